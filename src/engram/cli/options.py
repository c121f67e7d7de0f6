"""Options several commands take, as argparse parent parsers, and what they load.

Each parent is a small `ArgumentParser(add_help=False)` a command lists in `parents=[...]`, so a flag,
its help and its choices are written once. The choices come from the code that checks them (one
import each, here); those modules are light (no transformers), so `engram --help` stays fast.

`load_for_inference(args)` and `with_overlays(...)` turn the parsed model options into a model.
"""

from __future__ import annotations

import argparse
import sys

from ..config import TABLE_DTYPES
from ..editing.optimize import POSITIONS
from ..placement import DTYPES
from ..tables.quant import TABLE_FORMATS
from ..tables.rows import TIERS as TABLE_TIERS
from ..training.config import RENAMED_VALUES, TRAIN_TABLE_MODES
from ..training.data import SPLITS
from ..training.presets import ADAPT_METHODS as METHODS
from ..training.presets import BASELINES, PRESETS, TRAIN_PRESETS

__all__ = ["BASELINES", "DTYPES", "METHODS", "POSITIONS", "PRESETS", "SPLITS",
           "TABLE_DTYPES", "TABLE_FORMATS", "TABLE_TIERS", "TRAIN_PRESETS", "TRAIN_TABLE_MODES", "DeprecatedFlag",
           "config", "eval_windows", "load_for_inference", "model_source", "no_bos", "overlays", "placed",
           "placement", "preset_metavar", "run_options", "table_format", "table_tier", "train_table_mode",
           "with_overlays"]

CHECKPOINT_HELP = "run dir or save_pretrained folder of an engram model"
BASE_HELP = "a pretrained transformers model folder (with --adapter: plus that adapter)"
ADAPTER_HELP = "Engram adapter folder (or LoRA folder, or an `engram adapt` run dir)"
DTYPE_HELP = ("the dense weights' dtype (default: as saved: float32 for an engram model, a base's checkpoint dtype); "
              "the Engram tables keep theirs (--table-format converts them). On a CPU without native bfloat16 "
              "(AVX512-BF16/AMX) half precision saves memory but runs slower")
DEVICE_HELP = "where the model runs: cpu (default), cuda, cuda:N, mps"
# commands whose own code builds its tensors on the CPU: --device is refused there (one line) until it does not
CPU_ONLY = {"edit": "engram edit optimizes its rows on the CPU"}


def _parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


def preset_metavar() -> str:
    """`{tiny,cpu-small,...}`: the training presets, shown instead of a choices list (validated by the registry)."""
    return "{" + ",".join(TRAIN_PRESETS) + "}"


# ------------------------------------------------------------------------------------------ model options
def model_source(checkpoint: bool = True, base_help: str = BASE_HELP,
                 adapter_help: str = ADAPTER_HELP) -> argparse.ArgumentParser:
    """--checkpoint DIR (an engram model) or --base DIR [--adapter DIR] (a transformers model and an adapter), and
    --dtype / --device (`placement`): what `load_for_inference` loads, in what precision, where."""
    p = placement()
    if checkpoint:
        p.add_argument("--checkpoint", help=CHECKPOINT_HELP)
    p.add_argument("--base", help=base_help)
    p.add_argument("--adapter", help=adapter_help)
    return p


