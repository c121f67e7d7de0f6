"""Fused CPU kernels for a serving step's Engram math at n single positions (numba; the `fast` extra).

Used by `step.py` and `state.py` only (the hash's split-modulo arithmetic is `hashing.kernels`').

A vLLM step asks each Engram layer for a few positions (one per request while decoding). After the table gather,
eager PyTorch spends about 45 small ops on them (the value / key projection; the gate's two RMS norms, dot product
and signed square root; the gated value; the short conv's K taps, each RMS-normed, weighted and summed; SiLU), each
a dispatch of a few microseconds on a CPU, and inside vLLM's forward each costs more than in a loop of its own
(cold caches): most of Engram's cost there (`benchmarks/profile_vllm.py`, docs/performance.md). `layer(eng)` gives
an Engram layer's fused step, the math of `Engram.gated_value` steps 2-3 and `Engram.mix_at_taps` per position:

    .project(e)                         (n, E) -> kv (n, (Gk+1)*D): the value / key projection, one GEMM
    .delta(kv, x, view, store)          one kernel call: the gates, v = gate * value, this step's [value | gate]
                                        rows written at their slots, the conv over the K taps read back; then
                                        the SiLU and the residual add: (n, G, D) delta

It keeps what the kernels read in their own layouts, made once per layer (and again when a weight changes): the
projection's weight transposed, which a CPU GEMM multiplies faster at a few rows (measured on one thread of the
2-core VM at 1-1024 rows of 256 -> 512), the gate's two norm weights multiplied, and the conv's weight tap-major
with its norm weight folded in, in float64.

Rounding: the kernel accumulates in float64 (summation order left to the compiler) and rounds once to float32,
where torch sums in float32 in its own order; the SiLU is torch's, on that float32. Results differ from the torch
path by float32 rounding (tests hold them within 1e-6 + 1e-6 relative of `Engram.forward`). ENGRAM_FUSED=0 takes the
torch path, which computes what `Engram.forward` computes op for op. float32 CPU tensors and the gated design only;
others take the torch path.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

from ...hashing.kernels import reduce_mix, split_mix
from ...jit import LazyKernels
from ...jit import launch as _launch

# ------------------------------------------------------------------------------ the slot store's index math and hash
# (`state.py`: where each token of a step and its history live, and its hash; exact integers, equal to
# the numpy / `hash` path. Without numba, or with ENGRAM_FUSED=0, each returns None and the caller takes that path.)

def place(qsl: np.ndarray, slots: np.ndarray, block_table: np.ndarray, block_size: int
          ) -> tuple[np.ndarray, int, int] | None:
    """(req (n,): each token's request row in `block_table`, from the request starts `qsl` (R+1,); need: one past the
    largest slot a position of the step can read; the smallest slot of the step's tokens `slots` (n,))."""
    kernels = _kernels.get()
    if kernels is None:
        return None
    req = np.empty(len(slots), dtype=np.int64)
    with _launch():
        need, low = kernels[2](qsl, slots, block_table, block_size, req)
    return req, need, low


def locate(pos: np.ndarray, req: np.ndarray, block_table: np.ndarray, block_size: int, back: tuple[int, ...]
           ) -> tuple[np.ndarray, np.ndarray] | None:
    """(slots (n, k), valid (n, k)) of the positions `back[j]` before each token (`state.StepView.at`)."""
    kernels = _kernels.get()
    if kernels is None:
        return None
    slots, valid = np.empty((len(pos), len(back)), dtype=np.int64), np.empty((len(pos), len(back)), dtype=np.bool_)
    with _launch():
        kernels[1](pos, req, block_table, block_size, np.asarray(back, dtype=np.int64), slots, valid)
    return slots, valid


def hash_step(store: np.ndarray, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, req: np.ndarray,
              block_table: np.ndarray, block_size: int, plan) -> np.ndarray | None:
    """Write the step's `ids` at their `slots` of the id `store`, then hash each token after the N-1 ids before it
    (`state.SlotState.hash`): (L, n, O*H) rows of the family's index dtype, offsets as `plan` (`NgramHashMapping.
    kernel_plan`) has them; None without numba. An id outside the tokenizer raises `plan.validate`'s error."""
    kernels = _kernels.get()
    if kernels is None:
        return None
    out = np.empty((len(plan.layer_ids), len(ids), plan.heads), dtype=plan.dtype)
    with _launch():
        bad = kernels[3](store, ids, pos, slots, req, block_table, block_size, plan.lut, plan.pad, plan.vocab,
                         plan.mult, *plan.consts, plan.offsets, out)
    if bad >= 0:
        plan.validate(ids[None])  # (raises, naming the id)
    return out


# ---------------------------------------------------------------------------------------- an Engram layer's step
def usable(eng, x: torch.Tensor) -> bool:
    """True when the kernels compile here (numba, ENGRAM_FUSED not 0), `x` is a float32 CPU tensor and Engram layer
    `eng` has its gate (the no-gate ablation takes the torch path)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and eng.use_gate and _kernels.get() is not None


def slot_of(block_table, r, p, block_size):  # pragma: no cover - compiled inline into the kernels below
    """The KV slot of position p of request row r (vLLM's paged layout)."""
    return block_table[r, p // block_size] * block_size + p % block_size


# `hashing.kernels.split_mix` / `reduce_mix` and `slot_of`, compiled (by `_build`; module globals, so numba caches
# the kernels that call them)
_split = _reduce = _slot = None


def _build():
    global _split, _reduce, _slot
    from numba import njit

    # float64 sums may be reordered (vectorized); no approximate functions
    fm = {"contract", "reassoc", "nsz"}
    _split, _reduce = njit(inline="always")(split_mix), njit(inline="always")(reduce_mix)
    _slot = njit(inline="always")(slot_of)

    # the hash's integers are exact in float64: no reassociation (as `hashing.kernels`)
    @njit(cache=True, boundscheck=False, fastmath={"contract", "nnan", "ninf", "nsz"})
    def hash_step(store, ids, pos, slots, req, block_table, block_size, lut, pad, vocab, mult, p, c32, c48, inv, off,
                  out):  # pragma: no cover - compiled
        # store (S,) int64: the raw id at each KV slot; ids, pos, slots, req (n,): the step's tokens. Writes
        # store[slots[i]] = ids[i] for every token first (a window may read an earlier token of the step), then
        # hashes each token after the N-1 ids before it, read from the store through the block table, as
        # `hashing.kernels`' kernel hashes a sequence: x = lut[id] (lut empty: the raw id), the pad before position 0,
        # mix_k = XOR_{j<=k} x_{t-j} * mult[l, j], head h of order k+1 the row of mix_k modulo p[l, k-1, h], plus
        # off[l, k-1, h] -> out (L, n, O*H). Returns the first token whose id is outside [0, vocab), or -1.
        n = ids.shape[0]
        L, N = mult.shape
        H = p.shape[2]
        raw = lut.shape[0] == 0
        for i in range(n):
            if ids[i] < 0 or ids[i] >= vocab:
                return i
            store[slots[i]] = ids[i]
        for i in range(n):
            x0 = ids[i] if raw else lut[ids[i]]
            for l in range(L):
                mix = x0 * mult[l, 0]
                for k in range(1, N):
                    q = pos[i] - k
                    if q < 0:
                        tok = pad
                    else:
                        tok = store[_slot(block_table, req[i], q, block_size)]
                        tok = tok if raw else lut[tok]
                    mix = mix ^ (tok * mult[l, k])  # wrapping int64, as numpy/torch
                    hi, mid, lo = _split(mix)
                    for h in range(H):
                        out[l, i, (k - 1) * H + h] = _reduce(hi, mid, lo, p[l, k - 1, h], c48[l, k - 1, h],
                                                             c32[l, k - 1, h], inv[l, k - 1, h]) + off[l, k - 1, h]
        return -1

    @njit(cache=True, boundscheck=False, fastmath=fm)
    def delta(kv, h, wkq, gate_eps, pos, req, block_table, block_size, taps, store, w, conv_eps, y, v
              ):  # pragma: no cover - compiled
        # kv (n, (Gk+1)*D): [value; key_0; ...]; h (n, Gk, D): the query; wkq (Gk, D) = w_k * w_q.
        # gate (n, G): sigmoid(signed sqrt(<key, h * wkq> * rstd(key) * rstd(h) / sqrt(D))), branch g reads key
        # g % Gk (Gk = 1: one gate for every branch) -> v (n, G, D) = gate * value.
        # With the conv (taps (K,) not empty: how far back each tap reads, the last 0): the token at position pos[i]
        # of request row req[i] keeps [value (D) | gate (G)] in row `slot` of store (S, D + G), its KV slot
        # `slot_of(block_table, req[i], p, block_size)`; written here for every token first (a
        # tap may read an earlier token of the step); w (G, K, D) float64: conv weight x norm weight -> y (n, G, D):
        # sum_k RMSNorm(v at pos - taps[k]) * w_k before the activation, a position before 0 a zero input.
        n, Gk, D = h.shape
        G, K = v.shape[1], taps.shape[0]
        gate = np.empty((n, G), dtype=np.float32)
        for i in range(n):
            for g in range(Gk):
                dot, kk, hh = 0.0, 0.0, 0.0
                for d in range(D):
                    k, q = np.float64(kv[i, (g + 1) * D + d]), np.float64(h[i, g, d])
                    dot += k * (q * wkq[g, d])
                    kk += k * k
                    hh += q * q
                r = dot / math.sqrt(kk / D + gate_eps) / math.sqrt(hh / D + gate_eps) / math.sqrt(D)
                s = math.sqrt(max(abs(r), 1e-6))
                r = s if r > 0 else (-s if r < 0 else 0.0)
                gate[i, g] = 1.0 / (1.0 + math.exp(-r))
            for g in range(Gk, G):
                gate[i, g] = gate[i, g % Gk]
            for g in range(G):
                for d in range(D):
                    v[i, g, d] = gate[i, g] * kv[i, d]
        if K == 0:
            return
        for i in range(n):
            p = pos[i]
            s = _slot(block_table, req[i], p, block_size)
            for d in range(D):
                store[s, d] = kv[i, d]
            for g in range(G):
                store[s, D + g] = gate[i, g]
        acc = np.empty(D, dtype=np.float64)
        for i in range(n):
            for g in range(G):
                for d in range(D):
                    acc[d] = 0.0
                for k in range(K):
                    p = pos[i] - taps[k]
                    if p < 0:  # before the sequence: a zero input
                        continue
                    s = _slot(block_table, req[i], p, block_size)
                    gk = np.float64(store[s, D + g])
                    ss = 0.0
                    for d in range(D):
                        x = np.float64(store[s, d])
                        ss += x * x
                    c = gk / math.sqrt(gk * gk * ss / D + conv_eps)  # gate x rstd of the tap's gated value
                    for d in range(D):
                        acc[d] += c * np.float64(store[s, d]) * w[g, k, d]
                for d in range(D):
                    y[i, g, d] = acc[d]

    @njit(cache=True, boundscheck=False)
    def locate(pos, req, block_table, block_size, back, slots, valid):  # pragma: no cover - compiled
        # pos, req (n,); block_table (R, B); back (k,) -> slots, valid (n, k): the KV slot of position
        # pos[i] - back[j] of request req[i], valid when that position is >= 0 (else position 0's slot: a placeholder)
        n, k = slots.shape
        for i in range(n):
            for j in range(k):
                p = pos[i] - back[j]
                valid[i, j] = p >= 0
                if p < 0:
                    p = 0
                slots[i, j] = _slot(block_table, req[i], p, block_size)

    @njit(cache=True, boundscheck=False)
    def place(qsl, slots, block_table, block_size, req):  # pragma: no cover - compiled
        # req[i]: the request whose tokens qsl[r] <= i < qsl[r+1] hold token i (the last row past qsl[-1])
        n, R = slots.shape[0], qsl.shape[0] - 1
        r, low, high = 0, 1 << 62, -1
        for i in range(n):
            while r + 1 < R and qsl[r + 1] <= i:
                r += 1
            req[i] = r
            low, high = min(low, slots[i]), max(high, slots[i])
        top = 0
        for a in range(block_table.shape[0]):
            for b in range(block_table.shape[1]):
                top = max(top, block_table[a, b])
        return max((top + 1) * block_size, high + 1), low

    return delta, locate, place, hash_step


_kernels = LazyKernels(_build, switchable=True)
_EPS = float(torch.finfo(torch.float32).eps)  # the gate's RMS norms' eps (`memory._rstd`)
# the kernel's conv arguments for a layer without the conv: positions (and taps), block table, stores, weight
_NO_CONV = (np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int64), np.zeros((0, 0), dtype=np.float32),
            np.zeros((0, 0, 0)))


class Layer:
    """One Engram layer's fused step (`layer(eng)`): its weights in the kernel's layouts, made once from the layer's
    parameters (`sources`, with the `_version` each had then)."""

    def __init__(self, eng, sources: tuple):
        self.sources, self.versions = sources, tuple(p._version for p in sources)
        self.G, self.D = eng.hc_mult, eng.hidden_size
        self.single_branch, self.conv = eng.single_branch, eng.use_short_conv
        with torch.no_grad():
            self.kv_t = eng.kv_proj.weight.detach().t().contiguous()  # (E, (Gk+1)*D)
            self.kv_bias = None if eng.kv_proj.bias is None else eng.kv_proj.bias.detach()  # ((Gk+1)*D,)
            self.wkq = (eng.key_norm_weight * eng.query_norm_weight).double().contiguous().numpy()  # (Gk, D)
            self.conv_w = _NO_CONV[3]  # (G, K, D) float64: conv weight (tap-major) x the conv's norm weight
            self.conv_eps, self.conv_act, self.taps = 0.0, False, _NO_CONV[0]
            if eng.use_short_conv:
                sc = eng.short_conv
                G, D, K = sc.hc_mult, sc.hidden_size, sc.kernel_size
                w = sc.conv.weight.double().view(G, D, K).permute(0, 2, 1)
                self.conv_w = (w * sc.norm_weight.double()[:, None, :]).contiguous().numpy()
                self.conv_eps, self.conv_act = float(sc.norm_eps), bool(sc.activation)
                self.taps = np.asarray(sc.taps, dtype=np.int64)  # (K,) how far back each tap reads

    @staticmethod
    def sources_of(eng) -> tuple:
        """The parameters a `Layer` is made from."""
        kv, sc = eng.kv_proj, eng.short_conv
        params = (kv.weight, kv.bias, eng.key_norm_weight, eng.query_norm_weight,
                  *((sc.conv.weight, sc.norm_weight) if eng.use_short_conv else ()))
        return tuple(p for p in params if p is not None)

    def current(self) -> bool:
        """False once a source parameter was written in place (vLLM reloading weights, a test setting them)."""
        return all(p._version == v for p, v in zip(self.sources, self.versions))

    def project(self, e: torch.Tensor) -> torch.Tensor:
        """e (n, E) -> kv (n, (Gk+1)*D): `kv_proj(e)` with the weight transposed."""
        return torch.mm(e, self.kv_t) if self.kv_bias is None else torch.addmm(self.kv_bias, e, self.kv_t)

    def delta(self, kv: torch.Tensor, x: torch.Tensor, view=None, store: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's delta (n, G, D) from kv (n, (Gk+1)*D) and hidden x (n, G, D), as `Engram.forward`: without
        the conv, v; with it, v + conv(v) over the K taps of each token (`view`: the step's `state.StepView`), read
        from `store` (S, D + G) after this step's [value | gate] rows are written at the tokens' slots."""
        n = kv.shape[0]
        h = x.mean(dim=1, keepdim=True) if self.single_branch else x  # (n, Gk, D)
        y, v = np.empty((n, self.G, self.D), dtype=np.float32), np.empty((n, self.G, self.D), dtype=np.float32)
        if self.conv:
            place = (view.pos, view.req, view.block_table, view.block_size, self.taps, store.numpy())
        else:
            place = (_NO_CONV[0], _NO_CONV[0], _NO_CONV[1], 1, _NO_CONV[0], _NO_CONV[2])
        with _launch():
            _kernels.get()[0](kv.detach().numpy(), h.detach().contiguous().numpy(), self.wkq, _EPS, *place,
                              self.conv_w, self.conv_eps, y, v)
        v = torch.from_numpy(v)
        if not self.conv:
            return v
        y = torch.from_numpy(y)
        return v.add_(torch.nn.functional.silu(y) if self.conv_act else y)


_layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layer(eng) -> Layer:
    """Engram layer `eng`'s `Layer`: made on first use, and again when one of its parameters was written in place
    (cheap to check, once per step and layer) or `refresh(eng)` was called (a parameter replaced by a new tensor:
    rare while serving, whose weights are loaded in place, and not checked per step)."""
    got = _layers.get(eng)
    if got is None or not got.current():
        got = _layers[eng] = Layer(eng, Layer.sources_of(eng))
    return got


def refresh(eng) -> None:
    """Forget `eng`'s `Layer` (after replacing one of its parameters by a new tensor)."""
    _layers.pop(eng, None)
