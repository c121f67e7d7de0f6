"""The row codec interface: how one table's rows are stored as bytes, and decoded after a gather.

A codec knows nothing of files or tiers (`tables.rows.open_rows` does): it checks the shapes of a row's stored
parts, and turns the parts of gathered rows into values.

    parts = codec.encode(rows)               # rows (N, d) -> the stored parts, (N, w_i) or (N,)
    dim = codec.layout(parts, name)          # parts: stored tensors (or Tables of them), (N, w_i) or (N,)
    vals = codec.decode(gathered, dim, dtype)   # gathered parts of N rows -> (N, dim) `dtype`
"""

from __future__ import annotations

import torch

from ..base import Table, TableError


def shape_of(part) -> tuple:
    """The shape of a stored part: a tensor's, or (num_rows, dim) of a `Table` serving it (the disk tier)."""
    return (part.num_rows, part.dim) if isinstance(part, Table) else tuple(part.shape)


def pack_rows(*parts: torch.Tensor) -> torch.Tensor:
    """(N, sum of the parts' row bytes) uint8: each row's parts side by side (codes, then scales), so one read
    fetches a row (`RowCodec.split` undoes it)."""
    return torch.cat([p.view(torch.uint8) for p in parts], dim=1)


class RowCodec:
    """How rows are stored: `parts` (their names in a file, e.g. codes and scales), decoded after the gather.

    `encode(rows)` gives the stored parts of rows (N, d); `layout(parts, name) -> dim` checks the stored parts
    (tensors or Tables; one packed part for codecs whose parts are all byte rows, `widths`) and gives the row width,
    a one-line `TableError` when they do not fit; `decode(parts, dim, dtype)` turns the gathered parts (N, w_i) into
    rows (N, dim); `bytes_per_row(dim)` is what a row costs where it is stored."""

    name = ""
    parts: tuple[str, ...] = ("rows",)
    dtype = torch.float32  # what a gather returns unless the table says otherwise

    def encode(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The stored parts of rows (N, d), as `decode` takes them back: each (N, w_i), or (N,) for a scale per row.
        Per-row arithmetic only, so rows encoded a chunk at a time give the same bytes (NVFP4's per-table scale
        is fixed when its codec is made)."""
        raise NotImplementedError

    def layout(self, parts: tuple, name: str) -> int:
        raise NotImplementedError

    def widths(self, dim: int) -> tuple[int, ...] | None:
        """Bytes per row of each part when the parts can be stored packed in one byte row, else None."""
        return None

    def split(self, packed: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
        """The parts of gathered packed rows (N, sum of widths)."""
        out, at = [], 0
        for w in self.widths(dim):
            out.append(packed[:, at:at + w])
            at += w
        return tuple(out)

    def decode(self, parts: tuple[torch.Tensor, ...], dim: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def bytes_per_row(self, dim: int) -> int:
        raise NotImplementedError


class FloatCodec(RowCodec):
    """Float rows stored as themselves (float32, bfloat16, float16): one part (N, d), cast to `dtype` after the
    gather (no copy when it is the stored dtype). 4, 2 or 2 bytes a value."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.name = dtype, str(dtype).removeprefix("torch.")

    def layout(self, parts: tuple, name: str) -> int:
        shapes = [shape_of(p) for p in parts]
        if len(shapes) != 1 or len(shapes[0]) != 2:
            raise TableError(f"{name}: float rows are one (N, d) tensor, got {shapes}")
        return shapes[0][1]

    def encode(self, rows):
        return (rows.to(self.dtype),)

    def bytes_per_row(self, dim: int) -> int:
        return dim * torch.empty((), dtype=self.dtype).element_size()

    def decode(self, parts, dim, dtype):
        return parts[0].to(dtype)
