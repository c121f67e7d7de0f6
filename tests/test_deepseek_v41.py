"""DeepSeek-V4.1's Engram against independent slow oracles written here from the released format's description
(pure Python integers for hashing, bit fields for FP8 and ue8m0, float64 loops for the module), and a
synthetic checkpoint in the released layout (two shards) served from RAM, mmap and the disk tier."""

import json
import math
import warnings

import numpy as np
import pytest
import torch
from conftest import damaged_copy, drop_from_index, truncate_file

from engram.config import ConfigError
from engram.hashing import HashInputError
from engram.hashing import kernels as hash_kernels
from engram.integrations import deepseek_v41 as v41
from engram.tables.base import TableError
from engram.tables.quant import dequantize_ue8m0, quantize_ue8m0, ue8m0_to_float
from engram.tokenizer import CompressedTokenizer, train_bpe


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    text = [f"The quick brown fox jumps over the lazy dog, line {i} of the tale, said THE king." for i in range(300)]
    return train_bpe(text, 300, tmp_path_factory.mktemp("tok") / "tokenizer.json", progress=False)


def config(tok, **kw):
    ct = CompressedTokenizer(tok)
    c = dict(engram_layer_ids=[1, 3], engram_num_embeddings=[2600, 2600], engram_max_ngram_size=3,
             engram_n_heads=2, engram_head_dim=64, engram_vocab_size=331, engram_compressed_vocab_size=len(ct),
             engram_pad_token_id=1, hidden_size=32, hc_mult=2, rms_norm_eps=1e-6, model_type="deepseek_v41")
    c.update(kw)
    return c


# ------------------------------------------------------------------------------------------ hashing oracle
def _isprime(n):
    return n > 1 and all(n % k for k in range(2, int(n ** 0.5) + 1))


def oracle_hash(cfg, lut, ids, dead):
    """Row ids with offsets, from the description alone: Python ints, one n-gram at a time."""
    L, N, H = cfg["engram_layer_ids"], cfg["engram_max_ngram_size"], cfg["engram_n_heads"]
    V = cfg["engram_compressed_vocab_size"]
    pad = int(lut[cfg["engram_pad_token_id"]])
    taken, primes = set(), {}
    for lid in L:  # primes above engram_vocab_size - 1, never reused, in order of layer, order, head
        per = []
        for _ in range(N - 1):
            p, heads = cfg["engram_vocab_size"] - 1, []
            for _ in range(H):
                p += 1
                while p in taken or not _isprime(p):
                    p += 1
                taken.add(p)
                heads.append(p)
            per.append(heads)
        primes[lid] = per
    bound = (2 ** 63 - 1) // V // 2
    out = {}
    for lid in L:
        mult = [int(m) * 2 + 1 for m in np.random.default_rng(10007 * lid).integers(0, bound, size=N, dtype=np.int64)]
        flat = [p for per in primes[lid] for p in per]
        offs = [sum(flat[:j]) for j in range(len(flat))]
        res = np.zeros((len(ids), len(ids[0]), (N - 1) * H), dtype=np.int64)
        for b, row in enumerate(ids):
            for t in range(len(row)):
                for n in range(2, N + 1):
                    mix, blocked = 0, False
                    for k in range(n):
                        if t - k < 0 or dead[b][t - k]:
                            blocked = True
                        mix ^= (pad if blocked else int(lut[row[t - k]])) * mult[k]
                    for j, p in enumerate(primes[lid][n - 2]):
                        col = (n - 2) * H + j
                        res[b, t, col] = mix % p + offs[col]
        out[lid] = res
    return out


