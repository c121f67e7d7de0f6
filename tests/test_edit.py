"""Fact editing (`engram.editing`, `engram edit`): only overlay rows change, locality is exact, overlays apply on
every table backend, stack in order, refuse another model, and the CLI fails in one line."""

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import engram  # noqa: E402
from engram.cli import main  # noqa: E402
from engram.editing import (  # noqa: E402
    EditError,
    Fact,
    Overlay,
    apply_overlay,
    collision_set,
    conflicts,
    edit_facts,
    edit_report,
    edit_rows,
    locality,
    mapping_of,
    read_facts,
)
from engram.hashing import identity_digest  # noqa: E402
from engram.model import load_model  # noqa: E402
from engram.persist import IntegrityError  # noqa: E402
from engram.tables import Prefetcher, offload_tables  # noqa: E402
from engram.tables.overlay import remove_overlays  # noqa: E402
from engram.training.data import text_windows  # noqa: E402
from engram_experiments.world import make_facts  # noqa: E402

FACTS = [Fact("the cat sat on", " the dog", ["a cat sat on"], ["It rained. the cat sat on"]),
         Fact("Line 5: the king", " ran"), Fact("the dog ran to the mat", " cat")]


@pytest.fixture(scope="module")
def run(tiny_run, tmp_path_factory):
    """A copy of the session's tiny trained run (`ROOT/run`, corpus `ROOT/c.txt`): these tests write beside it."""
    root = tmp_path_factory.mktemp("edit")
    shutil.copytree(tiny_run, root / "run")
    shutil.copy(tiny_run.parent / "c.txt", root / "c.txt")
    return root, root / "c.txt"


@pytest.fixture(scope="module")
def edited(run):
    root, corpus = run
    model, tok = load_model(root / "run")
    overlay = edit_facts(model, tok, FACTS, steps=60, lr=0.3, progress=False)
    return model, tok, overlay


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def target_logp(model, tok, fact):
    p, t = (tok.encode(x, add_special_tokens=False).ids for x in (fact.prompt, fact.target))
    lp = torch.log_softmax(logits(model, torch.tensor([p + t])).float(), -1)[0]
    return float(sum(lp[len(p) - 1 + j, t[j]] for j in range(len(t))))


def test_edit_moves_only_overlay_rows_toward_targets(run):
    root, _ = run
    model, tok = load_model(root / "run")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = [target_logp(model, tok, f) for f in FACTS]
    ids = torch.tensor([tok.encode("the king sat on the mat", add_special_tokens=False).ids])
    base_logits = logits(model, ids)
    overlay = edit_facts(model, tok, FACTS, steps=60, lr=0.3, progress=False)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # no weight written
    assert all(v.grad is None and v.requires_grad is False for v in overlay.values.values())
    assert torch.equal(logits(model, ids), base_logits)  # not applied by edit_facts
    rows = edit_rows(model, tok, FACTS)
    assert {k: v.tolist() for k, v in overlay.rows.items()} == {k: v.tolist() for k, v in rows.items()}
    with engram.editing.applied(model, overlay):
        after = [target_logp(model, tok, f) for f in FACTS]
    assert all(a > b + 0.5 for a, b in zip(after, before)), (before, after)
    assert torch.equal(logits(model, ids), base_logits)  # taken off again: the undo


def test_edit_rows_are_the_trigger_ngrams_of_the_highest_order(edited):
    model, tok, _ = edited
    mapping, fact = mapping_of(model), FACTS[1]
    p, t = (tok.encode(x, add_special_tokens=False).ids for x in (fact.prompt, fact.target))
    h = mapping.hash(np.array([p + t]))
    lid = mapping.layer_ids[0]
    K, N = mapping.n_head_per_ngram, mapping.max_ngram_size
    offsets = torch.tensor(mapping.head_offsets(lid))
    cols = list(range((N - 2) * K, (N - 1) * K))
    want = (torch.as_tensor(h[lid][0, len(p) - 1]) + offsets)[cols]  # the prompt's last position, order N
    assert set(want.tolist()) == set(edit_rows(model, tok, [fact])[lid].tolist())
    all_rows = edit_rows(model, tok, [fact], positions="all", orders=[2, 3])[lid]
    assert len(all_rows) > len(want) and set(want.tolist()) <= set(all_rows.tolist())
    with pytest.raises(EditError, match="orders"):
        edit_rows(model, tok, [fact], orders=[5])


def test_collision_set_is_exact_and_nothing_outside_it_changes(run, edited):
    root, corpus = run
    model, tok, overlay = edited
    windows = text_windows(tok, [str(corpus)], "train", 32, 12)
    coll = collision_set(model, overlay, windows, tok)
    mask = coll["mask"]
    # brute force: hash every window alone, test each head's row against the edited rows
    mapping = mapping_of(model)
    lid = mapping.layer_ids[0]
    edited_rows = set(overlay.rows[lid].tolist())
    offsets = mapping.head_offsets(lid)
    for w in range(len(windows)):
        h = mapping.hash(windows[w:w + 1])[lid][0]
        for t in range(windows.shape[1]):
            hit = any(int(h[t, j]) + offsets[j] in edited_rows for j in range(h.shape[1]))
            assert bool(mask[w, t]) == hit
    assert 0 < coll["positions"] < mask.numel()  # the facts' n-grams occur in this text, but not everywhere
    loc = locality(model, overlay, windows, mask, batch_size=5)
    assert loc["changed_outside"] == 0
    assert loc["outside"]["loss_before"] == loc["outside"]["loss_after"] and loc["outside"]["tokens"] > 0
    assert loc["all"]["loss_before"] != loc["all"]["loss_after"]  # and inside it, something did change


def test_report_counts_efficacy_and_generalization(run, edited):
    root, corpus = run
    model, tok, overlay = edited
    windows = text_windows(tok, [str(corpus)], "train", 32, 4)
    rep = edit_report(model, tok, FACTS, overlay, windows)
    s = rep["summary"]
    assert s["facts"] == 3 and s["paraphrases_count"] == 1 and s["passages_count"] == 1
    assert s["p_target_after"] > s["p_target_before"]
    assert s["rows_changed"] == overlay.num_rows
    json.dumps(rep)  # the report is plain JSON