def placement() -> argparse.ArgumentParser:
    """--dtype {float32,bfloat16,float16} and --device of every command that loads a model (`engram.placement`:
    checked before the model loads; left out: as loaded, on the CPU)."""
    p = _parent()
    p.add_argument("--dtype", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--device", help=DEVICE_HELP)
    return p


def overlays() -> argparse.ArgumentParser:
    """--overlay DIR, repeatable: fact overlays applied in order (`with_overlays`)."""
    p = _parent()
    p.add_argument("--overlay", action="append", metavar="DIR",
                   help="apply this engram edit overlay (repeatable: stacked in order; leave out to undo)")
    return p


def table_format() -> argparse.ArgumentParser:
    """--table-format: the rows the Engram tables are served as (`tables.quant.set_table_format`)."""
    p = _parent()
    p.add_argument("--table-format", choices=TABLE_FORMATS,
                   help="serve the Engram tables as these rows (int8/fp8: per-row scale, dequantized after the gather)")
    return p


class DeprecatedFlag(argparse.Action):
    """An old spelling of flag `new`: stores into the same dest, and says once on stderr that it is deprecated
    (`engram: warning: --old is deprecated; use --new`). Hidden from --help. `renamed_values`: old values and their
    spelling now (stored as the new one; the warning names it: `use --new VALUE`)."""

    def __init__(self, option_strings, dest, new: str, renamed_values: dict | None = None, **kwargs):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new, self.renamed_values, self.warned = new, dict(renamed_values or {}), False

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.renamed_values.get(values, values)
        if not self.warned:
            use = f"{self.new} {value}" if value != values else self.new
            print(f"engram: warning: {option_string} is deprecated; use {use}", file=sys.stderr)
            self.warned = True
        setattr(namespace, self.dest, value)


def table_tier() -> argparse.ArgumentParser:
    """--table-tier / --table-dir of the commands that run a model: the tier its Engram table rows are read from
    (`--table-backend`: the deprecated spelling of --table-tier)."""
    p = _parent()
    p.add_argument("--table-tier", default="ram", choices=TABLE_TIERS,
                   help="ram (default), or mmap/disk: the tables as files under --table-dir, read row by row")
    p.add_argument("--table-backend", dest="table_tier", choices=TABLE_TIERS, action=DeprecatedFlag,
                   new="--table-tier")
    p.add_argument("--table-dir", help="where the mmap/disk table files go (an existing file's rows are used)")
    return p


def train_table_mode(help: str) -> argparse.ArgumentParser:
    """--table-mode of `engram train` / `adapt`: the training table mode (TrainConfig.table_mode: "ram", tables as
    parameters, or "mmap", tables and their Adam moments in files), not an inference tier. `--table-backend
    param|mmap` is its deprecated spelling (one warning line; "param" is "ram")."""
    p = _parent()
    p.add_argument("--table-mode", choices=TRAIN_TABLE_MODES, help=f"the training table mode: {help}")
    renamed = RENAMED_VALUES["table_mode"]
    p.add_argument("--table-backend", dest="table_mode", choices=(*renamed, *TRAIN_TABLE_MODES), action=DeprecatedFlag,
                   new="--table-mode", renamed_values=renamed)
    return p


def config() -> argparse.ArgumentParser:
    """--config FILE: the EngramConfig and BackBoneConfig of `engram demo`, `hash` and `spec`."""
    p = _parent()
    p.add_argument("--config", help="engram_config.json with sections 'engram' and 'backbone'")
    return p


def no_bos() -> argparse.ArgumentParser:
    p = _parent()
    p.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token (the tutorial does)")
    return p


def eval_windows(max_windows: int | None, data_help: str | None = None) -> argparse.ArgumentParser:
    """--data, --split, --seq-len, --batch-size, --max-windows: the text windows a model is scored on."""
    p = _parent()
    p.add_argument("--data", action="append", help=data_help)
    p.add_argument("--split", default="val", choices=SPLITS)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-windows", type=int, default=max_windows)
    return p


def run_options(set_help: str = "override a training setting, e.g. lr=1e-3") -> argparse.ArgumentParser:
    """--max-steps, --resume, --device, --set: what `engram train` and `engram adapt` share about a run."""
    p = _parent()
    p.add_argument("--max-steps", type=int)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last good checkpoint")
    p.add_argument("--device", help="cpu | cuda (default: cuda if available)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=set_help)
    return p


# ------------------------------------------------------------------------------------------ what they load
def load_for_inference(args):
    """(model, tokenizer) from --checkpoint (an engram model, or a folder of another registered kind: a qwen4_exp
    folder) or --base [--adapter] (a transformers model), the tables in the tier --table-tier/--table-dir name
    (`inference.load_inference_model`)."""
    from ..inference import load_inference_model

    tables = {"table_tier": getattr(args, "table_tier", None) or "ram",  # (commands without the options: RAM)
              "table_dir": getattr(args, "table_dir", None), **placed(args)}
    if args.base:
        if args.checkpoint:
            raise ValueError("give either --checkpoint (an engram model) or --base [--adapter], not both")
        return load_inference_model(base=args.base, adapter=args.adapter, **tables)
    if args.adapter:
        raise ValueError("--adapter needs --base DIR (the pretrained model it was trained on)")
    if not args.checkpoint:
        raise ValueError("give --checkpoint RUN_DIR (an engram model) or --base DIR [--adapter DIR]")
    return load_inference_model(args.checkpoint, **tables)


def placed(args) -> dict:
    """{"dtype", "device"} of --dtype / --device (None where a command has not the options), refused in one line on a
    command that runs on the CPU only (`CPU_ONLY`)."""
    dtype, device = getattr(args, "dtype", None), getattr(args, "device", None)
    why = CPU_ONLY.get(getattr(args, "command", None))
    if why and device is not None and device != "cpu":
        raise ValueError(f"--device {device}: {why}; leave --device out")
    return {"dtype": dtype, "device": device}


def with_overlays(model, overlay_dirs, table_format=None):
    """--overlay DIR (each checked against the model, then stacked in order: later ones win on shared rows)
    and --table-format (bfloat16, int8 or fp8 rows, dequantized after the gather), in the one order every
    inference path takes (`inference.prepare_inference`)."""
    from ..inference import prepare_inference

    prepare_inference(model, table_format=table_format, overlays={str(d): d for d in overlay_dirs or []})
    return model
