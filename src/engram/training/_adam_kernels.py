"""Fused CPU lazy-Adam kernels of `optim.py` (numba). Optional: the `fast` extra.

One parallel pass over the touched rows updates weight and both moments in place, in float32,
with the same per-element formula as `optim.adam_rows_` (torch's `lerp_` for the first moment,
`mul_().addcmul_()` for the second, SparseAdam's step size). The torch version gathers three
row blocks, updates them and scatters them back; scattering random rows dominated its time.
numba is imported on first use only, and the compiled kernel is cached on disk.
"""

from __future__ import annotations

import numpy as np

from ..jit import LazyKernels
from ..jit import launch as _launch


def available() -> bool:
    """True when numba imports (and ENGRAM_FUSED is not 0); compiles the kernels on first call."""
    return _kernels.get() is not None


def _build():
    from numba import njit, prange

    @njit(parallel=True, cache=True, boundscheck=False)
    def kernel(w, m, v, rows, g, w1, b2, c2, step_size, eps):  # pragma: no cover - compiled
        # w, m, v (R_table, D) float32, updated in place at `rows` (K,) int64; g (K, D) float32
        D = w.shape[1]
        for i in prange(rows.shape[0]):
            r = rows[i]
            for d in range(D):
                gi = g[i, d]
                mo = m[r, d]
                mo = mo + w1 * (gi - mo)  # torch.lerp(m, g, w1), w1 = 1 - b1 < 0.5
                vo = v[r, d] * b2 + c2 * gi * gi  # v.mul_(b2).addcmul_(g, g, value=1 - b2)
                m[r, d] = mo
                v[r, d] = vo
                w[r, d] = w[r, d] - step_size * (mo / (np.sqrt(vo) + eps))

    @njit(parallel=True, cache=True, boundscheck=False)
    def sparse_kernel(w, m, v, srows, order, starts, vals, gsum, w1, b2, c2, step_size, eps):  # pragma: no cover
        # an uncoalesced row gradient: lookups sorted by row (stable), segment s = starts[s]:starts[s+1];
        # each segment's gradients are summed in lookup order into gsum[s] (as index_add_ does), then updated
        D = w.shape[1]
        for s in prange(starts.shape[0] - 1):
            a, b = starts[s], starts[s + 1]
            r = srows[a]
            o = order[a]
            for d in range(D):
                gsum[s, d] = vals[o, d]
            for j in range(a + 1, b):
                o = order[j]
                for d in range(D):
                    gsum[s, d] += vals[o, d]
            for d in range(D):
                gi = gsum[s, d]
                mo = m[r, d]
                mo = mo + w1 * (gi - mo)
                vo = v[r, d] * b2 + c2 * gi * gi
                m[r, d] = mo
                v[r, d] = vo
                w[r, d] = w[r, d] - step_size * (mo / (np.sqrt(vo) + eps))
    return kernel, sparse_kernel


_kernels = LazyKernels(_build, switchable=True)


def adam_rows(w, m, v, rows, g, b1: float, b2: float, step_size: float, eps: float) -> None:
    """In place on numpy float32 arrays: rows `rows` of w, m, v get one Adam update with gradients g."""
    f = np.float32
    with _launch():
        _kernels.get()[0](w, m, v, rows, g, f(1 - b1), f(b2), f(1 - b2), f(step_size), f(eps))


def sparse_adam_rows(w, m, v, rows, vals, b1: float, b2: float, step_size: float, eps: float, gsum=None) -> None:
    """Like `adam_rows`, from an uncoalesced gradient: `rows` (N,) int64 with repeats, `vals` (N, D) float32.

    Repeated rows are summed in lookup order first (a stable sort groups them), fused with the update.
    `gsum`: an optional reusable float32 scratch of at least (N, D).
    """
    import torch

    r = torch.from_numpy(rows)
    srows, order = torch.sort(r, stable=True)
    starts = torch.ones(r.numel() + 1, dtype=torch.bool)
    starts[1:-1] = srows[1:] != srows[:-1]
    starts = starts.nonzero().squeeze(1)
    if gsum is None or gsum.shape[0] < starts.numel() - 1:
        gsum = np.empty((starts.numel() - 1, vals.shape[1]), dtype=np.float32)
    f = np.float32
    with _launch():
        _kernels.get()[1](w, m, v, srows.numpy(), order.numpy(), starts.numpy(), vals, gsum, f(1 - b1), f(b2),
                          f(1 - b2), f(step_size), f(eps))
