"""Options several commands take, as argparse parent parsers, and what they load.

Each parent is a small `ArgumentParser(add_help=False)` a command lists in `parents=[...]`, so a flag,
its help and its choices are written once. The choices come from the code that checks them (one
import each, here); those modules are light (no transformers), so `engram --help` stays fast.

`load_for_inference(args)` and `with_overlays(...)` turn the parsed model options into a model.

The grammar every command keeps (docs/cli.md):
- the model: `--checkpoint DIR` (an engram model), or `--base DIR|ORG/NAME [--adapter DIR]` (`model_source`), with
  `--dtype` / `--device`, on every command that loads one;
- a list of values is one comma list: `--layers 1,3`, `--orders 2,3`, `--unfreeze lm_head,embed_tokens`
  (`ListFlag`); a flag that names a file or a setting is repeated: `--data A --data B`, `--set K=V --set K2=V2`,
  `--overlay ...`;
- an overlay is `--overlay [NAME=]DIR` (`overlay_dirs`): NAME is the model id suffix `engram serve` serves it as
  (required there), a label in messages elsewhere;
- Engram fields are `--engram KEY=VALUE` (`engram_fields`), on `train` as on `adapt`;
- an old spelling keeps working and prints one line on stderr naming the new one (`say_deprecated`,
  `DeprecatedFlag`, `ListFlag`).
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
           "HelpFormatter", "ListFlag", "config", "engram_fields", "eval_windows", "load_for_inference",
           "model_source", "no_bos", "overlay_dirs", "overlays", "placed", "placement", "preset_metavar",
           "run_options", "say_deprecated", "table_format", "table_tier", "train_table_mode", "with_overlays"]

CHECKPOINT_HELP = "run dir or save_pretrained folder of an engram model"
BASE_HELP = ("a pretrained transformers model folder, or a model id ORG/NAME[@REVISION] in the local Hugging Face "
             "cache (with --adapter: plus that adapter)")
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
def model_source(base_help: str = BASE_HELP, adapter_help: str = ADAPTER_HELP, checkpoint_help: str = CHECKPOINT_HELP,
                 checkpoint_dest: str = "checkpoint") -> argparse.ArgumentParser:
    """--checkpoint DIR (an engram model) or --base DIR [--adapter DIR] (a transformers model and an adapter), and
    --dtype / --device (`placement`): what `load_for_inference` loads, in what precision, where. Every command that
    loads a model takes them. `checkpoint_dest`: the attribute --checkpoint is parsed into (`engram serve`: `path`,
    the name `integrations.vllm.launcher` reads)."""
    p = placement()
    p.add_argument("--checkpoint", dest=checkpoint_dest, metavar="CHECKPOINT", help=checkpoint_help)
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


OVERLAY_HELP = ("apply this engram edit overlay (repeatable: stacked in order; leave out to undo); NAME=, optional, "
                "names it in messages (as engram serve names per-request overlays)")


def overlays(help: str = OVERLAY_HELP, metavar: str = "[NAME=]DIR") -> argparse.ArgumentParser:
    """--overlay [NAME=]DIR, repeatable: fact overlays (`overlay_dirs`), applied in order at load (`with_overlays`),
    or, on `engram serve`, loaded to be chosen per request as MODEL+NAME (`help`, `metavar`: that command's)."""
    p = _parent()
    p.add_argument("--overlay", action="append", metavar=metavar, help=help)
    return p


def overlay_dirs(specs, need_names: bool = False) -> dict[str, str]:
    """{name: folder} of --overlay values `[NAME=]DIR`, in the order given. Without NAME= the name is the folder
    as given (`need_names`: refused, where the name is what clients ask for: `engram serve`). A value that is an
    existing path is a DIR even with a '=' in it. A name has no '+' (the server's MODEL+NAME); a name given twice
    is refused."""
    from ..inference.prepare import overlay_spec

    out: dict[str, str] = {}
    for spec in specs or []:
        name, d = overlay_spec(spec)
        if name is None:
            if need_names:
                raise ValueError(f"--overlay {spec}: expected NAME=DIR (the name clients send as MODEL+NAME)")
            name = d
        if name in out:
            raise ValueError(f"--overlay {name} given twice")
        out[name] = d
    return out


def table_format() -> argparse.ArgumentParser:
    """--table-format: the rows the Engram tables are served as (`tables.quant.set_table_format`)."""
    p = _parent()
    p.add_argument("--table-format", choices=TABLE_FORMATS,
                   help="serve the Engram tables as these rows (int8/fp8: per-row scale, dequantized after the gather)")
    return p


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, but a `ListFlag` shows its one syntax (`--orders N[,...]`), not the deprecated spaced form it
    still parses (`[N ...]`). Every command's parser uses it (`cli.build_parser`)."""

    def _format_args(self, action, default_metavar):
        if isinstance(action, ListFlag):
            return self._metavar_formatter(action, default_metavar)(1)[0]
        return super()._format_args(action, default_metavar)


def say_deprecated(old: str, new: str) -> None:
    """The one line an old CLI spelling prints on stderr: `engram: warning: OLD is deprecated; use NEW`. (The
    library's own old spellings warn through `engram.deprecation`, as Python's `DeprecationWarning`.)"""
    print(f"engram: warning: {old} is deprecated; use {new}", file=sys.stderr)


class DeprecatedFlag(argparse.Action):
    """An old spelling of flag `new`: stores into the same dest, and says once on stderr that it is deprecated
    (`engram: warning: --old is deprecated; use --new`). Hidden from --help. `renamed_values`: old values and their
    spelling now (stored as the new one; the warning names it: `use --new VALUE`). Also an old positional argument
    (`nargs="?"`, named by `old`: `engram serve PATH`): set only when given, and refused beside its new flag."""

    def __init__(self, option_strings, dest, new: str, renamed_values: dict | None = None, old: str | None = None,
                 **kwargs):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new, self.renamed_values, self.old, self.warned = new, dict(renamed_values or {}), old, False

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.renamed_values.get(values, values)
        old = option_string or self.old
        if option_string is None and getattr(namespace, self.dest, None) is not None:
            parser.error(f"{old} and {self.new}: give the model once, as {self.new} {value}")
        if not self.warned:
            use = f"{self.new} {value}" if value != values or option_string is None else self.new
            say_deprecated(old if option_string else f"{old} ({value})", use)
            self.warned = True
        setattr(namespace, self.dest, value)


class ListFlag(argparse.Action):
    """A list in the CLI's one list syntax, a comma list (`--layers 1,3`), parsed into a list of `item` values.
    The old spellings still parse, each with one deprecation line (`say_deprecated`): items separated by spaces
    (`--orders 2 3`, on a flag that took them: `spaced=True`) and a repeated flag (`--unfreeze a --unfreeze b`); the
    items of every form join in order. A bad item is argparse's one-line usage error."""

    def __init__(self, option_strings, dest, item=str, spaced: bool = False, **kwargs):
        kwargs.setdefault("metavar", f"{'N' if item is int else 'X'}[,...]")
        super().__init__(option_strings, dest, nargs="+" if spaced else None, **kwargs)
        self.item, self.warned = item, False

    def __call__(self, parser, namespace, values, option_string=None):
        values = values if isinstance(values, list) else [values]
        items = []
        for v in values:
            for part in v.split(","):
                try:
                    items.append(self.item(part.strip()))
                except ValueError:
                    raise argparse.ArgumentError(self, f"{part.strip()!r} in {v!r} is not a valid "
                                                 f"{self.item.__name__} (give a comma list, e.g. "
                                                 f"{option_string} {'1,3' if self.item is int else 'a,b'})") from None
        before = getattr(namespace, self.dest, None)
        repeated = before is not None and before is not self.default
        joined = (list(before) if repeated else []) + items
        if not self.warned and (repeated or len(values) > 1):
            old = (f"repeating {option_string}" if repeated else f"{option_string} {' '.join(values)}")
            say_deprecated(old, f"one comma list: {option_string} {','.join(map(str, joined))}")
            self.warned = True
        setattr(namespace, self.dest, joined)


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
    """--max-steps, --resume, --device, --set, --report-to: what `engram train` and `engram adapt` share about a
    run (--report-to: TrainConfig.report_to, `training.tracking`; a comma list, repeating it is deprecated)."""
    p = _parent()
    p.add_argument("--max-steps", type=int)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last good checkpoint")
    p.add_argument("--device", help="cpu | cuda (default: cuda if available)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=set_help)
    p.add_argument("--report-to", action=ListFlag, metavar="tensorboard,trackio|none",
                   help="also send every metrics.jsonl record to these trackers (a comma list; tensorboard: RUN/tb; "
                        "needs engram-torch[track]; default none, or on --resume the run's own)")
    return p


def engram_fields(help: str) -> argparse.ArgumentParser:
    """--engram KEY=VALUE, repeatable: EngramConfig fields (JSON values: 3, [1009,1013], true), on `engram train`
    (the model's `model.engram.KEY`, as --set model.engram.KEY=VALUE) and `engram adapt` (the adapter's)."""
    p = _parent()
    p.add_argument("--engram", action="append", metavar="KEY=VALUE", help=help)
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


def with_overlays(model, specs, table_format=None):
    """--overlay [NAME=]DIR values (`overlay_dirs`; each checked against the model, then stacked in order: later ones
    win on shared rows) and --table-format (bfloat16, int8 or fp8 rows, dequantized after the gather), in the one
    order every inference path takes (`inference.prepare_inference`)."""
    from ..inference import prepare_inference

    prepare_inference(model, table_format=table_format, overlays=overlay_dirs(specs))
    return model