KERNELS = ["torch"] + (["numba"] if hash_kernels.available() else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hashing_matches_the_oracle_with_dead_masks_and_random_configs(tok, seed, kernel):
    """The one engine, on the fused kernel and on the torch path: DEAD positions are per-position resets."""
    g = np.random.default_rng(seed)
    ct = CompressedTokenizer(tok)
    cfg = config(tok, engram_max_ngram_size=int(g.integers(2, 5)), engram_n_heads=int(g.integers(1, 4)),
                 engram_vocab_size=int(g.integers(40, 400)),
                 engram_layer_ids=sorted(g.choice(10, 2, replace=False).tolist()),
                 engram_num_embeddings=[5000, 5000], engram_pad_token_id=int(g.integers(0, 50)))
    m = v41.hash_mapping(cfg, ct, kernel=kernel)
    ids = g.integers(0, ct.raw_vocab_size, size=(3, 17))
    dead = g.random((3, 17)) < 0.2
    dead[0, :2] = dead[1, -1] = True  # a DEAD first and last position
    want = oracle_hash(cfg, ct.lookup_table, ids.tolist(), dead.tolist())
    got = m.hash(torch.from_numpy(ids), offsets=True, dead=torch.from_numpy(dead))
    for lid in cfg["engram_layer_ids"]:
        assert got[lid].dtype == torch.int32 and torch.equal(got[lid].long(), torch.from_numpy(want[lid]))
    clean = oracle_hash(cfg, ct.lookup_table, ids.tolist(), np.zeros_like(dead).tolist())
    fast = m.hash(ids, offsets=True)  # no DEAD: numpy in -> numpy out
    per_head = m.hash(ids, dead=np.zeros_like(dead))  # an all-False mask: no DEAD position
    for lid in cfg["engram_layer_ids"]:
        assert np.array_equal(fast[lid], clean[lid]) and fast[lid].dtype == np.int32
        assert np.array_equal(per_head[lid] + np.array(m.head_offsets(lid), dtype=np.int32), clean[lid])


def test_chunked_prefill_and_decode_equal_one_pass(tok):
    ct = CompressedTokenizer(tok)
    m = v41.hash_mapping(config(tok, engram_max_ngram_size=4), ct)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, ct.raw_vocab_size, (2, 30), generator=g)
    dead = torch.rand(2, 30, generator=g) < 0.15
    whole = m.hash(ids, offsets=True, dead=dead)
    N1 = 3
    for cut in (1, 7, 29):  # a chunk, then the rest with the N-1 ids before it as history
        first = m.hash(ids[:, :cut], offsets=True, dead=dead[:, :cut])
        h0 = max(0, cut - N1)
        rest = m.hash_continuation(ids[:, cut:], ids[:, h0:cut], offsets=True, dead=dead[:, cut:],
                                   history_dead=dead[:, h0:cut])
        for lid in whole:
            assert torch.equal(torch.cat([first[lid], rest[lid]], 1), whole[lid])
    steps = [m.hash_continuation(ids[:, t:t + 1], ids[:, max(0, t - N1):t], offsets=True, dead=dead[:, t:t + 1],
                                 history_dead=dead[:, max(0, t - N1):t]) for t in range(30)]  # decode
    for lid in whole:
        assert torch.equal(torch.cat([s[lid] for s in steps], 1), whole[lid])


def test_hash_manifest_round_trip_and_errors(tok, tmp_path):
    ct = CompressedTokenizer(tok)
    m = v41.hash_mapping(config(tok), ct)
    m.save_spec(tmp_path / "spec.json")
    from engram.hashing import NgramHashMapping

    again = NgramHashMapping.from_spec(tmp_path / "spec.json", tok)
    ids = torch.randint(0, ct.raw_vocab_size, (2, 9))
    dead = torch.zeros(2, 9, dtype=torch.bool)
    dead[0, 4] = True
    assert type(again) is NgramHashMapping and again.family.name == "deepseek_v41" and again.index_dtype == torch.int32
    assert all(torch.equal(again.hash(ids, dead=dead)[k], m.hash(ids, dead=dead)[k]) for k in (1, 3))
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size is 7"):
        v41.hash_mapping(config(tok, engram_compressed_vocab_size=7), ct)
    with pytest.raises(ConfigError, match="not a DeepSeek-V4.1 Engram config"):
        v41.hash_mapping({"model_type": "llama"}, ct)
    with pytest.raises(HashInputError, match="bool tensor of shape"):
        m.hash(ids, dead=torch.zeros(2, 8, dtype=torch.bool))


