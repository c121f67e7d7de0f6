"""Edits of a released table: `engram edit` on a qwen4_exp model (a tiny random Qwen4Exp, its n-gram tables served
by engram) writes facts into the table's rows as an overlay; `engram serve` applies it per request; the overlay is
bound to the model's hashing and weights, and the checkpoint's table is never written."""

import copy
import hashlib
import json
import shutil
import threading
import urllib.request

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
mq = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

from test_qwen4_exp import tiny_model  # noqa: E402  (the tiny Qwen4Exp config of the serving tests)

from engram.cli import main  # noqa: E402
from engram.editing import (  # noqa: E402
    EditError,
    Fact,
    Overlay,
    applied,
    apply_overlay,
    collision_set,
    edit_facts,
    edit_report,
    edit_rows,
    mapping_of,
    remove_overlays,
    score,
)
from engram.integrations.qwen4_exp import load_folder, serve_tables, transformers_hashing  # noqa: E402
from engram.training.data import text_windows  # noqa: E402

FACTS = [Fact("The queen of Zorbia is", " Paris"), Fact("The king rode to", " the sea")]
TEXT = ([f"The king of land {i} rode to the sea, and the queen said the tale was old." for i in range(300)]
        + [f"Day {i}: The king rode to the hills." for i in range(20)])


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread for this module (2 shared cores: a second thread mostly waits), restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A saved qwen4_exp model folder (config.json, model.safetensors with the table in row shards, tokenizer.json)
    and a corpus. `initializer_range=0.5`: a random model whose logits are not near-uniform, so that a target's
    probability can rise well above its neighbours' (at transformers' default 0.02 every token has p ~ 1/vocab)."""
    from engram.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("released")
    tok = train_bpe(TEXT, 400, root / "tok" / "tokenizer.json", progress=False)  # ids < 400 < vocab_size 1000
    tiny_model(eos_token_id=0, initializer_range=0.5).save_pretrained(root / "qwen")  # EOS: <|endoftext|> = 0
    shutil.copy(tok, root / "qwen" / "tokenizer.json")
    (root / "c.txt").write_text("\n".join(TEXT) + "\n")
    return root


@pytest.fixture(scope="module")
def edited(folder):
    ckpt = sha256(folder / "qwen" / "model.safetensors")
    model, tok = load_folder(folder / "qwen")  # tables served by engram from RAM, prefetch on
    with torch.no_grad():
        state = {k: v.clone() for k, v in model.state_dict().items()}  # the table included (as transformers saves it)
    before = [score(model, tok, f.prompt, f.target) for f in FACTS]
    overlay = edit_facts(model, tok, FACTS, steps=150, lr=0.3, progress=False)
    assert sha256(folder / "qwen" / "model.safetensors") == ckpt  # the checkpoint's table file is untouched
    with torch.no_grad():
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # and so is every weight
    return model, tok, overlay, before


def test_the_edited_model_states_the_fact_and_the_unedited_does_not(edited):
    model, tok, overlay, before = edited
    assert overlay.meta["hash_family"] == "qwen4_exp" and sorted(overlay.rows) == [1, 3]  # its 1-indexed PLE layers
    with applied(model, overlay):
        after = [score(model, tok, f.prompt, f.target) for f in FACTS]
    for f, b, a in zip(FACTS, before, after):
        assert not b["greedy"] and a["greedy"], (f, b, a)  # greedy decoding states the fact only with the overlay
        assert a["p_first"] > 0.3 and a["p_target"] > 1000 * b["p_target"], (f, b, a)  # (a random model: p ~ 1e-3)
    assert [score(model, tok, f.prompt, f.target) for f in FACTS] == before  # taken off again: the undo


def test_edited_rows_are_transformers_own_row_ids_of_the_trigger_ngram(edited):
    """The rows an edit changes are the ones transformers' Qwen4ExpTextNGramEmbedding reads (offsets included)
    for the highest-order n-grams ending where a target token is predicted (the prompt's last token, every target
    token but the last): the overlay addresses the released table's layout."""
    model, tok, overlay, _ = edited
    cfg = model.config
    N, K = cfg.ngram_size, cfg.heads_per_ngram
    for i, lid in enumerate(cfg.ple_layer_ids):
        union = set()
        for f in FACTS:
            p, t = (tok.encode(x, add_special_tokens=False).ids for x in (f.prompt, f.target))
            rows = transformers_hashing(cfg, i)(torch.tensor([p + t]), None)[0]  # (T, H)
            want = set(rows[len(p) - 1:len(p) + len(t) - 1, (N - 2) * K:].reshape(-1).tolist())
            assert set(edit_rows(model, tok, [f])[lid].tolist()) == want
            union |= want
        assert set(overlay.rows[lid].tolist()) == union


