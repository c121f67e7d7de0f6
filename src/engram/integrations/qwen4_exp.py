"""Qwen3.8-Flash-Next (`transformers` model type `qwen4_exp`): its n-gram tables hashed by engram's kernel.

The model's `Qwen4ExpTextNGramEmbedding` is Engram's lookup with another hash family (raw ids,
SplitMix64 multipliers, consecutive primes, EOS document resets: `Qwen4ExpFamily` below) and its
`Qwen4ExpTextPLELayer` is Engram's gate and conv. The installed transformers is the reference.

    mapping = hash_mapping(model.config.text_config)     # or the text config itself
    rows = mapping.hash(input_ids)                       # {ple_layer_id (1-indexed): (B, T, H)} before offsets
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from ..config import ConfigError
from ..hashing import PRIME_1, HashFamily, NgramHashMapping
from ..persist import read_json
from ..tokenizer import RawIds

# ------------------------------------------------------------------------------------------ the hash family

_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """SplitMix64's output function on a 64-bit state advanced by one step (what qwen4_exp seeds with)."""
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def splitmix_multipliers(vocab_size: int, ngram_size: int, index: int, seed: int) -> np.ndarray:
    """qwen4_exp's odd multipliers of PLE layer `index`: `2 * (splitmix64(base + GAMMA*(k+1)) mod half) + 1`."""
    half = max(1, (np.iinfo(np.int64).max // max(vocab_size, 1)) // 2)
    base = seed + PRIME_1 * index
    return np.array([2 * (splitmix64((base + _GAMMA * (k + 1)) & _MASK64) % half) + 1
                     for k in range(ngram_size)], dtype=np.int64)


def consecutive_primes(start: int, count: int) -> list[int]:
    """The `count` primes above `start`, in order."""
    from sympy import nextprime

    out, p = [], start
    for _ in range(count):
        p = int(nextprime(p))
        out.append(p)
    return out


class Qwen4ExpFamily(HashFamily):
    """Qwen3.8-Flash-Next's n-gram hashing: raw token ids (no compression); per PLE layer (index i in
    `ple_layer_ids`) multipliers `2 * (splitmix64(seed + 10007 * i + GAMMA * (k + 1)) mod half_bound) + 1`;
    head h of layer i takes the (i * H + h + 1)-th prime above `ngram_vocab_size_base - 1` (consecutive
    primes shared by all orders and layers); positions before the sequence or across an EOS (each
    document hashes as if it started fresh) read the EOS id. Keyed by the (1-indexed) `ple_layer_ids`.
    """

    name = "qwen4_exp"
    formula = ("raw token ids; positions before the sequence or before the token after the last EOS (reset_id) "
               "read reset_id; mix = XOR_{k<n} (x_{t-k} * multipliers[k]) in wrapping int64; head j of order n: "
               "row = mix floor-mod head_moduli[n-2][j]; table row = row + head_offsets[(n-2)*n_head_per_ngram + j]")

    def __init__(self, vocab_size: int, ngram_size: int, heads_per_ngram: int, ple_layer_ids,
                 ngram_vocab_size_base: int, seed: int, eos_token_id: int):
        for name, v in (("vocab_size", vocab_size), ("ngram_size", ngram_size), ("heads_per_ngram", heads_per_ngram),
                        ("ngram_vocab_size_base", ngram_vocab_size_base)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "ngram_size" else 1):
                raise ConfigError(f"qwen4_exp hashing: {name} must be a positive integer, got {v!r}")
        if not isinstance(eos_token_id, int) or not 0 <= eos_token_id < vocab_size:
            raise ConfigError(f"qwen4_exp hashing needs the EOS id in [0, {vocab_size}), got {eos_token_id!r}")
        if not ple_layer_ids:
            raise ConfigError("qwen4_exp hashing: ple_layer_ids is empty (the model has no n-gram table)")
        self.max_ngram_size, self.n_head_per_ngram = int(ngram_size), int(heads_per_ngram)
        self.prime_base, self.seed = int(ngram_vocab_size_base), int(seed)
        self.layer_ids = [int(i) for i in ple_layer_ids]
        self.compressed_tokenizer = RawIds(vocab_size)
        self.reset_id = self.raw_pad_id = self.pad_id = int(eos_token_id)
        H = (self.max_ngram_size - 1) * self.n_head_per_ngram
        primes = consecutive_primes(self.prime_base - 1, H * len(self.layer_ids))
        self.multipliers, self.moduli = {}, {}
        for i, lid in enumerate(self.layer_ids):
            self.multipliers[lid] = splitmix_multipliers(vocab_size, self.max_ngram_size, i, self.seed)
            heads = primes[i * H:(i + 1) * H]
            self.moduli[lid] = [heads[o * self.n_head_per_ngram:(o + 1) * self.n_head_per_ngram]
                                for o in range(self.max_ngram_size - 1)]

    def config_spec(self) -> dict:
        return {"vocab_size": self.raw_vocab_size, "max_ngram_size": self.max_ngram_size,
                "n_head_per_ngram": self.n_head_per_ngram, "prime_base": self.prime_base, "seed": self.seed,
                "reset_id": self.reset_id, "layer_ids": self.layer_ids,
                "lookup_table_sha256": self.compressed_tokenizer.lookup_sha256, "compressed_pad_id": self.pad_id}

    @classmethod
    def from_spec(cls, spec: dict, tokenizer=None) -> "Qwen4ExpFamily":
        return cls(spec["vocab_size"], spec["max_ngram_size"], spec["n_head_per_ngram"], spec["layer_ids"],
                   spec["prime_base"], spec["seed"], spec["reset_id"])



class _RowIds(nn.Module):
    """Stands in for an n-gram table: returns the row ids it is asked for (`transformers_hashing`)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Buffer(torch.zeros(1))

    def forward(self, ids):
        return ids.unsqueeze(-1)


def transformers_hashing(config, ple_index: int):
    """transformers' own `Qwen4ExpTextNGramEmbedding` for PLE layer `ple_index`, with its table replaced by an
    echo of the row ids: `module(input_ids, cache)` -> (B, T, H) row ids, offsets included. The reference our
    hashing is tested and benchmarked against; no table is allocated (it is built on the meta device)."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mq

    cfg = text_config(config)
    with torch.device("meta"):  # the real table would be ~20M rows per head
        m = mq.Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, cfg.ple_layer_ids[ple_index] - 1, ple_index)
    m.layer_multipliers = mq._build_layer_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.seed)
    m.ngram_heads_vocab_sizes = torch.tensor(m.head_vocab_sizes)
    m.ngram_heads_offsets = torch.tensor(m.head_offsets)
    m.ngram_embedding = _RowIds()
    return m


