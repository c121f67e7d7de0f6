"""`engram results`: docs/results.md and its plots, regenerated from the per-seed files in docs/results/.

`engram experiment NAME --record docs/results` writes `docs/results/NAME.json`: every variant's final val
loss for every seed, the seeds, parameter counts, the val curves (iso), and the environment each run
recorded (library versions, threads, CPU, ENGRAM_FUSED, commit). `docs/results.in.md` is the text of
the results page; `render` fills its placeholders from those files, so every number in a table or a
"finding" comes from the committed per-seed values:

    {{table:EXP}}           the experiment's table: mean ± sample sd (n), the difference to its baseline ± its
                            standard error and the verdict (a finding only beyond two standard errors)
    {{stat:EXP/VARIANT}}    "4.6593 ± 0.0118 (n=3)"; EXP/VARIANT#FIELD for a nested one (sensitivity's #increase)
    {{diff:EXP/A:EXP/B}}    B - A: "+0.0253 ± 0.0081 (se): a finding (beyond 2 se)" or "...: no difference
                            at this scale"
    {{env:EXP}}             the environment the experiment's runs recorded

`main` (the CLI) writes docs/results.md and the plots docs/img/exp-EXP.png; `--check` only compares.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

from ..persist import atomic_write_bytes, write_json
from .runs import ExperimentError, difference, read_result

# the row every other row of an experiment's table is compared with
BASELINE = {"iso": "no-engram", "placement": "block1", "capacity": "no-engram", "ablations": "full",
            "design": "reference", "allocation": "moe-E16"}


# experiments whose module renders its own table and plot (`markdown(rec)`, `plot(rec, path)`) from the record
OWN_REPORT = {"edit": "editing", "retrofit": "retrofit"}


def _own_report(name: str):
    from importlib import import_module

    return import_module(f".{OWN_REPORT[name]}", __package__)


# ------------------------------------------------------------------------------------------ recording
def experiment_record(summary: dict, results: dict[str, list[dict]], command: str | None = None) -> dict:
    """What `--record` commits: the summary's table (per-seed values included), each variant's seeds, the val
    curves of `iso`, and the environments the runs recorded (deduplicated; `run_environment` indexes them)."""
    name = summary["experiment"]
    rec = {"experiment": name, "preset": summary["preset"], "date": datetime.date.today().isoformat(),
           "command": command or f"engram experiment {name} --seeds {summary['seeds']} --record docs/results",
           "variants": summary["variants"], "seeds": {v: [r["seed"] for r in rs] for v, rs in results.items()}}
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
    if name == "iso":
        rec["curves"] = {v: [[[m["step"], m["val_loss"]] for m in r["metrics"] if "val_loss" in m] for r in rs]
                         for v, rs in results.items()}
    return rec


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


def record_experiment(path: Path, summary: dict, results: dict[str, list[dict]], command: str | None = None) -> dict:
    rec = experiment_record(summary, results, command)
    write_json(path, rec)
    return rec


# ------------------------------------------------------------------------------------------ formatting
def fmt_stat(s: dict) -> str:
    return f"{s['mean']:.4f} ± {s['std']:.4f} (n={s['n']})"


def fmt_diff(a: dict, b: dict) -> str:
    """b - a with its standard error and the verdict of the two-standard-error rule."""
    d = difference(a, b)
    verdict = "a finding (beyond 2 se)" if d["finding"] else "no difference at this scale"
    return f"{d['diff']:+.4f} ± {d['se']:.4f} (se): {verdict}"


def fmt_env(rec: dict) -> str:
    envs = rec.get("environments") or ([rec["environment"]] if rec.get("environment") else [])
    if not envs:
        return "environment not recorded"
    parts = []
    for e in envs:
        libs = ", ".join(f"{k} {e[k]}" for k in ("torch", "numba", "transformers", "tokenizers") if e.get(k))
        commit = (e.get("commit") or "?")[:7]
        parts.append(f"{libs}, {e.get('threads')} threads, {e.get('cpu')}, ENGRAM_FUSED={e.get('ENGRAM_FUSED')}, "
                     f"code at {commit}")
    return "; ".join(parts) if len(parts) == 1 else f"{len(parts)} environments: " + "; ".join(parts)


def table_markdown(rec: dict) -> str:
    name = rec["experiment"]
    if name in OWN_REPORT:  # edit: methods x metrics over fact sets; retrofit: the sweep and chosen points
        return _own_report(name).markdown(rec).rstrip("\n")
    table = rec["variants"]
    if name == "sensitivity":
        lines = ["| token category | tokens | loss with Engram | Engram suppressed | increase (mean ± sd, n) |",
                 "|---|---|---|---|---|"]
        for cat, r in table.items():
            lines.append(f"| {cat} | {r['tokens']:,} | {r['on']['mean']:.3f} | {r['off']['mean']:.3f} | "
                         f"{r['increase']['mean']:+.3f} ± {r['increase']['std']:.3f} (n={r['increase']['n']}) |")
        return "\n".join(lines)
    base = BASELINE.get(name)
    lines = [f"| variant | final val loss (mean ± sd, n) | vs {base} (± se) | params | table params |",
             "|---|---|---|---|---|"]
    for v, r in table.items():
        vs = "" if base is None or v == base or base not in table else fmt_diff(table[base], r)
        lines.append(f"| {v} | {fmt_stat(r)} | {vs} | {r['params']:,} | {r['table_params']:,} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ rendering
def load(results_dir: str | Path) -> dict[str, dict]:
    out = {}
    for f in sorted(Path(results_dir).glob("*.json")):
        rec = read_result(f, "experiment record")
        out[rec.get("experiment", f.stem)] = rec
    return out


def _stat(recs: dict, ref: str) -> dict:
    """`EXP/VARIANT` (or `EXP/VARIANT#FIELD` for a nested statistic, e.g. sensitivity's `#increase`)."""
    exp, _, variant = ref.partition("/")
    variant, _, sub = variant.partition("#")
    try:
        return recs[exp]["variants"][variant][sub] if sub else recs[exp]["variants"][variant]
    except KeyError:
        raise KeyError(f"{ref!r}: no such experiment/variant in the per-seed files") from None


def render(template: str, recs: dict[str, dict]) -> str:
    def rec(name: str) -> dict:
        if name not in recs:
            raise KeyError(f"no per-seed file for experiment {name!r} (engram experiment {name} --record DIR)")
        return recs[name]

    def fill(m: re.Match) -> str:
        kind, arg = m.group(1), m.group(2)
        if kind == "table":
            return table_markdown(rec(arg))
        if kind == "stat":
            return fmt_stat(_stat(recs, arg))
        if kind == "diff":
            a, b = arg.split(":")
            return fmt_diff(_stat(recs, a), _stat(recs, b))
        if kind == "env":
            return fmt_env(rec(arg))
        raise ValueError(f"unknown placeholder {{{{{kind}:{arg}}}}}")

    return re.sub(r"\{\{(table|stat|diff|env):([^}]+)\}\}", fill, template)


# ------------------------------------------------------------------------------------------ plots
def plot(rec: dict, path: str | Path) -> None:
    """The experiment's plot from its record (error bars: sample standard deviation over seeds)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    import numpy as np

    name, table = rec["experiment"], rec["variants"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if name == "iso" and rec.get("curves"):
        for v, curves in rec["curves"].items():
            steps = [s for s, _ in curves[0]]
            mean = np.mean([[x for _, x in c] for c in curves], axis=0)
            ax.plot(steps[1:], mean[1:], "o-", label=f"{v} (mean of {len(curves)} seeds)")
        ax.set_xlabel("step")
        ax.set_ylabel("val loss")
        ax.legend()
    elif name == "placement":
        xs = list(range(len(table)))
        ax.errorbar(xs, [table[v]["mean"] for v in table], yerr=[table[v]["std"] for v in table], fmt="o-", capsize=3)
        ax.set_xticks(xs, list(table))
        ax.set_xlabel("Engram block (0-based)")
        ax.set_ylabel("final val loss (± sd)")
    elif name == "capacity":
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
    elif name == "sensitivity":
        cats = list(table)
        ax.bar(cats, [table[c]["increase"]["mean"] for c in cats], yerr=[table[c]["increase"]["std"] for c in cats],
               capsize=3)
        ax.set_ylabel("val loss increase when Engram is suppressed")
    else:
        vs = list(table)
        ax.barh(vs, [table[v]["mean"] for v in vs], xerr=[table[v]["std"] for v in vs], capsize=3)
        lo = min(table[v]["mean"] for v in vs)
        ax.set_xlim(lo - 0.1, max(table[v]["mean"] for v in vs) + 0.05)
        ax.set_xlabel("final val loss (± sd)")
    ax.grid(alpha=0.3)
    ax.set_title(f"engram experiment {name}")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------------ CLI
def main(results_dir: str, template: str, out: str, img: str = "", check: bool = False) -> int:
    """Write `out` (and the plots into `img`) from `template` and the per-seed files; `check`: exit 1 if stale."""
    recs = load(results_dir)
    tpath = Path(template)
    if not tpath.is_file():
        print(f"engram: no template {template}; run from the repository root or pass --template")
        return 1
    text = render(tpath.read_text(encoding="utf-8"), recs)
    if check:
        current = Path(out).read_text(encoding="utf-8") if Path(out).is_file() else ""
        if current != text:
            print(f"engram: {out} is not what {template} and {results_dir}/ give; run `engram results`")
            return 1
        print(f"{out} is up to date with {len(recs)} per-seed files")
        return 0
    atomic_write_bytes(Path(out), text.encode("utf-8"))
    if img:
        for name, rec in recs.items():
            if name in ("iso", "placement", "capacity", "ablations", "sensitivity", "allocation"):
                plot(rec, Path(img) / f"exp-{name}{'-4seeds' if name == 'allocation' else ''}.png")
            elif name in OWN_REPORT:
                _own_report(name).plot(rec, Path(img) / f"{name}.png")
    print(f"wrote {out} from {len(recs)} per-seed files" + (f" and their plots in {img}/" if img else ""))
    return 0