def test_report_locality_is_exact_on_the_released_model(edited, folder):
    """The report as for engram's own models; the collision set checked against transformers' own row ids, and
    every logit outside the overlay's reach identical bit for bit."""
    model, tok, overlay, _ = edited
    windows = text_windows(tok, [str(folder / "c.txt")], "train", 32, 6)
    fact = tok.encode(FACTS[1].prompt, add_special_tokens=False).ids
    windows[:2, 8:8 + len(fact)] = fact  # a fact's trigger n-gram inside two windows (and in none of the others)
    rep = edit_report(model, tok, FACTS, overlay, windows, batch_size=3)
    json.dumps(rep)
    loc, s = rep["locality"], rep["summary"]
    assert s["greedy_after"] == 1.0 and s["greedy_before"] == 0.0
    assert loc["changed_outside"] == 0 and loc["outside"]["tokens"] > 0
    assert loc["outside"]["loss_before"] == loc["outside"]["loss_after"]
    assert loc["all"]["loss_before"] != loc["all"]["loss_after"]  # inside the collision set something changed
    mask = collision_set(model, overlay, windows)["mask"]
    cfg = model.config
    want = torch.zeros(windows.shape, dtype=torch.bool)
    for i, lid in enumerate(cfg.ple_layer_ids):
        rows = transformers_hashing(cfg, i)(torch.from_numpy(windows.astype(np.int64)), None)  # (W, T, H)
        want |= torch.isin(rows, overlay.rows[lid]).any(-1)
    assert torch.equal(mask, want) and 0 < int(mask.sum()) < mask.numel()


def test_overlay_is_written_atomically_and_applies_on_the_file_tiers(edited, folder, tmp_path, crash_at):
    model, tok, overlay, _ = edited
    for k in range(1, 20):  # killed at each filesystem step of the save in turn: no overlay, never half of one
        crash_at(k)
        try:
            overlay.save(tmp_path / "ov")
            break
        except BaseException as e:
            assert "killed" in str(e)
        finally:
            crash_at.disarm()
        if (tmp_path / "ov").exists():  # (a crash after the swap: the whole overlay)
            assert Overlay.load(tmp_path / "ov").num_rows == overlay.num_rows
    assert k > 1  # (some step crashed)
    d = tmp_path / "ov"
    assert Overlay.load(d).num_rows == overlay.num_rows
    assert {"overlay.safetensors", "overlay.json", "engram_manifest.json"} <= {p.name for p in d.iterdir()}
    ids = torch.tensor([tok.encode("Day 3: The king rode to the queen of Zorbia is", add_special_tokens=False).ids])
    with torch.no_grad(), applied(model, overlay):
        want = model(ids).logits
    for backend in ("mmap", "disk"):
        m, _ = load_folder(folder / "qwen", backend, tmp_path / backend)
        table = tmp_path / backend / "engram_table_L1.safetensors"
        digest = sha256(table)
        apply_overlay(m, Overlay.load(d))  # the digest reads the rows through the tier: same model, same digest
        with torch.no_grad():
            assert torch.equal(m(ids).logits, want)
        assert m.generate(ids[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0).shape == (1, 7)
        m.save_pretrained(tmp_path / f"saved_{backend}")  # a served, edited model saves its own rows, not the edit
        assert remove_overlays(m) == 2  # one per PLE layer
        assert sha256(table) == digest  # the table file engram serves from is never written
    again = mq.Qwen4ExpForCausalLM.from_pretrained(tmp_path / "saved_mmap").eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)  # the unedited logits: the overlay was not saved


