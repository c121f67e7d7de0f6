import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

import engram  # noqa: E402,F401  (registers the Auto classes)
from engram import ConfigError, presets  # noqa: E402
from engram.hyper import HyperConnection  # noqa: E402
from engram.model import CACHE_FIELD, EngramForCausalLM, MoE, update_expert_bias  # noqa: E402


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


@pytest.mark.parametrize("kw", [{}, {"hc_mult": 1}, {"ffn": "moe", "n_routed_experts": 4}])
def test_incremental_decoding_matches_full_forward(kw):
    m = make(**kw).eval()
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
    m = make().eval()
    ids = torch.randint(0, 1000, (1, 6))
    gen = m.generate(ids, max_new_tokens=6, do_sample=False)
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = m(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(gen, seq)


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
    with pytest.raises(ConfigError, match="hashing mismatch on 'layers'"):
        EngramForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "engram_hash_spec.json").unlink()
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


def test_engram_fused_0_turns_the_fused_kernels_off():
    import subprocess
    import sys

    code = "from engram import _fastadam, _fastsinkhorn; print(_fastadam.available(), _fastsinkhorn.available())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**__import__("os").environ, "ENGRAM_FUSED": "0"})
    assert r.stdout.split() == ["False", "False"], r.stderr


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
