"""Quantized table rows: int8 with a per-row scale, or FP8 (e4m3) with a per-row power-of-two scale.

    codes, scales = quantize_rows(W, "fp8")        # (N, d) uint8 codes, (N,) scales
    table = QuantTable(codes, scales, "fp8")       # a read-only Table: gather -> dequantized (N, d) rows
    quantize_tables(model, "int8")                 # every Engram table of a model, installed behind its layer

Rows are dequantized after the gather, so only the codes and one scale per row travel from
memory (or disk). Layouts:
  * "int8": `q = round(x / s)` in [-127, 127], `s = max|x| / 127` per row (float16; 1 for a zero row).
    Bytes per row: d + 2.
  * "fp8":  `x / 2**e` stored as float8 e4m3 (max 448), `e = ceil(log2(max|x| / 448))` per row (int8
    exponent, as the power-of-two scales vLLM and SGLang use for these tables). Bytes per row: d + 1.
Against bfloat16 rows (2d bytes) both about halve the table; against float32, a quarter.
Inference only: a quantized table is not trainable (train in float32/bf16, quantize after).
"""

from __future__ import annotations

import numpy as np
import torch

from .._numba import LazyKernels
from .base import Table, TableError, find_tables, install

FORMATS = ("int8", "fp8")  # quantized rows with a scale per row (`quantize_rows`)
TABLE_FORMATS = ("float32", "bfloat16", *FORMATS, "fp8_ue8m0")  # what `set_table_format` serves
FP8_MAX = 448.0


