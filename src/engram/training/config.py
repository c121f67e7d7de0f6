"""`TrainConfig`: the training settings of a run (`engram train --set KEY=VALUE` sets any of them; `[train]` of a
job file), and `TRAIN_TABLE_MODES`, where the tables live while training (`table_mode`).

Moved here from `engram.config` (the core holds the model's configs only); `engram.TrainConfig` is the same class,
and `from engram.config import TrainConfig` still works with a `DeprecationWarning`.

Renamed settings (`RENAMED_SETTINGS`): `table_backend` is now `table_mode`, and its value "param" is "ram".
The old spellings still work, with a `DeprecationWarning`: as keywords (`TrainConfig(table_backend="param")`), in
`--set`, a job file's `[train]` and overrides (`current_settings`), and in an old run's run.json (read silently).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass

from ..config import ConfigError, from_section, parse_bool
from ..deprecation import MovedNames
from .tracking import check_report_to

TRAIN_TABLE_MODES = ("ram", "mmap")  # TrainConfig.table_mode: where the tables live while training

RENAMED_SETTINGS = {"table_backend": "table_mode"}  # old training setting -> its name now
RENAMED_VALUES = {"table_mode": {"param": "ram"}}  # setting -> {old value: its spelling now}

# `TRAIN_TABLE_BACKENDS` (the old name of TRAIN_TABLE_MODES, with "param" for "ram"): still works, and warns
__getattr__ = moved = MovedNames(__name__)
moved.add("TRAIN_TABLE_BACKENDS", __name__, ("param", "mmap"), "TRAIN_TABLE_MODES")


def current_settings(settings: dict, warn: bool = True, stacklevel: int = 2) -> dict:
    """Training settings (`--set` items, a job file's `[train]`, overrides, a run.json's "train") with the old
    spellings of `RENAMED_SETTINGS` / `RENAMED_VALUES` renamed; each one found warns once (`DeprecationWarning`,
    pointing `stacklevel` frames up) unless `warn=False` (an old run's own run.json). A setting given under both
    names is a `ConfigError` where the two differ."""
    out = {}
    for key, value in settings.items():
        new = RENAMED_SETTINGS.get(key, key)
        if isinstance(value, str) and value in RENAMED_VALUES.get(new, {}):
            value = RENAMED_VALUES[new][value]
            old, now = f"{key}={settings[key]}", f"{new}={value}"
        else:
            old, now = key, new
        if warn and old != now:
            warnings.warn(f"training setting {old} is deprecated; use {now}", DeprecationWarning,
                          stacklevel=stacklevel)
        if new in out and out[new] != value:
            raise ConfigError(f"{new}={out[new]!r} and its old spelling {key}={settings[key]!r} disagree; "
                              f"give {new} only")
        out[new] = value
    return out


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
    table_mode: str = "ram"  # ram: the tables are parameters (in RAM / on the device); mmap: memory-mapped files
    table_cache_mb: float = 0.0  # mmap: hot-row cache size
    table_dir: str = ""  # mmap: where the table files live (default RUN_DIR/tables)
    # mmap: model (init in RAM, then written: same run as ram) | file (streamed, never in RAM)
    table_init: str = "model"
    table_readahead: bool = True  # mmap: read and journal the next batch's rows on the data pipeline's thread (for
    # files colder than the page cache; with a warm one it costs a few percent here: --set table_readahead=false)
    dense_parallel: str = "ddp"  # --nproc > 1: ddp (replicated dense weights) or fsdp2 (sharded)
    # --report-to: trackers that get every metrics record too ("tensorboard,trackio"; "none"; "": none, and a --resume
    # reports where the run did), `training/tracking.py`
    report_to: str = ""

    def __post_init__(self):
        old = self.table_mode
        self.table_mode = RENAMED_VALUES["table_mode"].get(old, old)
        if self.table_mode != old:
            warnings.warn(f"training setting table_mode={old} is deprecated; use table_mode={self.table_mode}",
                          DeprecationWarning, stacklevel=4)  # (the caller of TrainConfig(...))

    @property
    def table_backend(self) -> str:
        """The deprecated name of `table_mode`, in its old spelling ("param" for "ram")."""
        warnings.warn("TrainConfig.table_backend is deprecated; use .table_mode", DeprecationWarning, stacklevel=2)
        return {"ram": "param"}.get(self.table_mode, self.table_mode)

    def validate(self) -> None:
        for f in ("seq_len", "batch_size", "max_steps", "keep_checkpoints"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f} must be positive, got {getattr(self, f)}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if self.table_mode not in TRAIN_TABLE_MODES:
            raise ConfigError(f"table_mode must be 'ram' or 'mmap', got {self.table_mode!r}")
        if self.table_init not in ("model", "file"):
            raise ConfigError(f"table_init must be 'model' or 'file', got {self.table_init!r}")
        if self.table_init == "file" and self.table_mode != "mmap":
            raise ConfigError("table_init=file needs table_mode=mmap (the tables are created as files)")
        if self.dense_parallel not in ("ddp", "fsdp2"):
            raise ConfigError(f"dense_parallel must be 'ddp' or 'fsdp2', got {self.dense_parallel!r}")
        if self.table_cache_mb < 0:
            raise ConfigError(f"table_cache_mb must be >= 0, got {self.table_cache_mb}")
        check_report_to(self.report_to)  # (a known tracker whose package is installed)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def parse_overrides(cls, items: list[str]) -> dict:
        """`["lr=1e-3", "table_mode=mmap"]` (`--set KEY=VALUE`) -> {"lr": 0.001, ...}, typed like the fields (an old
        spelling, `table_backend=param`, is renamed: `current_settings`)."""
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        out = {}
        for kv in items:
            key, sep, value = kv.partition("=")
            if not sep:
                raise ConfigError(f"--set {kv}: expected KEY=VALUE, e.g. lr=1e-3")
            key, value = next(iter(current_settings({key: value}).items()))
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
        return from_section(cls, current_settings(d) if isinstance(d, dict) else d, "train")


def _old_spellings(init):
    """`TrainConfig(table_backend="param")`: the old spellings as keywords (`current_settings`), each warns once."""

    @functools.wraps(init)
    def inner(self, *args, **kwargs):
        init(self, *args, **current_settings(kwargs, stacklevel=3))

    return inner


TrainConfig.__init__ = _old_spellings(TrainConfig.__init__)