def test_the_report_marks_paraphrases_that_read_no_edited_row(run, edited):
    """A paraphrase that reads none of the overlay's rows gets the base's answer exactly, so the report marks it
    (`reads_edit`), counts it and `print_report` says how to reach it; one that reads an edited row is not marked."""
    import io

    from engram.editing import fact_report, print_report, reads_rows

    root, corpus = run
    model, tok, overlay = edited
    far = Fact("the cat sat on", " the dog", ["Line 9: ran to", "a cat sat on"])
    assert not reads_rows(model, tok, "Line 9: ran to", overlay.rows)  # shares no n-gram with the edited prompts
    assert reads_rows(model, tok, far.prompt, overlay.rows)
    rep = fact_report(model, tok, [far], overlay)
    marks = rep[0]["reads_edit"]["paraphrases"]
    assert marks == [False, reads_rows(model, tok, "a cat sat on", overlay.rows)]
    assert rep[0]["after"]["paraphrases"][0] == rep[0]["before"]["paraphrases"][0]  # the base's answer, exactly
    windows = text_windows(tok, [str(corpus)], "train", 32, 2)
    full = edit_report(model, tok, [far], overlay, windows)
    assert full["summary"]["paraphrases_reading_no_edited_row"] == sum(not x for x in marks) >= 1
    out = io.StringIO()
    print_report(full, file=out)
    assert "read none of the edited rows" in out.getvalue() and "--paraphrases" in out.getvalue()


