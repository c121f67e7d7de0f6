import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

import engram  # noqa: E402,F401  (registers the Auto classes)
from engram import ConfigError  # noqa: E402
from engram.hyper import HyperConnection  # noqa: E402
from engram.memory import ShortConv  # noqa: E402
from engram.model import CACHE_FIELD, EngramForCausalLM, MoE, update_expert_bias  # noqa: E402
from engram.training import presets  # noqa: E402


def make(**kw):
    torch.manual_seed(0)
    return EngramForCausalLM(presets.tiny(**kw))


def optimizers(model, lr=3e-3):
    table = [p for n, p in model.named_parameters() if "multi_head_embedding" in n]
    dense = [p for n, p in model.named_parameters() if "multi_head_embedding" not in n]
    opts = [torch.optim.AdamW(dense, lr=lr, weight_decay=0.0)]
    if table:
        opts.append(torch.optim.SparseAdam(table, lr=5 * lr))
    return opts


@pytest.mark.parametrize("kw", [{}, {"hc_mult": 1}, {"ffn": "moe", "n_routed_experts": 4, "num_experts_per_tok": 2},
                                {"use_engram": False}])
def test_tiny_overfits_one_batch(kw):
    m = make(**kw)
    ids = torch.randint(0, 1000, (2, 16))
    opts = optimizers(m)
    first = None
    for _ in range(40):
        loss = m(ids, labels=ids).loss
        first = first if first is not None else loss.item()
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    assert loss.item() < 0.3 * first


def trained_conv(m):
    """Give every Engram short conv non-zero taps (as training does), so decoding must carry the conv's state."""
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, ShortConv):
                mod.conv.weight.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("kw", [{}, {"hc_mult": 1}, {"ffn": "moe", "n_routed_experts": 4}])
def test_incremental_decoding_matches_full_forward(kw):
    m = trained_conv(make(**kw)).eval()
    ids = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        full = m(ids).logits
        out = m(ids[:, :5], use_cache=True)
        cache, steps = out[CACHE_FIELD], [out.logits]
        for t in range(5, 12):
            out = m(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-4)


def test_generate_uses_cache_and_matches_greedy_recompute():
    m = trained_conv(make()).eval()
    ids = torch.randint(0, 1000, (1, 6))
    gen = m.generate(ids, max_new_tokens=6, do_sample=False)
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = m(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(gen, seq)


def test_engram_cache_keeps_the_ngram_history_and_a_plain_cache_is_refused():
    from transformers.cache_utils import DynamicCache

    from engram.model import EngramCache, EngramCausalLMOutput

    m = make().eval()
    ids = torch.randint(0, 1000, (2, 8))
    with torch.no_grad():
        out = m(ids[:, :5], use_cache=True)
        assert isinstance(out, EngramCausalLMOutput) and isinstance(out[CACHE_FIELD], EngramCache)
        assert torch.equal(out[CACHE_FIELD].ngram_history, ids[:, 3:5])  # the last N-1 = 2 ids
        plain = DynamicCache()
        m(ids[:, :5], past_key_values=plain, use_cache=True)  # a first call needs no history
        with pytest.raises(ValueError, match="EngramCache"):
            m(ids[:, 5:6], past_key_values=plain, use_cache=True)


def test_history_is_kept_while_engram_is_off_and_for_ids_hashed_ahead():
    """Steps decoded with Engram switched off, or with hash ids passed in, still leave their ids in the cache."""
    m = make().eval()
    ids = torch.randint(0, 1000, (1, 9))
    with torch.no_grad():
        out = m(ids[:, :4], use_cache=True)
        cache = out[CACHE_FIELD]
        m(ids[:, 4:6], past_key_values=cache, use_cache=True, engram_scale=0.0)
        hashes = {k: v[:, -1:] for k, v in m.model.mapping.hash(ids[:, :7]).items()}
        m(ids[:, 6:7], past_key_values=cache, use_cache=True, hash_ids=hashes)
        assert torch.equal(cache.ngram_history, ids[:, 5:7])
        got, _ = m.engram_inputs(ids[:, 7:9], cache.ngram_history)  # the next step's n-grams reach back into those ids
    want = m.model.mapping.hash(ids)
    assert all(torch.equal(got[k], want[k][:, 7:9]) for k in want)


def test_beam_search_reorders_the_ngram_history():
    """Beam search with the cache (history reordered with the beams) equals beam search recomputing everything."""
    m = trained_conv(make()).eval()
    ids = torch.randint(0, 1000, (2, 5))
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=2)
    with torch.no_grad():
        assert torch.equal(m.generate(ids, **kw), m.generate(ids, use_cache=False, **kw))


