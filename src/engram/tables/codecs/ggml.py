"""ggml row types (llama.cpp's GGUF tensors): F32, F16, BF16, Q8_0 and Q4_0 decoded here (torch ops, no
dependency), every other type the `gguf` package can dequantize (the K-quants Q2_K..Q6_K of DeepSeek-V4.1 GGUFs,
IQ4_XS, the other IQ and TQ types, MXFP4, NVFP4, ...) by `gguf.quants` after the gather. A row of `dim` values is
`dim / block * type_size` contiguous bytes; float rows may also come as their own dtype (N, dim)."""

from __future__ import annotations

import numpy as np
import torch

from ...jit import LazyKernels
from ..base import GgufError
from .base import RowCodec, shape_of

# ggml tensor types: id -> (name, values per block, bytes per block). The tests check every entry against the
# gguf package's GGML_QUANT_SIZES and GGMLQuantizationType.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
              19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
              23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
              28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
              35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36)}
TYPE_IDS = {name: i for i, (name, _, _) in GGML_TYPES.items()}
NATIVE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")  # decoded here; the rest through gguf.quants
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # rows mapped as these dtypes
NP_FLOAT = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _build_q8_kernel():
    import numba

    @numba.njit(nogil=True, cache=True)
    def dequant_q8_0(raw, f16, out):  # out[i, 32b + j] = f16[d bytes of block b] * int8(code j), float32
        n, w = raw.shape
        for i in range(n):
            for b in range(w // 34):
                o = b * 34
                d = f16[raw[i, o] | (np.int64(raw[i, o + 1]) << 8)]
                for j in range(32):
                    c = np.int64(raw[i, o + 2 + j])
                    out[i, b * 32 + j] = d * np.float32(c - 256 if c > 127 else c)

    return dequant_q8_0


_Q8_KERNEL = LazyKernels(_build_q8_kernel)  # optional (engram-torch[fast]): ~5x the torch ops on gathered rows
_F16_LUT = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float().numpy()  # bits -> f32


def decode_rows(raw: torch.Tensor, type_name: str, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows (N, dim) of `dtype` from their bytes `raw` (N, row_bytes) uint8 in ggml type `type_name` (float rows may
    also come as (N, dim) of their own dtype). Q8_0: value = float16 scale * int8 code per 32 values; Q4_0:
    scale * (nibble - 8), low nibbles first; what ggml's `dequantize_row_*` computes in float32."""
    n = raw.shape[0]
    if type_name in FLOAT_TYPES:
        ft = FLOAT_TYPES[type_name]
        x = raw if raw.dtype == ft else raw.contiguous().view(torch.uint8).view(ft).view(n, dim)
        return x.to(dtype)
    raw = raw.contiguous().view(torch.uint8)
    kernel = _Q8_KERNEL.get() if type_name == "Q8_0" and n and dtype == torch.float32 else None
    if kernel is not None:  # one compiled pass, the same float32 products as the torch ops below (tested)
        out = torch.empty(n, dim, dtype=torch.float32)
        kernel(raw.numpy(), _F16_LUT, out.numpy())
        return out
    if type_name == "Q8_0":
        b = raw.view(n, dim // 32, 34)
        d = b[..., :2].contiguous().view(torch.float16).to(torch.float32)  # (N, blocks, 1)
        q = b[..., 2:].contiguous().view(torch.int8).to(torch.float32)  # (N, blocks, 32)
        return (d * q).view(n, dim).to(dtype)
    if type_name == "Q4_0":
        b = raw.view(n, dim // 32, 18)
        d = b[..., :2].contiguous().view(torch.float16).to(torch.float32)
        qs = b[..., 2:].to(torch.int16)  # (N, blocks, 16): element j in the low nibble, j + 16 in the high one
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.float32) - 8
        return (d * q).view(n, dim).to(dtype)
    out = _gguf_quants("dequantize", raw.numpy(), type_name, "upgrade gguf")  # (N, dim) float32
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).view(n, dim).to(dtype)


def _gguf_quants(fn: str, data: np.ndarray, type_name: str, fix: str) -> np.ndarray:
    """`gguf.quants.<fn>(data, type)` (quantize or dequantize) for the types not coded here; one GgufError line
    for an unknown type, a missing gguf package, or a type it cannot do (`fix` says what to do then)."""
    if type_name not in TYPE_IDS:
        raise GgufError(f"unknown ggml row type {type_name!r}")
    try:
        import gguf.quants
    except ImportError:
        raise GgufError(f"rows of ggml type {type_name} are coded by the gguf package: pip install gguf") from None
    try:
        return getattr(gguf.quants, fn)(data, gguf.GGMLQuantizationType[type_name])
    except NotImplementedError:
        raise GgufError(f"the installed gguf package cannot {fn} ggml type {type_name}; {fix}") from None


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (ggml's quantizers), not torch.round's halves to even."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def encode_rows(x: torch.Tensor, type_name: str) -> torch.Tensor:
    """Bytes (N, row_bytes) uint8 of rows `x` (N, dim) in ggml type `type_name`. Q8_0 as ggml's reference
    quantizer: per 32 values d = max|x| / 127 (stored float16), code = roundf(x / d) (0 where d is 0)."""
    n, dim = x.shape
    if type_name in FLOAT_TYPES:
        return x.to(FLOAT_TYPES[type_name]).contiguous().view(torch.uint8).view(n, -1)
    if type_name == "Q8_0":
        if dim % 32:
            raise GgufError(f"Q8_0 rows need a multiple of 32 values, these have {dim}")
        b = x.to(torch.float32).reshape(n, dim // 32, 32)
        d = b.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _round_away(b * inv).to(torch.int8)
        return torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1).view(n, -1)
    out = _gguf_quants("quantize", x.to(torch.float32).contiguous().numpy(), type_name, "write F16, BF16 or Q8_0")
    return torch.from_numpy(np.ascontiguousarray(out)).view(n, -1)


class GgmlCodec(RowCodec):
    """Rows of one ggml type: one part, raw row bytes (N, row_bytes) uint8, or for F32/F16/BF16 the rows as their
    dtype (N, dim); decoded by `decode_rows` into `dtype` (default: the float type's own, else float32)."""

    def __init__(self, type_name: str):
        if type_name not in TYPE_IDS:
            raise GgufError(f"unknown ggml row type {type_name!r}")
        self.type = type_name
        self.name = f"gguf {type_name}"
        self.dtype = FLOAT_TYPES.get(type_name, torch.float32)
        _, self.block, self.type_size = GGML_TYPES[TYPE_IDS[type_name]]

    def layout(self, parts: tuple, name: str) -> int:
        (part,) = parts
        n, w = shape_of(part)
        if self.type in FLOAT_TYPES and part.dtype != torch.uint8:
            return w
        if w % self.type_size:
            raise GgufError(f"{name}: rows of {w} bytes are not whole {self.type} blocks of {self.type_size} bytes")
        return w // self.type_size * self.block

    def encode(self, rows):
        return (encode_rows(rows, self.type),)

    def bytes_per_row(self, dim: int) -> int:
        return dim // self.block * self.type_size

    def decode(self, parts, dim, dtype):
        return decode_rows(parts[0], self.type, dim, dtype)
