"""GGUF files (llama.cpp's format): n-gram tables and their hash constants read in place, and tables written as GGUF.

    f = GgufFile("model.gguf")                       # header, metadata, tensor infos; no tensor byte is read
    f.meta["qwen4exp.ple.ngram_size"]                 # metadata values (int, float, str, bool, list, numpy array)
    t = open_table(f, "per_layer_token_embd.weight", backend="disk")   # a read-only Table over the rows in place
    rows = t.gather(ids)                              # (N, dim), decoded from the file's row type after the gather
    write_gguf(path, "qwen4exp", kv, [("per_layer_token_embd.weight", "Q8_0", rows)])   # streamed, atomic

Layout (GGUF v3, little-endian): `b"GGUF"`, version u32, tensor count u64, metadata count u64, the metadata
(key string, value type u32, value), the tensor infos (name, dims u64 each with ne0 innermost, ggml type u32,
offset u64 into the data section), then the data section at the next multiple of `general.alignment` (32 by
default). A table is a 2-D tensor `[ne0 = dim, ne1 = rows]`: numpy/torch shape `(rows, dim)`, each row
`dim / block * type_size` contiguous bytes, so a row is one read whatever its type.

Row types (`GGML_TYPES`): F32, F16, BF16 and Q8_0 (32 int8 codes and one float16 scale per block, the type
llama.cpp's converters write for these tables) and Q4_0 are decoded here (torch ops, no dependency); every other
ggml type the `gguf` package can dequantize (the K-quants Q2_K..Q6_K that DeepSeek-V4.1 GGUFs use, IQ4_XS of
the community Qwen3.8 files, the other IQ and TQ types, MXFP4, NVFP4, ...) is decoded by `gguf.quants` after
the gather, one row's blocks at a time (install `gguf`). Writing: F32, F16, BF16, Q8_0 (ggml's reference
rounding: the bytes equal `gguf.quants.quantize`'s, tested) and any type `gguf.quants` can quantize.

Why a reader and a writer of our own instead of `gguf.GGUFReader`/`GGUFWriter` (which the tests check both
against): the tiers read rows at byte offsets without parsing the file into Python objects; tables larger than
RAM are written in row blocks through `persist.atomic_file` with 4 KiB block sums beside the file (the disk
tier's checked reads), which `GGUFWriter` (whole tensors, its own file handling) does not do; and every damaged
file is one `GgufError` line, where `GGUFReader` raises assorted numpy and struct errors.

The released models' layouts (key names read off llama.cpp's sources, see docs/models.md): qwen4exp's table
is `per_layer_token_embd.weight` with keys `{arch}.ple.*` (`PLE_KEYS`; llama.cpp reads one PLE layer);
DeepSeek-V4.1's tables are `blk.{layer}.engram_embd.weight` with keys `deepseek41.engram.*` (`V41_KEYS`, as
the open llama.cpp PR #28696 defines them).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import torch

from .._numba import LazyKernels
from .base import Table, TableError
from .blocks import HEADER_IDS


class GgufError(TableError):
    """A GGUF file is missing, damaged or lacks what is asked of it; the message names the file and the fix."""


MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
FIX = "re-download or re-convert the file"

# ggml tensor types: id -> (name, values per block, bytes per block). The tests check every entry against the
# gguf package's GGML_QUANT_SIZES and GGMLQuantizationType.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
              19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
              23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
              28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
              35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36)}
TYPE_IDS = {name: i for i, (name, _, _) in GGML_TYPES.items()}
NATIVE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")  # decoded here; the rest through gguf.quants
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # rows mapped as these dtypes
_NP_FLOAT = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}

# metadata value types: id -> (name, struct format or None)
VALUE_TYPES = {0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
               5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"), 8: ("STRING", None),
               9: ("ARRAY", None), 10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d")}
VALUE_IDS = {name: i for i, (name, _) in VALUE_TYPES.items()}
_NP_VALUE = {"UINT8": "<u1", "INT8": "<i1", "UINT16": "<u2", "INT16": "<i2", "UINT32": "<u4", "INT32": "<i4",
             "FLOAT32": "<f4", "BOOL": "?", "UINT64": "<u8", "INT64": "<i8", "FLOAT64": "<f8"}

# llama.cpp's key names (src/llama-arch.cpp, gguf-py/gguf/constants.py of the llama.cpp that llama-cpp-python
# 0.3.36 vendors; DeepSeek-V4.1's from PR #28696). `{arch}` is general.architecture.
PLE_TABLE = "per_layer_token_embd.weight"
PLE_KEYS = {k: "{arch}.ple." + k for k in ("layers", "ngram_size", "heads_per_ngram", "conv_kernel",
                                            "layer_multipliers", "head_offsets", "head_vocab_sizes",
                                            "eos_token_id", "image_token_id")}
PLE_KEYS["row_dim"] = "{arch}.embedding_length_per_layer_input"
V41_TABLE = "blk.{layer}.engram_embd.weight"
V41_TENSORS = {"wkv": "blk.{layer}.engram_wkv.weight", "q_weight": "blk.{layer}.engram_q.weight",
               "k_weight": "blk.{layer}.engram_k.weight"}
V41_KEYS = {k: "{arch}.engram." + k for k in ("layer_ids", "head_count", "key_length", "max_ngram_size",
                                               "multipliers", "primes", "offsets", "token_map", "pad_id")}
VOCAB_KEY = "{arch}.vocab_size"
ENGRAM_NONCE = "engram.file_nonce"  # a fresh value per write: block sums of an older file never pass for this one


# ------------------------------------------------------------------------------------------ reading
class TensorInfo:
    """One tensor of a GGUF file: `name`, `type` (ggml type name), `shape` (numpy order: ne reversed), absolute
    byte `offset` of its data, `nbytes`."""

    def __init__(self, name: str, dims: list[int], type_id: int, rel: int, data_start: int, path):
        if type_id not in GGML_TYPES:
            raise GgufError(f"{path}: tensor {name!r} has unknown ggml row type {type_id} (this engram knows "
                            f"{', '.join(n for n, _, _ in GGML_TYPES.values())}); {FIX} with a known type")
        self.name, self.type = name, GGML_TYPES[type_id][0]
        _, block, size = GGML_TYPES[type_id]
        self.shape = tuple(reversed(dims))
        if dims and dims[0] % block:
            raise GgufError(f"{path}: tensor {name!r} has rows of {dims[0]} values, not a multiple of {self.type}'s "
                            f"block of {block}; {FIX}")
        self.offset = data_start + rel
        self.nbytes = math.prod(dims) // block * size if dims else size

    @property
    def row_bytes(self) -> int:
        _, block, size = GGML_TYPES[TYPE_IDS[self.type]]
        return self.shape[-1] // block * size


class GgufFile:
    """The header of a GGUF file: `meta` {key: value} (arrays of numbers as numpy arrays), `tensors` {name:
    TensorInfo}, `arch`, `data_start`, `header_bytes` (everything before the data section). Reads no tensor data;
    every offset and length is checked against the file's size, so a truncated or damaged file is one GgufError."""

    def __init__(self, path):
        self.path = path = Path(path)
        if not path.is_file():
            raise GgufError(f"GGUF file not found: {path}")
        self.size = path.stat().st_size
        with open(path, "rb") as f:
            self._f = f
            head = self._read(24, "header")
            if head[:4] != MAGIC:
                raise GgufError(f"{path} is not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
            if version not in (2, 3):
                raise GgufError(f"{path}: GGUF version {version} is not supported (2 and 3 are; a big-endian file "
                                "reads as a huge version: convert it little-endian)")
            if n_tensors > self.size or n_kv > self.size:
                raise GgufError(f"{path}: corrupt header ({n_tensors} tensors, {n_kv} metadata entries); {FIX}")
            self.version = version
            self.meta = {}
            self.meta_types = {}
            for _ in range(n_kv):
                key = self._string()
                vt = self._u32()
                self.meta[key], self.meta_types[key] = self._value(vt, key)
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                nd = self._u32()
                if nd > 8:
                    raise GgufError(f"{path}: tensor {name!r} claims {nd} dimensions; the header is corrupt; {FIX}")
                dims = list(struct.unpack(f"<{nd}Q", self._read(8 * nd, name)))
                type_id, rel = struct.unpack("<IQ", self._read(12, name))
                infos.append((name, dims, type_id, rel))
            pos = f.tell()
        self.alignment = self.meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(self.alignment, int) or self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GgufError(f"{path}: general.alignment {self.alignment} is not a power of two; {FIX}")
        self.data_start = -(-pos // self.alignment) * self.alignment
        self.header_bytes = pos
        self.tensors = {}
        for name, dims, type_id, rel in infos:
            t = TensorInfo(name, dims, type_id, rel, self.data_start, path)
            if t.offset + t.nbytes > self.size:
                raise GgufError(f"{path} is truncated: tensor {name!r} ends at byte {t.offset + t.nbytes:,}, the file "
                                f"has {self.size:,}; {FIX}")
            self.tensors[name] = t
        self.arch = self.meta.get("general.architecture")
        del self._f

    # ---- the header's pieces, each read checked
    def _read(self, n: int, what: str) -> bytes:
        if n > self.size:
            raise GgufError(f"{self.path}: corrupt header (a length of {n:,} bytes in {what!r}); {FIX}")
        b = self._f.read(n)
        if len(b) < n:
            raise GgufError(f"{self.path} is truncated inside its header (at {what!r}); {FIX}")
        return b

    def _u32(self) -> int:
        return struct.unpack("<I", self._read(4, "header"))[0]

    def _string(self) -> str:
        (n,) = struct.unpack("<Q", self._read(8, "string length"))
        raw = self._read(n, "string")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GgufError(f"{self.path}: a metadata string is not UTF-8 (corrupt header); {FIX}") from None

    def _value(self, vt: int, key: str):
        if vt not in VALUE_TYPES:
            raise GgufError(f"{self.path}: metadata {key!r} has unknown value type {vt} (corrupt header); {FIX}")
        name, fmt = VALUE_TYPES[vt]
        if name == "STRING":
            return self._string(), name
        if name != "ARRAY":
            return struct.unpack(fmt, self._read(struct.calcsize(fmt), key))[0], name
        et, count = struct.unpack("<IQ", self._read(12, key))
        if et not in VALUE_TYPES or VALUE_TYPES[et][0] == "ARRAY":
            raise GgufError(f"{self.path}: metadata array {key!r} has element type {et} (corrupt header); {FIX}")
        ename = VALUE_TYPES[et][0]
        if ename == "STRING":
            if count * 8 > self.size - self._f.tell():  # (each string takes at least its 8-byte length)
                raise GgufError(f"{self.path}: corrupt header ({count:,} strings in {key!r}); {FIX}")
            return [self._string() for _ in range(count)], f"ARRAY[{ename}]"
        dt = np.dtype(_NP_VALUE[ename])
        return np.frombuffer(self._read(count * dt.itemsize, key), dtype=dt).copy(), f"ARRAY[{ename}]"

    # ---- asking for what a layout needs, with one-line errors
    def key(self, template: str, default=None, required: bool = True):
        """The value of metadata `template` (`{arch}` filled in); a GgufError naming the key when it is absent."""
        k = template.format(arch=self.arch)
        if k in self.meta:
            return self.meta[k]
        if required:
            raise GgufError(f"{self.path} has no metadata key {k!r} (general.architecture {self.arch!r}); not a file "
                            f"with this layout, or written by an older converter: {FIX}")
        return default

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            near = [n for n in self.tensors if n.split(".")[-2:] == name.split(".")[-2:]][:3]
            raise GgufError(f"{self.path} has no tensor {name!r}" + (f" (it has {', '.join(near)})" if near else "") +
                            f"; {FIX}")
        return self.tensors[name]

    def rows(self, name: str) -> tuple[np.memmap, torch.Tensor]:
        """(numpy memmap, torch view) of 2-D tensor `name` in place: float rows (rows, dim) as their dtype (bfloat16
        viewed as torch.bfloat16), other types as raw row bytes (rows, row_bytes) uint8. No page is read."""
        import warnings

        t = self.tensor(name)
        if len(t.shape) != 2:
            raise GgufError(f"{self.path}: tensor {name!r} has shape {list(t.shape)}; a table is 2-D (rows, dim)")
        n, d = t.shape
        if t.type in _NP_FLOAT:
            arr = np.memmap(self.path, dtype=_NP_FLOAT[t.type], mode="r", offset=t.offset, shape=(n, d))
        else:
            arr = np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(n, t.row_bytes))
        with warnings.catch_warnings():  # read-only mappings are only ever gathered from
            warnings.simplefilter("ignore", UserWarning)
            view = torch.from_numpy(arr)
        return arr, view.view(torch.bfloat16) if t.type == "BF16" else view

    def array(self, name: str) -> torch.Tensor:
        """Tensor `name` decoded into RAM as float32 (small tensors: projections, norms)."""
        t = self.tensor(name)
        if len(t.shape) == 1:
            t2 = (1, t.shape[0])
        else:
            t2 = (math.prod(t.shape[:-1]), t.shape[-1])
        raw = np.fromfile(self.path, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(t2[0], -1)
        return decode_rows(torch.from_numpy(raw), t.type, t2[1]).reshape(t.shape)


def header_id(path) -> tuple[int, str]:
    """(data section offset, sha256 of the header bytes) of a GGUF file: what its block sums are bound to
    (`tables.blocks` uses it for files starting with b'GGUF')."""
    from ..persist import sha256_bytes

    f = GgufFile(path)
    with open(path, "rb") as fh:
        return f.data_start, sha256_bytes(fh.read(f.header_bytes))[:32]


HEADER_IDS[MAGIC] = header_id  # block sums of a GGUF file are bound to its header (`tables.blocks.header_id`)


# ------------------------------------------------------------------------------------------ row codecs
def _build_q8_kernel():
    import numba

    @numba.njit(nogil=True, cache=True)
    def dequant_q8_0(raw, f16, out):  # out[i, 32b + j] = f16[d bytes of block b] * int8(code j), float32
        n, w = raw.shape
        for i in range(n):
            for b in range(w // 34):
                o = b * 34
                d = f16[raw[i, o] | (np.int64(raw[i, o + 1]) << 8)]
                for j in range(32):
                    c = np.int64(raw[i, o + 2 + j])
                    out[i, b * 32 + j] = d * np.float32(c - 256 if c > 127 else c)

    return dequant_q8_0


_Q8_KERNEL = LazyKernels(_build_q8_kernel)  # optional (engram-torch[fast]): ~5x the torch ops on gathered rows
_F16_LUT = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float().numpy()  # bits -> f32


def decode_rows(raw: torch.Tensor, type_name: str, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows (N, dim) of `dtype` from their bytes `raw` (N, row_bytes) uint8 in ggml type `type_name` (float rows may
    also come as (N, dim) of their own dtype). Q8_0: value = float16 scale * int8 code per 32 values; Q4_0:
    scale * (nibble - 8), low nibbles first; what ggml's `dequantize_row_*` computes in float32."""
    n = raw.shape[0]
    if type_name in FLOAT_TYPES:
        ft = FLOAT_TYPES[type_name]
        x = raw if raw.dtype == ft else raw.contiguous().view(torch.uint8).view(ft).view(n, dim)
        return x.to(dtype)
    raw = raw.contiguous().view(torch.uint8)
    kernel = _Q8_KERNEL.get() if type_name == "Q8_0" and n and dtype == torch.float32 else None
    if kernel is not None:  # one compiled pass, the same float32 products as the torch ops below (tested)
        out = torch.empty(n, dim, dtype=torch.float32)
        kernel(raw.numpy(), _F16_LUT, out.numpy())
        return out
    if type_name == "Q8_0":
        b = raw.view(n, dim // 32, 34)
        d = b[..., :2].contiguous().view(torch.float16).to(torch.float32)  # (N, blocks, 1)
        q = b[..., 2:].contiguous().view(torch.int8).to(torch.float32)  # (N, blocks, 32)
        return (d * q).view(n, dim).to(dtype)
    if type_name == "Q4_0":
        b = raw.view(n, dim // 32, 18)
        d = b[..., :2].contiguous().view(torch.float16).to(torch.float32)
        qs = b[..., 2:].to(torch.int16)  # (N, blocks, 16): element j in the low nibble, j + 16 in the high one
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.float32) - 8
        return (d * q).view(n, dim).to(dtype)
    out = _gguf_quants("dequantize", raw.numpy(), type_name, "upgrade gguf")  # (N, dim) float32
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).view(n, dim).to(dtype)


def _gguf_quants(fn: str, data: np.ndarray, type_name: str, fix: str) -> np.ndarray:
    """`gguf.quants.<fn>(data, type)` (quantize or dequantize) for the types not coded here; one GgufError line
    for an unknown type, a missing gguf package, or a type it cannot do (`fix` says what to do then)."""
    if type_name not in TYPE_IDS:
        raise GgufError(f"unknown ggml row type {type_name!r}")
    try:
        import gguf.quants
    except ImportError:
        raise GgufError(f"rows of ggml type {type_name} are coded by the gguf package: pip install gguf") from None
    try:
        return getattr(gguf.quants, fn)(data, gguf.GGMLQuantizationType[type_name])
    except NotImplementedError:
        raise GgufError(f"the installed gguf package cannot {fn} ggml type {type_name}; {fix}") from None


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (ggml's quantizers), not torch.round's halves to even."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def encode_rows(x: torch.Tensor, type_name: str) -> torch.Tensor:
    """Bytes (N, row_bytes) uint8 of rows `x` (N, dim) in ggml type `type_name`. Q8_0 as ggml's reference
    quantizer: per 32 values d = max|x| / 127 (stored float16), code = roundf(x / d) (0 where d is 0)."""
    n, dim = x.shape
    if type_name in FLOAT_TYPES:
        return x.to(FLOAT_TYPES[type_name]).contiguous().view(torch.uint8).view(n, -1)
    if type_name == "Q8_0":
        if dim % 32:
            raise GgufError(f"Q8_0 rows need a multiple of 32 values, these have {dim}")
        b = x.to(torch.float32).reshape(n, dim // 32, 32)
        d = b.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _round_away(b * inv).to(torch.int8)
        return torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1).view(n, -1)
    out = _gguf_quants("quantize", x.to(torch.float32).contiguous().numpy(), type_name, "write F16, BF16 or Q8_0")
    return torch.from_numpy(np.ascontiguousarray(out)).view(n, -1)


# ------------------------------------------------------------------------------------------ tables in place
class GgufTable(Table):
    """Read-only rows of one GGUF table tensor, read in place and decoded after each gather into `dtype`.

    `src` holds the rows as stored: a mapped tensor (the mmap tier: pages read as touched, each block checked on
    its first read when the file has block sums) or a `DiskTable` over them (the disk tier: positioned reads,
    many in flight). Float rows come out of `src` as their dtype, quantized rows as raw bytes; `decode_rows`
    turns them into values."""

    def __init__(self, src, type_name: str, dim: int, dtype: torch.dtype, name: str, blocks=None, offset: int = 0):
        self.src, self.type, self.dtype, self.name = src, type_name, dtype, name
        self.num_rows = src.num_rows if isinstance(src, Table) else src.shape[0]
        self.dim = dim
        self.blocks, self._offset = blocks, offset
        self.trainable = False
        self.path = getattr(src, "path", None)

    @property
    def bytes_per_row(self) -> int:
        _, block, size = GGML_TYPES[TYPE_IDS[self.type]]
        return self.dim // block * size

    def _raw(self, rows: torch.Tensor) -> torch.Tensor:
        if isinstance(self.src, Table):
            return self.src.gather(rows)
        if self.blocks is not None:  # (data offsets of the block sums are relative to the data section)
            self.blocks.check_rows(rows, self._offset, self.bytes_per_row)
        return self.src.index_select(0, rows)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = rows.reshape(-1).long()
        if not isinstance(self.src, Table) and rows.numel():  # (the disk tier checks its own; numpy: one thread)
            r = rows.numpy()
            if int(r.min()) < 0 or int(r.max()) >= self.num_rows:
                raise GgufError(f"{self.name}: row ids must lie in [0, {self.num_rows})")
        vals = decode_rows(self._raw(rows), self.type, self.dim, self.dtype)  # (N, dim)
        return out.copy_(vals) if out is not None else vals

    @property
    def weight(self) -> torch.Tensor:
        """All rows decoded (N, dim): for saving or copying the table out (float rows: the mapping itself)."""
        src = self.src.weight if isinstance(self.src, Table) else self.src
        if self.type in FLOAT_TYPES and src.dtype == self.dtype:
            return src
        return torch.cat([decode_rows(src[s:s + (1 << 16)], self.type, self.dim, self.dtype)
                          for s in range(0, self.num_rows, 1 << 16)]) if self.num_rows else \
            torch.empty(0, self.dim, dtype=self.dtype)

    def stats(self) -> dict:
        extra = self.src.stats() if isinstance(self.src, Table) else {}
        return {**extra, "format": f"gguf {self.type}", "bytes_per_row": self.bytes_per_row}

    def close(self) -> None:
        if isinstance(self.src, Table):
            self.src.close()


def _disk_table_class():
    from .disk import DiskTable

    class GgufDiskTable(DiskTable):
        """The disk tier over one GGUF tensor: `tensor` is its name, rows as `GgufFile.rows` maps them (its first
        `rows` only, when given: a table padded past the rows its heads address)."""

        def __init__(self, path, tensor: str, rows: int | None = None, **kwargs):
            self._limit = rows
            super().__init__(path, tensor=tensor, **kwargs)

        def _map(self, path, tensor):
            f = GgufFile(path)
            arr, view = f.rows(tensor)
            return arr[:self._limit], view[:self._limit], f.tensors[tensor].offset

    return GgufDiskTable


def open_table(gguf, name: str, backend: str = "mmap", dtype: torch.dtype | None = None, rows: int | None = None,
               **disk_kwargs) -> Table:
    """A read-only `GgufTable` over 2-D tensor `name` of GGUF file `gguf` (a path or `GgufFile`), in place; its
    first `rows` rows only when given (a padded table: the rows its hash heads address).

    backend "mmap": the rows memory-mapped, each block checked on its first read when the file has block sums
    (`write_gguf` writes them; a llama.cpp file has none: one warning); "disk": read by the cold tier (`DiskTable`:
    positioned reads, many in flight, `disk_kwargs` such as `queue_depth`, `direct`); "ram": the stored rows
    copied into RAM (checked once), decoded after each gather like the others.
    `dtype`: what a gather returns (default: the rows' own dtype for F32/F16/BF16, float32 for the others).
    """
    from .blocks import BlockVerifier

    f = gguf if isinstance(gguf, GgufFile) else GgufFile(gguf)
    t = f.tensor(name)
    if len(t.shape) != 2:
        raise GgufError(f"{f.path}: tensor {name!r} has shape {list(t.shape)}; a table is 2-D (rows, dim)")
    if t.type not in NATIVE_TYPES:
        try:
            import gguf.quants  # noqa: F401
        except ImportError:
            raise GgufError(f"{f.path}: {name!r} has {t.type} rows, which the gguf package decodes: pip install "
                            "gguf") from None
    dtype = dtype or FLOAT_TYPES.get(t.type, torch.float32)
    label = f"{f.path.name}:{name}"
    if backend not in ("ram", "mmap", "disk"):
        raise GgufError(f"backend must be 'ram', 'mmap' or 'disk', got {backend!r}")
    if rows is not None and not 0 <= rows <= t.shape[0]:
        raise GgufError(f"{f.path}: {name!r} has {t.shape[0]:,} rows, {rows:,} are needed; {FIX}")
    if backend == "disk":
        src = _disk_table_class()(f.path, tensor=name, rows=rows, **disk_kwargs)
        table = GgufTable(src, t.type, t.shape[1], dtype, label)
    else:
        _, view = f.rows(name)
        view = view[:rows]
        blocks = BlockVerifier.open(f.path)
        table = GgufTable(view, t.type, t.shape[1], dtype, label, blocks, t.offset - f.data_start)
        if backend == "ram":  # the rows as stored (Q8_0 stays ~1 byte a value), copied into RAM and checked once
            if blocks is not None:
                blocks.check_bytes(t.offset - f.data_start, table.num_rows * t.row_bytes)
            table = GgufTable(view.clone(), t.type, t.shape[1], dtype, label)
    table.path = f.path
    return table


# ------------------------------------------------------------------------------------------ writing
def _pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _pack_value(key: str, vtype: str, value) -> bytes:
    """A metadata entry's bytes after its key: `vtype` "UINT32", "STRING", ... or "ARRAY[UINT64]"."""
    if vtype.startswith("ARRAY[") and vtype.endswith("]"):
        et = vtype[6:-1]
        if et not in VALUE_IDS or et == "ARRAY":
            raise GgufError(f"metadata {key!r}: unknown array element type {et!r}")
        out = struct.pack("<IIQ", VALUE_IDS["ARRAY"], VALUE_IDS[et], len(value))
        if et == "STRING":
            return out + b"".join(_pack_string(s) for s in value)
        arr = np.asarray(value)
        if arr.size and np.issubdtype(arr.dtype, np.integer):
            info = np.iinfo(np.dtype(_NP_VALUE[et]))
            if int(arr.min()) < info.min or int(arr.max()) > info.max:
                raise GgufError(f"metadata {key!r}: values outside {et}'s range")
        return out + arr.astype(_NP_VALUE[et]).tobytes()
    if vtype not in VALUE_IDS or vtype == "ARRAY":
        raise GgufError(f"metadata {key!r}: unknown value type {vtype!r}")
    if vtype == "STRING":
        return struct.pack("<I", VALUE_IDS[vtype]) + _pack_string(value)
    return struct.pack("<I", VALUE_IDS[vtype]) + struct.pack(VALUE_TYPES[VALUE_IDS[vtype]][1], value)


def write_gguf(path, arch: str, kv: dict, tensors: list, alignment: int = 4096, block_sums: bool = True,
               chunk_rows: int = 1 << 16) -> Path:
    """Write a GGUF v3 file atomically (`persist.atomic_file`), streaming tensors a block of rows at a time.

    `kv`: {key: (value type, value)} after `general.architecture = arch` and `general.alignment` (value types as
    GGUF names them: "UINT32", "STRING", "ARRAY[UINT64]", ...). `tensors`: `(name, ggml type, rows)` where `rows`
    is a 2-D float tensor (N, dim) (memory-mapped tables are read a block at a time) or `(name, ggml type,
    (N, dim), chunks)` with `chunks` yielding float row blocks. Rows are encoded to the type (`encode_rows`).
    `alignment` 4096: every tensor starts on a page, and `block_sums` writes 4 KiB block sums beside the file
    (`<file>.blocks`), so the disk tier checks each block on its first read, as for engram's own table files.
    """
    import uuid

    from ..persist import atomic_file
    from .blocks import PAGE, BlockCrc, write_sums

    path = Path(path)
    if alignment <= 0 or alignment & (alignment - 1):
        raise GgufError(f"alignment must be a power of two, got {alignment}")
    entries = {"general.architecture": ("STRING", arch), "general.alignment": ("UINT32", alignment),
               **{k.replace("{arch}", arch): v for k, v in kv.items()}}
    if block_sums:
        entries[ENGRAM_NONCE] = ("STRING", uuid.uuid4().hex)
    plan, rel = [], 0
    for ent in tensors:
        if len(ent) == 3:
            name, tname, rows = ent
            shape = tuple(rows.shape)
            chunks = _blocks(rows, chunk_rows)
        else:
            name, tname, shape, chunks = ent
        if tname not in TYPE_IDS:
            raise GgufError(f"{name}: unknown ggml type {tname!r}")
        _, block, size = GGML_TYPES[TYPE_IDS[tname]]
        if len(shape) != 2 or shape[1] % block:
            raise GgufError(f"{name}: {tname} rows need a multiple of {block} values, got shape {list(shape)}")
        nbytes = shape[0] * (shape[1] // block) * size
        plan.append((name, tname, shape, chunks, rel, nbytes))
        rel = -(-(rel + nbytes) // alignment) * alignment
    head = bytearray(MAGIC + struct.pack("<IQQ", 3, len(plan), len(entries)))
    for key, (vtype, value) in entries.items():
        head += _pack_string(key) + _pack_value(key, vtype, value)
    for name, tname, shape, _, off, _ in plan:
        head += _pack_string(name) + struct.pack("<I", 2) + struct.pack("<QQ", shape[1], shape[0])
        head += struct.pack("<IQ", TYPE_IDS[tname], off)
    head += b"\0" * (-len(head) % alignment)
    crc = BlockCrc(PAGE) if block_sums else None
    with atomic_file(path) as f:
        f.write(head)
        pos = 0  # in the data section
        for name, tname, shape, chunks, off, nbytes in plan:
            if off > pos:  # alignment padding before the tensor
                f.write(b"\0" * (off - pos))
                if crc is not None:
                    crc.update(b"\0" * (off - pos))
            written = 0
            for c in chunks:
                b = encode_rows(torch.as_tensor(c).detach().cpu(), tname).numpy().tobytes() if len(c) else b""
                f.write(b)
                if crc is not None:
                    crc.update(b)
                written += len(b)
            if written != nbytes:
                raise GgufError(f"{name}: wrote {written} bytes, its shape {list(shape)} in {tname} needs {nbytes}")
            pos = off + nbytes
        tail = b"\0" * (-pos % alignment) if plan else b""  # (GGUFWriter pads the last tensor too)
        f.write(tail)
        if crc is not None and tail:
            crc.update(tail)
    if crc is not None:
        write_sums(path, crc.finish(), PAGE)
    return path


def _blocks(rows, chunk_rows: int):
    """Row blocks of a 2-D tensor (bound now: a generator expression in the caller's loop would see its last)."""
    for s in range(0, rows.shape[0], chunk_rows):
        yield rows[s:s + chunk_rows]


def u64s(values) -> tuple[str, list]:
    """A metadata entry: array of uint64 (what llama.cpp's converters write for hash constants)."""
    return "ARRAY[UINT64]", [int(v) for v in np.asarray(values).reshape(-1)]


# ------------------------------------------------------------------------------------------ the released layouts
def ple_constants(f: GgufFile) -> dict:
    """qwen4exp's PLE keys: {layer (0-indexed decoder layer), ngram_size, heads_per_ngram, conv_kernel,
    eos_token_id, multipliers [ngram_size], head_offsets [H], head_vocab_sizes [H], vocab_size, row_dim}."""
    layers = [int(x) for x in f.key(PLE_KEYS["layers"])]
    if len(layers) != 1:
        raise GgufError(f"{f.path}: {PLE_KEYS['layers'].format(arch=f.arch)} lists {len(layers)} layers; llama.cpp's "
                        "qwen4exp (and this reader) take exactly one PLE layer")
    c = {"layer": layers[0]}
    for k in ("ngram_size", "heads_per_ngram", "conv_kernel", "eos_token_id"):
        c[k] = int(f.key(PLE_KEYS[k]))
    H = (c["ngram_size"] - 1) * c["heads_per_ngram"]
    for k, n in (("layer_multipliers", c["ngram_size"]), ("head_offsets", H), ("head_vocab_sizes", H)):
        v = np.asarray(f.key(PLE_KEYS[k]))
        if v.ndim != 1 or len(v) != n or not np.issubdtype(v.dtype, np.integer):
            raise GgufError(f"{f.path}: {PLE_KEYS[k].format(arch=f.arch)} must be {n} integers (ngram_size "
                            f"{c['ngram_size']}, heads_per_ngram {c['heads_per_ngram']}); {FIX}")
        c[k] = [int(x) for x in v]
    c["multipliers"] = c.pop("layer_multipliers")
    c["vocab_size"] = _vocab_size(f)
    c["row_dim"] = int(f.key(PLE_KEYS["row_dim"], required=False) or f.tensor(PLE_TABLE).shape[1])
    return c


def ple_kv(mapping, layer_id: int, conv_kernel: int, row_dim: int) -> dict:
    """The `{arch}.ple.*` metadata of PLE layer `layer_id` (1-indexed) of a qwen4_exp `mapping`, typed as llama.cpp's
    converter writes them (`gguf_writer.add_ple_*`): the layer 0-indexed, u32 sizes, u64 constants."""
    lid = int(layer_id)
    kv = {PLE_KEYS["layers"]: ("ARRAY[INT32]", [lid - 1]),
          PLE_KEYS["ngram_size"]: ("UINT32", mapping.max_ngram_size),
          PLE_KEYS["heads_per_ngram"]: ("UINT32", mapping.n_head_per_ngram),
          PLE_KEYS["conv_kernel"]: ("UINT32", int(conv_kernel)),
          PLE_KEYS["eos_token_id"]: ("UINT32", int(mapping.reset_id)),
          PLE_KEYS["row_dim"]: ("UINT32", int(row_dim)),
          PLE_KEYS["layer_multipliers"]: u64s(mapping.layer_multipliers[lid]),
          PLE_KEYS["head_offsets"]: u64s(mapping.head_offsets(lid)),
          PLE_KEYS["head_vocab_sizes"]: u64s(mapping.head_sizes(lid)),
          VOCAB_KEY: ("UINT32", int(mapping.raw_vocab_size))}
    return kv


def engram_kv(mapping, head_dim: int) -> dict:
    """The `{arch}.engram.*` metadata of a DeepSeek-style `mapping` (DeepSeek-V4.1's, or an engram model's: the
    constants are stored, not derived), typed as PR #28696's converter writes them: u32 sizes, i32 layer ids and
    token map, u64 multipliers, primes and offsets flattened in (layer, order, head) order, the compressed pad."""
    L = mapping.layer_ids
    return {V41_KEYS["layer_ids"]: ("ARRAY[INT32]", [int(x) for x in L]),
            V41_KEYS["head_count"]: ("UINT32", mapping.n_head_per_ngram),
            V41_KEYS["key_length"]: ("UINT32", int(head_dim)),
            V41_KEYS["max_ngram_size"]: ("UINT32", mapping.max_ngram_size),
            V41_KEYS["multipliers"]: u64s([mapping.layer_multipliers[lid] for lid in L]),
            V41_KEYS["primes"]: u64s([mapping.head_sizes(lid) for lid in L]),
            V41_KEYS["offsets"]: u64s([mapping.head_offsets(lid) for lid in L]),
            V41_KEYS["token_map"]: ("ARRAY[INT32]", [int(x) for x in mapping.compressed_tokenizer.lookup_table]),
            V41_KEYS["pad_id"]: ("UINT32", int(mapping.pad_id))}


def _vocab_size(f: GgufFile) -> int:
    v = f.key(VOCAB_KEY, required=False)
    if v is None:
        toks = f.meta.get("tokenizer.ggml.tokens")
        if toks is None:
            raise GgufError(f"{f.path} has neither {VOCAB_KEY.format(arch=f.arch)!r} nor tokenizer.ggml.tokens: the "
                            f"vocabulary size (which the hash multipliers derive from) is unknown; {FIX}")
        v = len(toks)
    return int(v)


def v41_constants(f: GgufFile) -> dict:
    """DeepSeek-V4.1's engram keys (PR #28696): {layer_ids, n_heads, head_dim, max_ngram_size, multipliers
    {layer: [N]}, primes {layer: [[p] * H] * (N-1)}, offsets {layer: [(N-1)*H]}, token_map (int64 array),
    pad_id (compressed)}."""
    c = {"layer_ids": [int(x) for x in f.key(V41_KEYS["layer_ids"])]}
    N, H = int(f.key(V41_KEYS["max_ngram_size"])), int(f.key(V41_KEYS["head_count"]))
    c.update(max_ngram_size=N, n_heads=H, head_dim=int(f.key(V41_KEYS["key_length"])),
             pad_id=int(f.key(V41_KEYS["pad_id"])))
    L = len(c["layer_ids"])
    arrays = {}
    for k, per in (("multipliers", N), ("primes", (N - 1) * H), ("offsets", (N - 1) * H)):
        v = np.asarray(f.key(V41_KEYS[k]))
        if v.ndim != 1 or len(v) != L * per or not np.issubdtype(v.dtype, np.integer):
            raise GgufError(f"{f.path}: {V41_KEYS[k].format(arch=f.arch)} must hold {L} x {per} integers "
                            f"({L} layers, max_ngram_size {N}, head_count {H}); {FIX}")
        arrays[k] = v.astype(np.int64).reshape(L, per)
    c["multipliers"] = {lid: arrays["multipliers"][i] for i, lid in enumerate(c["layer_ids"])}
    c["primes"] = {lid: arrays["primes"][i].reshape(N - 1, H).tolist() for i, lid in enumerate(c["layer_ids"])}
    c["offsets"] = {lid: arrays["offsets"][i].tolist() for i, lid in enumerate(c["layer_ids"])}
    tm = np.asarray(f.key(V41_KEYS["token_map"]))
    if tm.ndim != 1 or not len(tm) or not np.issubdtype(tm.dtype, np.integer) or int(tm.min()) < 0:
        raise GgufError(f"{f.path}: {V41_KEYS['token_map'].format(arch=f.arch)} must be non-negative integers; {FIX}")
    c["token_map"] = tm.astype(np.int64)
    return c


def check_constants(path, got: dict, want: dict, source: str = "the family's rules derive from its other keys",
                    fix: str = "re-convert the file") -> None:
    """One GgufError naming the first hash constant in `got` (read from the file) that differs from `want` (what
    `source` gives)."""
    for k in want:
        if [int(x) for x in np.asarray(got[k]).reshape(-1)] != [int(x) for x in np.asarray(want[k]).reshape(-1)]:
            raise GgufError(f"{path}: its hash constants {k!r} differ from what {source} (a damaged file, or another "
                            f"model's constants); {fix}")


def prime_base(first_prime: int) -> int:
    """The smallest start whose first prime is `first_prime` (`prevprime(p) + 1`): the table-size base that
    derives a file's stored moduli when the base itself is not stored."""
    from sympy import prevprime

    return int(prevprime(first_prime)) + 1 if first_prime > 2 else 2


__all__ = ["FLOAT_TYPES", "GGML_TYPES", "GgufError", "GgufFile", "GgufTable", "NATIVE_TYPES", "PLE_KEYS",
           "PLE_TABLE", "TYPE_IDS", "V41_KEYS", "V41_TABLE", "V41_TENSORS", "check_constants", "decode_rows",
           "encode_rows", "engram_kv", "header_id", "open_table", "ple_constants", "ple_kv", "prime_base", "u64s",
           "v41_constants", "write_gguf"]