def _close(a, b) -> bool:
    """Equal, floats up to float rounding (a batch's shape may change their last bits)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, float):
        return a == pytest.approx(b, rel=1e-5, abs=1e-12)
    return a == b


def test_report_in_chunks_is_the_report_one_sequence_at_a_time(run, edited):
    """`edit_report(chunk=...)` runs every forward (generate's too) on at most `chunk` sequences and gives what
    scoring each sequence alone gives (`score`): the same greedy tokens and text, the same probabilities up to float
    rounding; `print_report` shows at most `max_facts` facts and says how many it left out."""
    import io

    from engram.editing import print_report, score

    root, corpus = run
    model, tok, overlay = edited
    windows = text_windows(tok, [str(corpus)], "train", 32, 4)
    facts = FACTS + [Fact("Line 6: the king", " ran"), Fact("Line 7: the king", " sat on")]  # Line 5's length
    sizes = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kwargs: sizes.append(len(args[0] if args else kwargs["input_ids"])), with_kwargs=True)
    try:
        chunked = edit_report(model, tok, facts, overlay, windows, batch_size=2, chunk=2)
    finally:
        hook.remove()
    assert max(sizes) == 2  # sequences batched, never more than a chunk
    one = edit_report(model, tok, facts, overlay, windows, batch_size=2, chunk=1)
    assert _close(chunked, one)
    def alone():  # every prompt, paraphrase and passage scored on its own
        return [{"prompt": score(model, tok, f.prompt, f.target),
                 "paraphrases": [score(model, tok, q, f.target) for q in f.paraphrases],
                 "passages": [score(model, tok, q, f.target) for q in f.passages]} for f in facts]

    before = alone()
    with engram.editing.applied(model, overlay):
        after = alone()
    assert _close([r["before"] for r in chunked["facts"]], before)
    assert _close([r["after"] for r in chunked["facts"]], after)
    out = io.StringIO()
    print_report(chunked, out, max_facts=2)
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("the cat sat on") and lines[2].startswith("Line 5: the king")
    assert lines[3] == "... 3 more facts not shown (every fact is in report.json)"
    out = io.StringIO()
    print_report(chunked, out, max_facts=None)
    assert "not shown" not in out.getvalue() and "Line 7: the king" in out.getvalue()


def test_overlay_json_is_written_in_pieces_as_write_json_writes_it(tmp_path):
    """A report of many facts goes to disk piece by piece (never one string), with `persist.write_json`'s text."""
    from engram.editing.overlay import _dump_json
    from engram.persist import write_json

    obj = {"facts": [{"prompt": f"fact {i}", "p": i / 7, "ok": i % 2 == 0, "none": None} for i in range(20_000)],
           "text": "caf\u00e9"}
    _dump_json(tmp_path / "a.json", obj)
    write_json(tmp_path / "b.json", obj)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


@pytest.mark.slow  # (about 2 minutes on 2 shared cores)
def test_cli_edit_10000_facts_in_small_chunks(tmp_path, run, capsys):
    """`engram edit` on 10,000 facts with --chunk 16: every fact in the overlay and in report.json, the overlay's
    rows those of every fact, a printout of 20 facts and a line for the rest, progress bars on stderr."""
    root, corpus = run
    n = 10_000
    facts = tmp_path / "facts.jsonl"
    facts.write_text("".join(json.dumps({"prompt": f"The king sat on Line {i}", "target": " dog" if i % 2 else
                                         " the king"}) + "\n" for i in range(n)))
    out = tmp_path / "ov"
    code, stdout, err = cli(capsys, "edit", "--checkpoint", root / "run", "--facts", facts, "--out", out,
                            "--data", corpus, "--split", "train", "--seq-len", 32, "--max-windows", 4,
                            "--steps", 1, "--chunk", 16)
    assert code == 0, err[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert [r["prompt"] for r in rep["facts"]] == [f"The king sat on Line {i}" for i in range(n)]
    assert all(set(r[w]["prompt"]) == {"p_first", "p_target", "greedy", "generated"} for r in rep["facts"]
               for w in ("before", "after"))
    assert rep["summary"]["facts"] == n and rep["locality"]["changed_outside"] == 0
    ov = Overlay.load(out)
    assert len(ov.meta["facts"]) == n and ov.meta["summary"] == rep["summary"]
    model, tok = load_model(root / "run")
    want = edit_rows(model, tok, read_facts(facts, tok))
    assert {k: v.tolist() for k, v in ov.rows.items()} == {k: v.tolist() for k, v in want.items()}
    assert f"... {n - 20:,} more facts not shown" in stdout and len(stdout.splitlines()) < 35
    assert "0 logits rows changed" in stdout
    assert f"editing {n} sequences" in err and f"scoring {n} facts" in err  # the progress bars


def test_overlay_round_trip_and_refusals(tmp_path, run, edited):
    root, _ = run
    model, tok, overlay = edited
    ids = torch.tensor([tok.encode("the cat sat on the dog ran to the mat", add_special_tokens=False).ids])
    with engram.editing.applied(model, overlay):
        want = logits(model, ids)
    d = overlay.save(tmp_path / "ov")
    fresh, _ = load_model(root / "run")
    apply_overlay(fresh, d)
    assert torch.equal(logits(fresh, ids), want)
    assert remove_overlays(fresh) == 1
    # another checkpoint: the same config with other weights
    other, _ = load_model(root / "run")
    with torch.no_grad():
        other.lm_head.weight.mul_(1.01)
    with pytest.raises(EditError, match="another checkpoint"):
        apply_overlay(other, d)
    bad = Overlay(overlay.rows, overlay.values, {**overlay.meta, "hash_spec_sha256": "0" * 64})
    with pytest.raises(EditError, match="another hash manifest"):
        apply_overlay(fresh, bad)
    # an overlay made under another hash_mode (same constants, other rows) is refused too
    shuffled = {**mapping_of(fresh).spec(include_lookup_table=False), "hash_mode": "shuffled"}
    bad = Overlay(overlay.rows, overlay.values, {**overlay.meta, "hash_spec_sha256": identity_digest(shuffled)})
    with pytest.raises(EditError, match="another hash manifest"):
        apply_overlay(fresh, bad)
    raw = bytearray((d / "overlay.safetensors").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (d / "overlay.safetensors").write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="overlay.safetensors"):
        Overlay.load(d)


@pytest.mark.parametrize("backend", ["ram", "mmap"])
def test_overlay_reads_the_same_on_every_backend(tmp_path, run, edited, backend):
    root, _ = run
    model, tok, overlay = edited
    ids = torch.tensor([tok.encode("Line 5: the king sat on the mat", add_special_tokens=False).ids])
    with engram.editing.applied(model, overlay):
        want = logits(model, ids)
    other, _ = load_model(root / "run")
    offload_tables(other, backend, tmp_path / "tables")
    apply_overlay(other, overlay)  # the digest reads table rows through the backend: same model, same digest
    assert torch.equal(logits(other, ids), want)
    Prefetcher.attach(other)
    try:
        assert torch.equal(logits(other, ids), want)
    finally:
        Prefetcher.detach(other)


def test_overlays_stack_in_order_and_generate_uses_them(run, edited):
    root, _ = run
    model, tok, overlay = edited
    lid = next(iter(overlay.rows))
    r = overlay.rows[lid][:1]
    first = Overlay({lid: r}, {lid: torch.full((1, overlay.values[lid].shape[1]), 3.0)}, overlay.meta)
    second = Overlay({lid: r}, {lid: torch.full((1, overlay.values[lid].shape[1]), -2.0)}, overlay.meta)
    m, _ = load_model(root / "run")
    apply_overlay(m, first)
    apply_overlay(m, second)
    mhe = engram.editing.engram_layers(m)[lid]
    assert torch.equal(mhe.table.lookup(r)[0], torch.full((mhe.dim,), -2.0))  # the last overlay wins
    remove_overlays(m)
    apply_overlay(m, overlay)
    prompt = torch.tensor([tok.encode("the cat sat on", add_special_tokens=False).ids])
    out = m.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=1)
    full = logits(m, out[:, :-1])  # recompute without a cache: the same greedy tokens
    assert torch.equal(full[0, prompt.shape[1] - 1:].argmax(-1), out[0, prompt.shape[1]:])


def test_edit_on_an_adapter(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engram.tokenizer import load_tokenizer, train_bpe

    text = [f"The quick brown fox jumps over the lazy dog, line {i} of the tale, said the king." for i in range(300)]
    tok_file = train_bpe(text, 400, tmp_path / "tokenizer.json", progress=False)
    tok = load_tokenizer(tok_file)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         bos_token_id=0, eos_token_id=0, pad_token_id=1, initializer_range=0.3)).eval()
    engram.attach(model, [1], tokenizer=tok_file, engram_vocab_size=[211, 223], n_embed_per_ngram=16,
                  n_head_per_ngram=2)
    with torch.no_grad():  # stand-in for a trained adapter: value rows off zero
        for p in engram.adapters.adapter_of(model).parameters():
            p.add_(torch.randn(p.shape) * 0.3)
    facts = [Fact("The quick brown fox", " said")]
    before = target_logp(model, tok, facts[0])
    overlay = edit_facts(model, tok, facts, steps=40, lr=0.3, progress=False)
    windows = np.array([tok.encode(text[0] + " " + text[1], add_special_tokens=False).ids[:24]])
    coll = collision_set(model, overlay, windows)
    loc = locality(model, overlay, windows, coll["mask"])
    assert loc["changed_outside"] == 0
    apply_overlay(model, overlay)
    assert target_logp(model, tok, facts[0]) > before + 0.5


