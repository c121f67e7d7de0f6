"""NVFP4 table rows (`engram.tables.quant`: Qwen4Exp's packed rows as vLLM 0.33 stores them).

Checked against an independent oracle written from the formats' definitions (E2M1: 1 sign, 2 exponent bits
of bias 1, 1 mantissa bit; E4M3 "fn": 1 sign, 4 exponent bits of bias 7, 3 mantissa bits, 0x7F/0xFF NaN;
value = code * scale * global scale, computed exactly in Python floats and rounded once to float32, then
to the output dtype), over every code under every scale byte; against vLLM's own functions when vLLM imports
(marker `vllm`).
"""

import math

import numpy as np
import pytest
import torch

import engram.tables.codecs.nvfp4 as nv
import engram.tables.quant as q
from engram.tables import TableError
from engram.tables.quant import (
    NvFp4Table,
    dequantize_nvfp4,
    open_nvfp4_file,
    pack_nvfp4_rows,
    quantize_nvfp4,
    set_table_format,
    write_nvfp4_file,
)


# ------------------------------------------------------------------------------------------ the oracle
def e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return math.nan
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def f32_bits(x: float) -> int:
    """Bits of x rounded once to float32 (x is exact in a double: <= 30 significant bits)."""
    with np.errstate(over="ignore"):
        return int(np.array([x], dtype=np.float64).astype(np.float32).view(np.uint32)[0])


def narrow(bits32: int, dtype: torch.dtype) -> int:
    """float32 bits -> bits of `dtype` (round to nearest-even), computed on the bits."""
    if dtype == torch.float32:
        return bits32
    if dtype == torch.bfloat16:
        return ((bits32 + 0x7FFF + ((bits32 >> 16) & 1)) >> 16) & 0xFFFF
    with np.errstate(over="ignore"):  # float16: numpy's own float32 -> float16 conversion
        return int(np.array([bits32], np.uint32).view(np.float32).astype(np.float16).view(np.uint16)[0])


def oracle(packed: np.ndarray, scales: np.ndarray, g: float, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(bits, isnan) of every decoded value: element 2j of a row is the low nibble of byte j, 2j+1 the high one,
    scaled by the row's scale byte j // 8. The 256 x 16 (scale, code) values are computed one by one, then placed."""
    table = [[e2m1(c) * e4m3(s) * g for c in range(16)] for s in range(256)]
    nan_t = np.array([[math.isnan(v) for v in r] for r in table])
    bits_t = np.array([[0 if math.isnan(v) else narrow(f32_bits(v), dtype) for v in r] for r in table], np.int64)
    n, w = packed.shape
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, 2 * w).astype(np.int64)
    sc = np.repeat(scales.astype(np.int64), 16, axis=1)  # (n, 2w): each value's scale byte
    return bits_t[sc, codes], nan_t[sc, codes]


def as_bits(t: torch.Tensor) -> np.ndarray:
    it = {4: torch.int32, 2: torch.int16}[t.element_size()]
    mask = (1 << (8 * t.element_size())) - 1
    return t.view(it).numpy().astype(np.int64) & mask


GLOBALS = [1.0, 2.0 ** -20, float(np.float32(0.0123)), float(np.float32(1 / 2688)), float(np.float32(3.3e35)),
           float(np.float32(1e-38)), float(np.float32(7.77))]


@pytest.fixture(params=["numba", "torch"])
def path(request, monkeypatch):
    """Both decoders: the compiled loop (when numba is installed) and the torch ops."""
    if request.param == "torch":
        monkeypatch.setattr(nv, "_NVFP4_KERNEL", nv.LazyKernels(lambda: None))
    elif nv._NVFP4_KERNEL.get() is None:
        pytest.skip("numba is not installed")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", GLOBALS)
