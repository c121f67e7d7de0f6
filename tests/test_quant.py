"""Quantized table rows (`engram.tables.quant`): int8 per-row scale, FP8 e4m3 per-row power-of-two scale."""

import pytest
import torch

from engram.tables import EncodedTable, TableError
from engram.tables.codecs import FloatCodec, Nvfp4Codec, ScaledRowCodec, Ue8m0Codec
from engram.tables.quant import (
    TABLE_FORMATS,
    QuantTable,
    dequantize,
    dequantize_nvfp4,
    dequantize_ue8m0,
    open_quant_file,
    quantize_nvfp4,
    quantize_rows,
    quantize_ue8m0,
    set_table_format,
    write_quant_file,
)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_round_trip_error_is_bounded_per_row(fmt):
    torch.manual_seed(0)
    W = torch.randn(500, 32) * torch.logspace(-3, 3, 500)[:, None]  # rows across six orders of magnitude
    W[7] = 0
    codes, scales = quantize_rows(W, fmt, chunk_rows=128)
    back = dequantize(codes, scales, fmt)
    amax = W.abs().amax(1, keepdim=True)
    err = (back - W).abs()
    if fmt == "int8":  # half a step of max|x|/127 (+ the float16 scale's rounding)
        assert bool((err <= amax / 254 * 1.01 + 1e-30).all())
    else:  # e4m3: 3 mantissa bits, so within 1/16 of each value, or of the subnormal step near zero
        assert bool((err <= W.abs() / 16 + amax / 448 * 2 ** -6 + 1e-30).all())
    assert torch.equal(back[7], torch.zeros(32))
    assert torch.equal(QuantTable(codes, scales, fmt).gather(torch.arange(500)), back)  # fused kernel == torch ops
    assert codes.element_size() == 1 and scales.element_size() == (2 if fmt == "int8" else 1)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_table_and_file_gather_the_same_rows(tmp_path, fmt):
    W = torch.randn(3000, 16)
    codes, scales = quantize_rows(W, fmt)
    t = QuantTable(codes, scales, fmt)
    rows = torch.tensor([0, 5, 2999, 5])
    assert torch.equal(t.gather(rows), dequantize(codes, scales, fmt)[rows])
    f = write_quant_file(tmp_path / "q.safetensors", codes, scales, fmt)
    ft = open_quant_file(f)
    assert torch.equal(ft.gather(rows), t.gather(rows)) and ft.bytes_per_row == 16 + scales.element_size()
    b = bytearray(f.read_bytes())
    b[ft.blocks.data_offset + 100] ^= 0xFF  # inside the codes of row 6
    f.write_bytes(bytes(b))
    bad = open_quant_file(f)
    with pytest.raises(TableError, match="fail their checksum"):
        bad.gather(torch.tensor([6]))
    with pytest.raises(TableError, match="format must be"):
        quantize_rows(W, "int4")


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("direct", [False, True])
def test_the_disk_tier_serves_quantized_files(tmp_path, fmt, direct):
    """Codes read cold by DiskTable, scales in RAM: the same rows as the mapped file; damage to either is caught."""
    W = torch.randn(20000, 40)
    codes, scales = quantize_rows(W, fmt)
    f = write_quant_file(tmp_path / "q.safetensors", codes, scales, fmt, page_blocks=True)
    rows = torch.tensor([0, 5, 19999, 5, 7777])
    want = open_quant_file(f).gather(rows)
    t = open_quant_file(f, tier="disk", direct=direct)
    assert torch.equal(t.gather(rows), want) and t.bytes_per_row == 40 + scales.element_size()
    every = torch.randperm(20000)
    assert torch.equal(t.gather(every), QuantTable(codes, scales, fmt).gather(every))
    assert t.stats()["reads"] > 0
    t.close()
    n = 8 + len(f.read_bytes()[8:8 + int.from_bytes(f.read_bytes()[:8], "little")])
    b = bytearray(f.read_bytes())
    b[n + 1234 * 40 + 3] ^= 0xFF  # the codes of row 1234
    f.write_bytes(bytes(b))
    bad = open_quant_file(f, tier="disk", direct=direct)
    assert torch.equal(bad.gather(torch.tensor([19000])), QuantTable(codes, scales, fmt).gather(torch.tensor([19000])))
    with pytest.raises(TableError, match="fail their checksum"):
        bad.gather(torch.tensor([1234]))
    b[n + 1234 * 40 + 3] ^= 0xFF
    b[n + 20000 * 40 + 10] ^= 0xFF  # a scale
    f.write_bytes(bytes(b))
    with pytest.raises(TableError, match="fail their checksum"):
        open_quant_file(f, tier="disk")
    with pytest.raises(TableError, match="tier must be"):
        open_quant_file(f, tier="ram")


