"""Replications of the results page's findings (replication.py): each preregistration's seeds are new (no
record used them, init and data order differ), its n is the power plan's (80% power at the original effect and
sd, significance.n_for_power), a committed replication record checks out against its prereg, and the page renders
the replication beside the original family's row."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

stats = pytest.importorskip("scipy.stats", reason="scipy computes the tests")

from engram.utils import parse_toml  # noqa: E402
from engram_experiments import prereg, replication, report  # noqa: E402
from engram_experiments import significance as sig  # noqa: E402
from engram_experiments.runs import ExperimentError, seed_stats  # noqa: E402

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]
PREREGS = sorted((REPO / "docs" / "prereg").glob(f"*{replication.SUFFIX}.toml"))


def design_of(path: Path) -> dict:
    return parse_toml(path.read_text(encoding="utf-8"), str(path), ValueError)


@pytest.fixture(scope="module")
def recs() -> dict:
    return report.load(REPO / "docs" / "results")


def test_paired_power_and_n_for_power():
    # large n: the noncentral t approaches the normal: power ~ Phi(d sqrt(n) - z_{0.975})
    d, n = 0.3, 200
    z = stats.norm.ppf(0.975)
    assert sig.paired_power(d, 1.0, n) == pytest.approx(stats.norm.cdf(d * math.sqrt(n) - z), abs=2e-3)
    # the smallest n with power >= 0.8: the one below falls short; textbook value d = 0.5 -> 34 pairs
    assert sig.n_for_power(0.5, 1.0) == 34
    assert sig.paired_power(0.5, 1.0, 33) < 0.8 <= sig.paired_power(0.5, 1.0, 34)
    assert sig.n_for_power(-0.5, 1.0) == 34  # two-sided: the sign does not matter
    assert sig.n_for_power(14.0, 1.0) == 2  # huge effects: the floor of a paired test
    # alpha / m (a family of m): more pairs
    assert sig.n_for_power(0.5, 1.0, alpha=0.025) > 34
    # min_detectable is its inverse: at the detectable difference the power is 0.8
    r = sig.paired([0.0, 0.0, 0.0, 0.0], [0.1, 0.3, 0.2, 0.25])
    sd = r.se * math.sqrt(r.n_a)
    assert sig.paired_power(sig.min_detectable(r), sd, r.n_a) == pytest.approx(0.8, abs=1e-6)
    with pytest.raises(sig.SignificanceError):
        sig.paired_power(0.1, 0.0, 3)


def original_diffs(recs: dict, d: dict, a: str, b: str) -> list[float]:
    """The original's per-seed differences b - a, by hand from its record: its variants' values, or (an original
    that tested its own family, retrofit's `tests`) the runs of points `a` and `b` at its test seeds."""
    orig = recs[d["replicates"]]
    if d["replicates"] == "edit":  # POINT is "CONFIG at BUDGET": that config's runs at that budget, per fact set
        def cell(x: str) -> dict:
            point, _, metric = x.partition("#")
            config, _, budget = point.rpartition(" at ")
            return {r["seed"]: r[metric] for r in orig["runs"] if r["config"] == config and r["budget"] == int(budget)}

        ca, cb = cell(a), cell(b)
        assert sorted(ca) == sorted(cb) and len(ca) == orig["seeds"]
        return [cb[s] - ca[s] for s in sorted(ca)]
    if d["original_family"] != f"{d['replicates']}/tests":
        sa, sb = (report._stat(recs, f"{d['replicates']}/{x}") for x in (a, b))
        return [y - x for x, y in zip(sa["values"], sb["values"])]

    def values(x: str) -> dict:
        point, _, metric = x.partition("#")
        return {r["seed"]: r[metric] for r in orig["runs"]
                if f"{r['method']} lr {r['lr']:g}" == point and r["seed"] in orig["test_seeds"]}

    va, vb = values(a), values(b)
    assert sorted(va) == sorted(vb) == orig["test_seeds"]
    return [vb[s] - va[s] for s in orig["test_seeds"]]


@pytest.mark.parametrize("path", PREREGS, ids=lambda p: p.stem)
def test_each_replication_prereg_has_new_seeds_and_the_power_plans_n(path, recs):
    d = design_of(path)
    orig = recs[d["replicates"]]
    orig_seeds = replication.used_seeds({d["replicates"]: orig})
    assert orig_seeds and not orig_seeds & set(d["seeds"])
    used = replication.used_seeds(recs)
    assert used >= orig_seeds and all(abs(s - u) >= replication.ORDER_GAP for s in d["seeds"] for u in used)
    plan = replication.check_design(d, recs, path.stem)  # raises on any problem
    assert (d["power"]["n_80"], d["power"]["n"]) == (plan["n_80"], plan["n"])
    assert len(d["seeds"]) >= plan["n"]
    # the plan by hand: the original's per-seed differences, their mean and sd, the power at n_80 (alpha / family
    # size, Holm's first step) for every comparison and below it for at least one
    family = d["test"]["family"]
    alpha = sig.ALPHA / len(family)
    short = []
    for (a, b), row in zip(family, plan["comparisons"], strict=True):
        diffs = original_diffs(recs, d, a, b)
        assert row["effect"] == pytest.approx(np.mean(diffs)) and row["sd"] == pytest.approx(np.std(diffs, ddof=1))
        assert row["alpha"] == alpha and sig.paired_power(row["effect"], row["sd"], plan["n_80"], alpha) >= 0.8
        short.append(plan["n_80"] > 2 and sig.paired_power(row["effect"], row["sd"], plan["n_80"] - 1, alpha) < 0.8)
    assert plan["n_80"] == 2 or any(short)
    assert plan["n"] == max(plan["n_80"], len(diffs))
    assert d["original_family"] in (REPO / "docs" / "results.in.md").read_text(encoding="utf-8")


def test_a_new_seed_reads_the_data_in_a_new_order():
    from engram.training.data import Batcher

    tokens = np.arange(128 * 500, dtype=np.uint32)

    def first(seed: int) -> list[int]:
        b = Batcher(tokens, 128, 8, seed=seed, prefetch=False)
        return [int(b._window_ids()[0]) for _ in range(20)]

    new = [first(s) for d in map(design_of, PREREGS) for s in d["seeds"]]
    old = [first(s) for s in range(4)]
    assert all(x != y for x in new for y in old)


def test_check_design_refuses_used_seeds_too_few_seeds_and_a_wrong_plan(recs):
    d = design_of(REPO / "docs" / "prereg" / "ablations-replication.toml")
    name = "ablations-replication"
    for bad, match in [({"seeds": [2, 1000, 1100]}, "lie within"), ({"seeds": [1000, 1050, 1200]}, "lie within"),
                       ({"seeds": [1000, 1100]}, "fewer than the n"),
                       ({"power": {**d["power"], "n": 2}}, "the original record gives"),
                       ({"variants": ["full", "no-such"]}, "no variant"), ({"replicates": "iso"}, "replicates one")]:
        with pytest.raises(ExperimentError, match=match):
            replication.check_design({**d, **bad}, recs, name)


def _fake_replication(recs: dict, values_full, values_shuffled) -> dict:
    d = design_of(REPO / "docs" / "prereg" / "ablations-replication.toml")
    rec = {"experiment": "ablations-replication", "replicates": "ablations", "design": d,
           "prereg": {"file": "docs/prereg/ablations-replication.toml"},
           "variants": {"full": seed_stats(values_full) | {"params": 1, "table_params": 1},
                        "shuffled-hash": seed_stats(values_shuffled) | {"params": 1, "table_params": 1}},
           "seeds": {"full": d["seeds"], "shuffled-hash": d["seeds"]}}
    rec["tests"] = replication.tests(rec, replication.power_plan(d, recs))
    return rec


def test_the_page_renders_the_replication_beside_the_original(recs):
    page = (REPO / "docs" / "results.in.md").read_text(encoding="utf-8")
    fam4 = next(p for p in page.split("\n## ") if p.startswith("4."))
    fam4 = fam4[fam4.index("{{family:§4"):]
    fam4 = fam4[:fam4.index("}}") + 2]
    for full, shuffled, replicated in [([4.64, 4.65, 4.66], [4.69, 4.71, 4.71], True),  # a finding, same sign
                                       ([4.64, 4.65, 4.66], [4.63, 4.66, 4.64], False)]:
        r = _fake_replication(recs, full, shuffled)
        assert r["tests"][0]["replicated"] is replicated
        text = report.render(f"## 4. x\n{fam4}\n{{{{replication:ablations-replication}}}}\n@"
                             "{{verdict:ablations-replication/full:ablations-replication/shuffled-hash@ablations-replication}}",
                             {**recs, "ablations-replication": r})
        table = text[text.index("**Replication, family ablations-replication**"):]
        row = next(x for x in table.splitlines() if x.startswith("| shuffled-hash - full |"))
        assert row.count("|") == 9 and row.endswith("| **yes** |" if replicated else "| no |")
        assert "paired t, n=3" in row and "**finding**" in row  # the original's row is a finding
        assert text.endswith("a finding" if replicated else "not a finding")
    r["tests"][0]["p_holm"] = 0.5 if r["tests"][0]["p_holm"] < 0.4 else 0.01  # a record that disagrees
    with pytest.raises(ValueError, match="disagree"):
        report.render(f"## 4. x\n{fam4}\n{{{{replication:ablations-replication}}}}",
                      {**recs, "ablations-replication": r})
    with pytest.raises(KeyError, match="original family"):
        report.render("{{replication:ablations-replication}}", {**recs, "ablations-replication": r})


RECORDS = sorted((REPO / "docs" / "results").glob(f"*{replication.SUFFIX}.json"))


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs this repository's git history")
@pytest.mark.parametrize("path", RECORDS or [None], ids=lambda p: p.name if p else "none-yet")
def test_each_committed_replication_record_checks_out(path, recs):
    if path is None:
        pytest.skip("no replication recorded yet")
    rec = json.loads(path.read_text())
    assert prereg.check_record(rec, REPO) == []
    d = rec["design"]
    assert rec["power"]["n"] == d["power"]["n"] and all(
        sorted(ss) == sorted(d["seeds"]) for ss in rec["seeds"].values())  # every preregistered seed, no other
    assert rec["tests"] == replication.tests(rec, rec["power"])


def committed_copy(repo: Path, *rels: str) -> None:
    """A scratch git repo in `repo` holding this repository's files `rels`, committed (runs go to out/, rec/)."""
    from test_prereg import git

    for rel in rels:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes((REPO / rel).read_bytes())
    (repo / ".gitignore").write_text("out/\nrec/\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "prereg")


def test_run_records_the_preregistered_design_with_its_stamp(tmp_path, monkeypatch):
    """run() end to end without training (train_runs replaced): the prereg committed in a scratch repo, the record
    holds the stamp, the design, the plan and the family's tests, and check_record passes on it."""
    from engram_experiments import preset as experiments

    committed_copy(tmp_path, *("docs/prereg/ablations-replication.toml", "docs/results/ablations.json"))
    env = {"torch": "x", "threads": 2}
    fake = {"full": [4.64, 4.65, 4.66], "shuffled-hash": [4.69, 4.71, 4.70]}
    asked = []

    def train_runs(name, out, vs, seed_list, preset, data, max_steps, progress, jobs=1, finished_only=False):
        asked.append((name, sorted(vs), seed_list, preset, max_steps, jobs))
        return {v: [{"seed": s, "val_loss": x, "params": 1, "table_params": 1, "environment": env}
                    for s, x in zip(seed_list, fake[v])] for v in vs}

    monkeypatch.setattr(experiments, "train_runs", train_runs)
    with pytest.raises(ExperimentError, match="--max-steps"):
        replication.run("ablations-replication", tmp_path / "out", record=tmp_path / "rec", max_steps=3,
                        repo=tmp_path)
    rec = replication.run("ablations-replication", tmp_path / "out", progress=False, record=tmp_path / "rec",
                          repo=tmp_path)
    assert asked == [("ablations", ["full", "shuffled-hash"], [1000, 1100, 1200], "exp", None, 1)]
    assert json.loads((tmp_path / "rec" / "ablations-replication.json").read_text()) == rec
    assert rec["prereg"]["status"] == "confirmatory" and rec["seeds"]["full"] == [1000, 1100, 1200]
    assert rec["tests"][0]["replicated"] and rec["power"]["n"] == 3
    assert prereg.check_record(rec, tmp_path) == []
    (tmp_path / "docs/prereg/ablations-replication.toml").write_text("status = 'confirmatory'\n")
    with pytest.raises(ExperimentError, match="not committed"):
        replication.run("ablations-replication", tmp_path / "out", record=tmp_path / "rec", repo=tmp_path)


def test_allocation_replication_trains_the_original_runs(recs):
    """allocation has its own driver (`allocation.run`): the replication's runs are its plan's variants at the
    design's scale, each with the model overrides and Engram use the committed accounting records, the scale's
    training overrides, data and steps (`allocation._train`'s arguments); its table is allocation's record table."""
    from engram_experiments import allocation

    d = design_of(REPO / "docs" / "prereg" / "allocation-replication.toml")
    rs = replication.runs_of(d)
    sc = allocation.SCALES[d["scale"]]
    acc = json.loads((REPO / "docs" / "results" / "allocation-accounting.json").read_text())
    assert sorted(rs.variants) == sorted(v["name"] for v in acc["variants"])
    for v in acc["variants"]:
        assert rs.variants[v["name"]] == {"overrides": sc.train, "use_engram": v["use_engram"],
                                          "model_overrides": v["model_overrides"]}
    assert (rs.data, rs.max_steps) == (["shakespeare", "kjv"], 1000)
    fake = {v: [{"seed": s, "val_loss": 4.3 + 0.01 * i} for i, s in enumerate(d["seeds"])] for v in d["variants"]}
    table = rs.table(fake)
    orig = recs["allocation"]["variants"]
    for v in d["variants"]:
        assert {k: table[v][k] for k in ("rho", "params", "activated", "table_params")} == \
            {k: orig[v][k] for k in ("rho", "params", "activated", "table_params")}
        assert table[v]["values"] == [r["val_loss"] for r in fake[v]]
    with pytest.raises(ExperimentError, match="trains preset"):
        replication.runs_of({**d, "preset": "tiny"})
    with pytest.raises(ExperimentError, match="no variant"):
        replication.check_design({**d, "variants": ["moe-E16", "moe-E15+engram"]}, recs, "allocation-replication")


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 7 s
def test_run_trains_allocation_variants_with_its_data_and_steps(tmp_path, monkeypatch):
    """run() of allocation-replication without training: train_runs gets allocation's runs (its data, its 1,000
    steps, each variant's trained_run arguments) at the new seeds; the record is allocation's kind of table."""
    from engram_experiments import preset as experiments

    committed_copy(tmp_path, *("docs/prereg/allocation-replication.toml", "docs/results/allocation.json"))
    fake = {"moe-E16": [4.33, 4.32, 4.33, 4.325], "moe-E14+engram": [4.30, 4.30, 4.29, 4.305]}
    asked = []

    def train_runs(name, out, vs, seed_list, preset, data, max_steps, progress, jobs=1, finished_only=False):
        asked.append((name, vs, seed_list, preset, data, max_steps, jobs))
        return {v: [{"seed": s, "val_loss": x, "environment": {"torch": "x"}} for s, x in zip(seed_list, fake[v])]
                for v in vs}

    monkeypatch.setattr(experiments, "train_runs", train_runs)
    rec = replication.run("allocation-replication", tmp_path / "out", progress=False, record=tmp_path / "rec",
                          jobs=2, repo=tmp_path)
    (name, vs, seeds, preset, data, steps, jobs), = asked
    assert (name, sorted(vs), seeds, preset, data, steps, jobs) == (
        "allocation", ["moe-E14+engram", "moe-E16"], [2000, 2100, 2200, 2300], "exp", ["shakespeare", "kjv"], 1000, 2)
    assert vs == {v: replication.runs_of(rec["design"]).variants[v] for v in vs}
    assert rec["variants"]["moe-E14+engram"]["rho"] == pytest.approx(12 / 14) and rec["power"]["n"] == 4
    assert rec["tests"][0]["replicated"] and rec["tests"][0]["diff"] < 0
    assert prereg.check_record(rec, tmp_path) == []


def _fake_retrofit_replication(recs: dict, shift: float) -> dict:
    """A retrofit-replication record from its prereg: each point's runs at the new seeds are the original's test-seed
    values (seeds 1, 2, 3 and again 1) plus `shift` on the Engram points' domain loss."""
    d = design_of(REPO / "docs" / "prereg" / "retrofit-replication.toml")
    orig = recs["retrofit"]
    results = {}
    for name in d["variants"]:
        runs = {r["seed"]: r for r in orig["runs"] if f"{r['method']} lr {r['lr']:g}" == name}
        up = shift * name.startswith("engram")
        results[name] = [runs[s] | {"seed": new, "domain_val": runs[s]["domain_val"] + up}
                         for s, new in zip([1, 2, 3, 1], d["seeds"], strict=True)]
    from engram_experiments import retrofit

    rec = {"experiment": "retrofit-replication", "replicates": "retrofit", "design": d,
           "prereg": {"file": "docs/prereg/retrofit-replication.toml"},
           "variants": retrofit.replication_table(results), "seeds": {v: d["seeds"] for v in d["variants"]}}
    rec["tests"] = replication.tests(rec, replication.power_plan(d, recs))
    return rec


def test_retrofit_replication_renders_beside_its_records_family(recs):
    """retrofit's original family is its record's `tests` (`original_family` "retrofit/tests"): each replicated row
    sits beside that record's row of the same points and metric, the metric named (the family compares two)."""
    orig = recs["retrofit"]["tests"]
    same = _fake_retrofit_replication(recs, 0.0)  # the original's values again: every row a finding, same sign
    assert all(t["replicated"] for t in same["tests"]) and len(same["tests"]) == 10
    text = report.render("## 8. x\n{{replication:retrofit-replication}}\n@{{verdict:retrofit-replication/engram lr "
                         "0.003#domain_val:retrofit-replication/full lr 1e-05#domain_val@retrofit-replication}}",
                         {**recs, "retrofit-replication": same})
    rows = [x for x in text.splitlines() if x.startswith("| full lr 1e-05 - engram lr 0.003 (")]
    assert [r.split(" | ")[0] for r in rows] == ["| full lr 1e-05 - engram lr 0.003 (domain_val)",
                                                 "| full lr 1e-05 - engram lr 0.003 (forgetting_shared)"]
    assert f"{orig[0]['diff']:+.4f} ± {orig[0]['se']:.4f} (paired t, n=3)" in rows[0]
    assert rows[0].endswith("| **yes** |") and "paired t, n=4" in rows[0] and text.endswith("a finding")
    # the Engram points' domain loss 0.6 nats higher: the rows where Engram was below flip sign, and do not replicate
    worse = _fake_retrofit_replication(recs, 0.6)
    flips = {(t["a"], t["b"]): t["replicated"] for t in worse["tests"]}
    assert not flips[("engram lr 0.003#domain_val", "full lr 1e-05#domain_val")]
    assert flips[("engram lr 0.003#forgetting_shared", "full lr 1e-05#forgetting_shared")]  # untouched
    d = same["design"]
    bad = {**d, "test": {**d["test"], "family": [["engram lr 0.003#domain_val", "full lr 0.0001#domain_val"]]}}
    with pytest.raises(ExperimentError, match="not a row"):
        replication.power_plan(bad, recs)


def test_run_records_retrofit_points_from_retrofit_replicate(tmp_path, monkeypatch):
    """run() of retrofit-replication without training: `retrofit.replicate` gets the original record, the
    preregistered points and seeds; the record holds retrofit's replication table, the base's losses and the tests."""
    from engram_experiments import retrofit

    committed_copy(tmp_path, *("docs/prereg/retrofit-replication.toml", "docs/results/retrofit.json"))
    recs = report.load(REPO / "docs" / "results")
    fake = _fake_retrofit_replication(recs, 0.0)
    asked = []

    def replicate(rec, names, seeds, out, progress, jobs, max_steps):
        asked.append((rec["experiment"], names, seeds, jobs, max_steps))
        results = {n: [{"seed": s, "method": fake["variants"][n]["method"], "lr": fake["variants"][n]["lr"],
                        "trainable": 1, "environment": {"torch": "x"},
                        **{k: fake["variants"][n][k]["values"][i] for k in ("domain_val", "forgetting",
                                                                            "forgetting_shared", "step_ms",
                                                                            "peak_rss_mib")}}
                       for i, s in enumerate(seeds)] for n in names}
        return results, {"before": {"domain": 6.0}}

    monkeypatch.setattr(retrofit, "replicate", replicate)
    rec = replication.run("retrofit-replication", tmp_path / "out", progress=False, record=tmp_path / "rec",
                          repo=tmp_path)
    d = rec["design"]
    assert asked == [("retrofit", d["variants"], [3000, 3100, 3200, 3300], 1, None)]
    assert rec["before"] == {"domain": 6.0} and rec["power"]["n"] == 4 and rec["tests"] == fake["tests"]
    assert rec["variants"]["engram lr 0.003"]["forgetting_ratio"]["n"] == 4
    assert prereg.check_record(rec, tmp_path) == []


def _fake_edit_replication(recs: dict, shift: float) -> tuple[dict, dict]:
    """(results, record) of edit-replication as `editing.replicate` and `run` would make them, without running:
    each fact set's values the original's (set i % 3), ft+kl's val_change moved by `shift`."""
    from engram_experiments import edit as editing

    d = design_of(REPO / "docs" / "prereg" / "edit-replication.toml")
    orig = recs["edit"]
    results = {}
    for c in d["variants"]:
        for b in d["budgets"]:
            rs = sorted((r for r in orig["runs"] if r["config"] == c and r["budget"] == b), key=lambda r: r["seed"])
            results[editing.replication_point(c, b)] = [
                {**rs[i % len(rs)], "seed": s, "known_kept": 0.9 - 0.01 * i, "environment": {"torch": "x"},
                 "val_change": rs[i % len(rs)]["val_change"] + (shift if c == "ft+kl-w1" else 0.0)}
                for i, s in enumerate(d["seeds"])]
    rec = {"experiment": "edit-replication", "replicates": "edit", "design": d,
           "prereg": {"file": "docs/prereg/edit-replication.toml"}, "variants": editing.replication_table(results),
           "seeds": {v: [r["seed"] for r in rs] for v, rs in results.items()}}
    rec["tests"] = replication.tests(rec, replication.power_plan(d, recs))
    return results, rec


def test_edit_replication_renders_beside_edit_records_family(recs):
    """edit's original family is its record's `tests`, which tests the same pair at three budgets: the replicated
    row (`CONFIG at BUDGET#metric`, edit.json tests.38) sits beside exactly that row, and a shift that removes the
    difference does not replicate."""
    _, same = _fake_edit_replication(recs, 0.0)  # the original's values again (one set twice): a finding, same sign
    t38 = recs["edit"]["tests"][38]
    assert (t38["budget"], t38["b"], t38["metric"]) == (300, "ft+kl-w1", "val_change")
    assert same["tests"][0]["replicated"]
    text = report.render("## 9. x\n{{replication:edit-replication}}\n@{{verdict:edit-replication/engram-edit at "
                         "300#val_change:edit-replication/ft+kl-w1 at 300#val_change@edit-replication}}",
                         {**recs, "edit-replication": same})
    row, = [x for x in text.splitlines() if x.startswith("| ft+kl-w1 at 300 - engram-edit at 300 |")]
    assert f"{t38['diff']:+.4f} ± {t38['se']:.4f} (paired t, n=3) | {sig.fmt_p(t38['p_holm'])} | **finding**" in row
    assert "paired t, n=4" in row and row.endswith("| **yes** |") and text.endswith("a finding")
    _, gone = _fake_edit_replication(recs, -t38["diff"])  # ft+kl's damage brought down to the edit's
    assert not gone["tests"][0]["replicated"]


def test_run_records_edit_replication_from_editing_replicate(tmp_path, monkeypatch):
    """run() of edit-replication without editing: `editing.replicate` gets edit.json and the design; the record holds
    the cells by `CONFIG at BUDGET`, the seeds, what replicate adds (the editing family as `known_tests`), the
    claim's test and the stamp, and check_record passes."""
    from engram_experiments import edit as editing

    committed_copy(tmp_path, *("docs/prereg/edit-replication.toml", "docs/results/edit.json"))
    recs = report.load(REPO / "docs" / "results")
    results, fake = _fake_edit_replication(recs, 0.0)
    asked = []

    def replicate(original, design, out, progress):
        asked.append((original["experiment"], design["seeds"], design["variants"]))
        return results, {"known_tests": [{"p_holm": 0.5, "finding": False}]}

    monkeypatch.setattr(editing, "replicate", replicate)
    with pytest.raises(ExperimentError, match="--max-steps"):
        replication.run("edit-replication", tmp_path / "out", progress=False, max_steps=3, repo=tmp_path)
    rec = replication.run("edit-replication", tmp_path / "out", progress=False, record=tmp_path / "rec",
                          repo=tmp_path)
    assert asked == [("edit", [4000, 4100, 4200, 4300], ["engram-edit", "ft-lr0.0001", "ft+kl-w1", "lora-lr0.001"])]
    assert rec["tests"] == fake["tests"] and rec["power"]["n"] == 3 and rec["known_tests"][0]["p_holm"] == 0.5
    assert rec["seeds"]["ft+kl-w1 at 300"] == [4000, 4100, 4200, 4300]
    assert rec["variants"]["lora-lr0.001 at 10"]["known_kept"]["n"] == 4
    assert prereg.check_record(rec, tmp_path) == []
