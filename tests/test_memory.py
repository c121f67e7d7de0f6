import json

import numpy as np
import pytest
import torch

from engram import BackBoneConfig, Engram, EngramConfig, MultiHeadEmbedding, get_hash_mapping


def tiny(hc_mult=4, N=3, hidden=32, **kw):
    e = EngramConfig(engram_vocab_size=[101 + 10 * i for i in range(N - 1)], max_ngram_size=N, n_embed_per_ngram=16,
                     n_head_per_ngram=2, layer_ids=[0], **kw)
    b = BackBoneConfig(hidden_size=hidden, hc_mult=hc_mult, vocab_size=1000, num_layers=2)
    return e, b


def run(m, h, ids):
    """The layer on token ids: hash, look up its table's rows, then the math -> (delta, gate)."""
    return m(h, m.multi_head_embedding(m.hash_mapping.hash(ids)[m.layer_id]))


def load_golden_module(golden_dir):
    z = np.load(golden_dir / "forward_small.npz")
    cfg = json.loads((golden_dir / "forward_small_config.json").read_text())
    e = EngramConfig(engram_vocab_size=cfg["engram_vocab_size"], max_ngram_size=cfg["max_ngram_size"],
                     n_embed_per_ngram=cfg["n_embed_per_ngram"], n_head_per_ngram=cfg["n_head_per_ngram"],
                     layer_ids=cfg["layer_ids"], pad_id=cfg["pad_id"], seed=cfg["seed"], kernel_size=cfg["kernel_size"])
    b = BackBoneConfig(hidden_size=cfg["hidden_size"], hc_mult=cfg["hc_mult"], num_layers=2)
    m = Engram(1, e, b)
    G = cfg["hc_mult"]
    sd = {"multi_head_embedding.embedding.weight": z["embedding_table"], "value_proj.weight": z["value_proj_weight"],
          "value_proj.bias": z["value_proj_bias"], "short_conv.conv.weight": z["conv_weight"]}
    for i in range(G):
        sd[f"key_projs.{i}.weight"] = z["key_proj_weight"][i]
        sd[f"key_projs.{i}.bias"] = z["key_proj_bias"][i]
        sd[f"norm1.{i}.weight"] = z["key_norm_weight"][i]
        sd[f"norm2.{i}.weight"] = z["query_norm_weight"][i]
        sd[f"short_conv.norms.{i}.weight"] = z["conv_norm_weight"][i]
    m.load_reference_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()})
    return m, z


