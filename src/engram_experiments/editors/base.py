"""What every editor shares: the `Edit` handle (what changed, how long it took, how to undo it), token ids of a text,
and where a decoder layer and its MLP's output projection are in a `transformers` causal LM."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engram.adapters import find_layers
from engram.editing import EditError


@dataclass
class Edit:
    """An edit applied to a model in place. `method`: the editor's name; `facts`: how many facts it holds;
    `seconds`: wall time of the edit; `changed_params`: how many weight entries it changed (0 for a codebook or an
    overlay); `extra_bytes`: what it added beside the weights (a codebook, an overlay); `info`: the editor's own
    settings and diagnostics. `undo()` restores the model exactly (once)."""

    method: str
    facts: int
    seconds: float
    changed_params: int = 0
    extra_bytes: int = 0
    info: dict = field(default_factory=dict)
    _undo: Callable[[], None] | None = None

    def undo(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None


class Timer:
    """`with Timer() as t: ...; t.seconds`."""

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        return False


def snapshot(params: list[torch.nn.Parameter]) -> Callable[[], None]:
    """An undo for in-place changes to `params`: copies now, restores the copies when called."""
    saved = [p.detach().clone() for p in params]

    def restore() -> None:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)

    return restore


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens, from a `tokenizers.Tokenizer` or a transformers tokenizer."""
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(out.ids) if hasattr(out, "ids") else list(out)


_MLP_NAMES = ("mlp", "feed_forward", "ffn")
_OUT_NAMES = ("down_proj", "c_proj", "fc2", "dense_4h_to_h", "w2", "fc_out")


def decoder_layer(model, layer: int) -> torch.nn.Module:
    """The `layer`-th decoder layer of a transformers causal LM (`engram.adapters.find_layers`); a one-line
    `EditError` for a model without a decoder-layer list or a layer out of range."""
    try:
        _, layers = find_layers(model)
    except ValueError as e:
        raise EditError(f"unsupported architecture {type(model).__name__}: {str(e).splitlines()[0]}") from None
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(layers):
        raise EditError(f"layer {layer!r} is out of range: the model has {len(layers)} decoder layers "
                        f"(0..{len(layers) - 1})")
    return layers[layer]


def mlp_out(model, layer: int) -> tuple[str, torch.nn.Module]:
    """(dotted name, module) of the output projection of decoder layer `layer`'s MLP (Llama/Qwen `mlp.down_proj`,
    an `nn.Linear`, weight (d_out, d_in); GPT-2 `mlp.c_proj`, a `Conv1D`, weight (d_in, d_out)): its input is the
    MLP's key k (d_in), its weights what ROME, MEMIT and FT-L change and LoRA wraps by default."""
    block = decoder_layer(model, layer)
    path, _ = find_layers(model)
    for m in _MLP_NAMES:
        mlp = getattr(block, m, None)
        for o in _OUT_NAMES:
            mod = getattr(mlp, o, None) if mlp is not None else None
            if mod is not None and isinstance(getattr(mod, "weight", None), torch.Tensor):
                return f"{path}.{layer}.{m}.{o}", mod
    raise EditError(f"layer {layer} ({type(block).__name__}) has no dense MLP output projection (looked for "
                    f"{'/'.join(_MLP_NAMES)}.{'/'.join(_OUT_NAMES)}); a mixture-of-experts layer is not supported")
