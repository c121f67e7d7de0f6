"""The fact-edits-editors experiment's pieces that need no real model (`engram_experiments.fact_editors` and the
editor methods it names in `fact_edits`): method names with settings, the neighbours fine-tuning holds, the
preregistered choice of a setting, the guard that the measures still match the record, and its family."""

from types import SimpleNamespace

import pytest
from test_factset import ROWS

from engram_experiments import fact_editors, fact_edits
from engram_experiments.factset import build_from_rows
from engram_experiments.runs import ExperimentError


@pytest.fixture(scope="module")
def facts():
    return build_from_rows(ROWS, seed=0, new_per_relation=2)


def test_a_method_name_carries_its_settings_and_bad_names_say_how_to_write_one():
    assert fact_edits.method_named("grace") is fact_edits.METHODS["grace"]
    for name in [m for ms in fact_editors.GRID.values() for m in ms] + fact_editors.LOCALITY_ARMS:
        assert callable(fact_edits.method_named(name))  # every pilot setting resolves
    for name in fact_editors.KEEP_GRID:
        assert getattr(fact_edits.method_named(name), "uses_probes", False)  # the kept neighbours avoid the probes
    for bad, msg in [("bogus", "unknown method"), ("ft-l@eps=x", "not key=number"), ("ft-l@eps", "not key=number"),
                     ("ft-l@foo=1", "unexpected keyword")]:
        with pytest.raises(ExperimentError, match=msg):
            fact_edits.method_named(bad)
    assert getattr(fact_edits.method_named("ft-neighbours"), "uses_probes", False)  # it is handed the probes


def test_held_neighbours_are_known_unprobed_facts_of_the_relation_first(facts):
    real = [f for f in facts if f.kind == "real"]
    rel = real[0].relation
    same = [f for f in real if f.relation == rel]
    edited, probe = same[:1], same[1:2]
    s = SimpleNamespace(facts=facts, known={f.id for f in real})
    pr = {"same_relation": [f.id for f in probe], "shared_ngram": [], "same_subject": {edited[0].id: []}}
    held = fact_edits.held_neighbours(s, edited, pr, seed=0, n=len(same) + 3)
    ids = [f.id for f in held]
    assert len(ids) == len(set(ids)) == len(same) + 3
    assert not {f.id for f in edited + probe} & set(ids)  # never an edited fact or a probe
    assert edited[0].subject.casefold() not in {f.subject.casefold() for f in held}
    k = sum(f.relation == rel for f in held)
    assert all(f.relation == rel for f in held[:k]) and k == len([f for f in same[2:]
                                                                  if f.subject != edited[0].subject])
    assert [f.id for f in fact_edits.held_neighbours(s, edited, pr, seed=0, n=len(same) + 3)] == ids  # seeded


def test_the_preregistered_choice_of_a_setting():
    def t(eff, loc, para, chat):
        return {"efficacy": {"mean": eff}, "same_relation": {"mean": loc}, "paraphrases": {"mean": para},
                "chat_new": {"mean": chat}}

    grid = ["a", "b", "c"]
    s = {"table": {"a": t(0.9, 0.9, 0.1, 0.1), "b": t(1.0, 0.7, 0.9, 0.9), "c": t(0.8, 0.8, 0.3, 0.1)}}
    assert fact_editors.choose(s, grid) == "c"  # b generalizes best but fails the locality bar
    s["table"]["c"] = t(0.8, 0.8, 0.1, 0.1)
    assert fact_editors.choose(s, grid) == "a"  # a tie: the earlier setting
    s["table"] = {"a": t(0.1, 0.9, 0, 0), "b": t(1.0, 0.3, 0, 0), "c": t(0.6, 0.6, 0, 0)}
    assert fact_editors.choose(s, grid) == "b"  # none passes: the highest efficacy + locality
    assert fact_editors.choose({"table": {}}, grid) is None


def _run(method, i, para=0.5, chat=0.5, loc=0.9):
    return {"method": method, "set": f"test-{i}", "facts": [{"id": f"f{i}", "efficacy": True}],
            "same_relation": [True], "shared_ngram": [False], "text_change": 0.01, "text_change_shared": None,
            "probes": {"same_relation": [f"p{i}"]}, "environment": 0,
            "summary": {"paraphrases": para, "chat_new": chat, "same_relation": loc}}


