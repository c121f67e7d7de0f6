"""Where a released checkpoint's tensors lie, read without loading them: the one reader of safetensors
checkpoint folders (an index's `weight_map`, or the shards' own headers) that the released-model
integrations (`deepseek_v41`, `longcat`, `qwen4_exp`) share.

    wm = weight_map(folder)                               # {tensor name: shard file name}
    t = CheckpointTensor(folder, "embed.weight", wm)      # its shard, header entry, shape; size checked
    rows = t.mapped()                                     # memory-mapped in place (or t.load(): in RAM)
"""

from __future__ import annotations

from pathlib import Path

from ..config import ConfigError
from ..persist import read_json
from ..tables.rows import StoredTensor


def weight_map(d: Path) -> dict[str, str]:
    """{tensor name: shard file name} of checkpoint folder `d`: its `model.safetensors.index.json`, else the headers
    of its `*.safetensors` files (one file or several without an index)."""
    from ..tables.header import read_header

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
    return {k: f.name for f in files for k in read_header(f, required=()).tensors}


class CheckpointTensor(StoredTensor):
    """Where one checkpoint tensor lies (a `tables.StoredTensor`: its shard, header entry and shape, checked against
    the file's size; `mapped()`, `load()`, and the tiers through `tables.open_rows`).

    `needs`: what the caller's model needs, said in the error when `key` is missing (e.g. "a DeepSeek-V4.1
    Engram layer needs embed.weight, ...")."""

    def __init__(self, d: Path, key: str, weight_map: dict, needs: str = ""):
        d = Path(d)
        if key not in weight_map:
            raise ConfigError(f"{d}: the checkpoint has no {key} (not in its index)" + (f"; {needs}" if needs else ""))
        super().__init__(d / weight_map[key], key, why="which the index places there; re-download the shard")
