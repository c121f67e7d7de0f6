"""Plain reference-style implementations, written the way `engram_demo_v1.py` computes things.

Used only as the side-by-side baseline in benchmarks: numpy hashing with one int64 modulo
per head, and a module with per-branch Python loops, `nn.Conv1d` and a dense
`nn.Embedding` gradient. They take the project's hash mapping (for primes/multipliers) so
both sides compute the same function; the benchmarks check outputs are identical.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn


def reference_hash(mapping, input_ids: np.ndarray) -> dict:
    """numpy n-gram hashing as in the reference: shift, multiply, XOR, `%` per head."""
    x = mapping.compressed_tokenizer(input_ids)
    B, T = x.shape
    out = {}
    for layer_id in mapping.layer_ids:
        mult = mapping.layer_multipliers[layer_id]

        def shift_k(k):
            if k == 0:
                return x
            return np.pad(x, ((0, 0), (k, 0)), mode="constant", constant_values=mapping.pad_id)[:, :T]

        shifts = [shift_k(k) for k in range(mapping.max_ngram_size)]
        hashes = []
        for n in range(2, mapping.max_ngram_size + 1):
            mix = shifts[0] * mult[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, shifts[k] * mult[k])
            for mod in mapping.vocab_size_across_layers[layer_id][n - 2]:
                hashes.append((mix % int(mod)).astype(np.int64, copy=False))
        out[layer_id] = np.stack(hashes, axis=2)
    return out


class RefShortConv(nn.Module):
    def __init__(self, hidden_size, kernel_size, dilation, hc_mult, norm_eps=1e-5):
        super().__init__()
        C = hidden_size * hc_mult
        self.conv = nn.Conv1d(C, C, kernel_size, groups=C, bias=False, padding=(kernel_size - 1) * dilation,
                              dilation=dilation)
        self.norms = nn.ModuleList([nn.RMSNorm(hidden_size, eps=norm_eps) for _ in range(hc_mult)])

    def forward(self, x):
        B, T, G, C = x.shape
        x_norm = torch.cat([self.norms[i](x[:, :, i, :]) for i in range(G)], dim=-1)
        y = self.conv(x_norm.transpose(1, 2))[..., :T]
        return nn.functional.silu(y).transpose(1, 2).reshape(B, T, G, C).contiguous()


class RefEngram(nn.Module):
    """The reference module's forward: loops over branches, dense-gradient table."""

    def __init__(self, layer_id, mapping, hidden_size, hc_mult, kernel_size=4):
        super().__init__()
        self.layer_id = layer_id
        self.mapping = mapping
        sizes = mapping.head_sizes(layer_id)
        self.register_buffer("offsets", torch.tensor(mapping.head_offsets(layer_id)))
        self.embedding = nn.Embedding(sum(sizes), mapping.n_embed_per_ngram // mapping.n_head_per_ngram)
        E = (mapping.max_ngram_size - 1) * mapping.n_embed_per_ngram
        self.short_conv = RefShortConv(hidden_size, kernel_size, mapping.max_ngram_size, hc_mult)
        self.value_proj = nn.Linear(E, hidden_size)
        self.key_projs = nn.ModuleList([nn.Linear(E, hidden_size) for _ in range(hc_mult)])
        self.norm1 = nn.ModuleList([nn.RMSNorm(hidden_size) for _ in range(hc_mult)])
        self.norm2 = nn.ModuleList([nn.RMSNorm(hidden_size) for _ in range(hc_mult)])
        self.hidden_size, self.hc_mult = hidden_size, hc_mult

    def forward(self, hidden_states, input_ids=None, hash_ids=None):
        if hash_ids is None:
            hash_ids = torch.from_numpy(reference_hash(self.mapping, input_ids.numpy())[self.layer_id])
        emb = self.embedding(hash_ids + self.offsets).flatten(start_dim=-2)
        gates = []
        for i in range(self.hc_mult):
            k = self.norm1[i](self.key_projs[i](emb))
            q = self.norm2[i](hidden_states[:, :, i, :])
            g = (k * q).sum(dim=-1) / math.sqrt(self.hidden_size)
            g = g.abs().clamp_min(1e-6).sqrt() * g.sign()
            gates.append(g.sigmoid().unsqueeze(-1))
        gates = torch.stack(gates, dim=2)
        value = gates * self.value_proj(emb).unsqueeze(2)
        return value + self.short_conv(value)
