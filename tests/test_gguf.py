"""GGUF (llama.cpp's format): engram's reader and writer against the gguf package's own GGUFReader/GGUFWriter and
quantizers, every row type through the ram, mmap and disk tiers, damaged files, and the released models' layouts
(qwen4exp's `per_layer_token_embd` + `{arch}.ple.*`, DeepSeek-V4.1's `blk.N.engram_embd` + `{arch}.engram.*`)
loaded from GGUF and from safetensors checkpoints with the same hashing and rows."""

import os
import re
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from bases import ids_with_eos, qwen4_config, tiny_qwen4  # noqa: E402

from engram.integrations.qwen4_exp.gguf import PLE_KEYS, PLE_TABLE  # noqa: E402
from engram.tables.base import TableError  # noqa: E402
from engram.tables.blocks import UnverifiedTableWarning  # noqa: E402
from engram.tables.gguf import (  # noqa: E402
    GGML_TYPES,
    GgufError,
    GgufFile,
    decode_rows,
    encode_rows,
    open_table,
    prime_base,
    write_gguf,
)

Q = gguf.GGMLQuantizationType
WRITABLE = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_1"]  # engram's writer: native, or gguf.quants' quantizer
READ_ONLY = ["Q4_K", "Q6_K", "Q3_K", "IQ4_XS", "IQ4_NL", "MXFP4"]  # gguf.quants decodes these, cannot write them