def test_served_formats_keep_the_model_close(tmp_path):
    pytest.importorskip("transformers")
    from engram.model import EngramForCausalLM
    from engram.training.presets import tiny

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 24))
    ref = EngramForCausalLM(tiny()).eval()
    with torch.no_grad():
        want = ref(ids).logits
    for fmt, tol in [("bfloat16", 0.05), ("int8", 0.05), ("fp8", 0.3)]:
        m = EngramForCausalLM(tiny()).eval()
        m.load_state_dict(ref.state_dict())
        d = m.model.layers[1].engram.multi_head_embedding.dim
        per_row = set_table_format(m, fmt)
        assert set(per_row.values()) == {d * 2 if fmt == "bfloat16" else d + (2 if fmt == "int8" else 1)}
        with torch.no_grad():
            got = m(ids).logits
        assert not torch.equal(got, want) and float((got - want).abs().max()) < tol, fmt


def test_an_unknown_table_format_names_every_served_one():
    """One check (`check_table_format`) for set_table_format and the vLLM plugin's options: the message lists
    what set_table_format serves, not only the quantized formats."""
    with pytest.raises(TableError, match=r"table format must be one of \('float32', 'bfloat16', 'int8', 'fp8', "
                                         r"'fp8_ue8m0', 'nvfp4'\), got 'tape'"):
        set_table_format(torch.nn.Module(), "tape")


SERVED = {  # format -> (the rows it serves of float rows W (N, d), its bytes per row of d values)
    "float32": (lambda w: w, lambda d: 4 * d),
    "bfloat16": (lambda w: w.to(torch.bfloat16), lambda d: 2 * d),
    "int8": (lambda w: dequantize(*quantize_rows(w, "int8"), "int8"), lambda d: d + 2),
    "fp8": (lambda w: dequantize(*quantize_rows(w, "fp8"), "fp8"), lambda d: d + 1),
    "fp8_ue8m0": (lambda w: dequantize_ue8m0(*quantize_ue8m0(w), torch.float32), lambda d: d + d // 32),
    "nvfp4": (lambda w: dequantize_nvfp4(*quantize_nvfp4(w), torch.float32), lambda d: d // 2 + d // 16),
}


@pytest.mark.parametrize("tier", ["ram", "mmap"])
@pytest.mark.parametrize("fmt", TABLE_FORMATS)
def test_every_table_format_is_served_by_the_one_loop(tmp_path, fmt, tier):
    """set_table_format's one install loop (format -> codec): each format's rows bit for bit what its codec's own
    encoder and decoder give, and its bytes per row."""
    pytest.importorskip("transformers")
    from engram.model import EngramForCausalLM
    from engram.tables import find_tables, offload_tables
    from engram.training.presets import tiny

    assert tuple(SERVED) == TABLE_FORMATS
    torch.manual_seed(0)
    m = EngramForCausalLM(tiny(engram=dict(engram_vocab_size=[1009, 1013], n_embed_per_ngram=64,
                                           n_head_per_ngram=2, layer_ids=[1]))).eval()
    (_, mhe), = find_tables(m)
    w, d = mhe.embedding.weight.detach().clone(), mhe.dim
    if tier != "ram":
        offload_tables(m, tier, tmp_path)
    serves, per_row = SERVED[fmt]
    assert set_table_format(m, fmt) == {1: per_row(d)}
    got = mhe.table.gather(torch.arange(mhe.num_rows)) if mhe.table is not None else mhe.embedding.weight.detach()
    want = serves(w)
    assert got.dtype == want.dtype and torch.equal(got, want), fmt


@pytest.mark.parametrize("codec", [FloatCodec(torch.bfloat16), ScaledRowCodec("int8"), ScaledRowCodec("fp8"),
                                   Ue8m0Codec(), "nvfp4"])
def test_codecs_encode_a_chunk_of_rows_at_a_time_to_the_same_bytes(codec):
    """`RowCodec.encode` is per row (NVFP4's table scale is fixed by `Nvfp4Codec.of_rows`): rows encoded in chunks,
    as the one loop streams them into a file, are the bytes of the whole table encoded at once."""
    W = torch.randn(1000, 64) * torch.logspace(-2, 2, 1000)[:, None]
    codec = Nvfp4Codec.of_rows(W) if codec == "nvfp4" else codec
    whole = codec.encode(W)
    for i, part in enumerate(whole):
        chunked = torch.cat([codec.encode(W[s:s + 300])[i] for s in range(0, 1000, 300)])
        assert torch.equal(chunked.view(torch.uint8), part.view(torch.uint8))
    assert torch.equal(codec.decode(whole, 64, torch.float32), EncodedTable(whole, codec, torch.float32).gather(
        torch.arange(1000)))
