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
Block-scaled rows (`BlockScaledTable`), as released models store them:
  * "fp8_ue8m0" (DeepSeek-V4.1): e4m3 codes, a power-of-two scale byte per 32 values. d + d/32 bytes.
  * "nvfp4" (Qwen4Exp in vLLM 0.33): E2M1 codes two a byte, an E4M3 scale per 16 values, one float32
    scale per table. d/2 + d/16 bytes (90 for d = 160, 0.28 of bfloat16).
Inference only: a quantized table is not trainable (train in float32/bf16, quantize after).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .._numba import LazyKernels
from .base import Table, TableError, find_tables, install

FORMATS = ("int8", "fp8")  # quantized rows with a scale per row (`quantize_rows`)
TABLE_FORMATS = ("float32", "bfloat16", *FORMATS, "fp8_ue8m0", "nvfp4")  # what `set_table_format` serves
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
        codes, scales = quantize_rows(stored_rows(mhe), fmt)
        table = QuantTable(codes, scales, fmt, dtype or mhe.embedding.weight.dtype)
        install(mhe, table, free_parameter=True)
        tables[mhe.layer_id] = table
    return tables


def stored_rows(mhe) -> torch.Tensor:
    """All rows of one Engram table as they are stored now (N, d): an installed table's `weight` (a mapped file for
    the mmap and disk tiers: pages read as touched) or the layer's own parameter. What a format conversion reads:
    offloading empties the parameter, so reading `mhe.embedding.weight` there finds no rows."""
    src = mhe.table.weight if mhe.table is not None and hasattr(mhe.table, "weight") else mhe.embedding.weight
    if src.shape[0] != mhe.num_rows:
        raise TableError(f"layer {mhe.layer_id}: its {mhe.num_rows} rows are not readable here (the table holds "
                         f"{list(src.shape)}); convert the tables before moving them, or load them again")
    return src.detach()


def check_table_format(fmt: str) -> None:
    """`TableError` in one line unless `set_table_format` serves `fmt` (`TABLE_FORMATS`)."""
    if fmt not in TABLE_FORMATS:
        raise TableError(f"table format must be one of {TABLE_FORMATS}, got {fmt!r}")


def set_table_format(model, fmt: str) -> dict:
    """Serve `model`'s Engram tables as `fmt`: "float32" (as they are), "bfloat16" (cast, in RAM), "int8" or "fp8"
    (`quantize_tables`, dequantized to float32 after each gather), "fp8_ue8m0" (DeepSeek-V4.1's rows: a scale
    byte per 32 values) or "nvfp4" (Qwen4Exp's NVFP4 rows in vLLM: 4-bit codes, an E4M3 scale per 16 values and
    one per table, kept in the tables' tier: `nvfp4_tables`). Returns {layer_id: bytes per row}."""
    from .backends import InRamTable

    check_table_format(fmt)
    if fmt == "float32":
        return {mhe.layer_id: mhe.dim * 4 for _, mhe in find_tables(model)}
    if fmt == "bfloat16":
        out = {}
        for _, mhe in find_tables(model):
            install(mhe, InRamTable(stored_rows(mhe).to(torch.bfloat16)), free_parameter=True)
            out[mhe.layer_id] = mhe.dim * 2
        return out
    if fmt == "fp8_ue8m0":  # DeepSeek-V4.1's rows: e4m3 + a power-of-two scale per 32 values, dequantized to bf16
        out = {}
        for _, mhe in find_tables(model):
            if mhe.dim % UE8M0_BLOCK:
                raise TableError(f"fp8_ue8m0 needs rows a multiple of {UE8M0_BLOCK} wide; layer {mhe.layer_id}'s "
                                 f"are {mhe.dim}")
            table = BlockFp8Table(*quantize_ue8m0(stored_rows(mhe)), torch.float32,
                                  f"layer {mhe.layer_id}")
            install(mhe, table, free_parameter=True)
            out[mhe.layer_id] = table.bytes_per_row
        return out
    if fmt == "nvfp4":
        return {lid: t.bytes_per_row for lid, t in nvfp4_tables(model).items()}
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