def quantize_rows(w: torch.Tensor, fmt: str, chunk_rows: int = 1 << 18) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, d), scales (N,)) of rows `w` (N, d) in format `fmt`, a chunk of rows at a time."""
    if fmt not in FORMATS:
        raise TableError(f"table format must be one of {FORMATS}, got {fmt!r}")
    n, d = w.shape
    codes = torch.empty(n, d, dtype=torch.int8 if fmt == "int8" else torch.uint8)
    scales = torch.empty(n, dtype=torch.float16 if fmt == "int8" else torch.int8)
    for s in range(0, n, chunk_rows):
        x = w[s:s + chunk_rows].float()
        amax = x.abs().amax(dim=1)  # (n,)
        if fmt == "int8":
            sc = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).half()
            codes[s:s + chunk_rows] = torch.round(x / sc.float()[:, None]).clamp_(-127, 127).to(torch.int8)
            scales[s:s + chunk_rows] = sc
        else:
            e = torch.ceil(torch.log2(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))).clamp_(-127, 127)
            codes[s:s + chunk_rows] = torch.ldexp(x, -e[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
            scales[s:s + chunk_rows] = e.to(torch.int8)
    return codes, scales


def _build_kernels():
    import numba

    @numba.njit(nogil=True, cache=True)
    def dequant_fp8(codes, exps, lut, out):  # out[i] = e4m3(codes[i]) * 2**exps[i], over gathered (contiguous) rows
        for i in range(codes.shape[0]):
            s = np.float32(2.0) ** np.float32(exps[i])
            for j in range(codes.shape[1]):
                out[i, j] = lut[codes[i, j]] * s

    return dequant_fp8


_KERNELS = LazyKernels(_build_kernels)  # optional (engram-torch[fast]): torch's float8 -> float32 cast is ~4x slower
_FP8_LUT = torch.nan_to_num(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()).numpy()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str, dtype=torch.float32) -> torch.Tensor:
    """Rows (N, d) from their codes (N, d) and scales (N,)."""
    if fmt == "int8":
        return (codes.to(torch.float32) * scales.to(torch.float32)[:, None]).to(dtype)
    x = codes.view(torch.float8_e4m3fn).to(torch.float32)
    return torch.ldexp(x, scales.to(torch.float32)[:, None]).to(dtype)


class QuantTable(Table):
    """Read-only rows stored quantized (`quantize_rows`), dequantized after each gather into `dtype`."""

    def __init__(self, codes, scales: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32):
        """`codes`: (N, d) tensor, or a `Table` of them (the disk tier: `open_quant_file(backend="disk")`)."""
        if fmt not in FORMATS:
            raise TableError(f"table format must be one of {FORMATS}, got {fmt!r}")
        shape = (codes.num_rows, codes.dim) if isinstance(codes, Table) else tuple(codes.shape)
        if len(shape) != 2 or tuple(scales.shape) != shape[:1]:
            raise TableError(f"codes (N, d) and scales (N,) expected, got {shape} and {tuple(scales.shape)}")
        self.codes, self.scales, self.fmt, self.dtype = codes, scales, fmt, dtype
        self.num_rows, self.dim = shape
        self.trainable = False

    @property
    def bytes_per_row(self) -> int:
        code = torch.empty((), dtype=self.codes.dtype).element_size()
        return self.dim * code + self.scales.element_size()

    blocks = None  # a file-backed table's block checksums (`open_quant_file`)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = rows.reshape(-1).long()
        if isinstance(self.codes, Table):  # the disk tier reads (and checks) the codes; scales are in RAM
            codes = self.codes.gather(rows)
        else:
            if self.blocks is not None:
                self.blocks.check_rows(rows, self._offsets[0], self.dim * self.codes.element_size())
                self.blocks.check_rows(rows, self._offsets[1], self.scales.element_size())
            codes = self.codes.index_select(0, rows)  # (N, d)
        scales = self.scales.index_select(0, rows)  # (N,)
        kernel = _KERNELS.get() if self.fmt == "fp8" and self.dtype == torch.float32 else None
        if kernel is not None and rows.numel():
            vals = torch.empty(rows.numel(), self.dim, dtype=torch.float32)
            kernel(codes.numpy(), scales.numpy(), _FP8_LUT, vals.numpy())
        else:
            vals = dequantize(codes, scales, self.fmt, self.dtype)
        return out.copy_(vals) if out is not None else vals

    def stats(self) -> dict:
        extra = self.codes.stats() if isinstance(self.codes, Table) else {}
        return {**extra, "format": self.fmt, "bytes_per_row": self.bytes_per_row}

    def close(self) -> None:
        if isinstance(self.codes, Table):
            self.codes.close()


def quantize_tables(model, fmt: str, dtype: torch.dtype | None = None) -> dict[int, QuantTable]:
    """Replace every Engram table of `model` by its quantized copy (`fmt` int8 | fp8), installed behind its layer.

    The rows must be in the model (its own parameter, or an installed table's `weight`); the float
    parameter is freed. Returns {layer_id: table}.
    """
    tables = {}
    for _, mhe in find_tables(model):
        src = mhe.table.weight if mhe.table is not None and hasattr(mhe.table, "weight") else mhe.embedding.weight
        if src.shape[0] != mhe.num_rows:
            raise TableError(f"layer {mhe.layer_id}: its rows are not in memory to quantize")
        codes, scales = quantize_rows(src.detach(), fmt)
        table = QuantTable(codes, scales, fmt, dtype or mhe.embedding.weight.dtype)
        install(mhe, table, free_parameter=True)
        tables[mhe.layer_id] = table
    return tables


def check_table_format(fmt: str) -> None:
    """`TableError` in one line unless `set_table_format` serves `fmt` (`TABLE_FORMATS`)."""
    if fmt not in TABLE_FORMATS:
        raise TableError(f"table format must be one of {TABLE_FORMATS}, got {fmt!r}")


def set_table_format(model, fmt: str) -> dict:
    """Serve `model`'s Engram tables as `fmt`: "float32" (as they are), "bfloat16" (cast, in RAM), "int8" or "fp8"
    (`quantize_tables`, dequantized to float32 after each gather), or "fp8_ue8m0" (DeepSeek-V4.1's rows: a scale
    byte per 32 values). Returns {layer_id: bytes per row}."""
    from .backends import InRamTable

    check_table_format(fmt)
    if fmt == "float32":
        return {mhe.layer_id: mhe.dim * 4 for _, mhe in find_tables(model)}
    if fmt == "bfloat16":
        out = {}
        for _, mhe in find_tables(model):
            install(mhe, InRamTable(mhe.embedding.weight.detach().to(torch.bfloat16)), free_parameter=True)
            out[mhe.layer_id] = mhe.dim * 2
        return out
    if fmt == "fp8_ue8m0":  # DeepSeek-V4.1's rows: e4m3 + a power-of-two scale per 32 values, dequantized to bf16
        out = {}
        for _, mhe in find_tables(model):
            if mhe.dim % UE8M0_BLOCK:
                raise TableError(f"fp8_ue8m0 needs rows a multiple of {UE8M0_BLOCK} wide; layer {mhe.layer_id}'s "
                                 f"are {mhe.dim}")
            table = BlockFp8Table(*quantize_ue8m0(mhe.embedding.weight.detach()), torch.float32,
                                  f"layer {mhe.layer_id}")
            install(mhe, table, free_parameter=True)
            out[mhe.layer_id] = table.bytes_per_row
        return out
    return {lid: t.bytes_per_row for lid, t in quantize_tables(model, fmt, torch.float32).items()}


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
    from .files import tensor_entry, write_safetensors

    return write_safetensors(path, [tensor_entry("codes", codes), tensor_entry("scales", scales)],
                             {"format": "engram-quant-table", "quant": fmt}, block_sums=True, page_blocks=page_blocks)


# ------------------------------------------------------------------------------------------ FP8 + ue8m0 block scales
UE8M0_BLOCK = 32  # values per scale byte (DeepSeek-V4.1's Engram rows)


def ue8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """float32 scales of ue8m0 bytes: the byte is the fp32 exponent field (byte 127 = 1.0, 0 = +0.0, 255 = +inf),
    bit for bit what DeepSeek's kernels compute (`(byte << 23)` reinterpreted as float32)."""
    return (scales.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)


def _build_ue8m0_kernel():
    import numba

    @numba.njit(nogil=True, cache=True)
    def dequant_ue8m0(codes, scale_f, lut, out):  # out[i, j] = e4m3(codes[i, j]) * scale_f[i, j // 32], float32
        n, d = codes.shape
        for i in range(n):
            for b in range(d // 32):
                s = scale_f[i, b]
                for j in range(b * 32, b * 32 + 32):
                    out[i, j] = lut[codes[i, j]] * s

    return dequant_ue8m0


_UE8M0_KERNEL = LazyKernels(_build_ue8m0_kernel)  # optional: torch's float8 cast is several times slower
_E4M3_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()  # (NaN codes stay NaN)


def dequantize_ue8m0(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows (N, d) from float8 e4m3 codes (N, d) (as uint8 or float8) and ue8m0 scales (N, d / 32) (as uint8 or
    float8_e8m0fnu): `fp8 * scale` in float32, then `dtype` (bfloat16 as served). On CPU with numba installed the
    products come from one fused loop (bit-identical to the torch ops, tested)."""
    n, d = codes.shape
    if tuple(scales.shape) != (n, d // UE8M0_BLOCK) or d % UE8M0_BLOCK:
        raise TableError(f"ue8m0 scales of shape {tuple(scales.shape)} do not fit codes {tuple(codes.shape)}: one "
                         f"scale per {UE8M0_BLOCK} values, (N, d / {UE8M0_BLOCK}), expected")
    kernel = _UE8M0_KERNEL.get() if codes.device.type == "cpu" and n else None
    if kernel is not None:  # the same float32 products as the torch ops, then torch's cast: bit-identical (tested)
        out = torch.empty(n, d, dtype=torch.float32)
        kernel(codes.view(torch.uint8).contiguous().numpy(), ue8m0_to_float(scales).contiguous().numpy(), _E4M3_LUT,
               out.numpy())
        return out.to(dtype)
    return _dequantize_ue8m0_torch(codes, scales, dtype)


def _dequantize_ue8m0_torch(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, d = codes.shape
    x = codes.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).view(n, d // UE8M0_BLOCK, UE8M0_BLOCK)
    return (x * ue8m0_to_float(scales)[..., None]).view(n, d).to(dtype)


class BlockFp8Table(Table):
    """Read-only rows stored as float8 e4m3 codes with one ue8m0 scale byte per 32 values (DeepSeek-V4.1's
    format), kept as FP8 bytes wherever they live and dequantized after the gather into `dtype`.

    Either `codes` (N, d) and `scales` (N, d / 32), or `packed` (N, d + d / 32): each row's codes followed by
    its scales, so one read fetches a row (264 bytes for d = 256). Each is a uint8 tensor (in RAM, or
    memory-mapped from a checkpoint shard) or a `Table` of them (the disk tier's `DiskTable`)."""

    def __init__(self, codes=None, scales=None, dtype: torch.dtype = torch.bfloat16, name: str = "table",
                 packed=None):
        def shape(src):
            return (src.num_rows, src.dim) if isinstance(src, Table) else tuple(src.shape)

        if packed is not None:
            n, w = shape(packed)
            d = w * UE8M0_BLOCK // (UE8M0_BLOCK + 1)
            if len(shape(packed)) != 2 or d % UE8M0_BLOCK or d + d // UE8M0_BLOCK != w:
                raise TableError(f"{name}: packed rows of width {w} are not d + d/{UE8M0_BLOCK} bytes for a d "
                                 f"divisible by {UE8M0_BLOCK}")
            self.num_rows, self.dim = n, d
        else:
            cs, ss = shape(codes), shape(scales)
            if len(cs) != 2 or cs[1] % UE8M0_BLOCK or ss != (cs[0], cs[1] // UE8M0_BLOCK):
                raise TableError(f"{name}: scales of shape {list(ss)} do not fit rows {list(cs)} (one ue8m0 byte "
                                 f"per {UE8M0_BLOCK} values: {[cs[0], cs[1] // UE8M0_BLOCK]} expected)")
            self.num_rows, self.dim = cs
        self.codes, self.scales, self.packed, self.dtype, self.name = codes, scales, packed, dtype, name
        self.trainable = False

    @property
    def bytes_per_row(self) -> int:
        return self.dim + self.dim // UE8M0_BLOCK  # 1 byte per value + 1 per 32 values (256 -> 264)

    @staticmethod
    def _read(src, rows: torch.Tensor) -> torch.Tensor:
        return src.gather(rows) if isinstance(src, Table) else src.index_select(0, rows)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = rows.reshape(-1).long()
        if self.packed is not None:
            both = self._read(self.packed, rows)  # (N, d + d/32): one read per row
            codes, scales = both[:, :self.dim], both[:, self.dim:]
        else:
            codes, scales = self._read(self.codes, rows), self._read(self.scales, rows)
        vals = dequantize_ue8m0(codes, scales, self.dtype)  # (N, d)
        return out.copy_(vals) if out is not None else vals

    def stats(self) -> dict:
        src = self.packed if self.packed is not None else self.codes
        extra = src.stats() if isinstance(src, Table) else {}
        return {**extra, "format": "fp8_ue8m0", "bytes_per_row": self.bytes_per_row}

    def close(self) -> None:
        for src in (self.codes, self.scales, self.packed):
            if isinstance(src, Table):
                src.close()


def pack_ue8m0_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(N, d + d/32) uint8: each row's e4m3 codes followed by its ue8m0 scales (`BlockFp8Table(packed=...)`)."""
    return torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)], dim=1)


def quantize_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, d) uint8, scales (N, d / 32) uint8) of rows `w`: per 32 values the power of two that brings
    max|x| within e4m3's 448 (for writing test checkpoints and converting tables; DeepSeek ships them made)."""
    n, d = w.shape
    x = w.float().view(n, d // UE8M0_BLOCK, UE8M0_BLOCK)
    amax = x.abs().amax(dim=-1)  # (N, d / 32)
    e = torch.ceil(torch.log2(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))).clamp_(-127, 127)
    codes = torch.ldexp(x, -e[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(n, d)
    return codes, (e + 127).to(torch.uint8)


def open_quant_file(path, dtype: torch.dtype = torch.float32, backend: str = "mmap", **disk_kwargs) -> QuantTable:
    """A `QuantTable` over a quantized table file (`write_quant_file`).

    backend "mmap": codes and scales memory-mapped, blocks checked on first read. "disk": the codes read
    by the cold tier (`DiskTable`, positioned reads, `disk_kwargs` such as `queue_depth`, `direct`), the
    scales (one byte or two per row) loaded into RAM at open and checked there, so a cold row costs one read.
    """
    from pathlib import Path

    from .blocks import BlockVerifier
    from .files import QUANT_NP_DTYPES, map_tensor, read_header

    if backend not in ("mmap", "disk"):
        raise TableError(f"backend must be 'mmap' or 'disk', got {backend!r}")
    path = Path(path)
    n, meta, size = read_header(path, required=("codes", "scales"))
    fmt = meta.get("__metadata__", {}).get("quant")
    if fmt not in FORMATS:
        raise TableError(f"{path}: not a quantized table file (no quant format in its header); re-create it")
    infos = {k: meta[k] for k in ("codes", "scales")}
    scales = map_tensor(path, n, size, "scales", infos["scales"], dtypes=QUANT_NP_DTYPES)[1]
    if backend == "disk":
        from .disk import DiskTable

        codes = DiskTable(path, tensor="codes", **disk_kwargs)  # (opens the block sums: they serve both tensors)
        a, b = infos["scales"]["data_offsets"]
        if codes.blocks is not None and b > a:
            try:
                codes.blocks.check_bytes(a, b - a)  # every block of the scales, once, now
            except TableError:
                codes.close()
                raise
        table = QuantTable(codes, scales.clone(), fmt, dtype)
        table.path = path
        return table
    codes = map_tensor(path, n, size, "codes", infos["codes"], dtypes=QUANT_NP_DTYPES)[1]
    table = QuantTable(codes, scales, fmt, dtype)
    table.path, table.blocks = path, BlockVerifier.open(path)
    table._offsets = (infos["codes"]["data_offsets"][0], infos["scales"]["data_offsets"][0])
    return table


__all__ = ["BlockFp8Table", "FORMATS", "TABLE_FORMATS", "check_table_format", "QuantTable", "UE8M0_BLOCK", "dequantize",
           "dequantize_ue8m0", "pack_ue8m0_rows", "quantize_ue8m0", "ue8m0_to_float", "open_quant_file",
           "quant_error", "quantize_rows", "quantize_tables", "set_table_format", "write_quant_file"]
