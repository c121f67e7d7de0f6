"""Serving a model's tables in another row format, and the quantized table files: the format switch.

    set_table_format(model, "fp8")                 # every Engram table of a model, served as `fmt`
    codes, scales = quantize_rows(W, "fp8")        # (N, d) uint8 codes, (N,) scales (`tables.codecs`)
    table = QuantTable(codes, scales, "fp8")       # a read-only Table: gather -> dequantized (N, d) rows

Rows are decoded after the gather (`tables.encoded.EncodedTable`), so only the stored bytes travel from memory
(or disk). Formats (`TABLE_FORMATS`): float32 and bfloat16 as themselves; "int8" and "fp8" with a scale per row
(d + 2 and d + 1 bytes); "fp8_ue8m0" (DeepSeek-V4.1's rows: a ue8m0 scale byte per 32 values, d + d/32 bytes);
"nvfp4" (Qwen4Exp's rows in vLLM 0.33: d/2 + d/16 bytes, 0.28 of bfloat16). The codecs are `tables.codecs`;
the files are read in any tier by `tables.rows.open_rows`. Inference only: a quantized table is not trainable
(train in float32/bf16, quantize after).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from ..deprecation import renamed_keywords
from .base import TableError, find_tables, install
from .codecs import (
    FORMATS,
    NVFP4_BLOCK,
    UE8M0_BLOCK,
    FloatCodec,
    Nvfp4Codec,
    RowCodec,
    ScaledRowCodec,
    Ue8m0Codec,
    check_global_scale,
    dequantize,
    dequantize_nvfp4,
    dequantize_ue8m0,
    e2m1_to_float,
    e4m3_to_float,
    nvfp4_global_scale,
    pack_rows,
    quantize_nvfp4,
    quantize_rows,
    quantize_ue8m0,
    ue8m0_to_float,
)
from .encoded import BlockFp8Table, BlockScaledTable, NvFp4Table, QuantTable
from .rows import NVFP4_FILE_FORMAT, QUANT_FILE_FORMAT, RowBlocks, check_tier, open_rows, tier_of, write_rows


class ServedFormat(NamedTuple):
    """How `set_table_format` serves one format (`_SERVED`).

    `codec(rows, name)`: the codec of one table's stored rows (N, d) (NVFP4's global scale comes from the table's
    own rows), or None: the rows are served as they are stored (float32: 4 bytes a value). `block`: rows must be a
    multiple of this many values wide. `keep_tier`: the new rows stay in the replaced table's tier (a packed file
    beside a file-backed table's, which is closed), else they are encoded into RAM."""

    codec: Callable[[torch.Tensor, str], RowCodec] | None
    block: int = 1
    keep_tier: bool = False


_SERVED = {  # format -> how it is served (the codecs are `tables.codecs`), in `TABLE_FORMATS` order
    "float32": ServedFormat(None),
    "bfloat16": ServedFormat(lambda rows, name: FloatCodec(torch.bfloat16)),
    **{fmt: ServedFormat(lambda rows, name, fmt=fmt: ScaledRowCodec(fmt)) for fmt in FORMATS},  # int8, fp8
    "fp8_ue8m0": ServedFormat(lambda rows, name: Ue8m0Codec(), Ue8m0Codec.block),
    "nvfp4": ServedFormat(Nvfp4Codec.of_rows, Nvfp4Codec.block, keep_tier=True),
}
TABLE_FORMATS = tuple(_SERVED)  # what `set_table_format` serves
pack_ue8m0_rows = pack_nvfp4_rows = pack_rows  # (N, code bytes + scale bytes): each row's codes, then its scales


def check_table_format(fmt: str) -> None:
    """`TableError` in one line unless `set_table_format` serves `fmt` (`TABLE_FORMATS`)."""
    if fmt not in TABLE_FORMATS:
        raise TableError(f"table format must be one of {TABLE_FORMATS}, got {fmt!r}")


def set_table_format(model, fmt: str) -> dict:
    """Serve `model`'s Engram tables as `fmt`: "float32" (as they are), "bfloat16" (cast, in RAM), "int8" or "fp8"
    (`quantize_tables`, dequantized to float32 after each gather), "fp8_ue8m0" (DeepSeek-V4.1's rows: a scale
    byte per 32 values) or "nvfp4" (Qwen4Exp's NVFP4 rows in vLLM: 4-bit codes, an E4M3 scale per 16 values and
    one per table, kept in the tables' tier: `nvfp4_tables`). Returns {layer_id: bytes per row}."""
    check_table_format(fmt)
    return {layer_id: per_row for layer_id, (_, per_row) in _convert(model, fmt, torch.float32).items()}


