"""`engram experiment fact-edits-editors`: issue 56's Engram edit against the field's other editors (MEMIT, LoRA,
fine-tuning with neighbours held as data, and FT-L at a bound that edits), on the fact-edits design.

fact-edits (docs/prereg/fact-edits.toml, `fact_edits.py`) compared the chosen Engram overlay (subject+trigger+ctx)
with GRACE, ROME and FT-L; FT-L at ROME's GPT-2 XL bound edited nothing on SmolLM2. This design adds the editors it
left out, each at a setting chosen by one rule on the selection split before any of its test runs:

* `pilot` (exploratory, the fact-edits pilot's two selection sets, optimized on selection template 0 and measured
  on template 1): every setting of `GRID` on both sets; `choose` applies the rule per editor.
* `locality-pilot` (exploratory, the same two sets and templates): two ways to close the chosen edit's locality gap
  to GRACE, beside the chosen edit rerun at this commit and the fact-edits pilot's own runs of GRACE and the unedited
  model (read from its record, docs/results/fact-edits-pilot.json): holding known facts of the relation through the
  shared rows (`subject+trigger+ctx+keep`, `edit_facts(keep=...)`, at the weights of `KEEP_GRID`), and writing the
  subject's rows only (`subject+ctx`: no row of the prompt's end, which a relation's early-subject prompts share).
* `tie-pilot` (exploratory, the same two sets and templates): why held-out wordings are missed (`rows_read`: the
  edited rows a wording reads at its subject, against whether it was reached). Engram has no order-1 rows, so a
  one-token subject's rows all hold the word before it ("of France" and "in France" are different rows); the arms
  write the subject's rows only (`subject+ctx`, rerun at this commit), its order-2 rows only (`subject2+ctx`), and
  those tied across a fixed list of contexts (`subject2+tie+ctx`, `edit_facts(tie=fact_edits.TIE)`), beside the
  fact-edits pilot's GRACE and unedited runs.
* `test` (confirmatory, docs/prereg/fact-edits-editors.toml): the chosen settings on fact-edits' 23 test sets, with
  its probes, measures and held-out templates (`fact_edits.run_one`, unchanged). The chosen Engram variant is not
  rerun: its per-fact runs are read from the committed record docs/results/fact-edits.json, and `guard` first
  reruns the unedited model on two test sets and stops unless every per-fact outcome and probe equals the record's
  (the code measures as it did). Each new run's probes must equal the record's run of its set.
* `subject-test` (confirmatory, docs/prereg/fact-edits-subject.toml): the edit written at the subject's rows only
  (`subject+ctx`, the locality pilot's candidate) on the 23 test sets against the record's GRACE runs, after a guard
  that reruns the unedited model and GRACE on two test sets (GRACE is rerun on every set if it differs).
* `subject2-test` (confirmatory, docs/prereg/fact-edits-subject2.toml): the subject's order-2 rows only
  (`subject2+ctx`, the tie pilot's reading) against all its orders (`subject+ctx`, reused from the fact-edits-subject
  record after the same guard) on the 23 test sets: reach against same-relation and same-subject locality.

Every (set, method) run is cached under OUT/fact-edits/editors-pilot|editors/runs and resumed, as in fact_edits.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from engram.persist import read_json, write_json

from . import fact_edits as fe
from .registry import Experiment, register
from .runs import ExperimentError, options_argv

NAME = "fact-edits-editors"
RECORD = "docs/results/fact-edits.json"  # the fact-edits test whose sets, probes and chosen runs this reuses
GRID = {  # per editor, the settings the pilot tries (method names `fact_edits.method_named` runs; numbers without a
    # decimal point, so a name is one step of a page placeholder's dotted path)
    "ft-l": [f"ft-l@eps={e},lr={e}" for e in ("1e-3", "2e-3", "5e-3", "1e-2", "2e-2", "5e-2")],
    "lora": ["lora@lr=1e-3", "lora@lr=5e-3"],
    "ft-neighbours": ["ft-neighbours@lr=5e-4", "ft-neighbours@lr=2e-3"],
    "memit": ["memit@mom2_update_weight=1500", "memit@mom2_update_weight=15000"],
}
KEEP_GRID = ["subject+trigger+ctx+keep@keep_weight=1", "subject+trigger+ctx+keep@keep_weight=4"]
LOCALITY_ARMS = ["subject+ctx", *KEEP_GRID]  # the locality pilot's arms beside the chosen edit
TIE_ARMS = ["subject+ctx", "subject2+ctx", "subject2+tie+ctx"]  # the tie pilot's arms
PILOT_RECORD = "docs/results/fact-edits-pilot.json"  # the fact-edits pilot, whose runs the locality pilot sits beside
LOCALITY_REUSED = ("none", "grace")  # the fact-edits pilot's runs the locality pilot reads beside its own
PILOT_RELATIONS = ["atomic_number", "city_country"]  # fact-edits' pilot sets (fact_edits.PILOT)
GUARD_SETS = 2  # test sets on which the unedited model is measured again and compared with the record
SUBJECT = "fact-edits-subject"  # the subject's-rows edit against GRACE (docs/prereg/fact-edits-subject.toml)
SUBJECT_RECORD = f"docs/results/{SUBJECT}.json"
SUBJECT_MARGIN = 0.02  # the subject test's non-inferiority margin: its prereg's [test] family (a test holds them equal)
SUBJECT2 = "fact-edits-subject2"  # order-2 subject rows against every order (docs/prereg/fact-edits-subject2.toml)


def choose(s: dict, settings: list[str]) -> str | None:
    """The preregistered rule (docs/prereg/fact-edits-editors.toml [choice], fact-edits' rule for the Engram
    variant): among `settings` with mean efficacy >= 0.8 and mean same-relation locality >= 0.8, the highest mean
    of (held-out paraphrases, chat answers naming the new object); if none passes both bars, the highest efficacy +
    same-relation locality. Ties: the earlier setting in the grid. None when the pilot ran none of them."""
    t = {v: s["table"][v] for v in settings if v in s["table"]}
    if not t:
        return None
    ok = [v for v in t if t[v]["efficacy"]["mean"] >= 0.8 and t[v]["same_relation"]["mean"] >= 0.8]
    if ok:
        return max(ok, key=lambda v: (t[v]["paraphrases"]["mean"] + t[v]["chat_new"]["mean"]) / 2)
    return max(t, key=lambda v: t[v]["efficacy"]["mean"] + t[v]["same_relation"]["mean"])


def reuse_record(root: Path, record: dict, method: str, source: str = RECORD) -> int:
    """Write `method`'s runs of `record` (the file `source`) into root/runs (environment restored, `from_record`
    added) where absent; how many it wrote."""
    n = 0
    for r in record["runs"]:
        if r["method"] != method:
            continue
        f = root / "runs" / f"{r['set']}--{method}.json"
        if not f.is_file():
            env = r.get("environment")
            write_json(f, {**r, "environment": record["environments"][env] if env is not None else None,
                           "from_record": source})
            n += 1
    return n


def _same(a: dict, b: dict) -> list[str]:
    """Where run `a`'s per-fact outcomes and probes differ from run `b`'s (text-loss changes within 1e-4)."""
    bad = [k for k in ("facts", "same_relation", "shared_ngram", "probes") if a[k] != b[k]]
    for k in ("text_change", "text_change_shared"):
        if (a[k] is None) != (b[k] is None) or (a[k] is not None and abs(a[k] - b[k]) > 1e-4):
            bad.append(k)
    return bad


def guard(s, root: Path, record: dict, sets: dict, opt: str, held: str, neighbours: int, seed: int,
          also: tuple[str, ...] = (), source: str = RECORD) -> list[str]:
    """Measure the unedited model (and the methods `also`) on the first `GUARD_SETS` test sets at this commit and stop
    unless each unedited run equals the record's `none` run of its set; the methods of `also` whose runs differ from
    the record's (the caller reruns those rather than reuse them)."""
    differ = []
    for m in ("none", *also):
        old = {r["set"]: r for r in record["runs"] if r["method"] == m}
        for name in list(sets)[:GUARD_SETS]:
            r = fe.run_one(s, root / "guard", name, sets[name], m, opt, held, neighbours, seed, False)
            bad = _same(r, old[name])
            if bad and m == "none":
                raise ExperimentError(f"the unedited model measured at this commit differs from {source} on {name} "
                                      f"({', '.join(bad)}): the measures changed; run at the record's commit")
            if bad and m not in differ:
                differ.append(m)
    return differ


