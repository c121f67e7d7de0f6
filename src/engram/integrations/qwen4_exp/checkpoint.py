"""Qwen4Exp checkpoints' n-gram tables: the `split_ngram_parts` shards of a layer's table, float rows or NVFP4
(packed E2M1 codes, E4M3 block scales, one global scale), read a shard at a time, never whole in RAM."""

from __future__ import annotations

import torch

from ...config import ConfigError
from ...tables.codecs import Nvfp4Codec, check_global_scale, pack_rows
from ...tables.encoded import NvFp4Table
from ...tables.header import read_header
from ...tables.rows import RowBlocks


def checkpoint_shards(checkpoint, layer_idx: int, suffix: str = "weight") -> list[tuple]:
    """[(file, key, rows)] of decoder layer `layer_idx`'s n-gram table shards in a safetensors checkpoint, in order
    (`suffix` "weight_scale": an NVFP4 table's block-scale shards), from the shards' headers (`read_header`)."""
    import re
    from pathlib import Path

    from ..checkpoint import weight_map

    d = Path(checkpoint)
    files = sorted(set(weight_map(d).values()))
    pat = re.compile(rf"(^|\.)layers\.{layer_idx}\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.{suffix}$")
    found = []
    for f in files:
        for k, info in read_header(d / f, required=()).tensors.items():
            m = pat.search(k)
            if m:
                found.append((int(m.group(2)), d / f, k, info["shape"][0]))
    return [(f, k, n) for _, f, k, n in sorted(found)]


def _entry(file, key: str) -> dict:
    """Tensor `key`'s header entry in safetensors file `file`: {"dtype", "shape", "data_offsets"}."""
    return read_header(file, required=(key,)).tensors[key]


def _checkpoint_rows(checkpoint, layer_idx: int, padded: int, dim: int, parts: int):
    """(dtype, rows(lo, hi)): layer `layer_idx`'s table in a checkpoint, checked to add up to `padded` rows of
    `dim` in `parts` shards; `rows(lo, hi)` yields the row blocks of [lo, hi), one shard in RAM at a time."""
    from safetensors import safe_open

    shards = checkpoint_shards(checkpoint, layer_idx)
    total = sum(n for _, _, n in shards)
    if not shards or len(shards) != parts or total != padded:
        raise ConfigError(f"{checkpoint}: layer {layer_idx}'s n-gram table shards hold {total:,} rows in "
                          f"{len(shards)} shards; the config needs {padded:,} rows in split_ngram_parts={parts} "
                          "(incomplete or mismatched download?)")
    info = _entry(*shards[0][:2])
    dtype, width = info["dtype"], info["shape"][1]
    tdt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(dtype)
    if tdt is None or width != dim:
        raise ConfigError(f"{checkpoint}: n-gram table rows are {dtype} x {width}; "
                          f"the config needs float rows of {dim}")

    def rows(lo: int, hi: int):
        start = 0
        for f, k, n in shards:
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                with safe_open(str(f), "pt") as st:
                    yield st.get_slice(k)[a - start:b - start]
            start += n

    return tdt, rows


def _is_nvfp4(checkpoint, layer_idx: int) -> bool:
    """Whether layer `layer_idx`'s table shards in `checkpoint` are NVFP4 (uint8 rows with E4M3 block-scale shards,
    as vLLM 0.33 loads Qwen4Exp tables with `ple_embedding_dtype: nvfp4` or a ModelOpt NVFP4 config)."""
    shards = checkpoint_shards(checkpoint, layer_idx)
    if not shards:
        return False
    packed = _entry(*shards[0][:2])["dtype"] == "U8"
    return packed or bool(checkpoint_shards(checkpoint, layer_idx, "weight_scale"))


