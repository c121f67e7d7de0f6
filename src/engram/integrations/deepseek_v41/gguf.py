"""llama.cpp's deepseek41 GGUF layout (the open llama.cpp PR #28696): tables `blk.{layer}.engram_embd.weight`, the
module's `engram_wkv`/`engram_q`/`engram_k`, the hash constants under `{arch}.engram.*`; read (`load_gguf`) and
written (`export_gguf`) through the container `tables.gguf`."""

from __future__ import annotations

import numpy as np
import torch

from ...deprecation import renamed_keywords
from ...hashing import NgramHashMapping
from ...tables.gguf import FIX, GgufError, GgufFile, check_constants, open_table, prime_base, u64s, write_gguf
from ...tables.rows import check_tier
from ...tokenizer import CompressedTokenizer
from .checkpoint import V41Memory
from .family import DeepSeekV41Family, V41Config
from .module import V41Engram

V41_TABLE = "blk.{layer}.engram_embd.weight"
V41_TENSORS = {"wkv": "blk.{layer}.engram_wkv.weight", "q_weight": "blk.{layer}.engram_q.weight",
               "k_weight": "blk.{layer}.engram_k.weight"}
V41_KEYS = {k: "{arch}.engram." + k for k in ("layer_ids", "head_count", "key_length", "max_ngram_size",
                                               "multipliers", "primes", "offsets", "token_map", "pad_id")}


def engram_kv(mapping, head_dim: int) -> dict:
    """The `{arch}.engram.*` metadata of a DeepSeek-style `mapping` (DeepSeek-V4.1's, or an engram model's: the
    constants are stored, not derived), typed as PR #28696's converter writes them: u32 sizes, i32 layer ids and
    token map, u64 multipliers, primes and offsets flattened in (layer, order, head) order, the compressed pad."""
    L = mapping.layer_ids
    return {V41_KEYS["layer_ids"]: ("ARRAY[INT32]", [int(x) for x in L]),
            V41_KEYS["head_count"]: ("UINT32", mapping.n_head_per_ngram),
            V41_KEYS["key_length"]: ("UINT32", int(head_dim)),
            V41_KEYS["max_ngram_size"]: ("UINT32", mapping.max_ngram_size),
            V41_KEYS["multipliers"]: u64s([mapping.layer_multipliers[lid] for lid in L]),
            V41_KEYS["primes"]: u64s([mapping.head_sizes(lid) for lid in L]),
            V41_KEYS["offsets"]: u64s([mapping.head_offsets(lid) for lid in L]),
            V41_KEYS["token_map"]: ("ARRAY[INT32]", [int(x) for x in mapping.compressed_tokenizer.lookup_table]),
            V41_KEYS["pad_id"]: ("UINT32", int(mapping.compressed_pad_id))}


def v41_constants(f: GgufFile) -> dict:
    """DeepSeek-V4.1's engram keys (PR #28696): {layer_ids, n_heads, head_dim, max_ngram_size, multipliers
    {layer: [N]}, primes {layer: [[p] * H] * (N-1)}, offsets {layer: [(N-1)*H]}, token_map (int64 array),
    pad_id (compressed)}."""
    c = {"layer_ids": [int(x) for x in f.key(V41_KEYS["layer_ids"])]}
    N, H = int(f.key(V41_KEYS["max_ngram_size"])), int(f.key(V41_KEYS["head_count"]))
    c.update(max_ngram_size=N, n_heads=H, head_dim=int(f.key(V41_KEYS["key_length"])),
             pad_id=int(f.key(V41_KEYS["pad_id"])))
    L = len(c["layer_ids"])
    arrays = {}
    for k, per in (("multipliers", N), ("primes", (N - 1) * H), ("offsets", (N - 1) * H)):
        v = np.asarray(f.key(V41_KEYS[k]))
        if v.ndim != 1 or len(v) != L * per or not np.issubdtype(v.dtype, np.integer):
            raise GgufError(f"{f.path}: {V41_KEYS[k].format(arch=f.arch)} must hold {L} x {per} integers "
                            f"({L} layers, max_ngram_size {N}, head_count {H}); {FIX}")
        arrays[k] = v.astype(np.int64).reshape(L, per)
    c["multipliers"] = {lid: arrays["multipliers"][i] for i, lid in enumerate(c["layer_ids"])}
    c["primes"] = {lid: arrays["primes"][i].reshape(N - 1, H).tolist() for i, lid in enumerate(c["layer_ids"])}
    c["offsets"] = {lid: arrays["offsets"][i].tolist() for i, lid in enumerate(c["layer_ids"])}
    tm = np.asarray(f.key(V41_KEYS["token_map"]))
    if tm.ndim != 1 or not len(tm) or not np.issubdtype(tm.dtype, np.integer) or int(tm.min()) < 0:
        raise GgufError(f"{f.path}: {V41_KEYS['token_map'].format(arch=f.arch)} must be non-negative integers; {FIX}")
    c["token_map"] = tm.astype(np.int64)
    return c


@renamed_keywords(backend="tier")
def load_gguf(path, tier: str = "mmap", dtype: torch.dtype = torch.bfloat16, **disk_kwargs) -> V41Memory:
    """DeepSeek-V4.1's Engram layers from a llama.cpp GGUF file (`deepseek41`, the layout of llama.cpp PR #28696):
    tables `blk.{layer}.engram_embd.weight` read in place (`tables.gguf.open_table`: "ram" copies the stored rows
    into RAM, "mmap" maps them, "disk" reads them by the cold tier; decoded from their row type after each gather),
    `engram_wkv`, `engram_q`, `engram_k` decoded into the module, and the hashing from the `{arch}.engram.*` keys:
    the family rebuilt by its rules from the token map, sizes and first table size, whose multipliers, primes and
    offsets must equal the file's (so hashing is the safetensors checkpoint's, the same identity digest).
    Everything is checked before any table opens."""
    check_tier(tier)
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
                    {"multipliers": [family.layer_multipliers[lid] for lid in lids],
                     "primes": [family.vocab_size_across_layers[lid] for lid in lids],
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
            table = open_table(f, V41_TABLE.format(layer=lid), tier, dtype=dtype, **disk_kwargs)
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
    return V41Memory(cfg, NgramHashMapping.for_family(family), layers, tier)


def export_gguf(mem: V41Memory, path, row_type: str = "Q8_0", arch: str = "deepseek41", chunk_rows: int = 1 << 16):
    """Write `load`'s Engram layers as llama.cpp's `deepseek41` layout (PR #28696): each table as
    `blk.{layer}.engram_embd.weight` in `row_type` (Q8_0, what the PR's converter writes; BF16 holds FP8 x ue8m0
    rows exactly), the module's weights as F32, and the `{arch}.engram.*` hash constants
    (`tables.gguf.write_gguf`: streamed a block of rows at a time, atomic, with block sums)."""
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
