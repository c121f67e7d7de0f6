"""One way to open a table's stored rows in a tier: `open_rows`, with one error class (`TableError`).

    t = open_rows("engram_table_L1.safetensors", "disk")                # any engram table file: format from its header
    t = open_rows("model.gguf", "mmap", tensor="blk.3.engram_embd.weight")  # a GGUF tensor (`tables.gguf`)
    t = open_rows((codes, scales), "ram", codec=Ue8m0Codec())           # encoded parts in RAM
    t = open_rows((StoredTensor(shard, "embed.weight"), StoredTensor(shard, "embed.scale")), "disk",
                  codec=Ue8m0Codec())                                   # a released checkpoint's parts, in place
    t = open_rows(RowBlocks((n, d), torch.bfloat16, blocks), "mmap", dir, file="rows.safetensors")  # written first

                 source: where the bytes are
       (file, GGUF tensor, StoredTensor parts, tensors, RowBlocks, a list of segments)
                                   |
                            open_rows(tier, dir)   -- dir: copy the rows there first (packed, block sums)
               ram: parts in RAM   |   mmap: parts mapped   |   disk: DiskTable over the first part
                                   v
        MmapTable / DiskTable / InRamTable (float table files)   or   EncodedTable(parts, codec)
                                   |
                      gather(ids) -> codec.decode(stored bytes) -> (N, dim)

Tiers: "ram" (the stored rows copied into RAM, every block of their file checked once), "mmap" (mapped in place,
each block checked on its first read; `verify="open"` checks the whole file now) and "disk" (the rows' first part
read by positioned reads, `DiskTable`, each block checked on its first read; the other parts, scales, are small
and read into RAM at open). Rows given in RAM or as `RowBlocks` go to a file in `dir` for mmap and disk (page-
aligned 4 KiB block sums for disk); rows in a file are read in place unless `dir` is given, then copied there
first (packed: one read a row), which gives files without block sums (a released checkpoint's shards) checked
reads. A file without sums is one `UnverifiedTableWarning` per call, naming the fix.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import torch

from .base import Table, TableError
from .blocks import BlockVerifier, UnverifiedTableWarning
from .codecs import FloatCodec, Nvfp4Codec, RowCodec, ScaledRowCodec, Ue8m0Codec, pack_rows
from .codecs.scaled import FORMATS
from .disk import DiskTable
from .encoded import EncodedTable
from .files import NP_DTYPES, QUANT_NP_DTYPES, map_tensor
from .header import read_header
from .trainable import InRamTable, MmapTable

TIERS = ("ram", "mmap", "disk")  # where a table's rows are read from
NVFP4_FILE_FORMAT = "engram-nvfp4-rows/1"
UE8M0_FILE_FORMAT = "engram-v41-rows/1"  # (DeepSeek-V4.1's packed rows: the first files of this kind)
QUANT_FILE_FORMAT = "engram-quant-table"


def check_tier(tier: str, allowed: tuple = TIERS, needs_dir: bool = False, where: str = "open_rows",
               dir_arg: str = "dir") -> None:
    """A one-line `TableError` unless `tier` is one of `allowed`; with `needs_dir`, also when the tier reads a
    file and no directory for it was given (`where` names the call, `dir_arg` its directory argument)."""
    if tier not in allowed:
        names = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}" if len(allowed) > 1 else repr(allowed[0])
        raise TableError(f"tier must be {names}, got {tier!r} (where the table rows are read from)")
    if needs_dir and tier != "ram":
        raise TableError(f"{where}(tier={tier!r}) needs {dir_arg}= for the table files (or tier='ram')")


def tier_of(table) -> str:
    """The tier a table reads its rows from: "disk" (positioned reads), "mmap" (a mapped file) or "ram"."""
    t = table.parts[0] if isinstance(table, EncodedTable) else table
    return "disk" if isinstance(t, DiskTable) else "mmap" if isinstance(t, MmapTable) or \
        (isinstance(table, EncodedTable) and table.path is not None) else "ram"


class StoredTensor:
    """Where one stored tensor of a table lies: tensor `key` of safetensors file `path` (a table file, or a released
    checkpoint's shard), read in place. `shape`, `offset` (where its bytes start in the file's data section, which
    block sums count from); `mapped()` (in place, no page read), `load()` (in RAM), `disk(**kw)` (the disk tier).
    `why`: what to do when the file lacks `key`, said in the error."""

    def __init__(self, path, key: str, why: str = ""):
        self.key, self.path = key, Path(path)
        self.header = read_header(self.path, required=())  # (checks that every tensor lies inside the file)
        if key not in self.header.tensors:
            raise TableError(f"{self.path} lacks {key}" + (f", {why}" if why else "; pass a file that holds it"))
        self.info = self.header.tensors[key]
        self.shape, self.offset = tuple(self.info["shape"]), self.info["data_offsets"][0]

    def mapped(self) -> torch.Tensor:
        """The tensor memory-mapped from its file: raw bytes for FP8, else its dtype."""
        return map_tensor(self.path, self.header, self.key, dtypes={**NP_DTYPES, **QUANT_NP_DTYPES})[1]

    def load(self) -> torch.Tensor:
        """The tensor in RAM (FP8 bytes as uint8; bf16 and float32 as themselves)."""
        return self.mapped().clone()

    def disk(self, **kwargs) -> Table:
        return DiskTable(self.path, tensor=self.key, **kwargs)


class RowBlocks:
    """Rows given a block at a time, never whole in RAM: `shape` (N, w), `dtype`, `blocks` yielding (n_i, w) row
    blocks in order (for encoded rows: packed, `pack_rows`)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, blocks):
        self.shape, self.dtype, self.blocks = tuple(shape), dtype, blocks


