"""The table file format's reading side, shared by every file-backed table (mmap, disk tier, quantized).

A table file is a safetensors file whose tensor `weight` holds the rows `[rows, dim]`
(little-endian), optionally followed by the Adam moments `exp_avg`, `exp_avg_sq`; a quantized
table file holds `codes` and `scales` instead (`tables/quant.py`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .base import TableError

NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # bfloat16 rows are mapped as uint16
QUANT_NP_DTYPES = {"I8": np.int8, "U8": np.uint8, "F16": np.float16}  # codes and scales of quantized rows


def read_header(path: Path, required: tuple[str, ...] = ("weight",)) -> tuple[int, dict, int]:
    """(header length, tensor table, file size) of a safetensors file holding the `required` tensors, with clear
    errors."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"table file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TableError(f"{path} is too short to be a table file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 1 << 24):
            raise TableError(f"{path}: corrupt header length {n}")
        try:
            meta = json.loads(f.read(n))
            for name in required:
                meta[name]["data_offsets"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise TableError(f"{path}: corrupt header (expected a safetensors file with tensors "
                             f"{', '.join(repr(r) for r in required)})") from None
    return n, meta, size


def row_span(rows, row_bytes: int, offset: int, unit: int):
    """(first, last) `unit`-sized piece (page, checksum block) of the file holding each of `rows` (N,) of a
    tensor whose row 0 starts at byte `offset`: a row may straddle two."""
    start = rows * row_bytes + offset  # (N,) first byte of each row
    return start // unit, (start + row_bytes - 1) // unit


def map_tensor(path: Path, header_len: int, size: int, name: str, info: dict, writable: bool = False,
               dtypes: dict = NP_DTYPES):
    """(numpy memmap, torch view) of tensor `name` of a safetensors file (`info`: its header entry), checked
    against the file's size; bfloat16 is viewed as torch.bfloat16. No page is read until it is used."""
    import warnings

    import torch

    if info["dtype"] not in dtypes:
        raise TableError(f"{path}: '{name}' has unsupported dtype {info['dtype']}")
    a, b = info["data_offsets"]
    if 8 + header_len + b > size:
        raise TableError(f"{path} is truncated: header promises {b} data bytes, file has {size - 8 - header_len}")
    arr = np.memmap(path, dtype=dtypes[info["dtype"]], mode="r+" if writable else "r", offset=8 + header_len + a,
                    shape=tuple(info["shape"]))
    with warnings.catch_warnings():  # read-only mappings are only ever gathered from
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return arr, t.view(torch.bfloat16) if info["dtype"] == "BF16" else t
