"""`engram adapt` (engram.training.adapt): adapter runs on a tiny saved Llama, resume, eval/sample with --base --adapter."""

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from conftest import run_cli  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from engram.tokenizer import train_bpe  # noqa: E402
from engram.training.adapt import adapt  # noqa: E402

TINY = {"seq_len": 32, "batch_size": 4, "ckpt_every": 4, "eval_max_windows": 4, "eval_every": 4, "warmup_steps": 2,
        "lr": 1e-2}
ENGRAM = {"engram_vocab_size": [211, 223], "n_embed_per_ngram": 16, "n_head_per_ngram": 2}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A saved tiny Llama with its tokenizer.json, and a small corpus of another kind."""
    root = tmp_path_factory.mktemp("adapt")
    text = [f"The quick brown fox jumps over the lazy dog, line {i} of the tale, said the king." for i in range(300)]
    tok = train_bpe(text, 400, root / "tok" / "tokenizer.json", progress=False)
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=1, initializer_range=0.3))
    m.save_pretrained(root / "base")
    shutil.copy(tok, root / "base" / "tokenizer.json")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"def f{i % 50}(x):\n    return x * {i % 7} + {i % 11}\n\n" for i in range(1500)))
    return root / "base", corpus


def cli(capsys, *args):
    """`engram ARGS` in this process (the subprocess path is covered once below): (exit code, stdout, stderr)."""
    from engram.cli import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _losses(run):
    return [json.loads(l)["train_loss"] for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]


@pytest.mark.parametrize("backend", ["param", "mmap"])
def test_interrupted_adapt_resumes_exactly(base, tmp_path, backend):
    model_dir, corpus = base
    kw = dict(data=[str(corpus)], max_steps=10, overrides={**TINY, "table_backend": backend}, engram_options=ENGRAM,
              progress=False)
    full = adapt(model_dir, out=tmp_path / "full", **kw)
    cut = adapt(model_dir, out=tmp_path / "cut", stop_after=6, **kw)
    assert cut["interrupted"] and cut["step"] == 6
    done = adapt(model_dir, out=tmp_path / "cut", resume=True, **kw)
    assert done["step"] == 10 and _losses(tmp_path / "cut") == _losses(tmp_path / "full")
    val0 = json.loads((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[0])["val_loss"]
    assert done["val_loss"] == full["val_loss"] < val0
    # checkpoints hold what trains, not the frozen base
    from safetensors import safe_open

    with safe_open(str(next((tmp_path / "cut" / "checkpoints").glob("step_*")) / "model.safetensors"), "pt") as f:
        assert all("engram_adapter" in k for k in f.keys())


def test_adapter_run_loads_for_eval_and_sample(base, tmp_path, capsys):
    model_dir, corpus = base
    s = adapt(model_dir, data=[str(corpus)], out=tmp_path / "r", max_steps=8, overrides=TINY, engram_options=ENGRAM,
              progress=False)
    code, out, err = cli(capsys, "eval", "--base", model_dir, "--adapter", tmp_path / "r", "--data", corpus,
                         "--seq-len", "32", "--max-windows", "4")
    assert code == 0 and f"val loss {s['val_loss']:.4f}" in out, err  # the same windows give the training loss
    r = run_cli("sample", "--base", str(model_dir), "--adapter", str(tmp_path / "r" / "final"), "--prompt", "def f1",
                "--max-new-tokens", "5", "--temperature", "0")
    assert r.returncode == 0 and r.stdout.startswith("def f1"), r.stderr


def test_lora_targets_all_linear_wraps_more_than_the_default(base, tmp_path):
    pytest.importorskip("peft")
    model_dir, corpus = base
    counts = {}
    for targets in (None, ["q_proj", "v_proj"], "all-linear"):
        s = adapt(model_dir, data=[str(corpus)], out=tmp_path / str(targets), method="lora", lora_rank=2, max_steps=1,
                  overrides=TINY, progress=False, lora_targets=targets)
        counts[str(targets)] = s["trainable"]["base_trainable"]
    assert counts["None"] == counts[str(["q_proj", "v_proj"])] < counts["all-linear"]  # PEFT's Llama default is q/v


@pytest.mark.parametrize("method", ["lora", "lora+engram", "full"])
def test_other_methods_train_and_load(base, tmp_path, method, capsys):
    if "lora" in method:
        pytest.importorskip("peft")
    model_dir, corpus = base
    s = adapt(model_dir, data=[str(corpus)], out=tmp_path / "r", method=method, lora_rank=2, max_steps=6,
              overrides=TINY, engram_options=ENGRAM, progress=False) if method != "full" else \
        adapt(model_dir, data=[str(corpus)], out=tmp_path / "r", method=method, max_steps=6, overrides=TINY,
              progress=False)
    c = s["trainable"]
    assert (c["base_trainable"] > 0) and ((c["engram_table"] > 0) == ("engram" in method))
    from engram.verify import verify_path

    assert all(status == "ok" for _, status, _ in verify_path(tmp_path / "r"))  # every final carries checksums
    if method == "full":
        args = ["--base", str(tmp_path / "r" / "final")]
    else:
        args = ["--base", str(model_dir), "--adapter", str(tmp_path / "r")]
    code, out, err = cli(capsys, "eval", *args, "--data", corpus, "--seq-len", "32", "--max-windows", "4")
    assert code == 0 and f"val loss {s['val_loss']:.4f}" in out, err


def test_adapt_bad_input_is_one_line(base, tmp_path, capsys):
    model_dir, corpus = base
    r = run_cli("adapt", "--base", str(tmp_path), "--out", str(tmp_path / "o"), "--data", str(corpus))
    assert r.returncode == 2 and "no model here" in r.stderr and "Traceback" not in r.stderr, r.stderr
    for args, msg in (
        (["--base", str(tmp_path), "--out", str(tmp_path / "o")], "no model here"),
        (["--base", str(model_dir), "--out", str(tmp_path / "o"), "--layers", "7"], "out of range"),
        (["--base", str(model_dir), "--out", str(tmp_path / "o"), "--engram", "bogus=1"], "--engram bogus=1"),
        (["--base", str(model_dir), "--out", str(tmp_path / "o"), "--method", "full", "--lora-rank", "4"], "full"),
        (["--base", str(model_dir), "--out", str(tmp_path / "o"), "--method", "engram", "--lora-targets", "all-linear"],
         "--lora-targets needs LoRA"),
    ):
        code, _, err = cli(capsys, "adapt", *args, "--data", corpus, "--max-steps", "2")
        errors = [line for line in err.splitlines() if line.startswith("engram: error:")]
        assert code == 2 and len(errors) == 1 and msg in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()  # refused before the run directory was made
