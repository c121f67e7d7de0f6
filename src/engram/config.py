"""Configuration dataclasses: `EngramConfig` (the memory) and `BackBoneConfig` (the host model).

The names and defaults are the seed tutorial's (DeepSeek's `engram_demo_v1.py`), so tutorial
code runs unchanged. Both load from and save to one `engram_config.json` with the sections
`engram` and `backbone`. Every problem found by validation raises `ConfigError` (a
`ValueError`) whose message names the field and the fix.

`TrainConfig` (a run's training settings) lives in `engram.training.config`; `engram.TrainConfig` is the same
class. The old spelling `from engram.config import TrainConfig` still works and warns (`moved`: the root package,
which may import training, registers it; this module imports nothing of training).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .deprecation import MovedNames
from .errors import EngramError
from .persist import read_json, write_json

DEFAULT_TOKENIZER = "deepseek-ai/DeepSeek-V3"
TABLE_DTYPES = ("float32", "bfloat16", "float16")  # EngramConfig.table_dtype: how the tables are stored


# Names that moved out of this module: `engram.config.TrainConfig` warns and gives `engram.training.config`'s.
__getattr__ = moved = MovedNames(__name__)


class ConfigError(EngramError, ValueError):
    """A configuration value or file is invalid; the message says which and how to fix it."""


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class EngramConfig:
    """Engram memory settings (defaults = the tutorial's).

    engram_vocab_size[n-2] is the target table size per head for n-grams of order n; each head
    gets the next unused prime above it. `layer_ids` are 0-based block indices.
    `conv_zero_init`, `table_init_std` and `table_dtype` are our options: the reference keeps the
    default conv init, N(0, 1) rows and float32 tables (`False`, `1.0`, `"float32"`); the paper
    zero-initializes the conv. Adapters (`engram.attach`) default to a zero conv and N(0, 0.02) rows.

    Ablation switches (defaults = the reference): `use_gate` (False: gate fixed at 1),
    `use_short_conv` (False: output = gated value), `single_branch` (one gate from the mean of
    the streams, shared by all), `freeze_table` (random table, never trained),
    `compress_tokenizer` (False: raw token ids are hashed) and `hash_mode`: "ngram" (the
    reference), "shuffled" (each position XORs a fixed random key into the mix: same capacity and
    row statistics, no n-gram identity across positions) or "constant" (every lookup hits row 0
    of its head: a capacity-1 table, i.e. the gating/conv compute without memory).
    """

    tokenizer_name_or_path: str = DEFAULT_TOKENIZER
    engram_vocab_size: list[int] = field(default_factory=lambda: [129280 * 5, 129280 * 5])
    max_ngram_size: int = 3
    n_embed_per_ngram: int = 512
    n_head_per_ngram: int = 8
    layer_ids: list[int] = field(default_factory=lambda: [1, 15])
    pad_id: int = 2
    seed: int = 0
    kernel_size: int = 4
    conv_zero_init: bool = False
    table_init_std: float = 1.0
    table_dtype: str = "float32"
    use_gate: bool = True
    use_short_conv: bool = True
    single_branch: bool = False
    freeze_table: bool = False
    compress_tokenizer: bool = True
    hash_mode: str = "ngram"

    def __post_init__(self) -> None:
        self.engram_vocab_size = list(self.engram_vocab_size)
        self.layer_ids = list(self.layer_ids)
        self.validate()

    def validate(self) -> None:
        if isinstance(self.max_ngram_size, bool) or not isinstance(self.max_ngram_size, int) or self.max_ngram_size < 2:
            raise ConfigError(f"max_ngram_size must be an integer >= 2 (bigrams and up), got {self.max_ngram_size!r}")
        for name in ("n_embed_per_ngram", "n_head_per_ngram", "kernel_size"):
            _positive_int(name, getattr(self, name))
        if isinstance(self.table_init_std, bool) or not isinstance(self.table_init_std, (int, float)) \
                or not self.table_init_std > 0:
            raise ConfigError(f"table_init_std must be a positive number (1.0: the reference's N(0, 1) rows), "
                              f"got {self.table_init_std!r}")
        if len(self.engram_vocab_size) != self.max_ngram_size - 1:
            raise ConfigError(
                f"engram_vocab_size needs one size per n-gram order 2..{self.max_ngram_size} "
                f"(max_ngram_size - 1 = {self.max_ngram_size - 1} entries), got {len(self.engram_vocab_size)}"
            )
        for i, v in enumerate(self.engram_vocab_size):
            _positive_int(f"engram_vocab_size[{i}]", v)
        if self.n_embed_per_ngram % self.n_head_per_ngram != 0:
            raise ConfigError(
                f"n_embed_per_ngram ({self.n_embed_per_ngram}) must be divisible by n_head_per_ngram "
                f"({self.n_head_per_ngram}): each head stores n_embed_per_ngram // n_head_per_ngram dims"
            )
        if not self.layer_ids:
            raise ConfigError("layer_ids is empty: give at least one 0-based block index, e.g. [1]")
        for lid in self.layer_ids:
            if isinstance(lid, bool) or not isinstance(lid, int) or lid < 0:
                raise ConfigError(f"layer_ids must be non-negative integers, got {lid!r}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ConfigError(f"layer_ids has duplicates: {self.layer_ids}")
        if isinstance(self.pad_id, bool) or not isinstance(self.pad_id, int) or self.pad_id < 0:
            raise ConfigError(f"pad_id must be a non-negative token id, got {self.pad_id!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.hash_mode not in ("ngram", "shuffled", "constant"):
            raise ConfigError(f"hash_mode must be 'ngram', 'shuffled' or 'constant', got {self.hash_mode!r}")
        if self.table_dtype not in TABLE_DTYPES:
            raise ConfigError(f"table_dtype must be 'float32', 'bfloat16' or 'float16', got {self.table_dtype!r}")

    @property
    def head_dim(self) -> int:
        """Row width of every head's table: n_embed_per_ngram // n_head_per_ngram."""
        return self.n_embed_per_ngram // self.n_head_per_ngram

    @property
    def num_heads(self) -> int:
        """Heads per Engram layer across all orders: (max_ngram_size - 1) * n_head_per_ngram."""
        return (self.max_ngram_size - 1) * self.n_head_per_ngram

    @property
    def engram_hidden_size(self) -> int:
        """Width of the retrieved memory vector e_t: (max_ngram_size - 1) * n_embed_per_ngram."""
        return (self.max_ngram_size - 1) * self.n_embed_per_ngram

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngramConfig":
        return from_section(cls, d, "engram")


@dataclass
class BackBoneConfig:
    """Host model settings (defaults = the tutorial's 30-layer demo)."""

    hidden_size: int = 1024
    hc_mult: int = 4
    vocab_size: int = 129280
    num_layers: int = 30

    def __post_init__(self) -> None:
        for name in ("hidden_size", "hc_mult", "vocab_size", "num_layers"):
            _positive_int(name, getattr(self, name))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BackBoneConfig":
        return from_section(cls, d, "backbone")


def from_section(cls, d: Any, section: str):
    """`cls(**d)` for the JSON object `d` of a config file's section `section` (a dataclass per section: here and
    `training.config.TrainConfig`); a `ConfigError` naming the section for a non-object or an unknown key."""
    if not isinstance(d, dict):
        raise ConfigError(f"section '{section}' must be a JSON object, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(
            f"unknown key(s) in section '{section}': {', '.join(unknown)}; valid keys: {', '.join(sorted(known))}"
        )
    try:
        return cls(**d)
    except TypeError as e:  # pragma: no cover - dataclass signature mismatch
        raise ConfigError(f"section '{section}': {e}") from None


def parse_bool(value: str) -> bool:
    """A boolean setting written as text (`--set KEY=VALUE`, a job file's value): 1/true/yes/on or
    0/false/no/off, any case; anything else raises ValueError."""
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


def check_layer_ids(engram: EngramConfig, backbone: BackBoneConfig) -> None:
    """Engram layers must exist in the backbone: every id in [0, num_layers)."""
    bad = [i for i in engram.layer_ids if i >= backbone.num_layers]
    if bad:
        raise ConfigError(
            f"layer_ids {bad} are outside [0, {backbone.num_layers}) for a backbone with num_layers="
            f"{backbone.num_layers}; ids are 0-based block indices"
        )


def load_config(path: str | os.PathLike) -> tuple[EngramConfig, BackBoneConfig]:
    """Read an `engram_config.json` with sections `engram` and `backbone` (either may be omitted)."""
    p = Path(path)
    data = read_json(p, "config file", "write one with `engram.save_config` or omit --config", ConfigError)
    unknown = sorted(set(data) - {"engram", "backbone"})
    if unknown:
        raise ConfigError(f"unknown section(s) in {p}: {', '.join(unknown)}; valid sections: engram, backbone")
    engram = EngramConfig.from_dict(data.get("engram", {}))
    backbone = BackBoneConfig.from_dict(data.get("backbone", {}))
    check_layer_ids(engram, backbone)
    return engram, backbone


def save_config(path: str | os.PathLike, engram: EngramConfig, backbone: BackBoneConfig) -> None:
    """Write both configs to `path` as JSON (atomically: temp file, then rename)."""
    write_json(path, {"engram": engram.to_dict(), "backbone": backbone.to_dict()}, indent=2)
