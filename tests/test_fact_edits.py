"""The fact-edits experiment's pieces that need no real model (`engram_experiments.fact_edits`): which paraphrase
templates are optimized and which held out, how edit sets are drawn, how a chat answer is judged, how a run's
per-fact outcomes become the set's shares, and the table a record renders."""

from types import SimpleNamespace

import pytest
from test_factset import ROWS

from engram_experiments import fact_edits
from engram_experiments.factset import build_from_rows
from engram_experiments.runs import ExperimentError


@pytest.fixture(scope="module")
def facts():
    return build_from_rows(ROWS, seed=0, new_per_relation=2)


def test_templates_split_the_paraphrases_and_the_pilot_holds_one_selection_template_out(facts):
    f = next(f for f in facts if f.kind == "real")
    sel, test = fact_edits.templates(f, "selection"), fact_edits.templates(f, "test")
    assert len(sel) == 2 and len(test) == 2 and not set(sel) & set(test)
    assert fact_edits.templates(f, "selection-0") + fact_edits.templates(f, "selection-1") == sel


def test_edit_sets_are_disjoint_known_real_facts_of_one_relation_each(facts):
    known = {f.id for f in facts if f.kind == "real" and f.subject != "Peru"}
    s = SimpleNamespace(facts=facts, known=known)
    sets = fact_edits.edit_sets(s, "test", 3, 1, seed=0)
    ids = [f.id for v in sets.values() for f in v]
    assert len(ids) == len(set(ids)) == 3
    assert all(f.id in known and f.kind == "real" and f.split == "test" for v in sets.values() for f in v)
    assert [len({f.relation for f in v}) for v in sets.values()] == [1, 1, 1]
    assert fact_edits.edit_sets(s, "test", 3, 1, seed=0).keys() == sets.keys()  # seeded
    with pytest.raises(ExperimentError, match="make only"):
        fact_edits.edit_sets(s, "test", 50, 2, seed=0)  # more sets than known facts


def test_a_chat_answer_names_an_object_as_a_word():
    assert fact_edits.names("The capital of France is Paris.", "paris")
    assert not fact_edits.names("The atomic number of iron is 260.", "26")  # a number inside another
    assert fact_edits.names("It is 26, I think", "26") and not fact_edits.names("Parisian", "Paris")


def test_summarize_is_the_share_over_facts_and_probes():
    m = {"facts": [{"efficacy": True, "p_new_gt_old": True, "paraphrases": [True, False],
                    "paraphrases_old": [False, True], "chat_new": True, "chat_old": False, "same_subject": []},
                   {"efficacy": False, "p_new_gt_old": True, "paraphrases": [False, False],
                    "paraphrases_old": [True, True], "chat_new": False, "chat_old": True, "same_subject": [True]}],
         "same_relation": [True, True, False, True], "shared_ngram": [], "text_change": 0.01,
         "text_change_shared": None}
    got = fact_edits.summarize(m)
    assert got["efficacy"] == 0.5 and got["paraphrases"] == 0.25 and got["paraphrases_old"] == 0.75
    assert got["same_relation"] == 0.75 and got["same_subject"] == 1.0 and got["shared_ngram"] is None
    rec = {"experiment": "fact-edits-pilot", "phase": "pilot", "design": {"sets": 1},
           "table": {"none": {**{k: {"mean": 0.5, "std": 0.0} for k in fact_edits.MEASURES if k != "shared_ngram"},
                              "sets": ["selection-0"], "edit_seconds": {"mean": 0.0}}}}
    md = fact_edits.markdown(rec)
    assert "| none | 1 |" in md and "—" in md  # a measure no set had is a dash, not a number


def test_the_preregistered_choice_and_number_of_test_sets():
    def cell(mean, std=0.0):
        return {"mean": mean, "std": std}

    table = {"trigger": {"efficacy": cell(1.0), "same_relation": cell(0.5), "paraphrases": cell(0.5),
                         "chat_new": cell(0.2)},
             "subject+ctx": {"efficacy": cell(0.9), "same_relation": cell(0.9), "paraphrases": cell(0.3),
                             "chat_new": cell(0.3, 0.2)},
             "subject+trigger+ctx": {"efficacy": cell(1.0), "same_relation": cell(0.85), "paraphrases": cell(0.2),
                                     "chat_new": cell(0.2)},
             "grace": {"efficacy": cell(1.0), "same_relation": cell(1.0), "paraphrases": cell(0.0, 0.05),
                       "chat_new": cell(0.0)}}
    runs = [{"method": m, "info": {"rows": 10}} for m in table]
    s = {"table": table, "runs": runs}
    assert fact_edits.choose(s) == "subject+ctx"  # trigger fails the locality bar; the best generalizer of the rest
    assert fact_edits.sets_needed(s, "subject+ctx") == 16  # ceil((2.8 * 0.2 / 0.15)^2) + 2 = 14 + 2
    table["subject+ctx"]["chat_new"] = cell(0.3, 0.05)
    assert fact_edits.sets_needed(s, "subject+ctx") == 6  # the floor
    for v in table.values():
        v["same_relation"] = cell(0.5)
    assert fact_edits.choose(s) == "trigger"  # none passes: the highest efficacy + locality