def test_target_logprobs_project_only_the_target_positions_and_match_all_positions(run):
    """An edit step projects only the positions that predict a target token (`logits_to_keep`); its log-probabilities
    and their gradients are those of projecting every position, on engram's own model and on a transformers base
    with an adapter; engram's model keeps an int (the last k) or a tensor of positions, and refuses it with labels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engram.editing.optimize import fact_sequences, pad_batch, target_logprobs

    root, _ = run
    model, tok = load_model(root / "run")
    seqs = fact_sequences(tok, FACTS)
    ids = pad_batch([p + t for p, t in seqs], 0)  # (3, T), right-padded
    calls = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: calls.append(tuple(out.shape)))
    kept, full = target_logprobs(model, ids, seqs), target_logprobs(model, ids, seqs, full_logits=True)
    hook.remove()
    need = len({i for p, t in seqs for i in range(len(p) - 1, len(p) + len(t) - 1)})
    assert calls[0][1] == need < ids.shape[1] == calls[1][1]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(kept, full))
    assert [len(a) for a in kept] == [len(t) for _, t in seqs]
    with torch.no_grad():
        last = model(ids, logits_to_keep=2).logits
        assert torch.allclose(last, model(ids).logits[:, -2:], atol=1e-6)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, labels=ids, logits_to_keep=2)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128)).eval()
    x = hf.model.embed_tokens.weight
    grads = []
    for full_logits in (False, True):
        x.grad = None
        lps = target_logprobs(hf, ids, seqs, full_logits=full_logits)
        torch.stack([lp.mean() for lp in lps]).sum().backward()
        grads.append(x.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and grads[0].abs().sum() > 0


def test_an_interrupted_edit_resumes_from_its_checkpoint_to_the_same_overlay(run, tmp_path, monkeypatch):
    """An edit stopped after step 3 (the process killed) and started again with its checkpoint ends with the overlay
    of an uninterrupted edit, bit for bit; the checkpoint is removed when the edit completes, and one of another edit
    is refused in one line."""
    root, _ = run
    model, tok = load_model(root / "run")
    kw = dict(steps=6, lr=0.3, target_prob=0.999999, progress=False)
    whole = edit_facts(model, tok, FACTS, **kw)
    ckpt = tmp_path / "edit.ckpt"
    real, calls = torch.optim.Adam.step, []

    def dies_after_3(self, *a, **k):
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(torch.optim.Adam, "step", dies_after_3)
    with pytest.raises(KeyboardInterrupt):
        edit_facts(model, tok, FACTS, checkpoint=ckpt, checkpoint_every=0, **kw)
    monkeypatch.setattr(torch.optim.Adam, "step", real)
    assert ckpt.is_file()
    resumed = edit_facts(model, tok, FACTS, checkpoint=ckpt, **kw)
    assert resumed.meta["optimization"]["resumed_after_step"] == 3 and not ckpt.exists()
    assert all(torch.equal(whole.values[k], resumed.values[k]) for k in whole.values)
    assert resumed.meta["optimization"]["final_loss"] == whole.meta["optimization"]["final_loss"]
    monkeypatch.setattr(torch.optim.Adam, "step", dies_after_3)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        edit_facts(model, tok, FACTS, checkpoint=ckpt, checkpoint_every=0, **kw)
    monkeypatch.setattr(torch.optim.Adam, "step", real)
    with pytest.raises(EditError, match="belongs to another edit"):
        edit_facts(model, tok, FACTS[:2], checkpoint=ckpt, **kw)


def test_edit_refuses_a_freshly_attached_adapter_in_one_line(tmp_path):
    """A new adapter's value projection is zero: its rows cannot move the output, so no edit can work. Before,
    `edit_facts` ran all its steps and returned an overlay that did nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engram.tokenizer import load_tokenizer, train_bpe

    text = [f"The quick brown fox jumps over the lazy dog, line {i} of the tale, said the king." for i in range(300)]
    tok_file = train_bpe(text, 400, tmp_path / "tokenizer.json", progress=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         bos_token_id=0, eos_token_id=0, pad_token_id=1)).eval()
    engram.attach(model, [1], tokenizer=tok_file, engram_vocab_size=[211, 223], n_embed_per_ngram=16,
                  n_head_per_ngram=2)
    with pytest.raises(EditError, match="train the adapter first"):
        edit_facts(model, load_tokenizer(tok_file), [Fact("The quick brown fox", " said")], steps=40,
                   progress=False)


def test_facts_file_errors_and_generator(tmp_path, run):
    root, _ = run
    _, tok = load_model(root / "run")
    for line, msg in [('{"prompt": "", "target": " x"}', "'prompt' is missing or empty"),
                      ('{"prompt": "a", "target": "   "}', "'target' is missing or empty"),
                      ('{"prompt": "a"}', "'target' is missing"),
                      ('{"prompt": "a", "target": "b", "x": 1}', "unknown keys"),
                      ("not json", "not JSON"), ('{"prompt": "a", "target": "b", "paraphrases": "c"}', "list of")]:
        f = tmp_path / "f.jsonl"
        f.write_text(line + "\n")
        with pytest.raises(EditError, match=msg):
            read_facts(f, tok)
    facts = make_facts(50, seed=0)
    assert facts == make_facts(50, seed=0) and len({f.prompt for f in facts}) == 50
    assert all(f.paraphrases and f.passages and f.passages[0].endswith(f.prompt) for f in facts)


def test_conflicts_and_addressable_facts(edited):
    model, tok, _ = edited
    clash = [Fact("Line 7: the cat sat on", " the"), Fact("the cat sat on", " dog")]  # prompts end in one 3-gram
    ids = [tok.encode(f.prompt, add_special_tokens=False).ids for f in clash]
    assert ids[0][-3:] == ids[1][-3:] and ids[0] != ids[1]
    found = conflicts(model, tok, clash)
    assert [c["facts"] for c in found] == [[0, 1]] and found[0]["tokens"] == [" the", " dog"]
    assert engram.editing.shared_rows(model, tok, clash) == mapping_of(model).n_head_per_ngram
    assert conflicts(model, tok, [Fact("the cat sat on", " the"), Fact("the cat sat on", " the")]) == []  # same target