def text_config(config):
    """The text config of a Qwen4Exp config (a `Qwen4ExpConfig` nests it in `text_config`)."""
    return getattr(config, "text_config", None) or config


def eos_id(cfg) -> int:
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else cfg.eos_token_id
    if eos is None:
        raise ConfigError("qwen4_exp config has no eos_token_id: its hashing resets documents at EOS")
    return int(eos)


def hash_mapping(config, backend: str = "auto") -> NgramHashMapping:
    """The `qwen4_exp` `NgramHashMapping` of a Qwen4Exp (text) config, keyed by its 1-indexed `ple_layer_ids`."""
    cfg = text_config(config)
    if getattr(cfg, "model_type", None) not in ("qwen4_exp_text", "qwen4_exp") or not hasattr(cfg, "ngram_size"):
        raise ConfigError(f"not a qwen4_exp config (model_type {getattr(cfg, 'model_type', None)!r})")
    if not cfg.ple_layer_ids:
        raise ConfigError("this qwen4_exp config has no n-gram table (ple_layer_ids is empty)")
    family = Qwen4ExpFamily(cfg.vocab_size, cfg.ngram_size, cfg.heads_per_ngram, cfg.ple_layer_ids,
                            cfg.ngram_vocab_size_base, cfg.seed, eos_id(cfg))
    return NgramHashMapping.for_family(family, backend)


