"""`engram experiment retrofit`: the design's pieces (grid extension, choices on the selection seed only, the
Pareto front over the test seeds, the budgets' family of tests), the earlier record's re-test, and (slow) the whole
design on a tiny base."""

import json
from pathlib import Path

import pytest

from engram_experiments import retrofit as rf
from engram_experiments.retrofit import at_budget, budget_tests, extend_grid, grid_points, pareto


def test_pareto_front_keeps_only_undominated_points():
    pts = [{"forgetting": 0.1, "domain_val": 5.0}, {"forgetting": 0.2, "domain_val": 4.0},
           {"forgetting": 0.3, "domain_val": 4.5},  # dominated by the second
           {"forgetting": 0.05, "domain_val": 6.0}, {"forgetting": 0.2, "domain_val": 4.0}]  # a tie stays
    assert pareto(pts) == [3, 0, 1, 4]
    assert pareto([]) == []


def test_grid_is_extended_past_an_end_that_holds_the_optimum_until_interior():
    ext: dict = {}
    assert extend_grid([1e-3, 3e-3, 1e-2], {1e-3: 5.0, 3e-3: 4.8, 1e-2: 4.7}, ext) == pytest.approx(3e-2)
    assert extend_grid([1e-4, 3e-4, 1e-3], {1e-4: 4.0, 3e-4: 4.8, 1e-3: 4.9}, ext) == pytest.approx(3.33e-5)
    assert ext == {"up": 1, "down": 1}
    assert extend_grid([1e-3, 3e-3, 1e-2], {1e-3: 5.0, 3e-3: 4.6, 1e-2: 4.7}, {}) is None  # interior
    assert extend_grid([1e-3, 3e-3], {1e-3: 5.0, 3e-3: 4.0}, {"up": rf.EXTEND}) is None  # at most EXTEND per end
    assert len(rf.BUDGETS) >= 3 and rf.SELECTION_SEED == 0


def _runs():
    """Two methods x two lrs; the selection seed 0 says b's lr 1 fits budget 0.5, the test seeds say otherwise."""
    out = []
    for seed in (0, 1, 2, 3):
        for m, lr, dom, forg in (("a", 1.0, 5.0, 0.1), ("a", 2.0, 4.0, 0.8), ("b", 1.0, 4.5, 0.4),
                                 ("b", 2.0, 3.9, 1.5)):
            if seed and (m, lr) == ("b", 1.0):
                forg = 0.9  # only the selection seed saw it within the budget
            out.append({"method": m, "lr": lr, "seed": seed, "domain_val": dom + 0.01 * seed * (m == "b"),
                        "forgetting": forg + 0.001 * seed, "forgetting_shared": forg + 0.01 * seed})
    return out


def test_choices_read_the_selection_seed_only_and_numbers_the_test_seeds():
    runs = _runs()
    sel = [r for r in runs if r["seed"] == 0]
    assert at_budget(sel, 0.5) == {"a": 1.0, "b": 1.0} and at_budget(sel, 0.05) == {}
    assert at_budget(sel, 1.0) == {"a": 2.0, "b": 1.0}
    chosen, tests = budget_tests(runs, (0.5, 1.0, 2.0), [("a", "b")], 0, [1, 2, 3])
    b05 = next(c for c in chosen if c["budget"] == 0.5 and c["method"] == "b")
    assert b05["lr"] == 1.0 and b05["seeds"] == [1, 2, 3]  # chosen on seed 0 ...
    assert b05["forgetting"]["mean"] == pytest.approx(0.902)  # ... reported from the test seeds, over budget
    assert len(tests) == 3 * 2 and all(t["kind"] == "paired" and t["n"] == 3 for t in tests)
    assert all(t["p_holm"] >= t["p"] for t in tests)
    dom = next(t for t in tests if t["budget"] == 0.5 and t["metric"] == "domain_val")
    assert dom["diff"] == pytest.approx(-0.5 + 0.02)  # b - a, paired by seed: 4.5 + 0.01 s - 5.0


def test_pareto_points_pool_every_test_seed_with_their_spread():
    pts = grid_points(_runs(), [1, 2, 3])
    assert len(pts) == 4 and all(p["domain_val"]["n"] == 3 and p["seeds"] == [1, 2, 3] for p in pts)
    b1 = next(p for p in pts if (p["method"], p["lr"]) == ("b", 1.0))
    assert b1["forgetting"]["values"] == pytest.approx([0.901, 0.902, 0.903]) and b1["forgetting"]["std"] > 0
    # at each test seed b lr 1 (4.5, 0.9) is dominated by a lr 2 (4.0, 0.8): on no seed's front
    assert b1["on_front"] == 0 and next(p for p in pts if (p["method"], p["lr"]) == ("a", 2.0))["on_front"] == 3


