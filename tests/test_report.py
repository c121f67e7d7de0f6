"""`engram results`: the results page is rendered from the committed per-seed files, and stays so."""

import json
from pathlib import Path

import pytest

stats = pytest.importorskip("scipy.stats", reason="scipy computes the tests")

from engram.analysis import records, report  # noqa: E402
from engram.analysis import significance as sig  # noqa: E402
from engram.analysis.runs import seed_stats  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _rec(name, values: dict[str, list[float]]):
    return {"experiment": name, "variants": {v: seed_stats(xs) | {"params": 10, "table_params": 0}
                                             for v, xs in values.items()},
            "environments": [{"torch": "2.13.0", "threads": 2, "cpu": "X", "ENGRAM_FUSED": "1", "commit": "abcdef123"}]}


def test_placeholders_use_sample_sd_and_the_family_tests():
    recs = {"iso": _rec("iso", {"engram": [4.60, 4.61, 4.62], "no-engram": [4.70, 4.71, 4.72],
                                "iso-param": [4.60, 4.70, 4.65]})}
    recs["iso"]["seeds"] = {v: [0, 1, 2] for v in recs["iso"]["variants"]}
    fam = "{{family:F\niso/no-engram:iso/engram\niso/engram:iso/iso-param}}"
    text = report.render(f"## s\n{fam}\n@{{{{stat:iso/engram}}}}@{{{{diff:iso/no-engram:iso/engram}}}}@"
                         "{{diff:iso/engram:iso/iso-param}}@{{env:iso}}", recs)
    table, stat, far, near, env = text.split("@")
    assert stat == "4.6100 ± 0.0100 (n=3)"
    # engram - no-engram is -0.1 in every seed: paired differences with no spread, p = 0, a finding
    assert far.startswith("-0.1000 ± 0.0000 (paired t, n=3; p <1e-6, Holm <1e-6)") and far.endswith(": a finding")
    # iso-param - engram: differences 0, 0.09, 0.03: paired p from scipy, Holm x1 (the larger of two p)
    p = stats.ttest_rel([4.60, 4.70, 4.65], [4.60, 4.61, 4.62]).pvalue
    assert f"p {sig.fmt_p(p)}, Holm {sig.fmt_p(p)}" in near and "not a finding (detectable at 80% power" in near
    assert "**Tests, family F** (2 comparisons, paired t-tests (shared seeds)" in table
    assert "| engram - no-engram | -0.1000 ± 0.0000 | paired t, n=3 |" in table
    assert "2 threads" in env and "abcdef1" in env
    md = records.table_markdown(recs["iso"])
    assert "vs no-engram (difference of means)" in md and md.count("\n") == 4 and "| -0.1000 |" in md


def test_holm_is_within_the_family_and_diffs_need_one():
    recs = {"e": _rec("e", {"a": [1.0, 1.1, 1.2, 1.3], "b": [1.5, 1.7, 1.6, 1.8], "c": [1.0, 1.2, 1.1, 1.3]})}
    one = report.render("{{family:F\ne/a:e/b}}{{diff:e/a:e/b}}", recs)  # no seeds recorded: Welch
    two = report.render("{{family:F\ne/a:e/b\ne/a:e/c}}{{diff:e/a:e/b}}", recs)
    p = stats.ttest_ind([1.5, 1.7, 1.6, 1.8], [1.0, 1.1, 1.2, 1.3], equal_var=False).pvalue
    assert f"(Welch t, n=4/4; p {sig.fmt_p(p)}, Holm {sig.fmt_p(p)})" in one
    assert f"Holm {sig.fmt_p(2 * p)})" in two  # the smaller of two p-values, times two
    with pytest.raises(KeyError, match="not in a family of its section"):
        report.render("{{family:F\ne/a:e/b}}\n## next\n{{diff:e/a:e/b}}", recs)  # families end with their section


