"""What the engine accepts: token ids (`validate_ids`) and DEAD masks (`dead_mask`), each refused with a
one-line `HashInputError` that names the first problem and the fix."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import EngramError


class HashInputError(EngramError, ValueError):
    """Input ids have the wrong type, shape or values; the message names the first problem."""


def _first_bad(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def validate_ids(input_ids, raw_vocab_size: int, tokenizer) -> None:
    """Raise `HashInputError` unless `input_ids` is a 2-D integer array or tensor of ids in [0, raw_vocab_size)
    (`tokenizer`, the family's compression, is named in the message)."""
    if isinstance(input_ids, torch.Tensor):
        dt = input_ids.dtype
        dtype_ok = not (dt.is_floating_point or dt.is_complex or dt == torch.bool)
    elif isinstance(input_ids, np.ndarray):
        dtype_ok = np.issubdtype(input_ids.dtype, np.integer)
    else:
        raise HashInputError(
            f"input_ids must be a numpy array or torch tensor of shape [B, T], got {type(input_ids).__name__}; "
            "wrap lists with np.array(...)"
        )
    if not dtype_ok:
        raise HashInputError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; cast with .long() / "
                             ".astype(np.int64)")
    if input_ids.ndim != 2:
        raise HashInputError(
            f"input_ids must be 2-D [batch, seq_len], got {input_ids.ndim}-D shape {tuple(input_ids.shape)}; "
            "add a batch dimension with x[None] / x.unsqueeze(0)"
        )
    if input_ids.numel() if isinstance(input_ids, torch.Tensor) else input_ids.size:
        if isinstance(input_ids, torch.Tensor):
            lo, hi = (int(v) for v in torch.aminmax(input_ids))  # one pass
        else:
            lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= raw_vocab_size:
            arr = input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
            pos = _first_bad((arr < 0) | (arr >= raw_vocab_size))
            raise HashInputError(
                f"token id {int(arr[pos])} at position {pos} is outside [0, {raw_vocab_size}) for this "
                f"tokenizer ({getattr(tokenizer.tokenizer_file, 'name', 'in memory')}); "
                + ("negative ids are not allowed: pad with the pad id instead" if arr[pos] < 0
                   else "was the text tokenized with a different tokenizer?")
            )


def dead_mask(dead, shape, what: str = "dead") -> np.ndarray | None:
    """A DEAD mask (bool tensor or array, True at DEAD positions) as a numpy bool array of `shape` (B, T), or
    None (no mask, or no DEAD position)."""
    if dead is None:
        return None
    d = dead.detach().cpu().numpy() if isinstance(dead, torch.Tensor) else np.asarray(dead)
    if d.dtype != np.bool_ or tuple(d.shape) != tuple(shape):
        raise HashInputError(f"{what} must be a bool tensor of shape {list(shape)} (True at DEAD positions), got "
                             f"{d.dtype} {list(d.shape)}")
    return d if d.any() else None