def _rerun(folder: Path) -> list[str]:
    """The reused methods the guard found to differ from the record at this commit (rerun on every set instead)."""
    f = folder / "guard.json"
    return read_json(f, "the guard's verdict", f"delete {f}", ExperimentError)["differ"] if f.is_file() else []


def locality_power(s: dict, method: str, margin: float = SUBJECT_MARGIN, family: int = 3) -> dict:
    """What the record's own spread implies for the non-inferiority test of `method` vs GRACE on same-relation
    locality: the sd of the per-set differences and the test's power at `margin` for a true difference of 0
    (noncentral t, alpha 0.05 / `family`, Holm's strictest step), as docs/prereg/fact-edits-subject.toml's power
    plan computed it for assumed sds."""
    from scipy import stats

    per = {m: {r["set"]: r["summary"]["same_relation"] for r in s["runs"] if r["method"] == m}
           for m in (method, "grace")}
    common = sorted(set(per[method]) & set(per["grace"]))
    d = [per[method][x] - per["grace"][x] for x in common]
    sd = statistics.stdev(d) if len(d) > 1 else 0.0
    n = len(d)
    if sd == 0 or n < 2:
        return {"n": n, "sd": sd, "power": None}
    crit = stats.t.ppf(1 - 0.05 / family, n - 1)
    return {"n": n, "sd": sd, "power": float(1 - stats.nct.cdf(crit, n - 1, margin / (sd / math.sqrt(n))))}


