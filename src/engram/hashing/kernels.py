"""Fused CPU hashing kernel (numba), `NgramHashMapping`'s numba backend. Optional: the `fast` extra.

One parallel pass over tokens computes every layer's n-gram mixes and every head's row with
an exact float64 split-modulo (`mix = hi * 2^48 + mid * 2^32 + lo`, one floor-division per
head; see `hashing/engine.py`); numba is imported on first use only, so `import engram` stays light.
Compiled kernels are cached on disk by numba (`cache=True`).

Public (the vLLM step's kernel, `integrations.vllm._kernels`, compiles the same arithmetic into its own):
`split_mix`, `reduce_mix` (plain Python, compiled inline by each kernel), `MAX_PRIME`, `kernel_constants`,
`available`, `hash_into`.
"""

from __future__ import annotations

import numpy as np

from ..jit import LazyKernels, serial_only
from ..jit import launch as _launch


def split_mix(v):  # pragma: no cover - compiled inline into the kernels (here and in `integrations.vllm._kernels`)
    """An int64 mix as floats: v = hi * 2^48 + mid * 2^32 + lo, hi signed 16-bit, mid 16-bit, lo 32-bit."""
    return np.float64(v >> 48), np.float64((v >> 32) & 0xFFFF), np.float64(v & 0xFFFFFFFF)


def reduce_mix(hi, mid, lo, pv, a48, a32, iv):  # pragma: no cover - compiled inline, as `split_mix`
    """The mix `split_mix` split, modulo the head's prime pv (a48 = 2^48 mod pv, a32 = 2^32 mod pv, iv = 1/pv): an
    exact integer in [0, pv) as a float64."""
    # congruent to v mod p, an exact integer: |.| < 2^15 p + 2^16 p + 2^32 < 2^53
    w = hi * a48 + (mid * a32 + lo)
    r = w - np.floor(w * iv) * pv  # the floor may be off by one: corrected next
    return r + pv * (r < 0) - pv * (r >= pv)


# the two above, compiled (by `_build`; `integrations.vllm._kernels` compiles its own from the same source)
_split = _reduce = None


def available() -> bool:
    """True when numba imports; compiles the kernel on first call."""
    return _kernels.get() is not None