class BlockScaledTable(Table):
    """Read-only rows stored as byte codes with one scale byte per `block` values, kept in their stored bytes
    wherever they live and decoded after the gather into `dtype` (`_decode`, per subclass).

    Either `codes` (N, code bytes) and `scales` (N, d / block), or `packed` (N, code bytes + d / block): each
    row's codes followed by its scales, so one read fetches a row. Each is a uint8 tensor (in RAM, or
    memory-mapped from a file) or a `Table` of them (the disk tier's `DiskTable`). Subclasses set `fmt`,
    `block` and `values_per_byte` (values per code byte) and implement `_decode(codes, scales) -> (N, d)`.
    """

    fmt, block, values_per_byte = "", 1, 1

    def __init__(self, codes=None, scales=None, dtype: torch.dtype = torch.bfloat16, name: str = "table",
                 packed=None):
        def shape(src):
            return (src.num_rows, src.dim) if isinstance(src, Table) else tuple(src.shape)

        per_block = self.block // self.values_per_byte + 1  # code bytes + 1 scale byte, per block of values
        if packed is not None:
            ps = shape(packed)
            if len(ps) != 2 or ps[1] % per_block or not ps[1]:
                raise TableError(f"{name}: packed {self.fmt} rows of {list(ps)} bytes are not whole blocks of "
                                 f"{per_block} bytes ({self.block} values + 1 scale byte each)")
            self.num_rows, self.dim = ps[0], ps[1] // per_block * self.block
        else:
            if codes is None or scales is None:
                raise TableError(f"{name}: {self.fmt} rows need both codes and scales (or packed rows); the "
                                 f"{'scales' if codes is not None else 'codes'} are missing")
            cs, ss = shape(codes), shape(scales)
            d = cs[1] * self.values_per_byte if len(cs) == 2 else 0
            if len(cs) != 2 or not d or d % self.block or ss != (cs[0], d // self.block):
                raise TableError(f"{name}: {self.fmt} scales of shape {list(ss)} do not fit codes {list(cs)} (one "
                                 f"scale byte per {self.block} values of {self.values_per_byte} per code byte: "
                                 f"{[cs[0], d // self.block] if len(cs) == 2 else '(N, d)'} expected)")
            self.num_rows, self.dim = cs[0], d
        self.codes, self.scales, self.packed, self.dtype, self.name = codes, scales, packed, dtype, name
        self.trainable = False

    @property
    def code_bytes(self) -> int:
        return self.dim // self.values_per_byte

    @property
    def bytes_per_row(self) -> int:
        return self.code_bytes + self.dim // self.block

    @staticmethod
    def _read(src, rows: torch.Tensor) -> torch.Tensor:
        return src.gather(rows) if isinstance(src, Table) else src.index_select(0, rows)

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = rows.reshape(-1).long()
        if self.packed is not None:
            both = self._read(self.packed, rows)  # (N, code bytes + d/block): one read per row
            codes, scales = both[:, :self.code_bytes], both[:, self.code_bytes:]
        else:
            codes, scales = self._read(self.codes, rows), self._read(self.scales, rows)
        vals = self._decode(codes, scales)  # (N, d)
        return out.copy_(vals) if out is not None else vals

    def stats(self) -> dict:
        src = self.packed if self.packed is not None else self.codes
        extra = src.stats() if isinstance(src, Table) else {}
        return {**extra, "format": self.fmt, "bytes_per_row": self.bytes_per_row}

    def close(self) -> None:
        for src in (self.codes, self.scales, self.packed):
            if isinstance(src, Table):
                src.close()


class BlockFp8Table(BlockScaledTable):
    """Read-only rows stored as float8 e4m3 codes with one ue8m0 scale byte per 32 values (DeepSeek-V4.1's
    format): `codes` (N, d) and `scales` (N, d / 32), or `packed` (N, d + d / 32), 264 bytes for d = 256
    (`BlockScaledTable`); dequantized after the gather into `dtype` (`dequantize_ue8m0`)."""

    fmt, block, values_per_byte = "fp8_ue8m0", UE8M0_BLOCK, 1

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return dequantize_ue8m0(codes, scales, self.dtype)


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


# ------------------------------------------------------------------------------------------ NVFP4 (Qwen4Exp's rows)
NVFP4_BLOCK = 16  # values per FP8 E4M3 block scale (vLLM 0.33's Qwen4Exp NVFP4 PLE tables, ModelOpt's NVFP4)
E2M1_MAX = 6.0
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 of a code is the sign


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of FP4 E2M1 codes (0-15: bit 3 the sign, bits 0-2 the magnitude; 8 is -0.0)."""
    c = codes.to(torch.int64)
    mag = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32)[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def e4m3_to_float(scales: torch.Tensor) -> torch.Tensor:
    """float32 values of FP8 E4M3 (fn) bytes: the sign honoured, 0x7F and 0xFF NaN, subnormals below 2**-6."""
    return scales.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def check_global_scale(global_scale, name: str = "table") -> float:
    """The per-tensor global scale (`weight_scale_2`) as a float32-exact Python float; `TableError` in one line
    if it is missing, not one value, or not finite and positive (a damaged checkpoint: decoding would give
    NaN/inf/sign-flipped rows)."""
    if global_scale is None:
        raise TableError(f"{name}: the NVFP4 global scale (weight_scale_2) is missing; NVFP4 rows need their "
                         "per-tensor scale as well as their block scales")
    g = torch.as_tensor(global_scale).detach().to("cpu", torch.float32)
    if g.numel() != 1:
        raise TableError(f"{name}: the NVFP4 global scale must be one value, got shape {list(g.shape)}")
    v = float(g.reshape(()))
    if not (v > 0 and v != float("inf")):
        raise TableError(f"{name}: the NVFP4 global scale is {v}; a finite positive value is expected "
                         "(a damaged checkpoint?)")
    return v


@functools.lru_cache(maxsize=8)
def _nvfp4_lut(global_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """(65,536, 2) `dtype`: row `scale_byte * 256 + packed_byte` holds the values of its low and high nibble,
    each `(e2m1 * e4m3) * global_scale` in float32 (the first product exact, the second rounded once to
    nearest-even), then cast to `dtype` (round to nearest-even): vLLM 0.33's Triton lookup, bit for bit."""
    prod = (e4m3_to_float(torch.arange(256, dtype=torch.uint8))[:, None] * e2m1_to_float(torch.arange(16))[None, :]
            * torch.tensor(global_scale, dtype=torch.float32))  # (256 scale bytes, 16 codes)
    b = torch.arange(256)
    return torch.stack([prod[:, b & 15], prod[:, b >> 4]], dim=-1).to(dtype).reshape(65536, 2)


def _build_nvfp4_kernel():
    import numba

    @numba.njit(nogil=True, cache=True)
    def decode_nvfp4(packed, scales, lut, out):  # out[i, j] = lut[scales[i, j // 8] * 256 + packed[i, j]]: a pair
        n, w = packed.shape
        for i in range(n):
            for b in range(w // 8):
                base = np.int64(scales[i, b]) * 256
                for j in range(b * 8, b * 8 + 8):
                    out[i, j] = lut[base + packed[i, j]]

    return decode_nvfp4


_NVFP4_KERNEL = LazyKernels(_build_nvfp4_kernel)  # optional: copies the same LUT entries as the torch path
_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # (numba copies a value pair's bits as one integer)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale, dtype: torch.dtype = torch.bfloat16,
                     name: str = "table") -> torch.Tensor:
    """Rows (N, d) of NVFP4 `packed` (N, d / 2) uint8 (two E2M1 codes a byte: the low nibble is the even value,
    the high nibble the odd one), `scales` (N, d / 16) FP8 E4M3 block scales (uint8 or float8_e4m3fn) and the
    per-tensor `global_scale`: value = e2m1 * e4m3 * global_scale, exactly as vLLM 0.33's Triton lookup of
    Qwen4Exp NVFP4 tables computes it (float32, then `dtype`), read from one 65,536-entry table (`_nvfp4_lut`)."""
    n, w = packed.shape if packed.dim() == 2 else (0, -1)
    if packed.dim() != 2 or tuple(scales.shape) != (n, 2 * w // NVFP4_BLOCK) or (2 * w) % NVFP4_BLOCK:
        raise TableError(f"{name}: NVFP4 scales of shape {list(scales.shape)} do not fit packed codes "
                         f"{list(packed.shape)}: (N, d/2) code bytes and (N, d/16) scale bytes, d a multiple of 16")
    lut = _nvfp4_lut(check_global_scale(global_scale, name), dtype)
    p, s = packed.view(torch.uint8), scales.view(torch.uint8)
    kernel = _NVFP4_KERNEL.get() if n else None
    if kernel is not None:  # each packed byte's two values copied as one integer of their bits
        it = _INT_OF[2 * lut.element_size()]
        out = torch.empty(n, 2 * w, dtype=dtype)
        kernel(p.contiguous().numpy(), s.contiguous().numpy(), lut.view(it).view(-1).numpy(),
               out.view(it).numpy())
        return out
    idx = s.to(torch.int64).repeat_interleave(NVFP4_BLOCK // 2, dim=1) * 256 + p.to(torch.int64)  # (N, d/2)
    return lut.index_select(0, idx.reshape(-1)).view(n, 2 * w)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes of float32 `x` (already within +-6): magnitudes rounded to nearest, ties to the even
    code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), the sign bit kept (so a
    small negative value becomes -0, as the hardware conversion gives)."""
    a = x.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
           + (a > 5.0))
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def nvfp4_global_scale(amax) -> tuple[torch.Tensor, float]:
    """(encode scale (float32), decode scale `weight_scale_2`) of a tensor whose max |value| is `amax`:
    `6 * 448 / amax` and its float32 reciprocal, as vLLM's NVFP4 quantizer sets them (amax floored at 1e-8)."""
    a = torch.as_tensor(amax, dtype=torch.float32).clamp_min(1e-8)
    enc = (E2M1_MAX * FP8_MAX) / a
    return enc, float((1.0 / enc).to(torch.float32))


def quantize_nvfp4(w: torch.Tensor, chunk_rows: int = 1 << 16, amax=None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(packed (N, d/2) uint8, scales (N, d/16) uint8 E4M3 bytes, global scale) of rows `w` (N, d), d a multiple
    of 16, by the arithmetic of vLLM's reference quantizer (`ref_nvfp4_quant`): per 16 values the block scale
    `e4m3(enc * max|x| / 6)` (round to nearest-even, within 448), each value `x / (scale / enc)` clamped to
    +-6 and rounded to the nearest E2M1 value, ties to even (`_e2m1_codes`). `amax`: the whole table's max
    |value| when `w` is one part of it (default: `w`'s own)."""
    n, d = w.shape
    if d % NVFP4_BLOCK:
        raise TableError(f"NVFP4 needs rows a multiple of {NVFP4_BLOCK} wide; these are {d}")
    if amax is None:
        amax = max((float(w[s:s + chunk_rows].float().abs().amax()) for s in range(0, n, chunk_rows)), default=0.0)
    if amax != amax or amax == float("inf"):
        raise TableError(f"rows to quantize to NVFP4 hold a non-finite value (max |x| = {amax})")
    enc, g = nvfp4_global_scale(amax)
    packed = torch.empty(n, d // 2, dtype=torch.uint8)
    scales = torch.empty(n, d // NVFP4_BLOCK, dtype=torch.uint8)
    inv_enc = 1.0 / (enc + (enc == 0) * 1e8)
    for s in range(0, n, chunk_rows):
        x = w[s:s + chunk_rows].float().view(-1, d // NVFP4_BLOCK, NVFP4_BLOCK)  # (n, blocks, 16)
        sc = (enc * (x.abs().amax(dim=-1, keepdim=True) * (1 / E2M1_MAX))).clamp(-FP8_MAX, FP8_MAX)
        sc8 = sc.to(torch.float8_e4m3fn)  # (n, blocks, 1)
        sf = sc8.to(torch.float32) * inv_enc
        codes = _e2m1_codes((x * (1.0 / (sf + (sf == 0) * 1e8))).clamp(-E2M1_MAX, E2M1_MAX)).view(x.shape[0], d)
        packed[s:s + chunk_rows] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales[s:s + chunk_rows] = sc8.view(torch.uint8).view(x.shape[0], -1)
    return packed, scales, g


class NvFp4Table(BlockScaledTable):
    """Read-only NVFP4 rows (Qwen4Exp's packed PLE tables in vLLM 0.33, and `--table-format nvfp4`): `codes`
    (N, d/2) packed E2M1 pairs and `scales` (N, d/16) E4M3 block scales, or `packed` (N, d/2 + d/16), 90 bytes
    for d = 160 (`BlockScaledTable`), plus one per-tensor `global_scale`; decoded after the gather into `dtype`
    (`dequantize_nvfp4`)."""

    fmt, block, values_per_byte = "nvfp4", NVFP4_BLOCK, 2

    def __init__(self, codes=None, scales=None, global_scale=None, dtype: torch.dtype = torch.bfloat16,
                 name: str = "table", packed=None):
        super().__init__(codes, scales, dtype, name, packed)
        self.global_scale = check_global_scale(global_scale, name)

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return dequantize_nvfp4(codes, scales, self.global_scale, self.dtype, self.name)


def pack_nvfp4_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(N, d/2 + d/16) uint8: each row's packed E2M1 codes followed by its E4M3 scales (`NvFp4Table(packed=...)`)."""
    return torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)], dim=1)


NVFP4_FILE_FORMAT = "engram-nvfp4-rows/1"


def write_nvfp4_file(path, chunks, num_rows: int, dim: int, global_scale, page_blocks: bool = False,
                     metadata: dict | None = None):
    """An NVFP4 table file: safetensors with `rows` (N, d/2 + d/16) uint8 (`pack_nvfp4_rows`, streamed from
    `chunks`) and `global_scale` (1,) float32, with block checksums (`page_blocks=True` for the disk tier)."""
    from .files import write_safetensors

    if dim % NVFP4_BLOCK:
        raise TableError(f"NVFP4 needs rows a multiple of {NVFP4_BLOCK} wide; these are {dim}")
    g = torch.tensor([check_global_scale(global_scale, str(path))], dtype=torch.float32)
    width = dim // 2 + dim // NVFP4_BLOCK
    return write_safetensors(path, [("rows", torch.uint8, (num_rows, width), chunks),
                                    ("global_scale", torch.float32, (1,), iter([g]))],
                             {**(metadata or {}), "format": NVFP4_FILE_FORMAT}, block_sums=True,
                             page_blocks=page_blocks)


def open_nvfp4_file(path, backend: str = "mmap", dtype: torch.dtype = torch.bfloat16, name: str | None = None,
                    **disk_kwargs) -> NvFp4Table:
    """An `NvFp4Table` over an NVFP4 table file (`write_nvfp4_file`) in a tier: "ram" (rows read into RAM),
    "mmap" (mapped; both checked against their block sums once, at open) or "disk" (`DiskTable`: positioned
    reads, each block checked on its first read; `disk_kwargs` such as `queue_depth`, `direct`)."""
    from pathlib import Path

    from .blocks import BlockVerifier
    from .files import NP_DTYPES, QUANT_NP_DTYPES, map_tensor, read_header

    if backend not in ("ram", "mmap", "disk"):
        raise TableError(f"backend must be 'ram', 'mmap' or 'disk', got {backend!r}")
    path = Path(path)
    name = name or str(path)
    n, meta, size = read_header(path, required=("rows", "global_scale"))
    if meta.get("__metadata__", {}).get("format") != NVFP4_FILE_FORMAT:
        raise TableError(f"{path}: not an NVFP4 table file (format {meta.get('__metadata__', {}).get('format')!r}, "
                         f"expected {NVFP4_FILE_FORMAT!r}); write it with write_nvfp4_file")
    blocks = BlockVerifier.open(path)
    if blocks is not None:
        a, b = meta["global_scale"]["data_offsets"]
        blocks.check_bytes(a, b - a)
    g = map_tensor(path, n, size, "global_scale", meta["global_scale"], dtypes=NP_DTYPES)[1].clone()
    if backend == "disk":
        from .disk import DiskTable

        rows = DiskTable(path, tensor="rows", **disk_kwargs)
        try:
            return NvFp4Table(global_scale=g, dtype=dtype, name=name, packed=rows)
        except TableError:
            rows.close()
            raise
    if blocks is not None:
        blocks.verify_all()  # mapped gathers are not checked per row: the whole file once, now
    rows = map_tensor(path, n, size, "rows", meta["rows"], dtypes=QUANT_NP_DTYPES)[1]
    return NvFp4Table(global_scale=g, dtype=dtype, name=name, packed=rows.clone() if backend == "ram" else rows)


def nvfp4_tables(model, dtype: torch.dtype = torch.float32, chunk_rows: int = 1 << 16) -> dict[int, NvFp4Table]:
    """Replace every Engram table of `model` by its NVFP4 copy (`quantize_nvfp4`, one global scale per table),
    installed behind its layer and kept in its tier: rows in RAM stay in RAM; a file-backed table (mmap or
    disk tier) gets an NVFP4 file beside its file (`<name>.nvfp4.safetensors`) opened in the same tier.
    Returns {layer_id: table}."""
    from .backends import MmapTable
    from .disk import DiskTable

    tables = {}
    for _, mhe in find_tables(model):
        t, src = mhe.table, stored_rows(mhe)
        if mhe.dim % NVFP4_BLOCK:
            raise TableError(f"nvfp4 needs rows a multiple of {NVFP4_BLOCK} wide; layer {mhe.layer_id}'s are "
                             f"{mhe.dim}")
        n, name = src.shape[0], f"layer {mhe.layer_id}"
        amax = max((float(src[s:s + chunk_rows].float().abs().amax()) for s in range(0, n, chunk_rows)), default=0.)
        tier = "disk" if isinstance(t, DiskTable) else "mmap" if isinstance(t, MmapTable) else "ram"
        if tier == "ram":
            packed, scales, g = quantize_nvfp4(src, chunk_rows, amax)
            table = NvFp4Table(packed, scales, g, dtype, name)
        else:
            from pathlib import Path

            def chunks():
                for s in range(0, n, chunk_rows):
                    yield pack_nvfp4_rows(*quantize_nvfp4(src[s:s + chunk_rows], chunk_rows, amax)[:2])

            f = Path(t.path)
            f = write_nvfp4_file(f.with_name(f.name.split(".")[0] + ".nvfp4.safetensors"), chunks(), n, mhe.dim,
                                 nvfp4_global_scale(amax)[1], page_blocks=tier == "disk",
                                 metadata={"layer": str(mhe.layer_id)})
            table = open_nvfp4_file(f, tier, dtype, name)
        if t is not None:
            t.close()
        install(mhe, table, free_parameter=True)
        tables[mhe.layer_id] = table
    return tables


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


__all__ = ["BlockFp8Table", "BlockScaledTable", "NVFP4_BLOCK", "NvFp4Table", "check_global_scale", "dequantize_nvfp4",
           "e2m1_to_float", "e4m3_to_float", "nvfp4_global_scale", "nvfp4_tables", "open_nvfp4_file",
           "pack_nvfp4_rows", "quantize_nvfp4", "write_nvfp4_file", "FORMATS", "TABLE_FORMATS", "check_table_format",
           "QuantTable", "UE8M0_BLOCK", "dequantize", "dequantize_ue8m0", "pack_ue8m0_rows", "quantize_ue8m0",
           "ue8m0_to_float", "open_quant_file", "quant_error", "quantize_rows", "quantize_tables", "set_table_format",
           "write_quant_file"]
