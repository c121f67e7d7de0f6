"""GGUF files (llama.cpp's format): n-gram tables and their hash constants read in place, and tables written as GGUF.

Over 450 lines on purpose: the GGUF container (reader, writer, tensor table) is one format, kept whole.

    f = GgufFile("model.gguf")                       # header, metadata, tensor infos; no tensor byte is read
    f.meta["qwen4exp.ple.ngram_size"]                 # metadata values (int, float, str, bool, list, numpy array)
    t = open_table(f, "per_layer_token_embd.weight", tier="disk")     # a read-only Table over the rows in place
    rows = t.gather(ids)                              # (N, dim), decoded from the file's row type after the gather
    write_gguf(path, "qwen4exp", kv, [("per_layer_token_embd.weight", "Q8_0", rows)])   # streamed, atomic

Layout (GGUF v3, little-endian): `b"GGUF"`, version u32, tensor count u64, metadata count u64, the metadata
(key string, value type u32, value), the tensor infos (name, dims u64 each with ne0 innermost, ggml type u32,
offset u64 into the data section), then the data section at the next multiple of `general.alignment` (32 by
default). A table is a 2-D tensor `[ne0 = dim, ne1 = rows]`: numpy/torch shape `(rows, dim)`, each row
`dim / block * type_size` contiguous bytes, so a row is one read whatever its type.

Row types (`GGML_TYPES`, `tables.codecs.ggml`): F32, F16, BF16 and Q8_0 (32 int8 codes and one float16 scale per
block, the type llama.cpp's converters write for these tables) and Q4_0 are decoded by engram (torch ops, no
dependency); every other ggml type the `gguf` package can dequantize (the K-quants Q2_K..Q6_K that DeepSeek-V4.1
GGUFs use, IQ4_XS of the community Qwen3.8 files, the other IQ and TQ types, MXFP4, NVFP4, ...) by `gguf.quants`
after the gather (install `gguf`). Writing: F32, F16, BF16, Q8_0 (ggml's reference rounding: the bytes equal
`gguf.quants.quantize`'s, tested) and any type `gguf.quants` can quantize.

Why a reader and a writer of our own instead of `gguf.GGUFReader`/`GGUFWriter` (which the tests check both
against): the tiers read rows at byte offsets without parsing the file into Python objects; tables larger than
RAM are written in row blocks through `persist.atomic_file` with 4 KiB block sums beside the file (the disk
tier's checked reads), which `GGUFWriter` (whole tensors, its own file handling) does not do; and every damaged
file is one `GgufError` line, where `GGUFReader` raises assorted numpy and struct errors.

This module is the container (reading and writing the file); the row types are `tables.codecs.ggml`, the rows
are opened in a tier by `tables.rows.open_rows` (`open_table` here), and the released models' layouts (which
tensors and keys hold their Engram tables) live with their integrations (`integrations.qwen4_exp.gguf`,
`integrations.deepseek_v41.gguf`).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import torch

from ..deprecation import renamed_keywords
from .base import GgufError, Table
from .blocks import HEADER_IDS
from .codecs.ggml import FLOAT_TYPES, GGML_TYPES, NATIVE_TYPES, NP_FLOAT, TYPE_IDS, GgmlCodec, decode_rows, encode_rows
from .encoded import GgufTable
from .rows import FILE_OPENERS, StoredTensor, open_rows

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
FIX = "re-download or re-convert the file"

# metadata value types: id -> (name, struct format or None)
VALUE_TYPES = {0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
               5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"), 8: ("STRING", None),
               9: ("ARRAY", None), 10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d")}
VALUE_IDS = {name: i for i, (name, _) in VALUE_TYPES.items()}
_NP_VALUE = {"UINT8": "<u1", "INT8": "<i1", "UINT16": "<u2", "INT16": "<i2", "UINT32": "<u4", "INT32": "<i4",
             "FLOAT32": "<f4", "BOOL": "?", "UINT64": "<u8", "INT64": "<i8", "FLOAT64": "<f8"}

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
        if t.type in NP_FLOAT:
            arr = np.memmap(self.path, dtype=NP_FLOAT[t.type], mode="r", offset=t.offset, shape=(n, d))
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


# ------------------------------------------------------------------------------------------ tables in place
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


class GgufStoredTensor(StoredTensor):
    """Where one 2-D GGUF tensor's rows lie (`StoredTensor` for `open_rows`): its first `rows` rows when given (a
    table padded past the rows its hash heads address); `offset` counts from the data section, as the block sums."""

    def __init__(self, f: GgufFile, name: str, rows: int | None = None):
        t = f.tensor(name)
        if len(t.shape) != 2:
            raise GgufError(f"{f.path}: tensor {name!r} has shape {list(t.shape)}; a table is 2-D (rows, dim)")
        if rows is not None and not 0 <= rows <= t.shape[0]:
            raise GgufError(f"{f.path}: {name!r} has {t.shape[0]:,} rows, {rows:,} are needed; {FIX}")
        self.file, self.key, self.path, self.type, self.limit = f, name, f.path, t.type, rows
        self.offset = t.offset - f.data_start
        self.shape = (t.shape[0] if rows is None else rows, t.shape[1])

    def mapped(self) -> torch.Tensor:
        return self.file.rows(self.key)[1][:self.limit]

    def disk(self, **kwargs) -> Table:
        return _disk_table_class()(self.path, tensor=self.key, rows=self.limit, **kwargs)


def _stored(path, tensor: str | None, rows: int | None):
    """`open_rows`' reader of GGUF files: ((the tensor's rows in place,), their ggml codec)."""
    if tensor is None:
        raise GgufError(f"{path} is a GGUF file: name the table tensor (open_rows(..., tensor=NAME))")
    f = path if isinstance(path, GgufFile) else GgufFile(path)
    st = GgufStoredTensor(f, tensor, rows)
    if st.type not in NATIVE_TYPES:
        try:
            import gguf.quants  # noqa: F401
        except ImportError:
            raise GgufError(f"{f.path}: {tensor!r} has {st.type} rows, which the gguf package decodes: pip install "
                            "gguf") from None
    return (st,), GgmlCodec(st.type)


FILE_OPENERS[MAGIC] = _stored


@renamed_keywords(backend="tier")
def open_table(gguf, name: str, tier: str = "mmap", dtype: torch.dtype | None = None, rows: int | None = None,
               **disk_kwargs) -> Table:
    """A read-only `GgufTable` over 2-D tensor `name` of GGUF file `gguf` (a path or `GgufFile`), in place
    (`open_rows`); its first `rows` rows only when given (a padded table: the rows its hash heads address).

    tier "mmap": the rows memory-mapped, each block checked on its first read when the file has block sums
    (`write_gguf` writes them; a llama.cpp file has none: one warning); "disk": read by the cold tier (`DiskTable`:
    positioned reads, many in flight, `disk_kwargs` such as `queue_depth`, `direct`); "ram": the stored rows
    copied into RAM (checked once), decoded after each gather like the others.
    `dtype`: what a gather returns (default: the rows' own dtype for F32/F16/BF16, float32 for the others).
    """
    f = gguf if isinstance(gguf, GgufFile) else GgufFile(gguf)
    (st,), codec = _stored(f, name, rows)
    return open_rows(st, tier, codec=codec, dtype=dtype, name=f"{f.path.name}:{name}", **disk_kwargs)


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


# ------------------------------------------------------------------------------------------ hash constants in files
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


__all__ = ["FLOAT_TYPES", "GGML_TYPES", "GgufError", "GgufFile", "GgufStoredTensor", "GgufTable", "NATIVE_TYPES",
           "TYPE_IDS", "check_constants", "decode_rows", "encode_rows", "header_id", "open_table", "prime_base",
           "u64s", "write_gguf"]
