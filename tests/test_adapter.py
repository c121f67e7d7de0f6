"""Engram adapters on tiny random Llama, Qwen3 and GPT-2 models (engram.adapters)."""

import pytest
import torch

pytest.importorskip("transformers")

from bases import tale_tokenizer, tiny_base  # noqa: E402

import engram  # noqa: E402
from engram.adapters import AdapterError, adapter_of, freeze_base  # noqa: E402
from engram.training.optim import build_optimizers  # noqa: E402

KINDS = ["llama", "qwen3", "gpt2"]
OPTS = dict(engram_vocab_size=[211, 223], n_embed_per_ngram=16, n_head_per_ngram=2)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tale_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def make(kind, seed=0, hidden=32, vocab=400):
    return tiny_base(kind, vocab=vocab, hidden=hidden, seed=seed).eval()


def perturb(model, scale=0.3):
    """Stand-in for a trained adapter: every Engram weight (value rows, conv taps) moved off its init."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_of(model).parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def fit(model, ids, steps, lr=1e-2):
    """`steps` optimizer steps on one batch (engram's optimizer groups): (losses, optimizers)."""
    opts = build_optimizers(model, lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts.values():
            o.step()
        losses.append(loss.item())
    return losses, opts


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_an_attached_model_deepcopies_and_pickles_into_an_independent_model(tok):
    import copy
    import pickle

    m = perturb(engram.attach(make("llama"), [0], tokenizer=tok, verbose=False, **OPTS))
    ids = torch.randint(0, 400, (2, 12))
    want = logits(m, ids)
    twin, thawed = copy.deepcopy(m), pickle.loads(pickle.dumps(m))  # (after a forward: its cache is not copied)
    assert torch.equal(logits(twin, ids), want) and torch.equal(logits(thawed, ids), want)
    with torch.no_grad():  # the copy's hooks run the copy's adapter, not the original's
        adapter_of(twin).layers["0"].kv_proj.weight.add_(1.0)
    assert not torch.equal(logits(twin, ids), want) and torch.equal(logits(m, ids), want)
    engram.detach(twin)
    assert adapter_of(twin) is None and adapter_of(m) is not None and torch.equal(logits(m, ids), want)


@pytest.mark.parametrize("kind", KINDS)
def test_attach_is_exact_and_detach_gives_the_base_back(kind, tok):
    m = make(kind)
    ids = torch.randint(0, 400, (2, 12))
    base, keys = logits(m, ids), set(m.state_dict())
    assert engram.attach(m, [0, 1], tokenizer=tok, **OPTS) is m
    assert torch.equal(logits(m, ids), base)  # bit for bit: the value rows start at zero
    perturb(m)
    assert not torch.equal(logits(m, ids), base)  # the adapter is live
    engram.detach(m)
    assert torch.equal(logits(m, ids), base) and set(m.state_dict()) == keys and adapter_of(m) is None


@pytest.mark.parametrize("kind", KINDS)
def test_loss_falls_with_the_base_frozen_and_unchanged(kind, tok):
    m = engram.attach(make(kind), [1], tokenizer=tok, **OPTS).train()
    freeze_base(m)
    before = {k: v.clone() for k, v in m.state_dict().items() if "engram_adapter" not in k}
    ids = torch.randint(0, 400, (4, 16))
    losses, opts = fit(m, ids, 40)
    assert losses[-1] < 0.85 * losses[0], losses
    assert "tables" in opts  # the rows trained by the lazy row optimizer
    after = m.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip_is_identical(kind, tok, tmp_path):
    m = perturb(engram.attach(make(kind), [1], tokenizer=tok, **OPTS))
    ids = torch.randint(0, 400, (2, 10))
    want = logits(m, ids)
    engram.save_adapter(m, tmp_path / "a")
    names = {f.name for f in (tmp_path / "a").iterdir()}
    assert names == {"engram_adapter.json", "engram_adapter.safetensors", "engram_hash_spec.json", "tokenizer.json",
                     "engram_manifest.json", "README.md"}  # README.md: the model card (adapters/card.py)
    m2 = engram.load_adapter(make(kind), tmp_path / "a")
    assert torch.equal(logits(m2, ids), want)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_generate_equals_greedy_recompute(kind, tok):
    m = perturb(engram.attach(make(kind), [0, 1], tokenizer=tok, **OPTS))
    ids = torch.randint(2, 400, (2, 5))
    gen = m.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=1)
    seq = ids
    for _ in range(8):
        seq = torch.cat([seq, logits(m, seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(gen, seq)


@pytest.mark.parametrize("kind", KINDS)
def test_mmap_backend_and_prefetcher_are_identical(kind, tok, tmp_path):
    from engram.tables import offload_tables
    from engram.tables.prefetch import Prefetcher

    m = perturb(engram.attach(make(kind), [1], tokenizer=tok, **OPTS))
    ids = torch.randint(0, 400, (2, 10))
    want = logits(m, ids)
    offload_tables(m, "mmap", tmp_path)
    assert m.engram_adapter.layers["1"].multi_head_embedding.table is not None
    assert torch.equal(logits(m, ids), want)
    Prefetcher.attach(m)
    assert torch.equal(logits(m, ids), want)
    engram.save_adapter(m, tmp_path / "a")  # the rows stream out of the file
    engram.detach(m)
    assert torch.equal(logits(engram.load_adapter(make(kind), tmp_path / "a"), ids), want)


def test_lora_and_engram_train_together_and_round_trip(tok, tmp_path):
    pytest.importorskip("peft")
    m = engram.attach(make("llama"), [1], tokenizer=tok, **OPTS).train()
    pm = engram.adapters.add_lora(m, rank=4)
    names = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in names) and any("engram_adapter" in n for n in names)
    ids = torch.randint(0, 400, (4, 16))
    fit(pm, ids, 5)
    pm.eval()
    want = logits(pm, ids)
    engram.save_adapter(pm, tmp_path / "a")
    assert (tmp_path / "a" / "lora" / "adapter_config.json").is_file()
    loaded = engram.load_adapter(make("llama"), tmp_path / "a").eval()
    assert torch.equal(logits(loaded, ids), want)


def test_unfrozen_base_modules_are_saved_with_the_adapter(tok, tmp_path):
    m = engram.attach(make("llama"), [1], tokenizer=tok, **OPTS)
    freeze_base(m)
    assert engram.adapters.unfreeze(m, ["lm_head", "norm"]) == ["model.norm", "lm_head"]
    assert m.lm_head.weight.requires_grad and not m.model.embed_tokens.weight.requires_grad
    with torch.no_grad():
        m.lm_head.weight.mul_(1.5)  # stands in for training it
    ids = torch.randint(0, 400, (1, 8))
    want = logits(m, ids)
    engram.save_adapter(m, tmp_path / "a")
    assert (tmp_path / "a" / "base_modules.safetensors").is_file()
    assert torch.equal(logits(engram.load_adapter(make("llama"), tmp_path / "a"), ids), want)
    with pytest.raises(AdapterError, match="no base module named"):
        engram.adapters.unfreeze(m, ["nope"])


# ------------------------------------------------------------------------------------------ bad input
class OddLM(torch.nn.Module):
    """A causal LM whose layers sit where no convention looks (`stack`)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(400, 32)
        self.stack = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for layer in self.stack:
            h = h + layer(h)
        return h @ self.emb.weight.t()


def _untouched(m, ids, base):
    assert adapter_of(m) is None and torch.equal(logits(m, ids), base)
    assert not any(mod._forward_pre_hooks for mod in m.modules())


def test_bad_input_is_one_clear_error_and_modifies_nothing(tok, tmp_path):
    m = make("llama")
    ids = torch.randint(0, 400, (1, 6))
    base = logits(m, ids)
    with pytest.raises(AdapterError, match=r"out of range: model.layers has 2 layers \(0..1\)"):
        engram.attach(m, [0, 2], tokenizer=tok, **OPTS)
    _untouched(m, ids, base)
    with pytest.raises(AdapterError, match="not the model's tokenizer"):
        engram.attach(make("llama", vocab=2000), [0], tokenizer=tok, **OPTS)
    odd = OddLM()
    with pytest.raises(AdapterError, match="no decoder layer list found.*layers_path="):
        engram.attach(odd, [0], tokenizer=tok, **OPTS)
    assert adapter_of(odd) is None
    engram.attach(odd, [1], tokenizer=tok, layers_path="stack", **OPTS)  # pointed at the list: works
    assert odd(torch.randint(0, 400, (1, 5))).shape == (1, 5, 400)
    with pytest.raises(AdapterError, match="unknown Engram option"):
        engram.attach(m, [0], tokenizer=tok, n_heads=3)
    _untouched(m, ids, base)
    engram.attach(m, [0], tokenizer=tok, **OPTS)
    with pytest.raises(AdapterError, match="already has an Engram adapter"):
        engram.attach(m, [1], tokenizer=tok, **OPTS)
    with pytest.raises(AdapterError, match="input_ids"):
        m(inputs_embeds=torch.zeros(1, 3, 32))
    engram.save_adapter(m, tmp_path / "a")
    engram.detach(m)
    for other, why in ((make("llama", seed=5), "embedding weights differ"), (make("llama", hidden=64), "hidden_size"),
                       (make("qwen3"), "model_type")):
        o_base = logits(other, ids)
        with pytest.raises(AdapterError, match=f"saved for another base model: .*{why}"):
            engram.load_adapter(other, tmp_path / "a")
        _untouched(other, ids, o_base)
    (tmp_path / "a" / "engram_adapter.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterError, match="corrupt"):
        engram.load_adapter(make("llama"), tmp_path / "a")
    with pytest.raises(AdapterError, match="no Engram adapter here"):
        engram.load_adapter(make("llama"), tmp_path)


def _sharded_worker(rank, world, port, tok, kind):
    import gc
    import os

    from engram.distributed.parallel import DistContext, shutdown
    from engram.distributed.sharded import ShardedTable

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    try:
        m = perturb(engram.attach(make(kind), [0, 1], tokenizer=tok, **OPTS))
        ids = torch.randint(0, 400, (2, 9), generator=torch.Generator().manual_seed(rank))
        want = logits(m, ids)
        step_model = DistContext(torch.device("cpu")).parallelize(m)  # tables row-sharded over the 2 ranks
        assert all(isinstance(t.table, ShardedTable) for t in adapter_of(m).modules() if hasattr(t, "table"))
        with torch.no_grad():
            got = step_model(input_ids=ids).logits
        assert torch.equal(got, want), (rank, (got - want).abs().max())
    finally:
        step_model = m = None  # DDP's reducer freed while its group is alive (see `shutdown`)
        gc.collect()
        shutdown()


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 14 s
@pytest.mark.integration
def test_row_sharded_tables_are_identical(tok, free_port):
    import torch.multiprocessing as mp

    mp.spawn(_sharded_worker, args=(2, free_port(), str(tok), "qwen3"), nprocs=2, join=True)


def test_adapter_rows_start_small_unless_asked_for_the_reference_init(tok):
    """Adapters draw rows from N(0, 0.02) (see `default_options`); table_init_std=1.0 is the reference's N(0, 1)."""
    for std in (None, 1.0):
        m = make("llama")
        kw = {} if std is None else {"table_init_std": std}
        engram.attach(m, [1], tokenizer=tok, verbose=False, **OPTS, **kw)
        rows = adapter_of(m).layers["1"].multi_head_embedding.embedding.weight
        assert abs(rows.std().item() - (0.02 if std is None else 1.0)) < 0.1 * (0.02 if std is None else 1.0)


def test_clear_rows_makes_a_trained_adapter_exactly_the_base_until_rows_are_written(tok):
    m = make("llama")
    ids = torch.randint(0, 400, (2, 12))
    base = logits(m, ids)
    perturb(engram.attach(m, [0, 1], tokenizer=tok, verbose=False, **OPTS))  # trained-like: rows, biases, taps moved
    assert not torch.equal(logits(m, ids), base)
    kv = {k: layer.kv_proj.weight.clone() for k, layer in adapter_of(m).layers.items()}
    n = engram.adapters.clear_rows(m)
    assert n == sum(layer.multi_head_embedding.embedding.weight.shape[0] for layer in adapter_of(m).layers.values())
    assert torch.equal(logits(m, ids), base)  # bit for bit: zero rows, zero value bias
    assert all(torch.equal(layer.kv_proj.weight, kv[k]) for k, layer in adapter_of(m).layers.items())  # kept
    with torch.no_grad():  # one written row moves the output again: the projections still read rows
        adapter_of(m).layers["0"].multi_head_embedding.embedding.weight.add_(0.5)
    assert not torch.equal(logits(m, ids), base)
    with pytest.raises(AdapterError, match="attached Engram adapter"):
        engram.adapters.clear_rows(make("llama"))
