import json
import shutil
import subprocess

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from conftest import run_cli  # noqa: E402
from test_train import make_corpus  # noqa: E402  (shared corpus builder)

from engram_experiments.preset import run_experiment  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus_an"))


@pytest.mark.integration
@pytest.mark.parametrize("name", [pytest.param("iso", marks=pytest.mark.slow), "placement", "capacity", "ablations",
                                  "design"])  # (iso: 7 s, -m slow)
def test_experiments_run_at_tiny_size(corpus, tmp_path, name):
    seeds = 2 if name in ("iso", "design") else 1
    s = run_experiment(name, out=tmp_path, seeds=seeds, preset="tiny", data=[str(corpus)],
                       max_steps=3, progress=False, size="small")
    root = tmp_path / name
    assert (root / "summary.json").is_file() and (root / "summary.md").is_file() and (root / "plot.png").is_file()
    table = json.loads((root / "summary.json").read_text())["variants"]
    assert table == s["variants"]
    if name == "iso":
        assert set(table) == {"engram", "no-engram", "iso-param"} and len(table["engram"]["values"]) == 2
        assert table["no-engram"]["table_params"] == 0 < table["engram"]["table_params"]
    if name == "placement":  # block 1 is the preset's own Engram layer: iso's run, trained once, shared
        assert set(table) == {"block0", "block1"}
        assert (tmp_path / "iso" / "engram-seed0" / "summary.json").is_file() and not (root / "block1-seed0").exists()
        from engram_experiments.runs import trained_run

        # not the run asked for
        with pytest.raises(RuntimeError, match="holds a finished run of preset 'tiny', seed 0"):
            trained_run(tmp_path / "iso" / "engram-seed0", "x", 1, "tiny", data=[str(corpus)], max_steps=3,
                        progress=False)
    if name == "capacity":
        assert "rows1" in table and "no-engram" in table
    if name == "ablations":
        assert {"shuffled-hash", "frozen-table", "no-gate", "no-conv", "no-compression"} <= set(table)
    if name == "design":  # the reference vs V4.1's conv-less design, V4.1 also served as FP8 + ue8m0 rows
        assert set(table) == {"reference", "v41", "v41, fp8_ue8m0 rows"} and table["v41"]["n"] == 2
        assert table["v41"]["params"] == table["reference"]["params"]  # (the unused conv weights are still built)
        assert table["v41"]["table_params"] == table["reference"]["table_params"]
        # no test of its own beside the results page's family (the Welch p it kept was stale beside the paired one)
        assert "vs_reference" not in table["v41, fp8_ue8m0 rows"] and "sd, n" in (root / "summary.md").read_text()
        # the record: the command as run, the steps the runs trained, the FP8 evaluations paired by their runs' seeds
        run_experiment(name, out=tmp_path, seeds=seeds, preset="tiny", data=[str(corpus)], max_steps=3,
                       progress=False, finished_only=True, record=tmp_path / "rec")
        rec = json.loads((tmp_path / "rec" / "design.json").read_text())
        assert rec["command"] == ("engram experiment design --seeds 2 --preset tiny --max-steps 3 "
                                  f"--data {corpus.name} --record docs/results")
        assert rec["steps"] == [3] and rec["seeds"]["v41, fp8_ue8m0 rows"] == rec["seeds"]["v41"] == [0, 1]
    # finished runs are skipped on a rerun (resumable experiments)
    again = run_experiment(name, out=tmp_path, seeds=seeds, preset="tiny", data=[str(corpus)],
                           max_steps=3, progress=False, size="small")
    assert again["variants"] == table


