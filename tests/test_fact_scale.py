"""Scale and sequence of fact edits (`engram_experiments.fact_scale`, issue 56 item 3) on a tiny random Llama with an
edit-ready Engram adapter (`tiny_setup`, also what the driver's unit processes build here through `--setup`): the
units' facts (reserved probes, nested batches), the batch runner's time, peak memory, bytes per fact and row sharing,
the sequential runner's retention when a later edit overwrites an earlier one, caching and resuming, and the family."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from engram_experiments import fact_edits, fact_scale  # noqa: E402
from engram_experiments import factset as fs  # noqa: E402
from engram_experiments.runs import ExperimentError  # noqa: E402

HERE = Path(__file__).resolve().parent
COUNTRIES = ["France", "Japan", "Peru", "Chile", "Spain", "Italy", "Kenya", "Egypt", "Nepal"]
WORDS = ["king", "dog", "fox", "tale", "line", "quick", "brown", "lazy", "said"]  # one token each in the tale's BPE
ROWS = {"capital": list(zip(COUNTRIES, WORDS)), "continent": list(zip(COUNTRIES, WORDS[3:] + WORDS[:3]))}
STEPS = {"steps": 5, "lr": 0.3, "target_prob": 0.9}


def tiny_setup(root, progress=True):
    """A `fact_edits.Setup` on a tiny random Llama (tale tokenizer, 400 tokens) with a trained-like Engram adapter
    made edit-ready (`clear_rows`), and the facts of `tiny_facts`."""
    from bases import tale_tokenizer, tiny_base
    from tokenizers import Tokenizer

    import engram
    from engram.adapters import adapter_of, clear_rows
    from engram.editing import table_rows_read

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tok_file = root / "tokenizer.json"
    if not tok_file.is_file():
        tale_tokenizer(tok_file)
    model = tiny_base("llama").eval()
    engram.attach(model, [1], tokenizer=tok_file, verbose=False, engram_vocab_size=[211, 223], n_embed_per_ngram=16,
                  n_head_per_ngram=2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # stand-in for a trained adapter, then edit-ready: the base until a row is written
        for p in adapter_of(model).parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    clear_rows(model)
    model.eval()
    facts, known = tiny_facts(root)
    windows = torch.randint(2, 400, (4, 16), generator=torch.Generator().manual_seed(0))
    s = fact_edits.Setup(model, Tokenizer.from_file(str(tok_file)), facts, known,
                         lambda msgs: "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:",
                         windows, fact_edits.token_losses(model, windows))
    s.hashed = table_rows_read(model, windows.numpy())
    return s


def tiny_facts(root):
    """The facts of ROWS (3 invented entities per relation) in root/facts.jsonl and every real one "known" in
    root/known.json (the files `fact_edits.setup` leaves, what the driver plans from): (facts, known ids)."""
    from engram.persist import write_json

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "facts.jsonl").is_file():
        fs.write(root / "facts.jsonl", fs.build_from_rows(ROWS, seed=0, new_per_relation=3))
    facts = fs.read(root / "facts.jsonl")
    known = {f.id for f in facts if f.kind == "real"}
    write_json(root / "known.json", {"known": sorted(known), "of": len(facts)})
    return facts, known


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest: tiny models, one intra-op thread)


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("fact-edits"))


def design(**kw):
    return {"methods": ["subject+trigger+ctx"], "sizes": [1, 3, 6], "sequential": 4, "every": 2, "insert": 2,
            "sets": 1, "probes": 2, "split": "all", "seed": 0, "settings": STEPS, **kw}


def test_units_reserve_probe_subjects_nest_the_batches_and_refuse_too_many_facts():
    facts = fs.build_from_rows(ROWS, seed=0, new_per_relation=3)
    known = {f.id for f in facts if f.kind == "real" and f.subject != "Nepal"}
    plan = fact_scale.units(facts, known, design())
    by_id = {f.id: f for f in facts}
    probes = plan["batch--subject+trigger+ctx--0001--0"]["probes"]
    reserved = {by_id[i].subject for i in probes}
    assert len(reserved) == 4 and all(i in known for i in probes)  # 2 subjects per relation, every fact of them
    assert len(probes) == 2 * len(reserved)
    batches = [plan[f"batch--subject+trigger+ctx--{n:04d}--0"]["facts"] for n in (1, 3, 6)]
    assert batches[0] == batches[1][:1] and batches[1] == batches[2][:3]  # nested
    assert not {by_id[i].subject for b in batches for i in b} & reserved  # a reserved subject is never edited
    assert {by_id[i].relation for i in batches[1][:2]} == {"capital", "continent"}  # the relations in turn
    order = [i in known for i in batches[2]]
    assert order == sorted(order, reverse=True)  # known facts first
    assert plan["sequential--subject+trigger+ctx--0004"]["facts"] == batches[2][:4]  # the same facts as a batch
    assert all(by_id[i].kind == "new" for i in plan["insert--subject+trigger+ctx--0002"]["facts"])
    assert fact_scale.units(facts, known, design()) == plan  # seeded
    two = fact_scale.units(facts, known, design(sets=2))
    assert two["batch--subject+trigger+ctx--0006--1"]["facts"] != batches[2]  # another order, the same probes
    assert two["batch--subject+trigger+ctx--0006--1"]["probes"] == probes
    with pytest.raises(ExperimentError, match="ask for at most 10"):
        fact_scale.units(facts, known, design(sizes=[11]))


def test_optimized_facts_are_the_sequences_fact_edits_optimizes(s):
    from engram.editing import edit_rows

    batch = [f for f in s.facts if f.kind == "real"][:2]
    for method in ("trigger", "subject+trigger+ctx"):
        e = fact_edits.METHODS[method](s, batch, fact_scale.OPTIMIZED)
        e.undo()
        seqs = [x for f in batch for x in fact_scale.optimized_facts(f, method)]
        rows = edit_rows(s.model, s.tok, seqs, fact_scale.positions_of(method))
        assert e.info["sequences"] == len(seqs) and e.info["rows"] == sum(r.numel() for r in rows.values())
    with pytest.raises(ExperimentError, match="no Engram overlay method"):
        fact_scale.positions_of("grace")


def test_a_batch_records_time_peak_memory_bytes_per_fact_row_sharing_and_each_facts_measures(s, tmp_path,
                                                                                             monkeypatch):
    real = [f for f in s.facts if f.kind == "real"]
    france = [f for f in real if f.subject == "France"]
    batch = france + [f for f in real if f.subject == "Japan"][:1]  # two facts of one subject share its rows
    probes = [f for f in real if f.subject in ("Peru", "Chile")]
    spec = {"kind": "batch", "method": "subject+trigger+ctx", "size": 3, "set": 0, "facts": [f.id for f in batch],
            "probes": [f.id for f in probes]}
    path = tmp_path / "units" / "batch.json"
    rec = fact_scale.run_batch(s, path, "batch", spec, STEPS, progress=False)
    assert rec["edit_seconds"] > 0 and rec["optimization"]["steps_run"] <= 5
    assert rec["sequences"] == 9 and rec["estimate"]["sequences"] == 9 and rec["estimate"]["edit_seconds"] > 0
    assert rec["vmhwm_mib"]["edit"] > 0 and rec["vmhwm_mib"]["measure"] > 0 and rec["peak_reset"] in (True, False)
    ov = rec["overlay"]
    dim = next(iter(layers(s))).dim
    assert ov["bytes"] == ov["rows"] * (dim * 4 + 8)  # float32 rows and their int64 ids
    assert ov["bytes_per_fact"] == pytest.approx(ov["bytes"] / 3)
    col = rec["collisions"]
    assert col["rows"] == ov["rows"] and len(col["rows_per_fact"]) == 3
    assert col["shared_rows"] > 0 and col["facts_sharing"] >= 2  # France's two facts write its subject's rows
    assert sum(col["rows_per_fact"]) - col["rows"] >= col["shared_rows"]  # every shared row counted more than once
    assert [f["id"] for f in rec["facts"]] == spec["facts"] and len(rec["facts"][0]["paraphrases"]) == 2
    assert set(rec["reserved"]) == set(spec["probes"]) and rec["summary"]["reserved"] is not None
    fl = rec["fluency"]  # generation entropy before (the base) and with the overlay, per prompt
    assert fl["prompts"] == spec["facts"] and len(fl["before"]) == len(fl["after"]) == 3
    assert rec["summary"]["entropy_change"] == pytest.approx((sum(fl["after"]) - sum(fl["before"])) / 3)
    assert rec["probes"]["same_relation"] == [p.id for p in probes if p.relation in {f.relation for f in batch}]
    assert set(rec["summary"]) >= set(fact_scale.MEASURES) - {"efficacy_known"}
    assert not overlaid(s)  # the overlay is off again
    assert json.loads(path.read_text())["unit"] == "batch"

    def never(*a, **k):
        raise AssertionError("a cached unit edited again")

    monkeypatch.setattr(fact_scale, "edit_facts", never)
    assert fact_scale.run_batch(s, path, "batch", spec, STEPS, progress=False) == rec  # cached: read back


def layers(s):
    from engram.editing import engram_layers

    return engram_layers(s.model).values()


def overlaid(s) -> bool:
    from engram.tables.overlay import overlays_of

    return any(overlays_of(mhe) for mhe in layers(s))


def ranked_words(s, prompt: str, k: int = 20) -> list[str]:
    """The words the unedited model ranks highest after `prompt` (tokens of one space-led word, best first)."""
    ids = s.tok.encode(prompt, add_special_tokens=False).ids
    with torch.no_grad():
        logits = s.model(torch.tensor([ids])).logits[0, -1]
    out = []
    for i in logits.argsort(descending=True)[:k].tolist():
        w = s.tok.decode([i])
        if w.startswith(" ") and w[1:].strip() and s.tok.encode(w, add_special_tokens=False).ids == [i]:
            out.append(w[1:])
    return out


def test_sequential_retention_drops_when_a_later_edit_overwrites_an_earlier_one_and_resumes(s, tmp_path,
                                                                                           monkeypatch):
    """Japan's capital is edited to the model's second choice (an edit the tiny random model can make), then the same
    prompt to its first choice: the second edit writes the same rows, and the first no longer holds."""
    real = [f for f in s.facts if f.kind == "real"]
    japan = next(f for f in real if f.subject == "Japan" and f.relation == "capital")
    top, second = ranked_words(s, japan.prompt)[:2]
    a = dataclasses.replace(japan, id=japan.id + "/first", counterfactual=second)
    again = dataclasses.replace(japan, id=japan.id + "/again", counterfactual=top)
    other = next(f for f in real if f.subject == "Kenya" and f.relation == "continent")
    s = dataclasses.replace(s, facts=s.facts + [a, again])  # the same model, two more facts to look up
    probes = [f for f in real if f.subject in ("Peru", "Chile")]
    spec = {"kind": "sequential", "method": "subject+trigger+ctx", "size": 3, "set": 0, "every": 1,
            "facts": [a.id, again.id, other.id], "probes": [f.id for f in probes]}
    settings = {"steps": 60, "lr": 0.3, "target_prob": 0.9}
    folder = tmp_path / "seq"
    rec = fact_scale.run_sequential(s, folder, "seq", spec, settings, progress=False)
    st = rec["steps"]
    assert [x["edits"] for x in st] == [1, 2, 3]
    assert st[0]["per_edit"][0]["efficacy_now"] and st[0]["retention"] == [True]  # the first edit holds
    assert st[1]["per_edit"][0]["efficacy_now"]  # the conflicting one is written ...
    assert st[1]["retention"][0] is False and st[1]["retention_share"] < st[0]["retention_share"]  # ... over it
    assert st[1]["retained_of_learned"] == 0.5
    assert st[2]["overlay"]["stacked_bytes"] > st[2]["overlay"]["merged_bytes"]  # the rewrite's rows counted twice
    assert st[1]["overlay"]["distinct_rows"] == st[0]["overlay"]["distinct_rows"]  # the same prompt: the same rows
    assert set(st[2]["reserved"]) == set(spec["probes"]) and st[2]["vmhwm_mib"] > 0
    assert not overlaid(s)  # every overlay off again
    why = fact_scale.sequential_overwrites(s, rec)  # the rows say why the first edit no longer holds
    assert why["later_writers"][0] >= 1 and why["later_writers"][-1] == 0  # rewritten by "again"; nothing after
    cells = why["all"]
    assert cells["overwritten"]["facts"] + cells["untouched"]["facts"] == 3
    assert sum(c["held"] for c in cells.values()) == sum(st[2]["retention"])
    assert why["learned"]["overwritten"]["facts"] <= cells["overwritten"]["facts"]

    (folder / "unit.json").unlink()
    (folder / "block-002.json").unlink()  # stopped before its last block: it resumes there
    calls = []
    real_edit = fact_scale.edit_facts
    monkeypatch.setattr(fact_scale, "edit_facts", lambda *a, **k: calls.append(1) or real_edit(*a, **k))
    again_rec = fact_scale.run_sequential(s, folder, "seq", spec, settings, progress=False)
    assert len(calls) == 1  # only the missing block's edit; the others' overlays were read back
    assert again_rec["steps"][2]["retention"] == st[2]["retention"]
    assert again_rec["steps"][2]["reserved"] == st[2]["reserved"]


def test_the_family_is_non_inferiority_paired_over_the_reserved_probes():
    def run(method, size, kept):
        return {"kind": "batch", "method": method, "size": size, "set": 0,
                "reserved": {f"p{i}": k for i, k in enumerate(kept)}}

    n = 40
    small = [True] * 36 + [False] * 4
    runs = [run("subject+trigger+ctx", 10, small), run("subject+trigger+ctx", 1000, small[:-5] + [False] * 5),
            run("trigger", 10, small)]
    s = {"design": {"methods": ["subject+trigger+ctx", "trigger"]}, "runs": runs}
    rows = fact_scale.analyse(s)
    by = {r["method"]: r for r in rows}
    assert by["trigger"]["p"] is None  # never ran at 1,000: listed untested
    r = by["subject+trigger+ctx"]
    assert r["n"] == n and r["diff"] == pytest.approx(-1 / n) and r["large"] == 1000
    assert 0.05 < r["p"] < 0.5 and r["p_holm"] == r["p"]  # one probe lost: inside the margin, not shown to be
    lo, hi = r["ci95"]
    assert lo < r["diff"] < hi and hi - r["diff"] == pytest.approx(r["diff"] - lo)  # symmetric about the estimate
    text = fact_scale.markdown({**s, "experiment": "fact-scale", "phase": "test", "table": {}, "sequential": {},
                                "tests": rows})
    assert f"95% interval {lo:+.3f} to {hi:+.3f}, {n} probes" in text  # the target is read from the interval
    wide = fact_scale.analyse(s, margin=0.10)[0]  # the preregistered margin: the same loss is further inside it
    assert wide["p"] < r["p"] and wide["kind"] == "non-inferiority, margin 0.1"
    same = [run("subject+trigger+ctx", 10, small), run("subject+trigger+ctx", 1000, small)]
    assert fact_scale.analyse({**s, "runs": same})[0]["finding"]  # nothing changed: non-inferior
    worse = [run("subject+trigger+ctx", 10, small), run("subject+trigger+ctx", 1000, [False] * n)]
    assert not fact_scale.analyse({**s, "runs": worse})[0]["finding"]
    assert fact_scale.probes_needed(s, "subject+trigger+ctx") >= 2
    pw = fact_scale.pilot_power(s, "subject+trigger+ctx", small=10)
    assert pw["large"] == 1000 and pw["probes"] == n and pw["diff"] == pytest.approx(-1 / n)
    assert pw["probes_needed"] == fact_scale.probes_needed(s, "subject+trigger+ctx") and pw["sd"] > 0
    assert fact_scale.pilot_power(s, "trigger") is None  # no larger size: nothing to size the test with


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 15 s
@pytest.mark.integration
def test_the_driver_runs_each_unit_in_its_own_process_and_then_only_summarizes(tmp_path, monkeypatch):
    """`main` plans, starts one process per unit (`--unit`, building the tiny model through `--setup`), publishes the
    summary, table and plot; run again, it starts nothing."""
    import subprocess

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tiny_facts(tmp_path / "fact-edits")  # the files fact_edits.setup leaves (the unit process builds the model)
    argv = ["pilot", "--out", str(tmp_path), "--setup", "test_fact_scale:tiny_setup", "--sizes", "2",
            "--sequential", "2", "--every", "2", "--insert", "0", "--method", "trigger", "--probes", "2"]
    out = fact_scale.main(argv)
    cell = out["table"]["batch"]["trigger"]["2"]
    assert cell["edit_seconds"]["mean"] > 0 and cell["vmhwm_edit_mib"]["mean"] > 0 and "reserved" in cell
    root = tmp_path / "fact-scale" / "pilot"
    assert (root / "units" / "batch--trigger--0002--0.json").is_file() and (root / "summary.md").is_file()
    assert "| trigger | 2 (2) | 1 |" in (root / "summary.md").read_text()
    why = out["overwrites"]["trigger"]  # the sequential run's rows, read with the model the summary loaded
    assert len(why["later_writers"]) == 2 and why["later_writers"][1] == 0
    assert "whose rows a later edit wrote still held" in (root / "summary.md").read_text()

    real_run = subprocess.run

    def no_unit(cmd, *a, **k):
        if fact_scale.UNIT_PROCESS in cmd:
            raise AssertionError("a finished unit started again")
        return real_run(cmd, *a, **k)  # (git, for the preregistration)

    monkeypatch.setattr(subprocess, "run", no_unit)
    assert fact_scale.main(argv)["table"] == out["table"]
    with pytest.raises(ExperimentError, match="another design"):
        fact_scale.main([*argv[:-1], "3"])  # the cached unit was run with 2 probes per relation
