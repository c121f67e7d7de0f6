"""Pure row codecs: how table rows are stored as bytes and decoded after a gather, with no file or tier logic.

  * `base.py`: the interface, and float rows stored as themselves (`FloatCodec`);
  * `scaled.py`: int8 / FP8 (e4m3) with one scale per row (`ScaledRowCodec`), FP8 with a ue8m0 scale byte per
    32 values (`Ue8m0Codec`, DeepSeek-V4.1's rows), and their block-scaled base;
  * `nvfp4.py`: NVFP4 (`Nvfp4Codec`, Qwen4Exp's rows in vLLM 0.33);
  * `ggml.py`: the ggml types of GGUF files (`GgmlCodec`: F32/F16/BF16 float rows, Q8_0, Q4_0, and every type the
    gguf package decodes).
Each codec has its encoder (`quantize_rows`, `quantize_ue8m0`, `quantize_nvfp4`, `encode_rows`: `codec.encode(rows)`)
and decoder (`codec.decode`); the table that gathers stored bytes from any tier and decodes them is
`tables.encoded.EncodedTable`.
"""

from .base import FloatCodec, RowCodec, pack_rows, shape_of
from .ggml import FLOAT_TYPES, GGML_TYPES, NATIVE_TYPES, TYPE_IDS, GgmlCodec, decode_rows, encode_rows
from .nvfp4 import (
    NVFP4_BLOCK,
    Nvfp4Codec,
    check_global_scale,
    dequantize_nvfp4,
    e2m1_to_float,
    e4m3_to_float,
    nvfp4_global_scale,
    quantize_nvfp4,
)
from .scaled import (
    FORMATS,
    UE8M0_BLOCK,
    BlockScaledCodec,
    ScaledRowCodec,
    Ue8m0Codec,
    dequantize,
    dequantize_ue8m0,
    quantize_rows,
    quantize_ue8m0,
    ue8m0_to_float,
)

__all__ = ["FLOAT_TYPES", "FORMATS", "GGML_TYPES", "NATIVE_TYPES", "NVFP4_BLOCK", "TYPE_IDS", "UE8M0_BLOCK",
           "BlockScaledCodec", "FloatCodec", "GgmlCodec", "Nvfp4Codec", "RowCodec", "ScaledRowCodec", "Ue8m0Codec",
           "check_global_scale", "decode_rows", "dequantize", "dequantize_nvfp4", "dequantize_ue8m0", "e2m1_to_float",
           "e4m3_to_float", "encode_rows", "nvfp4_global_scale", "pack_rows", "quantize_nvfp4", "quantize_rows",
           "quantize_ue8m0", "shape_of", "ue8m0_to_float"]