@pytest.mark.integration
@pytest.mark.slow  # (19 s: worker processes training)
def test_jobs_train_runs_in_their_own_processes_with_the_same_numbers(corpus, tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # the children compute as this process does
    kw = dict(seeds=1, preset="tiny", data=[str(corpus)], max_steps=3, progress=False)
    apart = run_experiment("iso", out=tmp_path / "apart", jobs=2, **kw)
    logs = sorted(p.name for p in (tmp_path / "apart" / "iso").glob("*.log"))
    assert logs == ["engram-seed0.log", "iso-param-seed0.log", "no-engram-seed0.log"]  # each run was a subprocess
    here = run_experiment("iso", out=tmp_path / "here", **kw)
    for v, row in here["variants"].items():
        assert apart["variants"][v]["values"] == pytest.approx(row["values"], rel=1e-6)


@pytest.mark.integration
def test_a_failed_subprocess_run_names_its_log(tmp_path):
    from engram_experiments.runs import ExperimentError, call_in_subprocess

    call_in_subprocess("engram.persist:write_json", {"path": str(tmp_path / "x.json"), "obj": {"a": 1}},
                       tmp_path / "ok.log", "writing x")
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1}
    with pytest.raises(ExperimentError, match=r"writing y failed \(exit 1\); see .*bad.log"):
        call_in_subprocess("engram.persist:write_json", {"nope": 1}, tmp_path / "bad.log", "writing y")
    assert "TypeError" in (tmp_path / "bad.log").read_text()


@pytest.mark.integration
def test_sensitivity_reuses_iso_runs(corpus, tmp_path, monkeypatch):
    run_experiment("iso", out=tmp_path, seeds=1, preset="tiny", data=[str(corpus)], max_steps=3, progress=False)
    iso_run = tmp_path / "iso" / "engram-seed0"
    before = {f: f.stat().st_mtime_ns for f in iso_run.rglob("*") if f.is_file()}
    import engram.training.train

    def no_training(*a, **k):
        raise AssertionError("sensitivity trained a model although the iso experiment's run is finished")

    monkeypatch.setattr(engram.training.train, "train", no_training)  # (the experiment drivers import it at call time)
    s = run_experiment("sensitivity", out=tmp_path, seeds=1, preset="tiny", data=[str(corpus)], max_steps=3,
                       progress=False)
    assert {f: f.stat().st_mtime_ns for f in iso_run.rglob("*") if f.is_file()} == before  # read, not rewritten
    assert not [d for d in (tmp_path / "sensitivity").iterdir() if d.is_dir()]  # no runs of its own
    assert s["variants"]["all other tokens"]["on"]["values"][0] > 0
    t = s["variants"]
    assert set(t) == {"frequent n-gram completions", "all other tokens"}
    assert all(v["tokens"] > 0 for v in t.values())
    # --finished-only: the iso runs that finished (seed 0 of 2 asked), recorded, nothing trained
    s = run_experiment("iso", out=tmp_path, seeds=2, preset="tiny", data=[str(corpus)], max_steps=3, progress=False,
                       finished_only=True, record=tmp_path / "rec")
    assert {v["n"] for v in s["variants"].values()} == {1}
    rec = json.loads((tmp_path / "rec" / "iso.json").read_text())
    assert rec["seeds"]["engram"] == [0] and rec["environments"][0]["threads"] >= 1