def test_every_code_under_every_scale_byte_matches_the_oracle_bit_for_bit(g, dtype, path):
    """Row s: scale byte s (all 256, NaN and negative ones included) on 32 blocks whose 256 bytes are 0..255,
    so every (scale, low code, high code) triple is decoded once. Globals include overflow to inf (3.3e35)
    and float32 subnormal products (1e-38)."""
    packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # (256 rows, 256 bytes = 512 values)
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 32, axis=1)  # (256, 32)
    got = dequantize_nvfp4(torch.from_numpy(packed), torch.from_numpy(scales), g, dtype)
    want, nan = oracle(packed, scales, g, dtype)
    assert got.dtype == dtype and got.shape == (256, 512)
    assert np.array_equal(torch.isnan(got.float()).numpy(), nan)
    gb = as_bits(got)
    assert np.array_equal(np.where(nan, 0, gb), want), f"{int((np.where(nan, 0, gb) != want).sum())} values differ"


def test_layout_nibble_order_and_block_index_on_random_rows(path):
    """Random bytes and a different scale per block: element 2j is byte j's low nibble, block j // 8."""
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (40, 80), dtype=np.uint8)  # d = 160, Qwen3.8-Flash-Next's width
    scales = rng.integers(0, 0x7F, (40, 10), dtype=np.uint8)  # finite positive scales
    g = float(np.float32(0.000731))
    want, _ = oracle(packed, scales, g, torch.bfloat16)
    t = NvFp4Table(torch.from_numpy(packed), torch.from_numpy(scales), g, torch.bfloat16)
    rows = torch.tensor([39, 0, 7, 7])
    assert np.array_equal(as_bits(t.gather(rows)), want[rows.numpy()])
    p = NvFp4Table(packed=pack_nvfp4_rows(torch.from_numpy(packed), torch.from_numpy(scales)), global_scale=g)
    assert torch.equal(p.gather(rows), t.gather(rows)) and p.bytes_per_row == 90 and p.dim == 160


def test_quantizer_rounds_to_nearest_with_ties_to_even_and_bounds_the_error():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 5.01, -0.1, -0.0, 0.0, -6.0, 6.0])
    assert nv._e2m1_codes(ties).tolist() == [0, 2, 2, 4, 4, 6, 6, 1, 1, 7, 8, 8, 0, 15, 7]
    torch.manual_seed(0)
    W = torch.randn(300, 64) * torch.logspace(-3, 2, 300)[:, None]  # rows across five orders of magnitude
    W[5] = 0
    packed, scales, g = quantize_nvfp4(W, chunk_rows=64)
    back = dequantize_nvfp4(packed, scales, g, torch.float32)
    step = (q.e4m3_to_float(scales) * g).repeat_interleave(16, dim=1)  # each block's unit
    amax = W.view(300, 4, 16).abs().amax(-1).repeat_interleave(16, dim=1)
    # within +-6 units: half the widest E2M1 gap (4 -> 6), one unit; beyond (the block scale rounded down, coarsely
    # in E4M3's subnormal range for the small rows): clamped to 6 units
    assert bool(((back - W).abs() <= step * (1 + 1e-6) + (amax - 6 * step).clamp_min(0) * (1 + 1e-6)).all())
    assert float((back - W).abs().max()) > 0 and bool((scales[:50] < 8).any())  # (subnormal scales were exercised)
    assert torch.equal(back[5], torch.zeros(64)) and g == float(np.float32(1 / np.float32(2688 / W.abs().max())))
    # the chunked table and one call agree (one global scale for the whole table)
    p1, s1, g1 = quantize_nvfp4(W, chunk_rows=1 << 16)
    assert torch.equal(p1, packed) and torch.equal(s1, scales) and g1 == g


