"""Fused CPU Sinkhorn-Knopp for mHC (numba), `hyper.sinkhorn`'s kernels. Optional: the `fast` extra.

Per token, an n x n matrix goes through exp and `iters` alternating column/row normalizations in
registers, one parallel pass over tokens; every iterate is kept so that the backward pass is the
exact gradient of the unrolled iterations (the same function autograd differentiates in
`hyper.sinkhorn_knopp`). Eager PyTorch runs ~4 small kernels per iteration and as many in backward,
which dominated mHC's coefficient cost on CPU.
"""

from __future__ import annotations

import numpy as np

from .jit import LazyKernels, serial_only
from .jit import launch as _launch


def available() -> bool:
    """True when numba imports (and ENGRAM_FUSED is not 0) and parallel kernels may run here (not after
    `jit.leave_threads_to_host`: the torch path then); compiles the kernels on first call."""
    return not serial_only() and _kernels.get() is not None


def _build():
    from numba import njit, prange

    @njit(parallel=True, cache=True, boundscheck=False)
    def fwd(logits, its, out):  # pragma: no cover - compiled
        # logits (N, n, n) -> its (N, 2*iters+1, n, n): exp, then after each column / row normalization
        N, n = logits.shape[0], logits.shape[1]
        K = its.shape[1]
        for t in prange(N):
            mx = logits[t, 0, 0]
            for i in range(n):
                for j in range(n):
                    mx = max(mx, logits[t, i, j])
            for i in range(n):
                for j in range(n):
                    its[t, 0, i, j] = np.exp(logits[t, i, j] - mx)
            for k in range(1, K, 2):
                for j in range(n):  # columns: divide by the sum over rows
                    s = np.float32(0.0)
                    for i in range(n):
                        s += its[t, k - 1, i, j]
                    for i in range(n):
                        its[t, k, i, j] = its[t, k - 1, i, j] / s
                for i in range(n):  # rows: divide by the sum over columns
                    s = np.float32(0.0)
                    for j in range(n):
                        s += its[t, k, i, j]
                    for j in range(n):
                        its[t, k + 1, i, j] = its[t, k, i, j] / s
            for i in range(n):
                for j in range(n):
                    out[t, i, j] = its[t, K - 1, i, j]

    @njit(cache=True, boundscheck=False, inline="always")
    def _normalize_back(g, x, y):  # pragma: no cover - compiled
        # backward of y = x / rowsum(x), in place on g (n, n): dX_ij = (G_ij - sum_j' G_ij' Y_ij') / s_i
        n = g.shape[0]
        for i in range(n):
            s = np.float32(0.0)
            for j in range(n):
                s += x[i, j]
            dot = np.float32(0.0)
            for j in range(n):
                dot += g[i, j] * y[i, j]
            for j in range(n):
                g[i, j] = (g[i, j] - dot) / s

    @njit(parallel=True, cache=True, boundscheck=False)
    def bwd(its, grad, gin):  # pragma: no cover - compiled
        # grad (N, n, n) w.r.t. the output -> gin (N, n, n) w.r.t. the logits (the max shift is constant:
        # the output does not depend on it)
        N, K, n = its.shape[0], its.shape[1], its.shape[2]
        for t in prange(N):
            g = np.empty((n, n), dtype=np.float32)
            for i in range(n):
                for j in range(n):
                    g[i, j] = grad[t, i, j]
            for k in range(K - 1, 0, -2):
                # row step its[k] = its[k-1] / rowsum, then column step its[k-1] = its[k-2] / colsum: the same
                # step on the transposes
                _normalize_back(g, its[t, k - 1], its[t, k])
                _normalize_back(g.T, its[t, k - 2].T, its[t, k - 1].T)
            for i in range(n):
                for j in range(n):
                    gin[t, i, j] = g[i, j] * its[t, 0, i, j]  # d exp(x) = exp(x) dx
    return fwd, bwd


_kernels = LazyKernels(_build, switchable=True)


def forward(logits: np.ndarray, iters: int):
    N, n, _ = logits.shape
    its = np.empty((N, 2 * iters + 1, n, n), dtype=np.float32)
    out = np.empty((N, n, n), dtype=np.float32)
    with _launch():
        _kernels.get()[0](logits, its, out)
    return out, its


def backward(its: np.ndarray, grad: np.ndarray) -> np.ndarray:
    gin = np.empty(grad.shape, dtype=np.float32)
    with _launch():
        _kernels.get()[1](its, grad, gin)
    return gin