def test_the_record_is_reused_and_the_guard_stops_on_any_changed_outcome(tmp_path):
    rec = {"runs": [_run("none", 0), _run("subject+trigger+ctx", 0), _run("subject+trigger+ctx", 1)],
           "environments": [{"cpu": "x"}]}
    assert fact_editors.reuse_record(tmp_path, rec, "subject+trigger+ctx") == 2
    assert fact_editors.reuse_record(tmp_path, rec, "subject+trigger+ctx") == 0  # once
    back = fact_edits.read_json(tmp_path / "runs" / "test-1--subject+trigger+ctx.json", "run", "", ExperimentError)
    assert back["environment"] == {"cpu": "x"} and back["from_record"] == fact_editors.RECORD
    same = _run("none", 0)
    assert fact_editors._same(same, rec["runs"][0]) == []
    same["text_change"] += 5e-5
    assert fact_editors._same(same, rec["runs"][0]) == []  # within 1e-4
    for key, value in [("facts", [{"id": "f0", "efficacy": False}]), ("same_relation", [False]),
                       ("text_change_shared", 0.2), ("probes", {"same_relation": ["q"]})]:
        assert key in fact_editors._same({**_run("none", 0), key: value}, rec["runs"][0])
    fact_editors.check_probes({"runs": [_run("lora@lr=1e-3", 0)]}, rec)
    with pytest.raises(ExperimentError, match="test-0 probe other facts"):
        fact_editors.check_probes({"runs": [{**_run("lora@lr=1e-3", 0), "probes": {}}]}, rec)


def test_the_family_is_each_editor_on_three_measures_two_sided():
    runs = []
    for i in range(5):
        runs += [_run("subject+trigger+ctx", i, 0.3 + 0.01 * i, 0.2, 0.9), _run("lora", i, 0.6, 0.5 - 0.02 * i, 0.2),
                 _run("memit", i, 0.3 + 0.01 * i, 0.2, 0.9)]
    rows = fact_edits.analyse({"runs": runs}, "subject+trigger+ctx", others=["lora", "memit"],
                              metrics=("paraphrases", "chat_new", "same_relation"), noninferior=None)
    assert len(rows) == 6 and all(r["kind"] == "two-sided" for r in rows)
    by = {(r["a"], r["metric"]): r for r in rows}
    assert by[("lora", "same_relation")]["diff"] == pytest.approx(0.7) and by[("lora", "paraphrases")]["finding"]
    assert by[("memit", "paraphrases")]["se"] == 0 and not by[("memit", "paraphrases")]["finding"]
    p = fact_editors.power({"runs": runs}, "subject+trigger+ctx", ["lora"], n=23)
    assert p["family"] == 12 and p["detectable"]["lora/paraphrases"] > 0  # 4 editors x 3 measures
    wider = fact_editors.power({"runs": runs}, "subject+trigger+ctx", ["lora"], n=23, family=1)
    assert wider["detectable"]["lora/paraphrases"] < p["detectable"]["lora/paraphrases"]


def test_the_engram_edit_with_neighbours_held_holds_the_same_neighbours_as_fine_tuning(tmp_path):
    """`subject+trigger+ctx+keep`: the chosen edit with `held_neighbours`' facts kept (`edit_facts(keep=...)`), on
    the tiny live-adapter setup of test_fact_scale: it is handed the probes, holds facts none of which is a probe, and
    its overlay comes off again."""
    import torch
    from test_fact_scale import tiny_setup

    s = tiny_setup(tmp_path)
    edited = [f for f in s.facts if f.kind == "real" and f.relation == "capital"][:2]
    pr = fact_edits.probes(s, edited, 2, seed=0)
    fn = fact_edits.method_named("subject+trigger+ctx+keep")
    assert fn.uses_probes and not getattr(fact_edits.METHODS["subject+trigger+ctx"], "uses_probes", False)
    held = fact_edits.held_neighbours(s, edited, pr, 0)
    probed = set(pr["same_relation"]) | set(pr["shared_ngram"])
    assert held and not {f.id for f in held} & probed
    before = fact_edits.token_losses(s.model, s.windows)
    e = fn(s, edited, "selection", pr)
    try:
        assert e.info["held"] == len(held) and e.extra_bytes > 0
    finally:
        e.undo()
    assert torch.equal(fact_edits.token_losses(s.model, s.windows), before)  # the base again


