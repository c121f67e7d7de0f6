"""Fused CPU hashing kernel (numba). Optional: `pip install 'engram[fast]'`.

One parallel pass over tokens computes every layer's n-gram mixes and every head's row with
the exact float64 split-modulo of `hashing.py`; numba is imported on first use only, so
`import engram` stays light. Compiled kernels are cached on disk by numba (`cache=True`).
"""

from __future__ import annotations

import threading

import numpy as np

_kernel = None
_lock = threading.Lock()  # numba's default (workqueue) threading layer must not be entered concurrently
_checked = False


def available() -> bool:
    """True when numba imports; compiles the kernel on first call."""
    global _kernel, _checked
    if not _checked:
        _checked = True
        try:
            _kernel = _build()
        except Exception:  # numba missing or broken: the torch path takes over
            _kernel = None
    return _kernel is not None


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


def hash_into(x: np.ndarray, pad: int, mult: np.ndarray, primes: np.ndarray, out: np.ndarray) -> None:
    """Fill `out` (L, B, T, O*H) with per-head rows; primes (L, O, H) int64, all <= 2^21 here."""
    if primes.size and int(primes.max()) > (1 << 21):
        # beyond the exact float64 range of the fused kernel: reduce with int64 numpy (rare, huge heads)
        _hash_int64(x, pad, mult, primes, out)
        return
    p = primes.astype(np.float64)
    c = ((1 << 32) % primes).astype(np.float64)
    with _lock:
        _kernel(np.ascontiguousarray(x, dtype=np.int64), np.int64(pad), mult, p, c, 1.0 / p, out)


def _hash_int64(x, pad, mult, primes, out):
    L, O, H = primes.shape
    B, T = x.shape
    padded = np.pad(x, ((0, 0), (mult.shape[1] - 1, 0)), constant_values=pad)
    for l in range(L):
        mix = x * mult[l, 0]
        for k in range(1, mult.shape[1]):
            mix = mix ^ (padded[:, mult.shape[1] - 1 - k: mult.shape[1] - 1 - k + T] * mult[l, k])
            for h in range(H):
                out[l, :, :, (k - 1) * H + h] = mix % primes[l, k - 1, h]