def test_the_committed_record_is_what_its_runs_give():
    """docs/results/retrofit.json: its grid points, budget choices and family are recomputed from its runs; every
    grid point ran at the selection seed and every test seed; the selection seed's optimum is interior for each
    method."""
    rec = json.loads((Path(__file__).parents[1] / "docs/results/retrofit.json").read_text())
    assert rec["selection_seed"] == 0 and rec["test_seeds"] == [1, 2, 3]
    runs = rec["runs"]
    assert rf.grid_points(runs, rec["test_seeds"]) == rec["points"]
    chosen, tests = rf.budget_tests(runs, rec["budgets"], [tuple(p) for p in rec["pairs"]], rec["selection_seed"],
                                    rec["test_seeds"])
    assert chosen == rec["at_budget"] and tests == rec["tests"]
    for m, info in rec["methods"].items():
        for lr in info["lrs"]:
            assert sorted(r["seed"] for r in runs if r["method"] == m and r["lr"] == lr) == [0, 1, 2, 3]
    assert all(o["selection_interior"] for o in rec["optimum"].values())
    assert all(t["kind"] == "paired" and t["n"] == 3 and t["p_holm"] >= t["p"] for t in tests)


@pytest.mark.slow
def test_retrofit_design_on_a_tiny_base(tmp_path):
    pytest.importorskip("peft")
    general, domain = tmp_path / "general.txt", tmp_path / "domain"
    general.write_text("".join(f"Line {i}: the cat sat on the mat, the dog ran to the king.\n" for i in range(300)))
    domain.mkdir()
    for k in range(6):
        (domain / f"d{k}.txt").write_text("".join(f"word{i} (noun): a thing of kind {i % 7}\n" for i in range(80)))
    methods = {"full": (dict(method="full"), (1e-4, 1e-3)),
               "lora-all": (dict(rf.LORA_ALL), (1e-3,)),
               "engram-matched": (dict(method="engram", layers=[0], engram_options=dict(
                   n_embed_per_ngram=8, n_head_per_ngram=2)), (1e-3,))}
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    s = rf.run(tmp_path / "out", seeds=2, max_steps=2, pretrain_steps=2, progress=False, record=tmp_path / "rec",
               methods=methods, domain=[str(domain)], general=[str(general)], base_shape=base, tokenizer="bpe:300",
               budgets=(0.01, 0.1, 10.0), pairs=(("engram-matched", "lora-all"), ("full", "lora-all")), isolate=False)
    grid = {m: s["methods"][m]["lrs"] for m in methods}
    assert all(len(v) >= len(methods[m][1]) for m, v in grid.items())
    n_points = sum(len(v) for v in grid.values())
    assert len(s["runs"]) == n_points * 3  # the selection seed + 2 test seeds, every grid point
    assert s["test_seeds"] == [1, 2] and len(s["points"]) == n_points
    assert all(p["domain_val"]["n"] == 2 for p in s["points"])
    tr = {m: next(r["trainable"]["trainable"] for r in s["runs"] if r["method"] == m) for m in methods}
    assert abs(tr["engram-matched"] - tr["lora-all"]) / tr["lora-all"] < 0.1  # parameter-matched
    assert s["shared_set"]["windows"] > 0 and all("forgetting_shared" in r for r in s["runs"])
    assert {c["budget"] for c in s["at_budget"]} <= {0.01, 0.1, 10.0} and s["tests"]
    assert json.loads((tmp_path / "rec" / "retrofit.json").read_text())["runs"] == s["runs"]
    assert (tmp_path / "out" / "retrofit" / "plot.png").is_file()


