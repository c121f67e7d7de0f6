"""Edits at the subject (`positions="subject"`, `Fact.subject`) and the contexts an edit is optimized in
(`paraphrase_contexts`): the rows are the ones the subject's tokens read, in every order, and nothing else."""

import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from engram.editing import (  # noqa: E402
    EditError,
    Fact,
    edit_facts,
    edit_rows,
    engram_layers,
    mapping_of,
    paraphrase_contexts,
    parse_fact,
)
from engram.editing.optimize import edited_orders, subject_positions  # noqa: E402
from engram.model import load_model  # noqa: E402


@pytest.fixture(scope="module")
def model_tok(tiny_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("subject")
    shutil.copytree(tiny_run, root / "run")
    return load_model(root / "run")


def test_subject_positions_are_its_tokens(model_tok):
    _, tok = model_tok
    f = Fact("Line 5: the king sat on", " dog", subject=" the king")
    ids = tok.encode(f.prompt, add_special_tokens=False).ids
    pos = subject_positions(tok, f)
    assert tok.decode(ids[pos[0]:pos[-1] + 1]) == " the king" and pos == list(range(pos[0], pos[-1] + 1))
    with pytest.raises(EditError, match="subject"):
        subject_positions(tok, Fact("Line 5: the king sat on", " dog"))
    with pytest.raises(EditError, match="token boundaries"):
        subject_positions(tok, Fact("Line 5: the king sat on", " dog", subject="kin"))


def test_subject_edit_changes_the_rows_its_tokens_read_in_every_order(model_tok):
    model, tok = model_tok
    f = Fact("Line 5: the king sat on", " dog", subject=" the king")
    mapping = mapping_of(model)
    assert edited_orders(mapping, "subject") == list(range(2, mapping.max_ngram_size + 1))
    rows = edit_rows(model, tok, [f], positions="subject")
    ids = tok.encode(f.prompt + f.target, add_special_tokens=False).ids
    hashed = mapping.hash(np.asarray([ids], dtype=np.int64))
    pos = subject_positions(tok, f)
    for lid, r in rows.items():
        mhe = engram_layers(model)[lid]
        want = torch.unique(mhe.table_rows(hashed[lid][0])[pos].reshape(-1))
        assert torch.equal(r, want)  # every head of every order at the subject's tokens, nothing else
    overlay = edit_facts(model, tok, [f], steps=3, lr=0.1, positions="subject", progress=False)
    assert overlay.meta["settings"]["orders"] == edited_orders(mapping, "subject")


def test_paraphrase_contexts_and_the_subject_key():
    f = Fact("The capital of France is", " Paris", ["In France, the capital is", "France's capital is"],
             subject=" France")
    got = [(c.prompt, c.target, c.subject) for c in paraphrase_contexts([f], ["It rained. "])]
    assert got == [("In France, the capital is", " Paris", " France"),  # only those naming the subject as given
                   ("It rained. The capital of France is", " Paris", " France"),
                   ("It rained. In France, the capital is", " Paris", " France")]
    assert parse_fact({"prompt": "The capital of France is", "target": " Paris", "subject": " France"}, "l1").subject \
        == " France"
    with pytest.raises(EditError, match="'subject' must be"):
        parse_fact({"prompt": "The capital of France is", "target": " Paris", "subject": "Spain"}, "l1")


def test_a_subject_named_without_its_space_takes_the_space_before_it(model_tok):
    _, tok = model_tok
    with_space = subject_positions(tok, Fact("Line 5: the king sat on", " dog", subject=" the king"))
    assert subject_positions(tok, Fact("Line 5: the king sat on", " dog", subject="the king")) == with_space
    assert subject_positions(tok, Fact("the king sat on", " dog", subject="the king")) == \
        list(range(len(tok.encode("the king", add_special_tokens=False).ids)))  # at the start: no space to take


def test_a_subject_that_opens_the_prompt_capitalized_is_found(model_tok):
    """"the Bahamas" opens "The Bahamas is on" with a capital: the edit's subject rows and ROME's subject token
    find it there (one finder, `engram.editing.subject_span`); a subject the prompt does not name is still refused."""
    from engram.editing import subject_span

    assert subject_span("The Bahamas is on", "the Bahamas") == (0, len("the Bahamas"))
    assert subject_span("The Bahamas: the Bahamas is on", "the Bahamas", last=False) == (13, 24)
    assert subject_span("He saw the Bahamas", "The Bahamas") is None  # only a sentence's first letter is raised
    _, tok = model_tok
    assert subject_positions(tok, Fact("The king sat on", " dog", subject="the king")) == \
        subject_positions(tok, Fact("The king sat on", " dog", subject="The king"))
    assert parse_fact({"prompt": "The king sat on", "target": " dog", "subject": "the king"}, "l1").subject \
        == "the king"
    with pytest.raises(EditError, match="'subject' must be"):
        parse_fact({"prompt": "The king sat on", "target": " dog", "subject": "the queen"}, "l1")