def quantize_tables(model, fmt: str, dtype: torch.dtype | None = None) -> dict[int, QuantTable]:
    """Replace every Engram table of `model` by its quantized copy (`fmt` int8 | fp8), installed behind its layer.

    The rows must be in the model (its own parameter, or an installed table's `weight`); the float
    parameter is freed. Gathers decode to `dtype` (default: the layer's parameter dtype). Returns {layer_id: table}.
    """
    if fmt not in FORMATS:
        raise TableError(f"table format must be one of {FORMATS}, got {fmt!r}")
    return {layer_id: table for layer_id, (table, _) in _convert(model, fmt, dtype).items()}


def nvfp4_tables(model, dtype: torch.dtype = torch.float32, chunk_rows: int = 1 << 16) -> dict[int, NvFp4Table]:
    """Replace every Engram table of `model` by its NVFP4 copy (`quantize_nvfp4`, one global scale per table),
    installed behind its layer and kept in its tier: rows in RAM stay in RAM; a file-backed table (mmap or
    disk tier) gets an NVFP4 file beside its file (`<name>.nvfp4.safetensors`) opened in the same tier.
    Returns {layer_id: table}."""
    return {layer_id: table for layer_id, (table, _) in _convert(model, "nvfp4", dtype, chunk_rows).items()}


def _convert(model, fmt: str, dtype: torch.dtype | None, chunk_rows: int = 1 << 16) -> dict[int, tuple]:
    """The one install loop: each Engram table of `model` read through its tier (`stored_rows`), encoded by the
    codec `_SERVED[fmt]` gives it, opened as a table (`open_rows`: in RAM, or written `chunk_rows` at a time to a
    file in the old table's tier) that decodes gathers to `dtype` (None: the layer's parameter dtype), and installed
    behind its layer, the float parameter freed. Returns {layer_id: (table, bytes per row)} (float32: the table left
    as it is, None for the layer's own parameter)."""
    served = _SERVED[fmt]
    out = {}
    for _, mhe in find_tables(model):
        if served.codec is None:
            out[mhe.layer_id] = mhe.table, mhe.dim * 4
            continue
        if mhe.dim % served.block:
            raise TableError(f"{fmt} needs rows a multiple of {served.block} wide; layer {mhe.layer_id}'s are "
                             f"{mhe.dim}")
        old, rows, name = mhe.table, stored_rows(mhe), f"layer {mhe.layer_id}"
        codec, dt = served.codec(rows, name), dtype or mhe.embedding.weight.dtype
        tier = tier_of(old) if served.keep_tier and old is not None else "ram"
        if tier == "ram":
            table = open_rows(codec.encode(rows), "ram", codec=codec, dtype=dt, name=name)
        else:  # packed rows (the formats kept in their tier are block-scaled), streamed into a file beside the old
            n, f = rows.shape[0], Path(old.path)
            packed = (pack_rows(*codec.encode(rows[s:s + chunk_rows])) for s in range(0, n, chunk_rows))
            table = open_rows(RowBlocks((n, codec.bytes_per_row(mhe.dim)), torch.uint8, packed), tier, f.parent,
                              codec=codec, file=f"{f.name.split('.')[0]}.{fmt}.safetensors", dtype=dt, name=name,
                              metadata={"layer": str(mhe.layer_id)})
        if served.keep_tier and old is not None:
            old.close()
        install(mhe, table, free_parameter=True)
        out[mhe.layer_id] = table, codec.bytes_per_row(mhe.dim)
    return out


def stored_rows(mhe) -> torch.Tensor:
    """All rows of one Engram table as they are stored now (N, d): an installed table's `weight` (a mapped file for
    the mmap and disk tiers: pages read as touched) or the layer's own parameter. What a format conversion reads:
    offloading empties the parameter, so reading `mhe.embedding.weight` there finds no rows."""
    src = mhe.table.weight if mhe.table is not None and hasattr(mhe.table, "weight") else mhe.embedding.weight
    if src.shape[0] != mhe.num_rows:
        raise TableError(f"layer {mhe.layer_id}: its {mhe.num_rows} rows are not readable here (the table holds "
                         f"{list(src.shape)}); convert the tables before moving them, or load them again")
    return src.detach()