_MMAP_KW = {"cache_bytes", "policy", "writable", "durable"}  # `MmapTable`'s options (a float table file on mmap)
_DISK_KW = {"queue_depth", "direct"}  # `DiskTable`'s
FILE_OPENERS: dict = {}  # file magic -> opener(path, tensor, rows) -> ((StoredTensor parts), codec): `tables.gguf`


def open_rows(source, tier: str = "mmap", dir=None, *, codec: RowCodec | None = None, tensor: str | None = None,
              rows: int | None = None, file: str | None = None, dtype: torch.dtype | None = None,
              name: str | None = None, verify: str = "read", expect: str | None = None, metadata: dict | None = None,
              **tier_kwargs) -> Table:
    """A read-only (or, for a float table file on mmap with `writable=True`, trainable) `Table` of stored rows.

    `source`: a table file (str/Path: an engram table file of any format, told by its header; a GGUF file with
    `tensor=`; any safetensors file's `tensor=`), a `StoredTensor` or a tuple of them (the codec's parts in a
    file), a tensor or a tuple of tensors (rows or parts in RAM or mapped), `RowBlocks`, or a list of any of these
    (segments of one table, in order: `SegmentedTable`, or one file with `dir`). `codec`: how the parts encode the
    rows (None: float rows; a file's header names its own). `dir`/`file`: for mmap and disk, write the rows to
    `dir/file` first. `rows`: only the first rows of a GGUF tensor. `expect`: the file format required (one
    `TableError` otherwise). `tier_kwargs` go to the tier's reader when it takes them: `MmapTable` (cache_bytes,
    policy, writable, durable) for a float table file on mmap, `DiskTable` (queue_depth, direct) on disk.
    """
    check_tier(tier)
    unknown = set(tier_kwargs) - _MMAP_KW - _DISK_KW
    if unknown:
        raise TableError(f"open_rows: unknown option(s) {sorted(unknown)}; the tiers' readers take "
                         f"{sorted(_MMAP_KW)} (mmap) and {sorted(_DISK_KW)} (disk)")
    if verify not in ("read", "open"):
        raise TableError(f"verify must be 'read' (each block on its first read) or 'open', got {verify!r}")
    where = name or str(source if isinstance(source, (str, os.PathLike)) else "table")
    in_place = not isinstance(source, (str, os.PathLike)) and _all_stored(source)
    hint = "; open_rows(..., dir=DIR) reads a checked copy" if in_place else ""
    with _one_unverified_warning(hint):
        if isinstance(source, (str, os.PathLike)):
            parts, codec = _file_parts(Path(source), tensor, rows, codec, expect, where)
            if parts is None:  # an engram float table file: the tiers' own float tables
                return _float_file(Path(source), tier, tier_kwargs)
            if dir is None or tier == "ram":
                return _open_parts(parts, codec, tier, dtype, where, verify, tier_kwargs)
            source = parts if len(parts) > 1 else parts[0]
        if isinstance(source, list):
            if dir is None and tier != "ram":
                segs = []
                try:
                    for s in source:
                        segs.append(open_rows(s, tier, codec=codec, dtype=dtype, name=where, verify=verify,
                                              **tier_kwargs))
                except BaseException:
                    for s in segs:
                        s.close()
                    raise
                return SegmentedTable(segs, where)
            source, in_place = _concatenated(source), False
        parts = source if isinstance(source, tuple) else (source,)
        if tier != "ram" and (dir is not None or not in_place):
            if dir is None:
                raise TableError(f"{where}: rows in RAM are read from a file on the {tier} tier: pass dir= (where to "
                                 "write them) or tier='ram'")
            if file is None:
                raise TableError(f"{where}: open_rows(..., dir=) needs file= (the name of the file to write)")
            f = write_rows(Path(dir) / file, parts, codec, page_blocks=tier == "disk", metadata=metadata)
            return open_rows(f, tier, codec=None, dtype=dtype, name=name, verify=verify, **tier_kwargs)
        if any(isinstance(p, RowBlocks) for p in parts):
            parts = _filled(parts[0], codec)
        if in_place:
            return _open_parts(parts, codec, tier, dtype, where, verify, tier_kwargs)
        if codec is None or isinstance(codec, FloatCodec):  # float rows in RAM (as `_open_parts` serves them)
            return InRamTable(parts[0])
        return EncodedTable.of(parts, codec, dtype, where)


