"""The committed records (`docs/results/*.json`) as the pages show them: how an experiment writes one
(`engram experiment NAME --record DIR`: every variant's per-seed values, the seeds, parameter counts, the val curves
of `iso`, the environments its runs recorded), and each record's table, environment line, plot and machine.
`report.py` renders the pages from them."""

from __future__ import annotations

import datetime
import math
from pathlib import Path

from engram.persist import write_json

from .registry import Experiment, find, register
from .runs import ExperimentError, read_result


# ------------------------------------------------------------------------------------------ recording
def experiment_record(summary: dict, results: dict[str, list[dict]], command: str | None = None) -> dict:
    """What `--record` commits: the summary's table (per-seed values included), each variant's seeds and the
    environments the runs recorded (deduplicated; `run_environment` indexes them)."""
    name = summary["experiment"]
    rec = {"experiment": name, "preset": summary["preset"], "date": datetime.date.today().isoformat(),
           "command": command or f"engram experiment {name} --seeds {summary['seeds']} --record docs/results",
           "variants": summary["variants"], "seeds": {v: [r["seed"] for r in rs] for v, rs in results.items()}}
    steps = sorted({r["step"] for rs in results.values() for r in rs if "step" in r})  # what the runs trained
    if steps:
        rec["steps"] = steps
    envs: list[dict] = []
    rec["run_environment"] = {}
    for v, rs in results.items():
        for r in rs:
            env = r.get("environment")
            if env is None:
                continue
            if env not in envs:
                envs.append(env)
            rec["run_environment"][f"{v}/seed{r['seed']}"] = envs.index(env)
    rec["environments"] = envs
    return rec


def original_record(design: dict, recs: dict) -> dict:
    """The committed record of the experiment a replication's design replicates, or a one-line error."""
    orig = design.get("replicates")
    if not recs or orig not in recs:
        raise ExperimentError(f"no record docs/results/{orig}.json to replicate")
    return recs[orig]


def recorded_runs(path: Path) -> dict[str, list[dict]]:
    """The runs an existing record `path` holds, as `{variant: [{"seed", "val_loss", "environment",
    "recorded": True}]}` (`{}` when there is none): a sweep that adds seeds to a committed record trains only
    the (variant, seed) pairs it lacks and records the others as they were recorded, environments included."""
    path = Path(path)
    if not path.is_file():
        return {}
    rec = read_result(path, "experiment record")
    envs, where = rec.get("environments") or [], rec.get("run_environment") or {}
    out: dict[str, list[dict]] = {}
    for v, seeds in (rec.get("seeds") or {}).items():
        values = rec["variants"][v]["values"]
        if len(values) != len(seeds):
            raise ExperimentError(f"{path}: {v} has {len(values)} values for {len(seeds)} seeds; "
                                  f"delete the file and record the experiment again")
        out[v] = [{"seed": s, "val_loss": x, "recorded": True,
                   "environment": envs[where[f"{v}/seed{s}"]] if f"{v}/seed{s}" in where else None}
                  for s, x in zip(seeds, values)]
    return out


def record_experiment(path: Path, summary: dict, results: dict[str, list[dict]], command: str | None = None,
                      extra: dict | None = None) -> dict:
    """`experiment_record` plus `extra` (what a design adds, such as iso's val curves), written to `path`."""
    rec = experiment_record(summary, results, command) | (extra or {})
    write_json(path, rec)
    return rec


# ------------------------------------------------------------------------------------------ formatting
PM_MAX_PLACES = 8  # the most decimals `fmt_pm` gives a spread too small for its places
PM_ROUNDING = 1e-9  # a spread below this fraction of its value (or of 1) is floating-point rounding: zero


def fmt_pm(value: float, spread: float, places: int = 4, sign: bool = False) -> str:
    """"value ± spread" at `places` decimals, the one format of a mean and its sd (or a difference and its se) on
    the pages; where a spread that is not zero would print as zero at `places` ("± 0.0000"), both to the spread's
    second significant digit instead ("-0.000410 ± 0.000039"; at most `PM_MAX_PLACES` decimals, "± <1e-08" below).
    A spread of zero keeps `places`, as does one of floating-point rounding (below `PM_ROUNDING` of the value: the
    sd of identical values summed in another order)."""
    places = max(0, places)
    if abs(spread) < PM_ROUNDING * max(1.0, abs(value)):
        spread = 0.0
    if spread and float(f"{abs(spread):.{places}f}") == 0:
        places = min(PM_MAX_PLACES, max(places, 1 - math.floor(math.log10(abs(spread)))))
    shown = f"{spread:.{places}f}"
    if spread and float(shown) == 0:
        shown = f"<1e-{places:02d}"
    return f"{value:{'+' if sign else ''}.{places}f} ± {shown}"


def fmt_stat(s: dict) -> str:
    return f"{fmt_pm(s['mean'], s['std'])} (n={s['n']})"


