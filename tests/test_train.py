import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.integration  # (trains models or starts servers: tests/conftest.py)

pytest.importorskip("transformers")

from conftest import run_cli  # noqa: E402

from engram.config import ConfigError  # noqa: E402
from engram.training.checkpoint import CheckpointError, read_checkpoint  # noqa: E402
from engram.training.corpora import DataError, local_documents, strip_gutenberg  # noqa: E402
from engram.training.data import Batcher, load_manifest, prepare, split_documents  # noqa: E402
from engram.training.optim import LazyRowAdam, warmup_cosine  # noqa: E402
from engram.training.train import train  # noqa: E402

WORDS = ("the king queen horse great alexander tame could only bucephalus denmark prince ghost father "
         "mother sword crown night day love death").split()


def make_corpus(folder: Path, n_docs=4, words=3000, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS, size=words))
        (folder / f"doc{i}.txt").write_text(text + "\n")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


# ---------------------------------------------------------------------------- optimizer
@pytest.mark.parametrize("fused", [True, False])  # numba kernel in place / torch gather-update-scatter
def test_lazy_row_adam_matches_sparse_adam(fused):
    if fused:
        pytest.importorskip("numba")
    torch.manual_seed(0)
    W = torch.randn(64, 8)
    a, b = torch.nn.Parameter(W.clone()), torch.nn.Parameter(W.clone())
    oa = LazyRowAdam([a], lr=0.05, betas=(0.9, 0.95), fused=fused)
    ob = torch.optim.SparseAdam([b], lr=0.05, betas=(0.9, 0.95))
    for s in range(8):
        idx = torch.randint(0, 16 + 4 * s, (40,))  # overlapping, repeated rows
        g = torch.sparse_coo_tensor(idx[None], torch.randn(40, 8), (64, 8))
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
        assert torch.allclose(a, b, atol=1e-6)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[: 16 + 4 * 7] = False
    assert torch.equal(a[untouched], W[untouched])


def test_schedule_warmup_then_cosine():
    vals = [warmup_cosine(s, 100, 10, 0.1) for s in range(100)]
    assert vals[0] == pytest.approx(0.1) and vals[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in zip(vals[10:], vals[11:])) and vals[-1] >= 0.1


# ---------------------------------------------------------------------------- data
def test_strip_gutenberg():
    t = ("header\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nbody text\n"
         "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicense")
    assert strip_gutenberg(t) == "body text\n"
    assert strip_gutenberg("plain\n") == "plain\n"


def test_splits_are_disjoint_by_document(corpus):
    docs = local_documents(corpus)
    s = split_documents(docs)
    names = [set(d.name for d in s[k]) for k in ("train", "val", "test")]
    assert all(names) and not (names[0] & names[1]) and not (names[0] & names[2]) and not (names[1] & names[2])
    assert sum(map(len, names)) == len(docs)


def test_single_file_splits_into_contiguous_blocks(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("\n".join(f"line {i}" for i in range(1000)))
    s = split_documents(local_documents(f))
    assert s["train"][0].text + s["val"][0].text == f.read_text()
    assert "line 999" in s["val"][0].text and "line 999" not in s["train"][0].text


def test_jsonl_and_bad_data(tmp_path):
    j = tmp_path / "d.jsonl"
    j.write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"text": "world"}) + "\n")
    assert [d.text for d in local_documents(j)] == ["hello", "world"]
    with pytest.raises(DataError, match="no such file"):
        local_documents(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="no text found"):
        local_documents(tmp_path / "empty.txt")
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(DataError, match="not valid JSON"):
        local_documents(tmp_path / "bad.jsonl")


def test_prepare_writes_uint32_tokens_and_manifest(corpus, tmp_path):
    d = prepare([str(corpus)], "bpe:300", out_root=tmp_path, progress=False)
    m = load_manifest(d)
    assert m["vocab_size"] == 300 and m["pad_id"] == 1
    train_tokens = np.fromfile(d / "train.bin", dtype=np.uint32)
    assert train_tokens.size == m["splits"]["train"]["tokens"] > 0 and train_tokens.max() < 300
    assert prepare([str(corpus)], "bpe:300", out_root=tmp_path, progress=False) == d  # cached


