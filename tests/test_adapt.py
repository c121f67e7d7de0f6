"""`engram adapt` (engram.training.adapt): adapter runs on a tiny saved Llama, resume, eval/sample with --base
--adapter."""

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.integration  # (trains models or starts servers: tests/conftest.py)

pytest.importorskip("transformers")

from bases import tale_tokenizer, tiny_base  # noqa: E402
from conftest import run_cli  # noqa: E402

from engram.training.adapt import adapt  # noqa: E402

TINY = {"seq_len": 32, "batch_size": 4, "ckpt_every": 4, "eval_max_windows": 4, "eval_every": 4, "warmup_steps": 2,
        "lr": 1e-2}
ENGRAM = {"engram_vocab_size": [211, 223], "n_embed_per_ngram": 16, "n_head_per_ngram": 2}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A saved tiny Llama with its tokenizer.json, and a small corpus of another kind."""
    root = tmp_path_factory.mktemp("adapt")
    tok = tale_tokenizer(root / "tok" / "tokenizer.json")
    tiny_base("llama").save_pretrained(root / "base")
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


@pytest.mark.parametrize("mode", ["ram", "mmap"])
def test_interrupted_adapt_resumes_exactly(base, tmp_path, mode):
    model_dir, corpus = base
    kw = dict(data=[str(corpus)], max_steps=10, overrides={**TINY, "table_mode": mode}, engram_options=ENGRAM,
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


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 11 s; adapt then eval in test_hub_ids
def test_adapter_run_loads_for_eval_and_sample(base, tmp_path, capsys):
    model_dir, corpus = base
    s = adapt(model_dir, data=[str(corpus)], out=tmp_path / "r", max_steps=8, overrides=TINY, engram_options=ENGRAM,
              progress=False)
    code, out, err = cli(capsys, "eval", "--base", model_dir, "--adapter", tmp_path / "r", "--data", corpus,
                         "--seq-len", "32", "--max-windows", "4")
    assert code == 0 and f"val loss {s['val_loss']:.4f}" in out, err  # the same windows give the training loss
    # the adapter's tables served from files: the same loss (the rows are the same float32 values)
    code, out, err = cli(capsys, "eval", "--base", model_dir, "--adapter", tmp_path / "r", "--data", corpus,
                         "--seq-len", "32", "--max-windows", "4", "--table-backend", "mmap", "--table-dir",
                         tmp_path / "tables")
    assert code == 0 and f"val loss {s['val_loss']:.4f}" in out, err
    assert list((tmp_path / "tables").glob("engram_table_L*.safetensors"))
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
    if method == "lora+engram":  # lora/ holds PEFT's files only, not a second copy of the Engram tables
        assert not list((tmp_path / "r" / "final" / "lora").glob("engram_*"))
    from engram.cli.verify import verify_path

    assert all(status == "ok" for _, status, _ in verify_path(tmp_path / "r"))  # every final carries checksums
    if method == "full":
        args = ["--base", str(tmp_path / "r" / "final")]
    else:
        args = ["--base", str(model_dir), "--adapter", str(tmp_path / "r")]
    code, out, err = cli(capsys, "eval", *args, "--data", corpus, "--seq-len", "32", "--max-windows", "4")
    assert code == 0 and f"val loss {s['val_loss']:.4f}" in out, err


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 9 s
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


# ------------------------------------------------------------------ table options: adapt honours every one train does
def _spy_tables(monkeypatch):
    """Record the rows the table read-ahead touches and the rows training lookups read, per table file."""
    from engram.tables import MmapTable

    touched, looked = {}, {}
    touch, lookup = MmapTable.touch, MmapTable.lookup

    def spy_touch(self, rows):
        touched.setdefault(self.path.name, []).append(set(rows.tolist()))
        return touch(self, rows)

    def spy_lookup(self, rows, out=None):
        looked.setdefault(self.path.name, set()).update(rows.reshape(-1).tolist())
        return lookup(self, rows, out)

    monkeypatch.setattr(MmapTable, "touch", spy_touch)
    monkeypatch.setattr(MmapTable, "lookup", spy_lookup)
    return touched, looked


@pytest.mark.parametrize("readahead", [True, False])
def test_adapt_table_readahead_pages_in_the_rows_the_step_reads(base, tmp_path, monkeypatch, readahead):
    """`table_readahead` (on by default): the batcher hashes the next batch on its thread and the adapter's table
    files page those rows in ahead of the step, as in `engram train`; off: no read-ahead. The losses are the same."""
    model_dir, corpus = base
    touched, looked = _spy_tables(monkeypatch)
    over = {**TINY, "table_mode": "mmap", "table_readahead": readahead}
    s = adapt(model_dir, data=[str(corpus)], out=tmp_path / "r", max_steps=4, overrides=over, engram_options=ENGRAM,
              progress=False)
    assert s["step"] == 4 and looked
    if not readahead:
        assert touched == {}
        return
    assert set(touched) == set(looked) == {"engram_table_L1.safetensors"}
    calls = touched["engram_table_L1.safetensors"]
    assert len(calls) == 4 + 1  # every training batch, and the one after the last (prefetched, never used)
    assert calls[0] <= looked["engram_table_L1.safetensors"]  # the rows read ahead are those the adapter reads
    monkeypatch.undo()
    off = adapt(model_dir, data=[str(corpus)], out=tmp_path / "off", max_steps=4, engram_options=ENGRAM,
                overrides={**over, "table_readahead": False}, progress=False)
    assert _losses(tmp_path / "off") == _losses(tmp_path / "r") and off["val_loss"] == s["val_loss"]


def test_adapt_table_init_file_creates_the_tables_from_the_seed(base, tmp_path):
    """`table_init=file`: the adapter's tables are created as files from `seed + layer` (never in RAM), as in
    `engram train`, not written from rows drawn in RAM."""
    from safetensors import safe_open

    from engram.tables import create_table_file

    model_dir, corpus = base
    kw = dict(data=[str(corpus)], max_steps=4, engram_options={**ENGRAM, "table_init_std": 0.5}, progress=False,
              stop_after=0)
    rows = {}
    for init in ("file", "model"):
        s = adapt(model_dir, out=tmp_path / init, overrides={**TINY, "table_mode": "mmap", "table_init": init,
                                                             "seed": 3}, **kw)
        assert s["interrupted"] and s["step"] == 0  # stopped before the first update: the files hold the init
        with safe_open(str(tmp_path / init / "tables" / "engram_table_L1.safetensors"), "pt") as f:
            rows[init] = f.get_tensor("weight")
    ref = create_table_file(tmp_path / "ref.safetensors", *rows["file"].shape, seed=3 + 1, std=0.5)  # layer 1
    with safe_open(str(ref), "pt") as f:
        assert torch.equal(rows["file"], f.get_tensor("weight"))
    assert not torch.equal(rows["model"], rows["file"])


def test_edit_ready_adapter_is_the_base_until_an_edit_writes_rows(base, tmp_path, capsys):
    """`engram adapt --edit-ready` saves the trained adapter with its rows cleared: loaded on its base, the logits are
    the base's exactly, its card says so, and an edit then moves a fact's target (the trained projections carry
    the rows' values). A method without Engram is refused in one line."""
    from transformers import AutoModelForCausalLM

    from engram.editing import Fact, apply_overlay, edit_facts
    from engram.inference import load_with_adapter

    model_dir, corpus = base
    code, out, err = cli(capsys, "adapt", "--base", model_dir, "--data", corpus, "--out", tmp_path / "r",
                         "--max-steps", "6", "--edit-ready", "--engram", "engram_vocab_size=[211,223]",
                         "--engram", "n_embed_per_ngram=16", "--engram", "n_head_per_ngram=2",
                         *[x for k, v in TINY.items() for x in ("--set", f"{k}={v}")])
    assert code == 0 and "edit-ready" in out, err
    assert "edit_ready" in (tmp_path / "r" / "final" / "README.md").read_text()
    model, tok = load_with_adapter(model_dir, tmp_path / "r" / "final")
    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([tok.encode("def f3(x):\n    return x", add_special_tokens=False).ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)
    fact = Fact("def f3(x):\n    return x", " * 5")
    overlay = edit_facts(model, tok, [fact], steps=20, lr=0.3, progress=False)
    p, t = (tok.encode(x, add_special_tokens=False).ids for x in (fact.prompt, fact.target))
    seq = torch.tensor([p + t])

    def target_lp():
        with torch.no_grad():
            lp = torch.log_softmax(model(seq).logits[0].float(), -1)
        return sum(float(lp[len(p) - 1 + j, t[j]]) for j in range(len(t)))

    before = target_lp()
    apply_overlay(model, overlay)
    assert target_lp() > before + 0.5
    code, out, err = cli(capsys, "adapt", "--base", model_dir, "--out", tmp_path / "l", "--method", "lora",
                         "--edit-ready", "--max-steps", "1")
    assert code != 0 and "--edit-ready" in err and "Traceback" not in err
