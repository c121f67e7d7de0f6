"""The table file format, both sides: writing (streamed, atomic, with block sums) and reading (header, mapping),
shared by every file-backed table (mmap, disk tier, quantized). Headers are read by `header.read_header`, the one
reader of safetensors headers in engram.

A table file is a safetensors file whose tensor `weight` holds the rows `[rows, dim]`
(little-endian), optionally followed by the Adam moments `exp_avg`, `exp_avg_sq`; a quantized
table file holds `codes` and `scales` instead (`tables/quant.py`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import torch

from ..persist import atomic_file
from .base import TableError, find_tables
from .header import SafetensorsHeader

NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # bfloat16 rows are mapped as uint16
QUANT_NP_DTYPES = {"I8": np.int8, "U8": np.uint8, "F16": np.float16,  # codes and scales of quantized rows; FP8 bytes
                   "F8_E4M3": np.uint8, "F8_E8M0": np.uint8}  # (DeepSeek-V4.1's rows and ue8m0 scales) stay raw


def map_tensor(path: Path, header: SafetensorsHeader, name: str, writable: bool = False, dtypes: dict = NP_DTYPES):
    """(numpy memmap, torch view) of tensor `name` of a safetensors file (`header`: its `read_header`, which checked
    that the tensor lies inside the file); bfloat16 is viewed as torch.bfloat16. No page is read until it is used."""
    import warnings

    info = header.entries[name]
    if info["dtype"] not in dtypes:
        raise TableError(f"{path}: '{name}' has unsupported dtype {info['dtype']}")
    arr = np.memmap(path, dtype=dtypes[info["dtype"]], mode="r+" if writable else "r",
                    offset=header.data_start + info["data_offsets"][0], shape=tuple(info["shape"]))
    with warnings.catch_warnings():  # read-only mappings are only ever gathered from
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return arr, t.view(torch.bfloat16) if info["dtype"] == "BF16" else t


# ------------------------------------------------------------------------------------------ writing
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int8: "I8", torch.uint8: "U8",
              torch.int32: "I32", torch.bool: "BOOL", torch.float64: "F64"}


def table_file(directory: str | os.PathLike, layer_id: int, rank: int | None = None, world: int | None = None) -> Path:
    """Where layer `layer_id`'s table lives: one file, or with `rank`/`world` one file per rank's shard."""
    shard = f".rank{rank}-of-{world}" if rank is not None else ""
    return Path(directory) / f"engram_table_L{layer_id}{shard}.safetensors"


def write_table_file(path: str | os.PathLike, weight: torch.Tensor, chunk_rows: int = 1 << 20,
                     with_moments: bool = False, page_blocks: bool = False) -> Path:
    """Write `weight` as a safetensors file with one tensor `weight`, streamed in chunks, atomically.

    `with_moments=True` adds zero float32 tensors `exp_avg` and `exp_avg_sq` of the same shape
    (the Adam moments a trainable `MmapTable` keeps beside the rows). `page_blocks`: see `write_safetensors`.
    """
    w = weight.detach().cpu()
    entries = [tensor_entry("weight", w, chunk_rows)]
    return write_safetensors(path, entries + (_zero_moments(*w.shape, chunk_rows) if with_moments else []),
                             block_sums=True, page_blocks=page_blocks)


def new_table_file(path: str | os.PathLike, rows: torch.Tensor, num_rows: int, seed: int | None,
                   with_moments: bool, page_blocks: bool = False, std: float = 1.0) -> Path:
    """A table file of `num_rows` rows: `rows` written out when it holds them, else N(0, std) drawn from `seed`.

    `rows` gives dim and dtype; it is empty for a model built under `defer_table_allocation()`.
    """
    if rows.shape[0] == num_rows:
        return write_table_file(path, rows, with_moments=with_moments, page_blocks=page_blocks)
    if seed is None:
        raise TableError(f"{path} does not exist and the model has no table rows to write "
                         "(built with defer_table_allocation()): pass init_seed to create it")
    return create_table_file(path, num_rows, rows.shape[1], rows.dtype, seed=seed, with_moments=with_moments,
                             page_blocks=page_blocks, std=std)


def create_table_file(path: str | os.PathLike, num_rows: int, dim: int, dtype: torch.dtype = torch.float32,
                      seed: int = 0, with_moments: bool = False, chunk_rows: int = 1 << 18,
                      page_blocks: bool = False, std: float = 1.0) -> Path:
    """A new table file with N(0, std) rows (std 1: nn.Embedding's init) drawn chunk by chunk from `seed`.

    Memory stays at one chunk, so the table can be larger than RAM. Same seed, same file.
    """
    g = torch.Generator().manual_seed(seed)
    chunks = ((torch.randn(min(chunk_rows, num_rows - s), dim, generator=g) * std).to(dtype)
              for s in range(0, num_rows, chunk_rows))
    entries = [("weight", dtype, (num_rows, dim), chunks)]
    return write_safetensors(path, entries + (_zero_moments(num_rows, dim, chunk_rows) if with_moments else []),
                             block_sums=True, page_blocks=page_blocks)


def tensor_entry(name: str, t: torch.Tensor, chunk_rows: int = 1 << 18) -> tuple:
    """A `write_safetensors` entry for tensor `t` (e.g. a memory-mapped table), copied one row block at a time."""
    chunks = (t[s:s + chunk_rows] for s in range(0, max(1, t.shape[0]), chunk_rows)) if t.dim() else iter([t])
    return name, t.dtype, tuple(t.shape), chunks


def table_entries(module, tensors: dict, where: str = "") -> list:
    """`write_safetensors` entries for `tensors` (a state dict of `module`, in its order), with every installed
    table's rows (`<name>.embedding.weight`, an empty parameter then) streamed from its backend instead."""
    backed = {f"{name}.embedding.weight": m.table for name, m in find_tables(module) if m.table is not None}
    missing = sorted(set(backed) - set(tensors))
    if missing:
        raise TableError(f"{where or 'the tensors to write'} lack the table entries {missing}")
    return [tensor_entry(k, backed[k].weight if k in backed else v) for k, v in tensors.items()]


def _zero_moments(num_rows: int, dim: int, chunk_rows: int) -> list:
    def zeros():
        for s in range(0, num_rows, chunk_rows):
            yield torch.zeros(min(chunk_rows, num_rows - s), dim)
    return [("exp_avg", torch.float32, (num_rows, dim), zeros()),
            ("exp_avg_sq", torch.float32, (num_rows, dim), zeros())]


def write_safetensors(path: str | os.PathLike, entries: list, metadata: dict | None = None,
                      progress_bytes: int = 1 << 30, block_sums: bool = False, page_blocks: bool = False) -> Path:
    """Stream tensors into a safetensors file, atomically (`persist.atomic_file`: temp file, fsync, rename).

    `entries`: `(name, dtype, shape, chunks)` in file order, where `chunks` yields row blocks whose
    concatenation is the tensor, so tensors larger than RAM (memory-mapped, generated) are written
    a block at a time. Files of `progress_bytes` or more show a progress bar. `block_sums=True`
    (table files) also writes the per-block checksums `<file>.blocks` (`tables/blocks.py`),
    computed on the way; the header then carries a fresh nonce, so sums of an older version of the
    file never pass for this one's. `page_blocks=True` (files of the disk tier) pads the header so
    the data starts on a 4 KiB page and sums every page: checking a row read cold costs one page.
    """
    import uuid

    from .blocks import BLOCK_BYTES, PAGE, BlockCrc, write_sums

    path = Path(path)
    if block_sums:
        metadata = {**(metadata or {}), "engram_nonce": uuid.uuid4().hex}
    crc = BlockCrc(PAGE if page_blocks else BLOCK_BYTES) if block_sums else None
    meta, offset = {}, 0
    for name, dtype, shape, _ in entries:
        dt = _ST_DTYPES.get(dtype)
        if dt is None:
            raise TableError(f"{name}: dtype {dtype} is not supported (use float32, bfloat16 or float16)")
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        meta[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        meta["__metadata__"] = metadata
    header = json.dumps(meta).encode()
    align = PAGE if page_blocks else 8  # the data starts at 8 + len(header): pad with spaces (safetensors allows it)
    header += b" " * ((align - (8 + len(header)) % align) % align)
    from tqdm.auto import tqdm

    bar = tqdm(total=offset, unit="B", unit_scale=True, desc=f"writing {path.name}",
               disable=offset < progress_bytes, leave=False)
    with atomic_file(path) as f, bar:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for name, _dtype, _shape, chunks in entries:
            written = 0
            for c in chunks:
                b = c.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if c.numel() else b""
                f.write(b)
                if crc is not None:
                    crc.update(b)
                written += len(b)
                bar.update(len(b))
            a, z = meta[name]["data_offsets"]
            if written != z - a:
                raise TableError(f"{name}: wrote {written} bytes, the header promises {z - a}")
    if crc is not None:
        write_sums(path, crc.finish(), crc.block_bytes)
    return path
