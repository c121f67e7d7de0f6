"""The module that stands in for transformers' `Qwen4ExpTextNGramEmbedding` (`ServedNGramEmbedding`): engram's
kernel hashes, an engram table holds the rows; `state_dict()` gives back transformers' layout."""

from __future__ import annotations

import torch
import torch.nn as nn

from ...config import ConfigError
from ...hashing import NgramHashMapping


class ServedNGramEmbedding(nn.Module):
    """Drop-in for transformers' `Qwen4ExpTextNGramEmbedding`: engram's kernel hashes, an engram table holds the rows.

    `forward(input_ids (B, T), cache) -> (B, T, H * d)`, the same values. The cache's id slot (conv state 2)
    is read and written exactly as transformers does, so its own decoding code and ours share a cache.
    The rows live behind `mhe` (a `MultiHeadEmbedding` with an installed `engram.tables` Table); the
    <= 127 padding rows of the checkpoint's table (never addressed) are kept aside so that `state_dict()`
    gives back `ngram_embedding.weight` in its original shape: a saved model loads in plain transformers.
    """

    @property
    def hash_mapping(self) -> NgramHashMapping:
        """The mapping that addresses its rows, under the name `Engram` layers give it (`editing.mapping_of`)."""
        return self.mapping

    def __init__(self, orig, mapping: NgramHashMapping, ple_layer_id: int, table, pad_rows: torch.Tensor):
        super().__init__()
        from ...memory import MultiHeadEmbedding
        from ...tables.base import install

        self.layer_idx, self.context_len, self.eos_token_id = orig.layer_idx, orig.context_len, orig.eos_token_id
        self.mapping, self.ple_layer_id = mapping, ple_layer_id
        self.mhe = MultiHeadEmbedding(mapping.head_sizes(ple_layer_id), table.dim, dtype=table.dtype,
                                      layer_id=ple_layer_id)
        self.mhe.embedding.weight.requires_grad_(False)
        install(self.mhe, table)
        self.mhe.train(False)
        self.pad_rows = pad_rows  # (padded - used, d): saved back, never looked up
        self.pending = None  # rows handed over by the prefetcher for this call (PendingRows), else hashed here
        self._register_state_dict_hook(_state_dict_as_transformers)  # (loading goes through transformers)

    def forward(self, input_ids: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
        cache = kwargs.get("past_key_values", cache)
        input_ids = input_ids.long()
        history = cache.get_conv_state(self.layer_idx, state_idx=2) if cache is not None else None
        if history is not None:
            history = history.clone()
        if cache is not None:  # keep the last N-1 ids where transformers keeps them (EOS-padded on a short first call)
            ids = input_ids
            if history is None and ids.shape[1] < self.context_len:
                ids = torch.nn.functional.pad(ids, (self.context_len - ids.shape[1], 0), value=self.eos_token_id)
            cache.update_conv_state(ids, self.layer_idx, state_idx=2, conv_kernel_size=self.context_len)
        pending, self.pending = self.pending, None
        if pending is not None:
            rows = pending.wait()  # (B, T, H, d), gathered on the prefetch thread
        else:
            h = self.mapping.hash_continuation(input_ids.cpu(), history.cpu() if history is not None else None,
                                               offsets=True)  # the table's rows (head offsets added by the kernel)
            rows = self.mhe.gather(h[self.ple_layer_id])  # (B, T, H, d)
        return rows.to(input_ids.device).flatten(-2)  # (B, T, H * d)


def _state_dict_as_transformers(module, sd, prefix, local_metadata):
    from ...tables.base import rows_by_reference_active
    from ...tables.overlay import overlays_of

    for k in [k for k in sd if k.startswith(prefix + "mhe.")]:
        del sd[k]
    if rows_by_reference_active():  # a weights digest: it samples the rows through the table instead
        return sd
    below = overlays_of(module.mhe)  # fact overlays (engram edit) stay out of the checkpoint: it keeps its own rows
    t = below[0].base if below else module.mhe.table
    if not hasattr(t, "weight"):
        raise ConfigError(f"layer {module.layer_idx}'s n-gram table is served from {t.stats().get('format')} rows, "
                          "which are not saved back as transformers weights; save the model before serve_tables")
    sd[prefix + "ngram_embedding.weight"] = torch.cat([t.weight, module.pad_rows.to(t.weight.dtype)])
    return sd


def _ple_layers(model):
    """(text model, [(decoder layer index, ple module)]) of a Qwen4Exp model: the layers with an n-gram table."""
    for path in ("model.language_model", "model", "language_model", ""):
        owner = model
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part, None)
        if isinstance(getattr(owner, "layers", None), nn.ModuleList):
            break
    else:
        raise ConfigError(f"{type(model).__name__}: no decoder layer list; serve_tables takes a Qwen4Exp model")
    out = [(i, layer.ple) for i, layer in enumerate(owner.layers) if getattr(layer, "ple", None) is not None]
    if not out:
        raise ConfigError(f"{type(model).__name__} has no n-gram table (no decoder layer has a PLE module)")
    return owner, out
