"""Qwen3.8-Flash-Next's n-gram hashing (`Qwen4ExpFamily`), from its config (`hash_mapping`) or transformers' own
module (`transformers_hashing`, the reference it is tested against)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from ...config import ConfigError
from ...deprecation import renamed_keywords
from ...hashing import PRIME_1, HashFamily, NgramHashMapping
from ...tokenizer import RawIds

_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """SplitMix64's output function on a 64-bit state advanced by one step (what qwen4_exp seeds with)."""
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def splitmix_multipliers(vocab_size: int, ngram_size: int, index: int, seed: int) -> np.ndarray:
    """qwen4_exp's odd multipliers of PLE layer `index`: `2 * (splitmix64(base + GAMMA*(k+1)) mod half) + 1`."""
    half = max(1, (np.iinfo(np.int64).max // max(vocab_size, 1)) // 2)
    base = seed + PRIME_1 * index
    return np.array([2 * (splitmix64((base + _GAMMA * (k + 1)) & _MASK64) % half) + 1
                     for k in range(ngram_size)], dtype=np.int64)


def consecutive_primes(start: int, count: int) -> list[int]:
    """The `count` primes above `start`, in order."""
    from sympy import nextprime

    out, p = [], start
    for _ in range(count):
        p = int(nextprime(p))
        out.append(p)
    return out


class Qwen4ExpFamily(HashFamily):
    """Qwen3.8-Flash-Next's n-gram hashing: raw token ids (no compression); per PLE layer (index i in
    `ple_layer_ids`) multipliers `2 * (splitmix64(seed + 10007 * i + GAMMA * (k + 1)) mod half_bound) + 1`;
    head h of layer i takes the (i * H + h + 1)-th prime above `ngram_vocab_size_base - 1` (consecutive
    primes shared by all orders and layers); positions before the sequence or across an EOS (each
    document hashes as if it started fresh) read the EOS id. Keyed by the (1-indexed) `ple_layer_ids`.
    """

    name = "qwen4_exp"
    formula = ("raw token ids; positions before the sequence or before the token after the last EOS (reset_id) "
               "read reset_id; mix = XOR_{k<n} (x_{t-k} * multipliers[k]) in wrapping int64; head j of order n: "
               "row = mix floor-mod head_moduli[n-2][j]; table row = row + head_offsets[(n-2)*n_head_per_ngram + j]")

    def __init__(self, vocab_size: int, ngram_size: int, heads_per_ngram: int, ple_layer_ids,
                 ngram_vocab_size_base: int, seed: int, eos_token_id: int):
        for name, v in (("vocab_size", vocab_size), ("ngram_size", ngram_size), ("heads_per_ngram", heads_per_ngram),
                        ("ngram_vocab_size_base", ngram_vocab_size_base)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "ngram_size" else 1):
                raise ConfigError(f"qwen4_exp hashing: {name} must be a positive integer, got {v!r}")
        if not isinstance(eos_token_id, int) or not 0 <= eos_token_id < vocab_size:
            raise ConfigError(f"qwen4_exp hashing needs the EOS id in [0, {vocab_size}), got {eos_token_id!r}")
        if not ple_layer_ids:
            raise ConfigError("qwen4_exp hashing: ple_layer_ids is empty (the model has no n-gram table)")
        self.max_ngram_size, self.n_head_per_ngram = int(ngram_size), int(heads_per_ngram)
        self.prime_base, self.seed = int(ngram_vocab_size_base), int(seed)
        self.layer_ids = [int(i) for i in ple_layer_ids]
        self.compressed_tokenizer = RawIds(vocab_size)
        self.reset_id = self.raw_pad_id = self.compressed_pad_id = int(eos_token_id)
        H = (self.max_ngram_size - 1) * self.n_head_per_ngram
        primes = consecutive_primes(self.prime_base - 1, H * len(self.layer_ids))
        self.layer_multipliers, self.vocab_size_across_layers = {}, {}
        for i, lid in enumerate(self.layer_ids):
            self.layer_multipliers[lid] = splitmix_multipliers(vocab_size, self.max_ngram_size, i, self.seed)
            heads = primes[i * H:(i + 1) * H]
            self.vocab_size_across_layers[lid] = [heads[o * self.n_head_per_ngram:(o + 1) * self.n_head_per_ngram]
                                for o in range(self.max_ngram_size - 1)]

    def config_spec(self) -> dict:
        return {"vocab_size": self.raw_vocab_size, "max_ngram_size": self.max_ngram_size,
                "n_head_per_ngram": self.n_head_per_ngram, "prime_base": self.prime_base, "seed": self.seed,
                "reset_id": self.reset_id, "layer_ids": self.layer_ids,
                "lookup_table_sha256": self.compressed_tokenizer.lookup_sha256,
                "compressed_pad_id": self.compressed_pad_id}

    @classmethod
    def from_spec(cls, spec: dict, tokenizer=None) -> "Qwen4ExpFamily":
        return cls(spec["vocab_size"], spec["max_ngram_size"], spec["n_head_per_ngram"], spec["layer_ids"],
                   spec["prime_base"], spec["seed"], spec["reset_id"])


class _RowIds(nn.Module):
    """Stands in for an n-gram table: returns the row ids it is asked for (`transformers_hashing`)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Buffer(torch.zeros(1))

    def forward(self, ids):
        return ids.unsqueeze(-1)


def transformers_hashing(config, ple_index: int):
    """transformers' own `Qwen4ExpTextNGramEmbedding` for PLE layer `ple_index`, with its table replaced by an
    echo of the row ids: `module(input_ids, cache)` -> (B, T, H) row ids, offsets included. The reference our
    hashing is tested and benchmarked against; no table is allocated (it is built on the meta device)."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mq

    cfg = text_config(config)
    with torch.device("meta"):  # the real table would be ~20M rows per head
        m = mq.Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, cfg.ple_layer_ids[ple_index] - 1, ple_index)
    m.layer_multipliers = mq._build_layer_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.seed)
    m.ngram_heads_vocab_sizes = torch.tensor(m.head_vocab_sizes)
    m.ngram_heads_offsets = torch.tensor(m.head_offsets)
    m.ngram_embedding = _RowIds()
    return m


