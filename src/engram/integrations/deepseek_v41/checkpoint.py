"""DeepSeek-V4.1's Engram layers from a checkpoint folder (`load`), without its backbone: the rows opened in any
tier by `tables.open_rows`, in place or from a checked copy."""

from __future__ import annotations

from pathlib import Path

import torch

from ...config import ConfigError
from ...deprecation import renamed_keywords
from ...persist import read_json
from ...tables.codecs import UE8M0_BLOCK, Ue8m0Codec
from ...tables.rows import check_tier, open_rows
from ..checkpoint import CheckpointTensor, weight_map
from .family import V41Config, hash_mapping
from .module import V41Engram, dequantize_linear

NEEDS = "a DeepSeek-V4.1 Engram layer needs embed.weight, embed.scale, wkv.weight, q_weight and k_weight"


class V41Memory:
    """What `load` returns: `.config` (V41Config), `.mapping` (the `NgramHashMapping` of `hash_mapping`),
    `.layers[layer_id]` (V41Engram, each with its `.table`), `.tier` (the rows' tier; `.backend`: its old name).
    `close()` releases files and read threads."""

    def __init__(self, config, mapping, layers, tier):
        self.config, self.mapping, self.layers, self.tier = config, mapping, layers, tier

    backend = property(lambda self: self.tier, doc="The old name of `tier`.")

    def __call__(self, layer_id: int, hidden, hash_ids, mask=None):
        return self.layers[layer_id](hidden, hash_ids, mask)

    def table_bytes(self) -> int:
        return sum(m.table.num_rows * m.table.bytes_per_row for m in self.layers.values())

    def close(self) -> None:
        for m in self.layers.values():
            m.table.close()


@renamed_keywords(backend="tier")
def load(path, tier: str = "ram", dir=None, dtype: torch.dtype = torch.bfloat16, tokenizer=None,
         **disk_kwargs) -> V41Memory:
    """DeepSeek-V4.1's Engram layers from a checkpoint folder, without its backbone.

    The rows are opened by `tables.open_rows`: tier "ram": rows copied into RAM as FP8 bytes (264 bytes per
    256-wide row); "mmap": rows and scales memory-mapped in place from the shards; "disk": read in place by the
    cold tier (`DiskTable`: positioned reads, many in flight; `disk_kwargs` such as `queue_depth`), the scales in
    RAM. Rows are never assembled in RAM for mmap/disk and stay FP8 on disk; a gather dequantizes them to
    `dtype`. `dir` (mmap/disk): first copy each layer's rows and scales, packed (one read a row), into
    `dir/engram_v41_L{layer}.safetensors` with block checksums (4 KiB for disk), streamed a block at a time, and
    read that (every block checked on its first read; the released shards carry no sums: one warning a layer).
    Everything is checked before any table opens: keys, shapes, dtypes, shard sizes, the tokenizer.
    """
    check_tier(tier)
    d = Path(path)
    if not d.is_dir():
        raise ConfigError(f"{d}: no such checkpoint folder")
    cfg = V41Config.from_dict(read_json(d / "config.json", "config.json", "pass a DeepSeek-V4.1 checkpoint folder",
                                        ConfigError), str(d / "config.json"))
    tok = tokenizer if tokenizer is not None else d / "tokenizer.json"
    mapping = hash_mapping(cfg, tok)
    wm = weight_map(d)
    plan = {}
    for lid, rows in zip(cfg.layer_ids, cfg.num_embeddings):
        pre = f"layers.{lid}.engram."
        t = {k: CheckpointTensor(d, pre + k, wm, NEEDS)
             for k in ("embed.weight", "embed.scale", "wkv.weight", "q_weight", "k_weight")}
        if pre + "wkv.scale" in wm:
            t["wkv.scale"] = CheckpointTensor(d, pre + "wkv.scale", wm, NEEDS)
        want = {"embed.weight": ((rows, cfg.head_dim), ("F8_E4M3",)),
                "embed.scale": ((rows, cfg.head_dim // UE8M0_BLOCK), ("F8_E8M0", "U8")),
                "wkv.weight": ((cfg.hidden_size * (cfg.hc_mult + 1), cfg.n_hash_cols * cfg.head_dim),
                               ("BF16", "F32", "F8_E4M3")),
                "q_weight": ((cfg.hc_mult, cfg.hidden_size), ("BF16", "F32")),
                "k_weight": ((cfg.hc_mult, cfg.hidden_size), ("BF16", "F32"))}
        for k, (shape, dtypes) in want.items():
            if t[k].shape != shape or t[k].info["dtype"] not in dtypes:
                raise ConfigError(f"{t[k].path}: {t[k].key} is {t[k].info['dtype']} {list(t[k].shape)}, "
                                  f"a DeepSeek-V4.1 Engram layer needs {'/'.join(dtypes)} {list(shape)} "
                                  f"(config: {rows:,} rows, head_dim {cfg.head_dim})")
        plan[lid] = t
    layers, opened = {}, []
    try:
        for lid, t in plan.items():
            table = open_rows((t["embed.weight"], t["embed.scale"]), tier, dir, codec=Ue8m0Codec(), dtype=dtype,
                              name=f"layer {lid}", file=f"engram_v41_L{lid}.safetensors",
                              metadata={"source": str(d)}, **disk_kwargs)
            opened.append(table)
            m = V41Engram(lid, cfg, table, dtype=dtype)
            with torch.no_grad():
                m.wkv.weight.copy_(dequantize_linear(t["wkv.weight"].load(), t["wkv.scale"].load()
                                                     if "wkv.scale" in t else None, dtype))
                m.q_weight.copy_(t["q_weight"].load().to(dtype))
                m.k_weight.copy_(t["k_weight"].load().to(dtype))
            layers[lid] = m.eval()
    except BaseException:
        for table in opened:
            table.close()
        raise
    return V41Memory(cfg, mapping, layers, tier)