def check_probes(summary: dict, record: dict, source: str = RECORD) -> None:
    """Every run's probes equal the record's run of its set (one measurement design for all methods)."""
    old = {r["set"]: r["probes"] for r in record["runs"] if r["method"] == "none"}
    bad = sorted({r["set"] for r in summary["runs"] if r["probes"] != old.get(r["set"])})
    if bad:
        raise ExperimentError(f"runs of {', '.join(bad)} probe other facts than {source}: delete them and rerun")


def power(s: dict, chosen: str, others: list[str], metrics=("paraphrases", "chat_new", "same_relation"),
          n: int = 23, family: int = 3 * len(GRID)) -> dict:
    """What the test of n sets can detect at 80% power (two-sided, alpha 0.05 / `family`, Holm's strictest step;
    the test's family is every editor of `GRID` on 3 measures), with each difference's sd over `s`'s sets (the
    fact-edits record: chosen - GRACE / ROME)."""
    from scipy import stats

    runs = {(r["set"], r["method"]): r["summary"] for r in s["runs"]}
    sets = sorted({r["set"] for r in s["runs"]})
    sds = {}
    for o in others:
        for k in metrics:
            d = [runs[(x, chosen)][k] - runs[(x, o)][k] for x in sets if (x, o) in runs and (x, chosen) in runs]
            if len(d) > 1:
                sds[f"{o}/{k}"] = statistics.stdev(d)
    t = stats.t.ppf(1 - 0.05 / family / 2, n - 1) + stats.t.ppf(0.8, n - 1)
    return {"n": n, "family": family, "sd": sds, "detectable": {k: float(t * v / math.sqrt(n)) for k, v in sds.items()}}