# ------------------------------------------------------------------------------------------ serving the tables


class ServedNGramEmbedding(nn.Module):
    """Drop-in for transformers' `Qwen4ExpTextNGramEmbedding`: engram's kernel hashes, an engram table holds the rows.

    `forward(input_ids (B, T), cache) -> (B, T, H * d)`, the same values. The cache's id slot (conv state 2)
    is read and written exactly as transformers does, so its own decoding code and ours share a cache.
    The rows live behind `mhe` (a `MultiHeadEmbedding` with an installed `engram.tables` Table); the
    <= 127 padding rows of the checkpoint's table (never addressed) are kept aside so that `state_dict()`
    gives back `ngram_embedding.weight` in its original shape: a saved model loads in plain transformers.
    """

    @property
    def hash_mapping(self) -> NgramHashMapping:
        """The mapping that addresses its rows, under the name `Engram` layers give it (`editing.mapping_of`)."""
        return self.mapping

    def __init__(self, orig, mapping: NgramHashMapping, ple_layer_id: int, table, pad_rows: torch.Tensor):
        super().__init__()
        from ..memory import MultiHeadEmbedding
        from ..tables.base import install

        self.layer_idx, self.context_len, self.eos_token_id = orig.layer_idx, orig.context_len, orig.eos_token_id
        self.mapping, self.ple_layer_id = mapping, ple_layer_id
        self.mhe = MultiHeadEmbedding(mapping.head_sizes(ple_layer_id), table.dim, dtype=table.dtype,
                                      layer_id=ple_layer_id)
        self.mhe.embedding.weight.requires_grad_(False)
        install(self.mhe, table)
        self.mhe.train(False)
        self.pad_rows = pad_rows  # (padded - used, d): saved back, never looked up
        self.pending = None  # rows handed over by the prefetcher for this call (PendingRows), else hashed here
        self._register_state_dict_hook(_state_dict_as_transformers)  # (loading goes through transformers)

    def forward(self, input_ids: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
        cache = kwargs.get("past_key_values", cache)
        input_ids = input_ids.long()
        history = cache.get_conv_state(self.layer_idx, state_idx=2) if cache is not None else None
        if history is not None:
            history = history.clone()
        if cache is not None:  # keep the last N-1 ids where transformers keeps them (EOS-padded on a short first call)
            ids = input_ids
            if history is None and ids.shape[1] < self.context_len:
                ids = torch.nn.functional.pad(ids, (self.context_len - ids.shape[1], 0), value=self.eos_token_id)
            cache.update_conv_state(ids, self.layer_idx, state_idx=2, conv_kernel_size=self.context_len)
        pending, self.pending = self.pending, None
        if pending is not None:
            rows = pending.wait()  # (B, T, H, d), gathered on the prefetch thread
        else:
            h = self.mapping.hash_continuation(input_ids.cpu(), history.cpu() if history is not None else None,
                                               offsets=True)  # the table's rows (head offsets added by the kernel)
            rows = self.mhe.gather(h[self.ple_layer_id])  # (B, T, H, d)
        return rows.to(input_ids.device).flatten(-2)  # (B, T, H * d)


def _state_dict_as_transformers(module, sd, prefix, local_metadata):
    from ..tables.base import rows_by_reference_active
    from ..tables.overlay import overlays_of

    for k in [k for k in sd if k.startswith(prefix + "mhe.")]:
        del sd[k]
    if rows_by_reference_active():  # a weights digest: it samples the rows through the table instead
        return sd
    below = overlays_of(module.mhe)  # fact overlays (engram edit) stay out of the checkpoint: it keeps its own rows
    t = below[0].base if below else module.mhe.table
    if not hasattr(t, "weight"):
        raise ConfigError(f"layer {module.layer_idx}'s n-gram table is served from {t.stats().get('format')} rows, "
                          "which are not saved back as transformers weights; save the model before serve_tables")
    sd[prefix + "ngram_embedding.weight"] = torch.cat([t.weight, module.pad_rows.to(t.weight.dtype)])
    return sd


def _ple_layers(model):
    """(text model, [(decoder layer index, ple module)]) of a Qwen4Exp model: the layers with an n-gram table."""
    for path in ("model.language_model", "model", "language_model", ""):
        owner = model
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part, None)
        if isinstance(getattr(owner, "layers", None), nn.ModuleList):
            break
    else:
        raise ConfigError(f"{type(model).__name__}: no decoder layer list; serve_tables takes a Qwen4Exp model")
    out = [(i, layer.ple) for i, layer in enumerate(owner.layers) if getattr(layer, "ple", None) is not None]
    if not out:
        raise ConfigError(f"{type(model).__name__} has no n-gram table (no decoder layer has a PLE module)")
    return owner, out


