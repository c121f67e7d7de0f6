"""DeepSeek-V4.1's Engram layer (`V41Engram`): rows from a table, a key per hc branch and a shared value, a gate."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ...config import ConfigError
from ...tables.base import Table, TableError
from ...tables.codecs import ue8m0_to_float
from .family import V41Config


def dequantize_linear(weight: torch.Tensor, scale: torch.Tensor | None, dtype=torch.bfloat16) -> torch.Tensor:
    """A linear weight (out, in) as stored: bf16/fp32 as is; FP8 e4m3 with a float32 `scale` per 128 x 128 block
    (DeepSeek-V3's `weight_scale_inv`, multiplied) or a ue8m0 byte per 32 inputs (MX-FP8)."""
    if scale is None:
        return weight.to(dtype)
    w = weight.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    o, i = w.shape
    if (scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
            and tuple(scale.shape) == (o, i // 32)):
        s = ue8m0_to_float(scale).repeat_interleave(32, dim=1)
    elif scale.dtype == torch.float32 and tuple(scale.shape) == (math.ceil(o / 128), math.ceil(i / 128)):
        s = scale.repeat_interleave(128, dim=0)[:o].repeat_interleave(128, dim=1)[:, :i]
    else:
        raise TableError(f"wkv scale of shape {list(scale.shape)} ({scale.dtype}) fits neither 128x128 float32 blocks "
                         f"({[math.ceil(o / 128), math.ceil(i / 128)]}) nor ue8m0 per 32 inputs ({[o, i // 32]})")
    return (w * s).to(dtype)


class V41Engram(nn.Module):
    """DeepSeek-V4.1's Engram layer: `(hidden (B, T, G, D), hash ids (B, T, H) or rows (B, T, H, d), mask) -> hidden`.

    No short conv; the caller's residual is inside (the layer returns `h + gate * value`, as the released
    module does). Weights: `wkv` (G*D + D, H*d), `q_weight`, `k_weight` (G, D); rows from `table`."""

    def __init__(self, layer_id: int, cfg: V41Config, table: Table | None = None, dtype=torch.bfloat16):
        super().__init__()
        self.layer_id, self.cfg, self.table = layer_id, cfg, table
        G, D = cfg.hc_mult, cfg.hidden_size
        self.wkv = nn.Linear(cfg.n_hash_cols * cfg.head_dim, D * (G + 1), bias=False, dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(G, D, dtype=dtype), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(G, D, dtype=dtype), requires_grad=False)
        self.clamp = 1e-6

    def rows(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, H) int row ids (offsets added) -> (B, T, H, d) rows from the table."""
        if self.table is None:
            raise TableError(f"Engram layer {self.layer_id} has no table: pass rows, or load() a checkpoint")
        if hash_ids.dtype.is_floating_point or hash_ids.dim() != 3:
            raise ConfigError(f"hash ids must be an integer tensor (B, T, H), got {hash_ids.dtype} "
                              f"{list(hash_ids.shape)}")
        flat = hash_ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.table.num_rows):
            raise ConfigError(f"hash ids must lie in [0, {self.table.num_rows}) (offsets added): got "
                              f"[{int(flat.min())}, {int(flat.max())}]")
        return self.table.lookup(flat.cpu()).view(*hash_ids.shape, -1).to(hash_ids.device)

    def forward(self, hidden: torch.Tensor, ids_or_rows: torch.Tensor, mask: torch.Tensor | None = None):
        G, D = self.cfg.hc_mult, self.cfg.hidden_size
        if hidden.dim() != 4 or tuple(hidden.shape[2:]) != (G, D):
            raise ConfigError(f"hidden must be (B, T, {G}, {D}), got {list(hidden.shape)}")
        # 1. rows: looked up here from hash ids, or given
        rows = self.rows(ids_or_rows) if not ids_or_rows.dtype.is_floating_point else ids_or_rows  # (B, T, H, d)
        # 2. one key per branch and a shared value from one projection, in the weights' dtype
        kv = self.wkv(rows.flatten(-2).to(self.wkv.weight.dtype))  # (B, T, (G+1)*D)
        return self.gate_and_add(hidden, kv, mask)

    def gate_and_add(self, hidden: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Steps 3-4 (what the released `_fused_engram_post_wkv_kernel` does): hidden (B, T, G, D),
        kv (B, T, (G+1)*D)."""
        G, D = self.cfg.hc_mult, self.cfg.hidden_size
        B, T = hidden.shape[:2]
        f = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        key = kv[..., :G * D].reshape(B, T, G, D).to(f)  # (B, T, G, D)
        value = kv[..., G * D:].to(f)  # (B, T, D)
        h = hidden.to(f)
        # 3. gate per branch: normalized dot of the stream with the key, signed square root, sigmoid
        eps = self.cfg.rms_norm_eps
        dot = (h * self.q_weight.to(f) * self.k_weight.to(f) * key).sum(-1)  # (B, T, G)
        dot = dot * torch.rsqrt(h.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) / math.sqrt(D)
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(self.clamp)))  # (B, T, G)
        if mask is not None:
            if tuple(mask.shape) != (B, T):
                raise ConfigError(f"mask must be (B, T) = {[B, T]}, got {list(mask.shape)}")
            gate = gate * mask.to(gate.device, f)[..., None]  # False shuts the gate
        # 4. the stream plus the gated value
        return (h + gate[..., None] * value[:, :, None, :]).to(hidden.dtype)  # (B, T, G, D)
