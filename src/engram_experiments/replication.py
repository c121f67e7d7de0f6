"""`engram experiment NAME-replication`: a claim of a recorded experiment (`ablations`, `sensitivity`, `allocation`,
`retrofit`, `edit`: its fact sets, on a base of its recipe, `editing.replicate`) run again on
seeds no committed record used, every choice read from the committed preregistration
`docs/prereg/NAME-replication.toml` (`prereg.py`: `--record` refuses an uncommitted design or a dirty tree).

The preregistration names (keys of its TOML):

* `replicates`: the original experiment (its record `docs/results/<replicates>.json`), `original_family`: the
  label of the results page's family the claim was tested in, `claim`: the claim in words;
* `preset` and `variants`: the runs (only the variants the claim compares; `runs_of` gives their training
  arguments from the original experiment's own plan, so they train exactly as the original's did: a preset
  experiment's `experiments.variants`, or allocation's `allocation.plan` at the design's `scale`, its data, steps
  and training overrides; retrofit's variants are the grid points its selection seed chose, "engram lr 0.003",
  trained by `retrofit.replicate` with retrofit's own `Sweep`);
* `seeds`: the new seed indices. A seed sets the init (`torch.manual_seed`) and the data order (the train
  windows of epoch e in the order `default_rng(seed + e).permutation`, `training.data.Batcher`), so a seed at
  least `ORDER_GAP` from every seed a record used and from each other gives a new init and a data order no other
  run saw (in any epoch below `ORDER_GAP`);
* `[test]`: `family`, the comparisons `[a, b]` (b - a, variant names of the replication's own record, a `#FIELD`
  for a nested value as in sensitivity's `#increase`), each a comparison of the original family (`original_family`:
  a family label of the results page, or `EXP/tests` for an original that tested its own family, retrofit's: its
  rows are matched by points and metric, `a#metric`; `original_tests`); the test
  (paired t over the seeds, Holm over this family, `significance.py`) and what counts as replicated (a finding
  of the original's sign);
* `[power]`: `n_80` and `n` as `power_plan` computes them from the original record: for each comparison the
  original's paired test, its effect (mean difference) and the sd of its per-seed differences; n_80 the smallest
  n at which a paired t-test at alpha / (family size) has 80% power at that effect and sd
  (`significance.n_for_power`); n = max(n_80, the original's n). `run` refuses a design whose `[power]` differs
  from the plan or whose seeds are fewer than n.

The record (`docs/results/NAME-replication.json`) is the original experiment's kind of record (per-seed values
and seeds per variant) plus `replicates`, `prereg` (the stamp), `design` (the file), `power` and `tests` (each
comparison's paired test, its Holm p within the family, `finding`, and `replicated`). The results page renders
it with `{{replication:NAME-replication}}` beside the original family's rows (`report.py`).
"""

from __future__ import annotations

import math
from pathlib import Path

from engram.config import ConfigError
from engram.persist import write_json
from engram.utils import environment

from . import prereg
from . import significance as sig
from .records import experiment_record, table_markdown
from .registry import Runs, find, replicable
from .runs import ExperimentError

SUFFIX = "-replication"
# `engram experiment --list`'s line for replications
LISTING = """a claim of experiment NAME (one of those with a replication) run again on
               seeds (edit: fact sets) no record used, every choice (variants, seeds, n from the power at the
               original effect, the family, the test) read from the committed preregistration
               docs/prereg/NAME-replication.toml; recorded to docs/results/NAME-replication.json beside the
               original (`replication.py`)."""
ORDER_GAP = 100  # a new seed's distance from every used one: no data order shared below this many epochs


def runs_of(design: dict, recs: dict | None = None) -> Runs:
    """The original experiment's runs as its own driver trains them (its `Experiment.replication`): a preset
    experiment's variants at the design's `preset`; allocation's plan at the design's `scale`; retrofit's points its
    selection seed chose in the original record; edit's settings on new fact sets. `recs`: the committed records
    (retrofit and edit read their original's)."""
    exp = find(design.get("replicates"))
    if exp is None or exp.replication is None:
        raise ExperimentError(f"{design.get('replicates')!r} has no replication; replicable: {', '.join(replicable())}")
    return exp.replication(design, recs or {})