# ------------------------------------------------------------------------------------------ FP8 + ue8m0
def e4m3_oracle(byte):
    s, e, mant = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and mant == 0x7:
        return math.nan
    v = (mant / 8) * 2.0 ** -6 if e == 0 else (1 + mant / 8) * 2.0 ** (e - 7)
    return -v if s else v


def test_dequantization_of_every_code_and_every_scale_byte():
    codes = torch.arange(256, dtype=torch.uint8)
    want_codes = [e4m3_oracle(b) for b in range(256)]
    scales = torch.arange(256, dtype=torch.uint8)
    # the byte is the float32 exponent field: 0 -> +0.0, 1..254 -> 2^(b-127), 255 -> +inf (what the kernels compute)
    want_scales = [0.0 if b == 0 else math.inf if b == 255 else 2.0 ** (b - 127) for b in range(256)]
    assert ue8m0_to_float(scales).tolist() == want_scales
    rows = codes.repeat(256, 1)[:, :256 // 1]  # (256, 256): every code under every scale
    got = dequantize_ue8m0(rows, scales.view(256, 1).repeat(1, 8), torch.float32)
    for b in range(256):
        for c in (0, 1, 7, 56, 57, 126, 127, 128, 200, 254, 255):  # spot columns, all scales
            w = want_codes[c] * want_scales[b] if not (want_codes[c] == 0 and math.isinf(want_scales[b])) else math.nan
            x = float(got[b, c])
            with np.errstate(over="ignore"):  # products beyond float32 are inf on both sides
                assert (math.isnan(w) and math.isnan(x)) or x == np.float32(w), (b, c, x, w)
    full = dequantize_ue8m0(rows[:, :256], torch.full((256, 8), 127, dtype=torch.uint8), torch.float32)[0]
    assert [v for v in full.tolist() if v == v] == [v for v in want_codes if v == v]  # scale 1.0: the codes
    bf = dequantize_ue8m0(rows[:3], scales[120:123].view(3, 1).repeat(1, 8))  # served as bfloat16
    assert bf.dtype == torch.bfloat16 and torch.equal(bf.view(torch.int16),
                                                      got[120:123].to(torch.bfloat16).view(torch.int16))
    from engram.tables.codecs.scaled import _dequantize_ue8m0_torch

    g = torch.Generator().manual_seed(0)
    rc, rs = (torch.randint(0, 256, (300, 128), dtype=torch.uint8, generator=g),
              torch.randint(0, 256, (300, 4), dtype=torch.uint8, generator=g))
    for dt, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):  # fused loop (numba) == torch ops
        assert torch.equal(dequantize_ue8m0(rc, rs, dt).view(bits), _dequantize_ue8m0_torch(rc, rs, dt).view(bits))
    w = torch.randn(10, 64)
    c, s = quantize_ue8m0(w)
    assert ((dequantize_ue8m0(c, s, torch.float32) - w).abs() <= w.abs() * 0.0625 + 1e-12).all()
    with pytest.raises(TableError, match="one scale per 32"):
        dequantize_ue8m0(c, s[:, :1])


# ------------------------------------------------------------------------------------------ the module
def module_oracle(h, rows, wkv, q, k, eps, mask):
    """float64 loops: per token and branch, the released formula."""
    B, T, G, D = h.shape
    out = h.clone()
    for b in range(B):
        for t in range(T):
            kv = wkv @ rows[b, t].reshape(-1)
            value = kv[G * D:]
            for gi in range(G):
                key, x = kv[gi * D:(gi + 1) * D], h[b, t, gi]
                dot = float((x * q[gi] * k[gi] * key).sum())
                dot *= 1 / math.sqrt(float((x * x).mean()) + eps) / math.sqrt(float((key * key).mean()) + eps)
                dot /= math.sqrt(D)
                gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
                if mask is not None and not mask[b, t]:
                    gate = 0.0
                out[b, t, gi] = x + gate * value
    return out


