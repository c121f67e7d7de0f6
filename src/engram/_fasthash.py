"""Fused CPU hashing kernel (numba). Optional: `pip install 'engram[fast]'`.

One parallel pass over tokens computes every layer's n-gram mixes and every head's row with
the exact float64 split-modulo of `hashing.py`; numba is imported on first use only, so
`import engram` stays light. Compiled kernels are cached on disk by numba (`cache=True`).
"""

from __future__ import annotations

import numpy as np

from ._numba import LazyKernels, lock as _lock


def available() -> bool:
    """True when numba imports; compiles the kernel on first call."""
    return _kernels.get() is not None


def _build():
    from numba import njit, prange

    @njit(parallel=True, cache=True, boundscheck=False)
    def kernel(x, pad, mult, p, c, inv, out):  # pragma: no cover - compiled
        # x (B, T) compressed ids; mult (L, N) int64; p, c, inv (L, O, H) float64; out (L, B, T, O*H)
        B, T = x.shape
        L, N = mult.shape
        H = p.shape[2]
        for bt in prange(B * T):
            b = bt // T
            t = bt - b * T
            for l in range(L):
                mix = x[b, t] * mult[l, 0]
                for k in range(1, N):
                    tok = x[b, t - k] if t - k >= 0 else pad
                    mix = mix ^ (tok * mult[l, k])  # wrapping int64, as numpy/torch
                    hi = np.float64(mix >> 32)
                    lo = np.float64(mix & 0xFFFFFFFF)
                    for h in range(H):
                        pv = p[l, k - 1, h]
                        v = hi * c[l, k - 1, h] + lo  # exact integer < 2^53
                        q = np.floor(v * inv[l, k - 1, h])  # may be off by one: fixed below
                        r = v - q * pv
                        if r < 0:
                            r += pv
                        elif r >= pv:
                            r -= pv
                        out[l, b, t, (k - 1) * H + h] = np.int64(r)

    return kernel


_kernels = LazyKernels(_build)
MAX_PRIME = 1 << 21  # above this, hi * (2^32 mod p) + lo may exceed 2^53: the caller uses the torch path


def kernel_constants(primes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p, 2^32 mod p, 1/p) as float64 arrays (L, O, H), computed once per mapping."""
    p = primes.astype(np.float64)
    return p, ((1 << 32) % primes).astype(np.float64), 1.0 / p


def hash_into(x: np.ndarray, pad: int, mult: np.ndarray, consts: tuple, out: np.ndarray) -> None:
    """Fill `out` (L, B, T, O*H) with per-head rows; `consts` from `kernel_constants` (primes <= MAX_PRIME)."""
    p, c, inv = consts
    with _lock:
        _kernels.get()(np.ascontiguousarray(x, dtype=np.int64), np.int64(pad), mult, p, c, inv, out)
