"""Qwen3.8-Flash-Next (`transformers` model type `qwen4_exp`): its n-gram tables hashed by engram's kernel.

The model's `Qwen4ExpTextNGramEmbedding` is Engram's lookup with another hash family (raw ids,
SplitMix64 multipliers, consecutive primes, EOS document resets; `NgramHashMapping.qwen4_exp`) and its
`Qwen4ExpTextPLELayer` is Engram's gate and conv. The installed transformers is the reference.

    mapping = hash_mapping(model.config.text_config)     # or the text config itself
    rows = mapping.hash(input_ids)                       # {ple_layer_id (1-indexed): (B, T, H)} before offsets
"""

from __future__ import annotations

from ..config import ConfigError
from ..hashing import NgramHashMapping


def text_config(config):
    """The text config of a Qwen4Exp config (a `Qwen4ExpConfig` nests it in `text_config`)."""
    return getattr(config, "text_config", None) or config


def eos_id(cfg) -> int:
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else cfg.eos_token_id
    if eos is None:
        raise ConfigError("qwen4_exp config has no eos_token_id: its hashing resets documents at EOS")
    return int(eos)


def hash_mapping(config, backend: str = "auto") -> NgramHashMapping:
    """The `qwen4_exp` `NgramHashMapping` of a Qwen4Exp (text) config, keyed by its 1-indexed `ple_layer_ids`."""
    cfg = text_config(config)
    if getattr(cfg, "model_type", None) not in ("qwen4_exp_text", "qwen4_exp") or not hasattr(cfg, "ngram_size"):
        raise ConfigError(f"not a qwen4_exp config (model_type {getattr(cfg, 'model_type', None)!r})")
    if not cfg.ple_layer_ids:
        raise ConfigError("this qwen4_exp config has no n-gram table (ple_layer_ids is empty)")
    return NgramHashMapping.qwen4_exp(cfg.vocab_size, cfg.ngram_size, cfg.heads_per_ngram, cfg.ple_layer_ids,
                                      cfg.ngram_vocab_size_base, cfg.seed, eos_id(cfg), backend=backend)