def _build():
    global _split, _reduce
    from numba import njit, prange

    _split, _reduce = njit(inline="always")(split_mix), njit(inline="always")(reduce_mix)

    # Every value below is an integer held exactly in float64, so fused multiply-adds give the same results;
    # no reassociation or reciprocal approximations (`reassoc`, `arcp`) are allowed.
    fm = {"contract", "nnan", "ninf", "nsz"}

    def make(flavor):  # flavor (0 parallel, 1 serial) is a closure cell: numba's disk cache keeps the two apart
        def kernel(x, pad, ends, mult, p, c32, c48, inv, off, out):  # pragma: no cover - compiled
            # x (B, T) ids; ends (B, T) bool: True where a document ends (n-grams after it do not reach back
            # across it: those positions read `pad`, as positions before the sequence do), or (0, 0): none;
            # mult (L, N) int64;
            # p, c32 = 2^32 mod p, c48 = 2^48 mod p, inv = 1/p, off (L, O, H) float64 (off: added to each
            # head's row); out (L, B, T, O*H). Work goes in chunks of one sequence's tokens; inside a chunk
            # every loop runs over tokens, so the arithmetic is SIMD, then a tile is transposed into `out`.
            B, T = x.shape
            L, N = mult.shape
            O, H = p.shape[1], p.shape[2]
            chunk = 128  # tokens: the tile (O*H x chunk float64) stays in L1
            masked = ends.shape[0] > 0
            per_row = (T + chunk - 1) // chunk
            for job in prange(B * per_row):
                b = job // per_row
                t0 = (job - b * per_row) * chunk
                n = min(T, t0 + chunk) - t0
                ints = np.empty((2, n), dtype=np.int64)  # (two allocations per job, not six: they add up)
                start, mix = ints[0], ints[1]
                floats = np.empty((3 + O * H, n))
                hi, mid, lo, tile = floats[0], floats[1], floats[2], floats[3:]
                # each token's document start, looking back at most N-1 (only t - k >= start for k < N matters):
                # found for the chunk's first token, then carried forward
                s = 0
                if masked:
                    s = t0
                    while s > 0 and t0 - s < N - 1 and not ends[b, s - 1]:
                        s -= 1
                for i in range(n):
                    t = t0 + i
                    if masked and i > 0 and ends[b, t - 1]:
                        s = t
                    start[i] = s
                for l in range(L):
                    for i in range(n):
                        mix[i] = x[b, t0 + i] * mult[l, 0]
                    for k in range(1, N):
                        m = mult[l, k]
                        for i in range(n):
                            t = t0 + i
                            tok = x[b, t - k] if t - k >= start[i] else pad
                            v = mix[i] ^ (tok * m)  # wrapping int64, as numpy/torch
                            mix[i] = v
                            hi[i], mid[i], lo[i] = _split(v)
                        for h in range(H):
                            pv, a48, a32 = p[l, k - 1, h], c48[l, k - 1, h], c32[l, k - 1, h]
                            iv, ov = inv[l, k - 1, h], off[l, k - 1, h]
                            row = tile[(k - 1) * H + h]
                            for i in range(n):
                                row[i] = _reduce(hi[i], mid[i], lo[i], pv, a48, a32, iv) + ov
                    for i in range(n):
                        for j in range(O * H):
                            out[l, b, t0 + i, j] = tile[j, i]
            if flavor < 0:  # never: makes `flavor` part of the compiled function (cache key)
                return
        return kernel

    # one compiled function each: many threads for batches, one for a few tokens (decoding), where waking
    # the thread pool costs more than the work
    return (njit(parallel=True, cache=True, boundscheck=False, fastmath=fm)(make(0)),
            njit(cache=True, boundscheck=False, fastmath=fm)(make(1)))


_kernels = LazyKernels(_build)
SERIAL_BELOW = 512  # tokens: smaller calls run on the calling thread
MAX_PRIME = 1 << 36  # above, hi * (2^48 mod p) + mid * (2^32 mod p) + lo may exceed 2^53 (no longer exact)


def kernel_constants(primes: np.ndarray) -> tuple[np.ndarray, ...]:
    """(p, 2^32 mod p, 2^48 mod p, 1/p) as float64 arrays (L, O, H), computed once per mapping."""
    p = primes.astype(np.float64)
    return p, ((1 << 32) % primes).astype(np.float64), ((1 << 48) % primes).astype(np.float64), 1.0 / p


_NO_ENDS = np.zeros((0, 0), dtype=np.bool_)


def hash_into(x: np.ndarray, pad: int, mult: np.ndarray, consts: tuple, out: np.ndarray,
              ends: np.ndarray | None = None, offsets: np.ndarray | None = None) -> None:
    """Fill `out` (L, B, T, O*H) (int64 or int32) with per-head rows; `consts` from `kernel_constants`
    (primes <= MAX_PRIME).

    `ends` (B, T) bool, C-contiguous: True where a document ends (the n-grams after it read `pad` from there back:
    an EOS reset, the positions before and at a DEAD one), or None.
    `offsets` (L, O, H) float64: added to each head's row (its place in the layer's concatenated table), or None.
    """
    p, c32, c48, inv = consts
    parallel, serial = _kernels.get()
    fn = serial if x.size < SERIAL_BELOW or serial_only() else parallel
    if offsets is None:
        offsets = np.zeros_like(p)
    with _launch():
        fn(np.ascontiguousarray(x, dtype=np.int64), np.int64(pad),
           _NO_ENDS if ends is None else ends, mult, p, c32, c48, inv,
           offsets, out)