def test_golden_forward(golden_dir):
    m, z = load_golden_module(golden_dir)
    assert m.hash_mapping.head_offsets(1) == z["head_offsets"].tolist()
    ids = torch.from_numpy(z["input_ids"])
    assert np.array_equal(m.hash_mapping.hash(ids)[1].numpy(), z["hash_ids"])
    with torch.no_grad():
        out, gates = run(m, torch.from_numpy(z["hidden_states"]), ids)
        rows = m.multi_head_embedding(torch.from_numpy(z["hash_ids"]))  # (B, T, H, d) from precomputed hash ids
        out2, _ = m(torch.from_numpy(z["hidden_states"]), rows)
    np.testing.assert_allclose(gates.numpy(), z["gates"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.numpy(), z["output"], atol=1e-5, rtol=0)
    assert torch.equal(out, out2)


@pytest.mark.parametrize("hc_mult", [1, 4])
@pytest.mark.parametrize("N", [2, 3, 4])
def test_tiny_configs_shapes_and_causality(hc_mult, N):
    torch.manual_seed(0)
    e, b = tiny(hc_mult, N)
    m = Engram(0, e, b)
    ids = torch.randint(0, 128815, (2, 12))
    h = torch.randn(2, 12, hc_mult, 32)
    out, g = run(m, h, ids)
    assert out.shape == h.shape and g.shape == (2, 12, hc_mult)
    assert ((g > 0) & (g < 1)).all()
    ids2, h2 = ids.clone(), h.clone()
    ids2[:, 7:] = torch.randint(0, 128815, (2, 5))
    h2[:, 7:] = torch.randn(2, 5, hc_mult, 32)
    out2, _ = run(m, h2, ids2)
    assert torch.equal(out[:, :7], out2[:, :7])
    assert not torch.equal(out[:, 7:], out2[:, 7:])


def test_sparse_gradient_touches_only_looked_up_rows():
    torch.manual_seed(0)
    e, b = tiny()
    m = Engram(0, e, b)
    ids = torch.randint(0, 128815, (2, 10))
    h = torch.randn(2, 10, 4, 32)
    run(m, h, ids)[0].square().sum().backward()
    W = m.multi_head_embedding.embedding.weight
    assert W.grad.is_sparse
    rows, grads = m.multi_head_embedding.row_grads()
    looked_up = torch.unique(m.hash_mapping.hash(ids)[0] + m.multi_head_embedding.offsets)
    assert torch.equal(torch.sort(rows).values, looked_up)
    # same numbers as a dense-gradient run
    dense = Engram(0, e, b)
    dense.load_state_dict(m.state_dict())
    dense.multi_head_embedding.embedding.sparse = False
    run(dense, h, ids)[0].square().sum().backward()
    gd = dense.multi_head_embedding.embedding.weight.grad
    assert torch.allclose(gd[rows], grads, atol=1e-6)
    mask = torch.ones(gd.shape[0], dtype=torch.bool)
    mask[rows] = False
    assert gd[mask].abs().max() == 0


def test_conv_zero_init_gives_identity_on_value():
    e, b = tiny(conv_zero_init=True)
    m = Engram(0, e, b)
    assert m.short_conv.conv.weight.abs().max() == 0
    h, ids = torch.randn(1, 6, 4, 32), torch.randint(0, 1000, (1, 6))
    out, g = run(m, h, ids)
    e_rows = m.multi_head_embedding(m.hash_mapping.hash(ids)[0]).flatten(-2)
    v = g.unsqueeze(-1) * m.kv_proj(e_rows)[..., :32].unsqueeze(2)
    assert torch.allclose(out, v, atol=1e-6)


def test_short_conv_matches_nn_conv1d():
    torch.manual_seed(0)
    e, b = tiny(N=3)
    sc = Engram(0, e, b).short_conv
    x = torch.randn(2, 11, 4, 32)
    ref_conv = torch.nn.Conv1d(128, 128, 4, groups=128, bias=False, padding=3 * 3, dilation=3)
    ref_conv.weight.data.copy_(sc.conv.weight.data)
    xn = torch.nn.functional.rms_norm(x, (32,), eps=1e-5) * sc.norm_weight
    want = torch.nn.functional.silu(ref_conv(xn.reshape(2, 11, 128).transpose(1, 2))[..., :11]).transpose(1, 2)
    assert torch.allclose(sc(x).reshape(2, 11, 128), want, atol=1e-6)


def test_bf16_table_and_bad_shapes():
    e, b = tiny(table_dtype="bfloat16")
    m = Engram(0, e, b)
    assert m.multi_head_embedding.embedding.weight.dtype == torch.bfloat16
    out, _ = run(m, torch.randn(1, 4, 4, 32), torch.randint(0, 1000, (1, 4)))
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match=r"hidden_states must be \(B, T, 4, 32\)"):
        run(m, torch.randn(1, 4, 2, 32), torch.randint(0, 1000, (1, 4)))
    with pytest.raises(ValueError, match=r"rows must be \(B=1, T=4, H, d\)"):
        m(torch.randn(1, 4, 4, 32), torch.randn(1, 3, 4, 8))
    with pytest.raises(ValueError, match="not in engram_cfg.layer_ids"):
        Engram(1, e, b)


def test_multi_head_embedding_offsets():
    mhe = MultiHeadEmbedding([3, 5, 7], 2)
    assert mhe.offsets.tolist() == [0, 3, 8]
    out = mhe(torch.tensor([[[2, 4, 6]]]))
    W = mhe.embedding.weight
    assert torch.equal(out[0, 0], W[[2, 7, 14]])