@pytest.mark.slow  # out of the default run (under 10 min on 2 cores): 11 s; gates --base/--adapter: test_cli_grammar
@pytest.mark.integration
def test_gates_and_stats_cli(corpus, tmp_path, monkeypatch, capsys):
    """`engram gates` once as a user runs it (a fresh interpreter); the other calls in-process (same main())."""
    from engram.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--preset", "tiny", "--data", str(corpus), "--out", "run", "--max-steps", "3"]) == 0
    capsys.readouterr()
    r = run_cli("gates", "--checkpoint", "run", "--text", "the king and the queen", "--out", "g.png", "--summary",
                "--record", "gates.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "g.png").stat().st_size > 1000 and "mean gate on frequent n-gram completions" in r.stdout
    rec = json.loads((tmp_path / "gates.json").read_text())
    assert rec["experiment"] == "gates" and "--summary" in rec["command"] and rec["environment"]["torch"]
    layer = next(iter(rec["summary"].values()))
    assert f"{layer['entity_completion']:.3f}" in r.stdout
    assert main(["gates", "--checkpoint", "run", "--text", "the king", "--out", "g.html"]) == 0
    page = (tmp_path / "g.html").read_text()
    assert page.count('class="tok"') >= 2 and "data-gates" in page and "mouseenter" in page
    capsys.readouterr()
    assert main(["gates", "--checkpoint", "run", "--text", "x", "--out", "g.gif"]) == 2
    assert ".png or .html" in capsys.readouterr().err
    assert main(["stats", "--data", str(corpus), "--tokenizer", "bpe:300", "--sizes", "101", "1009",
                 "--out", "z.png", "--record", "stats.json"]) == 0
    out = capsys.readouterr().out
    assert "reduction" in out and "collide" in out and (tmp_path / "z.png").is_file()
    from engram_experiments.report import render

    rec = json.loads((tmp_path / "stats.json").read_text())
    assert [u["table_rows"] for u in rec["row_usage"]] == [101, 1009, 101, 1009] and rec["environment"]["torch"]
    assert render("{{table:stats}} {{value:stats/zipf_top.2.top1pct_share|.1%}}", {"stats": rec}).count("\n") == 5


@pytest.mark.skipif(not shutil.which("chromium"), reason="headless Chromium not installed")
def test_gates_html_renders_in_headless_chromium(corpus, tmp_path):
    import numpy as np

    from engram.analysis.gates import save_html

    page = save_html(["the", " king"], {1: np.array([[0.2, 0.3], [0.9, 0.8]])}, tmp_path / "g.html")
    r = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-500:]
    assert 'class="tok"' in r.stdout and "hover a token" in r.stdout


@pytest.mark.slow  # two tiny sweeps: ~20 s alone, over a minute on a shared machine
def test_allocation_adds_seeds_to_a_committed_record(corpus, tmp_path):
    """`--variants V --seeds N --record DIR` with DIR/allocation.json committed: only V's missing seeds train (in
    an empty OUT); the other runs come from the record unchanged, environments included."""
    from engram_experiments import allocation as A

    rec_dir = tmp_path / "rec"
    A.run(tmp_path / "a", seeds=2, max_steps=2, progress=False, scale="tiny", data=[str(corpus)], record=rec_dir,
          third_seed=False)
    before = json.loads((rec_dir / "allocation.json").read_text())
    A.run(tmp_path / "b", seeds=3, max_steps=2, progress=False, scale="tiny", data=[str(corpus)], record=rec_dir,
          only=["moe-E5+engram"])
    after = json.loads((rec_dir / "allocation.json").read_text())
    trained = sorted(p.name for p in (tmp_path / "b" / "allocation-tiny").iterdir() if p.is_dir())
    assert trained == ["moe-E5+engram-seed2"]
    assert after["seeds"]["moe-E5+engram"] == [0, 1, 2] and after["seeds"]["moe-E6"] == [0, 1]
    for v, r in before["variants"].items():
        assert after["variants"][v]["values"][:2] == r["values"]
    assert after["variants"]["moe-E6"] == before["variants"]["moe-E6"]
    assert len(after["run_environment"]) == sum(len(s) for s in after["seeds"].values())
    assert after["command"].startswith(before["command"] + "; then ")


def test_collisions_count_every_ngram_in_a_shared_row():
    """§7's measure: 3 n-grams in row 5, 2 in row 9, 1 alone in row 7 -> 5 of 6 share their row (the old
    (distinct - rows used) / distinct said 3 of 6)."""
    import numpy as np

    from engram.analysis.stats import row_usage, shared_rows

    assert shared_rows(np.array([5, 5, 5, 7, 9, 9])) == (3, 5 / 6)
    assert shared_rows(np.array([1, 2, 3])) == (3, 0.0)
    # uniform hashing of n distinct n-grams into p rows: 1 - exp(-n/p) of them share a row (Poisson occupancy)
    ids = np.random.default_rng(0).integers(0, 50_000, 400_000)
    u = [r for r in row_usage(ids, [100_000]) if r["order"] == 3][0]
    lam = u["distinct_ngrams"] / u["table_rows"]
    assert u["collision_rate"] == pytest.approx(1 - np.exp(-lam), abs=0.01)