def test_welch_check_is_unpaired_even_where_seeds_are_shared():
    recs = {"e": _rec("e", {"a": [1.0, 1.1, 1.2, 1.3], "b": [1.5, 1.7, 1.6, 1.8]})}
    recs["e"]["seeds"] = {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}
    text = report.render("{{welch:e/a:e/b}}", recs)
    p = stats.ttest_ind([1.5, 1.7, 1.6, 1.8], [1.0, 1.1, 1.2, 1.3], equal_var=False).pvalue
    assert text.startswith("+0.5000 ± ")
    assert f"(Welch t, n=4/4, unadjusted, outside the family; p {sig.fmt_p(p)})" in text


def test_a_record_with_summaries_only_is_tested_by_welch_from_them():
    rec = {"experiment": "sweep", "variants": {"a": {"mean": 4.3, "std": 0.01, "n": 2, "half_range": 0.007},
                                               "b": {"mean": 4.28, "std": 0.005, "n": 3, "half_range": 0.004}}}
    t = report.comparison({"sweep": rec}, "sweep/a", "sweep/b")
    assert t.kind == "welch" and t.p == pytest.approx(sig.welch_summary(4.3, 0.01, 2, 4.28, 0.005, 3).p)


def test_unsourced_numbers_catch_a_hand_typed_result():
    ok = ("Engram vs none: {{diff:iso/a:iso/b}}, {{stat:iso/a}}; the paper's {{quoted:the paper|1.634}}; "
          "lr `3e-3`, init {{set:N(0, 0.02)}}; 500 steps, 4 blocks, 1,024 tokens, DeepSeek-V4.1.\n"
          "![x](img/exp-1.5.png)\n## 10. Section\n{{family:F\niso/a:iso/b}}")
    assert report.unsourced_numbers(ok) == []
    for bad in ("the memory is 0.035 below the pure MoE", "it forgets 44% less", "damage: 14x that",
                "loss 4.62 ± 0.01", "a 2.3-se result"):
        found = report.unsourced_numbers(ok + "\n" + bad)
        assert [line for _, line in found] == [bad], bad
        assert found[0][0] == ok.count("\n") + 2  # line numbers survive multi-line placeholders


def test_unknown_references_fail_loudly():
    with pytest.raises(KeyError, match="iso/nothing"):
        report.render("{{stat:iso/nothing}}", {"iso": _rec("iso", {"engram": [1.0, 2.0]})})


def test_record_keeps_every_seed_and_environment(tmp_path):
    env = {"torch": "2.13.0", "threads": 2}
    results = {"engram": [{"seed": s, "val_loss": [4.6, 4.61, 4.62][s], "environment": env,
                           "metrics": [{"step": 0, "val_loss": 8.0}, {"step": 10, "val_loss": 5.0}]} for s in range(3)]}
    summary = {"experiment": "iso", "preset": "exp", "seeds": 3,
               "variants": {"engram": seed_stats([r["val_loss"] for r in results["engram"]])}}
    rec = records.record_experiment(tmp_path / "iso.json", summary, results)
    back = json.loads((tmp_path / "iso.json").read_text())
    assert back == rec and back["seeds"] == {"engram": [0, 1, 2]}
    assert back["variants"]["engram"]["values"] == [4.6, 4.61, 4.62]
    assert back["environments"] == [env] and len(back["run_environment"]) == 3
    assert back["curves"]["engram"][2] == [[0, 8.0], [10, 5.0]]


def test_the_committed_results_page_is_what_the_per_seed_files_give():
    """docs/results.md must be `engram results`'s output: edit docs/results.in.md or re-record, then re-render."""
    assert report.main(str(ROOT / "docs/results"), str(ROOT / "docs/results.in.md"), str(ROOT / "docs/results.md"),
                       check=True) == 0


def test_every_measured_number_on_the_results_page_has_a_record_or_is_marked_quoted():
    """A decimal, percentage, ± or "Nx" typed into docs/results.in.md's prose instead of rendered from a record
    (`{{stat}}`, `{{diff}}`, `{{table}}`, `{{value}}`) or marked (`{{quoted:SOURCE|...}}`, `{{set:...}}`)."""
    text = (ROOT / "docs/results.in.md").read_text(encoding="utf-8")
    assert report.unsourced_numbers(text) == []