def test_missing_per_layer_inputs_are_named():
    m = make().eval()
    ids = torch.randint(0, 1000, (1, 5))
    for kw in ({"engram_rows": {}}, {"hash_ids": {7: torch.zeros(1, 5, 4, dtype=torch.long)}}):
        with pytest.raises(ValueError, match="no entry for Engram layer 1"):
            m(ids, **kw)


def test_gates_come_back_in_the_output_field():
    m = make().eval()
    with torch.no_grad():
        out = m(torch.randint(0, 1000, (1, 7)), return_gates=True)
        assert set(out.gates) == {1} and out.gates[1].shape == (1, 7, 4)
        assert m(torch.randint(0, 1000, (1, 7))).gates is None


def test_init_weights_really_initializes():
    """`_init_weights` is what from_pretrained uses for weights a checkpoint lacks: it must give each kind of
    weight its constructor's distribution (and post_init must not redraw what the constructors drew)."""
    torch.manual_seed(0)
    a = EngramForCausalLM(presets.tiny(ffn="moe", n_routed_experts=4))
    torch.manual_seed(0)
    b = EngramForCausalLM(presets.tiny(ffn="moe", n_routed_experts=4))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    fresh = {k: v.clone() for k, v in a.state_dict().items()}
    with torch.no_grad():
        for p in a.parameters():
            p.fill_(7.0)
    a.initialize_weights()
    for k, v in a.state_dict().items():
        if v.dtype.is_floating_point and v.numel() > 1 and "expert_bias" not in k:
            assert not (v == 7.0).any(), f"{k} was not re-initialized"
            assert abs(v.float().std() - fresh[k].float().std()) <= 0.35 * fresh[k].float().std() + 1e-6, k
            assert abs(v.float().mean() - fresh[k].float().mean()) <= 0.35 * fresh[k].float().std() + 0.05, k
    assert (a.model.layers[1].engram.short_conv.conv.weight == 0).all()  # conv_zero_init kept


def test_from_pretrained_initializes_missing_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    m = make()
    m.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.1.engram.kv_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    from engram.persist import write_manifest

    write_manifest(tmp_path)  # a deliberate edit re-lists the files (otherwise it is refused as corrupt)
    loaded = EngramForCausalLM.from_pretrained(tmp_path)
    w = loaded.model.layers[1].engram.kv_proj.weight
    bound = 1 / w.shape[1] ** 0.5  # nn.Linear's kaiming-uniform bound
    assert torch.isfinite(w).all() and w.abs().max() <= bound and w.std() > 0.4 * bound
    assert torch.equal(loaded.model.layers[1].engram.kv_proj.bias, m.model.layers[1].engram.kv_proj.bias)


@pytest.mark.parametrize("tie", [False, True])
def test_save_load_round_trip_and_auto_class(tmp_path, tie):
    m = make(tie_word_embeddings=tie).eval()
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == tie
    ids = torch.randint(0, 1000, (2, 9))
    with torch.no_grad():
        want = m(ids).logits
    m.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "engram_hash_spec.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, EngramForCausalLM)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
    spec = json.loads((tmp_path / "engram_hash_spec.json").read_text())
    spec["layers"]["1"]["multipliers"][0] += 2
    (tmp_path / "engram_hash_spec.json").write_text(json.dumps(spec))
    from engram.persist import IntegrityError, write_manifest

    with pytest.raises(IntegrityError, match="engram_hash_spec.json is truncated or padded"):
        EngramForCausalLM.from_pretrained(tmp_path)  # the checksum manifest catches the edit first
    write_manifest(tmp_path)  # a spec edited on purpose (files re-listed): the hashing check refuses it
    with pytest.raises(ConfigError, match="hashing mismatch on 'layers'"):
        EngramForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "engram_hash_spec.json").unlink()
    write_manifest(tmp_path)
    with pytest.raises(ConfigError, match="hashing manifest"):
        EngramForCausalLM.from_pretrained(tmp_path)


def test_h_res_doubly_stochastic():
    torch.manual_seed(0)
    hc = HyperConnection(32, 4)
    with torch.no_grad():
        hc.alpha.fill_(0.1)  # 10x the init: the dynamic part matters
        _, h_post, h_res = hc.coefficients(torch.randn(2, 5, 4, 32) * 3)
    assert torch.allclose(h_res.sum(-1), torch.ones(2, 5, 4), atol=1e-5)
    assert torch.allclose(h_res.sum(-2), torch.ones(2, 5, 4), atol=1e-5)
    assert ((h_post > 0) & (h_post < 2)).all()


