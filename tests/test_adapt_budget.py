"""`engram_experiments.adapt_budget` (issue 59): the design's units, forgetting at matched gain on a run's path, the
Pareto front, the family of tests on synthetic records, and one unit end to end on a tiny base."""

import math
import shutil
from pathlib import Path

import pytest

from engram.persist import write_json
from engram.utils import parse_toml
from engram_experiments import adapt_budget as ab
from engram_experiments.runs import ExperimentError, read_result
from engram_experiments.significance import holm

ROOT = Path(__file__).resolve().parents[1]


def design() -> dict:
    return parse_toml((ROOT / "docs" / "prereg" / "adapt-budget.toml").read_text(), "adapt-budget.toml", ValueError)


def test_the_drafted_design_runs_every_budget_on_the_test_seeds_in_stop_rule_order():
    d = design()
    ab.check_design(d)
    assert d["status"] == "draft"  # --record refuses until the lead makes it confirmatory
    assert len(d["budgets"]) >= 5 and d["budgets"][0] <= 25600 and d["budgets"][-1] >= 800_000
    assert [ab.steps_of(b, d["train"]) for b in d["budgets"]] == [50, 119, 283, 673, 1600]
    chosen = {(m, meth): {b: lrs[1] for b in d["selection"]["budgets"]} for m in d["models"]
              for meth, lrs in d["methods"].items()}
    units = ab.test_units(d, chosen)
    assert len(units) == len(d["models"]) * len(d["budgets"]) * len(d["test"]["seeds"]) * len(d["methods"])
    assert len({u.name for u in units}) == len(units)
    # model, then budget ascending, then seed: a stopped test holds whole low budgets first
    order = [(d["models"].index(u.model), u.budget, u.seed) for u in units]
    assert order == sorted(order)
    assert not {u.seed for u in units} & {d["selection"]["seed"], *d["power"]["seeds"]}
    assert units[0].name == "smollm2-135m-instruct/full/b25600/lr0.0001-seed1"
    spread = ab.spread_units(d, chosen)
    assert {u.budget for u in spread} == {d["power"]["budget"]} and {u.seed for u in spread} == {101, 102}


def test_steps_paths_and_interpolated_learning_rates():
    tr = {"seq_len": 128, "batch_size": 4}
    with pytest.raises(ExperimentError, match="multiple of seq_len x batch_size = 512"):
        ab.steps_of(25000, tr)
    assert ab.path_steps(50, 8) == [7, 14, 21, 28, 35, 42, 49, 50]
    assert ab.path_steps(4, 2) == [2, 4] and ab.path_steps(3, 8) == [1, 2, 3]
    chosen = {100: 1e-2, 10000: 1e-4}
    assert ab.interpolated_lr(chosen, 1000) == pytest.approx(1e-3)  # halfway in log budget: halfway in log lr
    assert ab.interpolated_lr(chosen, 50) == 1e-2 and ab.interpolated_lr(chosen, 10**5) == 1e-4  # no extrapolation
    assert ab.interpolated_lr(chosen, 100) == 1e-2


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["methods"].update({"adalora": [1e-3]}), "not known"),
    (lambda d: d["test"].update({"seeds": [0, 1, 2]}), "also selection or spread seeds"),
    (lambda d: d["test"].update({"budgets": [60928]}), "no selection grid"),
    (lambda d: d.update({"budgets": [25600, 25000]}), "distinct and increasing"),
    (lambda d: d["test"].update({"pairs": [["engram", "ia3"]]}), "does not train"),
])
def test_a_design_the_code_cannot_run_is_refused_in_one_line(edit, message):
    d = design()
    edit(d)
    with pytest.raises(ExperimentError, match=message):
        ab.check_design(d)


PATH = [{"step": 0, "gain": 0.0, "forgetting_general": 0.0},
        {"step": 10, "gain": 0.2, "forgetting_general": 0.04},
        {"step": 20, "gain": 0.1, "forgetting_general": 0.06},  # the gain dips: the first crossing counts
        {"step": 30, "gain": 0.4, "forgetting_general": 0.10}]