@pytest.mark.filterwarnings("ignore:.*block sums cover")  # (the 64 KiB-sum file on the disk tier)
def test_every_tier_serves_the_same_rows_and_damage_is_caught(tmp_path):
    torch.manual_seed(1)
    W = torch.randn(5000, 160)
    packed, scales, g = quantize_nvfp4(W)
    ram = NvFp4Table(packed, scales, g, torch.bfloat16)
    every = torch.randperm(5000)
    want = ram.gather(every)
    for page_blocks in (False, True):
        f = write_nvfp4_file(tmp_path / f"t{page_blocks}.safetensors", iter([pack_nvfp4_rows(packed, scales)]),
                             5000, 160, g, page_blocks=page_blocks)
        for backend in ("ram", "mmap", "disk"):
            t = open_nvfp4_file(f, backend)
            assert torch.equal(t.gather(every), want), backend
            assert t.bytes_per_row == 90 and t.stats()["format"] == "nvfp4"
            t.close()
    f = tmp_path / "tTrue.safetensors"
    b = bytearray(f.read_bytes())
    hdr = 8 + int.from_bytes(b[:8], "little")
    b[hdr + 1234 * 90 + 3] ^= 0xFF  # codes of row 1234
    f.write_bytes(bytes(b))
    disk = open_nvfp4_file(f, "disk")
    assert torch.equal(disk.gather(torch.tensor([4000])), ram.gather(torch.tensor([4000])))
    with pytest.raises(TableError, match="checksum"):
        disk.gather(torch.tensor([1234]))
    disk.close()
    with pytest.raises(TableError, match="checksum"):
        open_nvfp4_file(f, "mmap")
    b[hdr + 1234 * 90 + 3] ^= 0xFF
    b[hdr + 5000 * 90] ^= 0x01  # the global scale
    f.write_bytes(bytes(b))
    with pytest.raises(TableError, match="checksum"):
        open_nvfp4_file(f, "disk")


def test_damaged_inputs_get_one_line_errors(tmp_path):
    p, s, g = quantize_nvfp4(torch.randn(8, 32))
    cases = [
        (lambda: NvFp4Table(p, s[:, :1], g), "scales of shape \\[8, 1\\] do not fit codes \\[8, 16\\]"),
        (lambda: NvFp4Table(p, None, g), "scales are missing"),
        (lambda: NvFp4Table(None, s, g), "codes are missing"),
        (lambda: NvFp4Table(p[:, :7], s[:, :1], g), "do not fit codes \\[8, 7\\]"),  # odd row width (14 values)
        (lambda: NvFp4Table(packed=torch.zeros(8, 10, dtype=torch.uint8), global_scale=g), "not whole blocks of 9"),
        (lambda: NvFp4Table(p, s, None), "global scale \\(weight_scale_2\\) is missing"),
        (lambda: NvFp4Table(p, s, float("nan")), "global scale is nan"),
        (lambda: NvFp4Table(p, s, 0.0), "finite positive"),
        (lambda: NvFp4Table(p, s, torch.ones(2)), "must be one value"),
        (lambda: dequantize_nvfp4(p, s[:5], g), "do not fit packed codes"),
        (lambda: quantize_nvfp4(torch.randn(4, 24)), "multiple of 16"),
        (lambda: quantize_nvfp4(torch.tensor([[float("inf")] * 16])), "non-finite"),
        (lambda: open_nvfp4_file(tmp_path / "none.safetensors"), "not found"),
        (lambda: open_nvfp4_file(tmp_path / "x", "gpu"), "tier must be"),
    ]
    for fn, msg in cases:
        with pytest.raises(TableError, match=msg) as e:
            fn()
        assert "\n" not in str(e.value)
    from engram.tables import write_table_file

    f = write_table_file(tmp_path / "plain.safetensors", torch.randn(4, 16))
    with pytest.raises(TableError, match="no tensor 'rows'"):
        open_nvfp4_file(f)