def rows_of(type_name, n=300, dim=256, seed=0):
    """(stored bytes (n, row_bytes) uint8, values (n, dim) float32) of a table in `type_name`: quantized by the gguf
    package where it can, else random blocks whose float16 scales are made finite (K and IQ types)."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, dim)).astype(np.float32)
    qt = Q[type_name]
    try:
        raw = gguf.quants.quantize(x, qt)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qt]
        raw = g.integers(0, 256, (n, dim // block, size), dtype=np.uint8)
        scale = np.array([0.01], dtype=np.float16).view(np.uint8)
        if type_name in ("Q4_K", "Q3_K", "Q6_K"):  # d (and dmin) float16 at the block's end (Q3_K, Q6_K) or start
            at = {"Q4_K": [0, 2], "Q3_K": [size - 2], "Q6_K": [size - 2]}[type_name]
        else:  # IQ4_XS, IQ4_NL: d first; MXFP4: an e8m0 byte first
            at = [0] if type_name != "MXFP4" else []
        for a in at:
            raw[..., a:a + 2] = scale
        if type_name == "MXFP4":
            raw[..., 0] = 120
        raw = raw.reshape(n, -1)
    return raw.reshape(n, -1).view(np.uint8), gguf.quants.dequantize(raw, qt).reshape(n, dim).astype(np.float32)


def test_type_table_and_value_types_match_the_gguf_package():
    for i, (name, block, size) in GGML_TYPES.items():
        assert Q[name] == i and gguf.GGML_QUANT_SIZES[Q[name]] == (block, size), name
    assert {t.name for t in Q} - {n for n, _, _ in GGML_TYPES.values()} <= {"Q1_0"}  # (newer than this table)
    from engram.tables.gguf import VALUE_TYPES

    assert {i: n for i, (n, _) in VALUE_TYPES.items()} == {t.value: t.name for t in gguf.GGUFValueType}


@pytest.mark.parametrize("type_name", WRITABLE)
def test_writer_to_gguf_reader_and_back_through_every_tier(type_name, tmp_path):
    """engram's writer -> gguf.GGUFReader (metadata, shapes, types, bytes decoded by gguf.quants) and -> engram's
    reader on ram, mmap and disk: the same values; Q8_0 bytes equal the gguf package's quantizer's."""
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((300, 64)).astype(np.float32))
    kv = {"{arch}.ple.layers": ("ARRAY[INT32]", [0]), "{arch}.ple.layer_multipliers": ("ARRAY[UINT64]", [3, 5 ** 20]),
          "{arch}.ple.eos_token_id": ("UINT32", 7), "note": ("STRING", "héllo"), "pi": ("FLOAT32", 3.5)}
    p = write_gguf(tmp_path / "t.gguf", "qwen4exp", kv, [("tab.weight", type_name, x), ("other.weight", "F32", x[:3])])
    r = gguf.GGUFReader(p)
    assert r.fields["general.architecture"].contents() == "qwen4exp"
    assert r.fields["qwen4exp.ple.layer_multipliers"].contents() == [3, 5 ** 20]
    assert r.fields["qwen4exp.ple.layer_multipliers"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64]
    assert r.fields["qwen4exp.ple.eos_token_id"].types == [gguf.GGUFValueType.UINT32]
    assert r.fields["note"].contents() == "héllo" and r.fields["pi"].contents() == 3.5
    t = {t.name: t for t in r.tensors}["tab.weight"]
    assert t.tensor_type == Q[type_name] and list(t.shape) == [64, 300]
    want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(300, 64).astype(np.float32)
    if type_name in ("Q8_0", "F16", "BF16"):  # the bytes are exactly the gguf package's encoding
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1),
                              gguf.quants.quantize(x.numpy(), Q[type_name]).view(np.uint8).reshape(-1))
    f = GgufFile(p)
    assert f.meta["qwen4exp.ple.layer_multipliers"].tolist() == [3, 5 ** 20]
    assert f.tensors["tab.weight"].type == type_name
    assert f.tensors["tab.weight"].offset == int(t.data_offset) and f.data_start == r.data_offset
    ids = torch.tensor([5, 0, 299, 5, 17])
    for backend in ("ram", "mmap", "disk"):
        table = open_table(p, "tab.weight", backend, dtype=torch.float32)
        assert table.num_rows == 300 and table.dim == 64
        assert np.array_equal(table.gather(ids).numpy(), want[ids.numpy()])
        table.close()


@pytest.mark.parametrize("type_name", WRITABLE + READ_ONLY)
def test_gguf_writer_files_read_lazily_from_every_tier_equal_the_eager_decode(type_name, tmp_path):
    """gguf.GGUFWriter (as llama.cpp's converters write) -> engram's reader: rows read lazily (mmap, and the disk
    tier's positioned reads, cold then warm) equal gguf.quants' eager decode of the whole tensor."""
    raw, want = rows_of(type_name)
    w = gguf.GGUFWriter(tmp_path / "g.gguf", "qwen4exp")
    w.add_uint32("qwen4exp.ple.ngram_size", 3)
    w.add_tensor("per_layer_token_embd.weight", raw, raw_dtype=Q[type_name]) if type_name not in ("F32",) else \
        w.add_tensor("per_layer_token_embd.weight", want)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if type_name == "F16":
        want = want.astype(np.float16).astype(np.float32)
    f = GgufFile(tmp_path / "g.gguf")
    assert f.meta["qwen4exp.ple.ngram_size"] == 3 and f.tensors[PLE_TABLE].shape == (300, 256)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (400,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedTableWarning)  # (a llama.cpp file has no block sums)
        for backend in ("ram", "mmap", "disk"):
            t = open_table(f, PLE_TABLE, backend, dtype=torch.float32)
            for _ in range(2):  # the disk tier: cold reads, then the same rows warm from its mapping
                assert np.array_equal(t.gather(ids).numpy(), want[ids.numpy()], equal_nan=True), backend
            assert np.array_equal(t.gather(ids[:5]).numpy(), want[ids[:5].numpy()], equal_nan=True)  # a decode step
            if backend == "disk":
                s = t.stats()
                assert s["reads"] > 0 and s["warm_rows"] > 0 and s["format"] == f"gguf {type_name}"
            t.close()


def test_codecs_match_the_gguf_package_on_every_code():
    """Q8_0 and Q4_0 decoding of every code under several scales (zero, subnormal, large), and Q8_0 encoding
    (ggml's roundf: halves away from zero) byte for byte against gguf.quants."""
    for type_name, block_bytes in (("Q8_0", 34), ("Q4_0", 18)):
        g = np.random.default_rng(2)
        raw = g.integers(0, 256, (64, 8, block_bytes), dtype=np.uint8)
        for i, s in enumerate([0.0, 6e-8, 1.0, -3.5, 60000.0, 2 ** -14, 0.1, -0.0]):
            raw[:, i, :2] = np.array([s], dtype=np.float16).view(np.uint8)
        raw[0, :, 2:] = np.arange(256, dtype=np.uint8)[:block_bytes - 2]  # every byte value somewhere
        raw[1, :, 2:] = np.arange(256, dtype=np.uint8)[-(block_bytes - 2):]
        raw = raw.reshape(64, -1)
        want = gguf.quants.dequantize(raw, Q[type_name]).reshape(64, 256)
        assert np.array_equal(decode_rows(torch.from_numpy(raw), type_name, 256).numpy(), want)  # (numba: Q8_0)
        torch_path = decode_rows(torch.from_numpy(raw), type_name, 256, torch.float64)  # (always the torch ops)
        assert np.array_equal(torch_path.float().numpy(), want)
    x = torch.tensor(np.random.default_rng(3).standard_normal((50, 64)), dtype=torch.float32)
    x[0, :32] = torch.arange(32) - 15.5  # halves: roundf differs from round-half-even here
    x[1] = 0
    for type_name in ("Q8_0", "F16", "BF16", "F32"):
        assert np.array_equal(encode_rows(x, type_name).numpy().reshape(-1),
                              gguf.quants.quantize(x.numpy(), Q[type_name]).view(np.uint8).reshape(-1)), type_name


# ------------------------------------------------------------------------------------------ damaged files
def _ple_file(tmp_path, type_name="Q8_0"):
    x = torch.randn(200, 64)
    return write_gguf(tmp_path / "d.gguf", "qwen4exp", {"{arch}.ple.ngram_size": ("UINT32", 3)},
                      [(PLE_TABLE, type_name, x)])


def test_damaged_files_are_one_line_errors(tmp_path):
    p = _ple_file(tmp_path)
    good = p.read_bytes()
    f = GgufFile(p)

    def damaged(b: bytes) -> Path:
        q = tmp_path / "bad.gguf"
        q.write_bytes(b)
        return q

    cases = [
        (good[:len(good) - 5000], r"is truncated: tensor 'per_layer_token_embd.weight' ends at byte"),
        (good[:40], r"is truncated inside its header"),
        (b"GGUX" + good[4:], r"is not a GGUF file"),
        (good.replace(struct.pack("<I", 8) + struct.pack("<Q", f.tensors[PLE_TABLE].offset - f.data_start),
                      struct.pack("<I", 99) + struct.pack("<Q", f.tensors[PLE_TABLE].offset - f.data_start)),
         r"unknown ggml row type 99"),
        (good[:4] + struct.pack("<I", 7) + good[8:], r"GGUF version 7 is not supported"),
    ]
    key = b"qwen4exp.ple.ngram_size"
    at = good.index(key) - 8
    cases.append((good[:at] + struct.pack("<Q", 1 << 62) + good[at + 8:], r"corrupt header"))
    for b, msg in cases:
        with pytest.raises(GgufError, match=msg) as e:
            open_table(damaged(b), PLE_TABLE, "disk")
        assert "\n" not in str(e.value)
    with pytest.raises(GgufError, match=r"has no tensor 'blk.1.engram_embd.weight'"):
        open_table(p, "blk.1.engram_embd.weight")
    with pytest.raises(GgufError, match=r"has no metadata key 'qwen4exp.ple.layers'"):
        f.key(PLE_KEYS["layers"])
    with pytest.raises(GgufError, match="not found"):
        GgufFile(tmp_path / "missing.gguf")


def test_a_flipped_byte_in_a_written_table_fails_its_block_check_on_first_read(tmp_path):
    p = _ple_file(tmp_path, "BF16")
    f = GgufFile(p)
    b = bytearray(p.read_bytes())
    b[f.tensors[PLE_TABLE].offset + 128 * 10 + 3] ^= 0xFF  # row 10 (128 bytes a row)
    with open(p, "r+b") as fh:  # in place: the header (and so the block sums' file id) is unchanged
        fh.write(bytes(b))
    for backend in ("mmap", "disk"):
        t = open_table(p, PLE_TABLE, backend)
        with pytest.raises(TableError, match="fail their checksum"):
            t.gather(torch.tensor([10]))
        t.close()
    with pytest.raises(TableError, match="fail their checksum"):
        open_table(p, PLE_TABLE, "ram")


# ------------------------------------------------------------------------------------------ llama.cpp's key names
def test_key_names_and_types_are_llama_cpps():
    """Against the llama.cpp sources that llama-cpp-python's sdist vendors (set ENGRAM_LLAMA_CPP_SRC to its
    vendor/llama.cpp folder): every qwen4exp PLE key, the table's tensor name, and the value types its converter
    writes."""
    src = os.environ.get("ENGRAM_LLAMA_CPP_SRC")
    if not src or not (Path(src) / "src" / "llama-arch.cpp").is_file():
        pytest.skip("set ENGRAM_LLAMA_CPP_SRC to llama-cpp-python's vendor/llama.cpp to check llama.cpp's key names")
    arch = (Path(src) / "src" / "llama-arch.cpp").read_text()
    consts = (Path(src) / "gguf-py" / "gguf" / "constants.py").read_text()
    writer = (Path(src) / "gguf-py" / "gguf" / "gguf_writer.py").read_text()
    for k, template in PLE_KEYS.items():
        c_form = template.replace("{arch}", "%s")
        assert f'"{c_form}"' in arch, k
        if k != "row_dim":
            assert f'"{template}"' in consts, k
    assert '"per_layer_token_embd"' in arch and PLE_TABLE == "per_layer_token_embd.weight"
    assert "MODEL_ARCH.QWEN4EXP:         \"qwen4exp\"" in consts
    for k in ("layer_multipliers", "head_offsets", "head_vocab_sizes"):  # u64 arrays, as ple_kv writes them
        assert re.search(rf"def add_ple_{k}\(.*\n\s+self\._add_u64_array", writer), k
    for k in ("ngram_size", "heads_per_ngram", "conv_kernel", "eos_token_id"):
        assert re.search(rf"def add_ple_{k}\(.*\n\s+self\.add_uint32", writer), k


# ------------------------------------------------------------------------------------------ qwen4exp (llama.cpp)
def _qwen():
    pytest.importorskip("transformers")
    return pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")


def tiny_qwen(seed=0, **kw):
    """A tiny random Qwen4Exp with one PLE layer (decoder layer 0, linear attention: what llama.cpp takes), rows
    128 / 4 heads = 32 wide (one Q8_0 block)."""
    _qwen()
    return tiny_qwen4(seed, **{**dict(ple_layer_ids=[1], ple_embed_dim=128, split_ngram_parts=2), **kw})


def llama_cpp_style_ple_file(path, model, type_name, raw=None):
    """What llama.cpp's converter (conversion/qwen4exp.py with gguf-py's add_ple_* writers) writes for the table,
    through gguf.GGUFWriter: keys with the same names and value types, the padded table as one tensor."""
    from engram.integrations.qwen4_exp import hash_mapping, text_config

    cfg = text_config(model.config)
    m = hash_mapping(cfg)
    w = model.model.layers[0].ple.ple_embedding.ngram_embedding.weight.detach()
    g = gguf.GGUFWriter(path, "qwen4exp")
    g.add_vocab_size(cfg.vocab_size)
    g.add_array("qwen4exp.ple.layers", [0])
    for k, v in (("ngram_size", cfg.ngram_size), ("heads_per_ngram", cfg.heads_per_ngram),
                 ("conv_kernel", cfg.ple_conv_kernel_size), ("eos_token_id", cfg.eos_token_id)):
        g.add_uint32(f"qwen4exp.ple.{k}", v)
    g.add_embedding_length_per_layer_input(w.shape[1])
    for k, v in (("layer_multipliers", m.layer_multipliers[1]), ("head_offsets", m.head_offsets(1)),
                 ("head_vocab_sizes", m.head_sizes(1))):
        g.add_key_value(f"qwen4exp.ple.{k}", [int(x) for x in v], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64)
    if raw is not None:  # the table's bytes as given (a type gguf cannot quantize)
        g.add_tensor(PLE_TABLE, raw, raw_dtype=Q[type_name])
    elif type_name == "F32":
        g.add_tensor(PLE_TABLE, w.numpy())
    else:
        g.add_tensor(PLE_TABLE, gguf.quants.quantize(w.numpy(), Q[type_name]), raw_dtype=Q[type_name])
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return path


@pytest.mark.parametrize("writer,backend", [("engram", "ram"), ("engram", "mmap"), ("engram", "disk"),
                                            ("gguf", "disk")])
def test_qwen4exp_from_gguf_equals_the_safetensors_checkpoint(writer, backend, tmp_path):
    """A tiny checkpoint written both ways (save_pretrained; engram's export_gguf or gguf.GGUFWriter as llama.cpp's
    converter does): the GGUF's hashing is the config's (same identity digest, same row ids), and the model served
    from the GGUF (ram, mmap, disk) gives transformers' logits and generations; saved back, plain transformers
    loads it."""
    mq = _qwen()
    from engram.hashing import identity_digest
    from engram.integrations.qwen4_exp import export_gguf, from_pretrained, gguf_hash_mapping, hash_mapping

    ref = tiny_qwen()
    ref.save_pretrained(tmp_path / "ckpt")
    p = tmp_path / "t.gguf"
    export_gguf(ref, p, "F32") if writer == "engram" else llama_cpp_style_ple_file(p, ref, "F32")
    cfg = ref.config
    want_map, got_map = hash_mapping(cfg), gguf_hash_mapping(p)
    assert identity_digest(got_map.family.spec()) == identity_digest(want_map.family.spec())
    # the spec agrees but for the table-size base, which the file does not store: the smallest base giving its
    # primes is recorded (5000 for this config's 5003; the released 20,000,000 is recovered exactly)
    got_spec, want_spec = got_map.family.config_spec(), want_map.family.config_spec()
    assert (got_spec.pop("prime_base"), want_spec.pop("prime_base")) == (5000, 5003) and got_spec == want_spec
    assert prime_base(20_000_003) == 20_000_000
    ids = ids_with_eos(qwen4_config(), 2, 14, 1, eos_every=5)
    assert torch.equal(got_map.hash(ids, offsets=True)[1], want_map.hash(ids, offsets=True)[1])
    with torch.no_grad():
        want = ref(ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedTableWarning)
        m = from_pretrained(tmp_path / "ckpt", tier=backend, gguf=p)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)
    if backend != "disk":
        return
    assert torch.equal(m.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0),
                       ref.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0))
    m.save_pretrained(tmp_path / "again")  # the table goes back into the checkpoint's shape, padding rows included
    with torch.no_grad():
        assert torch.equal(mq.Qwen4ExpForCausalLM.from_pretrained(tmp_path / "again").eval()(ids).logits, want)