def _all_stored(source) -> bool:
    items = source if isinstance(source, (tuple, list)) else [source]
    return bool(items) and all(isinstance(p, StoredTensor) or (isinstance(p, tuple) and _all_stored(p))
                               for p in items)


@contextlib.contextmanager
def _one_unverified_warning(hint: str):
    """At most one `UnverifiedTableWarning` for everything opened inside (the first, with `hint` added); other
    warnings pass through."""
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        _say_once(caught, hint)


def _say_once(caught: list, hint: str) -> None:
    said = False
    for w in caught:
        if issubclass(w.category, UnverifiedTableWarning):
            if not said:
                msg = str(w.message)
                warnings.warn(msg if msg.endswith(hint) else msg + hint, w.category, stacklevel=4)
            said = True
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


# ------------------------------------------------------------------------------------------ files
def _file_parts(path: Path, tensor, rows, codec, expect, where):
    """(StoredTensor parts, codec) of the rows in file `path`; (None, None) for an engram float table file."""
    if not path.is_file():
        raise TableError(f"table file not found: {path}; write it first (or give the path of an existing one)")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic in FILE_OPENERS:
        return FILE_OPENERS[magic](path, tensor, rows)
    if tensor is not None:
        return (StoredTensor(path, tensor),), codec
    required = _FILE_FORMATS[expect][0] + _FILE_FORMATS[expect][1] if expect else ("weight",)
    md = read_header(path, required=() if expect is None else required).metadata
    fmt = md.get("format")
    if expect is not None and fmt != expect:
        if expect == QUANT_FILE_FORMAT:
            raise TableError(f"{path}: not a quantized table file (no quant format in its header); re-create it")
        raise TableError(f"{path}: not a {expect!r} table file (format {fmt!r}); write it with "
                         f"{_FILE_FORMATS[expect][3]}")
    if fmt not in _FILE_FORMATS:
        read_header(path, required=("weight",))  # (a float table file: one clear error if it is not one)
        return None, None
    part_names, extra_names, make, _ = _FILE_FORMATS[fmt]
    extra = {k: StoredTensor(path, k) for k in extra_names}  # a file's small tensors, read at open: checked now
    blocks = BlockVerifier.open(path) if extra else None
    for t in extra.values():
        if blocks is not None:
            blocks.check_bytes(t.offset, t.info["data_offsets"][1] - t.offset)
    return tuple(StoredTensor(path, k) for k in part_names), make(md, {k: t.load() for k, t in extra.items()},
                                                                   where, path)


def _quant_codec(md, _, where, path):
    if md.get("quant") not in FORMATS:
        raise TableError(f"{path}: not a quantized table file (no quant format in its header); re-create it")
    return ScaledRowCodec(md["quant"])


# metadata "format" -> (row parts, other tensors, codec from (metadata, other tensors, name, path), writer)
_FILE_FORMATS = {
    QUANT_FILE_FORMAT: (("codes", "scales"), (), _quant_codec, "write_quant_file"),
    NVFP4_FILE_FORMAT: (("rows",), ("global_scale",), lambda md, x, name, path: Nvfp4Codec(x["global_scale"], name),
                        "write_nvfp4_file"),
    UE8M0_FILE_FORMAT: (("rows",), (), lambda md, x, name, path: Ue8m0Codec(), "open_rows(..., dir=)"),
}


