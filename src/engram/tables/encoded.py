"""The one table of encoded rows: stored bytes gathered from any tier, decoded after the gather by a row codec.

    table = EncodedTable((codes, scales), ScaledRowCodec("fp8"))     # parts in RAM, mapped, or Tables of them
    rows = table.gather(ids)                                          # (N, dim): only the stored bytes travel

A table's rows are stored as the codec's parts (codes and scales), or packed in one byte row (one read a row).
Each part is a tensor (in RAM, or memory-mapped from a file: `check_blocks` then checks each block of the file on
its first read) or a `Table` serving the stored rows (the disk tier's `DiskTable`: positioned reads, checked
itself). The tiers and formats are chosen by `tables.rows.open_rows`; the codecs are `tables.codecs`.

The names served before this one table existed stay as thin constructors with their arguments: `QuantTable`
(int8 / fp8 per row), `BlockFp8Table` (ue8m0 blocks), `NvFp4Table`, `GgufTable` (ggml types).
"""

from __future__ import annotations

import torch

from .base import Table, TableError
from .codecs import FLOAT_TYPES, GgmlCodec, Nvfp4Codec, RowCodec, ScaledRowCodec, Ue8m0Codec
from .codecs.scaled import BlockScaledCodec


class EncodedTable(Table):
    """Read-only rows stored by `codec` in `parts`, decoded after each gather into `dtype` (default the codec's).

    `parts`: the codec's parts, each (N, w) (or (N,) for a scale per row), or one packed part (N, sum of the
    codec's `widths`); each a tensor or a `Table` of the stored rows."""

    def __init__(self, parts, codec: RowCodec, dtype: torch.dtype | None = None, name: str = "table"):
        parts = tuple(parts)
        self.dim = codec.layout(parts, name)
        first = parts[0]
        self.num_rows = first.num_rows if isinstance(first, Table) else first.shape[0]
        self.parts, self.codec, self.dtype, self.name = parts, codec, dtype or codec.dtype, name
        self.packed_parts = len(parts) == 1 and len(codec.parts) > 1
        self._checks = [None] * len(parts)
        self.trainable = False
        self.path = getattr(first, "path", None)

    def check_blocks(self, blocks, offsets) -> None:
        """Check each block of the file holding the mapped parts on its first read: `blocks` its `BlockVerifier`,
        `offsets` each part's byte offset in the file's data section (None for a part not in that file)."""
        if blocks is None:
            return
        self.blocks = blocks
        for i, (p, off) in enumerate(zip(self.parts, offsets)):
            if off is not None and not isinstance(p, Table):
                self._checks[i] = (blocks, off, (p.shape[1] if p.dim() == 2 else 1) * p.element_size())

    blocks = None  # the file's block checksums, when its mapped parts are checked on first read

    @property
    def bytes_per_row(self) -> int:
        return self.codec.bytes_per_row(self.dim)

    def read(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The stored parts of `rows` (N,) as stored (packed rows split into the codec's parts)."""
        mapped = [p for p in self.parts if not isinstance(p, Table)]
        if mapped and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.num_rows):
            raise TableError(f"{self.name}: row ids must lie in [0, {self.num_rows})")
        out = []
        for p, check in zip(self.parts, self._checks):
            if isinstance(p, Table):  # the disk tier reads (and checks) its rows
                out.append(p.gather(rows))
                continue
            if check is not None:
                check[0].check_rows(rows, check[1], check[2])
            out.append(p.index_select(0, rows))
        return self.codec.split(out[0], self.dim) if self.packed_parts else tuple(out)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = rows.reshape(-1).long()
        vals = self.codec.decode(self.read(rows), self.dim, self.dtype)  # (N, dim)
        return out.copy_(vals) if out is not None else vals

    def stats(self) -> dict:
        extra = self.parts[0].stats() if isinstance(self.parts[0], Table) else {}
        return {**extra, "format": self.codec.name, "bytes_per_row": self.bytes_per_row}

    def close(self) -> None:
        for p in self.parts:
            if isinstance(p, Table):
                p.close()

    @classmethod
    def of(cls, parts, codec: RowCodec, dtype: torch.dtype | None = None, name: str = "table") -> "EncodedTable":
        """The table of `codec`'s rows under the name it was served as before (`QuantTable`, `NvFp4Table`, ...),
        built from parts as `EncodedTable` takes them."""
        kind = next((k for c, k in _NAMED if isinstance(codec, c)), EncodedTable)
        table = kind.__new__(kind)
        EncodedTable.__init__(table, parts, codec, dtype, name)
        return table


# ------------------------------------------------------------------------------------------ the names served before
class QuantTable(EncodedTable):
    """Rows stored quantized with a scale per row (`quantize_rows`: "int8" or "fp8"), dequantized after each gather.
    `codes`: (N, d) tensor, or a `Table` of them (the disk tier); `scales` (N,)."""

    def __init__(self, codes, scales: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32):
        super().__init__((codes, scales), ScaledRowCodec(fmt), dtype)

    fmt = property(lambda self: self.codec.fmt)
    codes = property(lambda self: self.parts[0])
    scales = property(lambda self: self.parts[1])


def _block_parts(codes, scales, packed, fmt: str, name: str) -> tuple:
    if packed is not None:
        return (packed,)
    if codes is None or scales is None:
        raise TableError(f"{name}: {fmt} rows need both codes and scales (or packed rows); the "
                         f"{'scales' if codes is not None else 'codes'} are missing")
    return codes, scales


class BlockScaledTable(EncodedTable):
    """Rows stored as byte codes with one scale byte per block of values (`codecs.BlockScaledCodec`): `codes` and
    `scales`, or `packed` (each row's codes then its scales: one read a row)."""

    codes = property(lambda self: None if self.packed_parts else self.parts[0])
    scales = property(lambda self: None if self.packed_parts else self.parts[1])
    packed = property(lambda self: self.parts[0] if self.packed_parts else None)
    fmt = property(lambda self: self.codec.name)
    code_bytes = property(lambda self: self.codec.widths(self.dim)[0])


class BlockFp8Table(BlockScaledTable):
    """DeepSeek-V4.1's rows: e4m3 codes (N, d) and ue8m0 scales (N, d / 32), or `packed` (N, d + d / 32)."""

    def __init__(self, codes=None, scales=None, dtype: torch.dtype = torch.bfloat16, name: str = "table",
                 packed=None):
        super().__init__(_block_parts(codes, scales, packed, "fp8_ue8m0", name), Ue8m0Codec(), dtype, name)


class NvFp4Table(BlockScaledTable):
    """NVFP4 rows: `codes` (N, d/2) packed E2M1 pairs and `scales` (N, d/16) E4M3 block scales, or `packed`
    (N, d/2 + d/16), and the per-tensor `global_scale`."""

    def __init__(self, codes=None, scales=None, global_scale=None, dtype: torch.dtype = torch.bfloat16,
                 name: str = "table", packed=None):
        parts = _block_parts(codes, scales, packed, "nvfp4", name)
        super().__init__(parts, Nvfp4Codec(global_scale, name), dtype, name)

    global_scale = property(lambda self: self.codec.global_scale)


class GgufTable(EncodedTable):
    """One GGUF table tensor's rows (`src`: raw row bytes, or float rows as their dtype; or a `Table` of them),
    decoded from ggml type `type_name` after each gather (`codecs.GgmlCodec`)."""

    def __init__(self, src, type_name: str, dim: int, dtype: torch.dtype, name: str, blocks=None, offset: int = 0):
        super().__init__((src,), GgmlCodec(type_name), dtype, name)
        if self.dim != dim:
            raise TableError(f"{name}: rows of {self.dim} values, {dim} expected")
        self.check_blocks(blocks, [offset])

    type = property(lambda self: self.codec.type)
    src = property(lambda self: self.parts[0])

    @property
    def weight(self) -> torch.Tensor:
        """All rows decoded (N, dim): for saving or copying the table out (float rows: the mapping itself)."""
        src = self.src.weight if isinstance(self.src, Table) else self.src
        if self.type in FLOAT_TYPES and src.dtype == self.dtype:
            return src
        step = 1 << 16
        return torch.cat([self.codec.decode((src[s:s + step],), self.dim, self.dtype)
                          for s in range(0, self.num_rows, step)]) if self.num_rows else \
            torch.empty(0, self.dim, dtype=self.dtype)


_NAMED = ((ScaledRowCodec, QuantTable), (Nvfp4Codec, NvFp4Table), (Ue8m0Codec, BlockFp8Table),
          (BlockScaledCodec, BlockScaledTable), (GgmlCodec, GgufTable))
