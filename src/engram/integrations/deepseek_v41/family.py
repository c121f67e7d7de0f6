"""DeepSeek-V4.1's Engram config (`V41Config`) and hash family (`DeepSeekV41Family`, `hash_mapping`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...config import ConfigError
from ...deprecation import renamed_keywords
from ...hashing import HashFamily, NgramHashMapping, head_moduli, layer_multipliers
from ...persist import read_json
from ...tables.codecs import UE8M0_BLOCK
from ...tokenizer import CompressedTokenizer

CONFIG_FIELDS = ("engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads",
                 "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size", "engram_pad_token_id")


# ------------------------------------------------------------------------------------------ config
@dataclass
class V41Config:
    """The Engram fields of a DeepSeek-V4.1 `config.json`, plus the host sizes the module needs."""

    layer_ids: list[int]
    num_embeddings: list[int]  # table rows per Engram layer
    max_ngram_size: int
    n_heads: int  # heads per n-gram order
    head_dim: int  # row width
    vocab_size: int  # engram_vocab_size: primes start above it - 1
    compressed_vocab_size: int
    pad_token_id: int
    hidden_size: int
    hc_mult: int
    rms_norm_eps: float

    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "config") -> "V41Config":
        if not isinstance(cfg, dict) or not cfg.get("engram_layer_ids"):
            raise ConfigError(f"{where}: not a DeepSeek-V4.1 Engram config (no engram_layer_ids; model_type "
                              f"{cfg.get('model_type') if isinstance(cfg, dict) else None!r})")
        missing = [k for k in CONFIG_FIELDS + ("hidden_size", "hc_mult") if k not in cfg]
        if missing:
            raise ConfigError(f"{where}: DeepSeek-V4.1 Engram config lacks {', '.join(missing)}")
        c = cls([int(i) for i in cfg["engram_layer_ids"]], [int(n) for n in cfg["engram_num_embeddings"]],
                int(cfg["engram_max_ngram_size"]), int(cfg["engram_n_heads"]), int(cfg["engram_head_dim"]),
                int(cfg["engram_vocab_size"]), int(cfg["engram_compressed_vocab_size"]),
                int(cfg["engram_pad_token_id"]), int(cfg["hidden_size"]), int(cfg["hc_mult"]),
                float(cfg.get("rms_norm_eps", 1e-6)))
        if len(c.num_embeddings) != len(c.layer_ids):
            raise ConfigError(f"{where}: engram_num_embeddings has {len(c.num_embeddings)} entries for "
                              f"{len(c.layer_ids)} engram_layer_ids")
        if c.max_ngram_size < 2 or c.n_heads < 1 or c.head_dim % UE8M0_BLOCK:
            raise ConfigError(f"{where}: engram_max_ngram_size must be >= 2, engram_n_heads >= 1 and engram_head_dim "
                              f"a multiple of {UE8M0_BLOCK}")
        return c


# ------------------------------------------------------------------------------------------ hashing
class DeepSeekV41Family(HashFamily):
    """DeepSeek-V4.1's hash family: the reference's, with seed 0 and `engram_vocab_size` for every order."""

    name = "deepseek_v41"
    index_dtype = torch.int32  # the released model's hash ids
    formula = ("x = lookup_table[token_id]; positions t<0, and every position at or before the nearest DEAD one an "
               "n-gram reaches, read compressed_pad_id; mix = XOR_{k<n} (x_{t-k} * multipliers[k]) in int64; head j of "
               "order n: row = mix mod head_moduli[n-2][j] + head_offsets[(n-2)*n_heads + j] (int32)")

    def __init__(self, cfg: V41Config, compressed_tokenizer: CompressedTokenizer):
        ct = compressed_tokenizer
        if ct.compressed_vocab_size != cfg.compressed_vocab_size:
            raise ConfigError(f"the tokenizer compresses to {ct.compressed_vocab_size:,} ids but the config's "
                              f"engram_compressed_vocab_size is {cfg.compressed_vocab_size:,}: not this model's "
                              "tokenizer (hash multipliers derive from that size); "
                              "pass the checkpoint's tokenizer.json")
        if not 0 <= cfg.pad_token_id < ct.raw_vocab_size:
            raise ConfigError(f"engram_pad_token_id {cfg.pad_token_id} is outside the tokenizer's "
                              f"[0, {ct.raw_vocab_size})")
        self.cfg = cfg
        self.layer_ids, self.max_ngram_size, self.n_head_per_ngram = cfg.layer_ids, cfg.max_ngram_size, cfg.n_heads
        self.seed, self.compressed_tokenizer = 0, ct
        self.raw_pad_id, self.compressed_pad_id = cfg.pad_token_id, int(ct.lookup_table[cfg.pad_token_id])
        self.layer_multipliers = layer_multipliers(cfg.layer_ids, cfg.max_ngram_size, ct.compressed_vocab_size, 0)
        self.vocab_size_across_layers = head_moduli(cfg.layer_ids, [cfg.vocab_size] * (cfg.max_ngram_size - 1),
                                                    cfg.max_ngram_size, cfg.n_heads)
        for lid, rows in zip(cfg.layer_ids, cfg.num_embeddings):
            if sum(self.head_sizes(lid)) > rows:
                raise ConfigError(f"layer {lid}: its heads need {sum(self.head_sizes(lid)):,} rows, "
                                  f"engram_num_embeddings gives {rows:,}")

    def config_spec(self) -> dict:
        ct, c = self.compressed_tokenizer, self.cfg
        return {"tokenizer_sha256": ct.tokenizer_sha256, "tokenizer_len": ct.raw_vocab_size,
                "compressed_vocab_size": ct.compressed_vocab_size, "lookup_table_sha256": ct.lookup_sha256,
                "pad_id": c.pad_token_id, "compressed_pad_id": self.compressed_pad_id,
                "max_ngram_size": c.max_ngram_size,
                "n_head_per_ngram": c.n_heads, "head_dim": c.head_dim, "engram_vocab_size": c.vocab_size,
                "num_embeddings": c.num_embeddings, "layer_ids": c.layer_ids, "hidden_size": c.hidden_size,
                "hc_mult": c.hc_mult, "rms_norm_eps": c.rms_norm_eps}

    @classmethod
    def from_spec(cls, spec: dict, tokenizer=None) -> "DeepSeekV41Family":
        ct = CompressedTokenizer(tokenizer)
        if ct.lookup_sha256 != spec["lookup_table_sha256"]:
            raise ConfigError("lookup table mismatch: the compression built from this tokenizer differs from the "
                              "spec's")
        cfg = V41Config(spec["layer_ids"], spec["num_embeddings"], spec["max_ngram_size"], spec["n_head_per_ngram"],
                        spec["head_dim"], spec["engram_vocab_size"], spec["compressed_vocab_size"], spec["pad_id"],
                        spec["hidden_size"], spec["hc_mult"], spec["rms_norm_eps"])
        return cls(cfg, ct)


@renamed_keywords(backend="kernel")
def hash_mapping(config, tokenizer, kernel: str = "auto") -> NgramHashMapping:
    """The V4.1 hashing of a config (`config.json` path, dict or `V41Config`) and the model's tokenizer
    (`tokenizer.json`, its folder, a tokenizer object or a `CompressedTokenizer`): the engine over
    `DeepSeekV41Family`. Its ids are int32; pass `offsets=True` for the table's rows and `dead=` for DEAD masks:
    `hash(ids, offsets=True, dead=mask)`, `hash_continuation(new, history, offsets=True, dead=..., history_dead=...)`.
    `kernel`: as `NgramHashMapping`'s ("auto" | "numba" | "torch"; `backend=`: its deprecated spelling).
    """
    cfg = config if isinstance(config, V41Config) else V41Config.from_dict(
        read_json(config, "config.json", "pass the checkpoint folder's config.json", ConfigError)
        if isinstance(config, (str, Path)) else config)
    ct = tokenizer if isinstance(tokenizer, CompressedTokenizer) else CompressedTokenizer(tokenizer)
    return NgramHashMapping.for_family(DeepSeekV41Family(cfg, ct), kernel)