def test_module_matches_the_float64_oracle(tok):
    cfg = v41.V41Config.from_dict(config(tok))
    torch.manual_seed(0)
    m = v41.V41Engram(1, cfg, dtype=torch.float64)
    with torch.no_grad():
        m.wkv.weight.normal_(0, 0.05)
        m.q_weight.normal_(1, 0.3)
        m.k_weight.normal_(1, 0.3)
    h = torch.randn(2, 5, cfg.hc_mult, cfg.hidden_size, dtype=torch.float64)
    rows = torch.randn(2, 5, cfg.n_hash_cols, cfg.head_dim, dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True, True], [True, False, True, True, True]])
    want = module_oracle(h, rows, m.wkv.weight.detach(), m.q_weight.detach(), m.k_weight.detach(), 1e-6, mask)
    got = m(h, rows, mask)
    assert (got - want).abs().max() < 1e-12
    assert torch.equal(got[0, 2], h[0, 2])  # a shut gate passes the stream through untouched
    b = v41.V41Engram(1, cfg)  # bfloat16 as served: float32 math after the bf16 projection
    b.load_state_dict({k: v.to(torch.bfloat16) for k, v in m.state_dict().items()})
    got16 = b(h.to(torch.bfloat16), rows.to(torch.bfloat16)).double()
    assert (got16 - module_oracle(h, rows, m.wkv.weight.detach(), m.q_weight.detach(), m.k_weight.detach(), 1e-6,
                                  None)).abs().max() < 0.1


# ------------------------------------------------------------------------------------------ the checkpoint
def write_checkpoint(d, tok, wkv_fp8=False, seed=0):
    """A checkpoint folder in DeepSeek-V4.1's layout: config.json, tokenizer.json, index, two shards."""
    import shutil

    from engram.tables.files import tensor_entry, write_safetensors

    d.mkdir(parents=True, exist_ok=True)
    cfg = config(tok)
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copy(tok, d / "tokenizer.json")
    g = torch.Generator().manual_seed(seed)
    C = v41.V41Config.from_dict(cfg)
    shards, wm = {"model-00001-of-00002.safetensors": [], "model-00002-of-00002.safetensors": []}, {}
    for i, (lid, n) in enumerate(zip(C.layer_ids, C.num_embeddings)):
        shard = list(shards)[i]
        pre = f"layers.{lid}.engram."
        codes, scales = quantize_ue8m0(torch.randn(n, C.head_dim, generator=g))
        wkv = torch.randn(C.hidden_size * (C.hc_mult + 1), C.n_hash_cols * C.head_dim, generator=g) * 0.05
        ents = [(pre + "embed.weight", codes), (pre + "embed.scale", scales)]
        if wkv_fp8:
            wc, ws = quantize_ue8m0(wkv)  # MX-FP8: one ue8m0 byte per 32 inputs
            ents += [(pre + "wkv.weight", wc), (pre + "wkv.scale", ws)]
        else:
            ents += [(pre + "wkv.weight", wkv.to(torch.bfloat16))]
        ents += [(pre + "q_weight", (1 + 0.3 * torch.randn(C.hc_mult, C.hidden_size, generator=g)).to(torch.bfloat16)),
                 (pre + "k_weight", (1 + 0.3 * torch.randn(C.hc_mult, C.hidden_size, generator=g)).to(torch.bfloat16)),
                 (f"layers.{lid}.attn.wq.weight", torch.randn(4, 4, generator=g).to(torch.bfloat16))]  # not Engram
        shards[shard] += ents
        wm.update({k: shard for k, _ in ents})
    for shard, ents in shards.items():
        write_safetensors(d / shard, [tensor_entry(k, v) for k, v in ents])
    _retag_fp8(d, shards)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


