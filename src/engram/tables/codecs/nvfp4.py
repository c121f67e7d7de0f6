"""NVFP4 rows (Qwen4Exp's PLE tables in vLLM 0.33, ModelOpt's NVFP4): E2M1 codes two a byte, an E4M3 scale per
16 values, one float32 scale per table. d/2 + d/16 bytes a row (90 for d = 160, 0.28 of bfloat16)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from ...jit import LazyKernels
from ..base import TableError
from .scaled import FP8_MAX, BlockScaledCodec

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


def rows_amax(w: torch.Tensor, chunk_rows: int = 1 << 16) -> float:
    """max |value| of rows `w` (N, d) (0.0 for no rows), read a chunk of rows at a time (a mapped table is never
    whole in RAM): what sets a table's NVFP4 global scale."""
    return max((float(w[s:s + chunk_rows].float().abs().amax()) for s in range(0, w.shape[0], chunk_rows)),
               default=0.0)


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
        amax = rows_amax(w, chunk_rows)
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


class Nvfp4Codec(BlockScaledCodec):
    """NVFP4 rows: parts `codes` (N, d/2) packed E2M1 pairs and `scales` (N, d/16) E4M3 block scales (or packed,
    N x (d/2 + d/16)), and the table's `global_scale` (checked: finite and positive); decoded by
    `dequantize_nvfp4`."""

    name, block, values_per_byte = "nvfp4", NVFP4_BLOCK, 2
    amax = None  # the table's max |value|, when the codec was made from its rows (`of_rows`): what `encode` needs

    def __init__(self, global_scale, name: str = "table"):
        self.global_scale, self.table_name = check_global_scale(global_scale, name), name

    @classmethod
    def of_rows(cls, w: torch.Tensor, name: str = "table", chunk_rows: int = 1 << 16) -> "Nvfp4Codec":
        """The codec of a table's rows `w` (N, d) quantized to NVFP4: its global scale set by the whole table's max
        |value| (`nvfp4_global_scale`), which `encode` then quantizes every chunk of the rows with."""
        amax = rows_amax(w, chunk_rows)
        codec = cls(nvfp4_global_scale(amax)[1], name)
        codec.amax = amax
        return codec

    def encode(self, rows):
        if self.amax is None:
            raise TableError(f"{self.table_name}: this NVFP4 codec only decodes (its table's max |value| is not "
                             "known); encode with Nvfp4Codec.of_rows(rows of the whole table)")
        return quantize_nvfp4(rows, amax=self.amax)[:2]

    def decode(self, parts, dim, dtype):
        return dequantize_nvfp4(*parts, self.global_scale, dtype, self.table_name)
