"""The one reader of safetensors headers in engram (`read_header`): table files (`files`, `trainable`, `disk`,
`rows`), released checkpoints' shards (`integrations.checkpoint`, `integrations.qwen4_exp.checkpoint`) and the file
ids block sums are bound to (`blocks.header_id`) all go through it. It checks what it reads: the 8-byte length, the
JSON, every tensor entry and that every tensor lies inside the file, each failure one `TableError` line.

A module of its own below `files` (the writer) and `blocks` (the checksums the writer adds), which both read
headers.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from ..persist import decode_json_bytes
from .base import TableError

MAX_HEADER_BYTES = 1 << 24  # a longer header is not one engram reads (never read a whole file as one)


class SafetensorsHeader(NamedTuple):
    """A safetensors file's header, checked (`read_header`): `length` its bytes (the data section starts at
    `data_start` = 8 + length), `entries` its JSON object ({tensor name: {"dtype", "shape", "data_offsets"}}, and
    "__metadata__"), `size` the file's bytes. Unpacks as (header length, entries, file size)."""

    length: int
    entries: dict
    size: int

    @property
    def data_start(self) -> int:
        return 8 + self.length

    @property
    def tensors(self) -> dict:
        """{tensor name: {"dtype": str, "shape": [int], "data_offsets": [start, end]}}, offsets in the data section."""
        return {k: v for k, v in self.entries.items() if k != "__metadata__"}

    @property
    def metadata(self) -> dict:
        """The header's "__metadata__" ({} when it has none): engram's files name their format there."""
        return self.entries.get("__metadata__", {})


def read_header(path, required: tuple[str, ...] = ("weight",)) -> SafetensorsHeader:
    """The header of safetensors file `path` holding the `required` tensors: the one reader of safetensors headers
    (table files, quantized and NVFP4 files, released checkpoints' shards, block sums' file ids).

    `[u64 little-endian n][n bytes of JSON][data section]`; every tensor entry is checked (dtype, shape, data
    offsets) and must lie inside the file. A missing, short, truncated or non-safetensors file is one `TableError`
    line naming the file and what was expected."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"table file not found: {path}")
    size = path.stat().st_size
    names = ", ".join(map(repr, required))
    expected = f"expected a safetensors file with tensors {names}" if required else "expected a safetensors file"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TableError(f"{path} is too short to be a table file ({size} bytes); {expected}")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise TableError(f"{path}: corrupt header length {n:,} (the file has {size:,} bytes); {expected}")
        entries = decode_json_bytes(f.read(n), f"{path}: header", expected, TableError)
    for name, info in entries.items():
        bad = _bad_entry(name, info)
        if bad:
            raise TableError(f"{path}: header is corrupt ({bad}); {expected}")
    missing = [r for r in required if r not in entries or r == "__metadata__"]
    if missing:
        raise TableError(f"{path}: header is corrupt (no tensor {missing[0]!r}); {expected}")
    header = SafetensorsHeader(n, entries, size)
    end = max((info["data_offsets"][1] for info in header.tensors.values()), default=0)  # in the data section
    if header.data_start + end > size:
        raise TableError(f"{path} is truncated: its header promises {end:,} data bytes, the file has "
                         f"{size - header.data_start:,}; re-create or re-download it")
    return header


def _bad_entry(name: str, info) -> str:
    """What is wrong with one entry of a safetensors header ("" when nothing is)."""
    if name == "__metadata__":
        return "" if isinstance(info, dict) else "its __metadata__ is not an object"
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or not _counts(info.get("shape")):
        return f"tensor {name!r} has no dtype and shape"
    offsets = info.get("data_offsets")
    if not _counts(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        return f"tensor {name!r} has no data offsets [start, end]"
    return ""


def _counts(xs) -> bool:
    """Whether `xs` is a list of non-negative integers (a shape, data offsets)."""
    return isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)
