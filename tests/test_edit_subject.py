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


def _one_token_subject(tok) -> str:
    """A word the tiny tokenizer writes as one token after a space and at a text's start."""
    vocab = sorted(tok.get_vocab())
    for w in (v.lstrip("Ġ▁ ") for v in vocab):
        if len(w) >= 3 and w.isalpha() and all(len(tok.encode(x, add_special_tokens=False).ids) == 1
                                               for x in (" " + w, w)):
            return w
    raise AssertionError("the tiny tokenizer writes no word as one token both after a space and at a start")


def test_tied_rows_group_a_one_token_subject_under_every_listed_context(model_tok):
    from engram.editing.optimize import tied_rows

    model, tok = model_tok
    w = _one_token_subject(tok)
    f = Fact(f"Line 5: of {w} sat on", " dog", subject=w)
    groups = tied_rows(model, tok, [f], ["", "where "], positions="subject", orders=[2])
    mapping = mapping_of(model)
    K = mapping.n_head_per_ngram
    for lid, g in groups.items():
        mhe = engram_layers(model)[lid]
        for text in (f.prompt, w, f"where {w}"):
            ids = tok.encode(text, add_special_tokens=False).ids
            pos = subject_positions(tok, Fact(text, " dog", subject=w))[0]
            row = mhe.table_rows(mapping.hash(np.asarray([ids], dtype=np.int64))[lid][0])[pos][:K]  # order 2
            assert [g[r] for r in row.tolist()] == [f"{k}:{w}" for k in range(K)]  # head k's group, every context
    assert set(groups[lid].values()) == {f"{k}:{w}" for k in range(K)}
    longer = Fact("Line 5: the king sat on", " dog", subject=" the king")
    assert all(not g for g in tied_rows(model, tok, [longer], ["in "], positions="subject", orders=[2]).values())
    with pytest.raises(EditError, match="subject's rows"):
        tied_rows(model, tok, [f], ["in "], positions="trigger")
    with pytest.raises(EditError, match="include 2"):
        edit_facts(model, tok, [f], steps=1, positions="subject", orders=[3], tie=["in "], progress=False)


def test_a_tied_edit_writes_one_value_that_an_unseen_wording_reads(model_tok):
    from engram.editing import apply_overlay, remove_overlays, table_rows_read

    model, tok = model_tok
    w = _one_token_subject(tok)
    f = Fact(f"Line 5: of {w} sat on", " dog", subject=w)
    plain = edit_facts(model, tok, [f], steps=3, positions="subject", orders=[2], progress=False)
    tied = edit_facts(model, tok, [f], steps=3, positions="subject", orders=[2], tie=["where "], progress=False)
    unseen = f"Line 9: where {w} sat on"
    read = table_rows_read(model, np.asarray([tok.encode(unseen, add_special_tokens=False).ids]))
    pos = subject_positions(tok, Fact(unseen, " dog", subject=w))[0]
    for lid in tied.rows:
        K = mapping_of(model).n_head_per_ngram
        at = read[lid][0][pos][:K]  # the unseen wording's order-2 rows at the subject
        assert not torch.isin(at, plain.rows[lid]).any()  # untied: the edit is not read there
        assert torch.isin(at, tied.rows[lid]).all()  # tied: every head reads an edited row
        own = read[lid][0][pos][:K]
        prompt_rows = table_rows_read(model, np.asarray([tok.encode(f.prompt, add_special_tokens=False).ids]))[lid][0]
        mine = prompt_rows[subject_positions(tok, f)[0]][:K]
        vals = dict(zip(tied.rows[lid].tolist(), tied.values[lid]))
        for a, b in zip(own.tolist(), mine.tolist()):
            assert torch.equal(vals[a], vals[b])  # the same value under "where" as under the prompt's "of"
    assert tied.meta["settings"]["tie"] == ["where "] and tied.num_rows > plain.num_rows
    apply_overlay(model, tied)
    try:
        assert tied.meta["optimization"]["steps_run"] >= 1
    finally:
        remove_overlays(model)


def test_the_orders_of_edited_rows_a_wording_reads_at_its_subject(model_tok):
    from engram_experiments.fact_editors import subject_orders_read

    model, tok = model_tok
    w = _one_token_subject(tok)
    f = Fact(f"Line 5: sat on {w} is", " dog", subject=w)  # " sat" and " on" are tokens of the tiny tokenizer
    both = edit_rows(model, tok, [f], positions="subject", orders=[2, 3])
    two = edit_rows(model, tok, [f], positions="subject", orders=[2])
    assert subject_orders_read(model, tok, both, f.prompt, w) == 3  # its own prompt reads them all
    assert subject_orders_read(model, tok, both, f"Line 9: ran on {w} is", w) == 2  # one word the same: the bigram
    assert subject_orders_read(model, tok, two, f"Line 9: ran on {w} is", w) == 2
    assert subject_orders_read(model, tok, two, f"Line 9: ran sat {w} is", w) == 0  # another word before: nothing
    tied = edit_rows(model, tok, [f], positions="subject", orders=[2], tie=["sat "])
    assert subject_orders_read(model, tok, tied, f"Line 9: ran sat {w} is", w) == 2
