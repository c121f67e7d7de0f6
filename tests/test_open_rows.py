"""`tables.open_rows`: the same stored rows opened in every tier give the same gathers, for each codec and source;
a bad tier or a missing file is one `TableError` line naming the fix."""

import warnings

import pytest
import torch

from engram.tables import TIERS, EncodedTable, RowBlocks, StoredTensor, TableError, open_rows
from engram.tables.codecs import (
    FloatCodec,
    Nvfp4Codec,
    ScaledRowCodec,
    Ue8m0Codec,
    decode_rows,
    encode_rows,
    pack_rows,
    quantize_nvfp4,
    quantize_rows,
    quantize_ue8m0,
)
from engram.tables.files import write_safetensors
from engram.tables.rows import write_rows

# (the test shards are written without block sums, as released checkpoints are: their one warning is tested below)
pytestmark = pytest.mark.filterwarnings("ignore::engram.tables.blocks.UnverifiedTableWarning")
torch.manual_seed(0)
W = torch.randn(3000, 64)
IDS = torch.cat([torch.randperm(3000)[:700], torch.tensor([0, 2999, 5, 5])])


def encoded(kind):
    """(parts in RAM, codec) of W in codec `kind`."""
    if kind == "fp8":
        return quantize_rows(W, "fp8"), ScaledRowCodec("fp8")
    if kind == "int8":
        return quantize_rows(W, "int8"), ScaledRowCodec("int8")
    if kind == "fp8_ue8m0":
        return quantize_ue8m0(W), Ue8m0Codec()
    packed, scales, g = quantize_nvfp4(W)
    return (packed, scales), Nvfp4Codec(g)


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8_ue8m0", "nvfp4"])
def test_every_tier_gathers_the_same_rows_from_a_file(tmp_path, kind):
    parts, codec = encoded(kind)
    want = EncodedTable(parts, codec).gather(IDS)
    f = write_rows(tmp_path / "t.safetensors", parts, codec, page_blocks=True)
    for tier in TIERS:
        t = open_rows(f, tier)
        assert isinstance(t, EncodedTable) and t.codec.name == kind and (t.num_rows, t.dim) == (3000, 64)
        assert torch.equal(t.gather(IDS), want), tier
        t.close()


@pytest.mark.parametrize("kind", ["float", "fp8_ue8m0", "nvfp4"])
def test_rows_given_in_ram_as_blocks_or_in_place_are_the_same_in_every_tier(tmp_path, kind):
    """One source three ways (tensors in RAM, a stream of row blocks, tensors of a safetensors file read in place),
    each opened in every tier (with `dir`: written there first, packed), gathers the same rows."""
    if kind == "float":
        parts, codec, want = (W.to(torch.bfloat16),), None, W.to(torch.bfloat16)[IDS]
    else:
        parts, codec = encoded(kind)
        want = EncodedTable(parts, codec).gather(IDS)
    shard = write_safetensors(tmp_path / "shard.safetensors",
                              [(f"p{i}", p.dtype, tuple(p.shape), iter([p])) for i, p in enumerate(parts)])
    in_place = tuple(StoredTensor(shard, f"p{i}") for i in range(len(parts)))
    packed = pack_rows(*parts) if codec is not None else parts[0]
    for tier in TIERS:
        for how in ("ram", "blocks", "in place", "in place, copied"):
            if how == "ram":
                source = parts if len(parts) > 1 else parts[0]
            elif how == "blocks":
                source = RowBlocks(tuple(packed.shape), packed.dtype, iter(packed.split(1000)))
            else:
                source = in_place if len(in_place) > 1 else in_place[0]
            d = tmp_path / f"{tier}-{how}" if tier != "ram" and how != "in place" else None
            t = open_rows(source, tier, d, codec=codec, file="rows.safetensors")
            assert torch.equal(t.gather(IDS), want), (tier, how)
            t.close()


def test_gguf_tensors_open_in_every_tier(tmp_path):
    from engram.tables.gguf import write_gguf

    f = write_gguf(tmp_path / "t.gguf", "test", {}, [("tab.weight", "Q8_0", W)])
    want = decode_rows(encode_rows(W, "Q8_0"), "Q8_0", 64)[IDS]
    for tier in TIERS:
        t = open_rows(f, tier, tensor="tab.weight")
        assert t.codec.name == "gguf Q8_0" and torch.equal(t.gather(IDS), want), tier
        t.close()


def test_segments_are_one_table_in_every_tier(tmp_path):
    segs = [W[:1000].to(torch.bfloat16), W[1000:].to(torch.bfloat16)]
    shard = write_safetensors(tmp_path / "s.safetensors",
                              [(f"e{i}", s.dtype, tuple(s.shape), iter([s])) for i, s in enumerate(segs)])
    source = [StoredTensor(shard, "e0"), StoredTensor(shard, "e1")]
    want = W.to(torch.bfloat16)[IDS]
    for tier, d in (("ram", None), ("mmap", None), ("disk", None), ("mmap", tmp_path / "m"), ("disk", tmp_path / "k")):
        t = open_rows(source, tier, d, file="all.safetensors")
        assert t.num_rows == 3000 and torch.equal(t.gather(IDS), want), (tier, d)
        t.close()


def test_a_bad_tier_or_a_missing_file_is_one_table_error_naming_the_fix(tmp_path):
    from engram.config import ConfigError

    cases = [(lambda: open_rows(tmp_path / "none.safetensors", "mmap"), "table file not found: .*write it first"),
             (lambda: open_rows(W, "gpu"), "tier must be 'ram', 'mmap' or 'disk', got 'gpu'"),
             (lambda: open_rows(W, "mmap"), "pass dir= .* or tier='ram'"),
             (lambda: open_rows(W, "mmap", tmp_path), "needs file="),
             (lambda: open_rows(W, "ram", queue_dept=3), "unknown option"),
             (lambda: open_rows(*encoded("fp8")[:1], "ram", codec=Ue8m0Codec()), "do not fit codes")]
    for fn, msg in cases:
        with pytest.raises(TableError, match=msg) as e:
            fn()
        assert "\n" not in str(e.value) and isinstance(e.value, ConfigError)


def test_in_place_files_without_sums_warn_once_per_call(tmp_path):
    from engram.tables.blocks import UnverifiedTableWarning

    parts, codec = encoded("fp8_ue8m0")
    shard = write_safetensors(tmp_path / "x.safetensors", [("c", torch.uint8, tuple(parts[0].shape), iter([parts[0]])),
                                                           ("s", torch.uint8, tuple(parts[1].shape), iter([parts[1]]))],
                              block_sums=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = open_rows((StoredTensor(shard, "c"), StoredTensor(shard, "s")), "disk", codec=codec)
    said = [w for w in caught if issubclass(w.category, UnverifiedTableWarning)]
    assert len(said) == 1 and "dir=DIR" in str(said[0].message)
    assert torch.equal(t.gather(IDS), EncodedTable(parts, codec).gather(IDS))
    t.close()


def test_float_codec_is_the_stored_rows():
    t = EncodedTable((W.to(torch.bfloat16),), FloatCodec(torch.bfloat16))
    assert t.bytes_per_row == 128 and torch.equal(t.gather(IDS), W.to(torch.bfloat16)[IDS])