def test_save_final_names_engrams_eos_for_transformers_and_vllm(corpus, tmp_path):
    """RUN/final carries tokenizer_config.json (EOS = the id `prepare` ends documents with; no chat template) and
    generation_config.json's eos_token_id: transformers, vLLM and engram's own decoding all stop there."""
    from transformers import AutoTokenizer

    from engram.inference import chat_template_of
    from engram.model import EngramForCausalLM, load_model
    from engram.persist import verify_manifest
    from engram.training import presets
    from engram.training.train import save_final

    m = load_manifest(prepare([str(corpus)], "bpe:300", out_root=tmp_path, progress=False))
    assert m["eos_id"] == 0
    model = EngramForCausalLM(presets.model_for("tiny", m["vocab_size"], m["pad_id"], m["tokenizer_file"]))
    final = save_final(model, tmp_path / "run", m)
    verify_manifest(final)  # the checksum manifest covers the new file
    cfg = json.loads((final / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>" and cfg["pad_token"] == "<|pad|>" and "bos_token" not in cfg
    assert chat_template_of(final) is None  # `engram serve` keeps its --chat-template rules
    tok = AutoTokenizer.from_pretrained(final)
    assert (tok.eos_token_id, tok.pad_token_id) == (m["eos_id"], m["pad_id"])
    assert tok("the king")["input_ids"] == load_model(final)[1].encode("the king").ids  # no BOS/EOS added
    assert load_model(final)[0].generation_config.eos_token_id == m["eos_id"]


def test_tokenizer_files_name_no_eos_where_the_tokenizer_has_none(tmp_path):
    """A tokenizer without an end-of-text token: `prepare` still ends documents with id 0, but the saved folder
    names no EOS (an ordinary token 0 must not end generation); a special id 0 is named."""
    from tokenizers import Tokenizer, models

    from engram.tokenizer import write_tokenizer_files

    for special, eos in ((False, None), (True, 0)):
        tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
        if special:
            tok.add_special_tokens(["a"])
        tok.save(str(tmp_path / "t.json"))
        (tmp_path / str(special)).mkdir()
        assert write_tokenizer_files(tmp_path / str(special), tmp_path / "t.json", 1) == eos
        cfg = json.loads((tmp_path / str(special) / "tokenizer_config.json").read_text())
        assert cfg.get("eos_token") == (None if eos is None else "a") and cfg["pad_token"] == "b"


def test_batcher_resume_and_prefetch_give_same_batches():
    tokens = np.arange(10_000, dtype=np.uint32)
    a = Batcher(tokens, 16, 4, seed=3, prefetch=True)
    seq = [a.next()[0] for _ in range(30)]
    b = Batcher(tokens, 16, 4, seed=3, prefetch=False)
    for i in range(12):
        assert torch.equal(b.next()[0], seq[i])
    c = Batcher(tokens, 16, 4, seed=3, prefetch=True)
    for _ in range(12):
        c.next()
    d = Batcher(tokens, 16, 4, seed=3)
    d.load_state_dict(c.consumed_state())
    for i in range(12, 30):
        assert torch.equal(d.next()[0], seq[i])


# ---------------------------------------------------------------------------- trainer
def test_resume_reproduces_uninterrupted_run(corpus, tmp_path):
    full = train("tiny", data=[str(corpus)], out=tmp_path / "full", progress=False)
    assert full["val_loss"] is not None
    train("tiny", data=[str(corpus)], out=tmp_path / "cut", progress=False, stop_after=7)
    train("tiny", data=[str(corpus)], out=tmp_path / "cut", progress=False, resume=True)
    a = [json.loads(l) for l in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(l) for l in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(21))
    for x, y in zip(a, b):
        assert abs(x["train_loss"] - y["train_loss"]) < 1e-5
        assert ("val_loss" in x) == ("val_loss" in y)
    assert "val_loss" in a[0] and "val_loss" in a[-1]
    assert sum("val_loss" in r for r in a) >= 5  # before the first step, every 10%, at the end
    from transformers import AutoModelForCausalLM

    import engram  # noqa: F401

    m = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final")
    ids = torch.tensor([[5, 6, 7, 8]])
    assert m(ids).logits.shape == (1, 4, m.config.vocab_size)


def test_a_run_folder_of_the_old_spelling_resumes(corpus, tmp_path):
    """A run folder written before `table_backend` became `table_mode` (run.json's `"table_backend": "param"`)
    resumes under the new code: the resume check reads the old spelling as the new one (silently: it is the run's
    own file), still refuses another mode, and run.json is written again in the new spelling."""
    import warnings

    kw = dict(data=[str(corpus)], progress=False, max_steps=4)
    train("tiny", out=tmp_path / "run", stop_after=2, **kw)
    run_json = tmp_path / "run" / "run.json"
    info = json.loads(run_json.read_text())
    info["train"] = {("table_backend" if k == "table_mode" else k): ("param" if k == "table_mode" else v)
                     for k, v in info["train"].items()}
    assert info["train"]["table_backend"] == "param" and "table_mode" not in info["train"]
    run_json.write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="was trained with table_mode=ram; use the same setting"):
        train("tiny", out=tmp_path / "run", resume=True, overrides={"table_mode": "mmap"}, **kw)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        s = train("tiny", out=tmp_path / "run", resume=True, **kw)
    assert s["step"] == 4 and not s.get("interrupted")
    assert not [w for w in seen if "table_backend" in str(w.message) or "param" in str(w.message)]
    assert json.loads(run_json.read_text())["train"]["table_mode"] == "ram"
    assert "table_backend" not in json.loads(run_json.read_text())["train"]


def test_corrupt_checkpoint_falls_back_to_previous(corpus, tmp_path):
    run = tmp_path / "run"
    train("tiny", data=[str(corpus)], out=run, progress=False, stop_after=12)  # checkpoints at 5, 10, 12 (keep 2)
    cks = sorted((run / "checkpoints").glob("step_*"))
    assert [c.name for c in cks] == ["step_000010", "step_000012"]
    data = (cks[-1] / "model.safetensors").read_bytes()
    (cks[-1] / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncate the newest
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_checkpoint(cks[-1])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "train_lo')  # a line torn by a kill while appending
    s = train("tiny", data=[str(corpus)], out=run, progress=False, resume=True)
    assert s["step"] == 20
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(21))


def _losses(run):
    return [json.loads(l)["train_loss"] for l in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def _final_tensors(run):
    from safetensors.torch import load_file

    return load_file(str(Path(run) / "final" / "model.safetensors"))


def test_mmap_tables_train_like_parameters_and_survive_a_kill(corpus, tmp_path, monkeypatch):
    """Tables in memory-mapped files (moments beside the rows) follow the in-RAM trajectory; a crash in the
    middle of a table write is rolled back by the undo journal and --resume ends where an uninterrupted run ends."""
    from engram.tables import MmapTable

    kw = dict(data=[str(corpus)], progress=False, max_steps=8)
    train("tiny", out=tmp_path / "ref", overrides={"ckpt_every": 3}, **kw)
    mm = {"ckpt_every": 3, "table_mode": "mmap", "table_cache_mb": 0.01}
    train("tiny", out=tmp_path / "mmap", overrides=mm, **kw)
    assert _losses(tmp_path / "mmap") == pytest.approx(_losses(tmp_path / "ref"), abs=1e-6)

    calls = {"n": 0}
    original = MmapTable.begin_write

    def dying_write(self, rows):  # every table update starts here (journal), then writes the rows
        original(self, rows)
        calls["n"] += 1
        if calls["n"] == 5:  # step 5: rows journaled, half of them overwritten, then the process dies
            half = rows[: len(rows) // 2]
            self.weight.index_copy_(0, half, torch.full((len(half), self.dim), 9.0))
            raise RuntimeError("simulated kill during a table write")

    monkeypatch.setattr(MmapTable, "begin_write", dying_write)
    with pytest.raises(RuntimeError, match="simulated kill"):
        train("tiny", out=tmp_path / "crash", overrides=mm, **kw)
    monkeypatch.setattr(MmapTable, "begin_write", original)
    s = train("tiny", out=tmp_path / "crash", overrides=mm, resume=True, **kw)  # resumes at step 3
    assert s["step"] == 8
    assert _losses(tmp_path / "crash") == pytest.approx(_losses(tmp_path / "ref"), abs=1e-6)
    a, b = _final_tensors(tmp_path / "ref"), _final_tensors(tmp_path / "crash")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    with pytest.raises(ConfigError, match="trained with table_mode=mmap"):
        train("tiny", out=tmp_path / "crash", resume=True, overrides={"ckpt_every": 3}, **kw)
    (tmp_path / "crash" / "tables" / "engram_table_L1.safetensors").unlink()
    with pytest.raises(CheckpointError, match="table files missing"):
        train("tiny", out=tmp_path / "crash", resume=True, overrides=mm, **kw)


def test_file_initialized_tables_train_and_resume(corpus, tmp_path):
    """table_init=file: the tables are created as files (never in RAM); stop + resume equals an uninterrupted run."""
    kw = dict(data=[str(corpus)], progress=False, max_steps=6)
    mm = {"ckpt_every": 100, "table_mode": "mmap", "table_init": "file"}
    full = train("tiny", out=tmp_path / "full", overrides=mm, **kw)
    train("tiny", out=tmp_path / "cut", overrides=mm, stop_after=3, **kw)
    train("tiny", out=tmp_path / "cut", overrides=mm, resume=True, **kw)
    assert _losses(tmp_path / "cut") == pytest.approx(_losses(tmp_path / "full"), abs=1e-6)
    ref = train("tiny", out=tmp_path / "param", **kw)
    assert (full["params"], full["table_params"]) == (ref["params"], ref["table_params"])
    assert _losses(tmp_path / "full")[0] != _losses(tmp_path / "param")[0]  # other table init, same model size


@pytest.mark.slow  # a killed run and its resume: 28 s on the 2026-12-05 VM
def test_mmap_run_killed_with_sigkill_resumes_exactly(corpus, tmp_path):
    """A real `kill -9` of `engram train --table-mode mmap` at an arbitrary moment (after its first
    checkpoint): --resume rolls the table file back and ends with the uninterrupted run's losses."""
    import signal
    import time

    steps, mm = 40, {"ckpt_every": 4, "table_mode": "mmap"}
    train("tiny", data=[str(corpus)], out=tmp_path / "ref", progress=False, max_steps=steps, overrides=mm)
    args = [sys.executable, "-m", "engram.cli", "train", "--preset", "tiny", "--data", str(corpus), "--out", "run",
            "--max-steps", str(steps), "--set", "ckpt_every=4", "--table-mode", "mmap"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 120

    def logged():
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    while logged() < 11 and time.time() < deadline:  # step 10 logged: checkpoint 8 exists, step 11 running
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = [c.name for c in (tmp_path / "run" / "checkpoints").glob("step_*")]
    assert done and f"step_{steps:06d}" not in done, "the kill must land before the run ended"
    r = subprocess.run(args + ["--resume"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _losses(tmp_path / "run") == pytest.approx(_losses(tmp_path / "ref"), abs=1e-6)


def test_ctrl_c_finishes_the_step_then_checkpoints(corpus, tmp_path, monkeypatch):
    """One Ctrl-C: the step completes, a checkpoint is written, --resume continues exactly.
    Two Ctrl-C inside a step: abort without writing the half-updated weights."""
    import os
    import signal

    from engram.training.checkpoint import checkpoints
    from engram.training.optim import LazyRowAdam

    kw = dict(data=[str(corpus)], progress=False, max_steps=8, overrides={"ckpt_every": 100})
    found = signal.getsignal(signal.SIGINT)  # SIG_IGN when started from a background shell job, else Python's
    train("tiny", out=tmp_path / "ref", **kw)
    original = LazyRowAdam.step

    def press(at, times):
        calls = {"n": 0}

        def step(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == at:
                for _ in range(times):
                    os.kill(os.getpid(), signal.SIGINT)
            return original(self, *a, **k)
        monkeypatch.setattr(LazyRowAdam, "step", step)

    press(4, 1)
    s = train("tiny", out=tmp_path / "run", **kw)
    assert s.get("interrupted") and s["step"] == 4
    assert [c.name for c in checkpoints(tmp_path / "run")] == ["step_000004"]
    monkeypatch.setattr(LazyRowAdam, "step", original)
    train("tiny", out=tmp_path / "run", resume=True, **kw)
    assert _losses(tmp_path / "run") == pytest.approx(_losses(tmp_path / "ref"), abs=1e-6)

    press(3, 2)
    s = train("tiny", out=tmp_path / "abort", **kw)
    assert s.get("interrupted") and s["step"] == 2 and checkpoints(tmp_path / "abort") == []
    assert signal.getsignal(signal.SIGINT) is found  # the handler found before the run is restored


def _spawned_train(rank, world, port, out, corpus, stop_after, resume, dense, model_overrides=None, extra=None):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    train("tiny", data=[corpus], out=out, progress=False, max_steps=6, stop_after=stop_after, resume=resume,
          overrides={"ckpt_every": 100, "dense_parallel": dense, **(extra or {})}, model_overrides=model_overrides)


@pytest.mark.slow  # (30 s; test_distributed's two-rank test keeps sharded training in the default run)
def test_memory_mapped_table_shards_train_and_resume_like_one_process(corpus, tmp_path, free_port):
    """--nproc 2 with table_mode=mmap: each rank's rows and moments in its own journaled file; the run and a
    stopped-then-resumed run follow the single-process losses; another world size is refused on resume."""
    import torch.multiprocessing as mp

    mm = {"table_mode": "mmap", "table_cache_mb": 0.01}
    train("tiny", data=[str(corpus)], out=tmp_path / "ref", progress=False, max_steps=6, overrides={"ckpt_every": 100})
    for out, stop_after, resume in (("full", None, False), ("cut", 3, False), ("cut", None, True)):
        mp.spawn(_spawned_train, args=(2, free_port(), str(tmp_path / out), str(corpus), stop_after, resume, "ddp",
                                       None, mm), nprocs=2, join=True)
    files = sorted(f.name for f in (tmp_path / "full" / "tables").glob("*.safetensors"))
    assert files == ["engram_table_L1.rank0-of-2.safetensors", "engram_table_L1.rank1-of-2.safetensors"]
    for out in ("full", "cut"):
        assert _losses(tmp_path / out) == pytest.approx(_losses(tmp_path / "ref"), abs=1e-4)
    a, b = _final_tensors(tmp_path / "ref"), _final_tensors(tmp_path / "cut")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-3
    with pytest.raises(CheckpointError, match="table files missing"):  # the shard files belong to --nproc 2
        train("tiny", data=[str(corpus)], out=tmp_path / "cut", progress=False, max_steps=8, resume=True,
              overrides={"ckpt_every": 100, **mm})


@pytest.mark.parametrize("dense", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])  # (fsdp2: 20 s, -m slow)
def test_moe_balancing_under_data_parallelism_matches_one_process(corpus, tmp_path, free_port, dense):
    """The loss-free balancing bias follows the global expert load (summed over ranks), as in one process."""
    import torch.multiprocessing as mp

    moe = {"ffn": "moe", "n_routed_experts": 4, "num_experts_per_tok": 2}
    train("tiny", data=[str(corpus)], out=tmp_path / "one", progress=False, max_steps=6,
          overrides={"ckpt_every": 100}, model_overrides=moe)
    mp.spawn(_spawned_train, args=(2, free_port(), str(tmp_path / "two"), str(corpus), None, False, dense, moe),
             nprocs=2, join=True)
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), abs=1e-4)


@pytest.mark.parametrize("first,then", [((2, "ddp"), (1, "ddp")),
                                        pytest.param((1, "ddp"), (2, "fsdp2"), marks=pytest.mark.slow),  # (18 s)
                                        pytest.param((2, "fsdp2"), (2, "ddp"), marks=pytest.mark.slow)])
def test_sharded_checkpoints_resume_at_another_world_size(corpus, tmp_path, free_port, first, then):
    """Stop a run at step 3 with one world size / dense wrapper, resume it with another: same losses as an
    uninterrupted single-process run.

    (Weights agree to 1e-3: data parallelism averages per-rank gradients, a different float summation
    that Adam amplifies on near-zero gradients such as the mHC alphas.)
    """
    import torch.multiprocessing as mp

    ref = tmp_path / "ref"
    train("tiny", data=[str(corpus)], out=ref, progress=False, max_steps=6, overrides={"ckpt_every": 100})
    run = tmp_path / "run"
    for (world, dense), stop_after, resume in ((first, 3, False), (then, None, True)):
        if world == 1:
            train("tiny", data=[str(corpus)], out=run, progress=False, max_steps=6, stop_after=stop_after,
                  resume=resume, overrides={"ckpt_every": 100})
        else:
            mp.spawn(_spawned_train, args=(world, free_port(), str(run), str(corpus), stop_after, resume, dense),
                     nprocs=world, join=True)
        if world == 2 and stop_after:  # the sharded layout: one file per rank and table, with row ranges
            ck = run / "checkpoints" / "step_000003"
            assert len(list(ck.glob("tables/*/shard_*.safetensors"))) == 2
    assert _losses(run) == pytest.approx(_losses(ref), abs=1e-4)
    a, b = _final_tensors(ref), _final_tensors(run)
    diffs = {k: (a[k] - b[k]).abs().max().item() for k in a}
    assert max(diffs.values()) < 1e-3, sorted(diffs.items(), key=lambda kv: -kv[1])[:4]


def test_no_engram_and_iso_param_baselines(corpus, tmp_path):
    from engram.training import presets
    from engram.training.data import load_manifest

    m = load_manifest(prepare([str(corpus)], "bpe:512", progress=False))
    eng = presets.model_for("tiny", m["vocab_size"], m["pad_id"], m["tokenizer_file"])
    flop = presets.model_for("tiny", m["vocab_size"], m["pad_id"], m["tokenizer_file"], use_engram=False)
    par = presets.model_for("tiny", m["vocab_size"], m["pad_id"], m["tokenizer_file"], baseline="iso-param")
    from engram.model import EngramForCausalLM

    n = [sum(p.numel() for p in EngramForCausalLM(c).parameters()) for c in (eng, flop, par)]
    assert n[1] < n[0] and abs(n[2] - n[0]) / n[0] < 0.02  # iso-param within 2%
    assert not flop.use_engram and not par.use_engram and par.intermediate_size > eng.intermediate_size




@pytest.mark.slow  # out of the default run (under 10 min on 2 cores): 33 s; train/eval/sample: test_analysis
def test_cli_train_eval_sample_and_errors(corpus, tmp_path, monkeypatch, capsys):
    """Train, eval and sample as a user runs them (fresh interpreters); the error cases in-process (same main())."""
    from engram.cli import main

    r = run_cli("train", "--preset", "tiny", "--data", str(corpus), "--out", "run", "--max-steps", "6", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    r = run_cli("eval", "--checkpoint", "run", "--data", str(corpus), "--seq-len", "32", cwd=tmp_path)
    assert r.returncode == 0 and "perplexity" in r.stdout, r.stderr
    r = run_cli("sample", "--checkpoint", "run", "--prompt", "the king", "--max-new-tokens", "5", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("the king"), r.stderr
    for args, msg in [
        (("train", "--preset", "tiny", "--data", "missing.txt", "--out", "x"), "no such file"),
        (("train", "--preset", "tiny", "--data", str(corpus), "--out", "run"), "already holds a run"),
        (("train", "--preset", "nope", "--out", "y"), "unknown preset"),
        (("eval", "--checkpoint", "nowhere"), "no model here"),
        (("train", "--preset", "tiny", "--data", str(corpus), "--out", "z", "--set", "bogus=1"),
         "unknown training setting"),
        (("train", "--preset", "tiny", "--data", str(corpus), "--out", "z", "--nproc", "3"), "does not divide"),
        (("train", "--preset", "tiny", "--data", str(corpus), "--out", "z", "--nproc", "0"), "at least 1"),
        (("train", "--preset", "tiny", "--data", str(corpus), "--out", "z", "--set", "lr=abc"), "expected a float"),
        (("train", "--preset", "tiny", "--data", str(corpus), "--out", "z", "--set", "table_init=file"),
         "needs table_mode"),
    ]:
        monkeypatch.chdir(tmp_path)
        code = main(list(args))
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and msg in err, (args, err)
    (tmp_path / "empty.txt").write_text("")
    assert main(["train", "--preset", "tiny", "--data", "empty.txt", "--out", "e"]) == 2
    assert "no text found" in capsys.readouterr().err


def test_prepare_tokenizes_a_local_corpus_again_when_it_changes(tmp_path):
    """The prepared-data cache is keyed by the local files' size and mtime too: an edited corpus is not served
    stale (it was keyed by the path string alone)."""
    import os

    from engram.training.data import load_split, prepare

    corpus = tmp_path / "c.txt"
    corpus.write_text("first version of the corpus. " * 200 + "\n\nanother document here. " * 50)
    a = prepare([str(corpus)], "deepseek", out_root=tmp_path / "data", progress=False)
    assert prepare([str(corpus)], "deepseek", out_root=tmp_path / "data", progress=False) == a  # unchanged: cached
    corpus.write_text("a second, different text that is longer. " * 300 + "\n\nand more of it. " * 60)
    os.utime(corpus, ns=(corpus.stat().st_atime_ns, corpus.stat().st_mtime_ns + 10**9))
    b = prepare([str(corpus)], "deepseek", out_root=tmp_path / "data", progress=False)
    assert b != a and len(load_split(b, "train")) != len(load_split(a, "train"))