def test_a_mismatched_overlay_is_refused_in_one_line(edited, folder, tmp_path, capsys):
    model, tok, overlay, _ = edited
    d = overlay.save(tmp_path / "ov")
    other = serve_tables(tiny_model(seed=1, eos_token_id=0, initializer_range=0.5), prefetch=False)  # other weights
    with pytest.raises(EditError, match="made for another checkpoint"):
        apply_overlay(other, d)
    # the same weights hashed with other constants (the config's hash seed: other multipliers, same table shape)
    cfg = copy.deepcopy(model.config)
    cfg.seed = 5
    m = mq.Qwen4ExpForCausalLM(cfg).eval()
    got = m.load_state_dict(model.state_dict(), strict=False)  # (the hash buffers it keeps are its own config's)
    assert not got.unexpected_keys and all("ple_embedding" in k for k in got.missing_keys)
    m = serve_tables(m, prefetch=False)
    assert mapping_of(m).spec_digest() != mapping_of(model).spec_digest()
    with pytest.raises(EditError, match="another hash manifest"):
        apply_overlay(m, d)
    # an engram model: another hash family
    from engram.model import EngramForCausalLM
    from engram.training import presets

    with pytest.raises(EditError, match="'qwen4_exp' family, this model hashes with 'deepseek'"):
        apply_overlay(EngramForCausalLM(presets.tiny()), d)
    # transformers' own (unserved) Qwen4Exp model: told to serve its tables first
    with pytest.raises(EditError, match="serve them with engram first"):
        apply_overlay(tiny_model(eos_token_id=0), d)
    # the server refuses it at start, one line, exit 2
    other_dir = tmp_path / "other"
    tiny_model(seed=1, eos_token_id=0, initializer_range=0.5).save_pretrained(other_dir)
    shutil.copy(folder / "qwen" / "tokenizer.json", other_dir / "tokenizer.json")
    capsys.readouterr()
    code, _, err = cli(capsys, "serve", "--checkpoint", other_dir, "--overlay", f"fact={d}")
    lines = [line for line in err.splitlines() if line.startswith("engram:")]
    assert code == 2 and len(lines) == 1 and "made for another checkpoint" in lines[0], err
    assert "Traceback" not in err


def submit(engine, prompt, n, overlay=None):
    """Queue one greedy request on the serving engine (as the HTTP app submits it); returns a function that waits
    for it and gives the text it decoded."""
    from engram.serving.engine import Job

    events, done = [], threading.Event()

    def emit(ev):
        events.append(ev)
        if ev["type"] in ("done", "error"):
            done.set()

    engine.submit(Job(ids=engine.encode(prompt), max_tokens=n, temperature=0.0, top_p=1.0, stop=[], seed=None,
                      overlay=overlay, emit=emit))

    def result():
        assert done.wait(120)
        assert events[-1]["type"] == "done", events
        return "".join(e["text"] for e in events if e["type"] == "delta")

    return result


