"""Engram adapters under transformers.Trainer, TRL's SFTTrainer and DDP (engram.training.hf), on a tiny random Llama."""

import os

import pytest
import torch

pytest.importorskip("transformers")

from bases import tale_tokenizer, tiny_base  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import engram  # noqa: E402
from engram.adapters import adapter_of, from_pretrained  # noqa: E402

OPTS = dict(engram_vocab_size=[211, 223], n_embed_per_ngram=16, n_head_per_ngram=2)
VOCAB = 400


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tale_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", VOCAB)


def base(seed=0):
    return tiny_base("llama", vocab=VOCAB, seed=seed)


def attached(tok, seed=0):
    """The base (always seed 0) with an adapter on both layers; `seed` draws the adapter's init."""
    m = base()
    torch.manual_seed(seed)
    return engram.attach(m, [0, 1], tokenizer=str(tok), verbose=False, **OPTS)


def dataset(n=32, seq=16):
    ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids]


def trainer(model, out, steps=4, bs=4, ga=1, save_steps=500, callbacks=None, **kw) -> Trainer:
    """A Trainer with default arguments (max_grad_norm=1.0, linear schedule, AdamW betas) except the run length,
    batch and LR, and the one engram argument: optimizers=engram.hf_optimizers(model, args)."""
    args = TrainingArguments(str(out), per_device_train_batch_size=bs, gradient_accumulation_steps=ga, max_steps=steps,
                             learning_rate=1e-2, save_steps=save_steps, logging_steps=1, report_to=[], use_cpu=True,
                             disable_tqdm=True, **kw)
    return Trainer(model=model, args=args, train_dataset=dataset(), callbacks=callbacks,
                   optimizers=engram.hf_optimizers(model, args))


def trained(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def history(tr, key="loss") -> list:
    return [h[key] for h in tr.state.log_history if key in h and "train_runtime" not in h]


def perturbed(tok):
    """An attached model whose value rows are non-zero, so the tables get non-zero gradients from the first step."""
    m = attached(tok)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_of(m).parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return m


# ---------------------------------------------------------------------------------------------- clipping
def test_clipping_counts_the_table_rows_read_as_a_dense_model_would(tok):
    """clip_grad_norm_(model.parameters()) as Trainer calls it: the global norm of the dense-equivalent gradients
    (the tables' summed looked-up rows included), every gradient scaled by the same factor."""
    m = perturbed(tok)
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(2))
    m(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    sparse = [n for n, g in grads.items() if g.is_sparse]
    assert len(sparse) == 2 and all(not grads[n].is_coalesced() for n in sparse)  # one entry per lookup
    dense_eq = {n: g.to_dense().clone() for n, g in grads.items()}
    want = torch.sqrt(sum((g.double() ** 2).sum() for g in dense_eq.values()))
    table_part = torch.sqrt(sum((dense_eq[n].double() ** 2).sum() for n in sparse))
    assert table_part > 0.05 * want  # the rows weigh in the norm
    total = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.1)
    assert torch.allclose(total.double(), want, rtol=1e-5)
    coef = 0.1 / (want + 1e-6)
    for n, p in m.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad.to_dense(), (dense_eq[n] * coef).float(), rtol=1e-5, atol=1e-8)


def test_trainer_with_default_arguments_trains_the_adapter_only(tok, tmp_path):
    m = attached(tok)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    tr = trainer(m, tmp_path / "out")
    assert tr.args.max_grad_norm == 1.0  # clipping on (Trainer's default)
    tr.train()
    norms = history(tr, "grad_norm")
    assert len(norms) == 4 and all(torch.isfinite(torch.tensor(norms)))
    assert any(n > 1.0 for n in norms)  # some steps were clipped
    moved = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert all("engram_adapter" in n for n in moved)  # the base never moves
    assert {n for n in before if "multi_head_embedding" in n or "kv_proj" in n} <= moved  # rows and values train