def text_config(config):
    """The text config of a Qwen4Exp config (a `Qwen4ExpConfig` nests it in `text_config`)."""
    return getattr(config, "text_config", None) or config


def eos_id(cfg) -> int:
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else cfg.eos_token_id
    if eos is None:
        raise ConfigError("qwen4_exp config has no eos_token_id: its hashing resets documents at EOS")
    return int(eos)


@renamed_keywords(backend="kernel")
def hash_mapping(config, kernel: str = "auto") -> NgramHashMapping:
    """The `qwen4_exp` `NgramHashMapping` of a Qwen4Exp (text) config, keyed by its 1-indexed `ple_layer_ids`
    (`kernel`: as `NgramHashMapping`'s; `backend=`: its deprecated spelling)."""
    cfg = text_config(config)
    if getattr(cfg, "model_type", None) not in ("qwen4_exp_text", "qwen4_exp") or not hasattr(cfg, "ngram_size"):
        raise ConfigError(f"not a qwen4_exp config (model_type {getattr(cfg, 'model_type', None)!r})")
    if not cfg.ple_layer_ids:
        raise ConfigError("this qwen4_exp config has no n-gram table (ple_layer_ids is empty)")
    family = Qwen4ExpFamily(cfg.vocab_size, cfg.ngram_size, cfg.heads_per_ngram, cfg.ple_layer_ids,
                            cfg.ngram_vocab_size_base, cfg.seed, eos_id(cfg))
    return NgramHashMapping.for_family(family, kernel)
