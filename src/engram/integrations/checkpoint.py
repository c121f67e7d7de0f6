"""Where a released checkpoint's tensors lie, read without loading them: the one reader of safetensors
checkpoint folders (an index's `weight_map`, or the shards' own headers) that the released-model
integrations (`deepseek_v41`, `longcat`, `qwen4_exp`) share.

    wm = weight_map(folder)                               # {tensor name: shard file name}
    t = CheckpointTensor(folder, "embed.weight", wm)      # its shard, header entry, shape; size checked
    rows = t.mapped()                                     # memory-mapped in place (or t.load(): in RAM)
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError
from ..persist import read_json
from ..tables.base import TableError


def weight_map(d: Path) -> dict[str, str]:
    """{tensor name: shard file name} of checkpoint folder `d`: its `model.safetensors.index.json`, else the headers
    of its `*.safetensors` files (one file or several without an index)."""
    from ..tables.files import read_header

    d = Path(d)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        wm = read_json(index, "safetensors index", "re-download the checkpoint", ConfigError).get("weight_map")
        if not isinstance(wm, dict):
            raise ConfigError(f"{index} has no weight_map; re-download the checkpoint")
        return wm
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{d}: no model.safetensors.index.json or *.safetensors (not a checkpoint folder)")
    return {k: f.name for f in files for k in read_header(f, required=())[1] if k != "__metadata__"}


class CheckpointTensor:
    """Where one checkpoint tensor lies: its shard, header and entry (checked against the file's size).

    `needs`: what the caller's model needs, said in the error when `key` is missing (e.g. "a DeepSeek-V4.1
    Engram layer needs embed.weight, ...")."""

    def __init__(self, d: Path, key: str, weight_map: dict, needs: str = ""):
        from ..tables.files import read_header

        d = Path(d)
        if key not in weight_map:
            raise ConfigError(f"{d}: the checkpoint has no {key} (not in its index)" + (f"; {needs}" if needs else ""))
        self.key, self.path = key, d / weight_map[key]
        self.n, meta, self.size = read_header(self.path, required=())
        if key not in meta:
            raise ConfigError(f"{self.path} lacks {key}, which the index places there; re-download the shard")
        self.info = meta[key]
        a, b = self.info["data_offsets"]
        if 8 + self.n + b > self.size:
            raise TableError(f"{self.path} is truncated: {key} ends at byte {8 + self.n + b:,}, the file has "
                             f"{self.size:,}; re-download the shard")
        self.shape = tuple(self.info["shape"])

    def mapped(self) -> torch.Tensor:
        """The tensor memory-mapped from its shard: raw bytes for FP8, else its dtype."""
        from ..tables.files import NP_DTYPES, QUANT_NP_DTYPES, map_tensor

        return map_tensor(self.path, self.n, self.size, self.key, self.info,
                          dtypes={**NP_DTYPES, **QUANT_NP_DTYPES})[1]

    def load(self) -> torch.Tensor:
        """The tensor in RAM (FP8 bytes as uint8; bf16 and float32 as themselves)."""
        return self.mapped().clone()