def quant_error(w: torch.Tensor, fmt: str) -> dict:
    """Relative error of the rows `w` after a round trip through `fmt` (max and RMS over all entries)."""
    codes, scales = quantize_rows(w, fmt)
    back = dequantize(codes, scales, fmt)
    err = (back - w.float()).abs()
    rms = float(err.square().mean().sqrt() / w.float().square().mean().sqrt().clamp_min(1e-30))
    return {"max_abs": float(err.max()), "rel_rms": rms, "bytes_per_row": QuantTable(codes, scales, fmt).bytes_per_row}


def write_quant_file(path, codes: torch.Tensor, scales: torch.Tensor, fmt: str, page_blocks: bool = False):
    """A quantized table file: safetensors with `codes` (N, d) and `scales` (N,), format in the metadata,
    and block checksums (`tables/blocks.py`; `page_blocks=True` for the disk tier, as `write_safetensors`)."""
    return write_rows(path, (codes, scales), ScaledRowCodec(fmt), page_blocks=page_blocks)


@renamed_keywords(backend="tier")
def open_quant_file(path, dtype: torch.dtype = torch.float32, tier: str = "mmap", **disk_kwargs) -> QuantTable:
    """A `QuantTable` over a quantized table file (`write_quant_file`) (`open_rows`).

    tier "mmap": codes and scales memory-mapped, blocks checked on first read. "disk": the codes read
    by the cold tier (`DiskTable`, positioned reads, `disk_kwargs` such as `queue_depth`, `direct`), the
    scales (one byte or two per row) loaded into RAM at open and checked there, so a cold row costs one read.
    """
    check_tier(tier, ("mmap", "disk"))
    return open_rows(path, tier, dtype=dtype, expect=QUANT_FILE_FORMAT, **disk_kwargs)


def write_nvfp4_file(path, chunks, num_rows: int, dim: int, global_scale, page_blocks: bool = False,
                     metadata: dict | None = None):
    """An NVFP4 table file: safetensors with `rows` (N, d/2 + d/16) uint8 (`pack_nvfp4_rows`, streamed from
    `chunks`) and `global_scale` (1,) float32, with block checksums (`page_blocks=True` for the disk tier)."""
    if dim % NVFP4_BLOCK:
        raise TableError(f"NVFP4 needs rows a multiple of {NVFP4_BLOCK} wide; these are {dim}")
    rows = RowBlocks((num_rows, dim // 2 + dim // NVFP4_BLOCK), torch.uint8, chunks)
    return write_rows(path, (rows,), Nvfp4Codec(global_scale, str(path)), page_blocks, metadata)


@renamed_keywords(backend="tier")
def open_nvfp4_file(path, tier: str = "mmap", dtype: torch.dtype = torch.bfloat16, name: str | None = None,
                    **disk_kwargs) -> NvFp4Table:
    """An `NvFp4Table` over an NVFP4 table file (`write_nvfp4_file`) in a tier (`open_rows`): "ram" (rows read into
    RAM), "mmap" (mapped; both checked against their block sums once, at open) or "disk" (`DiskTable`: positioned
    reads, each block checked on its first read; `disk_kwargs` such as `queue_depth`, `direct`)."""
    check_tier(tier)
    return open_rows(path, tier, dtype=dtype, name=name or str(path), expect=NVFP4_FILE_FORMAT, verify="open",
                     **disk_kwargs)


__all__ = ["BlockFp8Table", "BlockScaledTable", "NVFP4_BLOCK", "NvFp4Table", "check_global_scale", "dequantize_nvfp4",
           "e2m1_to_float", "e4m3_to_float", "nvfp4_global_scale", "nvfp4_tables", "open_nvfp4_file",
           "pack_nvfp4_rows", "quantize_nvfp4", "write_nvfp4_file", "FORMATS", "TABLE_FORMATS", "check_table_format",
           "QuantTable", "UE8M0_BLOCK", "dequantize", "dequantize_ue8m0", "pack_ue8m0_rows", "quantize_ue8m0",
           "ue8m0_to_float", "open_quant_file", "quant_error", "quantize_rows", "quantize_tables", "set_table_format",
           "write_quant_file"]