def _float_file(path: Path, tier: str, kwargs) -> Table:
    """An engram float table file (tensor `weight`) in a tier: the tiers' own float tables."""
    if tier == "mmap":
        return MmapTable(path, **{k: v for k, v in kwargs.items() if k in _MMAP_KW})
    if tier == "disk":
        return DiskTable(path, **{k: v for k, v in kwargs.items() if k in _DISK_KW})
    return _open_parts((StoredTensor(path, "weight"),), None, "ram", None, str(path), "open", {})


def _open_parts(parts: tuple, codec, tier: str, dtype, name: str, verify: str, kwargs) -> Table:
    """The table of stored parts read in place (ram: loaded, checked once; mmap: mapped; disk: `DiskTable`)."""
    codec = codec or FloatCodec(_torch_dtype(parts[0]))
    verifiers = {}

    def blocks_of(p):
        if p.path not in verifiers:
            verifiers[p.path] = BlockVerifier.open(p.path)
        return verifiers[p.path]

    def nbytes(p):
        m = p.mapped()
        return m.numel() * m.element_size()

    if tier == "disk":
        first = parts[0].disk(**{k: v for k, v in kwargs.items() if k in _DISK_KW})
        verifiers.setdefault(parts[0].path, first.blocks)
        try:
            rest = []
            for p in parts[1:]:  # (scales: a byte or two a row, read into RAM at open and checked there)
                if blocks_of(p) is not None and nbytes(p):
                    blocks_of(p).check_bytes(p.offset, nbytes(p))
                rest.append(p.load())
            return first if isinstance(codec, FloatCodec) else EncodedTable.of((first, *rest), codec, dtype, name)
        except BaseException:
            first.close()
            raise
    if tier == "ram":
        for p in parts:
            if blocks_of(p) is not None and nbytes(p):
                blocks_of(p).check_bytes(p.offset, nbytes(p))
        loaded = tuple(p.load() for p in parts)
        if isinstance(codec, FloatCodec):
            return InRamTable(loaded[0])
        return EncodedTable.of(loaded, codec, dtype, name)
    table = EncodedTable.of(tuple(p.mapped() for p in parts), codec, dtype, name)
    for p0 in {p.path: p for p in parts}.values():
        blocks, path = blocks_of(p0), p0.path
        if blocks is None:
            continue
        if verify == "open":
            blocks.verify_all()  # the whole file once, now
        else:
            table.check_blocks(blocks, [p.offset if p.path == path else None for p in parts])
    table.path = parts[0].path
    return table


def _torch_dtype(p) -> torch.dtype:
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(p.info["dtype"], torch.uint8) \
        if isinstance(p, StoredTensor) else p.dtype


# ------------------------------------------------------------------------------------------ rows given, and written
def _part_blocks(p, chunk_rows: int):
    m = p.mapped() if isinstance(p, StoredTensor) else p
    for s in range(0, m.shape[0], chunk_rows):
        yield m[s:s + chunk_rows]


def _concatenated(segments: list) -> RowBlocks:
    """Float row segments (tensors or StoredTensors, one width and dtype) as one table's rows, in order."""
    shapes = [tuple(s.shape) for s in segments]
    dtypes = {_torch_dtype(s) for s in segments}
    if len({w for _, w in shapes}) != 1 or len(dtypes) != 1:
        raise TableError(f"segments of one table differ in width or dtype ({shapes}, {sorted(map(str, dtypes))})")
    blocks = (b for s in segments for b in _part_blocks(s, 1 << 16))
    return RowBlocks((sum(n for n, _ in shapes), shapes[0][1]), dtypes.pop(), blocks)


def _as_blocks(parts: tuple, codec, chunk_rows: int = 1 << 16) -> RowBlocks:
    """The rows of `parts` as one stream of row blocks: as given, or the codec's parts packed (`pack_rows`)."""
    if len(parts) == 1:
        p = parts[0]
        if isinstance(p, RowBlocks):
            return p
        return RowBlocks(tuple(p.shape), _torch_dtype(p), _part_blocks(p, chunk_rows))
    streams = [_part_blocks(p, chunk_rows) for p in parts]
    shapes = [tuple(p.shape) for p in parts]
    width = sum(s[1] * torch.empty((), dtype=_torch_dtype(p)).element_size() for s, p in zip(shapes, parts))
    return RowBlocks((shapes[0][0], width), torch.uint8, (pack_rows(*bs) for bs in zip(*streams)))