def test_the_new_record_renders_from_every_test_seed(tmp_path):
    """markdown/plot of the redo's record, built here from the design's pieces (no training)."""
    runs = _runs()
    tr = {"trainable": 10, "engram_table": 0, "engram_dense": 0, "base_trainable": 10}
    for r in runs:
        r |= {"step_ms": 1.0, "peak_rss_mib": 100.0, "trainable": tr}
    pts = grid_points(runs, [1, 2, 3])
    chosen, tests = budget_tests(runs, (0.5, 1.0, 2.0), [("a", "b")], 0, [1, 2, 3])
    means = [{"forgetting": p["forgetting"]["mean"], "domain_val": p["domain_val"]["mean"]} for p in pts]
    s = {"before": {"domain": 6.0, "general": 4.0, "shared": 4.5},
         "shared_set": {"windows": 4, "of": 10, "ngram_share": 0.5, "ngram_share_general": 0.3},
         "test_seeds": [1, 2, 3], "selection_seed": 0, "adapt_steps": 2, "tokens_per_step": 64,
         "budgets": [0.5, 1.0, 2.0], "methods": {"a": {}, "b": {}}, "points": pts,
         "pareto_front": [[pts[i]["method"], pts[i]["lr"]] for i in pareto(means)],
         "optimum": {"a": {"lr": 2.0, "interior": False, "selection_lr": 2.0, "selection_interior": False}},
         "at_budget": chosen, "tests": tests, "cost": {"a": {"trainable": tr, "step_ms": {"mean": 1.0},
                                                             "peak_rss_mib": {"mean": 100.0}}}, "runs": runs}
    md = rf.markdown(s)
    assert md.count("\n| a") + md.count("\n| b") >= 4 and "Holm p" in md and "3/3" in md
    rf.plot(s, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_the_retrofit_page_shows_forgetting_ratios_per_seed_and_no_inherited_peak_rss():
    """Issue 48 item 4: each at-budget point's shared/general forgetting ratio is the mean ± sd of per-seed ratios; a
    record whose peak RSS was `ru_maxrss` (inherited across fork+exec) shows no RSS column."""
    import json
    import statistics
    from pathlib import Path

    from engram_experiments import retrofit

    rec = json.loads((Path(__file__).parents[1] / "docs/results/retrofit.json").read_text())
    cell = next(c for c in rec["at_budget"] if c["method"] == "engram")
    r = retrofit.forgetting_ratio(cell)
    per_seed = [s / g for s, g in zip(cell["forgetting_shared"]["values"], cell["forgetting"]["values"])]
    assert r["mean"] == statistics.fmean(per_seed) and r["n"] == len(rec["test_seeds"])
    md = retrofit.markdown(rec)
    assert f"{r['mean']:.2f} ± {r['std']:.2f} |" in md and "peak RSS (MiB)" not in md
    assert "peak RSS (MiB)" in retrofit.markdown({**rec, "peak_rss_measure": "VmHWM"})


def test_replicate_trains_the_chosen_points_as_the_original_did(monkeypatch, tmp_path):
    """`replicate` (retrofit-replication's runs): only the points the selection seed chose, at the new seeds, with
    `Sweep` (replaced here: no training); it refuses points that were not chosen and a design that is no longer the
    record's."""
    from engram_experiments.runs import ExperimentError

    rec = json.loads((Path(__file__).resolve().parents[1] / "docs" / "results" / "retrofit.json").read_text())
    trained = []

    class FakeSweep:
        def __init__(self, out, max_steps=None, progress=True, jobs=1, methods=None):
            self.domain, self.general, self.steps = rf.DOMAIN, rf.GENERAL, max_steps or 100
            self.tcfg = type("T", (), {"seq_len": 128, "batch_size": 16})
            solved = {"engram_vocab_size": [1394, 1394]}  # what matched_engram solves on the base
            self.methods = {m: ({**kw, "engram_options": {**kw["engram_options"], **solved}}
                                if m == "engram-matched" else kw, lrs) for m, (kw, lrs) in methods.items()}
            self.before, self.shared_info = {"general": 4.0}, {"windows": 64}

        def train_all(self, keys):
            trained.extend(keys)

        def measure(self, m, lr, seed):
            return {"method": m, "lr": lr, "seed": seed}

    monkeypatch.setattr(rf, "Sweep", FakeSweep)
    names = ["engram lr 0.003", "engram-matched lr 0.001", "full lr 0.0001"]
    results, extra = rf.replicate(rec, names, [3000, 3100], tmp_path)
    assert trained == [("engram", 0.003, 3000), ("engram-matched", 0.001, 3000), ("full", 0.0001, 3000),
                       ("engram", 0.003, 3100), ("engram-matched", 0.001, 3100), ("full", 0.0001, 3100)]
    assert [r["seed"] for r in results["full lr 0.0001"]] == [3000, 3100] and extra["before"] == {"general": 4.0}
    with pytest.raises(ExperimentError, match="not a point"):
        rf.replicate(rec, ["full lr 0.009"], [3000], tmp_path)  # in the grid, never chosen
    monkeypatch.setitem(rf.METHODS, "full", (dict(method="full", lora_rank=4), ()))
    with pytest.raises(ExperimentError, match="no longer trains"):
        rf.replicate(rec, names, [3000], tmp_path)
