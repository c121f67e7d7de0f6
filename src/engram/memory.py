"""The Engram module: `(hidden (B, T, G, D), rows (B, T, H, d)) -> (delta, gate)`, and the layer's table.

`Engram` is math over retrieved rows (context gate per branch, short conv); `MultiHeadEmbedding`
turns per-head hash ids into rows through the layer's table (`engram.table.Table`). This file
imports no storage, distribution, data or training code (tests/test_architecture.py).

Shapes: B batch, T tokens, G = hc_mult residual branches (streams), D = backbone hidden,
H = (N-1)*K heads, d = per-head row width, E = H*d = (N-1)*n_embed_per_ngram.

Same math as the reference `engram_demo_v1.py`, arranged for speed:
  * the shared value projection and the G per-branch key projections are one fused
    `Linear(E, (G+1)*D)` (weights stored as `kv_proj`, rows `[value; key_0; ...; key_{G-1}]`);
  * per-branch RMSNorms are one normalization with a `(G, D)` weight;
  * the dilated depthwise causal conv is K shifted multiply-adds in (B, T, C) layout;
  * the default table is an `nn.Embedding(sparse=True)`: backward yields the looked-up rows and
    their gradients (a sparse COO tensor), never a dense gradient of the whole table.
`Engram.load_reference_state_dict` accepts the reference's parameter names.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import BackBoneConfig, EngramConfig, check_layer_ids
from .hashing import NgramHashMapping, get_hash_mapping

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _rstd(x: torch.Tensor, eps: float | None) -> torch.Tensor:
    """1 / RMS over the last dim, (..., 1), as RMSNorm computes it (eps=None: the dtype's machine eps)."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1]
    return (ms + eps).rsqrt()


def is_table_key(name: str) -> bool:
    """True for the parameter / state-dict names of Engram tables (their rows live in `multi_head_embedding`)."""
    return "multi_head_embedding" in name


_DEFER_TABLES = False


@contextlib.contextmanager
def defer_table_allocation():
    """Build models whose Engram tables get no storage (0-row weights, no init draws).

    For tables that will live in a backend created on its own (`offload_tables(..., init_seed=)`
    streams an N(0, 1) file), so a table larger than RAM is never materialized.
    """
    global _DEFER_TABLES
    old, _DEFER_TABLES = _DEFER_TABLES, True
    try:
        yield
    finally:
        _DEFER_TABLES = old


class MultiHeadEmbedding(nn.Module):
    """One Engram layer's table: all heads' rows in one `(sum(list_of_N), D)` embedding, per-head row offsets.

    forward: per-head row ids `(..., H)` -> rows `(..., H, D)`. The rows live in this module's own
    `embedding` parameter (sparse gradient, trained by `optim.LazyRowAdam`) unless a table from
    `engram.tables` or `engram.distributed` was installed (`engram.tables.install`): then `table`
    holds it and every lookup goes there. Either way it is one call, `table.lookup(flat row ids)`;
    this module is itself the parameter implementation of that interface (`engram.table.Table`).
    """

    def __init__(self, list_of_N: list[int], D: int, dtype: torch.dtype = torch.float32, sparse: bool = True,
                 layer_id: int | None = None, init_std: float = 1.0):
        super().__init__()
        self.layer_id = layer_id
        self.init_std = float(init_std)
        self.num_heads = len(list_of_N)
        self.num_rows = int(sum(list_of_N))  # the table's rows, also when its storage lives elsewhere
        self.embedding_dim = self.dim = D
        offsets = [0]
        for n in list_of_N[:-1]:
            offsets.append(offsets[-1] + int(n))
        # Offsets are derived from the config, never stored: a plain list, turned into a tensor per device.
        self._offsets = offsets
        self._offsets_cache: dict[torch.device, torch.Tensor] = {}
        self.table = None  # an installed engram.tables Table; None: the rows are `embedding.weight`
        weight = torch.empty(0 if _DEFER_TABLES else self.num_rows, D, dtype=dtype)
        self.embedding = nn.Embedding(weight.shape[0], D, sparse=sparse, _weight=weight)  # _weight: skip default init
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, chunk_rows: int = 1 << 20) -> None:
        """N(0, init_std) init (1: nn.Embedding's, the reference's); drawn in float32 chunks (bf16 `normal_` is
        ~3x slower)."""
        w = self.embedding.weight
        for start in range(0, w.shape[0], chunk_rows):
            block = w[start: start + chunk_rows]
            if block.dtype == torch.float32:
                block.normal_(std=self.init_std)
            else:
                block.copy_(torch.randn(block.shape, dtype=torch.float32) * self.init_std)

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype

    @property
    def offsets(self) -> torch.Tensor:
        """Row offset of each head, int64 (H,), on the table's device."""
        return self._offsets_on(self.embedding.weight.device)

    def _offsets_on(self, dev: torch.device) -> torch.Tensor:
        if dev not in self._offsets_cache:
            self._offsets_cache[dev] = torch.tensor(self._offsets, dtype=torch.long, device=dev)
        return self._offsets_cache[dev]

    def train(self, mode: bool = True):
        super().train(mode)
        if self.table is not None:  # a trainable table records lookups for its optimizer only while training
            self.table.training = mode
        return self

    def lookup(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The `Table` interface for rows in this module's parameter: flat row ids (N,) -> (N, D)."""
        w = self.embedding.weight  # (nn.Embedding's own call, without a module call's cost: serving steps add up)
        vals = nn.functional.embedding(rows.to(w.device), w, sparse=self.embedding.sparse)
        return out.copy_(vals) if out is not None else vals

    def take_grads(self):
        return None  # the gradient lands on embedding.weight (sparse COO): LazyRowAdam reads it there

    def table_rows(self, hash_ids) -> torch.Tensor:
        """Per-head row ids (..., H) (a tensor or array) -> this table's global row ids (..., H): plus head offsets."""
        hash_ids = torch.as_tensor(hash_ids)
        return hash_ids + self._offsets_on(hash_ids.device)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """This table's global row ids (..., H) (`table_rows`, or `hash(..., offsets=True)`) -> (..., H, D)."""
        got = (self if self.table is None else self.table).lookup(rows.reshape(-1), out=out)  # (N, D)
        return got.view(*rows.shape, self.embedding_dim)  # (..., H, D)

    def forward(self, hash_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Per-head row ids (..., H) -> rows (..., H, D)."""
        return self.gather(self.table_rows(hash_ids), out=out)

    def row_grads(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After backward: `(rows [R], grads [R, D])` for the R distinct rows touched, or None.

        Duplicate lookups of a row are summed. This is what a lazy row optimizer consumes.
        """
        g = self.embedding.weight.grad
        if g is None:
            return None
        if g.is_sparse:
            g = g.coalesce()
            return g.indices()[0], g.values()
        rows = g.abs().sum(1).nonzero().squeeze(1)  # dense fallback (sparse=False)
        return rows, g[rows]


class ShortConv(nn.Module):
    """`SiLU(causal dilated depthwise conv(RMSNorm_g(x)))` over the G*D channels, branch-major.

    x: (B, T, G, D) -> (B, T, G, D). The conv runs as K shifted multiply-adds; its weight keeps
    nn.Conv1d's layout and name (`conv.weight`, (C, 1, K), tap K-1 = the current token) so
    reference and older checkpoints load. `zero_init=True` starts it at zero (the paper's init: the
    Engram block is then exactly `v` at step 0); False keeps nn.Conv1d's init (the reference's).
    """

    def __init__(self, hidden_size: int, kernel_size: int = 4, dilation: int = 1, norm_eps: float = 1e-5,
                 hc_mult: int = 4, activation: bool = True, zero_init: bool = False):
        super().__init__()
        self.hc_mult, self.hidden_size = hc_mult, hidden_size
        self.kernel_size, self.dilation, self.norm_eps, self.activation = kernel_size, dilation, norm_eps, activation
        self.zero_init = zero_init
        C = hidden_size * hc_mult
        self.conv = nn.ParameterDict({"weight": nn.Parameter(torch.empty(C, 1, kernel_size))})  # (C, 1, K)
        self.norm_weight = nn.Parameter(torch.ones(hc_mult, hidden_size))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Conv1d's init (kaiming-uniform, a=sqrt(5)), then zeros when `zero_init`; norm weight ones."""
        nn.init.kaiming_uniform_(self.conv.weight, a=math.sqrt(5))  # drawn either way: same RNG stream
        if self.zero_init:
            nn.init.zeros_(self.conv.weight)
        nn.init.ones_(self.norm_weight)

    @property
    def lookback(self) -> int:
        """How many earlier positions an output reads: (K-1) * dilation (what incremental decoding keeps)."""
        return (self.kernel_size - 1) * self.dilation

    @property
    def taps(self) -> tuple[int, ...]:
        """How far back each tap reads, tap 0 first: ((K-1) * dilation, ..., dilation, 0), 0 the current token."""
        return tuple((self.kernel_size - 1 - k) * self.dilation for k in range(self.kernel_size))

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The conv's input after RMSNorm per branch: x (..., G, D) -> (..., G, D)."""
        return (x * _rstd(x, self.norm_eps)).mul_(self.norm_weight)

    def forward(self, x: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, G, D) -> (B, T, G, D); `history` (B, S, G, D): the inputs of the S positions before x
        (incremental decoding), read by the taps instead of zeros. Same values as one call over both."""
        if history is not None and history.shape[1]:
            S = history.shape[1]
            return self.forward(torch.cat([history.to(x.dtype), x], dim=1))[:, S:]
        B, T, G, D = x.shape
        xn = self.normed(x).view(B, T, G * D)  # (B, T, C)
        w = self.conv.weight.squeeze(1).t()  # (K, C); tap K-1 is the current token
        K = self.kernel_size
        y = xn * w[K - 1]
        for k, s in enumerate(self.taps[:-1]):  # tap k looks s positions back; earlier positions read zeros (causal)
            if s < T:
                y[:, s:].addcmul_(xn[:, : T - s], w[k])
        if self.activation:
            y = F.silu(y, inplace=not torch.is_grad_enabled())  # in place only when no backward will need y
        return y.view(B, T, G, D)

    def at_taps(self, x: torch.Tensor) -> torch.Tensor:
        """The output at n single positions from their inputs at the taps only: x (n, K, G, D), x[:, k] the input
        `taps[k]` positions back (zeros before the sequence; x[:, K-1] the position's own) -> (n, G, D). The same
        multiply-adds in the same order as `forward`'s at that position, on K inputs instead of the whole
        (K-1) * dilation + 1 window (what a server keeping per-position inputs reads, `integrations/vllm`)."""
        n, K, G, D = x.shape
        xn = self.normed(x)  # (n, K, G, D)
        w = self.conv.weight.squeeze(1).t().reshape(K, G, D)  # (K, G, D)
        y = xn[:, K - 1] * w[K - 1]
        for k in range(K - 1):
            y.addcmul_(xn[:, k], w[k])
        if self.activation:
            y = F.silu(y, inplace=not torch.is_grad_enabled())
        return y


class Engram(nn.Module):
    """One Engram layer: `forward(hidden (B, T, G, D), rows (B, T, H, d)) -> (delta (B, T, G, D), gate (B, T, G))`.

    Pure math over retrieved rows: where the rows come from (this layer's table, a memory-mapped
    file, other ranks, a prefetch thread) is the caller's business. The caller adds the delta to
    the residual stream (`H <- H + delta`). The layer's table and its addressing live beside the
    math: `multi_head_embedding` (per-head hash ids -> rows, see `engram.tables`) and
    `hash_mapping` (token ids -> per-head hash ids):

        rows = layer.multi_head_embedding(layer.hash_mapping.hash(ids)[layer.layer_id])  # (B, T, H, d)
        delta, gate = layer(hidden, rows)
    """

    def __init__(self, layer_id: int, engram_cfg: EngramConfig | None = None,
                 backbone_cfg: BackBoneConfig | None = None, hash_mapping: NgramHashMapping | None = None):
        super().__init__()
        engram_cfg = engram_cfg or EngramConfig()
        backbone_cfg = backbone_cfg or BackBoneConfig()
        check_layer_ids(engram_cfg, backbone_cfg)
        if layer_id not in engram_cfg.layer_ids:
            raise ValueError(f"layer_id {layer_id} is not in engram_cfg.layer_ids {engram_cfg.layer_ids}")
        self.layer_id = layer_id
        self.hash_mapping = hash_mapping or get_hash_mapping(engram_cfg)
        self.hidden_size = D = backbone_cfg.hidden_size
        self.hc_mult = G = backbone_cfg.hc_mult
        E = engram_cfg.engram_hidden_size
        self.multi_head_embedding = MultiHeadEmbedding(
            self.hash_mapping.head_sizes(layer_id), engram_cfg.head_dim, dtype=_DTYPES[engram_cfg.table_dtype],
            layer_id=layer_id, init_std=engram_cfg.table_init_std,
        )
        self.short_conv = ShortConv(D, engram_cfg.kernel_size, dilation=engram_cfg.max_ngram_size, hc_mult=G,
                                    zero_init=engram_cfg.conv_zero_init)
        self.use_gate, self.use_short_conv = engram_cfg.use_gate, engram_cfg.use_short_conv
        self.single_branch = engram_cfg.single_branch
        Gk = (1 if self.single_branch else G) if self.use_gate else 0  # key projections
        self.kv_proj = nn.Linear(E, (Gk + 1) * D)  # rows: [value (D); key_0 (D); ...; key_{Gk-1} (D)]
        if self.use_gate:
            self.key_norm_weight = nn.Parameter(torch.ones(Gk, D))
            self.query_norm_weight = nn.Parameter(torch.ones(Gk, D))
        if engram_cfg.freeze_table:
            self.multi_head_embedding.embedding.weight.requires_grad_(False)

    def forward(self, hidden_states: torch.Tensor, rows: torch.Tensor, state: dict | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`state`: this layer's incremental-decoding dict (a KV cache keeps one per layer, see
        `engram.model.NgramHistory`): the short conv reads the gated values of the positions decoded
        before (`state["conv"]`, (B, <= lookback, G, D)) and leaves this call's there. None: the call
        stands alone (training, a full forward)."""
        B, T, G, D = hidden_states.shape
        if G != self.hc_mult or D != self.hidden_size:
            raise ValueError(f"hidden_states must be (B, T, {self.hc_mult}, {self.hidden_size}), "
                             f"got {tuple(hidden_states.shape)}")
        if rows.shape[:2] != (B, T) or rows.dim() != 4:
            raise ValueError(f"rows must be (B={B}, T={T}, H, d) table rows for these hidden states, got "
                             f"{tuple(rows.shape)}; look them up with layer.multi_head_embedding(hash_ids)")
        value, gate = self.gated_value(hidden_states, rows)  # (B, T, D), (B, T, G)
        v = self.branch_value(value, gate)  # 4.                                    (B, T, G, D)
        past = None
        if state is not None and self.use_short_conv:  # decoding: the conv's taps reach back into earlier calls
            past = state.get("conv")
            keep = self.short_conv.lookback
            tail = v if past is None else torch.cat([past, v], dim=1)
            state["conv"] = tail[:, max(0, tail.shape[1] - keep):].detach()
        return self.mix(v, past), gate  # 5.

    @staticmethod
    def branch_value(value: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Step 4 of `forward`: the gated value per branch, value (..., D) x gate (..., G) -> (..., G, D)."""
        return gate.unsqueeze(-1) * value.unsqueeze(-2)

    def mix(self, v: torch.Tensor, past: torch.Tensor | None = None) -> torch.Tensor:
        """Step 5 of `forward`: delta = v + ShortConv(v), (B, T, G, D) -> (B, T, G, D); `past` (B, S, G, D): the
        gated values of the S positions before v (incremental decoding). Without the conv (ablation) delta = v."""
        if not self.use_short_conv:
            return v
        return self.short_conv(v, past).add_(v)  # the conv output is a fresh buffer no backward needs: add in place

    def mix_at_taps(self, v: torch.Tensor) -> torch.Tensor:
        """`mix` at n single positions from the gated values at the conv's taps (`ShortConv.taps`): v (n, K, G, D),
        v[:, -1] each position's own -> delta (n, G, D). Without the conv, v (n, 1, G, D): delta = v[:, 0]."""
        if not self.use_short_conv:
            return v[:, -1]
        return self.short_conv.at_taps(v).add_(v[:, -1])

    def gated_value(self, hidden_states: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-3 of `forward`: (value (B, T, D), gate (B, T, G)); the gated value is `gate[..., None] *
        value[:, :, None]`. Apart so that a server keeping per-position state (engram.integrations.vllm) stores
        D + G numbers per position, not G * D, and rebuilds `v` exactly as `forward` does (its step kernels,
        `integrations/vllm/_kernels.py`, compute steps 2-5 at a serving step's few positions in a few calls, their own
        rounding)."""
        B, T, G, D = hidden_states.shape
        # 1. retrieved memory e_t: the heads' rows concatenated                     (B, T, E)
        e = rows.flatten(start_dim=-2).to(hidden_states.device, hidden_states.dtype)
        # 2. value and per-branch keys, one fused projection                        (B, T, (Gk+1)*D)
        kv = self.kv_proj(e)
        value = kv[..., :D]  # (B, T, D)
        # 3. gate per branch: sigmoid(signed sqrt(<RMSNorm_k(key), RMSNorm_q(h)> / sqrt(D)))  (B, T, G)
        if self.use_gate:
            h = hidden_states.mean(dim=2, keepdim=True) if self.single_branch else hidden_states  # (B, T, Gk, D)
            key = kv[..., D:].view(B, T, h.shape[2], D)  # (B, T, Gk, D), pre-norm
            # <RMSNorm_k(key), RMSNorm_q(h)> = rstd_k * rstd_q * <key, h * w_k * w_q>: no normalized copies needed
            hw = h * (self.key_norm_weight * self.query_norm_weight)  # (B, T, Gk, D)
            dot = torch.einsum("btgd,btgd->btg", key, hw)  # (B, T, Gk)
            gate = dot * (_rstd(key, None) * _rstd(h, None)).squeeze(-1) / math.sqrt(D)
            gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
            gate = gate.sigmoid().expand(B, T, G)
        else:  # ablation: no gate
            gate = hidden_states.new_ones(B, T, G)
        return value, gate

    @torch.no_grad()
    def load_reference_state_dict(self, sd: dict) -> None:
        """Load weights named as in the reference demo (`value_proj`, `key_projs.i`, `norm1.i`, ...)."""
        G = self.hc_mult
        self.multi_head_embedding.embedding.weight.copy_(sd["multi_head_embedding.embedding.weight"])
        w = torch.cat([sd["value_proj.weight"]] + [sd[f"key_projs.{i}.weight"] for i in range(G)], 0)
        b = torch.cat([sd["value_proj.bias"]] + [sd[f"key_projs.{i}.bias"] for i in range(G)], 0)
        self.kv_proj.weight.copy_(w)
        self.kv_proj.bias.copy_(b)
        self.key_norm_weight.copy_(torch.stack([sd[f"norm1.{i}.weight"] for i in range(G)]))
        self.query_norm_weight.copy_(torch.stack([sd[f"norm2.{i}.weight"] for i in range(G)]))
        self.short_conv.conv.weight.copy_(sd["short_conv.conv.weight"])
        self.short_conv.norm_weight.copy_(torch.stack([sd[f"short_conv.norms.{i}.weight"] for i in range(G)]))
