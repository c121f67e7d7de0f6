"""Row codecs with scales: int8 and FP8 (e4m3) with one scale per row, and FP8 with a ue8m0 scale per 32 values.

  * "int8": `q = round(x / s)` in [-127, 127], `s = max|x| / 127` per row (float16; 1 for a zero row).
    Bytes per row: d + 2.
  * "fp8":  `x / 2**e` stored as float8 e4m3 (max 448), `e = ceil(log2(max|x| / 448))` per row (int8
    exponent, as the power-of-two scales vLLM and SGLang use for these tables). Bytes per row: d + 1.
  * "fp8_ue8m0" (DeepSeek-V4.1's rows): e4m3 codes, a power-of-two scale byte per 32 values. d + d/32 bytes.
Block-scaled codecs (`BlockScaledCodec`: this one and NVFP4, `codecs/nvfp4.py`) store byte codes and one scale
byte per block of values, as two parts or packed in one byte row.
"""

from __future__ import annotations

import numpy as np
import torch

from ...jit import LazyKernels
from ..base import TableError
from .base import RowCodec, shape_of

FORMATS = ("int8", "fp8")  # quantized rows with a scale per row (`quantize_rows`)
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


class ScaledRowCodec(RowCodec):
    """int8 or fp8 rows with one scale per row: parts `codes` (N, d) and `scales` (N,) (`quantize_rows`)."""

    parts = ("codes", "scales")

    def __init__(self, fmt: str):
        if fmt not in FORMATS:
            raise TableError(f"table format must be one of {FORMATS}, got {fmt!r}")
        self.name = self.fmt = fmt

    def layout(self, parts: tuple, name: str) -> int:
        shapes = [shape_of(p) for p in parts]
        if len(shapes) != 2 or len(shapes[0]) != 2 or shapes[1] != shapes[0][:1]:
            raise TableError(f"codes (N, d) and scales (N,) expected, got "
                             f"{' and '.join(str(s) for s in shapes)}")
        return shapes[0][1]

    def encode(self, rows):
        return quantize_rows(rows, self.fmt)

    def bytes_per_row(self, dim: int) -> int:
        return dim + (2 if self.fmt == "int8" else 1)

    def decode(self, parts, dim, dtype):
        codes, scales = parts
        kernel = _KERNELS.get() if self.fmt == "fp8" and dtype == torch.float32 else None
        if kernel is not None and codes.shape[0]:
            vals = torch.empty(codes.shape[0], codes.shape[1], dtype=torch.float32)
            kernel(codes.numpy(), scales.numpy(), _FP8_LUT, vals.numpy())
            return vals
        return dequantize(codes, scales, self.fmt, dtype)


class BlockScaledCodec(RowCodec):
    """Byte codes with one scale byte per `block` values: parts `codes` (N, d / values_per_byte) and `scales`
    (N, d / block), or both packed in one byte row (N, code bytes + d / block) (`pack_rows`). Subclasses set
    `name`, `block` and `values_per_byte` and implement `decode`."""

    parts = ("codes", "scales")
    dtype = torch.bfloat16
    block, values_per_byte = 1, 1

    def layout(self, parts: tuple, name: str) -> int:
        if len(parts) == 1:  # packed
            ps = shape_of(parts[0])
            per_block = self.block // self.values_per_byte + 1  # code bytes + 1 scale byte, per block of values
            if len(ps) != 2 or ps[1] % per_block or not ps[1]:
                raise TableError(f"{name}: packed {self.name} rows of {list(ps)} bytes are not whole blocks of "
                                 f"{per_block} bytes ({self.block} values + 1 scale byte each)")
            return ps[1] // per_block * self.block
        cs, ss = (shape_of(p) for p in parts)
        d = cs[1] * self.values_per_byte if len(cs) == 2 else 0
        if len(cs) != 2 or not d or d % self.block or ss != (cs[0], d // self.block):
            raise TableError(f"{name}: {self.name} scales of shape {list(ss)} do not fit codes {list(cs)} (one "
                             f"scale byte per {self.block} values of {self.values_per_byte} per code byte: "
                             f"{[cs[0], d // self.block] if len(cs) == 2 else '(N, d)'} expected)")
        return d

    def widths(self, dim: int) -> tuple[int, int]:
        return dim // self.values_per_byte, dim // self.block

    def bytes_per_row(self, dim: int) -> int:
        return sum(self.widths(dim))


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


def quantize_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, d) uint8, scales (N, d / 32) uint8) of rows `w`: per 32 values the power of two that brings
    max|x| within e4m3's 448 (for writing test checkpoints and converting tables; DeepSeek ships them made)."""
    n, d = w.shape
    x = w.float().view(n, d // UE8M0_BLOCK, UE8M0_BLOCK)
    amax = x.abs().amax(dim=-1)  # (N, d / 32)
    e = torch.ceil(torch.log2(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))).clamp_(-127, 127)
    codes = torch.ldexp(x, -e[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(n, d)
    return codes, (e + 127).to(torch.uint8)


class Ue8m0Codec(BlockScaledCodec):
    """DeepSeek-V4.1's rows: float8 e4m3 codes with one ue8m0 scale byte per 32 values (`dequantize_ue8m0`);
    264 bytes for d = 256."""

    name, block, values_per_byte = "fp8_ue8m0", UE8M0_BLOCK, 1

    def encode(self, rows):
        return quantize_ue8m0(rows)

    def decode(self, parts, dim, dtype):
        return dequantize_ue8m0(*parts, dtype)