def test_forgetting_at_matched_gain_is_linear_in_gain_at_the_first_crossing():
    assert ab.at_gain(PATH, 0.1, "forgetting_general") == pytest.approx(0.02)  # between steps 0 and 10, not step 20
    assert ab.at_gain(PATH, 0.2, "forgetting_general") == pytest.approx(0.04)  # a point exactly at the level
    assert ab.at_gain(PATH, 0.3, "forgetting_general") == pytest.approx(0.06 + (0.3 - 0.1) / 0.3 * 0.04)
    assert ab.at_gain(PATH, 0.0, "forgetting_general") == 0.0
    assert ab.at_gain(PATH, 0.5, "forgetting_general") is None  # never reached: contributes nothing


def test_pareto_front_per_method_over_every_path_point():
    def pt(step, gain, forgetting):
        return {"step": step, "gain": gain, "forgetting_general": forgetting}

    runs = [{"method": "engram", "budget": 1, "lr": 0.01, "seed": 0,
             "path": [pt(0, 0.0, 0.0), pt(5, 0.2, 0.1), pt(9, 0.3, 0.3)]},
            {"method": "engram", "budget": 2, "lr": 0.03, "seed": 0,
             "path": [pt(0, 0.0, 0.0), pt(5, 0.3, 0.2), pt(9, 0.25, 0.25)]},  # step 9: dominated by its own step 5
            {"method": "full", "budget": 1, "lr": 1e-4, "seed": 0, "path": [pt(0, 0.0, 0.0), pt(5, 0.5, 0.5)]}]
    f = ab.fronts(runs, ["engram", "full"], "forgetting_general")
    assert [(p["gain"], p["forgetting"], p["budget"], p["step"]) for p in f["engram"]] == \
        [(0.0, 0.0, 1, 0), (0.2, 0.1, 1, 5), (0.3, 0.2, 2, 5)]  # (both step-0 points are the base: one kept)
    assert [(p["gain"], p["forgetting"]) for p in f["full"]] == [(0.0, 0.0), (0.5, 0.5)]
    pts = [{"domain_val": 1, "forgetting_general": 1, "forgetting_shared": 1},
           {"domain_val": 1, "forgetting_general": 2, "forgetting_shared": 1},
           {"domain_val": 0, "forgetting_general": 3, "forgetting_shared": 1}]
    assert ab.dominated(pts) == [False, True, False]


def _run(model, method, budget, seed, end, forgetting, slope=1.0, diverged=None):
    """A synthetic unit record: its path climbs linearly to gain `end` with forgetting `slope` x gain + `forgetting`."""
    path = [{"step": s, "gain": end * s / 4, "forgetting_general": forgetting + slope * end * s / 4,
             "forgetting_shared": forgetting} for s in range(5)]
    return {"model": model, "method": method, "budget": budget, "lr": 0.01, "seed": seed, "path": path,
            "domain_val": None if diverged else 4.0 - end, "diverged": diverged}


def test_family_pairs_by_seed_tests_at_the_matched_level_and_holm_adjusts_the_whole_family():
    d = {"models": ["m"], "methods": {"engram": [0.01], "lora-all": [0.01]},
         "selection": {"seed": 0, "budgets": [512], "gain_levels": [0.1, 0.2, 0.4]},
         "test": {"seeds": [1, 2, 3], "budgets": [512], "pairs": [["engram", "lora-all"]], "alpha": 0.05,
                  "metrics": ["domain_val", "forgetting_general_at_gain", "forgetting_shared_at_gain"]}}
    chosen = {("m", "engram"): {512: 0.01}, ("m", "lora-all"): {512: 0.01}}
    selection = [_run("m", "engram", 512, 0, 0.25, 0.0), _run("m", "lora-all", 512, 0, 0.5, 0.0)]
    levels = ab.matched_levels(d, selection, chosen, [512])
    assert levels == {("m", 512, "engram", "lora-all"): 0.2}  # the largest level both selection paths reach
    runs = [_run("m", "engram", 512, s, 0.25 + 0.01 * s, 0.0) for s in (1, 2, 3)] + \
           [_run("m", "lora-all", 512, s, 0.5 + 0.013 * s, 0.0, slope=2.0 + 0.1 * s) for s in (1, 2, 3)]
    rows = ab.family(d, runs, chosen, levels)
    assert [r["metric"] for r in rows] == d["test"]["metrics"]
    dom, gen, shared = rows
    assert dom["kind"] == "paired" and dom["diff"] == pytest.approx(-0.256) and dom["n"] == 3
    # forgetting at gain 0.2: engram 0.2 (slope 1), lora-all 0.2 x slope
    assert gen["level"] == 0.2 and gen["diff"] == pytest.approx(0.2 * 2.2 - 0.2) and gen["n"] == 3
    assert shared["kind"] == "paired" and shared["se"] == 0 and shared["p"] == 1.0  # the same on every seed
    assert [r["p_holm"] for r in rows] == pytest.approx(holm([r["p"] for r in rows]))
    assert all(r["finding"] == (r["p_holm"] < 0.05) for r in rows)
    # a side where fewer than two seeds reach the level: kept in the family at p = 1, saying why
    runs[1] = _run("m", "engram", 512, 2, 0.1, 0.0)
    runs[2] = _run("m", "engram", 512, 3, 0.0, 0.0, diverged="loss became nan at step 3")
    rows = ab.family(d, runs, chosen, levels)
    assert rows[0]["seeds_a"] == [1, 2] and rows[0]["left_out"] == [3]  # the diverged run has no final loss
    assert rows[1]["kind"] == "not testable" and rows[1]["p"] == 1.0 and "fewer than 2" in rows[1]["why"]
    assert rows[1]["left_out"] == [2, 3]