def test_the_family_pairs_by_set_and_tests_locality_as_non_inferiority():
    def run(method, i, para, chat, loc):
        return {"method": method, "set": f"test-{i}", "summary": {"paraphrases": para, "chat_new": chat,
                                                                  "same_relation": loc}}

    runs = []
    for i in range(6):
        runs += [run("subject+trigger+ctx", i, 0.6 + 0.02 * i, 0.4, 0.97 + 0.005 * (i % 2)),
                 run("grace", i, 0.0, 0.0, 1.0), run("rome", i, 0.5 + 0.03 * i, 0.5 - 0.01 * i, 0.3)]
    rows = fact_edits.analyse({"runs": runs}, "subject+trigger+ctx")
    by = {(r["a"], r["metric"]): r for r in rows}
    assert len(rows) == 7 and by[("ft-l", "paraphrases")]["p"] is None  # ft-l never ran: untested, not dropped
    assert by[("grace", "paraphrases")]["diff"] == pytest.approx(0.65) and by[("grace", "paraphrases")]["finding"]
    ni = by[("grace", "same_relation")]
    assert ni["diff"] == pytest.approx(-0.0275) and not ni["finding"]  # 0.0275 below grace: outside the 0.02 margin
    tested = [r for r in rows if r["p"] is not None]
    assert all(r["p_holm"] >= r["p"] for r in tested)
    # the family in the test record's table: each row with its difference, Holm p and verdict
    table = {m: {**{k: {"mean": 0.5, "std": 0.1} for k in fact_edits.MEASURES}, "sets": ["test-0"],
                 "edit_seconds": {"mean": 1.0}} for m in ("subject+trigger+ctx", "grace", "rome")}
    md = fact_edits.markdown({"experiment": "fact-edits", "phase": "test", "design": {"sets": 6}, "table": table,
                              "tests": rows})
    assert "| subject+trigger+ctx - grace | held-out paraphrases | two-sided | 6 | +0.650 ±" in md
    assert "untested (fewer than 2 shared sets)" in md and "non-inferiority, margin 0.02" in md
    assert by[("rome", "chat_new")]["min_detectable"] > 0 and ni["min_detectable"] is None
    line = next(x for x in md.splitlines() if "held-out paraphrases | two-sided" in x and "- rome" in x)
    assert line.endswith("|") and ("**finding**" in line or "detectable: ±" in line)


def test_by_relation_is_each_held_out_templates_share_per_method_and_relation():
    from engram_experiments import factset

    facts = factset.build_from_rows({"continent": [("France", "Europe"), ("Peru", "South America"),
                                                   ("Chad", "Africa")]}, new_per_relation=0)
    fr, pe, ch = facts
    held = "test"
    which = fact_edits.template_indices(fr, held)
    assert [fr.paraphrases[i] for i in which] == fact_edits.templates(fr, held) and len(which) == 2

    def pf(f, hits, chat):
        return {"id": f.id, "paraphrases": hits, "chat_new": chat}

    runs = [{"method": "m", "relation": "continent", "held_out_templates": held, "same_relation": [True, False],
             "facts": [pf(fr, [True, False], True), pf(pe, [True, True], False)]},
            {"method": "m", "relation": "continent", "held_out_templates": held, "same_relation": [True, True],
             "facts": [pf(ch, [False, False], False)]}]
    d = fact_edits.by_relation(runs, facts)["m"]["continent"]
    assert d["sets"] == 2 and d["facts"] == 3 and d["position"] == "early"
    rel = factset.RELATIONS["continent"]
    assert [t["template"] for t in d["templates"]] == [rel.paraphrases[i] for i in which]
    assert [t["share"] for t in d["templates"]] == [2 / 3, 1 / 3] and d["templates"][0]["n"] == 3
    assert d["chat_new"] == 1 / 3 and d["same_relation"] == 0.75
    md = fact_edits.markdown({"experiment": "fact-edits", "phase": "test", "design": {}, "table": {},
                              "by_relation": fact_edits.by_relation(runs, facts)})
    assert f'| m | continent (early) | 2 | "{rel.paraphrases[which[0]]}" 0.67;' in md


def test_the_table_keeps_a_measure_some_sets_lack_and_says_over_how_many():
    """Same-subject locality is None for a set whose subjects have no other known fact: the table averages the
    sets that have it and the cell names its n, instead of dropping the measure for every set."""
    from engram_experiments.fact_edits import cell, table_of

    def run(i, same):
        return {"method": "m", "set": f"test-{i}", "edit_seconds": 1.0,
                "summary": {k: 0.5 for k in fact_edits.MEASURES} | {"same_subject": same}}

    t = table_of([run(0, None), run(1, 1.0), run(2, 0.5)], ["m"])["m"]
    assert t["same_subject"]["n"] == 2 and t["same_subject"]["mean"] == 0.75 and t["efficacy"]["n"] == 3
    assert cell(t, "same_subject").endswith("(n=2)") and "(n=" not in cell(t, "efficacy")
    assert "same_subject" not in table_of([run(0, None)], ["m"])["m"] and cell({}, "same_subject") == "—"


def test_every_committed_fact_edits_record_table_is_its_runs_table():
    """The tables the pages render are `table_of` the record's own per-set summaries (none left stale)."""
    import glob
    import json
    from pathlib import Path

    from engram_experiments.fact_edits import table_of

    files = sorted(glob.glob(str(Path(__file__).parents[1] / "docs" / "results" / "fact-edits*.json")))
    assert files
    for f in files:
        rec = json.loads(Path(f).read_text())
        assert rec["table"] == table_of(rec["runs"], list(rec["table"])), f