def _retag_fp8(d, shards):
    """Our writer tags raw bytes U8; DeepSeek's shards say F8_E4M3 / F8_E8M0: rewrite each shard's header (the
    data section, whose offsets are relative to its start, is kept byte for byte)."""
    import struct

    for shard in shards:
        p = d / shard
        b = p.read_bytes()
        (n,) = struct.unpack("<Q", b[:8])
        meta = json.loads(b[8:8 + n])
        for k, info in meta.items():
            if k.endswith(("embed.weight", "wkv.weight")) and info.get("dtype") == "U8":
                info["dtype"] = "F8_E4M3"
            elif k.endswith(("embed.scale", "wkv.scale")) and info.get("dtype") == "U8":
                info["dtype"] = "F8_E8M0"
        head = json.dumps(meta).encode()
        head += b" " * (-(8 + len(head)) % 8)
        p.write_bytes(struct.pack("<Q", len(head)) + head + b[8 + n:])


@pytest.mark.parametrize("wkv_fp8", [False, True])
def test_synthetic_checkpoint_gives_identical_outputs_from_every_tier(tok, tmp_path, wkv_fp8):
    from safetensors import safe_open

    d = write_checkpoint(tmp_path / "ckpt", tok, wkv_fp8=wkv_fp8)
    ids = torch.randint(0, CompressedTokenizer(tok).raw_vocab_size, (2, 12))
    dead = torch.zeros(2, 12, dtype=torch.bool)
    dead[1, 3:5] = True
    outs = {}
    for backend, kw in (("ram", {}), ("mmap", {}), ("disk", {}), ("mmap", {"dir": tmp_path / "m"}),
                        ("disk", {"dir": tmp_path / "k"})):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mem = v41.load(d, backend, **kw)
        if backend == "disk" and "dir" not in kw:
            assert sum("no block checksums" in str(w.message) for w in caught) == 2  # one per layer, in place
        if "dir" in kw:  # the checked copy: one packed 64 + 2 byte row per table row, block sums beside it
            assert all((kw["dir"] / f"engram_v41_L{lid}.safetensors.blocks").is_file() for lid in (1, 3))
        hash_ids = mem.mapping.hash(ids, offsets=True, dead=dead)
        torch.manual_seed(1)
        h = torch.randn(2, 12, 2, 32).to(torch.bfloat16)
        outs[(backend, "dir" in kw)] = {lid: mem.layers[lid](h, hash_ids[lid], mask=~dead) for lid in (1, 3)}
        # rows: the shard's FP8 bytes dequantized exactly (compared with our own read of the file)
        with safe_open(str(d / "model-00001-of-00002.safetensors"), "pt") as f:
            want_rows = dequantize_ue8m0(f.get_tensor("layers.1.engram.embed.weight").view(torch.uint8)[:40],
                                         f.get_tensor("layers.1.engram.embed.scale").view(torch.uint8)[:40])
        assert torch.equal(mem.layers[1].table.gather(torch.arange(40)), want_rows)
        assert mem.table_bytes() == 2 * 2600 * 66
        mem.close()
    first = next(iter(outs.values()))
    assert all(torch.equal(o[lid], first[lid]) for o in outs.values() for lid in (1, 3))
    assert not torch.equal(first[1], first[3])