def refs(exp: str, family: list) -> list[tuple[str, str]]:
    """The family's comparisons as the page's references `EXP/A`, `EXP/B` (b - a)."""
    return [(f"{exp}/{a}", f"{exp}/{b}") for a, b in family]


def original_tests(design: dict, recs: dict) -> list[sig.TestResult]:
    """The original's test of each comparison of the design's family: recomputed from the original's per-seed
    values (`report.comparison`), or, where the original tested its own family (`original_family` "EXP/tests"), that
    record's row of the same comparison (`report.record_family`)."""
    from .report import comparison, record_family

    family, orig = design["test"]["family"], design["replicates"]
    if design.get("original_family") != f"{orig}/tests":
        return [comparison(recs, ra, rb) for ra, rb in refs(orig, family)]
    rows = {(r["a"], r["b"]): r["test"] for r in record_family(recs[orig], orig)}
    missing = [f"{b} - {a}" for a, b in refs(orig, family) if (a, b) not in rows]
    if missing:
        raise ExperimentError(f"{', '.join(missing)}: not a row of docs/results/{orig}.json's tests (name them "
                              "`POINT#metric`, as its rows' a, b and metric)")
    return [rows[ab] for ab in refs(orig, family)]


def power_plan(design: dict, recs: dict) -> dict:
    """What the replication's n must be, from the original record: for each comparison of the design's family the
    original's paired test (effect = mean difference b - a, sd of the per-seed differences = se * sqrt(n)) and
    n_80, the smallest n at which a two-sided paired t-test at alpha / (family size) (Holm's first step) has
    `significance.POWER` at that effect and sd; n = max(every n_80, the original's n)."""
    family = design["test"]["family"]
    alpha = sig.ALPHA / len(family)
    rows = []
    for (a, b), (ra, rb), t in zip(family, refs(design["replicates"], family), original_tests(design, recs)):
        if t.kind != "paired":
            raise ExperimentError(f"{rb} - {ra}: the original test is {t.label}, not paired; this plan needs the "
                                  "sd of per-seed differences")
        sd = t.se * math.sqrt(t.n_a)
        n80 = sig.n_for_power(t.diff, sd, sig.POWER, alpha)
        rows.append({"a": a, "b": b, "effect": t.diff, "sd": sd, "n_original": t.n_a, "alpha": alpha,
                     "n_80": n80, "power_at_n_80": sig.paired_power(t.diff, sd, n80, alpha)})
    n = max(max(r["n_80"] for r in rows), max(r["n_original"] for r in rows))
    for r in rows:
        r["power_at_n"] = sig.paired_power(r["effect"], r["sd"], n, alpha)
    return {"power": sig.POWER, "comparisons": rows, "n_80": max(r["n_80"] for r in rows), "n": n}


def used_seeds(recs: dict) -> set[int]:
    """Every seed index the records `recs` used (their `seed` and `seeds` fields, wherever they are), less the
    replications' own (a replication's seeds are new when it is preregistered; its record then holds them)."""
    out: set[int] = set()

    def walk(x) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "seed" and isinstance(v, int):
                    out.add(v)
                elif k == "seeds" and isinstance(v, list):
                    out.update(s for s in v if isinstance(s, int))
                elif k == "seeds" and isinstance(v, dict):
                    out.update(s for vs in v.values() if isinstance(vs, list) for s in vs if isinstance(s, int))
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for rec in recs.values():
        if "replicates" not in rec:
            walk(rec)
    return out