def test_serve_chooses_the_overlay_per_request(edited, folder, tmp_path):
    from engram.serving import load_engine

    model, tok, overlay, before = edited
    d = overlay.save(tmp_path / "ov")
    engine = load_engine(folder / "qwen", overlays={"fact": d}, table_tier="mmap", table_dir=tmp_path / "t",
                         name="qwen")
    try:
        assert engine.model_ids() == ["qwen", "qwen+fact"] and engine.resolve("qwen+fact") == "fact"
        queued = []  # every request queued at once, alternating: each decodes with its own overlay or none
        for f, b in zip(FACTS * 2, before * 2):
            n = len(tok.encode(f.target, add_special_tokens=False).ids)
            queued += [(submit(engine, f.prompt, n, "fact"), f.target), (submit(engine, f.prompt, n), b["generated"])]
        assert [r() for r, _ in queued] == [want for _, want in queued]
        assert all(b["generated"] != f.target for f, b in zip(FACTS, before))
    finally:
        engine.close()


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 27 s
def test_cli_edit_on_a_qwen4_exp_folder(folder, tmp_path, capsys):
    facts = tmp_path / "facts.jsonl"
    facts.write_text("".join(json.dumps(f.__dict__) + "\n" for f in FACTS))
    ckpt = sha256(folder / "qwen" / "model.safetensors")
    out = tmp_path / "ov"
    code, stdout, err = cli(capsys, "edit", "--checkpoint", folder / "qwen", "--facts", facts, "--out", out,
                            "--data", folder / "c.txt", "--split", "train", "--seq-len", 32, "--max-windows", 2,
                            "--steps", 150, "--lr", 0.3)
    assert code == 0, err
    assert "efficacy: greedy produces the target for 100% of 2 facts (before 0%)" in stdout, stdout
    assert "0 logits rows changed" in stdout
    rep = json.loads((out / "report.json").read_text())
    assert rep["locality"]["changed_outside"] == 0
    assert json.loads((out / "overlay.json").read_text())["hash_family"] == "qwen4_exp"
    assert sha256(folder / "qwen" / "model.safetensors") == ckpt
    code, stdout, err = cli(capsys, "verify", out)
    assert code == 0 and stdout.startswith("ok"), (stdout, err)
    # the tables served from files (--table-tier mmap): the same overlay as from RAM
    code, _, err = cli(capsys, "edit", "--checkpoint", folder / "qwen", "--facts", facts, "--out", tmp_path / "ovm",
                       "--data", folder / "c.txt", "--split", "train", "--seq-len", 32, "--max-windows", 2,
                       "--steps", 150, "--lr", 0.3, "--table-tier", "mmap", "--table-dir", tmp_path / "tables")
    assert code == 0, err
    assert list((tmp_path / "tables").iterdir())  # the rows were read from files
    from safetensors.torch import load_file

    ram, mm = load_file(str(out / "overlay.safetensors")), load_file(str(tmp_path / "ovm" / "overlay.safetensors"))
    assert ram.keys() == mm.keys() and all(torch.equal(ram[k], mm[k]) for k in ram)
    code, _, err = cli(capsys, "edit", "--checkpoint", folder / "qwen", "--facts", facts, "--out", tmp_path / "no",
                       "--table-tier", "mmap")
    assert code == 2 and "needs --table-dir DIR" in err and "Traceback" not in err and not (tmp_path / "no").exists()
    # stacked: a second edit on top of the first, on the same folder
    facts2 = tmp_path / "facts2.jsonl"
    facts2.write_text(json.dumps({"prompt": "Day 3: The king", "target": " said"}) + "\n")
    code, stdout, err = cli(capsys, "edit", "--checkpoint", folder / "qwen", "--overlay", out, "--facts", facts2,
                            "--out", tmp_path / "ov2", "--data", folder / "c.txt", "--split", "train", "--seq-len",
                            32, "--max-windows", 1, "--steps", 30, "--lr", 0.3)
    assert code == 0, err
    assert json.loads((tmp_path / "ov2" / "overlay.json").read_text())["stacked_on"] == [str(out)]
    # bad input: one line, exit 2, nothing written
    (tmp_path / "empty.jsonl").write_text('{"prompt": " ", "target": " x"}\n')
    code, _, err = cli(capsys, "edit", "--checkpoint", folder / "qwen", "--facts", tmp_path / "empty.jsonl",
                       "--out", tmp_path / "bad")
    lines = [line for line in err.splitlines() if line.startswith("engram:")]
    assert code == 2 and len(lines) == 1 and "missing or empty" in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_cli_edit_then_engram_serve_end_to_end(folder, tmp_path, capsys):
    """`engram edit --checkpoint FOLDER` then `engram serve FOLDER --overlay fact=DIR`, over HTTP: the model id
    `qwen+fact` states the fact, `qwen` does not."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from test_serve import start

    facts = tmp_path / "facts.jsonl"
    facts.write_text("".join(json.dumps(f.__dict__) + "\n" for f in FACTS))
    code, _, err = cli(capsys, "edit", "--checkpoint", folder / "qwen", "--facts", facts, "--out", tmp_path / "ov",
                       "--data", folder / "c.txt", "--split", "train", "--seq-len", 32, "--max-windows", 2,
                       "--steps", 150, "--lr", 0.3)
    assert code == 0, err
    p, port = start(["--checkpoint", folder / "qwen", "--overlay", f"fact={tmp_path / 'ov'}", "--served-model-name",
                     "qwen",
                     "--table-tier", "disk", "--table-dir", tmp_path / "t"])
    try:
        def ask(model, prompt, n):
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())["choices"][0]["text"]

        model, tok = load_folder(folder / "qwen")
        for f in FACTS:
            n = len(tok.encode(f.target, add_special_tokens=False).ids)
            assert ask("qwen+fact", f.prompt, n) == f.target
            assert ask("qwen", f.prompt, n) == score(model, tok, f.prompt, f.target)["generated"] != f.target
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_weights_digest_samples_a_served_table_and_never_rebuilds_it(folder, monkeypatch):
    """The digest an overlay binds to reads a served table's rows through the table (a sample), not through the
    state-dict hook that rebuilds the whole table in transformers' layout (~100 GB for the released one); a change
    to the table's rows still changes it."""
    from engram.adapters.introspect import model_digest
    from engram.tables.base import find_tables, rows_by_reference

    model, _ = load_folder(folder / "qwen")
    before = model_digest(model)
    assert any(k.endswith("ngram_embedding.weight") for k in model.state_dict())  # a plain state_dict rebuilds it
    with rows_by_reference():  # what the digest reads: the hook leaves the rows out
        assert not any(k.endswith("ngram_embedding.weight") for k in model.state_dict())
    assert model_digest(model) == before
    (_, mhe), *_ = find_tables(model)
    with torch.no_grad():
        mhe.table.weight[0] += 1.0  # one row of the served table (row 0 is in the digest's sample)
    assert model_digest(model) != before
