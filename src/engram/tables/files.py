"""The table file format's reading side, shared by every file-backed table (mmap, disk tier).

A table file is a safetensors file whose tensor `weight` holds the rows `[rows, dim]`
(little-endian), optionally followed by the Adam moments `exp_avg`, `exp_avg_sq`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .base import TableError

NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # bfloat16 rows are mapped as uint16


def read_header(path: Path) -> tuple[int, dict, int]:
    """(header length, tensor table, file size) of a safetensors file, with clear errors."""
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
            meta["weight"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise TableError(f"{path}: corrupt header (expected a safetensors file with a 'weight' tensor)") from None
    return n, meta, size
