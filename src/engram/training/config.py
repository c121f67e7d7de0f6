"""`TrainConfig`: the training settings of a run (`engram train --set KEY=VALUE` sets any of them; `[train]` of a
job file), and `TRAIN_TABLE_BACKENDS`, where the tables live while training.

Moved here from `engram.config` (the core holds the model's configs only); `engram.TrainConfig` is the same class,
and `from engram.config import TrainConfig` still works with a `DeprecationWarning`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ConfigError, from_section, parse_bool

TRAIN_TABLE_BACKENDS = ("param", "mmap")  # TrainConfig.table_backend: where the tables live while training


@dataclass
class TrainConfig:
    """Training settings of a run (`engram train --set KEY=VALUE` overrides any of them; presets in `presets.py`)."""

    tokenizer: str = "bpe:8192"
    seq_len: int = 256
    batch_size: int = 16
    max_steps: int = 1500
    lr: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    table_lr_mult: float = 5.0
    grad_clip: float = 1.0
    eval_every: int = 0  # 0: every 10% of the run
    eval_max_windows: int = 128
    ckpt_every: int = 250
    keep_checkpoints: int = 2
    seed: int = 0
    table_backend: str = "param"  # param: tables are parameters in RAM / on device; mmap: memory-mapped files
    table_cache_mb: float = 0.0  # mmap: hot-row cache size
    table_dir: str = ""  # mmap: where the table files live (default RUN_DIR/tables)
    # mmap: model (init in RAM, then written: same run as param) | file (streamed, never in RAM)
    table_init: str = "model"
    table_readahead: bool = True  # mmap: read and journal the next batch's rows on the data pipeline's thread (for
    # files colder than the page cache; with a warm one it costs a few percent here: --set table_readahead=false)
    dense_parallel: str = "ddp"  # --nproc > 1: ddp (replicated dense weights) or fsdp2 (sharded)

    def validate(self) -> None:
        for f in ("seq_len", "batch_size", "max_steps", "keep_checkpoints"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f} must be positive, got {getattr(self, f)}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if self.table_backend not in TRAIN_TABLE_BACKENDS:
            raise ConfigError(f"table_backend must be 'param' or 'mmap', got {self.table_backend!r}")
        if self.table_init not in ("model", "file"):
            raise ConfigError(f"table_init must be 'model' or 'file', got {self.table_init!r}")
        if self.table_init == "file" and self.table_backend != "mmap":
            raise ConfigError("table_init=file needs table_backend=mmap (the tables are created as files)")
        if self.dense_parallel not in ("ddp", "fsdp2"):
            raise ConfigError(f"dense_parallel must be 'ddp' or 'fsdp2', got {self.dense_parallel!r}")
        if self.table_cache_mb < 0:
            raise ConfigError(f"table_cache_mb must be >= 0, got {self.table_cache_mb}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def parse_overrides(cls, items: list[str]) -> dict:
        """`["lr=1e-3", "table_backend=mmap"]` (`--set KEY=VALUE`) -> {"lr": 0.001, ...}, typed like the fields."""
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        out = {}
        for kv in items:
            key, sep, value = kv.partition("=")
            if not sep:
                raise ConfigError(f"--set {kv}: expected KEY=VALUE, e.g. lr=1e-3")
            if key not in fields:
                raise ConfigError(f"--set {key}=...: unknown training setting; valid: {', '.join(sorted(fields))}")
            kind = type(fields[key])
            try:
                out[key] = kind(value) if kind is not bool else parse_bool(value)
            except ValueError:
                raise ConfigError(f"--set {key}={value}: expected a {kind.__name__} value") from None
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return from_section(cls, d, "train")