@pytest.mark.parametrize("type_name", ["F16", "BF16", "Q8_0", "Q4_K"])
def test_qwen4exp_rows_of_each_row_type_are_the_files_decoded(type_name, tmp_path):
    """Served from a GGUF of any row type (engram's writer; Q4_K, which gguf cannot quantize, as a K-quant file
    llama.cpp's quantizer writes, random blocks through gguf.GGUFWriter), a layer's rows are the file's rows as
    gguf.quants decodes them, on every tier."""
    from engram.integrations.qwen4_exp import export_gguf, hash_mapping, serve_tables

    kw = {"ple_embed_dim": 1024} if type_name == "Q4_K" else {}  # (rows of 256: one K-quant super-block)
    ref = tiny_qwen(**kw)
    p = tmp_path / "t.gguf"
    if type_name == "Q4_K":
        n = ref.model.layers[0].ple.ple_embedding.ngram_embedding.weight.shape[0]
        llama_cpp_style_ple_file(p, ref, "Q4_K", raw=rows_of("Q4_K", n=n, dim=256)[0])
    else:
        export_gguf(ref, p, type_name)
    r = {t.name: t for t in gguf.GGUFReader(p).tensors}[PLE_TABLE]
    file_rows = gguf.quants.dequantize(r.data, r.tensor_type).reshape(r.shape[::-1].tolist())
    used = sum(hash_mapping(ref.config).head_sizes(1))
    for backend in ("ram", "mmap", "disk"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnverifiedTableWarning)
            m = serve_tables(tiny_qwen(seed=5, **kw), backend=backend, gguf=p, prefetch=False)
        t = m.model.layers[0].ple.ple_embedding.mhe.table
        assert t.num_rows == used
        assert np.array_equal(t.gather(torch.arange(used)).float().numpy(), file_rows[:used]), backend
        t.close()