def test_the_subject_test_family_and_its_locality_power(tmp_path):
    """fact-edits-subject: subject+ctx - GRACE on two measures two-sided and locality as non-inferiority at 0.02
    (Holm over 3); `locality_power` from the record's own spread (None when it has none); the guard's verdict read
    back by `_rerun`."""
    runs = []
    for i in range(23):
        runs += [_run("grace", i, 0.0, 0.0, 1.0), _run("subject+ctx", i, 0.5, 0.2, 1.0 - 0.02 * (i % 2))]
    rows = fact_edits.analyse({"runs": runs}, "subject+ctx", margin=0.02, others=("grace",),
                              metrics=("paraphrases", "chat_new"), noninferior="grace")
    assert [r["kind"] for r in rows] == ["two-sided", "two-sided", "non-inferiority, margin 0.02"]
    assert all(r["n"] == 23 for r in rows)
    ni = rows[2]
    assert ni["diff"] == pytest.approx(-0.02 * 11 / 23) and ni["finding"]  # mean loss 0.0096 < 0.02, tight spread
    pw = fact_editors.locality_power({"runs": runs}, "subject+ctx")
    assert pw["n"] == 23 and pw["sd"] > 0 and 0.5 < pw["power"] <= 1
    flat = [r for r in runs if r["method"] == "grace"] + [_run("subject+ctx", i, 0.5, 0.2, 1.0) for i in range(23)]
    assert fact_editors.locality_power({"runs": flat}, "subject+ctx")["power"] is None  # no spread: nothing to size
    assert fact_editors._rerun(tmp_path) == []  # no guard yet: nothing to rerun
    fact_edits.write_json(tmp_path / "guard.json", {"differ": ["grace"]})
    assert fact_editors._rerun(tmp_path) == ["grace"]


def test_the_subject_margin_is_the_one_its_preregistration_states():
    """The subject test's margin lives in one constant; its committed prereg states the same margin in the analysis
    call it names (a prereg is never edited after its runs, so the code follows it)."""
    from pathlib import Path

    from engram.utils import parse_toml

    f = Path(__file__).parents[1] / "docs" / "prereg" / "fact-edits-subject.toml"
    pre = parse_toml(f.read_text(), str(f), ValueError)
    assert f"margin={fact_editors.SUBJECT_MARGIN}," in pre["test"]["family"]


def test_the_subject2_test_reads_its_preregistration_and_tests_four_measures_against_subject_ctx():
    """fact-edits-subject2: its design from docs/prereg/fact-edits-subject2.toml (the method, its baseline and the
    reused runs from the fact-edits-subject record), and the family: four two-sided paired tests, Holm over 4, a
    measure a set lacks (same_subject None) left out of that set's pair."""
    from pathlib import Path

    from engram.persist import read_json

    rec = read_json(Path(fact_editors.RECORD), "record", "", ExperimentError)
    ph = fact_editors._phase("subject2-test", rec, record=False)
    assert ph.methods == ["subject2+ctx"] and ph.design["baseline"] == "subject+ctx" and ph.split == "test"
    assert ph.source == fact_editors.SUBJECT_RECORD and "subject+ctx" in ph.reused and ph.count == 23
    assert fact_edits.METHODS["subject2+ctx"].rows["orders"] == [2]
    runs = []
    for i in range(23):
        a, b = _run("subject+ctx", i, 0.2, 0.2, 1.0), _run("subject2+ctx", i, 0.3 + 0.01 * (i % 3), 0.2, 1.0)
        a["summary"]["same_subject"], b["summary"]["same_subject"] = (1.0, 0.5) if i % 2 else (None, None)
        runs += [a, b]
    rows = fact_edits.analyse({"runs": runs}, "subject2+ctx", others=("subject+ctx",), noninferior=None,
                              metrics=("paraphrases", "chat_new", "same_relation", "same_subject"))
    assert [r["metric"] for r in rows] == ["paraphrases", "chat_new", "same_relation", "same_subject"]
    assert [r["n"] for r in rows] == [23, 23, 23, 11]
    assert rows[0]["finding"] and rows[0]["diff"] == pytest.approx(0.1 + 0.01 * 22 / 23)
    assert rows[3]["diff"] == pytest.approx(-0.5)