def fmt_env(rec: dict) -> str:
    envs = rec.get("environments") or ([rec["environment"]] if rec.get("environment") else []) or \
        record_environments(rec)
    if not envs:
        return "environment not recorded"
    parts = []
    for e in envs:
        libs = ", ".join(f"{k} {e[k]}" for k in ("torch", "numba", "transformers", "tokenizers") if e.get(k))
        commit = (e.get("commit") or "?")[:7]
        threads = f"{e.get('threads')} thread{'' if e.get('threads') == 1 else 's'}"
        parts.append(f"{libs}, {threads}, {e.get('cpu')}, ENGRAM_FUSED={e.get('ENGRAM_FUSED')}, code at {commit}")
    return "; ".join(parts) if len(parts) == 1 else f"{len(parts)} environments: " + "; ".join(parts)


def table_markdown(rec: dict, name: str | None = None) -> str:
    """The table of record `rec` (`name`: its file's stem, for records without an "experiment" key; a replication's
    table is its original experiment's)."""
    name = rec.get("replicates") or rec.get("experiment", name)
    exp = find(name)
    if exp is not None and exp.table is not None:  # the experiment's own table (edit, retrofit, stats, ...)
        return exp.table(rec).rstrip("\n")
    table = rec["variants"]
    baseline = exp.baseline if exp is not None else None
    if rec.get("quoted"):  # summary statistics kept from runs whose per-seed values were not (allocation-sweep)
        lines = ["| variant | rho | seeds | final val loss (mean ± half-range) | sd used by the tests | vs "
                 f"{baseline or '-'} |", "|---|---|---|---|---|---|"]
        base = table.get(baseline or "")
        for v, r in table.items():
            rho = f"{100 * r['rho']:.1f}%" if r.get("rho") is not None else "-"
            vs = f"{r['mean'] - base['mean']:+.4f}" if base else ""
            lines.append(f"| {v} | {rho} | {r['n']} | {fmt_pm(r['mean'], r['half_range'])} | {r['std']:.4f} | {vs} |")
        return "\n".join(lines)
    base = baseline
    lines = [f"| variant | final val loss (mean ± sd, n) | vs {base} (difference of means) | params | table params |",
             "|---|---|---|---|---|"]
    for v, r in table.items():
        vs = "" if base is None or v == base or base not in table else f"{r['mean'] - table[base]['mean']:+.4f}"
        lines.append(f"| {v} | {fmt_stat(r)} | {vs} | {r['params']:,} | {r['table_params']:,} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ other records' tables
def stats_markdown(rec: dict) -> str:
    """`engram stats --record`'s row usage: one head per order, per table size."""
    lines = ["| order | rows | distinct n-grams | rows used | usage | n-grams sharing their row with another |",
             "|---|---|---|---|---|---|"]
    for u in rec["row_usage"]:
        lines.append(f"| {u['order']} | {u['table_rows']:,} | {u['distinct_ngrams']:,} | {u['rows_used']:,} | "
                     f"{u['row_usage']:.1%} | {u['collision_rate']:.1%} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ environments
def record_environments(rec) -> list[dict]:
    """Every environment a record holds, wherever its writer put it ("environments", "environment", per run)."""
    out: list[dict] = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "environments" and isinstance(v, list):
                    out.extend(e for e in v if isinstance(e, dict) and e not in out)
                elif k == "environment" and isinstance(v, dict):
                    if v not in out:
                        out.append(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(rec)
    return out


def _runs_per_environment(rec: dict) -> dict[int, int]:
    """How many of the record's runs recorded each of its `environments` (where runs point at them by index)."""
    where = rec.get("run_environment")
    idx = list(where.values()) if isinstance(where, dict) else [
        r.get("environment") for r in rec.get("runs", []) if isinstance(r, dict)]
    counts: dict[int, int] = {}
    for i in idx:
        if isinstance(i, int):
            counts[i] = counts.get(i, 0) + 1
    return counts


def machines_markdown(recs: dict[str, dict], pattern: str = "*") -> str:
    """One row per environment the records matching `pattern` (fnmatch, comma-separated) recorded: CPU, threads,
    library versions, which records (and how many of their runs) ran there; records without one say so."""
    from fnmatch import fnmatch

    names = [n for n in sorted(recs) if any(fnmatch(n, p.strip()) for p in pattern.split(","))]
    rows: dict[tuple, dict[str, int]] = {}  # machine -> {record: its runs there}
    bare = []
    for n in names:
        rec, envs = recs[n], record_environments(recs[n])
        if not envs:
            bare.append(n)
        counts = _runs_per_environment(rec) if rec.get("environments") else {}
        keys = set()
        for i, e in enumerate(envs):
            key = (e.get("cpu"), e.get("cpus"), e.get("threads"), e.get("torch"), e.get("numba"),
                   e.get("ENGRAM_FUSED"))
            keys.add(key)
            where = rows.setdefault(key, {})
            where[n] = where.get(n, 0) + counts.get(i, 0)
        if len(keys) == 1 or not counts:  # all its runs on one machine, or no count of them: name it only
            for key in keys:
                rows[key][n] = 0
    total = {n: sum(_runs_per_environment(recs[n]).values()) for n in names}
    lines = ["| CPU (as recorded) | vCPUs | threads | torch | numba | ENGRAM_FUSED | records |",
             "|---|---|---|---|---|---|---|"]
    for (cpu, cpus, threads, torch, numba, fused), who in sorted(rows.items(), key=lambda kv: str(kv[0])):
        named = ", ".join(f"{n} ({k} of {total[n]} runs)" if k else n for n, k in who.items())
        lines.append(f"| {cpu} | {cpus} | {threads} | {torch} | {numba} | {fused} | {named} |")
    if bare:
        lines.append(f"| not recorded | | | | | | {', '.join(bare)} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ plots
class _Figure:
    """One experiment plot: `with _Figure(rec, path) as (ax, table):` draws on `ax`, then titles and saves it
    (nothing without matplotlib)."""

    def __init__(self, rec: dict, path: str | Path):
        self.rec, self.path = rec, path

    def __enter__(self):
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None, self.rec["variants"]
        self.plt = plt
        self.fig, self.ax = plt.subplots(figsize=(7, 4))
        return self.ax, self.rec["variants"]

    def __exit__(self, *exc):
        if exc[0] is None and getattr(self, "ax", None) is not None:
            self.ax.grid(alpha=0.3)
            self.ax.set_title(f"engram experiment {self.rec['experiment']}")
            self.fig.savefig(self.path, dpi=110, bbox_inches="tight")
        if getattr(self, "fig", None) is not None:
            self.plt.close(self.fig)
        return False


def plot_curves(rec: dict, path: str | Path) -> None:
    """Mean val loss vs step per variant (a design with `curves`; bars when the record has none)."""
    if not rec.get("curves"):
        return plot_bars(rec, path)
    import numpy as np

    with _Figure(rec, path) as (ax, _):
        if ax is None:
            return
        for v, curves in rec["curves"].items():
            steps = [s for s, _ in curves[0]]
            mean = np.mean([[x for _, x in c] for c in curves], axis=0)
            ax.plot(steps[1:], mean[1:], "o-", label=f"{v} (mean of {len(curves)} seeds)")
        ax.set_xlabel("step")
        ax.set_ylabel("val loss")
        ax.legend()


def plot_placement(rec: dict, path: str | Path) -> None:
    """Final val loss (± sd over seeds) vs the Engram block."""
    with _Figure(rec, path) as (ax, table):
        if ax is None:
            return
        xs = list(range(len(table)))
        ax.errorbar(xs, [table[v]["mean"] for v in table], yerr=[table[v]["std"] for v in table], fmt="o-", capsize=3)
        ax.set_xticks(xs, list(table))
        ax.set_xlabel("Engram block (0-based)")
        ax.set_ylabel("final val loss (± sd)")


def plot_capacity(rec: dict, path: str | Path) -> None:
    """Final val loss (± sd) vs rows per head, log scale, beside the no-Engram baseline."""
    with _Figure(rec, path) as (ax, table):
        if ax is None:
            return
        pts = sorted((int(v[4:]), table[v]) for v in table if v.startswith("rows"))
        ax.errorbar([p for p, _ in pts], [t["mean"] for _, t in pts], yerr=[t["std"] for _, t in pts], fmt="o-",
                    capsize=3, label="Engram")
        if "no-engram" in table:
            t = table["no-engram"]
            ax.axhline(t["mean"], color="gray", ls="--", label="no Engram (± sd shaded)")
            ax.axhspan(t["mean"] - t["std"], t["mean"] + t["std"], color="gray", alpha=0.15)
        ax.set_xscale("log")
        ax.set_xlabel("rows per head")
        ax.set_ylabel("final val loss (± sd)")
        ax.legend()


def plot_sensitivity(rec: dict, path: str | Path) -> None:
    """The val loss increase when Engram is suppressed, per token category."""
    with _Figure(rec, path) as (ax, table):
        if ax is None:
            return
        cats = list(table)
        ax.bar(cats, [table[c]["increase"]["mean"] for c in cats], yerr=[table[c]["increase"]["std"] for c in cats],
               capsize=3)
        ax.set_ylabel("val loss increase when Engram is suppressed")


def plot_bars(rec: dict, path: str | Path) -> None:
    """Each variant's final val loss (± sd over seeds) as a horizontal bar."""
    with _Figure(rec, path) as (ax, table):
        if ax is None:
            return
        vs = list(table)
        ax.barh(vs, [table[v]["mean"] for v in vs], xerr=[table[v]["std"] for v in vs], capsize=3)
        lo = min(table[v]["mean"] for v in vs)
        ax.set_xlim(lo - 0.1, max(table[v]["mean"] for v in vs) + 0.05)
        ax.set_xlabel("final val loss (± sd)")


register(Experiment("stats", "`engram stats --record`: row usage and collisions per order and table size",
                    table=lambda rec: stats_markdown(rec), section="7"))