def check_design(design: dict, recs: dict, name: str) -> dict:
    """The design's problems as one error, else its power plan: the experiment and variants it names, seeds at
    least `ORDER_GAP` from every seed a record used, `[power]` equal to `power_plan`, at least n seeds."""
    where = f"docs/prereg/{name}.toml"
    orig = design.get("replicates")
    if design.get("experiment") != name or orig not in replicable() or f"{orig}{SUFFIX}" != name:
        raise ExperimentError(f"{where}: experiment must be {name!r} and replicates one of {', '.join(replicable())}")
    if orig not in recs:
        raise ExperimentError(f"{where}: no record docs/results/{orig}.json to replicate")
    known = runs_of(design, recs).variants
    unknown = [v for v in design["variants"] if v not in known]
    if unknown:
        raise ExperimentError(f"{where}: {orig} has no variant {', '.join(unknown)}")
    seeds = design["seeds"]
    close = sorted({s for s in seeds for u in used_seeds(recs) if abs(s - u) < ORDER_GAP} |
                   {s for s in seeds for u in seeds if s != u and abs(s - u) < ORDER_GAP})
    if close or len(set(seeds)) != len(seeds):
        raise ExperimentError(f"{where}: seeds {close or seeds} repeat, or lie within {ORDER_GAP} of each other or of "
                              "a seed a record used (the same init or data order)")
    plan = power_plan(design, recs)
    if {k: design["power"].get(k) for k in ("n_80", "n")} != {"n_80": plan["n_80"], "n": plan["n"]}:
        raise ExperimentError(f"{where}: [power] says n_80 {design['power'].get('n_80')}, n "
                              f"{design['power'].get('n')}; the original record gives {plan['n_80']}, {plan['n']}")
    if len(seeds) < plan["n"]:
        raise ExperimentError(f"{where}: {len(seeds)} seeds, fewer than the n = {plan['n']} the power plan needs")
    return plan


def tests(rec: dict, plan: dict) -> list[dict]:
    """The family's paired tests on the replication's record, Holm-adjusted within it; `replicated`: a finding
    whose difference has the original effect's sign."""
    from .report import family

    name = rec["experiment"]
    rows = family({name: rec}, refs(name, rec["design"]["test"]["family"]))
    out = []
    for r, p in zip(rows, plan["comparisons"]):
        t = r["test"]
        out.append({"a": p["a"], "b": p["b"], "test": t.label, "diff": t.diff, "se": t.se, "df": t.df, "p": t.p,
                    "p_holm": r["p_holm"], "finding": r["finding"],
                    "replicated": bool(r["finding"] and math.copysign(1, t.diff) == math.copysign(1, p["effect"]))})
    return out


def run(name: str, out: str | Path = "runs/experiments", progress: bool = True, record: str | Path | None = None,
        jobs: int = 1, max_steps: int | None = None, repo: Path | None = None) -> dict:
    """Train the preregistered variants on the preregistered seeds (finished runs reused, under OUT as the original
    experiment's runs), test the family and write OUT/NAME/summary.json (and `record`/NAME.json)."""
    from .report import load

    if record is not None and max_steps is not None:
        raise ExperimentError("--max-steps departs from the preregistered design; drop it to --record")
    pre = prereg.load(name, record=record is not None, repo=repo)
    d = pre.design
    recs = load((repo or prereg.repo_root() or Path.cwd()) / "docs" / "results")
    plan = check_design(d, recs, name)
    orig = d["replicates"]
    runs = runs_of(d, recs)
    results, extra = runs.train(d, out, progress, jobs, max_steps)
    table = runs.table
    if any(len(rs) != len(d["seeds"]) for rs in results.values()):
        raise ConfigError(f"{name}: a variant lacks a seed; nothing recorded")
    summary = {"experiment": name, "preset": d.get("preset"), "seeds": len(d["seeds"]),
               "variants": table(results), "environment": environment()}
    rec = experiment_record(summary, results, f"engram experiment {name} --record docs/results")
    rec |= extra | {"replicates": orig, "prereg": pre.stamp(), "design": d, "power": plan}
    rec["tests"] = tests(rec, plan)
    root = Path(out) / name
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "summary.json", rec)
    if record is not None:
        write_json(Path(record) / f"{name}.json", rec)
    if find(orig).table is None:  # an experiment with its own table renders its own record's shape only
        print(table_markdown(rec))
    for t in rec["tests"]:
        print(f"{t['b']} - {t['a']}: {t['diff']:+.4f} ± {t['se']:.4f} ({t['test']}; p {sig.fmt_p(t['p'])}, Holm "
              f"{sig.fmt_p(t['p_holm'])}): {'replicated' if t['replicated'] else 'not replicated'}")
    return rec