@pytest.mark.parametrize("backend", ["ram", "mmap", "disk"])
def test_engram_models_serve_their_tables_as_nvfp4_in_their_tier(backend, tmp_path):
    """`--table-format nvfp4`: an engram model's tables as NVFP4 rows, kept in the tier they were in."""
    pytest.importorskip("transformers")
    from engram.model import EngramForCausalLM
    from engram.tables import offload_tables
    from engram.training.presets import tiny

    torch.manual_seed(0)
    cfg = dict(engram=dict(engram_vocab_size=[1009, 1013], n_embed_per_ngram=64, n_head_per_ngram=2, layer_ids=[1]))
    ids = torch.randint(0, 1000, (2, 24))
    ref = EngramForCausalLM(tiny(**cfg)).eval()
    m = EngramForCausalLM(tiny(**cfg)).eval()
    m.load_state_dict(ref.state_dict())
    w = [mhe.embedding.weight.detach().clone() for _, mhe in q.find_tables(ref)][0]
    if backend != "ram":
        offload_tables(m, backend, tmp_path)
    assert set_table_format(m, "nvfp4") == {1: 32 // 2 + 32 // 16}
    t = [mhe.table for _, mhe in q.find_tables(m)][0]
    assert isinstance(t, NvFp4Table) and (backend == "ram") == (t.packed is None)
    rows = torch.arange(w.shape[0])
    assert torch.equal(t.gather(rows), dequantize_nvfp4(*quantize_nvfp4(w), torch.float32))
    with torch.no_grad():
        want, got = ref(ids).logits, m(ids).logits
    assert not torch.equal(got, want) and float((got - want).abs().max()) < 0.5
    from engram.tables.overlay import OverlayTable

    edited, values = torch.tensor([3, 500]), torch.randn(2, 32)  # an overlay stacks on NVFP4 rows in any tier
    over = OverlayTable(t, edited, values)
    got = over.gather(torch.tensor([3, 4, 500]))
    assert torch.equal(got[[0, 2]], values) and torch.equal(got[1], t.gather(torch.tensor([4]))[0])
    with pytest.raises(TableError, match="multiple of 16"):
        set_table_format(EngramForCausalLM(tiny()).eval(), "nvfp4")  # 8-wide rows


# ------------------------------------------------------------------------------------------ Qwen4Exp checkpoints
def nvfp4_checkpoint(tmp_path):
    """A tiny Qwen4Exp checkpoint whose n-gram tables are NVFP4 shards as vLLM loads them, and the reference:
    the same model in plain transformers with its tables replaced by the decoded rows."""
    pytest.importorskip("transformers.models.qwen4_exp")
    from safetensors.torch import load_file, save_file
    from test_qwen4_exp import tiny_model

    ref = tiny_model(ple_embed_dim=128)  # 32 values a row (4 heads): NVFP4 needs a multiple of 16
    ref.config.ple_embedding_dtype = "nvfp4"  # vLLM's switch for these tables
    ref.save_pretrained(tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    sd = load_file(str(f))
    for i, layer in enumerate(ref.model.layers):
        if getattr(layer, "ple", None) is None:
            continue
        pre = f"model.layers.{i}.ple.ple_embedding.ngram_embedding."
        keys = sorted((k for k in sd if k.startswith(pre + "shard_")), key=lambda k: int(k[len(pre) + 6:-7]))
        sizes = [sd[k].shape[0] for k in keys]
        w = torch.cat([sd.pop(k) for k in keys])
        packed, scales, g = quantize_nvfp4(w)
        at = 0
        for j, n in enumerate(sizes):
            sd[f"{pre}shard_{j}.weight"] = packed[at:at + n].clone()
            sd[f"{pre}shard_{j}.weight_scale"] = scales[at:at + n].clone().view(torch.float8_e4m3fn)
            at += n
        sd[pre + "weight_scale_2"] = torch.tensor(g, dtype=torch.float32)
        with torch.no_grad():
            layer.ple.ple_embedding.ngram_embedding.weight.copy_(dequantize_nvfp4(packed, scales, g, w.dtype))
    save_file(sd, str(f), metadata={"format": "pt"})
    return ref, tmp_path / "ckpt"


@pytest.mark.parametrize("backend", ["ram", pytest.param("mmap", marks=pytest.mark.slow), "disk"])  # (mmap: -m slow)
def test_a_qwen4exp_nvfp4_checkpoint_is_served_packed_from_every_tier(backend, tmp_path):
    from test_qwen4_exp import config, ids_with_eos, tiny_model

    from engram.integrations.qwen4_exp import from_pretrained

    ref, ckpt = nvfp4_checkpoint(tmp_path)
    ids = ids_with_eos(config(), 2, 12, 4)
    with torch.no_grad():
        want = ref(ids).logits
        plain = tiny_model(ple_embed_dim=128)(ids).logits  # (the same model before its tables were quantized)
    assert not torch.equal(plain, want)
    m = from_pretrained(ckpt, tier=backend, dir=tmp_path / "t")
    t = m.model.layers[0].ple.ple_embedding.mhe.table
    assert isinstance(t, NvFp4Table) and t.bytes_per_row == 32 // 2 + 32 // 16
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)
    assert torch.equal(m.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0),
                       ref.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0))
    from engram.config import ConfigError

    with pytest.raises(ConfigError, match="not saved back"):
        m.save_pretrained(tmp_path / "again")


