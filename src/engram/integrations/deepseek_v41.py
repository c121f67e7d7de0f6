"""DeepSeek-V4.1's released Engram: its hash family, FP8 rows with ue8m0 scales, and its conv-less module.

Studying or serving DeepSeek's memory needs none of its backbone: `load` reads only the Engram parts of
a checkpoint folder (config.json, tokenizer.json, the safetensors index and the shards it names).

    mem = load("path/to/DeepSeek-V4.1-Flash", backend="disk")      # "ram" | "mmap" | "disk"
    ids = mem.mapping.hash(input_ids, offsets=True)                  # {layer: (B, T, (N-1)*H) int32}: table rows
    hidden = mem.layers[layer](hidden, ids[layer], mask=None)        # (B, T, G, D) -> (B, T, G, D)

What was read off vLLM 0.32's port of DeepSeek's `inference/engram.py` (and checked against it, see
docs/models.md):

- Hashing: the reference's compression of the model's own tokenizer (its size must equal
  `engram_compressed_vocab_size`), multipliers from `default_rng(10007 * layer_id)`, primes above
  `engram_vocab_size - 1` never reused, in order of layer, order, head: the reference family with seed 0
  and one table size for every order. The pad is the compressed id of `engram_pad_token_id`. A DEAD
  position (an image span) blocks every n-gram that reaches it: from there back the n-gram reads the
  pad, as before the sequence start. Hash ids are int32 with the layer's head offsets added.
- Rows: `layers.{i}.engram.embed.weight` (F8_E4M3, rows x head_dim) and `.embed.scale` (F8_E8M0,
  rows x head_dim/32): value = fp8 * the float32 whose exponent field is the scale byte, then bf16.
- Module: `wkv` (n_hash_cols * head_dim -> hidden * (hc_mult + 1): a key per hc branch and one shared
  value), `q_weight`, `k_weight` (hc_mult x hidden); per branch `dot = sum(h q k key) rsqrt(mean h^2 + eps)
  rsqrt(mean key^2 + eps) / sqrt(D)`, `gate = sigmoid(sign(dot) sqrt(max(|dot|, 1e-6)))`, `h + gate value`;
  a token mask shuts the gate. No short conv. `wkv` may be bf16 or block-FP8 with a `.scale`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from ..config import ConfigError
from ..hashing import HashFamily, NgramHashMapping, head_moduli, layer_multipliers
from ..persist import read_json
from ..tables.base import Table, TableError
from ..tables.quant import UE8M0_BLOCK, BlockFp8Table, ue8m0_to_float
from ..tokenizer import CompressedTokenizer
from .checkpoint import CheckpointTensor, weight_map

CONFIG_FIELDS = ("engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads",
                 "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size", "engram_pad_token_id")


# ------------------------------------------------------------------------------------------ config
@dataclass
class V41Config:
    """The Engram fields of a DeepSeek-V4.1 `config.json`, plus the host sizes the module needs."""

    layer_ids: list[int]
    num_embeddings: list[int]  # table rows per Engram layer
    max_ngram_size: int
    n_heads: int  # heads per n-gram order
    head_dim: int  # row width
    vocab_size: int  # engram_vocab_size: primes start above it - 1
    compressed_vocab_size: int
    pad_token_id: int
    hidden_size: int
    hc_mult: int
    rms_norm_eps: float

    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "config") -> "V41Config":
        if not isinstance(cfg, dict) or not cfg.get("engram_layer_ids"):
            raise ConfigError(f"{where}: not a DeepSeek-V4.1 Engram config (no engram_layer_ids; model_type "
                              f"{cfg.get('model_type') if isinstance(cfg, dict) else None!r})")
        missing = [k for k in CONFIG_FIELDS + ("hidden_size", "hc_mult") if k not in cfg]
        if missing:
            raise ConfigError(f"{where}: DeepSeek-V4.1 Engram config lacks {', '.join(missing)}")
        c = cls([int(i) for i in cfg["engram_layer_ids"]], [int(n) for n in cfg["engram_num_embeddings"]],
                int(cfg["engram_max_ngram_size"]), int(cfg["engram_n_heads"]), int(cfg["engram_head_dim"]),
                int(cfg["engram_vocab_size"]), int(cfg["engram_compressed_vocab_size"]),
                int(cfg["engram_pad_token_id"]), int(cfg["hidden_size"]), int(cfg["hc_mult"]),
                float(cfg.get("rms_norm_eps", 1e-6)))
        if len(c.num_embeddings) != len(c.layer_ids):
            raise ConfigError(f"{where}: engram_num_embeddings has {len(c.num_embeddings)} entries for "
                              f"{len(c.layer_ids)} engram_layer_ids")
        if c.max_ngram_size < 2 or c.n_heads < 1 or c.head_dim % UE8M0_BLOCK:
            raise ConfigError(f"{where}: engram_max_ngram_size must be >= 2, engram_n_heads >= 1 and engram_head_dim "
                              f"a multiple of {UE8M0_BLOCK}")
        return c


# ------------------------------------------------------------------------------------------ hashing
class DeepSeekV41Family(HashFamily):
    """DeepSeek-V4.1's hash family: the reference's, with seed 0 and `engram_vocab_size` for every order."""

    name = "deepseek_v41"
    index_dtype = torch.int32  # the released model's hash ids
    formula = ("x = lookup_table[token_id]; positions t<0, and every position at or before the nearest DEAD one an "
               "n-gram reaches, read compressed_pad_id; mix = XOR_{k<n} (x_{t-k} * multipliers[k]) in int64; head j of "
               "order n: row = mix mod head_moduli[n-2][j] + head_offsets[(n-2)*n_heads + j] (int32)")

    def __init__(self, cfg: V41Config, compressed_tokenizer: CompressedTokenizer):
        ct = compressed_tokenizer
        if ct.compressed_vocab_size != cfg.compressed_vocab_size:
            raise ConfigError(f"the tokenizer compresses to {ct.compressed_vocab_size:,} ids but the config's "
                              f"engram_compressed_vocab_size is {cfg.compressed_vocab_size:,}: not this model's "
                              "tokenizer (hash multipliers derive from that size); "
                              "pass the checkpoint's tokenizer.json")
        if not 0 <= cfg.pad_token_id < ct.raw_vocab_size:
            raise ConfigError(f"engram_pad_token_id {cfg.pad_token_id} is outside the tokenizer's "
                              f"[0, {ct.raw_vocab_size})")
        self.cfg = cfg
        self.layer_ids, self.max_ngram_size, self.n_head_per_ngram = cfg.layer_ids, cfg.max_ngram_size, cfg.n_heads
        self.seed, self.compressed_tokenizer = 0, ct
        self.raw_pad_id, self.pad_id = cfg.pad_token_id, int(ct.lookup_table[cfg.pad_token_id])
        self.multipliers = layer_multipliers(cfg.layer_ids, cfg.max_ngram_size, ct.compressed_vocab_size, 0)
        self.moduli = head_moduli(cfg.layer_ids, [cfg.vocab_size] * (cfg.max_ngram_size - 1), cfg.max_ngram_size,
                                  cfg.n_heads)
        for lid, rows in zip(cfg.layer_ids, cfg.num_embeddings):
            if sum(self.head_sizes(lid)) > rows:
                raise ConfigError(f"layer {lid}: its heads need {sum(self.head_sizes(lid)):,} rows, "
                                  f"engram_num_embeddings gives {rows:,}")

    def config_spec(self) -> dict:
        ct, c = self.compressed_tokenizer, self.cfg
        return {"tokenizer_sha256": ct.tokenizer_sha256, "tokenizer_len": ct.raw_vocab_size,
                "compressed_vocab_size": ct.compressed_vocab_size, "lookup_table_sha256": ct.lookup_sha256,
                "pad_id": c.pad_token_id, "compressed_pad_id": self.pad_id, "max_ngram_size": c.max_ngram_size,
                "n_head_per_ngram": c.n_heads, "head_dim": c.head_dim, "engram_vocab_size": c.vocab_size,
                "num_embeddings": c.num_embeddings, "layer_ids": c.layer_ids, "hidden_size": c.hidden_size,
                "hc_mult": c.hc_mult, "rms_norm_eps": c.rms_norm_eps}

    @classmethod
    def from_spec(cls, spec: dict, tokenizer=None) -> "DeepSeekV41Family":
        ct = CompressedTokenizer(tokenizer)
        if ct.lookup_sha256 != spec["lookup_table_sha256"]:
            raise ConfigError("lookup table mismatch: the compression built from this tokenizer differs from the "
                              "spec's")
        cfg = V41Config(spec["layer_ids"], spec["num_embeddings"], spec["max_ngram_size"], spec["n_head_per_ngram"],
                        spec["head_dim"], spec["engram_vocab_size"], spec["compressed_vocab_size"], spec["pad_id"],
                        spec["hidden_size"], spec["hc_mult"], spec["rms_norm_eps"])
        return cls(cfg, ct)


def hash_mapping(config, tokenizer, backend: str = "auto") -> NgramHashMapping:
    """The V4.1 hashing of a config (`config.json` path, dict or `V41Config`) and the model's tokenizer
    (`tokenizer.json`, its folder, a tokenizer object or a `CompressedTokenizer`): the engine over
    `DeepSeekV41Family`. Its ids are int32; pass `offsets=True` for the table's rows and `dead=` for DEAD masks:
    `hash(ids, offsets=True, dead=mask)`, `hash_continuation(new, history, offsets=True, dead=..., history_dead=...)`.
    """
    cfg = config if isinstance(config, V41Config) else V41Config.from_dict(
        read_json(config, "config.json", "pass the checkpoint folder's config.json", ConfigError)
        if isinstance(config, (str, Path)) else config)
    ct = tokenizer if isinstance(tokenizer, CompressedTokenizer) else CompressedTokenizer(tokenizer)
    return NgramHashMapping.for_family(DeepSeekV41Family(cfg, ct), backend)


# ------------------------------------------------------------------------------------------ the module
def dequantize_linear(weight: torch.Tensor, scale: torch.Tensor | None, dtype=torch.bfloat16) -> torch.Tensor:
    """A linear weight (out, in) as stored: bf16/fp32 as is; FP8 e4m3 with a float32 `scale` per 128 x 128 block
    (DeepSeek-V3's `weight_scale_inv`, multiplied) or a ue8m0 byte per 32 inputs (MX-FP8)."""
    if scale is None:
        return weight.to(dtype)
    w = weight.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    o, i = w.shape
    if (scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
            and tuple(scale.shape) == (o, i // 32)):
        s = ue8m0_to_float(scale).repeat_interleave(32, dim=1)
    elif scale.dtype == torch.float32 and tuple(scale.shape) == (math.ceil(o / 128), math.ceil(i / 128)):
        s = scale.repeat_interleave(128, dim=0)[:o].repeat_interleave(128, dim=1)[:, :i]
    else:
        raise TableError(f"wkv scale of shape {list(scale.shape)} ({scale.dtype}) fits neither 128x128 float32 blocks "
                         f"({[math.ceil(o / 128), math.ceil(i / 128)]}) nor ue8m0 per 32 inputs ({[o, i // 32]})")
    return (w * s).to(dtype)


class V41Engram(nn.Module):
    """DeepSeek-V4.1's Engram layer: `(hidden (B, T, G, D), hash ids (B, T, H) or rows (B, T, H, d), mask) -> hidden`.

    No short conv; the caller's residual is inside (the layer returns `h + gate * value`, as the released
    module does). Weights: `wkv` (G*D + D, H*d), `q_weight`, `k_weight` (G, D); rows from `table`."""

    def __init__(self, layer_id: int, cfg: V41Config, table: Table | None = None, dtype=torch.bfloat16):
        super().__init__()
        self.layer_id, self.cfg, self.table = layer_id, cfg, table
        G, D = cfg.hc_mult, cfg.hidden_size
        self.wkv = nn.Linear(cfg.n_hash_cols * cfg.head_dim, D * (G + 1), bias=False, dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(G, D, dtype=dtype), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(G, D, dtype=dtype), requires_grad=False)
        self.clamp = 1e-6

    def rows(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, H) int row ids (offsets added) -> (B, T, H, d) rows from the table."""
        if self.table is None:
            raise TableError(f"Engram layer {self.layer_id} has no table: pass rows, or load() a checkpoint")
        if hash_ids.dtype.is_floating_point or hash_ids.dim() != 3:
            raise ConfigError(f"hash ids must be an integer tensor (B, T, H), got {hash_ids.dtype} "
                              f"{list(hash_ids.shape)}")
        flat = hash_ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.table.num_rows):
            raise ConfigError(f"hash ids must lie in [0, {self.table.num_rows}) (offsets added): got "
                              f"[{int(flat.min())}, {int(flat.max())}]")
        return self.table.lookup(flat.cpu()).view(*hash_ids.shape, -1).to(hash_ids.device)

    def forward(self, hidden: torch.Tensor, ids_or_rows: torch.Tensor, mask: torch.Tensor | None = None):
        G, D = self.cfg.hc_mult, self.cfg.hidden_size
        if hidden.dim() != 4 or tuple(hidden.shape[2:]) != (G, D):
            raise ConfigError(f"hidden must be (B, T, {G}, {D}), got {list(hidden.shape)}")
        # 1. rows: looked up here from hash ids, or given
        rows = self.rows(ids_or_rows) if not ids_or_rows.dtype.is_floating_point else ids_or_rows  # (B, T, H, d)
        # 2. one key per branch and a shared value from one projection, in the weights' dtype
        kv = self.wkv(rows.flatten(-2).to(self.wkv.weight.dtype))  # (B, T, (G+1)*D)
        return self.gate_and_add(hidden, kv, mask)

    def gate_and_add(self, hidden: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Steps 3-4 (what the released `_fused_engram_post_wkv_kernel` does): hidden (B, T, G, D),
        kv (B, T, (G+1)*D)."""
        G, D = self.cfg.hc_mult, self.cfg.hidden_size
        B, T = hidden.shape[:2]
        f = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        key = kv[..., :G * D].reshape(B, T, G, D).to(f)  # (B, T, G, D)
        value = kv[..., G * D:].to(f)  # (B, T, D)
        h = hidden.to(f)
        # 3. gate per branch: normalized dot of the stream with the key, signed square root, sigmoid
        eps = self.cfg.rms_norm_eps
        dot = (h * self.q_weight.to(f) * self.k_weight.to(f) * key).sum(-1)  # (B, T, G)
        dot = dot * torch.rsqrt(h.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) / math.sqrt(D)
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(self.clamp)))  # (B, T, G)
        if mask is not None:
            if tuple(mask.shape) != (B, T):
                raise ConfigError(f"mask must be (B, T) = {[B, T]}, got {list(mask.shape)}")
            gate = gate * mask.to(gate.device, f)[..., None]  # False shuts the gate
        # 4. the stream plus the gated value
        return (h + gate[..., None] * value[:, :, None, :]).to(hidden.dtype)  # (B, T, G, D)


# ------------------------------------------------------------------------------------------ the checkpoint
NEEDS = "a DeepSeek-V4.1 Engram layer needs embed.weight, embed.scale, wkv.weight, q_weight and k_weight"


class V41Memory:
    """What `load` returns: `.config` (V41Config), `.mapping` (the `NgramHashMapping` of `hash_mapping`),
    `.layers[layer_id]` (V41Engram, each with its `.table`), `.backend`. `close()` releases files and read threads."""

    def __init__(self, config, mapping, layers, backend):
        self.config, self.mapping, self.layers, self.backend = config, mapping, layers, backend

    def __call__(self, layer_id: int, hidden, hash_ids, mask=None):
        return self.layers[layer_id](hidden, hash_ids, mask)

    def table_bytes(self) -> int:
        return sum(m.table.num_rows * m.table.bytes_per_row for m in self.layers.values())

    def close(self) -> None:
        for m in self.layers.values():
            m.table.close()


def load(path, backend: str = "ram", dir=None, dtype: torch.dtype = torch.bfloat16, tokenizer=None,
         **disk_kwargs) -> V41Memory:
    """DeepSeek-V4.1's Engram layers from a checkpoint folder, without its backbone.

    backend "ram": rows copied into RAM as FP8 bytes (264 bytes per 256-wide row); "mmap": rows and scales
    memory-mapped in place from the shards; "disk": read in place by the cold tier (`DiskTable`: positioned
    reads, many in flight; `disk_kwargs` such as `queue_depth`). Rows are never assembled in RAM for mmap/disk
    and stay FP8 on disk; a gather dequantizes them to `dtype`. `dir` (mmap/disk): first copy each layer's
    rows and scales into `dir/engram_v41_L{layer}.safetensors` with 4 KiB block checksums, streamed a block
    at a time, and read that (every block checked on its first read; the released shards carry no sums).
    Everything is checked before any table opens: keys, shapes, dtypes, shard sizes, the tokenizer.
    """
    if backend not in ("ram", "mmap", "disk"):
        raise ConfigError(f"backend must be 'ram', 'mmap' or 'disk', got {backend!r}")
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
            table = _open_table(t["embed.weight"], t["embed.scale"], backend, dir, lid, dtype, disk_kwargs)
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
    return V41Memory(cfg, mapping, layers, backend)


def _open_table(codes: CheckpointTensor, scales: CheckpointTensor, backend: str, dir, lid: int, dtype,
                disk_kwargs) -> BlockFp8Table:
    name = f"layer {lid}"
    if backend == "ram":
        return BlockFp8Table(codes.load(), scales.load(), dtype, name)
    if dir is not None:  # a checked copy: rows packed with their scales (one read each), 4 KiB block sums
        return _open_file(_write_packed(codes, scales, Path(dir), lid), backend, dtype, name, disk_kwargs)
    if backend == "mmap":
        return BlockFp8Table(codes.mapped(), scales.mapped(), dtype, name)
    from ..tables.blocks import UnverifiedTableWarning
    from ..tables.disk import DiskTable

    with warnings.catch_warnings():  # the released shards carry no block sums: one warning per layer, below
        warnings.simplefilter("ignore", UnverifiedTableWarning)
        c = DiskTable(codes.path, tensor=codes.key, **disk_kwargs)
    if c.blocks is None:
        warnings.warn(f"{codes.path.parent}: the shards have no block checksums, so disk-tier reads of layer {lid} are "
                      "not checked; load(..., dir=DIR) reads a checked copy", UnverifiedTableWarning, stacklevel=3)
    # the scales (1/32 of the bytes) in RAM: a cold row is one read of its codes, not two
    return BlockFp8Table(c, scales.load(), dtype, name)


def _write_packed(codes: CheckpointTensor, scales: CheckpointTensor, dir: Path, lid: int,
                  chunk_rows: int = 1 << 16) -> Path:
    """dir/engram_v41_L{lid}.safetensors: tensor `rows` (N, d + d/32) uint8, each row's codes then its scales,
    streamed from the mapped shards a block of rows at a time, page-aligned with 4 KiB block sums."""
    from ..tables.files import write_safetensors
    from ..tables.quant import pack_ue8m0_rows

    c, s = codes.mapped(), scales.mapped()
    n, w = c.shape[0], c.shape[1] + s.shape[1]
    chunks = (pack_ue8m0_rows(c[i:i + chunk_rows], s[i:i + chunk_rows]) for i in range(0, n, chunk_rows))
    f = dir / f"engram_v41_L{lid}.safetensors"
    return write_safetensors(f, [("rows", torch.uint8, (n, w), chunks)],
                             {"format": "engram-v41-rows/1", "source": str(codes.path.parent)}, block_sums=True,
                             page_blocks=True)


def _open_file(f: Path, backend: str, dtype, name: str, disk_kwargs) -> BlockFp8Table:
    from ..tables.blocks import BlockVerifier
    from ..tables.files import QUANT_NP_DTYPES, map_tensor, read_header

    if backend == "disk":
        from ..tables.disk import DiskTable

        return BlockFp8Table(dtype=dtype, name=name, packed=DiskTable(f, tensor="rows", **disk_kwargs))
    n, meta, size = read_header(f, required=("rows",))
    blocks = BlockVerifier.open(f)
    if blocks is not None:
        blocks.verify_all()  # mmap gathers are not checked per row here: check the copy once, now
    return BlockFp8Table(dtype=dtype, name=name, packed=map_tensor(f, n, size, "rows", meta["rows"],
                                                                   dtypes=QUANT_NP_DTYPES)[1])


# ------------------------------------------------------------------------------------------ llama.cpp GGUF files
def load_gguf(path, backend: str = "mmap", dtype: torch.dtype = torch.bfloat16, **disk_kwargs) -> V41Memory:
    """DeepSeek-V4.1's Engram layers from a llama.cpp GGUF file (`deepseek41`, the layout of llama.cpp PR #28696):
    tables `blk.{layer}.engram_embd.weight` read in place (`tables.gguf.open_table`: "ram" copies the stored rows
    into RAM, "mmap" maps them, "disk" reads them by the cold tier; decoded from their row type after each gather),
    `engram_wkv`, `engram_q`, `engram_k` decoded into the module, and the hashing from the `{arch}.engram.*` keys:
    the family rebuilt by its rules from the token map, sizes and first table size, whose multipliers, primes and
    offsets must equal the file's (so hashing is the safetensors checkpoint's, the same identity digest).
    Everything is checked before any table opens."""
    from ..tables.gguf import (
        V41_TABLE,
        V41_TENSORS,
        GgufError,
        GgufFile,
        check_constants,
        open_table,
        prime_base,
        v41_constants,
    )

    if backend not in ("ram", "mmap", "disk"):
        raise ConfigError(f"backend must be 'ram', 'mmap' or 'disk', got {backend!r}")
    f = GgufFile(path)
    c = v41_constants(f)
    lids, lut = c["layer_ids"], c["token_map"]
    rows = {}
    for lid in lids:
        t = f.tensor(V41_TABLE.format(layer=lid))
        if len(t.shape) != 2 or t.shape[1] != c["head_dim"]:
            raise GgufError(f"{f.path}: {t.name} has shape {list(t.shape)}, key_length says rows of {c['head_dim']}")
        rows[lid] = t.shape[0]
    q = f.tensor(V41_TENSORS["q_weight"].format(layer=lids[0]))
    if len(q.shape) != 2:
        raise GgufError(f"{f.path}: {q.name} has shape {list(q.shape)}, (hc_mult, hidden) expected")
    hc, hidden = q.shape
    pads = np.flatnonzero(lut == c["pad_id"])
    if not len(pads):
        raise GgufError(f"{f.path}: no token maps to the pad id {c['pad_id']} of its token map; re-convert the file")
    cfg = V41Config(lids, [rows[lid] for lid in lids], c["max_ngram_size"], c["n_heads"], c["head_dim"],
                    prime_base(c["primes"][lids[0]][0][0]), int(lut.max()) + 1, int(pads[0]), hidden, hc,
                    float(f.key("{arch}.attention.layer_norm_rms_epsilon", 1e-6, required=False)))
    ct = CompressedTokenizer.__new__(CompressedTokenizer)  # the file's token map is the compression
    ct.tokenizer_file = ct.tokenizer = ct.tokenizer_sha256 = None
    ct.lookup_table, ct.num_new_token = lut, cfg.compressed_vocab_size
    family = DeepSeekV41Family(cfg, ct)
    check_constants(f.path, {"multipliers": [c["multipliers"][lid] for lid in lids],
                             "primes": [c["primes"][lid] for lid in lids],
                             "offsets": [c["offsets"][lid] for lid in lids]},
                    {"multipliers": [family.multipliers[lid] for lid in lids],
                     "primes": [family.moduli[lid] for lid in lids],
                     "offsets": [family.head_offsets(lid) for lid in lids]})
    weights = {lid: {k: f.array(name.format(layer=lid)) for k, name in V41_TENSORS.items()} for lid in lids}
    for lid, w in weights.items():
        want = {"wkv": (hidden * (hc + 1), cfg.n_hash_cols * cfg.head_dim), "q_weight": (hc, hidden),
                "k_weight": (hc, hidden)}
        for k, shape in want.items():
            if tuple(w[k].shape) != shape:
                raise GgufError(f"{f.path}: {V41_TENSORS[k].format(layer=lid)} has shape {list(w[k].shape)}, this "
                                f"file's engram keys need {list(shape)}")
    layers, opened = {}, []
    try:
        for lid in lids:
            table = open_table(f, V41_TABLE.format(layer=lid), backend, dtype=dtype, **disk_kwargs)
            opened.append(table)
            m = V41Engram(lid, cfg, table, dtype=dtype)
            with torch.no_grad():
                for k in ("q_weight", "k_weight"):
                    getattr(m, k).copy_(weights[lid][k].to(dtype))
                m.wkv.weight.copy_(weights[lid]["wkv"].to(dtype))
            layers[lid] = m.eval()
    except BaseException:
        for table in opened:
            table.close()
        raise
    return V41Memory(cfg, NgramHashMapping.for_family(family), layers, backend)


def export_gguf(mem: V41Memory, path, row_type: str = "Q8_0", arch: str = "deepseek41", chunk_rows: int = 1 << 16):
    """Write `load`'s Engram layers as llama.cpp's `deepseek41` layout (PR #28696): each table as
    `blk.{layer}.engram_embd.weight` in `row_type` (Q8_0, what the PR's converter writes; BF16 holds FP8 x ue8m0
    rows exactly), the module's weights as F32, and the `{arch}.engram.*` hash constants
    (`tables.gguf.write_gguf`: streamed a block of rows at a time, atomic, with block sums)."""
    from ..tables.gguf import V41_TABLE, V41_TENSORS, engram_kv, write_gguf

    def rows(table):
        for s in range(0, table.num_rows, chunk_rows):
            yield table.gather(torch.arange(s, min(s + chunk_rows, table.num_rows))).float()

    tensors = []
    for lid, m in mem.layers.items():
        tensors.append((V41_TABLE.format(layer=lid), row_type, (m.table.num_rows, m.table.dim), rows(m.table)))
        for k, name in V41_TENSORS.items():
            w = m.wkv.weight if k == "wkv" else getattr(m, k)
            tensors.append((name.format(layer=lid), "F32", w.detach().float()))
    kv = {**engram_kv(mem.mapping, mem.config.head_dim),
          "{arch}.attention.layer_norm_rms_epsilon": ("FLOAT32", mem.config.rms_norm_eps)}
    return write_gguf(path, arch, kv, tensors)


__all__ = ["DeepSeekV41Family", "V41Config", "V41Engram", "V41Memory", "dequantize_linear",
           "export_gguf", "hash_mapping", "load", "load_gguf"]