def checkpoint_shards(checkpoint, layer_idx: int, suffix: str = "weight") -> list[tuple]:
    """[(file, key, rows)] of decoder layer `layer_idx`'s n-gram table shards in a safetensors checkpoint, in order
    (`suffix` "weight_scale": an NVFP4 table's block-scale shards)."""
    import re
    from pathlib import Path

    from safetensors import safe_open

    from .checkpoint import weight_map

    d = Path(checkpoint)
    files = sorted(set(weight_map(d).values()))
    pat = re.compile(rf"(^|\.)layers\.{layer_idx}\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.{suffix}$")
    found = []
    for f in files:
        with safe_open(str(d / f), "pt") as st:
            for k in st.keys():
                m = pat.search(k)
                if m:
                    found.append((int(m.group(2)), d / f, k, st.get_slice(k).get_shape()[0]))
    return [(f, k, n) for _, f, k, n in sorted(found)]


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
    with safe_open(str(shards[0][0]), "pt") as st:
        sl = st.get_slice(shards[0][1])
        dtype, width = sl.get_dtype(), sl.get_shape()[1]
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
    from safetensors import safe_open

    shards = checkpoint_shards(checkpoint, layer_idx)
    if not shards:
        return False
    with safe_open(str(shards[0][0]), "pt") as st:
        packed = st.get_slice(shards[0][1]).get_dtype() == "U8"
    return packed or bool(checkpoint_shards(checkpoint, layer_idx, "weight_scale"))