def test_damaged_qwen4exp_nvfp4_checkpoints_get_one_line_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    from engram.config import ConfigError
    from engram.integrations.qwen4_exp import from_pretrained

    _, ckpt = nvfp4_checkpoint(tmp_path)
    f = ckpt / "model.safetensors"
    good = load_file(str(f))
    pre = "model.layers.0.ple.ple_embedding.ngram_embedding."
    bad = [
        ({k: v for k, v in good.items() if k != pre + "weight_scale_2"}, TableError,
         "global scale \\(weight_scale_2\\) is missing"),
        ({k: v for k, v in good.items() if k != pre + "shard_2.weight_scale"}, ConfigError,
         "3 shard_<i>.weight_scale tensors"),
        ({**good, pre + "shard_1.weight_scale": good[pre + "shard_1.weight_scale"].view(torch.uint8)}, ConfigError,
         "shard_1.weight_scale is U8 .*NVFP4 needs F8_E4M3 rows of 2"),
        ({**good, pre + "shard_0.weight": good[pre + "shard_0.weight"][:, :15].clone()}, ConfigError,
         "shard_0.weight is U8 \\[.*, 15\\]; NVFP4 needs U8 rows of 16"),
        ({**good, pre + "weight_scale_2": torch.tensor(-1.0)}, TableError, "finite positive"),
    ]
    for i, (sd, err, msg) in enumerate(bad):
        save_file(sd, str(f), metadata={"format": "pt"})
        with pytest.raises(err, match=msg) as e:
            from_pretrained(ckpt, tier="mmap", dir=tmp_path / f"t{i}")
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ vLLM's own code
def _vllm_nvfp4():
    try:
        from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils as u
    except Exception as e:  # not installed, or its import chain needs what this machine lacks
        pytest.skip(f"vLLM's nvfp4_emulation_utils does not import here ({type(e).__name__}: {e})")
    return u


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllms_cpu_dequant_agrees(path, dtype):
    """vLLM 0.33's `dequantize_to_dtype(..., swizzle=False)` on CPU (what its Qwen4Exp NVFP4 lookup runs for
    CPU ids): `e2m1 * (scale * global)`, another order than its Triton lookup's `(e2m1 * scale) * global`
    (ours, and the oracle's). Every code under every scale byte: equal bit for bit when `scale * global` is
    exact (a power-of-two global); for other globals in the normal range, bfloat16 rows equal and float32 rows
    within one float32 step. Globals whose `scale * global` overflows or is subnormal (3.3e35, 1e-38) are not
    compared: there the CPU path's intermediate rounding differs by more (inf * 0.5, lost subnormal bits)."""
    u = _vllm_nvfp4()
    packed = torch.from_numpy(np.tile(np.arange(256, dtype=np.uint8), (256, 1)))
    scales = torch.from_numpy(np.repeat(np.arange(256, dtype=np.uint8)[:, None], 32, axis=1))
    for g in [x for x in GLOBALS if 1e-30 < x < 1e30]:
        theirs = u.dequantize_to_dtype(packed, scales.view(torch.float8_e4m3fn), torch.tensor([g]), dtype,
                                       swizzle=False)
        ours = dequantize_nvfp4(packed, scales, g, dtype)
        nan = torch.isnan(ours)
        assert torch.equal(nan, torch.isnan(theirs))
        a, b = ours[~nan], theirs[~nan]
        if math.log2(g).is_integer() or dtype == torch.bfloat16:
            assert torch.equal(a, b), g
        else:  # same sign, so the bit patterns differ by at most one
            assert int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max()) <= 1, g