def test_the_test_summary_renders_its_tables_and_plot_from_unit_records(tmp_path):
    """summarize -> markdown -> plot on synthetic unit records: the selection with its dominated points, the
    interpolated lr of a budget without a grid, the curve, forgetting at matched gain, the fronts, the tests."""
    d = {"models": ["m"], "domain": ["x"], "methods": {"engram": [0.01, 0.03], "lora-all": [0.01]},
         "budgets": [512, 1024, 2048], "train": {"seq_len": 32, "batch_size": 4},
         "selection": {"seed": 0, "budgets": [512, 2048], "gain_levels": [0.1, 0.2]},
         "test": {"seeds": [1, 2], "budgets": [2048], "pairs": [["engram", "lora-all"]], "alpha": 0.05,
                  "metrics": ["domain_val", "forgetting_general_at_gain"], "smallest_effect_of_interest": 0.02}}
    root = tmp_path / "adapt-budget"
    write_json(root / "m" / "setup.json", {"before": {"domain": 4.0, "general": 2.0, "shared": 3.0},
                                            "base_info": {"source": "m.Q4_1.gguf"}, "train_tokens": 10**5})
    grids = {("m", "engram", 512): [0.01, 0.03], ("m", "engram", 2048): [0.01, 0.03],
             ("m", "lora-all", 512): [0.01], ("m", "lora-all", 2048): [0.01]}
    chosen = {("m", "engram"): {512: 0.03, 2048: 0.01}, ("m", "lora-all"): {512: 0.01, 2048: 0.01}}
    units = [ab.Unit(m, meth, b, lr, 0) for (m, meth, b), lrs in grids.items() for lr in lrs] + \
        ab.test_units(d, chosen)
    d["power"] = {"seeds": [101, 102], "budget": 512}
    units += ab.spread_units(d, chosen)
    for u in units:
        r = _run(u.model, u.method, u.budget, u.seed, 0.3 + 0.01 * (u.seed % 100) * (1 + (u.method == "lora-all")) +
                 (u.method == "lora-all") * 0.1, 0.0, slope=1.0 + (u.lr == 0.03))
        r.update(lr=u.lr, gain=r["path"][-1]["gain"], forgetting_general=r["path"][-1]["forgetting_general"],
                 forgetting_shared=0.0, environment=None)
        write_json(u.dir(root) / "unit.json", r)
    assert {u.lr for u in units if u.method == "engram" and u.budget == 1024} == {0.0173}  # between 0.03 and 0.01
    s = ab.summarize(root, d, "test", chosen, grids, {c: {} for c in grids})
    assert len(s["tests"]) == 2 and s["tests"][1]["level"] == 0.2
    assert [r["dominated"] for r in s["selection"] if r["budget"] == 512] == [False, True, False]
    md = ab.markdown(s)
    assert "Base: m.Q4_1.gguf" in md and "| 512 | engram | 0.03 * |" in md and "not a finding" in md
    ab.plot(s, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    # the pilot: the selection seed and the spread seeds at the power budget give the power plan
    pilot = ab.summarize(root, d, "pilot", chosen, grids, {c: {} for c in grids})
    dom = pilot["power"][0]
    assert dom["metric"] == "domain_val" and dom["seeds"] == [0, 101, 102] and dom["sd"] == pytest.approx(0.01)
    assert dom["n_needed"] == 5 and "Power plan" in ab.markdown(pilot)  # 0.02 nats at sd 0.01: 5 pairs


def test_spread_aware_formatting():
    assert ab.fmt({"mean": 3.48791, "std": 0.0034, "n": 3}) == "3.4879 ± 0.0034 (n=3)"
    assert ab.fmt({"mean": 0.5, "std": 0.00004, "n": 3}, sign=True) == "+0.500000 ± 0.000040 (n=3)"
    assert ab.fmt({"mean": 0.5, "std": 0.0, "n": 1}) == "0.5000" and ab.fmt(None) == "-"
    assert ab.fmt({"mean": -0.1, "std": 1e-17, "n": 3}, sign=True) == "-0.1000 ± 0.0000 (n=3)"  # rounding, not spread


# ------------------------------------------------------------------------------------------ one unit, end to end
@pytest.mark.integration
def test_one_unit_on_a_tiny_base_records_its_path_and_resumes_a_missing_point(tmp_path, one_thread):
    pytest.importorskip("transformers")
    import numpy as np
    import torch
    from bases import tale_tokenizer, tiny_base

    from engram.inference import load_with_adapter
    from engram.training.run import evaluate

    base = tmp_path / "base"
    tiny_base("llama").save_pretrained(base)
    shutil.copy(tale_tokenizer(tmp_path / "tok" / "tokenizer.json"), base / "tokenizer.json")
    texts = {"domain": "".join(f"def f{i % 50}(x):\n    return x * {i % 7} + {i % 11}\n\n" for i in range(1500)),
             "general": "".join(f"The quick brown fox jumps over the lazy dog, line {i}.\n" for i in range(1500)),
             "pool": "".join(f"return the king said to x {i % 13} of the tale\n" for i in range(1500))}
    for k, t in texts.items():
        (tmp_path / f"{k}.txt").write_text(t)
    d = {"models": [str(base)], "domain": [str(tmp_path / "domain.txt")], "general": [str(tmp_path / "general.txt")],
         "shared_pool": [str(tmp_path / "pool.txt")], "shared_windows": 4, "budgets": [512],
         "train": {"seq_len": 32, "batch_size": 4, "warmup_fraction": 0.25, "min_lr_ratio": 0.1, "weight_decay": 0.0,
                   "eval_max_windows": 4, "layers": [1], "evals": 2, "keep_models": True},
         "methods": {"engram": [1e-2]}}
    root = tmp_path / "out" / "adapt-budget"
    setup = ab.setup_model(str(root), str(base), d, progress=False)
    assert setup["base_info"] is None and set(setup["before"]) == {"domain", "general", "shared"}
    rec = ab.run_unit(str(root), str(base), "engram", 512, 1e-2, 0, d)
    assert [p["step"] for p in rec["path"]] == [0, 2, 4]  # step 0 (the base) and two eval points
    end = rec["path"][-1]
    assert rec["path"][0]["gain"] == 0 and end["gain"] > 0 and rec["diverged"] is None
    assert end["gain"] == pytest.approx(setup["before"]["domain"] - rec["domain_val"])
    assert end["forgetting_general"] == pytest.approx(end["general_val"] - setup["before"]["general"])
    # the point measured from the checkpoint is the trained adapter: its saved final model gives the same loss
    run_dir = ab.Unit(str(base), "engram", 512, 1e-2, 0).dir(root)
    final, _ = load_with_adapter(base, run_dir)
    shared = np.load(root / "base" / "shared.npy")
    assert evaluate(final.eval(), shared, 4, torch.device("cpu")) == pytest.approx(end["shared_val"], abs=1e-6)
    # a unit stopped before its last point was measured: the rerun measures it from the checkpoint, trains nothing
    (run_dir / "unit.json").unlink()
    path = read_result(run_dir / "path.json", "path", expect=list)
    write_json(run_dir / "path.json", path[:-1])
    lines = (run_dir / "metrics.jsonl").read_text()
    again = ab.run_unit(str(root), str(base), "engram", 512, 1e-2, 0, d)
    assert (run_dir / "metrics.jsonl").read_text() == lines
    assert [(p["step"], p.get("shared_val")) for p in again["path"]] == [(p["step"], p.get("shared_val"))
                                                                          for p in rec["path"]]
    assert math.isfinite(again["step_ms"])