def _nvfp4_rows(checkpoint, layer_idx: int, padded: int, used: int, dim: int, parts: int, dtype):
    """(packed rows, codec, decoded padding rows) of layer `layer_idx`'s NVFP4 table in `checkpoint`:
    `shard_<i>.weight` (rows, d/2) uint8, `shard_<i>.weight_scale` (rows, d/16) F8_E4M3 and one
    `ngram_embedding.weight_scale_2`, checked to fit the config."""
    from pathlib import Path

    from safetensors import safe_open

    parts_of = {sfx: checkpoint_shards(checkpoint, layer_idx, sfx) for sfx in ("weight", "weight_scale")}
    where = f"{checkpoint}: layer {layer_idx}'s NVFP4 n-gram table"
    for sfx, width, dt in (("weight", dim // 2, "U8"), ("weight_scale", dim // 16, "F8_E4M3")):
        shards = parts_of[sfx]
        if dim % 16 or len(shards) != parts or sum(n for *_, n in shards) != padded:
            raise ConfigError(f"{where}: {len(shards)} shard_<i>.{sfx} tensors hold {sum(n for *_, n in shards):,} "
                              f"rows; the config needs {padded:,} rows of {dim} (a multiple of 16) in "
                              f"split_ngram_parts={parts} (incomplete download, or scales missing?)")
        for f, k, _ in shards:
            info = _entry(f, k)
            if info["dtype"] != dt or info["shape"][1:] != [width]:
                what = "two E2M1 codes a byte" if sfx == "weight" else "one E4M3 scale per 16 values"
                raise ConfigError(f"{where}: {k} is {info['dtype']} {info['shape']}; NVFP4 needs {dt} rows of "
                                  f"{width} ({what})")
    key = f"layers.{layer_idx}.ple.ple_embedding.ngram_embedding.weight_scale_2"
    g = None
    for f in sorted({f for f, *_ in parts_of["weight"]} | set(Path(checkpoint).glob("*.safetensors"))):
        k = next((k for k in read_header(f, required=()).tensors if k == key or k.endswith("." + key)), None)
        if k is not None:
            with safe_open(str(f), "pt") as st:
                g = st.get_tensor(k)
            break
    g = check_global_scale(g, f"{where} ({key})")

    def packed(lo: int, hi: int):  # packed rows [lo, hi), one shard's slice at a time
        start = 0
        for (fc, kc, n), (fs, ks, _) in zip(parts_of["weight"], parts_of["weight_scale"]):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                with safe_open(str(fc), "pt") as st:
                    codes = st.get_slice(kc)[a - start:b - start]
                with safe_open(str(fs), "pt") as st:
                    scales = st.get_slice(ks)[a - start:b - start]
                yield pack_rows(codes, scales)
            start += n

    pad = NvFp4Table(packed=torch.cat(list(packed(used, padded))), global_scale=g, dtype=dtype,
                     name=f"layer {layer_idx}") if padded > used else None
    pad_rows = pad.gather(torch.arange(padded - used)) if pad is not None else torch.empty(0, dim, dtype=dtype)
    return RowBlocks((used, dim // 2 + dim // 16), torch.uint8, packed(0, used)), \
        Nvfp4Codec(g, f"layer {layer_idx}"), pad_rows


def table_rows(checkpoint, layer_idx: int, padded: int, used: int, dim: int, parts: int, dtype):
    """(rows, codec, decoded padding rows) of decoder layer `layer_idx`'s n-gram table in `checkpoint`: the first
    `used` rows as `RowBlocks` (float rows, codec None; or packed NVFP4 rows and their `Nvfp4Codec`), for
    `tables.open_rows`, and the `padded - used` rows the heads never address (saved back, never looked up)."""
    if _is_nvfp4(checkpoint, layer_idx):
        return _nvfp4_rows(checkpoint, layer_idx, padded, used, dim, parts, dtype)
    tdt, rows = _checkpoint_rows(checkpoint, layer_idx, padded, dim, parts)
    pad_rows = torch.cat(list(rows(used, padded))) if padded > used else torch.empty(0, dim, dtype=tdt)
    return RowBlocks((used, dim), tdt, rows(0, used)), None, pad_rows