def _nvfp4_table(checkpoint, layer_idx: int, lid: int, padded: int, used: int, dim: int, parts: int, backend: str,
                 dir, dtype):
    """(NvFp4Table of the first `used` rows, decoded padding rows) of layer `layer_idx`'s NVFP4 table in
    `checkpoint`: `shard_<i>.weight` (rows, d/2) uint8, `shard_<i>.weight_scale` (rows, d/16) F8_E4M3 and one
    `ngram_embedding.weight_scale_2`, checked to fit the config; RAM, or a packed file in `dir` (mmap/disk)."""
    from pathlib import Path

    from safetensors import safe_open

    from ..tables.quant import NvFp4Table, check_global_scale, open_nvfp4_file, pack_nvfp4_rows, write_nvfp4_file

    parts_of = {sfx: checkpoint_shards(checkpoint, layer_idx, sfx) for sfx in ("weight", "weight_scale")}
    where = f"{checkpoint}: layer {layer_idx}'s NVFP4 n-gram table"
    for sfx, width, dt in (("weight", dim // 2, "U8"), ("weight_scale", dim // 16, "F8_E4M3")):
        shards = parts_of[sfx]
        if dim % 16 or len(shards) != parts or sum(n for *_, n in shards) != padded:
            raise ConfigError(f"{where}: {len(shards)} shard_<i>.{sfx} tensors hold {sum(n for *_, n in shards):,} "
                              f"rows; the config needs {padded:,} rows of {dim} (a multiple of 16) in "
                              f"split_ngram_parts={parts} (incomplete download, or scales missing?)")
        for f, k, _ in shards:
            with safe_open(str(f), "pt") as st:
                sl = st.get_slice(k)
                if sl.get_dtype() != dt or sl.get_shape()[1:] != [width]:
                    what = "two E2M1 codes a byte" if sfx == "weight" else "one E4M3 scale per 16 values"
                    raise ConfigError(f"{where}: {k} is {sl.get_dtype()} {sl.get_shape()}; NVFP4 needs {dt} rows of "
                                      f"{width} ({what})")
    key = f"layers.{layer_idx}.ple.ple_embedding.ngram_embedding.weight_scale_2"
    g = None
    for f in sorted({f for f, *_ in parts_of["weight"]} | set(Path(checkpoint).glob("*.safetensors"))):
        with safe_open(str(f), "pt") as st:
            k = next((k for k in st.keys() if k == key or k.endswith("." + key)), None)
            if k is not None:
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
                yield pack_nvfp4_rows(codes, scales)
            start += n

    name = f"layer {layer_idx}"
    pad = NvFp4Table(packed=torch.cat(list(packed(used, padded))), global_scale=g, dtype=dtype, name=name) \
        if padded > used else None
    pad_rows = pad.gather(torch.arange(padded - used)) if pad is not None else torch.empty(0, dim, dtype=dtype)
    if backend == "ram":
        return NvFp4Table(packed=torch.cat(list(packed(0, used))), global_scale=g, dtype=dtype, name=name), pad_rows
    f = write_nvfp4_file(Path(dir) / f"engram_table_L{lid}.nvfp4.safetensors", packed(0, used), used, dim, g,
                         page_blocks=backend == "disk", metadata={"layer": str(lid), "source": str(checkpoint)})
    return open_nvfp4_file(f, backend, dtype, name), pad_rows


def serve_tables(model, backend: str = "ram", dir=None, cache_mb: float = 0.0, prefetch: bool = True,
                 checkpoint=None, gguf=None):
    """Serve a loaded Qwen4Exp model's n-gram tables from engram: our kernel hashes, an engram backend holds the rows.

    backend "ram": the table tensor is used where it is (no copy); "mmap": each table is written, a block of
    rows at a time, to `dir/engram_table_L{ple layer}.safetensors` and memory-mapped (hot-row cache of
    `cache_mb`), and the model's copy is freed; "disk": written the same way (page-aligned, 4 KiB block
    sums) and read by the cold tier, `DiskTable` (many positioned reads in flight, each block checked on
    its first read; for tables colder than the page cache). `prefetch`: every forward hashes and gathers on a thread
    while the layers before the first PLE run. Prefill logits and cached `generate()` equal transformers'
    own; `save_pretrained` writes `ngram_embedding.weight` back, so the saved model loads in plain
    transformers. `checkpoint`: take the rows from that checkpoint's `split_ngram_parts` shards, one shard in RAM
    at a time, instead of from the model's tensor (which may then be empty: see `from_pretrained`). `gguf`: read
    the rows in place from a llama.cpp qwen4exp GGUF file's `per_layer_token_embd` instead (`serve_gguf_table`).
    Returns the model.
    """
    import math

    from ..tables.backends import InRamTable, MmapTable
    from ..tables.files import table_file, tensor_entry, write_safetensors

    if backend not in ("ram", "mmap", "disk"):
        raise ConfigError(f"backend must be 'ram', 'mmap' or 'disk', got {backend!r}")
    if backend in ("mmap", "disk") and dir is None and gguf is None:
        raise ConfigError(f"serve_tables(backend={backend!r}) needs dir= for the table files")
    mapping = hash_mapping(model.config)
    cfg = text_config(model.config)
    owner, ples = _ple_layers(model)
    served = {}
    for i, ple in ples:
        orig = ple.ple_embedding
        if isinstance(orig, ServedNGramEmbedding):
            raise ConfigError(f"layer {i}'s n-gram table is already served by engram")
        lid = i + 1  # ple_layer_ids are 1-indexed
        used = int(sum(mapping.head_sizes(lid)))
        padded = math.ceil(used / cfg.make_ngram_vocab_size_divisible_by) * cfg.make_ngram_vocab_size_divisible_by
        w, dim = orig.ngram_embedding.weight.detach(), orig.ngram_embedding.embedding_dim
        if list(orig.head_vocab_sizes) != mapping.head_sizes(lid):
            raise ConfigError(f"layer {i}: the model's heads {orig.head_vocab_sizes[:3]}... differ from the hashing "
                              "its config derives")
        if gguf is not None:  # rows read in place from a llama.cpp file, no copy (the dir is not used)
            table, pad_rows = serve_gguf_table(gguf, mapping, lid, padded, backend, dim)
            served[lid] = ple.ple_embedding = ServedNGramEmbedding(orig, mapping, lid, table, pad_rows)
            continue
        if checkpoint is None:
            if w.shape[0] != padded:
                raise ConfigError(f"layer {i}: the model's n-gram table has {w.shape[0]:,} rows, its config needs "
                                  f"{padded:,} (loaded without its table? pass checkpoint=)")
            dtype, pad_rows = w.dtype, w[used:].clone()
        elif _is_nvfp4(checkpoint, i):  # packed NVFP4 rows (vLLM's Qwen4Exp format): served packed, in any tier
            table, pad_rows = _nvfp4_table(checkpoint, i, lid, padded, used, dim, cfg.split_ngram_parts, backend,
                                           dir, w.dtype)
            served[lid] = ple.ple_embedding = ServedNGramEmbedding(orig, mapping, lid, table, pad_rows)
            continue
        else:
            dtype, rows = _checkpoint_rows(checkpoint, i, padded, dim, cfg.split_ngram_parts)
            pad_rows = torch.cat(list(rows(used, padded))) if padded > used else torch.empty(0, dim, dtype=dtype)
        if backend == "ram":
            if checkpoint is None:
                weight = w[:used]  # the tensor transformers loaded: no copy
            else:
                weight, at = torch.empty(used, dim, dtype=dtype), 0
                for blk in rows(0, used):
                    weight[at:at + blk.shape[0]] = blk
                    at += blk.shape[0]
            table = InRamTable(weight)
        else:
            f = table_file(dir, lid)
            entry = (tensor_entry("weight", w[:used]) if checkpoint is None
                     else ("weight", dtype, (used, dim), rows(0, used)))
            write_safetensors(f, [entry], {"format": "engram-table", "layer": str(lid)}, block_sums=True,
                              page_blocks=backend == "disk")
            if backend == "disk":
                from ..tables.disk import DiskTable

                table = DiskTable(f)
            else:
                table = MmapTable(f, cache_bytes=int(cache_mb * 2**20))
        served[lid] = ple.ple_embedding = ServedNGramEmbedding(orig, mapping, lid, table, pad_rows)
        del orig  # (mmap: the model's copy of the table is released here)
    if prefetch:
        _attach_prefetch(owner, served, mapping)
    return model


def _attach_prefetch(owner, served: dict, mapping) -> None:
    """A pre-hook on the text model: hash and gather every served table's rows on a thread for this call."""
    from ..tables.prefetch import Prefetcher

    pf = Prefetcher.for_tables({lid: s.mhe for lid, s in served.items()}, mapping)
    first = min(served.values(), key=lambda s: s.layer_idx)

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        hist = cache.get_conv_state(first.layer_idx, state_idx=2) if cache is not None else None
        for lid, rows in pf.submit(ids, hist).items():
            served[lid].pending = rows
        return None

    owner.register_forward_pre_hook(hook, with_kwargs=True)


def is_model_folder(path) -> bool:
    """True when `path` is a model folder whose config.json is a Qwen4Exp one (`model_type` qwen4_exp or its text)."""
    from pathlib import Path

    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    try:
        cfg = read_json(f, "model config", "re-save or re-download the model", ConfigError)
    except ConfigError:
        return False  # (unreadable: the loader of engram's own folders checks it against its manifest and says so)
    return isinstance(cfg, dict) and cfg.get("model_type") in ("qwen4_exp", "qwen4_exp_text")


def load_folder(path, backend: str = "ram", dir=None):
    """(model, tokenizer) of a Qwen4Exp model folder: `from_pretrained` (tables served by engram) and the folder's
    tokenizer.json. What `engram serve PATH` and `engram edit --checkpoint PATH` load for such a folder."""
    from pathlib import Path

    from ..tokenizer import load_tokenizer

    return from_pretrained(path, backend, dir), load_tokenizer(Path(path) / "tokenizer.json")


def from_pretrained(path, backend: str = "mmap", dir=None, cache_mb: float = 0.0, prefetch: bool = True, gguf=None,
                    **kwargs):
    """Load a Qwen4Exp checkpoint with its n-gram tables served by engram, never holding a whole table in RAM
    (backend "mmap"): the backbone loads through transformers with the table left out (its modules get an
    empty table and its `split_ngram_parts` shards are skipped), then `serve_tables(..., checkpoint=path)`
    streams each table into `dir`, one shard at a time. `gguf`: the table is read in place from that llama.cpp
    GGUF file instead (its shards in `path` are not read). `kwargs` go to transformers' `from_pretrained`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mq

    if backend in ("mmap", "disk") and dir is None and gguf is None:
        raise ConfigError(f"from_pretrained(backend={backend!r}) needs dir= for the table files")
    hash_mapping(AutoConfig.from_pretrained(path))  # a model without n-gram tables is refused before loading
    original = mq.Qwen4ExpTextNGramEmbedding

    class _Tableless(original):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)  # (on the meta device inside from_pretrained: costs nothing)
            self.ngram_embedding = nn.Embedding(0, self.ngram_embedding.embedding_dim)

    skip = {r"ngram_embedding\.": "ngram_embedding_served_by_engram."}
    mq.Qwen4ExpTextNGramEmbedding = _Tableless
    try:
        model = AutoModelForCausalLM.from_pretrained(path, key_mapping={**skip, **kwargs.pop("key_mapping", {})},
                                                     **kwargs)
    finally:
        mq.Qwen4ExpTextNGramEmbedding = original
    return serve_tables(model, backend=backend, dir=dir, cache_mb=cache_mb, prefetch=prefetch,
                        checkpoint=None if gguf is not None else path, gguf=gguf)


# ------------------------------------------------------------------------------------------ llama.cpp GGUF files


def gguf_hash_mapping(path, seed: int = 1234, ngram_vocab_size_base: int | None = None,
                      backend: str = "auto") -> NgramHashMapping:
    """The `qwen4_exp` mapping of a llama.cpp qwen4exp GGUF file, from its `{arch}.ple.*` keys (`tables.gguf`).

    The family is rebuilt by its rules from the file's vocabulary size, n-gram size, heads, EOS id and PLE layer,
    with `seed` (the checkpoint config's; transformers' default 1234, which the released config leaves out) and
    `ngram_vocab_size_base` (default: the smallest base whose primes are the file's table sizes); the file's
    multipliers, table sizes and offsets must then equal the derived ones, so hashing is exactly the
    safetensors checkpoint's (the same identity digest) and a damaged constant is refused."""
    from ..tables.gguf import GgufFile, check_constants, ple_constants, prime_base

    f = path if isinstance(path, GgufFile) else GgufFile(path)
    c = ple_constants(f)
    lid = c["layer"] + 1  # the file's layer is 0-indexed, ple_layer_ids 1-indexed
    base = ngram_vocab_size_base or prime_base(c["head_vocab_sizes"][0])
    family = Qwen4ExpFamily(c["vocab_size"], c["ngram_size"], c["heads_per_ngram"], [lid], base, seed,
                            c["eos_token_id"])
    check_constants(f.path, {k: c[k] for k in ("multipliers", "head_vocab_sizes", "head_offsets")},
                    {"multipliers": family.multipliers[lid], "head_vocab_sizes": family.head_sizes(lid),
                     "head_offsets": family.head_offsets(lid)},
                    f"qwen4_exp's rules derive from its other keys with seed {seed}",
                    "pass seed= (the checkpoint config's) if it is not 1234, else re-convert the file")
    return NgramHashMapping.for_family(family, backend)


def serve_gguf_table(gguf, mapping: NgramHashMapping, lid: int, padded: int, backend: str, dim: int):
    """(table, pad rows) of PLE layer `lid` read in place from a qwen4exp GGUF file (`tables.gguf.open_table`:
    "ram" decodes it into RAM, "mmap" maps it, "disk" reads it by the cold tier), after checking that the file's
    hash constants are `mapping`'s. The rows past those the heads address come back as the pad rows (zeros
    beyond the file's, up to the checkpoint's `padded`)."""
    from ..tables.gguf import PLE_TABLE, GgufFile, check_constants, decode_rows, open_table, ple_constants

    f = gguf if isinstance(gguf, GgufFile) else GgufFile(gguf)
    c = ple_constants(f)
    if c["layer"] + 1 != lid:
        raise ConfigError(f"{f.path} holds the n-gram table of decoder layer {c['layer']}, this model's is at "
                          f"layer {lid - 1}: not this model's file")
    check_constants(f.path, {k: c[k] for k in ("multipliers", "head_vocab_sizes", "head_offsets")},
                    {"multipliers": mapping.layer_multipliers[lid], "head_vocab_sizes": mapping.head_sizes(lid),
                     "head_offsets": mapping.head_offsets(lid)}, "this model's config derives",
                    "use the GGUF converted from this checkpoint")
    used = int(sum(mapping.head_sizes(lid)))
    table = open_table(f, PLE_TABLE, backend, rows=used)
    if table.dim != dim:
        table.close()
        raise ConfigError(f"{f.path}: {PLE_TABLE} rows are {table.dim} wide, this model's are {dim}")
    n = f.tensors[PLE_TABLE].shape[0]
    tail = decode_rows(f.rows(PLE_TABLE)[1][used:min(n, padded)], f.tensors[PLE_TABLE].type, dim, table.dtype)
    pad_rows = torch.cat([tail, torch.zeros(max(0, padded - n), dim, dtype=table.dtype)])
    return table, pad_rows


def export_gguf(model, path, row_type: str = "Q8_0"):
    """Write a Qwen4Exp model's n-gram table (served by engram or its own) and hash constants as llama.cpp reads
    them: `per_layer_token_embd.weight` with the checkpoint's padding rows, and the `{arch}.ple.*` keys, under
    architecture "qwen4exp" (`tables.gguf.write_gguf`: streamed, atomic, with block sums). llama.cpp takes one
    PLE layer. `row_type`: F32, F16, BF16, Q8_0 or a type the gguf package can quantize."""
    from ..tables.gguf import PLE_TABLE, ple_kv, write_gguf

    mapping = hash_mapping(model.config)
    _, ples = _ple_layers(model)
    if len(ples) != 1:
        raise ConfigError(f"this model has {len(ples)} PLE layers; llama.cpp's qwen4exp GGUF holds one")
    i, ple = ples[0]
    e = ple.ple_embedding
    if isinstance(e, ServedNGramEmbedding):
        t, dim = e.mhe.table, e.mhe.embedding_dim
        n = t.num_rows + e.pad_rows.shape[0]

        def chunks():  # the served rows a block at a time, then the padding rows
            for s in range(0, t.num_rows, 1 << 16):
                yield t.gather(torch.arange(s, min(s + (1 << 16), t.num_rows)))
            yield e.pad_rows.to(t.dtype)

        entry = (PLE_TABLE, row_type, (n, dim), chunks())
    else:
        entry = (PLE_TABLE, row_type, e.ngram_embedding.weight.detach())
        dim = entry[2].shape[1]
    cfg = text_config(model.config)
    return write_gguf(path, "qwen4exp", ple_kv(mapping, i + 1, cfg.ple_conv_kernel_size, dim), [entry])
