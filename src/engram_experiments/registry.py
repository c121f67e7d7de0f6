"""One interface for every evidence experiment (`Experiment`), registered by name.

An experiment is its design (the variants it trains, or its own driver's plan), how it runs them
(`run(options)`: train or reuse, summarize, `--record`), how its record shows on the results page (`table`,
`plot`, the `section` that renders it, the `baseline` row of the generic table) and how a replication trains
its runs again on new seeds (`replication(design, records) -> Runs`). Each experiment module registers its own
(`register`); `engram experiment NAME`, `engram results` and `NAME-replication` look them up here (`get`), so no
code branches on an experiment's name. Records other commands write (`engram stats --record`, the allocation
accounting) register the same way with `run=None`: only their table.

The experiments are loaded on the first lookup (`load`): every module of the `engram.experiments` entry-point group
is imported (this package's `catalog`, first; then other installed packages' in name order), and importing a module
registers its experiments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engram.config import ConfigError


@dataclass(frozen=True)
class Options:
    """What `engram experiment` passes to every experiment's `run`; each reads the fields it uses.

    out: runs go under OUT/NAME/. seeds: seeds per variant (experiments whose design is a preregistration fix
    their own). preset / data / max_steps / size: the preset experiments' model, corpus, steps and sweep size.
    checkpoint: `edit`'s trained model. scale / plan_only / variants_only: allocation's sweep. record: also write
    RECORD/NAME.json. finished_only: train nothing, summarize what finished. jobs: runs trained at once."""

    out: str | Path = "runs/experiments"
    seeds: int = 3
    preset: str = "exp"
    data: list[str] | None = None
    max_steps: int | None = None
    size: str = "default"
    checkpoint: str | None = None
    scale: str = "cpu"
    record: str | Path | None = None
    plan_only: bool = False
    finished_only: bool = False
    variants_only: list[str] | None = None
    jobs: int = 1
    progress: bool = True


@dataclass(frozen=True)
class Experiment:
    """One experiment (or one kind of record) as the commands and the pages use it.

    name: `engram experiment NAME`, the record's file stem (docs/results/NAME.json) and its "experiment" key.
    help: the paragraph `engram experiment --list` prints.
    run: `run(Options) -> summary`; None for a record another command writes (it is not listed or run).
    design: a preset experiment's variants (`preset.Design`); None where the experiment has its own driver.
    table: `table(record) -> markdown`; None: the generic per-variant table (`records.table_markdown`).
    plot: `plot(record, path)`; plot_file: its file name under the page's image folder (`engram results`).
    baseline: the variant every row of the generic table is compared with.
    replication: `replication(design, records) -> replication.Runs`, how `NAME-replication` trains the runs
    again; None: the experiment has no replication.
    section: the heading of docs/results.in.md whose text renders the record (None: not on that page).
    in_all: run by `engram experiment all`."""

    name: str
    help: str
    run: Callable[[Options], dict] | None = None
    design: Any = None
    table: Callable[[dict], str] | None = None
    plot: Callable[[dict, Path], None] | None = None
    plot_file: str | None = None
    baseline: str | None = None
    replication: Callable[[dict, dict], Any] | None = None
    section: str | None = None
    in_all: bool = True


@dataclass
class Runs:
    """How an experiment's replication trains its runs again (what `Experiment.replication` returns): `variants`
    (the names a design may choose, each with what trains it), `table(results)` (the record's table of per-seed
    results), `trainer(design, out, progress, jobs, max_steps) -> ({variant: runs in seed order}, what the record
    adds)`, and the `data` and `max_steps` the runs share where the experiment fixes them."""

    variants: dict
    table: Callable[[dict], dict]
    trainer: Callable[..., tuple[dict, dict]]
    data: list[str] | None = None
    max_steps: int | None = None

    def train(self, design: dict, out, progress: bool, jobs: int, max_steps: int | None) -> tuple[dict, dict]:
        """The design's variants on its seeds."""
        return self.trainer(design, out, progress, jobs, max_steps)


_REGISTRY: dict[str, Experiment] = {}
_ORDER: list[str] = []  # the loaded modules' `ORDER`s: how `all` runs and `--list` shows (else registration order)
_LOADED = False


def load() -> None:
    """Import every module of the `engram.experiments` entry-point group once (this package's `catalog` first):
    each registers its experiments. A missing group means the package is not installed (`pip install -e .`)."""
    global _LOADED
    if _LOADED:
        return
    from importlib.metadata import entry_points

    _LOADED = True
    eps = sorted(entry_points(group="engram.experiments"), key=lambda e: (e.name != "engram", e.name))
    if not eps:
        raise ConfigError("no experiments are registered: install the project (pip install -e .) so the "
                          "engram.experiments entry points exist")
    for ep in eps:
        _ORDER.extend(getattr(ep.load(), "ORDER", ()))


def _ordered() -> list[Experiment]:
    """Every registered experiment: those the loaded modules order (`ORDER`) first, in that order, then the rest in
    registration order."""
    load()
    rank = {n: i for i, n in enumerate(_ORDER)}
    return sorted(_REGISTRY.values(), key=lambda e: rank.get(e.name, len(rank)))


def register(exp: Experiment) -> Experiment:
    """Add `exp` under its name (once: a second registration of a name is a bug)."""
    if exp.name in _REGISTRY:
        raise ValueError(f"experiment {exp.name!r} is registered twice")
    _REGISTRY[exp.name] = exp
    return exp


def find(name: str | None) -> Experiment | None:
    """The experiment or record kind `name`, or None."""
    load()
    return _REGISTRY.get(name) if name else None


def get(name: str) -> Experiment:
    """The runnable experiment `name`, or a one-line error listing them."""
    load()
    exp = _REGISTRY.get(name)
    if exp is None or exp.run is None:
        raise ConfigError(f"unknown experiment {name!r}; choose one of {', '.join(names())} or all "
                          "(or NAME-replication)")
    return exp


def names() -> list[str]:
    """The runnable experiments, in the order `all` runs them."""
    return [e.name for e in _ordered() if e.run is not None]


def experiments() -> list[Experiment]:
    """Every registered experiment and record kind, in the order `all` runs them."""
    return _ordered()


def replicable() -> list[str]:
    """The experiments a `NAME-replication` preregistration may replicate."""
    return [e.name for e in _ordered() if e.replication is not None]


def listing() -> str:
    """`engram experiment --list`: each runnable experiment's paragraph."""
    out = []
    for exp in _ordered():
        if exp.run is None:
            continue
        lines = exp.help.strip().splitlines()
        out.append(f"  {exp.name:<12} {lines[0]}" + "".join(f"\n{'':15}{ln.strip()}" for ln in lines[1:]))
    return "\n".join(out)