def test_fused_sinkhorn_matches_autograd_of_the_unrolled_iterations():
    pytest.importorskip("numba")
    from engram.hyper import sinkhorn, sinkhorn_knopp

    torch.manual_seed(0)
    x = (torch.randn(3, 7, 4, 4) * 2 + torch.eye(4)).requires_grad_()
    g = torch.randn(3, 7, 4, 4)
    ref = sinkhorn_knopp(x, 20)
    (gx_ref,) = torch.autograd.grad((ref * g).sum(), x)
    out = sinkhorn(x, 20)
    (gx,) = torch.autograd.grad((out * g).sum(), x)
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(gx, gx_ref, atol=1e-5)
    assert torch.equal(sinkhorn(x, 20, fused=False), ref)


@pytest.mark.integration
def test_engram_fused_0_turns_the_fused_kernels_off():
    import subprocess
    import sys

    code = ("from engram import _fastsinkhorn; from engram.training import _adam_kernels; "
            "print(_adam_kernels.available(), _fastsinkhorn.available())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**__import__("os").environ, "ENGRAM_FUSED": "0"})
    assert r.stdout.split() == ["False", "False"], r.stderr


@pytest.mark.integration
def test_fused_kernels_use_torch_thread_count():
    """A process limited to one torch thread runs numba's kernels on one thread too, and stays at one torch thread
    (numba defaults to every core, and starting its OpenMP pool raised torch's count too: two such processes on 2
    cores ran ~5x slower)."""
    import subprocess
    import sys

    pytest.importorskip("numba")
    code = ("import numpy as np, numba, torch\n"
            "from engram.training import _adam_kernels\n"
            "assert _adam_kernels.available()\n"
            "w, m, v = (np.zeros((8, 4), np.float32) for _ in range(3))\n"
            "for _ in range(2):\n"
            "    _adam_kernels.adam_rows(w, m, v, np.arange(4), np.ones((4, 4), np.float32), 0.9, 0.95, 1e-3, 1e-8)\n"
            "print(numba.config.NUMBA_NUM_THREADS, numba.get_num_threads(), torch.get_num_threads())")
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2", "ENGRAM_FUSED": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.stdout.split() == ["2", "1", "1"], r.stdout + r.stderr  # torch's count not raised by numba's either


def test_moe_bias_balancing_reduces_imbalance():
    torch.manual_seed(0)
    cfg = presets.tiny(ffn="moe", n_routed_experts=8, num_experts_per_tok=2, moe_bias_update_speed=0.02)
    moe = MoE(cfg).train()
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.2)
        moe.router.weight[0] += 0.3  # skew: most tokens prefer experts 0 and 1
        moe.router.weight[1] += 0.2
    x = torch.randn(512, 32) + 1.0

    def imbalance():
        moe(x)
        load = moe.last_load.float()
        return (load.max() / load.mean()).item()

    before = imbalance()
    for _ in range(200):
        moe(x)
        update_expert_bias(moe)  # the training step's balancing (forward only counts)
    after = imbalance()
    assert before > 2.5 and after < 0.6 * before, (before, after)
    moe.take_load()
    moe(x)
    moe(x)
    assert torch.equal(moe.take_load(), 2 * moe.last_load)  # the count covers every forward since the last update
    assert moe.take_load().sum() == 0
    moe.eval()(x)
    assert moe.take_load().sum() == 0  # evaluation does not move the balance


def test_engram_switch_recovers_backbone_exactly():
    m = make().eval()
    base = EngramForCausalLM(presets.tiny(use_engram=False)).eval()
    missing = base.load_state_dict({k: v for k, v in m.state_dict().items() if ".engram." not in k}, strict=True)
    assert not missing.missing_keys
    ids = torch.randint(0, 1000, (2, 10))
    with torch.no_grad():
        with m.engram_disabled():
            off = m(ids).logits
        on = m(ids).logits
        assert torch.equal(off, base(ids).logits)
        assert torch.equal(m(ids, engram_scale=0.0).logits, off)
    assert not torch.equal(on, off)


@pytest.mark.parametrize("kw, match", [
    (dict(num_attention_heads=5), "must divide hidden_size"),
    (dict(engram=dict(engram_vocab_size=[1009, 1013], n_embed_per_ngram=16, n_head_per_ngram=2, layer_ids=[7])),
     r"outside \[0, 2\)"),
    (dict(ffn="dense"), "ffn must be"),
    (dict(num_key_value_heads=3), "must divide num_attention_heads"),
])
def test_bad_configs(kw, match):
    with pytest.raises(ConfigError, match=match):
        presets.tiny(**kw)


def test_bad_input_ids():
    m = make()
    with pytest.raises(ValueError, match="2-D"):
        m(torch.tensor([1, 2, 3]))
