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

    def make(flavor):  # flavor (0 parallel, 1 serial) is a closure cell: numba's disk cache keeps the two apart
        def kernel(x, pad, reset, big, mult, p, c, inv, out):  # pragma: no cover - compiled
            # x (B, T) ids; reset: the id that ends a document (n-grams do not reach back across it: those
            # positions read `pad`, as positions before the sequence do), -1 for none; mult (L, N) int64;
            # p, c, inv (L, O, H) float64; big: some p > 2^21, so hi is reduced mod p first; out (L, B, T, O*H)
            B, T = x.shape
            L, N = mult.shape
            H = p.shape[2]
            for bt in prange(B * T):
                b = bt // T
                t = bt - b * T
                start = 0  # t's document starts here (looking back at most N-1 positions)
                if reset >= 0:
                    start = t
                    while start > 0 and t - start < N - 1 and x[b, start - 1] != reset:
                        start -= 1
                for l in range(L):
                    mix = x[b, t] * mult[l, 0]
                    for k in range(1, N):
                        tok = x[b, t - k] if t - k >= start else pad
                        mix = mix ^ (tok * mult[l, k])  # wrapping int64, as numpy/torch
                        hi = np.float64(mix >> 32)
                        lo = np.float64(mix & 0xFFFFFFFF)
                        for h in range(H):
                            pv = p[l, k - 1, h]
                            hr = hi
                            if big:  # hi mod p first (|hi| < 2^31): then hr * c + lo < 2^52 + 2^32 for p <= 2^26
                                hr = hi - np.floor(hi * inv[l, k - 1, h]) * pv
                                if hr < 0:
                                    hr += pv
                                elif hr >= pv:
                                    hr -= pv
                            v = hr * c[l, k - 1, h] + lo  # exact integer < 2^53
                            q = np.floor(v * inv[l, k - 1, h])  # may be off by one: fixed below
                            r = v - q * pv
                            if r < 0:
                                r += pv
                            elif r >= pv:
                                r -= pv
                            out[l, b, t, (k - 1) * H + h] = np.int64(r)
            if flavor < 0:  # never: makes `flavor` part of the compiled function (cache key)
                return
        return kernel

    # one compiled function each: many threads for batches, one for a few tokens (decoding), where waking
    # the thread pool costs more than the work
    return (njit(parallel=True, cache=True, boundscheck=False)(make(0)),
            njit(cache=True, boundscheck=False)(make(1)))


_kernels = LazyKernels(_build)
SERIAL_BELOW = 512  # tokens: smaller calls run on the calling thread
MAX_PRIME = 1 << 26  # above 2^21 hi is reduced mod p first; above 2^26 the reduced product may exceed 2^53


def kernel_constants(primes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p, 2^32 mod p, 1/p) as float64 arrays (L, O, H), computed once per mapping."""
    p = primes.astype(np.float64)
    return p, ((1 << 32) % primes).astype(np.float64), 1.0 / p


def hash_into(x: np.ndarray, pad: int, mult: np.ndarray, consts: tuple, out: np.ndarray,
              reset: int | None = None) -> None:
    """Fill `out` (L, B, T, O*H) with per-head rows; `consts` from `kernel_constants` (primes <= MAX_PRIME).

    `reset`: the id that ends a document (the n-grams of the next token do not reach back across it), or None.
    """
    p, c, inv = consts
    big = bool(p.max() > (1 << 21))
    parallel, serial = _kernels.get()
    fn = serial if x.size < SERIAL_BELOW else parallel
    with _lock:
        fn(np.ascontiguousarray(x, dtype=np.int64), np.int64(pad), np.int64(-1 if reset is None else reset), big, mult,
           p, c, inv, out)
