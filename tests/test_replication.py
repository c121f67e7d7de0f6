"""Replications of the results page's findings (analysis/replication.py): each preregistration's seeds are new (no
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

from engram.analysis import prereg, replication, report  # noqa: E402
from engram.analysis import significance as sig  # noqa: E402
from engram.analysis.runs import ExperimentError, seed_stats  # noqa: E402
from engram.utils import parse_toml  # noqa: E402

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


@pytest.mark.parametrize("path", PREREGS, ids=lambda p: p.stem)
def test_each_replication_prereg_has_new_seeds_and_the_power_plans_n(path, recs):
    d = design_of(path)
    orig = recs[d["replicates"]]
    orig_seeds = {s for ss in orig["seeds"].values() for s in ss}
    assert orig_seeds and not orig_seeds & set(d["seeds"])
    used = replication.used_seeds(recs)
    assert used >= orig_seeds and all(abs(s - u) >= replication.ORDER_GAP for s in d["seeds"] for u in used)
    plan = replication.check_design(d, recs, path.stem)  # raises on any problem
    assert (d["power"]["n_80"], d["power"]["n"]) == (plan["n_80"], plan["n"])
    assert len(d["seeds"]) >= plan["n"]
    # the plan by hand: the original's per-seed differences, their mean and sd, the power at n_80 and below it
    (a, b), = d["test"]["family"]
    sa, sb = (report._stat(recs, f"{d['replicates']}/{x}") for x in (a, b))
    diffs = [y - x for x, y in zip(sa["values"], sb["values"])]
    row = plan["comparisons"][0]
    assert row["effect"] == pytest.approx(np.mean(diffs)) and row["sd"] == pytest.approx(np.std(diffs, ddof=1))
    assert sig.paired_power(row["effect"], row["sd"], plan["n_80"]) >= 0.8
    assert plan["n_80"] == 2 or sig.paired_power(row["effect"], row["sd"], plan["n_80"] - 1) < 0.8
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
    from engram.analysis import experiments

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
    from engram.analysis import allocation

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


def test_run_trains_allocation_variants_with_its_data_and_steps(tmp_path, monkeypatch):
    """run() of allocation-replication without training: train_runs gets allocation's runs (its data, its 1,000
    steps, each variant's trained_run arguments) at the new seeds; the record is allocation's kind of table."""
    from engram.analysis import experiments

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
