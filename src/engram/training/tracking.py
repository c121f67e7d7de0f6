"""`--report-to tensorboard|trackio`: every metrics record a run writes to metrics.jsonl also goes to these trackers.

    engram train --preset tiny --report-to tensorboard            # RUN/tb: tensorboard --logdir RUN/tb
    engram adapt --base DIR --out RUN --report-to tensorboard,trackio

The setting is `TrainConfig.report_to` (a comma list; "" or "none": none), so run.json records it, `--set
report_to=...` and a job file's `[train]` take it, and a `--resume` without `--report-to` reports where the run did
(`resumed_report_to`, from `run.open_run`). `run.Run.log` is the one place a record is written: metrics.jsonl, then
`Trackers.log`.

    tensorboard   `torch.utils.tensorboard.SummaryWriter` into RUN/tb, one scalar per record field (train_loss, lr,
                  tok_s, val_loss) at the record's step. A new run starts RUN/tb afresh; a resumed one purges the
                  events past its checkpoint (`purge_step`), as metrics.jsonl drops those records.
    trackio       `trackio.init(project="engram", name=RUN's folder name)`, `trackio.log`, `trackio.finish`: local
                  (trackio's SQLite files under $TRACKIO_DIR, default $HF_HOME/trackio; `trackio show` opens the
                  dashboard), unless the user's environment sends trackio elsewhere ($TRACKIO_SPACE_ID,
                  $TRACKIO_SERVER_URL). trackio's own CPU/GPU sampling is off: the records are the run's. A resumed
                  run continues the trackio run of that name; the points it had past the checkpoint stay there.

Both packages come with `engram-torch[track]`; a missing one is refused when the settings are checked
(`check_report_to`, from `TrainConfig.validate`), before any data is read. Only rank 0 reports (as it alone writes
metrics.jsonl).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from ..config import ConfigError
from ..errors import install_hint
from ..persist import read_json, remove_tree

REPORTERS = ("tensorboard", "trackio")  # what --report-to takes (and "none")
TRACKIO_PROJECT = "engram"
TB_DIR = "tb"  # RUN/tb: the TensorBoard event files


def parse_report_to(spec) -> tuple[str, ...]:
    """The trackers of `spec` ("tensorboard,trackio", a list of such strings, "", "none" or None), in order, each
    once; an unknown name is a one-line `ConfigError` listing the valid ones."""
    items = [spec] if isinstance(spec, str) or spec is None else list(spec)
    names = [n.strip() for item in items for n in str(item or "").split(",") if n.strip()]
    for n in names:
        if n not in (*REPORTERS, "none"):
            raise ConfigError(f"report_to: unknown tracker {n!r}; valid: {', '.join(REPORTERS)}, none "
                              "(e.g. --report-to tensorboard,trackio)")
    if "none" in names and len(set(names)) > 1:
        raise ConfigError(f"report_to={','.join(names)}: 'none' with trackers; give the trackers or none")
    return tuple(dict.fromkeys(n for n in names if n != "none"))


def check_report_to(spec) -> tuple[str, ...]:
    """`parse_report_to`, and each tracker's package importable (found, not imported: this runs where settings are
    checked); a missing one is a one-line `ImportError` naming the extra that installs it."""
    names = parse_report_to(spec)
    for n in names:
        if importlib.util.find_spec(n) is None:
            raise ImportError(f"--report-to {n} needs the {n} package: {install_hint('track')}")
    return names


def resumed_report_to(tcfg, run_dir):
    """`tcfg` (a TrainConfig) of a --resume: with no trackers named (`report_to` ""), those the run in `run_dir`
    was started with, as its run.json records them (none when it cannot be read: `run.setup_run` then says why)."""
    if tcfg.report_to:
        return tcfg
    try:
        train = read_json(Path(run_dir) / "run.json", "run.json", "", ConfigError).get("train")
    except ConfigError:
        return tcfg
    started = train.get("report_to") if isinstance(train, dict) else None
    return dataclasses.replace(tcfg, report_to=str(started)) if started else tcfg


class _TensorBoard:
    """Scalars into RUN/tb through `torch.utils.tensorboard.SummaryWriter`."""

    def __init__(self, run_dir: Path, step: int, config: dict):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(f"--report-to tensorboard needs the tensorboard package: {install_hint('track')}") \
                from None
        log_dir = Path(run_dir) / TB_DIR
        if step == 0:
            remove_tree(log_dir)  # a new run: no events of an earlier attempt in this --out
        # resumed at `step`: events past it are hidden, as metrics.jsonl's records past it are dropped
        self.writer = SummaryWriter(str(log_dir), purge_step=step + 1 if step else None)

    def log(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class _Trackio:
    """One trackio run (project "engram", named after the run dir), local unless the environment says otherwise."""

    def __init__(self, run_dir: Path, step: int, config: dict):
        try:
            import trackio
        except ImportError:
            raise ImportError(f"--report-to trackio needs the trackio package: {install_hint('track')}") from None
        self.trackio = trackio
        trackio.init(project=TRACKIO_PROJECT, name=Path(run_dir).name, config=config,
                     resume="allow" if step else "never", embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, values: dict, step: int) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


_KINDS = {"tensorboard": _TensorBoard, "trackio": _Trackio}


class Trackers:
    """The trackers of one run: `log(record)` sends a metrics.jsonl record's numbers to each at its "step";
    `close()` flushes and ends them (idempotent; `with trackers:` closes them however the block ends).
    `Trackers()`: none (what a run holds until `run.execute` opens its own)."""

    def __init__(self, names=(), run_dir: Path | None = None, step: int = 0, config: dict | None = None):
        """Open `names` (`parse_report_to`) for the run in `run_dir`, starting after `step` (0: a new run; else the
        checkpoint a resumed run continues from); `config`: the run's settings, which trackio stores with the run."""
        self.open: list = []
        try:
            for n in parse_report_to(names):
                self.open.append(_KINDS[n](run_dir, step, config or {}))
        except BaseException:
            self.close()
            raise

    def log(self, record: dict) -> None:
        if not self.open:
            return
        values = {k: float(v) for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for t in self.open:
            t.log(values, int(record["step"]))

    def close(self) -> None:
        while self.open:
            self.open.pop().close()

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
