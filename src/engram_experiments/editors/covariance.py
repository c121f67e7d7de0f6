"""Second moments of an MLP's keys, the statistics ROME and MEMIT weigh their updates with.

An MLP reads `k = act(W_in h)` (Llama/Qwen: `act(gate(h)) * up(h)`) and writes `v = W_out k`: ROME and MEMIT
treat `W_out` (`down_proj`, GPT-2's `c_proj`) as a linear associative memory from keys `k` to values `v`, and
change it so that a new key maps to a new value while the keys the model already sees keep their values as well as
possible. "As well as possible" is measured by the keys' uncentred second moment `C = E[k k^T]` over ordinary text
(Meng et al. 2022, eq. 2; 2023, eq. 9), estimated here with a forward pre-hook on the output projection over text
windows, accumulated in float64, and cached to a file keyed by the model's weight digest, the layer, the number of
keys and the windows' token digest.

Also here: the weight arithmetic of an output projection in either storage order (`weight_out_in`, `add_to_weight`)
and `ensure_eval`. Where a layer's projection is: `base.mlp_out`.

    windows = engram.training.data.text_windows(tok, None, "train", 256, 400)   # (W, T) Shakespeare ids
    covs = key_covariances(model, [3, 4, 5], windows, cache_dir="runs/cov")      # {layer: (d_in, d_in) float64}
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from engram.editing import EditError, model_digest
from engram.persist import atomic_write_bytes

from .base import encode, mlp_out


def is_conv1d(module: torch.nn.Module) -> bool:
    """Whether `module` is GPT-2's `Conv1D`, whose weight is stored (d_in, d_out), transposed from `nn.Linear`."""
    return type(module).__name__ == "Conv1D"


def weight_out_in(module: torch.nn.Module) -> torch.Tensor:
    """The projection's weight as a (d_out, d_in) view, whichever way the module stores it."""
    return module.weight.t() if is_conv1d(module) else module.weight


def add_to_weight(module: torch.nn.Module, delta: torch.Tensor) -> None:
    """`W += delta` for a (d_out, d_in) `delta` (any float dtype), summed in float64 and rounded once to the
    weight's dtype, whichever way the module stores its weight."""
    w = weight_out_in(module)
    with torch.no_grad():
        w.copy_((w.double() + delta.to(device=w.device, dtype=torch.float64)).to(w.dtype))


@contextlib.contextmanager
def ensure_eval(model) -> Iterator[None]:
    """The model in eval mode (no dropout) inside the block, its previous mode restored after."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


class _Stop(Exception):
    """Raised by the last hook that needs the forward pass, to skip the layers above it."""


def _as_windows(windows, tokenizer, seq_len: int) -> list[list[int]]:
    """Token-id windows from strings (tokenized, truncated to `seq_len`), a (W, T) array/tensor or lists of ids."""
    if isinstance(windows, (np.ndarray, torch.Tensor)):
        return [list(map(int, w)) for w in windows.tolist()]
    out = []
    for w in windows:
        if isinstance(w, str):
            if tokenizer is None:
                raise EditError("text windows given as strings need a tokenizer (tokenizer=...)")
            ids = encode(tokenizer, w)[:seq_len]
        else:
            ids = [int(i) for i in w]
        if ids:
            out.append(ids)
    if not out:
        raise EditError("no text to estimate key statistics from: every window is empty")
    return out


def _windows_digest(windows: list[list[int]]) -> str:
    h = hashlib.sha256()
    for w in windows:
        h.update(np.asarray(w, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def cache_path(cache_dir, digest: str, layer: int, count: int, data_digest: str) -> Path:
    """Where the second moment of `layer`'s keys is cached: `DIR/keycov-MODEL16-DATA12-L{layer}-n{count}.safetensors`
    (model digest, windows' token digest, layer, number of keys)."""
    return Path(cache_dir) / f"keycov-{digest[:16]}-{data_digest[:12]}-L{layer}-n{count}.safetensors"


def key_covariances(model, layers: Sequence[int], windows, *, tokenizer=None, seq_len: int = 256,
                    batch_size: int = 8, cache_dir=None, progress: bool = True) -> dict[int, torch.Tensor]:
    """{layer: C} with C = E[k k^T] (d_in, d_in), float64 on the CPU, the uncentred second moment of the keys `k`
    entering `layer`'s MLP output projection, averaged over every token of `windows`.

    `windows`: a (W, T) array/tensor of token ids, a list of id lists, or a list of strings (then `tokenizer` is
    needed; each is truncated to `seq_len` tokens). Windows of different lengths are right-padded and the padding
    masked out. One forward pass per batch for all `layers`, stopped after the highest one. With `cache_dir`, each
    layer's C is read from / written to `cache_path(...)` (safetensors, written atomically), so a second call with
    the same weights and text costs only the model digest. `progress`: a tqdm bar over batches."""
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save
    from tqdm.auto import tqdm

    layers = sorted(set(int(i) for i in layers))
    mods = {i: mlp_out(model, i)[1] for i in layers}
    ids = _as_windows(windows, tokenizer, seq_len)
    count = sum(len(w) for w in ids)
    out: dict[int, torch.Tensor] = {}
    paths: dict[int, Path] = {}
    if cache_dir is not None:
        digest, data = model_digest(model), _windows_digest(ids)
        for i in layers:
            paths[i] = cache_path(cache_dir, digest, i, count, data)
            if paths[i].is_file():
                out[i] = st_load(paths[i].read_bytes())["second_moment"]
    todo = [i for i in layers if i not in out]
    if not todo:
        return out
    d = {i: mods[i].weight.shape[0 if is_conv1d(mods[i]) else 1] for i in todo}
    acc = {i: torch.zeros(d[i], d[i], dtype=torch.float64) for i in todo}
    device = next(model.parameters()).device
    mask_now: list[torch.Tensor] = []

    def hook_for(i):
        def hook(_mod, args):
            k = args[0].detach()[mask_now[0]].to(torch.float64)  # (n, d_in), real tokens only
            acc[i].add_((k.T @ k).cpu())
            if i == todo[-1]:
                raise _Stop
        return hook

    handles = [mods[i].register_forward_pre_hook(hook_for(i)) for i in todo]
    try:
        with ensure_eval(model), torch.no_grad():
            for s in tqdm(range(0, len(ids), batch_size), desc=f"key statistics, layers {todo}", disable=not progress,
                          leave=False):
                batch = ids[s:s + batch_size]
                T = max(len(w) for w in batch)
                x = torch.zeros(len(batch), T, dtype=torch.long)
                m = torch.zeros(len(batch), T, dtype=torch.bool)
                for r, w in enumerate(batch):
                    x[r, :len(w)] = torch.tensor(w)
                    m[r, :len(w)] = True
                mask_now[:] = [m.to(device)]
                with contextlib.suppress(_Stop):
                    model(input_ids=x.to(device), attention_mask=m.long().to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    for i in todo:
        out[i] = acc[i] / count
        if i in paths:
            meta = {"layer": str(i), "count": str(count), "model_digest": digest, "data_digest": data}
            atomic_write_bytes(paths[i], st_save({"second_moment": out[i].contiguous()}, metadata=meta))
    return out


def key_covariance(model, layer: int, windows, **kw) -> torch.Tensor:
    """C = E[k k^T] (d_in, d_in) of one layer's keys: `key_covariances(model, [layer], windows, **kw)[layer]`."""
    return key_covariances(model, [layer], windows, **kw)[layer]
