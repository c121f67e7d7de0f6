"""Engram's decoding state inside a transformers KV cache: the last N-1 token ids and each layer's conv inputs."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache


class NgramHistory:
    """What Engram needs in a KV cache besides keys and values to decode token by token (a mixin for a
    transformers `Cache`): the last N-1 token ids (the next token's n-grams reach back into them) and,
    per Engram layer, the short conv's inputs at the last (K-1)*dilation positions (`engram_state`).

    Beam search and batch edits reorder both with the keys and values. `with_ngram_history(cache)`
    gives a plain `DynamicCache` (e.g. one `generate()` made) these fields in place. Steps decoded
    with Engram switched off (`engram_scale=0`) keep their ids but leave no conv inputs: a later
    step with Engram on reads the conv inputs of the last step that ran it.
    """

    ngram_history: torch.Tensor | None = None  # (B, <= N-1) int64

    def push_ngram_history(self, input_ids: torch.Tensor, keep: int) -> None:
        ctx = input_ids if self.ngram_history is None else torch.cat([self.ngram_history, input_ids], dim=1)
        self.ngram_history = ctx[:, -keep:] if keep > 0 else ctx[:, :0]

    def engram_state(self, layer_id: int) -> dict:
        """Engram layer `layer_id`'s incremental-decoding state (see `Engram.forward`)."""
        return self.__dict__.setdefault("_engram_states", {}).setdefault(int(layer_id), {})

    def _map_engram(self, fn) -> None:
        if self.ngram_history is not None:
            self.ngram_history = fn(self.ngram_history)
        for st in self.__dict__.get("_engram_states", {}).values():
            for k, t in st.items():
                st[k] = fn(t)

    def clear_engram(self) -> None:
        """Forget the id history and conv states (the keys and values are the caller's)."""
        self.ngram_history = None
        self.__dict__.pop("_engram_states", None)

    def reset(self):
        super().reset()
        self.clear_engram()

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._map_engram(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._map_engram(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self._map_engram(lambda t: t[indices])


class EngramCache(NgramHistory, DynamicCache):
    """The KV cache plus Engram's decoding state (`NgramHistory`).

    `generate()` creates one; pass one yourself (`past_key_values=EngramCache()`) for manual decoding.
    """


_HISTORY_CLASSES: dict[type, type] = {}


def with_ngram_history(cache):
    """Give a transformers cache Engram's decoding state in place (its class gains `NgramHistory`); returns it."""
    if isinstance(cache, NgramHistory):
        return cache
    cls = type(cache)
    if cls not in _HISTORY_CLASSES:
        _HISTORY_CLASSES[cls] = type(f"Engram{cls.__name__}", (NgramHistory, cls), {"__module__": __name__})
    cache.__class__ = _HISTORY_CLASSES[cls]
    return cache