def test_the_report_suggests_subject_rows_for_conflicting_trigger_edits(run, edited):
    """Facts whose prompts end in one n-gram share their trigger rows: the printout names them and, for a trigger
    edit, suggests writing the subject's rows too (a subject+trigger edit is not told so again)."""
    import io

    from engram.editing import print_report

    root, corpus = run
    model, tok, _ = edited
    clash = [Fact("Line 7: the cat sat on", " the", subject="Line 7"), Fact("the cat sat on", " dog", subject="cat")]
    windows = text_windows(tok, [str(corpus)], "train", 32, 2)
    for positions, hint in (("trigger", True), ("subject+trigger", False)):
        ov = edit_facts(model, tok, clash, steps=1, positions=positions, progress=False)
        out = io.StringIO()
        print_report(edit_report(model, tok, clash, ov, windows), out)
        line = next(x for x in out.getvalue().splitlines() if x.startswith("conflicts:"))
        assert "2 facts end in the same n-gram" in line
        assert ("--positions subject+trigger" in line) == hint, line


def test_patience_ends_an_edit_whose_conflicting_facts_can_never_all_be_met(run, edited):
    """Two facts reading the same rows for two targets never both reach theirs: without `patience` the edit runs
    every step; with it, it stops once that many steps meet no more facts, with the overlay the same edit of that
    many steps makes (patience only shortens it), and the overlay and printout say why it stopped."""
    import io

    from engram.editing import print_report

    root, corpus = run
    model, tok, _ = edited
    clash = [Fact("Line 7: the cat sat on", " the"), Fact("the cat sat on", " dog")]
    STEPS = 150
    full = edit_facts(model, tok, clash, steps=STEPS, progress=False)
    assert full.meta["optimization"]["stopped"] == "steps" and full.meta["optimization"]["steps_run"] == STEPS
    short = edit_facts(model, tok, clash, steps=STEPS, patience=5, progress=False)
    o = short.meta["optimization"]
    assert o["stopped"] == "patience" and o["steps_run"] < STEPS and short.meta["settings"]["patience"] == 5
    same = edit_facts(model, tok, clash, steps=o["steps_run"], progress=False)
    for lid in same.values:
        assert torch.equal(same.values[lid], short.values[lid])
    # a loss still falling (over 1% per `patience` steps here) keeps an edit going
    going = edit_facts(model, tok, FACTS[:1], steps=30, lr=0.3, patience=10, progress=False)
    assert going.meta["optimization"]["stopped"] == "steps" and going.meta["optimization"]["steps_run"] == 30
    windows = text_windows(tok, [str(corpus)], "train", 32, 2)
    for ov, said in ((full, "(stopped: the step limit)"), (short, "(stopped: no more facts met for --patience")):
        out = io.StringIO()
        print_report(edit_report(model, tok, clash, ov, windows), out)
        text = out.getvalue()
        assert said in text and ("--patience N ends an edit" in text) == (ov is full)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(EditError, match="patience must be a positive number of steps"):
            edit_facts(model, tok, clash, steps=2, patience=bad, progress=False)


def test_keep_holds_other_facts_through_the_shared_rows_without_writing_theirs(tmp_path):
    """`keep`: facts read through the edited rows whose answers join the loss. On a tiny Llama with a live adapter:
    an edit at orders 2 and 3 lowers a fact that shares its 2-gram rows, and keeping that fact holds it (its rows are
    not written); a kept fact that reads no edited row changes nothing, bit for bit, and neither does no `keep`."""
    from bases import tale_tokenizer, tiny_base
    from tokenizers import Tokenizer

    from engram.adapters import adapter_of, clear_rows

    tale_tokenizer(tmp_path / "tokenizer.json")
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    model = tiny_base("llama").eval()
    engram.attach(model, [1], tokenizer=tmp_path / "tokenizer.json", verbose=False, engram_vocab_size=[211, 223],
                  n_embed_per_ngram=16, n_head_per_ngram=2)
    with torch.no_grad():  # a live adapter (a trained one's stand-in), edit-ready
        g = torch.Generator().manual_seed(1)
        for p in adapter_of(model).parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    clear_rows(model)
    fact = [Fact("the quick brown fox", " dog")]
    near = Fact("a lazy brown fox", " king")  # shares the 2-gram " brown fox" (not the 3-gram) with the edit

    def edit(**kw):
        return edit_facts(model, tok, fact, steps=100, lr=2.0, progress=False, **kw)

    def near_after(ov):
        apply_overlay(model, ov)
        try:
            return target_logp(model, tok, near)
        finally:
            remove_overlays(model)

    base = target_logp(model, tok, near)
    plain, held = edit(orders=[2, 3]), edit(orders=[2, 3], keep=[near])
    assert near_after(plain) < base - 0.5  # the edit's shared 2-gram rows moved the other fact
    assert near_after(held) > near_after(plain) + 0.5  # keeping it holds it
    assert {k: v.tolist() for k, v in held.rows.items()} == {k: v.tolist() for k, v in plain.rows.items()}
    assert held.meta["keep"][0]["prompt"] == near.prompt and held.meta["settings"]["keep_weight"] == 1.0
    assert "keep_at_target" in held.meta["optimization"] and "keep" not in plain.meta
    top, top_kept, top_empty = edit(), edit(keep=[near]), edit(keep=[])  # the 3-gram rows only: near reads none
    for ov in (top_kept, top_empty):
        assert all(torch.equal(ov.values[lid], top.values[lid]) for lid in top.values)
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(EditError, match="keep_weight must be a positive number"):
            edit_facts(model, tok, fact, steps=1, keep=[near], keep_weight=bad, progress=False)


class SyllableTokenizer:
    """A stand-in tokenizer: words with their leading space are tokens, made-up names split into syllables."""

    def __init__(self):
        self.vocab = {}

    def _pieces(self, word):
        from engram_experiments.world import SYLLABLES

        core, out = word.strip().lower(), []
        while core:
            syl = next((x for x in SYLLABLES if core.startswith(x)), None)
            if syl is None:
                return [word]
            out.append(syl)
            core = core[len(syl):]
        return out

    def encode(self, text, add_special_tokens=False):
        import re
        import types

        toks = [p for w in re.findall(r" ?[^ ]+", text) for p in self._pieces(w)]
        return types.SimpleNamespace(ids=[self.vocab.setdefault(t, len(self.vocab)) for t in toks])