def _filled(blocks: RowBlocks, codec) -> tuple:
    """Row blocks gathered into RAM: one tensor (float rows), or each of the codec's parts, filled a block at a time
    (never two copies of the table)."""
    n, w = blocks.shape
    if codec is None or codec.widths(0) is None:
        out, at = torch.empty(n, w, dtype=blocks.dtype), 0
        for b in blocks.blocks:
            out[at:at + b.shape[0]] = b
            at += b.shape[0]
        return (out,)
    dim = codec.layout((torch.empty(0, w, dtype=torch.uint8),), "rows")
    parts, at = [torch.empty(n, pw, dtype=torch.uint8) for pw in codec.widths(dim)], 0
    for b in blocks.blocks:
        for part, piece in zip(parts, codec.split(b.view(torch.uint8), dim)):
            part[at:at + b.shape[0]] = piece
        at += b.shape[0]
    return tuple(parts)


def write_rows(path, parts: tuple, codec: RowCodec | None = None, page_blocks: bool = False,
               metadata: dict | None = None) -> Path:
    """A table file of the rows `parts` (as `open_rows` takes them) encoded by `codec`, streamed a block of rows at
    a time with block sums: float rows as tensor `weight`; codes and scales packed in `rows` (block-scaled codecs;
    NVFP4 with its `global_scale`); int8/fp8 `codes` and `scales`. `open_rows(path, ...)` reads it in any tier."""
    from .files import tensor_entry, write_safetensors

    metadata = dict(metadata or {})
    if isinstance(codec, ScaledRowCodec):
        entries = [tensor_entry(k, p if not isinstance(p, StoredTensor) else p.mapped())
                   for k, p in zip(codec.parts, parts)]
        return write_safetensors(path, entries, {"format": QUANT_FILE_FORMAT, "quant": codec.fmt}, block_sums=True,
                                 page_blocks=page_blocks)
    rb = _as_blocks(tuple(parts), codec)
    if codec is None or isinstance(codec, FloatCodec):
        entries, fmt = [("weight", rb.dtype, rb.shape, rb.blocks)], "engram-table"
    elif isinstance(codec, Nvfp4Codec):
        g = torch.tensor([codec.global_scale], dtype=torch.float32)
        entries = [("rows", torch.uint8, rb.shape, rb.blocks), ("global_scale", torch.float32, (1,), iter([g]))]
        fmt = NVFP4_FILE_FORMAT
    elif isinstance(codec, Ue8m0Codec):
        entries, fmt = [("rows", torch.uint8, rb.shape, rb.blocks)], UE8M0_FILE_FORMAT
    else:
        raise TableError(f"{path}: rows in {codec.name} are not written as engram table files")
    return write_safetensors(path, entries, {**metadata, "format": fmt}, block_sums=True, page_blocks=page_blocks)


# ------------------------------------------------------------------------------------------ segments
class SegmentedTable(Table):
    """One table over consecutive segments (each a `Table`), so that rows of a concatenated layout can be read
    where a checkpoint keeps each part: rows (N,) -> (N, dim), each segment asked for its own rows."""

    def __init__(self, segments: list[Table], name: str = "table"):
        dims, dtypes = {t.dim for t in segments}, {t.dtype for t in segments}
        if len(dims) != 1 or len(dtypes) != 1:
            raise TableError(f"{name}: its segments differ in width or dtype ({sorted(dims)}, "
                             f"{sorted(map(str, dtypes))})")
        self.segments, self.dim, self.dtype = segments, dims.pop(), dtypes.pop()
        self.bounds = torch.tensor([0] + [t.num_rows for t in segments], dtype=torch.long).cumsum(0)
        self.num_rows = int(self.bounds[-1])

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(rows.numel(), self.dim, dtype=self.dtype) if out is None else out
        seg = torch.bucketize(rows, self.bounds[1:], right=True)  # (N,): the segment of each row
        for s in torch.unique(seg).tolist():
            at = (seg == s).nonzero().squeeze(1)
            out[at] = self.segments[s].gather(rows[at] - self.bounds[s])
        return out

    def stats(self) -> dict:
        return {"segments": [t.stats() for t in self.segments]}

    def close(self) -> None:
        for t in self.segments:
            t.close()