def test_qwen4exp_gguf_mismatches_are_one_line_and_load_nothing(tmp_path):
    from engram.config import ConfigError
    from engram.integrations.qwen4_exp import export_gguf, gguf_hash_mapping, serve_tables

    ref = tiny_qwen()
    p = export_gguf(ref, tmp_path / "t.gguf", "F32")
    cfg = tiny_qwen().config
    cfg.seed = 99  # another hash seed
    other = _qwen().Qwen4ExpForCausalLM(cfg).eval()
    q = export_gguf(other, tmp_path / "s99.gguf", "F32")
    with pytest.raises(GgufError, match=r"hash constants 'multipliers' differ .* seed 1234.*pass seed="):
        gguf_hash_mapping(q)
    assert gguf_hash_mapping(q, seed=99).layer_multipliers[1].tolist() == \
        other.model.layers[0].ple.ple_embedding.layer_multipliers.tolist()
    m = tiny_qwen(seed=1)
    before = m.model.layers[0].ple.ple_embedding
    with pytest.raises(GgufError, match=r"'multipliers' differ from what this model's config derives"):
        serve_tables(m, tier="disk", gguf=q)
    assert m.model.layers[0].ple.ple_embedding is before  # nothing half-loaded
    with pytest.raises(ConfigError, match="2 PLE layers; llama.cpp's qwen4exp GGUF holds one"):
        export_gguf(tiny_qwen(ple_layer_ids=[1, 3]), tmp_path / "two.gguf")
    b = p.read_bytes()  # a table shorter than the heads address
    f = GgufFile(p)
    assert serve_tables(tiny_qwen(), gguf=p, prefetch=False) is not None
    with pytest.raises(GgufError, match="is truncated"):
        (tmp_path / "short.gguf").write_bytes(b[:f.tensors[PLE_TABLE].offset + 100])
        serve_tables(tiny_qwen(), gguf=tmp_path / "short.gguf")