def test_generator_keeps_only_addressable_facts():
    from engram_experiments.world import _trigger_ngrams

    tok = SyllableTokenizer()
    facts = make_facts(50, seed=0, tokenizer=tok)
    seen = set()
    for f in facts:
        p = tok.encode(f.prompt).ids
        t = tok.encode(f.target).ids
        seq = p + t
        mine = {tuple(seq[max(0, i - 2): i + 1]) for i in range(len(p) - 1, len(seq) - 1)}
        assert not mine & seen  # no two facts read the same 3-gram where a target is predicted
        seen |= mine
    assert _trigger_ngrams(tok, "Kaldor rules over", " Rome", len("Kaldor"), 3) is not None  # 2 words after: ok
    assert _trigger_ngrams(tok, "Kaldor is the lord of", " Rome", len("Kaldor"), 3) is None  # 4 words after


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_edit_sample_eval_gates_and_errors(tmp_path, run, capsys):
    root, corpus = run
    facts = tmp_path / "facts.jsonl"
    facts.write_text("".join(json.dumps(f.__dict__) + "\n" for f in FACTS[1:2]))
    out = tmp_path / "ov"
    code, stdout, err = cli(capsys, "edit", "--checkpoint", root / "run", "--facts", facts, "--out", out,
                            "--data", corpus, "--split", "train", "--seq-len", 32, "--max-windows", 4,
                            "--steps", 60, "--lr", 0.3)
    assert code == 0, err
    assert "efficacy" in stdout and "0 logits rows changed" in stdout
    assert (out / "report.json").is_file() and (out / "engram_manifest.json").is_file()
    kept = tmp_path / "kept.jsonl"
    kept.write_text(json.dumps(FACTS[2].__dict__) + "\n")
    code, _, err = cli(capsys, "edit", "--checkpoint", root / "run", "--facts", facts, "--out", tmp_path / "ov-kept",
                       "--data", corpus, "--split", "train", "--seq-len", 32, "--max-windows", 4, "--steps", 3,
                       "--keep", kept, "--keep-weight", 2)
    assert code == 0 and "1 facts kept as they are" in err, err
    meta = Overlay.load(tmp_path / "ov-kept").meta
    assert meta["keep"][0]["prompt"] == FACTS[2].prompt and meta["settings"]["keep_weight"] == 2.0
    code, stdout, err = cli(capsys, "verify", out)
    assert code == 0 and stdout.startswith("ok") and "overlay" in stdout, (stdout, err)
    code, stdout, err = cli(capsys, "sample", "--checkpoint", root / "run", "--overlay", out, "--prompt",
                            FACTS[1].prompt, "--temperature", 0, "--max-new-tokens", 1)
    assert code == 0, err
    edited_greedy = json.loads((out / "report.json").read_text())["facts"][0]["after"]["prompt"]["greedy"]
    assert (stdout.strip() == (FACTS[1].prompt + FACTS[1].target)) == edited_greedy
    code, stdout, err = cli(capsys, "eval", "--checkpoint", root / "run", "--overlay", out, "--data", corpus,
                            "--seq-len", 32, "--max-windows", 2)
    assert code == 0 and "perplexity" in stdout, err
    code, stdout, err = cli(capsys, "gates", "--checkpoint", root / "run", "--overlay", out, "--text", "the king")
    assert code == 0 and "gate min" in stdout, err
    # bad input: one line each, exit 2, nothing written
    (tmp_path / "empty.jsonl").write_text('{"prompt": " ", "target": " x"}\n')
    for args, msg in [(("--facts", tmp_path / "empty.jsonl"), "missing or empty"),
                      (("--facts", tmp_path / "nope.jsonl"), "no such file"),
                      (("--facts", facts, "--overlay", tmp_path / "nowhere"), "no overlay here"),
                      (("--facts", facts, "--patience", 0), "patience must be a positive number"),
                      (("--facts", facts, "--keep-weight", 2), "give --keep FILE too"),
                      (("--facts", facts, "--keep", facts, "--keep-weight", 0), "keep_weight must be a positive"),
                      (("--facts", facts, "--keep", tmp_path / "empty.jsonl"), "missing or empty")]:
        code, _, err = cli(capsys, "edit", "--checkpoint", root / "run", "--out", tmp_path / "bad", *args)
        lines = [line for line in err.splitlines() if line.startswith("engram:")]
        assert code == 2 and len(lines) == 1 and msg in lines[0] and "Traceback" not in err, err
        assert not (tmp_path / "bad").exists()


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 10 s
def test_edit_experiment_end_to_end(run, tmp_path, monkeypatch):
    """The counterfactual/new-entity experiment on the tiny model: every config measured at every fixed step budget
    (no stopping rule), per-seed files written, the fact sets seeded, neighbours never among the edited subjects,
    the held-out countries never edited, the family of paired tests Holm-adjusted, per-relation hits with n."""
    from engram_experiments import edit as ed
    from engram_experiments.world import fact_sets

    root, corpus = run
    facts = [(f"Land{c}", rel, f" {o}{c.lower()}") for c in "ABCDEFGHIJ" for rel, o in
             (("capital", "Rome"), ("subregion", "Europe"), ("demonym", "Romans"))]
    facts.append(("LandZ", "capital", " Paris"))  # not known: never edited, never a neighbour
    held = ed.held_out_subjects(facts)
    assert held == ed.held_out_subjects(facts) and len(held) == 1 and not held & {f[0] for f in ed.trained_facts(facts)}
    monkeypatch.setattr(ed, "world_facts", lambda: facts)
    monkeypatch.setattr(ed, "known_facts", lambda model, tok, fs: [f for f in fs if f[0] != "LandZ"])
    known = [f for f in facts if f[0] != "LandZ" and f[0] not in held]
    fs = fact_sets(known, facts, 3, seed=1)
    assert fs == fact_sets(known, facts, 3, seed=1)
    edited_subjects = {f.prompt for f in fs["counterfactual"]}
    assert len(fs["counterfactual"]) == 3 and len(fs["new"]) == 3
    assert all(f.target != o for f, o in zip(fs["counterfactual"], fs["counterfactual_true"]))
    assert not {x["prompt"] for x in fs["neighbours"]} & edited_subjects
    grid = ed.configs(ft_lrs=(1e-4,), lora_lrs=(1e-3,), kl_weights=(1.0,))  # each method's default setting
    s = ed.run(tmp_path, checkpoint=str(root / "run"), n_facts=3, seeds=2, max_windows=2, budgets=(1, 3),
               general=[str(corpus)], progress=False, record=tmp_path / "rec", grid=grid)
    assert set(s["table"]) == set(grid) == {"engram-edit", *ed.DEFAULTS.values()}
    assert len(ed.configs()) == 1 + 3 + 3 + 1  # the edit; ft lr and KL weight each swept over 3 values; LoRA at 1
    assert len(s["runs"]) == len(grid) * 2 * 2  # every config x fact set x budget
    for c in grid:
        for b in ("1", "3"):
            assert set(s["table"][c][b]) == set(ed.METRICS) and s["table"][c][b]["val_change"]["n"] == 2
    assert s["held_out_subjects"] == sorted(held) and s["known_facts"] == len(known)  # held-out never edited
    # the family: each default setting vs the edit, at each budget, on FAMILY_METRICS; Holm-adjusted
    assert len(s["tests"]) == 2 * 3 * len(ed.FAMILY_METRICS)
    assert all(t["kind"] == "paired" and t["n"] == 2 and t["p_holm"] >= t["p"] for t in s["tests"])
    # damage on known facts: every known fact this set neither edits nor uses as a neighbour, measured and tested
    assert s["family_metrics"] == list(ed.FAMILY_METRICS) and "known_kept" in {t["metric"] for t in s["tests"]}
    assert "world_change" not in {t["metric"] for t in s["tests"]}  # descriptive: never-trained countries
    for seed, other in s["known_other"].items():
        fs_i = fact_sets(known, facts, 3, int(seed))
        assert other["n"] == len(known) - len(fs_i["counterfactual"]) - len(fs_i["neighbours"])
    # per-relation cells pooled over fact sets with their n
    cell = s["by_relation"]["ft-lr0.0001"]["3"]
    assert sum(x["efficacy_n"] for x in cell.values()) == 3 * 2
    rec = json.loads((tmp_path / "rec" / "edit.json").read_text())
    assert rec["known_facts"] == len(known)
    from engram.persist import sha256_file

    # the record names the model by its weights' checksum, not by a path on this machine
    assert rec["model"] == "--checkpoint run" and str(tmp_path) not in json.dumps(rec)
    assert rec["model_sha256"] == sha256_file(root / "run" / "final" / "model.safetensors")
    assert (tmp_path / "edit" / "plot.png").is_file() and "Holm p" in (tmp_path / "edit" / "summary.md").read_text()
    with pytest.raises(ValueError, match="knows only"):
        ed.run(tmp_path / "again", checkpoint=str(root / "run"), n_facts=30, seeds=1, general=[str(corpus)],
               progress=False)