@pytest.mark.vllm
def test_vllms_reference_quantizer_agrees():
    """vLLM's `ref_nvfp4_quant` (float E2M1 values and block scales) gives our codes and scale bytes."""
    u = _vllm_nvfp4()
    torch.manual_seed(3)
    W = torch.randn(64, 160) * torch.logspace(-2, 1, 64)[:, None]
    packed, scales, g = quantize_nvfp4(W)
    enc, g2 = q.nvfp4_global_scale(W.abs().max())
    vals, sc = u.ref_nvfp4_quant(W, enc.reshape(1), 16)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(64, 160)
    assert g2 == g and torch.equal(q.e2m1_to_float(codes), vals)
    assert torch.equal(q.e4m3_to_float(scales), sc)


_TRITON_SCRIPT = '''
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # (vLLM then keeps Triton on a machine without a GPU driver)
import numpy as np, torch
import triton.runtime.interpreter as I

# The interpreter evaluates `owned & in_row` (a scalar and a block of booleans) to int64, which its masked loads
# refuse; the same truth values as booleans, so the kernel itself runs unchanged.
load, store = I.InterpreterBuilder.create_masked_load, I.InterpreterBuilder.create_masked_store
I.InterpreterBuilder.create_masked_load = lambda self, p, m, o, *a: load(
    self, p, I.TensorHandle(m.data.astype(bool), m.dtype), o, *a)
I.InterpreterBuilder.create_masked_store = lambda self, p, v, m, *a: store(
    self, p, v, I.TensorHandle(m.data.astype(bool), m.dtype), *a)
from vllm.models.qwen4_exp.common.ngram_embedding import _lookup_nvfp4_ple_embedding_kernel as kernel

packed = torch.from_numpy(np.tile(np.arange(256, dtype=np.uint8), (256, 1)))
scales = torch.from_numpy(np.repeat(np.arange(256, dtype=np.uint8)[:, None], 32, axis=1))
outs = {}
for i, g in enumerate(float(x) for x in sys.argv[2:]):
    for name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        out = torch.empty(256, 512, dtype=dt)
        kernel[(256,)](packed, scales, torch.tensor([g]), torch.arange(256), out, 512, 0, 256, BLOCK_D=512)
        outs[f"{name}_{i}"] = out.view(torch.int32 if dt == torch.float32 else torch.int16).numpy()
np.savez(sys.argv[1], **outs)
'''


@pytest.mark.vllm
def test_vllms_triton_lookup_agrees(tmp_path):
    """vLLM 0.33's own Triton lookup of Qwen4Exp NVFP4 rows (`_lookup_nvfp4_ple_embedding_kernel`), run by
    Triton's interpreter on the CPU over every code under every scale byte: float32 rows equal ours bit for
    bit for every global scale (overflow and subnormals included). The interpreter casts float32 to bfloat16
    by truncation (a GPU rounds to nearest-even, as torch and we do), so its bfloat16 rows are compared with
    our float32 rows truncated (where those are normal floats): equal, i.e. the only difference is the
    interpreter's final cast."""
    import subprocess
    import sys

    _vllm_nvfp4()
    pytest.importorskip("triton")
    script = tmp_path / "run.py"
    script.write_text(_TRITON_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "out.npz"), *map(repr, GLOBALS)],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    got = np.load(tmp_path / "out.npz")
    packed = torch.from_numpy(np.tile(np.arange(256, dtype=np.uint8), (256, 1)))
    scales = torch.from_numpy(np.repeat(np.arange(256, dtype=np.uint8)[:, None], 32, axis=1))
    for i, g in enumerate(GLOBALS):
        ours = dequantize_nvfp4(packed, scales, g, torch.float32)
        nan = ours.isnan().numpy()
        bits = ours.view(torch.int32).numpy()
        assert np.array_equal(got[f"f32_{i}"][~nan], bits[~nan]), g
        assert np.isnan(got[f"f32_{i}"].view(np.float32)[nan]).all()
        a = ours.abs().numpy()
        normal = ~nan & ((a >= np.finfo(np.float32).tiny) | (a == 0))  # (its subnormal conversion differs again)
        assert np.array_equal(got[f"bf16_{i}"][normal], (bits >> 16).astype(np.int16)[normal]), g