def test_checkpoint_errors_are_one_line_and_load_nothing(tok, tmp_path):
    d = write_checkpoint(tmp_path / "ok", tok)

    def broken(name, edit):
        return damaged_copy(d, tmp_path / name, edit)

    def drop_key(b):
        drop_from_index(b, "layers.3.engram.embed.scale")

    def other_vocab(b):
        c = json.loads((b / "config.json").read_text())
        c["engram_compressed_vocab_size"] += 1
        (b / "config.json").write_text(json.dumps(c))

    def not_v41(b):
        (b / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 32}))

    def truncate(b):
        truncate_file(b / "model-00002-of-00002.safetensors", 5000)

    def scale_shape(b):
        c = json.loads((b / "config.json").read_text())
        c["engram_head_dim"] = 32  # the stored rows are 64 wide: rows and scales no longer fit the config
        (b / "config.json").write_text(json.dumps(c))

    cases = [(drop_key, ConfigError, "has no layers.3.engram.embed.scale"),
             (other_vocab, ConfigError, "engram_compressed_vocab_size"),
             (not_v41, ConfigError, "not a DeepSeek-V4.1 Engram config"),
             (truncate, TableError, "truncated"),
             (scale_shape, ConfigError, "needs F8_E4M3")]
    for edit, err, msg in cases:
        b = broken(edit.__name__, edit)
        for backend in ("ram", "disk"):
            with pytest.raises(err, match=msg) as e:
                v41.load(b, backend)
            assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="tier must be"):
        v41.load(d, "gpu")


def test_a_flipped_byte_in_the_checked_copy_is_one_error_on_its_first_read(tok, tmp_path):
    d = write_checkpoint(tmp_path / "ckpt", tok)
    v41.load(d, "disk", dir=tmp_path / "copy").close()
    f = tmp_path / "copy" / "engram_v41_L1.safetensors"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF  # a row in the middle of the table
    f.write_bytes(bytes(b))
    from engram.tables.disk import DiskTable
    from engram.tables.quant import BlockFp8Table

    table = BlockFp8Table(packed=DiskTable(f, tensor="rows"))
    with pytest.raises(TableError, match="checksum|corrupt"):
        table.gather(torch.arange(table.num_rows))
    table.close()


def test_engram_models_serve_their_tables_in_v41_rows():
    """`--table-format fp8_ue8m0`: any engram model's tables as DeepSeek-V4.1 stores them (264/256 bytes per value)."""
    pytest.importorskip("transformers")
    from engram.model import EngramForCausalLM
    from engram.tables.quant import set_table_format
    from engram.training.presets import tiny

    torch.manual_seed(0)
    cfg = dict(engram=dict(engram_vocab_size=[1009, 1013], n_embed_per_ngram=128, n_head_per_ngram=2, layer_ids=[1]))
    ids = torch.randint(0, 1000, (2, 24))
    ref = EngramForCausalLM(tiny(**cfg)).eval()
    m = EngramForCausalLM(tiny(**cfg)).eval()
    m.load_state_dict(ref.state_dict())
    assert set_table_format(m, "fp8_ue8m0") == {1: 64 + 2}
    with torch.no_grad():
        want, got = ref(ids).logits, m(ids).logits
    assert not torch.equal(got, want) and float((got - want).abs().max()) < 0.3
    with pytest.raises(TableError, match="multiple of 32"):
        set_table_format(EngramForCausalLM(tiny()).eval(), "fp8_ue8m0")  # 8-wide rows