def test_finetune_measured_at_a_budget_is_the_run_of_that_many_steps(run):
    """Fixed budgets read along one run: the model after step 2 of a 3-step run is the 2-step run's."""
    from engram_experiments import edit as ed

    root, _ = run
    seen = {}

    def grab(step, model):
        with torch.no_grad():
            seen.setdefault(step, []).append(model(torch.tensor([[5, 6, 7, 8]])).logits.clone())
    from engram.model import load_model

    ed.finetune(lambda: load_model(root / "run"), FACTS, "ft", (2, 3), grab, 1e-3, progress=False)
    ed.finetune(lambda: load_model(root / "run"), FACTS, "ft", (2,), grab, 1e-3, progress=False)
    assert set(seen) == {2, 3} and torch.equal(seen[2][0], seen[2][1]) and not torch.equal(seen[2][0], seen[3][0])


def test_the_committed_edit_record_is_tested_by_the_fixed_rule():
    """docs/results/edit.json: its family (45 paired comparisons with the edit, Holm-adjusted) and its per-relation
    cells are what its per-fact-set runs give; each budget's counterfactual cells add up to every edited fact."""
    from pathlib import Path

    from engram_experiments import edit as ed

    rec = json.loads((Path(__file__).parents[1] / "docs/results/edit.json").read_text())
    assert rec["budgets"] == [10, 50, 300] and rec["seeds"] == 3
    again = ed.analyse(rec)
    assert again["tests"] == rec["tests"] and again["by_relation"] == rec["by_relation"]
    assert len(rec["tests"]) == 45 and all(t["kind"] == "paired" and t["n"] == 3 and t["p_holm"] >= t["p"]
                                           for t in rec["tests"])
    cells = [line for line in ed.markdown(rec).splitlines() if line.startswith("| engram-edit | ") and "/" in line]
    assert len(cells) == 3
    for c in cells:
        assert sum(int(x.split(",")[0].split("/")[1]) for x in c.strip("| \n").split(" | ")[2:]) == \
            rec["n_facts"] * rec["seeds"]



def test_unedited_known_leaves_out_exactly_the_edited_facts_and_neighbours():
    """Damage on known facts reads every known fact the set neither edits nor uses as a neighbour, by its main
    phrasing and true object; another relation of an edited subject is still read (it was not edited)."""
    from engram_experiments import edit as ed
    from engram_experiments.world import WORLD_RELATIONS, fact_sets

    known = [(f"Land{c}", rel, f" {o}{c.lower()}") for c in "ABCDEFGHIJKL" for rel, o in
             (("capital", "Rome"), ("subregion", "Europe"), ("demonym", "Romans"))]
    fs = fact_sets(known, known, 3, seed=4000)
    other = ed.unedited_known(known, fs)
    used = {f.prompt for f in fs["counterfactual"]} | {x["prompt"] for x in fs["neighbours"]}
    assert len(used) == 3 + 9 and len(other) == len(known) - len(used)
    assert not {p for p, _ in other} & used
    phrased = [(WORLD_RELATIONS[r][1].format(s=s), o) for s, r, o in known]
    assert other == [(p, o) for p, o in phrased if p not in used]
    edited_subject = fs["counterfactual"][0].prompt
    assert any(s in edited_subject and WORLD_RELATIONS[r][1].format(s=s) != edited_subject and
               (WORLD_RELATIONS[r][1].format(s=s), o) in other for s, r, o in known)
    draws = [fact_sets(known, known, 3, seed=s)["counterfactual"] for s in (4000, 0)]
    assert draws[0] != draws[1]  # a new seed draws another fact set