def plain_forward(m, h, ids):
    """Reference-formula forward from the module's own parameters: per-branch norms, nn Conv1d, dense table."""
    D, G = m.hidden_size, m.hc_mult
    hid = m.hash_mapping.hash(ids)[m.layer_id] + m.multi_head_embedding.offsets
    e = torch.nn.functional.embedding(hid, m.multi_head_embedding.embedding.weight).flatten(-2)
    W, b = m.kv_proj.weight, m.kv_proj.bias
    value = e @ W[:D].T + b[:D]
    gates = []
    for i in range(G):
        k = torch.nn.functional.rms_norm(e @ W[(i + 1) * D:(i + 2) * D].T + b[(i + 1) * D:(i + 2) * D], (D,),
                                         m.key_norm_weight[i])
        q = torch.nn.functional.rms_norm(h[:, :, i], (D,), m.query_norm_weight[i])
        g = (k * q).sum(-1) / D ** 0.5
        gates.append((g.abs().clamp_min(1e-6).sqrt() * g.sign()).sigmoid())
    v = torch.stack(gates, 2).unsqueeze(-1) * value.unsqueeze(2)
    sc = m.short_conv
    xn = torch.cat([torch.nn.functional.rms_norm(v[:, :, i], (D,), sc.norm_weight[i], eps=1e-5) for i in range(G)], -1)
    T = h.shape[1]
    y = torch.nn.functional.conv1d(xn.transpose(1, 2), sc.conv.weight, padding=(sc.kernel_size - 1) * sc.dilation,
                                   dilation=sc.dilation, groups=G * D)[..., :T]
    return v + torch.nn.functional.silu(y).transpose(1, 2).reshape(v.shape)


@pytest.mark.parametrize("hc_mult", [1, 4])
def test_gradients_match_plain_formula(hc_mult):
    torch.manual_seed(1)
    e, b = tiny(hc_mult)
    m = Engram(0, e, b)
    with torch.no_grad():
        m.key_norm_weight.uniform_(0.5, 1.5)
        m.query_norm_weight.uniform_(0.5, 1.5)
        m.short_conv.norm_weight.uniform_(0.5, 1.5)
    ids = torch.randint(0, 128815, (2, 9))
    h1 = torch.randn(2, 9, hc_mult, 32, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_(True)
    w = torch.randn(2, 9, hc_mult, 32)
    (run(m, h1, ids)[0] * w).sum().backward()
    ours = {n: p.grad.to_dense() if p.grad.is_sparse else p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    out_plain = plain_forward(m, h2, ids)
    assert torch.allclose(run(m, h2.detach(), ids)[0], out_plain, atol=1e-5)
    (out_plain * w).sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5)
    for n, p in m.named_parameters():
        g = p.grad.to_dense() if p.grad.is_sparse else p.grad
        assert torch.allclose(ours[n], g, atol=1e-5), n


@pytest.mark.parametrize("opt", [dict(use_gate=False), dict(use_short_conv=False), dict(single_branch=True),
                                 dict(freeze_table=True), dict(compress_tokenizer=False), dict(hash_mode="shuffled"),
                                 dict(hash_mode="constant")])
def test_ablation_switches_run_and_do_what_they_say(opt):
    torch.manual_seed(0)
    e, b = tiny(**opt)
    m = Engram(0, e, b)
    ids = torch.randint(0, 128815, (2, 8))
    h = torch.randn(2, 8, 4, 32, requires_grad=True)
    out, g = run(m, h, ids)
    out.sum().backward()
    rows = m.hash_mapping.hash(ids)[0]
    ref = get_hash_mapping(tiny()[0]).hash(ids)[0]
    if opt.get("use_gate") is False:
        assert torch.equal(g, torch.ones_like(g))
    if opt.get("single_branch"):
        assert torch.equal(g[..., 0], g[..., 3])
    if opt.get("freeze_table"):
        assert m.multi_head_embedding.embedding.weight.grad is None
    if opt.get("hash_mode") == "constant":
        assert rows.abs().max() == 0
    if opt.get("hash_mode") == "shuffled":
        assert not torch.equal(rows, ref) and (rows < torch.tensor(m.hash_mapping.head_sizes(0))).all()
        assert torch.equal(rows, m.hash_mapping.hash(ids)[0])  # fixed, deterministic
    if opt.get("compress_tokenizer") is False:
        assert m.hash_mapping.tokenizer_vocab_size == 128815
        # two raw ids that compression merges: same rows with compression, different rows without
        lut = get_hash_mapping(tiny()[0]).compressed_tokenizer.lookup_table
        a = int(np.flatnonzero(np.bincount(lut) > 1)[0])
        x, y = np.flatnonzero(lut == a)[:2]
        pair = torch.tensor([[5, int(x)], [5, int(y)]])
        merged, raw = get_hash_mapping(tiny()[0]).hash(pair)[0], m.hash_mapping.hash(pair)[0]
        assert torch.equal(merged[0], merged[1]) and not torch.equal(raw[0, 1], raw[1, 1])
    if opt.get("use_short_conv") is False:
        e_rows = m.multi_head_embedding(rows).flatten(-2)
        assert torch.allclose(out, g.unsqueeze(-1) * m.kv_proj(e_rows)[..., :32].unsqueeze(2), atol=1e-6)