def test_overlays_stack_on_v41_rows_from_every_tier(tok, tmp_path):
    from engram.tables.overlay import OverlayTable

    d = write_checkpoint(tmp_path / "ckpt", tok)
    rows, values = torch.tensor([5, 17, 2000]), torch.randn(3, 64)
    for backend in ("ram", "mmap", "disk"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mem = v41.load(d, backend)
        base = mem.layers[1].table
        ids = torch.tensor([4, 5, 6, 17, 2000, 2001])
        before = base.gather(ids)
        mem.layers[1].table = OverlayTable(base, rows, values, name="facts")
        got = mem.layers[1].table.lookup(ids)
        assert torch.equal(got[[1, 3, 4]], values.to(torch.bfloat16)) and torch.equal(got[[0, 2, 5]], before[[0, 2, 5]])
        mem.layers[1].table = base  # removing the overlay is the undo
        assert torch.equal(mem.layers[1].table.lookup(ids), before)
        mem.close()


@pytest.mark.slow  # out of the default run (under 10 min on 2 cores): 6 s
def test_stats_of_the_v41_hashing_on_a_corpus(tok):
    """`engram stats --v41`: row use and collisions per head, hashed in chunks that continue each other."""
    from engram.analysis.stats import mapping_usage

    ct = CompressedTokenizer(tok)
    m = v41.hash_mapping(config(tok), ct)
    ids = np.random.default_rng(0).integers(0, 40, 3000)  # a small alphabet: n-grams repeat, rows collide
    whole, chunked = mapping_usage(m, ids), mapping_usage(m, ids, chunk=77)
    assert whole == chunked and len(whole) == 2 * 2 * 2  # layers x orders x heads
    h = m.hash(torch.from_numpy(ids[None]))
    for u in whole:
        col = (u["order"] - 2) * 2 + u["head"]
        assert u["rows_used"] == len(torch.unique(h[u["layer"]][0, :, col]))
        assert u["rows_used"] <= min(u["head_rows"], u["distinct_ngrams"]) and 0 <= u["collision_rate"] < 1


@pytest.mark.integration
def test_the_v41_preset_trains_saves_and_serves_in_v41_rows(tmp_path):
    """`engram train --preset cpu-small-v41` (no short conv) and `engram eval --table-format fp8_ue8m0`."""
    pytest.importorskip("transformers")
    from engram.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"Line {i}: the cat sat on the mat, the dog ran to the king.\n" for i in range(300)))
    assert main(["train", "--preset", "cpu-small-v41", "--data", str(corpus), "--out", str(tmp_path / "run"),
                 "--max-steps", "2", "--set", "seq_len=32", "--set", "eval_max_windows=2"]) == 0
    cfg = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert cfg["engram"]["use_short_conv"] is False
    for fmt in ("float32", "fp8_ue8m0"):
        assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(corpus), "--seq-len", "32",
                     "--max-windows", "2", "--table-format", fmt]) == 0


def test_hash_windows_and_the_step_kernel_equal_hash(tok):
    """A serving step's hash (`hash_windows`, and `integrations.vllm._kernels.hash_step` reading a per-slot store)
    gives V4.1's rows (int32, offsets added) as `hash` does inside the whole sequences."""
    from engram.integrations.vllm import _kernels as step_kernels
    from engram.integrations.vllm.state import SlotState, StepView

    ct = CompressedTokenizer(tok)
    m = v41.hash_mapping(config(tok), ct)
    g = np.random.default_rng(11)
    seqs = g.integers(0, ct.raw_vocab_size, size=(2, 9))
    whole = m.hash(seqs, offsets=True)
    N = m.max_ngram_size
    b, t = np.repeat([0, 1], 9), np.tile(np.arange(9), 2)
    cols = t[:, None] - np.arange(N - 1, -1, -1)
    windows = np.where(cols >= 0, seqs[b[:, None], np.maximum(cols, 0)], 0)
    got = m.hash_windows(windows, np.maximum(N - 1 - t, 0), offsets=True)
    bt, bs = np.array([[3, 0, 5], [1, 4, 2]]), 4
    view = StepView(seqs[b, t], t, bt[b, t // bs] * bs + t % bs, np.array([0, 9, 18]), bt, bs)
    state = SlotState(bs)
    stepped = state.hash(view, m)
    for lid in m.layer_ids:
        assert got[lid].dtype == torch.int32 and torch.equal(got[lid], torch.from_numpy(whole[lid][b, t]))
        assert torch.equal(stepped[lid], got[lid])
    if step_kernels._kernels.get() is not None:
        assert m.kernel_plan(offsets=True) is not None  # (the kernel path was the one taken)
