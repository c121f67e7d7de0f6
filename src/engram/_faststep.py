"""Fused CPU kernels for a serving step's Engram math at n single positions (numba; `pip install 'engram-torch[fast]'`).

A vLLM step asks each Engram layer for a few positions (one per request while decoding). After the value/key
projection, eager PyTorch spends about 45 small ops on them (the gate's two RMS norms, dot product and signed
square root; the gated value; the short conv's K taps, each RMS-normed, weighted and summed; SiLU), each a dispatch
of a few microseconds on a CPU: most of Engram's cost inside vLLM (`benchmarks/bench_vllm.py`, docs/performance.md).
Two kernels do the same math per position, one call each:

    gate(kv, h, wkq, out)                          `Engram.gated_value` step 3: (n, Gk) gates
    conv(value, gate, slots, valid, vs, gs, ...)   write this step's (value, gate) at their slots, then
                                                   `Engram.mix_at_taps` on the K taps read back: (n, G, D) delta

Rounding: the sums accumulate in float64 and round once, where torch sums in float32 in its own order, so results
differ from the torch path by float32 rounding (tests hold them within 1e-5). ENGRAM_FUSED=0 takes the torch path,
which computes what `Engram.forward` computes op for op. float32 CPU tensors only; others take the torch path.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._numba import LazyKernels
from ._numba import launch as _launch


def usable(x: torch.Tensor) -> bool:
    """True when the kernels compile here (numba, ENGRAM_FUSED not 0) and `x` is a float32 CPU tensor."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and _kernels.get() is not None


def _build():
    from numba import njit

    @njit(cache=True, boundscheck=False)
    def gate(kv, h, wkq, eps, out):  # pragma: no cover - compiled
        # kv (n, (Gk+1)*D): [value; key_0; ...]; h (n, Gk, D) the query; wkq (Gk, D) = w_k * w_q -> out (n, Gk):
        # sigmoid(signed sqrt(<key, h * wkq> * rstd(key) * rstd(h) / sqrt(D)))
        n, Gk, D = h.shape
        for i in range(n):
            for g in range(Gk):
                dot, kk, hh = 0.0, 0.0, 0.0
                for d in range(D):
                    k, q = kv[i, (g + 1) * D + d], h[i, g, d]
                    dot += k * (q * wkq[g, d])
                    kk += k * k
                    hh += q * q
                r = dot / math.sqrt(kk / D + eps) / math.sqrt(hh / D + eps) / math.sqrt(D)
                s = math.sqrt(max(abs(r), 1e-6))
                r = s if r > 0 else (-s if r < 0 else 0.0)
                out[i, g] = 1.0 / (1.0 + math.exp(-r))

    @njit(cache=True, boundscheck=False)
    def conv(value, gate, slots, valid, vs, gs, norm_w, w, eps, act, out):  # pragma: no cover - compiled
        # value (n, D), gate (n, G): this step's; slots, valid (n, K): the K taps' slots (tap K-1 = the token's own);
        # vs (S, D), gs (S, G): the stores; norm_w (G, D); w (G*D, 1, K) the conv weight -> out (n, G, D):
        # v + SiLU(sum_k RMSNorm(v_tap_k) * w_k), v = gate * value
        n, D = value.shape
        G, K = gate.shape[1], slots.shape[1]
        for i in range(n):  # written first: a tap may be an earlier token of the same step (a prefill chunk)
            s = slots[i, K - 1]
            for d in range(D):
                vs[s, d] = value[i, d]
            for g in range(G):
                gs[s, g] = gate[i, g]
        y = np.empty(D, dtype=np.float64)
        for i in range(n):
            for g in range(G):
                y[:] = 0.0
                for k in range(K):
                    if not valid[i, k]:  # before the sequence: a zero input
                        continue
                    s = slots[i, k]
                    gk = gs[s, g]
                    ss = 0.0
                    for d in range(D):
                        x = gk * vs[s, d]
                        ss += x * x
                    r = 1.0 / math.sqrt(ss / D + eps)
                    for d in range(D):
                        y[d] += (gk * vs[s, d] * r * norm_w[g, d]) * w[g * D + d, 0, k]
                for d in range(D):
                    a = y[d] / (1.0 + math.exp(-y[d])) if act else y[d]
                    out[i, g, d] = a + gate[i, g] * value[i, d]

    return gate, conv


_kernels = LazyKernels(_build, switchable=True)


def gate(kv: torch.Tensor, h: torch.Tensor, wkq: torch.Tensor) -> torch.Tensor:
    """kv (n, 1, (Gk+1)*D), h (n, 1, Gk, D), wkq (Gk, D) -> gates (n, 1, Gk), as `Engram.gated_value` step 3."""
    n, _, Gk, D = h.shape
    out = np.empty((n, Gk), dtype=np.float32)
    with _launch():
        _kernels.get()[0](kv.detach().reshape(n, -1).contiguous().numpy(), h.detach().reshape(n, Gk, D).contiguous()
                          .numpy(), wkq.detach().contiguous().numpy(), float(torch.finfo(torch.float32).eps), out)
    return torch.from_numpy(out).unsqueeze(1)


def conv(value: torch.Tensor, gate: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, vs: torch.Tensor,
         gs: torch.Tensor, short_conv) -> torch.Tensor:
    """value (n, D), gate (n, G) of this step, written into the stores vs (S, D), gs (S, G) at slots[:, -1]; then
    the delta (n, G, D) of `Engram.mix_at_taps` from the K taps `slots` (n, K) (`valid` (n, K) False before the
    sequence) read back, with `short_conv`'s weights."""
    n, D = value.shape
    G = gate.shape[1]
    out = np.empty((n, G, D), dtype=np.float32)
    with _launch():
        _kernels.get()[1](value.detach().contiguous().numpy(), gate.detach().contiguous().numpy(), slots.numpy(),
                          valid.numpy(), vs.numpy(), gs.numpy(), short_conv.norm_weight.detach().numpy(),
                          short_conv.conv.weight.detach().numpy(), float(short_conv.norm_eps),
                          bool(short_conv.activation), out)
    return torch.from_numpy(out)