# ------------------------------------------------------------------------------------------ DeepSeek-V4.1 (PR #28696)
def _v41():
    import test_deepseek_v41 as tv

    return tv


@pytest.fixture(scope="module")
def v41_ckpt(tmp_path_factory):
    tv = _v41()
    d = tmp_path_factory.mktemp("v41")
    text = [f"The quick brown fox jumps over the lazy dog, line {i} of the tale, said THE king." for i in range(300)]
    from engram.tokenizer import train_bpe

    tok = train_bpe(text, 300, d / "tok.json", progress=False)
    return tv.write_checkpoint(d / "ckpt", tok)


def pr_style_v41_file(path, mem, type_name="Q8_0"):
    """What PR #28696's converter writes for the Engram part, through gguf.GGUFWriter: `deepseek41.engram.*` keys
    with its value types (u32 sizes, add_array's i32 layer ids, u64 constants, i32 token map, the compressed pad)
    and each table requantized from FP8 x ue8m0 to Q8_0 by gguf.quantize."""
    m = mem.mapping
    g = gguf.GGUFWriter(path, "deepseek41")
    g.add_uint32("deepseek41.engram.head_count", m.n_head_per_ngram)
    g.add_uint32("deepseek41.engram.key_length", mem.config.head_dim)
    g.add_uint32("deepseek41.engram.max_ngram_size", m.max_ngram_size)
    g.add_array("deepseek41.engram.layer_ids", list(m.layer_ids))
    u64 = gguf.GGUFValueType.UINT64
    for k, v in (("multipliers", [m.layer_multipliers[l] for l in m.layer_ids]),
                 ("primes", [m.head_sizes(l) for l in m.layer_ids]),
                 ("offsets", [m.head_offsets(l) for l in m.layer_ids])):
        g.add_key_value(f"deepseek41.engram.{k}", [int(x) for x in np.asarray(v).reshape(-1)], gguf.GGUFValueType.ARRAY,
                        u64)
    g.add_key_value("deepseek41.engram.token_map", [int(x) for x in m.compressed_tokenizer.lookup_table],
                    gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    g.add_uint32("deepseek41.engram.pad_id", int(m.compressed_pad_id))
    for lid, layer in mem.layers.items():
        rows = layer.table.gather(torch.arange(layer.table.num_rows)).float().numpy()
        g.add_tensor(f"blk.{lid}.engram_embd.weight", gguf.quants.quantize(rows, Q[type_name]), raw_dtype=Q[type_name])
        g.add_tensor(f"blk.{lid}.engram_wkv.weight", layer.wkv.weight.detach().float().numpy())
        g.add_tensor(f"blk.{lid}.engram_q.weight", layer.q_weight.detach().float().numpy())
        g.add_tensor(f"blk.{lid}.engram_k.weight", layer.k_weight.detach().float().numpy())
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return path


@pytest.mark.parametrize("writer", ["engram", "gguf"])
def test_v41_from_gguf_equals_the_safetensors_checkpoint(v41_ckpt, writer, tmp_path):
    """The checkpoint's Engram as GGUF (engram's export_gguf in BF16, which holds FP8 x ue8m0 rows exactly; or
    Q8_0 through gguf.GGUFWriter as the PR's converter writes it), loaded back on every tier: the same hashing
    (identity digest, row ids with DEAD masks) and rows (exactly, or the file's Q8_0 rows as gguf decodes them),
    and for BF16 the same layer outputs."""
    from engram.hashing import identity_digest
    from engram.integrations import deepseek_v41 as v41

    ref = v41.load(v41_ckpt, "ram")
    p = tmp_path / "v41.gguf"
    v41.export_gguf(ref, p, "BF16") if writer == "engram" else pr_style_v41_file(p, ref)
    ids = torch.randint(0, ref.mapping.raw_vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    dead = torch.zeros(2, 12, dtype=torch.bool)
    dead[1, 3:5] = True
    want_ids = ref.mapping.hash(ids, offsets=True, dead=dead)
    h = torch.randn(2, 12, 2, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    r = {t.name: t for t in gguf.GGUFReader(p).tensors}
    for backend in ("ram", "mmap", "disk"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnverifiedTableWarning)
            mem = v41.load_gguf(p, backend)
        assert identity_digest(mem.mapping.family.spec()) == identity_digest(ref.mapping.family.spec())
        got_ids = mem.mapping.hash(ids, offsets=True, dead=dead)
        for lid in (1, 3):
            assert torch.equal(got_ids[lid], want_ids[lid])
            t = r[f"blk.{lid}.engram_embd.weight"]
            file_rows = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, 64).copy())
            got = mem.layers[lid].table.gather(torch.arange(2600))
            assert torch.equal(got, file_rows.to(torch.bfloat16))
            if writer == "engram":
                assert torch.equal(got, ref.layers[lid].table.gather(torch.arange(2600)))
                assert torch.equal(mem.layers[lid](h, got_ids[lid], mask=~dead),
                                   ref.layers[lid](h, want_ids[lid], mask=~dead))
        mem.close()


def test_v41_gguf_errors_are_one_line_and_open_nothing(v41_ckpt, tmp_path):
    from engram.integrations import deepseek_v41 as v41

    ref = v41.load(v41_ckpt, "ram")
    p = v41.export_gguf(ref, tmp_path / "v41.gguf", "Q8_0")
    f = GgufFile(p)
    b = p.read_bytes()

    def variant(old: bytes, new: bytes, name: str) -> Path:
        q = tmp_path / name
        assert b.count(old) == 1
        q.write_bytes(b.replace(old, new))
        return q

    # a wrong key name (same length, so the rest of the header still parses)
    with pytest.raises(GgufError, match=r"no metadata key 'deepseek41.engram.pad_id'"):
        v41.load_gguf(variant(b"deepseek41.engram.pad_id", b"deepseek41.engram.pad_ix", "key.gguf"))
    # a damaged constant: the first multiplier (u64, the array's first element after its type and count)
    key = b"deepseek41.engram.multipliers"
    at = b.index(key) + len(key) + 4 + 4 + 8
    bad = bytearray(b)
    bad[at] ^= 2
    (tmp_path / "mult.gguf").write_bytes(bytes(bad))
    with pytest.raises(GgufError, match=r"hash constants 'multipliers' differ from what the family's rules derive"):
        v41.load_gguf(tmp_path / "mult.gguf")
    (tmp_path / "short.gguf").write_bytes(b[:f.tensors["blk.3.engram_embd.weight"].offset + 10])
    with pytest.raises(GgufError, match=r"is truncated: tensor 'blk.3.engram_embd.weight' ends at"):
        v41.load_gguf(tmp_path / "short.gguf", "disk")
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    with pytest.raises(GgufError, match=r"has no tensor 'blk.3.engram_q.weight'"):
        v41.load_gguf(variant(b"blk.3.engram_q.weight", b"blk.3.engram_x.weight", "tensor.gguf"), "disk")
    if fds is not None:  # checked before any table opened: no file left open (layer 1's table included)
        assert len(os.listdir("/proc/self/fd")) == fds


def test_row_types_the_gguf_package_cannot_write_are_one_line(tmp_path):
    with pytest.raises(GgufError, match="cannot quantize ggml type Q4_K; write F16, BF16 or Q8_0"):
        write_gguf(tmp_path / "k.gguf", "x", {}, [("t", "Q4_K", torch.randn(4, 256))])
    with pytest.raises(GgufError, match="unknown ggml type 'Q9_9'"):
        write_gguf(tmp_path / "k.gguf", "x", {}, [("t", "Q9_9", torch.randn(4, 256))])
    assert not (tmp_path / "k.gguf").exists() and not list(tmp_path.iterdir())  # nothing half-written


def test_block_sums_added_to_a_llama_cpp_file_check_its_reads(tmp_path):
    """A GGUF without sums (as llama.cpp's converters write it) opens with one warning; `write_block_sums` adds
    4 KiB sums bound to its header, after which the disk tier checks every block on its first read."""
    from engram.tables.blocks import write_block_sums

    p = write_gguf(tmp_path / "l.gguf", "qwen4exp", {}, [(PLE_TABLE, "Q8_0", torch.randn(500, 64))], block_sums=False)
    assert not (tmp_path / "l.gguf.blocks").exists()
    with pytest.warns(UnverifiedTableWarning, match="no block checksums"):
        open_table(p, PLE_TABLE, "disk").close()
    write_block_sums(p, 4096)
    f = GgufFile(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnverifiedTableWarning)
        t = open_table(p, PLE_TABLE, "disk")
    assert t.src.blocks is not None and t.src.blocks.data_offset == f.data_start
    t.gather(torch.arange(500))
    t.close()
    with open(p, "r+b") as fh:
        fh.seek(f.tensors[PLE_TABLE].offset + 68 * 300)
        fh.write(b"\xff\xff")
    t = open_table(p, PLE_TABLE, "disk")
    with pytest.raises(TableError, match=r"rows 240-301 \(block 4 of 9\) fail their checksum"):
        t.gather(torch.tensor([300]))
    t.close()
