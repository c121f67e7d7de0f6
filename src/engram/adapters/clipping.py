"""Clipping tables' sparse gradients: `torch.linalg.vector_norm` for sparse COO tensors, so `clip_grad_norm_`
(transformers.Trainer's, accelerate's, your own loop's) works on a model whose Engram tables have sparse gradients.

Here, in `adapters`, because `engram.attach` registers it (an attached model trains under any Trainer) and
`engram.hf_optimizers` (`training.hf`) does too: the training package, above the adapters, imports it from here.
"""

from __future__ import annotations

import torch

from ..tables.base import row_grads

_SPARSE_NORM_LIB = None  # the torch.library registration (kept alive: dropping it unregisters the kernel)


def _sparse_vector_norm(x: torch.Tensor, ord=2, dim=None, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    """`torch.linalg.vector_norm` of a sparse COO tensor: the norm of its dense equivalent.

    A table's row gradient `(num_rows, D)` holds one entry per lookup, repeated rows not yet summed;
    the norm is that of the summed rows (what the dense gradient would be): from the coalesced values
    for any order >= 0 over the whole tensor (implicit zeros add nothing), else through `to_dense()`.
    """
    if dim is None and not keepdim and ord >= 0:
        vals = x._values() if x.is_coalesced() else row_grads(x)[1]
        return torch.linalg.vector_norm(vals, ord, dtype=dtype if dtype is not None else x.dtype)
    return torch.linalg.vector_norm(x.to_dense(), ord, dim, keepdim, dtype=dtype)


def enable_sparse_grad_norm() -> None:
    """Give `torch.linalg.vector_norm` a kernel for sparse COO tensors (torch has none), so that
    `torch.nn.utils.clip_grad_norm_`, accelerate's and `transformers.Trainer`'s clipping work on a model whose
    Engram tables have sparse gradients, with the meaning they have for a dense model: the global norm is
    sqrt(sum of every dense gradient's squared entries + every table's summed looked-up rows' squared entries),
    and clipping scales the table rows by the same factor (`mul_` on a sparse gradient scales its values).

    Process-wide and idempotent; it only fills a missing kernel (without it the call raises), so nothing that
    worked before changes. Called by `engram.attach` and `engram.hf_optimizers`.
    """
    global _SPARSE_NORM_LIB
    if _SPARSE_NORM_LIB is not None:
        return
    has = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", lambda op, key: False)
    lib = torch.library.Library("aten", "IMPL")
    for key in ("SparseCPU", "SparseCUDA"):
        if not has("aten::linalg_vector_norm", key):  # a later torch may bring its own: keep that one
            lib.impl("linalg_vector_norm", _sparse_vector_norm, key)
    _SPARSE_NORM_LIB = lib