def test_hf_optimizers_uses_the_arguments_and_refuses_what_it_cannot_train(tok, tmp_path):
    m = attached(tok)
    args = TrainingArguments(str(tmp_path), learning_rate=2e-3, weight_decay=0.1, adam_beta2=0.95, report_to=[])
    opt, sched = engram.hf_optimizers(m, args, table_lr_mult=4.0)
    assert sched is None
    rows = [g for g in opt.param_groups if g.get("rows")]
    assert opt.param_groups[0]["lr"] == 2e-3 and opt.param_groups[0]["weight_decay"] == 0.1
    assert len(rows) == 1 and rows[0]["lr"] == pytest.approx(8e-3) and rows[0]["weight_decay"] == 0.0
    assert all(g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    with pytest.raises(engram.AdapterError, match="no trainable parameters"):
        engram.hf_optimizers(base().requires_grad_(False), args)
    from engram.tables import offload_tables

    offload_tables(m, "mmap", tmp_path / "tables", trainable=True)
    with pytest.raises(engram.AdapterError, match="keep their own rows"):
        engram.hf_optimizers(m, args)


# ---------------------------------------------------------------------------------------------- accumulation
def test_gradient_accumulation_2_equals_one_batch_twice_the_size(tok, tmp_path):
    one = attached(tok)
    t1 = trainer(one, tmp_path / "one", bs=4, ga=1)
    t1.train()
    acc = attached(tok)
    t2 = trainer(acc, tmp_path / "acc", bs=2, ga=2)
    t2.train()
    assert history(t1) == pytest.approx(history(t2), rel=1e-5)
    assert history(t1, "grad_norm") == pytest.approx(history(t2, "grad_norm"), rel=1e-4)  # clipped alike
    w1, w2 = trained(one), trained(acc)
    for n in w1:  # (Adam divides by sqrt(v): where a row's gradient is ~0, rounding moves it by ~1e-5)
        torch.testing.assert_close(w2[n], w1[n], rtol=1e-4, atol=5e-5)


# ---------------------------------------------------------------------------------------------- checkpoints
class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True


def test_a_trainer_checkpoint_resumes_exactly(tok, tmp_path):
    full = attached(tok)
    t_full = trainer(full, tmp_path / "full", steps=6)
    t_full.train()
    first = attached(tok)
    trainer(first, tmp_path / "run", steps=6, save_steps=3, callbacks=[_StopAt(3)]).train()  # interrupted at 3
    ck = tmp_path / "run" / "checkpoint-3"
    from safetensors import safe_open

    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:  # the adapter, not a copy of the base
        assert set(f.keys()) == {n for n, p in first.named_parameters() if p.requires_grad}
    assert (ck / "engram_manifest.json").is_file() and (ck / "optimizer.pt").is_file()
    again = attached(tok, seed=5)  # another init: the checkpoint's weights must replace it
    t_res = trainer(again, tmp_path / "run", steps=6, save_steps=3)
    t_res.train(resume_from_checkpoint=str(ck))
    assert len(history(t_res)) == 6  # steps 1-3 from the checkpoint's trainer_state.json, 4-6 trained here
    assert history(t_res)[3:] == history(t_full)[3:]  # the loss curve continues exactly
    assert history(t_res, "grad_norm")[3:] == history(t_full, "grad_norm")[3:]
    w_full, w_res = trained(full), trained(again)
    assert all(torch.equal(w_full[n], w_res[n]) for n in w_full)


def test_save_model_writes_the_adapter_that_load_adapter_reads(tok, tmp_path):
    m = attached(tok)
    tr = trainer(m, tmp_path / "out", steps=3)
    tr.train()
    out = tmp_path / "out"  # Trainer's output_dir: the adapter goes beside the checkpoints, which stay
    tr.save_model()
    assert (out / "engram_adapter.json").is_file() and (out / "checkpoint-3").is_dir()
    assert not (out / "config.json").exists()  # no copy of the base
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = m(input_ids=ids).logits
    for load in (engram.load_adapter, from_pretrained):
        got_model = load(base(), out)
        with torch.no_grad():
            assert torch.equal(got_model(input_ids=ids).logits, want)
    # the folder of save_adapter and that of save_pretrained hold the same adapter
    engram.save_adapter(m, tmp_path / "classic")
    with torch.no_grad():
        assert torch.equal(engram.load_adapter(base(), tmp_path / "classic")(input_ids=ids).logits, want)
    # detached: save_pretrained is the base's own again
    engram.detach(m)
    m.save_pretrained(tmp_path / "base")
    assert (tmp_path / "base" / "config.json").is_file()


def test_lora_and_engram_under_trainer_save_resume_and_load_together(tok, tmp_path):
    """A PEFT model around an attached base (engram.adapters.add_lora): Trainer's checkpoints and save_model hold
    LoRA and Engram together; resuming restores both exactly; load_adapter gives the same model back."""
    pytest.importorskip("peft")
    from engram.adapters import add_lora

    def lora_model(seed=0):
        torch.manual_seed(100 + seed)  # (LoRA's A init; its B starts at zero)
        return add_lora(perturbed(tok) if seed == 0 else attached(tok, seed=seed), rank=2)

    full = lora_model()
    t_full = trainer(full, tmp_path / "full", steps=6)
    t_full.train()
    first = lora_model()
    trainer(first, tmp_path / "run", steps=6, save_steps=3, callbacks=[_StopAt(3)]).train()
    ck = tmp_path / "run" / "checkpoint-3"
    assert (ck / "adapter_model.safetensors").is_file() and (ck / "engram_adapter.json").is_file()
    again = lora_model(seed=5)  # other Engram and LoRA inits: the checkpoint must replace both
    t_res = trainer(again, tmp_path / "run", steps=6, save_steps=3)
    t_res.train(resume_from_checkpoint=str(ck))
    assert history(t_res)[3:] == history(t_full)[3:]
    w_full, w_res = trained(full), trained(again)
    assert any("lora_" in n for n in w_full) and any("engram_adapter" in n for n in w_full)
    assert set(w_full) == set(w_res) and all(torch.equal(w_full[n], w_res[n]) for n in w_full)
    t_full.save_model()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = full(input_ids=ids).logits
        got = engram.load_adapter(base(), tmp_path / "full")
        assert type(got).__name__.startswith("Peft") and torch.equal(got(input_ids=ids).logits, want)
        # without LoRA's weights the model differs: both parts were saved and loaded
        assert not torch.equal(engram.load_adapter(base(), tmp_path / "full", lora=False)(input_ids=ids).logits, want)


def test_save_pretrained_keeps_other_files_and_its_manifest_catches_corruption(tok, tmp_path):
    m = perturbed(tok)
    engram.adapters.unfreeze(m, ["norm"])  # unfrozen base modules travel in model.safetensors too
    with torch.no_grad():
        m.model.norm.weight.add_(0.5)
    d = tmp_path / "shared"
    d.mkdir()
    (d / "optimizer.pt").write_bytes(b"someone else's")
    m.save_pretrained(d)
    assert (d / "optimizer.pt").read_bytes() == b"someone else's"
    (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text() + "\n")  # Trainer may rewrite it
    got = engram.load_adapter(base(), d)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(got(input_ids=ids).logits, m(input_ids=ids).logits)
    blob = bytearray((d / "model.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (d / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(engram.AdapterError, match="corrupt"):
        engram.load_adapter(base(), d)


# ---------------------------------------------------------------------------------------------- TRL
def test_sft_trainer_trains_and_saves_the_adapter(tok, tmp_path):
    trl = pytest.importorskip("trl", reason="TRL not installed (pip install -e '.[trainer]')")
    datasets = pytest.importorskip("datasets", reason="datasets not installed (TRL needs it)")
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tok), eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                            "{% if add_generation_prompt %}assistant: {% endif %}")
    texts = [f"The quick brown fox jumps over the lazy dog, line {i}." for i in range(16)]
    chats = [{"messages": [{"role": "user", "content": f"line {i}?"},
                           {"role": "assistant", "content": f"the quick brown fox, line {i}."}]} for i in range(16)]
    for name, rows in (("text", [{"text": t} for t in texts]), ("chat", chats)):
        m = attached(tok)
        before = trained(m)
        args = trl.SFTConfig(str(tmp_path / name), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                             max_length=32, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)
        sft = trl.SFTTrainer(model=m, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=hf_tok, optimizers=engram.hf_optimizers(m, args))
        sft.train()
        assert all(torch.isfinite(torch.tensor(history(sft))))
        assert any(not torch.equal(p, before[n]) for n, p in trained(m).items() if "multi_head_embedding" in n)
        sft.save_model(str(tmp_path / name / "adapter"))  # the tokenizer's files land beside the adapter
        assert (tmp_path / name / "adapter" / "tokenizer_config.json").is_file()
        # (SFTConfig trains under bf16 autocast by default, which accelerate leaves on m's forward: compare weights)
        loaded = trained(engram.load_adapter(base(), tmp_path / name / "adapter"))
        assert loaded.keys() == before.keys() and all(torch.equal(loaded[n], w) for n, w in trained(m).items())


# ---------------------------------------------------------------------------------------------- DDP
def _ddp_worker(rank, world, port, tok, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    m = attached(tok)
    tr = trainer(m, out, bs=4 // world, save_strategy="no")  # the same global batch of 4
    tr.train()
    assert tr.accelerator.num_processes == world
    if rank == 0:
        torch.save({"weights": trained(m), "loss": history(tr), "grad_norm": history(tr, "grad_norm")},
                   f"{out}/result.pt")


@pytest.mark.slow  # ~60 s on 2 busy cores: two spawned interpreters import transformers
def test_two_ddp_processes_train_as_one_on_the_same_global_batch(tok, tmp_path, free_port):
    """accelerate's DDP on 2 CPU processes (gloo), tables replicated: the sparse row gradients are averaged with
    the dense ones, every rank clips by the same global norm and applies the same update."""
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(2, free_port(), str(tok), str(tmp_path / "ddp")), nprocs=2, join=True)
    got = torch.load(tmp_path / "ddp" / "result.pt")
    one = attached(tok)
    tr = trainer(one, tmp_path / "one", bs=4, save_strategy="no")
    tr.train()
    assert got["loss"] == pytest.approx(history(tr), rel=1e-5)
    assert got["grad_norm"] == pytest.approx(history(tr, "grad_norm"), rel=1e-4)  # averaged, not summed
    for n, w in trained(one).items():
        torch.testing.assert_close(got["weights"][n], w, rtol=1e-4, atol=5e-5)