def test_the_edit_family_is_the_records_and_the_old_record_keeps_its_own():
    """A record names its family (`family_metrics`); edit.json (2026-12-02), which does not, keeps the family it was
    tested on (the held-out countries' loss in it, no known facts) and its table shows no known-facts column; a
    record that names another family is tested on it, and a replication's editing family is its `known_tests`."""
    from pathlib import Path

    from engram_experiments import edit as ed

    rec = json.loads((Path(__file__).parents[1] / "docs/results/edit.json").read_text())
    assert "family_metrics" not in rec and {t["metric"] for t in rec["tests"]} == set(ed.FAMILY_METRICS_HELD_OUT)
    assert "known_kept" not in ed.FAMILY_METRICS_HELD_OUT and "world_change" not in ed.FAMILY_METRICS
    head = next(x for x in ed.markdown(rec).splitlines() if x.startswith("| method | steps |"))
    assert ed.LABELS["known_kept"] not in head and ed.LABELS["world_change"] in head
    for r in rec["runs"]:  # a record that measured known facts (made-up values) and names a family of them
        r["known_kept"] = 0.9 if r["config"] == "engram-edit" else 0.8 + 0.01 * r["seed"]
    new = {**rec, "family_metrics": ["known_kept"]}
    new |= ed.analyse(new)
    assert len(new["tests"]) == 9 and {t["metric"] for t in new["tests"]} == {"known_kept"}
    assert new["tests"][0]["diff"] == pytest.approx(-0.09)
    head = next(x for x in ed.markdown(new).splitlines() if x.startswith("| method | steps |"))
    assert ed.LABELS["known_kept"] in head
    rep = {**new, "replicates": "edit", "known_tests": new["tests"], "tests": [{"a": "x"}], "seeds": {"c": [4, 5, 6]}}
    assert ed.family_tests(rep) == new["tests"] and ed._n_sets(rep) == 3
    assert sum(x.split(" | ")[2:3] == [ed.LABELS["known_kept"]] for x in ed.markdown(rep).splitlines()) == 9


def test_replicate_refuses_a_design_that_is_not_the_originals(tmp_path):
    """`editing.replicate` runs the original record's design: another fact-set size, budget list, base, window count,
    a swept setting or a config missing from the family's sides is refused in one line, before anything runs."""
    from pathlib import Path

    from engram.utils import parse_toml
    from engram_experiments import edit as ed
    from engram_experiments.runs import ExperimentError

    repo = Path(__file__).parents[1]
    rec = json.loads((repo / "docs/results/edit.json").read_text())
    d = parse_toml((repo / "docs/prereg/edit-replication.toml").read_text(), "prereg", ValueError)
    for bad, match in [({"n_facts": 10}, "n_facts"), ({"budgets": [10, 300]}, "budgets"),
                       ({"base_steps": 300}, "base_steps"), ({"max_windows": 32}, "max_windows"),
                       ({"variants": ["engram-edit", "ft-lr0.0003", "ft+kl-w1", "lora-lr0.001"]}, "default setting"),
                       ({"variants": ["engram-edit", "ft-lr0.0001", "ft+kl-w1"]}, "default setting")]:
        with pytest.raises(ExperimentError, match=match):
            ed.replicate(rec, {**d, **bad}, tmp_path)
    assert not any(tmp_path.iterdir())
    assert ed.replication_point("ft+kl-w1", 300) == "ft+kl-w1 at 300"


def test_overlap_counts_the_facts_an_original_seed_would_also_edit(tmp_path, monkeypatch):
    """`editing.overlap`: a seed of the original's overlaps fully with itself; another seed's draw from the same known
    facts shares at most a few edited facts (counted, not assumed zero)."""
    from engram_experiments import edit as ed

    facts = [(f"Land{c}{d}", rel, f" {o}{c.lower()}") for c in "ABCDEFGHIJ" for d in "xyz" for rel, o in
             (("capital", "Rome"), ("subregion", "Europe"), ("demonym", "Romans"))]
    monkeypatch.setattr(ed, "world_facts", lambda: facts)
    (tmp_path / "known.json").write_text(json.dumps(facts))
    got = ed.overlap(tmp_path, [0, 1], [1, 4000], 6)
    assert got["1"] == {"counterfactual": 6, "new": 6, "of": 6}
    assert got["4000"]["counterfactual"] < 6 and got["4000"]["new"] < 6


def test_ngram_entropy_is_the_weighted_entropy_of_word_ngrams():
    """Generation entropy as ROME reports fluency: a text that repeats one word has none; n distinct words have
    log2(n - 1) bits of bigrams and log2(n - 2) of trigrams, weighted 2/3 and 4/3 and averaged."""
    import math

    from engram.editing import ngram_entropy

    assert ngram_entropy("the the the the the") == 0.0 and ngram_entropy("") == 0.0
    words = " ".join(f"w{i}" for i in range(10))
    assert ngram_entropy(words) == pytest.approx((2 / 3 * math.log2(9) + 4 / 3 * math.log2(8)) / 2)
    assert ngram_entropy("a b a b a b a b") < ngram_entropy("a b c d e f g h")  # repetition scores lower
    assert ngram_entropy("Paris, Paris.") == ngram_entropy("paris , paris .")  # lower case, punctuation as words
    with pytest.raises(ValueError, match="one weight per order"):
        ngram_entropy("a b c", orders=(2, 3), weights=(1.0,))