def subject_orders_read(model, tok, rows: dict, text: str, subject: str) -> int:
    """The highest n-gram order of an edited row (`rows`: {layer: row ids}) that `text` reads at its subject's tokens;
    0 when it reads none there."""
    import numpy as np

    from engram.editing import Fact, mapping_of, table_rows_read
    from engram.editing.optimize import subject_positions

    K = mapping_of(model).n_head_per_ngram
    pos = subject_positions(tok, Fact(text, " x", subject=subject))  # (P,) the subject's tokens
    read = table_rows_read(model, np.asarray([tok.encode(text, add_special_tokens=False).ids]))  # {layer: (1, T, H)}
    hit = torch.zeros(read[next(iter(read))].shape[-1], dtype=torch.bool)  # (H,) heads: order 2's K, then order 3's
    for lid, r in rows.items():
        hit |= torch.isin(read[lid][0][pos], r).any(0)
    return max([o + 2 for o in range(len(hit) // K) if hit[o * K:(o + 1) * K].any()], default=0)


def rows_read(s, runs: list[dict], method: str, opt: str, held: str) -> dict:
    """Per held-out wording of every fact `method` edited in `runs`: the highest order of the edited rows it reads
    at its subject (`subject_orders_read`, 0: none) against whether it was answered with the new object. Returns
    {order: {"reached": k, "n": n}}: why a wording is or is not reached, from the hash spec alone."""
    from engram.editing import edit_rows

    spec = fe.METHODS[method].rows
    by_id = {f.id: f for f in s.facts}
    out: dict[str, dict] = {}
    for run in runs:
        if run["method"] != method:
            continue
        for pf in run["facts"]:
            f = by_id[pf["id"]]
            rows = edit_rows(s.model, s.tok, fe.method_facts(f, spec["contexts"], opt), spec["positions"],
                             spec["orders"], spec["tie"])
            for text, hit in zip(fe.templates(f, held), pf["paraphrases"]):
                cell = out.setdefault(str(subject_orders_read(s.model, s.tok, rows, text, f.subject)),
                                      {"reached": 0, "n": 0})
                cell["reached"] += bool(hit)
                cell["n"] += 1
    return dict(sorted(out.items()))


def committed(rel: str, what: str) -> dict:
    """A committed record of this checkout (`rel` from the repo root), or a one-line error naming it."""
    from . import prereg

    return read_json(Path(prereg.repo_root() or ".") / rel, what, f"restore {rel} from git", ExperimentError)


def _phase(name: str, rec: dict, record: bool) -> SimpleNamespace:
    """What phase `name` runs: its experiment name, folder, methods, split and templates, the design it records, the
    reused runs (record file, its summary, methods) and its preregistration (None for a pilot)."""
    from . import prereg

    d = rec["design"]
    seed, neighbours, size = d["facts"].get("seed", 0), d["measures"]["neighbours"], d["facts"]["set_size"]
    pilot_split = dict(opt="selection-0", held="selection-1", split="selection", count=2, rels=PILOT_RELATIONS)
    test_split = dict(opt="selection", held="test", split="test", count=d["test_sets"],
                      rels=d["facts"]["test_relations"])
    common = dict(seed=seed, neighbours=neighbours, size=size, pre=None, source=RECORD, reused_record=rec)
    if name in ("pilot", "locality-pilot", "tie-pilot"):
        methods = {"pilot": [m for ms in GRID.values() for m in ms], "locality-pilot": [d["chosen"], *LOCALITY_ARMS],
                   "tie-pilot": TIE_ARMS}[name]
        design = {"sets": 2, "size": size, "neighbours": neighbours, "seed": seed, "relations": PILOT_RELATIONS,
                  "methods": methods}
        if name == "pilot":
            return SimpleNamespace(**common, **pilot_split, experiment=f"{NAME}-pilot", folder="editors-pilot",
                                   methods=methods, design=design, reused=[])
        pilot = committed(PILOT_RECORD, "the fact-edits pilot record")
        design["reused"] = {"from": PILOT_RECORD, "methods": list(LOCALITY_REUSED)}
        return SimpleNamespace(**{**common, "source": PILOT_RECORD, "reused_record": pilot}, **pilot_split,
                               experiment=f"{NAME}-{name}", folder=name, methods=methods,
                               design=design, reused=list(LOCALITY_REUSED))
    if name == "subject2-test":
        pre = prereg.load(SUBJECT2, record=record)
        subject = committed(SUBJECT_RECORD, "the fact-edits-subject record")
        return SimpleNamespace(**{**common, "pre": pre, "source": SUBJECT_RECORD, "reused_record": subject},
                               **test_split, experiment=SUBJECT2, folder="subject2", methods=[pre.design["method"]],
                               design=pre.design, reused=list(pre.design["reused"]))
    if name == "subject-test":
        pre = prereg.load(SUBJECT, record=record)
        return SimpleNamespace(**{**common, "pre": pre}, **test_split, experiment=SUBJECT, folder="subject",
                               methods=[pre.design["method"]], design=pre.design,
                               reused=[*pre.design["reused"], d["chosen"]])  # the chosen edit: descriptive
    pre = prereg.load(NAME, record=record)
    if pre.design.get("chosen") is None:
        raise ExperimentError(f"docs/prereg/{NAME}.toml has no chosen settings yet: run the pilot, fill them in by "
                              "its rule and commit the amendment before the test")
    return SimpleNamespace(**{**common, "pre": pre}, **test_split, experiment=NAME, folder="editors",
                           methods=list(pre.design["chosen"].values()), design=pre.design, reused=[d["chosen"]])


def _complete(out: dict, want: list[tuple[str, str]], name: str) -> dict | None:
    """The preregistered stop rule: None when every (set, method) of `want` is in `out`'s runs, else what is done
    (printed; nothing of the test split is summarized before)."""
    done = {(r["set"], r["method"]) for r in out["runs"]}
    n = sum(w in done for w in want)
    if n == len(want):
        return None
    print(f"[{name}] {n} of {len(want)} test runs done; nothing is summarized until every run of the family is "
          "(the preregistered stop rule)", file=sys.stderr)
    return {"done": n, "of": len(want)}


def main(argv: list[str] | None = None) -> dict:
    """Run a phase (every cached run reused), then publish its summary (and `--record` it)."""
    import argparse

    from .runs import parse_shard, publish

    ap = argparse.ArgumentParser(prog="python -m engram_experiments.fact_editors",
                                 description="the settings and locality pilots (selection split) and the confirmatory "
                                             "tests of the Engram edit against the field's editors and against GRACE")
    ap.add_argument("phase", choices=["pilot", "locality-pilot", "tie-pilot", "test", "subject-test",
                                      "subject2-test"])
    ap.add_argument("--out", default="runs/experiments")
    ap.add_argument("--summary-only", action="store_true", help="summarize the cached runs, run nothing")
    ap.add_argument("--shard", default="0/1", metavar="K/N",
                    help="run only every N-th (method, set) run, from the K-th (0-based): N processes share a phase")
    ap.add_argument("--record", help="also write the summary to RECORD/<the phase's experiment>.json "
                    "(fact-edits-editors[-pilot|-locality-pilot|-tie-pilot], fact-edits-subject[2])")
    a = ap.parse_args(argv)
    shard = parse_shard(a.shard, ap)
    torch.manual_seed(0)
    root = Path(a.out) / fe.NAME
    rec = committed(RECORD, "the fact-edits record")
    chosen = rec["design"]["chosen"]
    ph = _phase(a.phase, rec, a.record is not None)
    folder = root / ph.folder
    s = None  # the model and facts: loaded to run, or later for an analysis that reads the hash spec
    if not a.summary_only:
        s = fe.setup(root)
        sets = fe.edit_sets(s, ph.split, ph.count, ph.size, ph.seed, ph.rels)
        if ph.pre is not None:  # the test phases: the record's runs are comparable only if the guard passes
            also = tuple(m for m in ph.design.get("reused", []) if m != "none")
            write_json(folder / "guard.json", {"differ": guard(s, folder, ph.reused_record, sets, ph.opt, ph.held,
                                                               ph.neighbours, ph.seed, also, ph.source)})
        todo = [(m, x) for m in [*_rerun(folder), *ph.methods] for x in sets]  # the preregistered order
        for m, x in todo[shard[0]::shard[1]]:
            fe.run_one(s, folder, x, sets[x], m, ph.opt, ph.held, ph.neighbours, ph.seed, True)
    rerun = _rerun(folder)
    for m in ph.reused:  # the record's runs (those the guard allows)
        if m not in rerun:
            reuse_record(folder, ph.reused_record, m, ph.source)
    out = fe.summary(root, ph.folder, ph.design)
    order = ph.reused + ph.methods  # the table in the design's order, not by file name
    out["table"] = {m: out["table"][m] for m in order if m in out["table"]} | out["table"]
    out["experiment"], out["command"] = ph.experiment, f"python -m engram_experiments.fact_editors {a.phase}"
    editors = {"grid": GRID, "defaults": {k: fe.SETTINGS[k] for k in GRID}, "reused": RECORD,
               "held_neighbours": fe.NEIGHBOURS_HELD}  # the editors' pilot and test
    if a.phase == "pilot":
        out["settings"] = editors
        out["choice"] = {k: choose(out, v) for k, v in GRID.items()}
        out["power"] = power(rec, chosen, ["grace", "rome"])
    elif a.phase == "locality-pilot":
        out["settings"] = {"grid": LOCALITY_ARMS, "reused": PILOT_RECORD, "held_neighbours": fe.NEIGHBOURS_HELD}
        check_probes(out, ph.reused_record, PILOT_RECORD)
        old = {r["set"]: r for r in ph.reused_record["runs"] if r["method"] == chosen}  # the rerun against the record
        out["rerun_differs"] = {r["set"]: _same(r, old[r["set"]]) for r in out["runs"] if r["method"] == chosen}
    elif a.phase == "tie-pilot":
        out["settings"] = {"grid": TIE_ARMS, "reused": PILOT_RECORD, "tie": list(fe.TIE)}
        check_probes(out, ph.reused_record, PILOT_RECORD)
        s = s or fe.setup(root, progress=False)  # the hash spec and tokenizer rows_read reads
        subject = committed(SUBJECT_RECORD, "the fact-edits-subject record")
        out["rows_read"] = {  # why a wording is reached: the edited rows it reads at its subject (hash spec only)
            "pilot": {m: rows_read(s, out["runs"], m, ph.opt, ph.held) for m in TIE_ARMS},
            "fact_edits": {chosen: rows_read(s, rec["runs"], chosen, "selection", "test")},
            "fact_edits_subject": {"subject+ctx": rows_read(s, subject["runs"], "subject+ctx", "selection", "test")}}
    else:
        check_probes(out, rec)
        out["prereg"] = ph.pre.stamp()
        if a.phase == "test":
            out["settings"] = editors
            wait = _complete(out, [(f"test-{i}", m) for i in range(ph.count) for m in [chosen, *ph.methods]], NAME)
            if wait:
                return wait
            out["tests"] = fe.analyse(out, chosen, others=ph.methods,
                                      metrics=("paraphrases", "chat_new", "same_relation"), noninferior=None)
        elif a.phase == "subject2-test":
            m, base = ph.methods[0], ph.design["baseline"]
            out["settings"] = {"reused": SUBJECT_RECORD, "rerun": rerun}
            wait = _complete(out, [(f"test-{i}", x) for i in range(ph.count) for x in (m, base)], SUBJECT2)
            if wait:
                return wait
            out["tests"] = fe.analyse(out, m, others=(base,), noninferior=None,
                                      metrics=("paraphrases", "chat_new", "same_relation", "same_subject"))
            s = s or fe.setup(root, progress=False)  # the hash spec and tokenizer rows_read reads
            out["rows_read"] = {x: rows_read(s, out["runs"], x, ph.opt, ph.held) for x in (m, base)}
        else:
            m = ph.methods[0]
            out["settings"] = {"reused": RECORD, "rerun": rerun}
            wait = _complete(out, [(f"test-{i}", x) for i in range(ph.count) for x in (m, "grace")], SUBJECT)
            if wait:
                return wait
            out["tests"] = fe.analyse(out, m, margin=SUBJECT_MARGIN, others=("grace",),
                                      metrics=("paraphrases", "chat_new"), noninferior="grace")
            out["power"] = locality_power(out, m)
    return publish(out, folder, a.record, f"{out['experiment']}.json", fe.markdown, fe.plot)


register(Experiment("fact-edits-editors-pilot", """
    the settings pilot of issue 56's other editors (exploratory, fact-edits' two selection sets): FT-L at six
    norm bounds, LoRA and fine-tuning with neighbours at two learning rates each, MEMIT at two strengths; the
    preregistered rule picks each editor's setting (`fact_editors.py`; about 1.5 hours of one core).""",
                    run=lambda o: main(["pilot"] + options_argv(o)), table=fe.markdown, plot=fe.plot,
                    plot_file="fact-edits-editors-pilot.png", section="14", in_all=False))
register(Experiment(SUBJECT, """
    issue 56's confirmatory test of the Engram edit written at the subject's rows only (subject+ctx) against GRACE
    on fact-edits' 23 test sets: more held-out wordings and chat answers, same-relation locality within 0.02
    (non-inferiority); design in docs/prereg/fact-edits-subject.toml (`fact_editors.py`; about 3 hours of one core,
    resumable).""",
                    run=lambda o: main(["subject-test"] + options_argv(o)), table=fe.markdown, plot=fe.plot,
                    plot_file="fact-edits-subject.png", section="14", in_all=False))
register(Experiment(SUBJECT2, """
    issue 56's confirmatory test of the Engram edit written at the subject's order-2 rows only (subject2+ctx)
    against all its orders (subject+ctx) on fact-edits' 23 test sets: held-out wordings, chat answers, same-relation
    and same-subject locality; design in docs/prereg/fact-edits-subject2.toml (`fact_editors.py`; about 2 hours of
    one core, resumable).""",
                    run=lambda o: main(["subject2-test"] + options_argv(o)), table=fe.markdown, plot=fe.plot,
                    plot_file="fact-edits-subject2.png", section="14", in_all=False))
register(Experiment("fact-edits-editors-locality-pilot", """
    issue 56's pilot of two ways to close the Engram edit's locality gap to GRACE (exploratory, fact-edits' two
    selection sets): held neighbours kept through the shared rows (weights 1 and 4) and the subject's rows only,
    beside the chosen edit rerun and the fact-edits pilot's own runs of GRACE and the unedited model
    (`fact_editors.py`; about 40 minutes of one core).""",
                    run=lambda o: main(["locality-pilot"] + options_argv(o)), table=fe.markdown, plot=fe.plot,
                    plot_file="fact-edits-editors-locality-pilot.png", section="14", in_all=False))
register(Experiment("fact-edits-editors-tie-pilot", """
    issue 56's pilot of why an edit misses wordings with words after the subject (exploratory, fact-edits' two
    selection sets): the subject's rows only, its order-2 rows only, and those tied across a fixed list of contexts
    that may stand before a subject (`fact_editors.py`; about 40 minutes of one core).""",
                    run=lambda o: main(["tie-pilot"] + options_argv(o)), table=fe.markdown, plot=fe.plot,
                    plot_file="fact-edits-editors-tie-pilot.png", section="14", in_all=False))
register(Experiment("fact-edits-editors", """
    issue 56's confirmatory test of the chosen Engram edit against MEMIT, LoRA, fine-tuning with neighbours and
    FT-L at their pilot-chosen settings, on fact-edits' 23 test sets (its Engram runs reused from the record),
    design in docs/prereg/fact-edits-editors.toml (`fact_editors.py`; about 5 hours of one core, resumable).""",
                    run=lambda o: main(["test"] + options_argv(o)), table=fe.markdown, plot=fe.plot,
                    plot_file="fact-edits-editors.png", section="14", in_all=False))


if __name__ == "__main__":
    main()
