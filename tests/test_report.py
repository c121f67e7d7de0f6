"""`engram results`: the results page is rendered from the committed per-seed files, and stays so."""

import json
from pathlib import Path

import pytest

from engram.analysis import report
from engram.analysis.runs import seed_stats

ROOT = Path(__file__).resolve().parents[1]


def _rec(name, values: dict[str, list[float]]):
    return {"experiment": name, "variants": {v: seed_stats(xs) | {"params": 10, "table_params": 0}
                                             for v, xs in values.items()},
            "environments": [{"torch": "2.13.0", "threads": 2, "cpu": "X", "ENGRAM_FUSED": "1", "commit": "abcdef123"}]}


def test_placeholders_use_sample_sd_and_the_two_se_rule():
    recs = {"iso": _rec("iso", {"engram": [4.60, 4.61, 4.62], "no-engram": [4.70, 4.71, 4.72],
                                "iso-param": [4.60, 4.70, 4.65]})}
    text = report.render("{{stat:iso/engram}} | {{diff:iso/no-engram:iso/engram}} | "
                         "{{diff:iso/engram:iso/iso-param}} | {{env:iso}}", recs)
    stat, far, near, env = text.split(" | ")
    assert stat == "4.6100 ± 0.0100 (n=3)"
    assert far.startswith("-0.1000 ± 0.0082 (se)") and far.endswith("a finding (beyond 2 se)")
    assert near.endswith("no difference at this scale")  # +0.04 with se 0.029
    assert "2 threads" in env and "abcdef1" in env
    table = report.table_markdown(recs["iso"])
    assert "vs no-engram" in table and table.count("\n") == 4


def test_unknown_references_fail_loudly():
    with pytest.raises(KeyError, match="iso/nothing"):
        report.render("{{stat:iso/nothing}}", {"iso": _rec("iso", {"engram": [1.0, 2.0]})})


def test_record_keeps_every_seed_and_environment(tmp_path):
    env = {"torch": "2.13.0", "threads": 2}
    results = {"engram": [{"seed": s, "val_loss": [4.6, 4.61, 4.62][s], "environment": env,
                           "metrics": [{"step": 0, "val_loss": 8.0}, {"step": 10, "val_loss": 5.0}]} for s in range(3)]}
    summary = {"experiment": "iso", "preset": "exp", "seeds": 3,
               "variants": {"engram": seed_stats([r["val_loss"] for r in results["engram"]])}}
    rec = report.record_experiment(tmp_path / "iso.json", summary, results)
    back = json.loads((tmp_path / "iso.json").read_text())
    assert back == rec and back["seeds"] == {"engram": [0, 1, 2]}
    assert back["variants"]["engram"]["values"] == [4.6, 4.61, 4.62]
    assert back["environments"] == [env] and len(back["run_environment"]) == 3
    assert back["curves"]["engram"][2] == [[0, 8.0], [10, 5.0]]


def test_the_committed_results_page_is_what_the_per_seed_files_give():
    """docs/results.md must be `engram results`'s output: edit docs/results.in.md or re-record, then re-render."""
    assert report.main(str(ROOT / "docs/results"), str(ROOT / "docs/results.in.md"), str(ROOT / "docs/results.md"),
                       check=True) == 0
