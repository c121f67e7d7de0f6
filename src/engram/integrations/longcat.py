"""LongCat-Flash-Lite's n-gram embedding: its hash family, its tables read from a checkpoint into every tier, and
the input embedding it feeds the model.

Serving or studying the n-gram embedding needs none of the backbone: `load` reads only config.json, the
safetensors index and the shards holding `model.embed_tokens.weight` and `model.ngram_embeddings.*`.

    mapping = hash_mapping(config)                            # config.json path, dict or config object
    ids = mapping.hash(input_ids, offsets=True)[0]            # (B, T, k*(n-1)) int32 rows of the concatenated table
    mem = load("path/to/LongCat-Flash-Lite", tier="disk")      # "ram" | "mmap" | "disk"
    emb = mem.embedding(input_ids)                            # (B, T, hidden): the model's input embedding
    emb = mem.embedding(new_ids, history=last_ids)            # a chunk or a decode step after earlier ids

What was read off vLLM 0.32's `model_executor/models/longcat_flash_ngram.py` (unchanged in 0.33) and
SGLang 0.5.23's `kernels/jit/csrc/speculative/ngram_embedding.cuh` with its callers (docs/models.md says
what was checked against what):

- Layout: V = vocab_size, m = ngram_vocab_size_ratio * V, k = emb_split_num, n = emb_neighbor_num.
  Embedder e = i*k + j (n-gram order i+2, split j; i < n-1, j < k) is a table of M_e = int(m + 2e + 1)
  rows of hidden // (k*(n-1)) values; the engines concatenate the k*(n-1) tables in order of e, so a
  row id is the local id plus the sum of the sizes before it. Checkpoint keys:
  `model.ngram_embeddings.embedders.{e}.weight` (M_e, d) and `.post_projs.{e}.weight` (hidden, d).
- Ids: local id of embedder e at position t = (sum over d < i+2 of (tok[t-d] * (V^d mod M_e)) mod M_e)
  mod M_e, exact in 64-bit integers. The walk back stops at the request's start and at an EOS: tokens
  from there back add nothing (here: they read the pad x = 0, whose term is 0, as token 0's is).
- EOS as the current token (where the engines disagree): vLLM negates EOS ids in its token table and its
  kernel stops at any negative entry, the current one included, so an EOS position is an empty n-gram
  (local id 0 in every embedder); SGLang stops only when looking back (`j > 0`), so an EOS position hashes
  with the tokens before it. `eos_rule="vllm"` (the default) or `"sglang"`. With vLLM's rule an EOS id
  of 0 stops nothing (-0 is not negative); that is followed too.
- Forward (`NgramEmbedding`): the word embedding and the k*(n-1) looked-up rows each projected to hidden
  (`rows @ post_projs[e].weight.T`, no bias) are averaged: mean over the k*(n-1) + 1 vectors, at the input
  only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from ..config import ConfigError
from ..deprecation import renamed_keywords
from ..hashing import HashFamily, NgramHashMapping
from ..persist import read_json
from ..tables.base import Table
from ..tables.rows import SegmentedTable, check_tier, open_rows
from ..tokenizer import RawIds

EOS_RULES = ("vllm", "sglang")
PREFIX = "model.ngram_embeddings."
WORD_KEY = "model.embed_tokens.weight"
ROW_DTYPES = ("BF16", "F16", "F32")


# ------------------------------------------------------------------------------------------ config
def _field(cfg, *names):
    """The first of `names` the config (dict or object) sets, else None (SGLang reads oe_* as aliases)."""
    for name in names:
        v = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        if v is not None:
            return v
    return None


@dataclass(frozen=True)
class LongCatConfig:
    """The n-gram fields of a LongCat-Flash(-Lite) config and the table layout they give."""

    vocab_size: int
    ngram_vocab_size_ratio: float  # m = ratio * vocab_size (int or float, as the config has it)
    emb_split_num: int  # k
    emb_neighbor_num: int  # n: orders 2..n
    eos_token_id: int
    hidden_size: int | None = None  # needed by the forward, not by the hashing

    @property
    def num_embedders(self) -> int:
        return self.emb_split_num * (self.emb_neighbor_num - 1)

    @property
    def sizes(self) -> list[int]:
        """Rows of embedder e = i*k + j: int(m + 2e + 1), as both engines compute it."""
        m = self.ngram_vocab_size_ratio * self.vocab_size
        return [int(m + 2 * e + 1) for e in range(self.num_embedders)]

    @property
    def offsets(self) -> list[int]:
        """Row offset of each embedder in the concatenated table."""
        return [int(v) for v in np.concatenate([[0], np.cumsum(self.sizes)[:-1]])]

    @property
    def emb_dim(self) -> int:
        """Row width: hidden_size // (k*(n-1))."""
        if self.hidden_size is None:
            raise ConfigError("the LongCat config has no hidden_size: the n-gram rows' width derives from it")
        return self.hidden_size // self.num_embedders

    @classmethod
    def from_config(cls, cfg, where: str = "config") -> "LongCatConfig":
        """From a config.json dict or a config object (transformers' or SGLang's `LongcatFlashConfig`)."""
        if isinstance(cfg, LongCatConfig):
            return cfg
        ratio = _field(cfg, "ngram_vocab_size_ratio", "oe_vocab_size_ratio")
        if ratio is None:
            raise ConfigError(f"{where}: not a LongCat n-gram embedding config (no ngram_vocab_size_ratio; "
                              f"model_type {_field(cfg, 'model_type')!r})")
        vocab, k = _field(cfg, "vocab_size"), _field(cfg, "emb_split_num", "oe_split_num")
        n, eos, hidden = _field(cfg, "emb_neighbor_num", "oe_neighbor_num"), _field(cfg, "eos_token_id"), \
            _field(cfg, "hidden_size")
        for name, v, low in (("vocab_size", vocab, 1), ("emb_split_num", k, 1), ("emb_neighbor_num", n, 2)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{where}: {name} must be an integer >= {low}, got {v!r}")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
            raise ConfigError(f"{where}: ngram_vocab_size_ratio must be a positive number, got {ratio!r}")
        if isinstance(eos, (list, tuple)):
            if len(eos) != 1:
                raise ConfigError(f"{where}: eos_token_id lists {len(eos)} ids; the engines hash with one (vLLM "
                                  "reads int(eos_token_id)): set eos_token_id to the id your requests end with")
            eos = eos[0]
        if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < vocab:
            raise ConfigError(f"{where}: eos_token_id must be a token id in [0, {vocab}) (the n-gram walk stops at "
                              f"EOS), got {eos!r}")
        if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1):
            raise ConfigError(f"{where}: hidden_size must be a positive integer, got {hidden!r}")
        c = cls(vocab, ratio, k, n, eos, hidden)
        if sum(c.sizes) >= 2 ** 31 or c.sizes[0] < 2:
            raise ConfigError(f"{where}: the n-gram tables would hold {sum(c.sizes):,} rows; the engines' row ids "
                              "are int32 and every table needs >= 2 rows (check ngram_vocab_size_ratio)")
        return c


def read_config(config) -> LongCatConfig:
    """A `LongCatConfig` from a config.json path (or its folder), a dict or a config object."""
    if isinstance(config, (str, Path)):
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        return LongCatConfig.from_config(read_json(p, "config.json", "pass a LongCat checkpoint's config.json",
                                                   ConfigError), str(p))
    return LongCatConfig.from_config(config)


# ------------------------------------------------------------------------------------------ hashing
class LongCatFamily(HashFamily):
    """LongCat's n-gram ids: raw token ids; embedder e = i*k + j reads the i+2 tokens up to t, each times
    V^d mod M_e, summed mod M_e; one "layer" (id 0: the input embedding) whose heads are the embedders."""

    name = "longcat"
    index_dtype = torch.int32  # both engines' kernels write int32 ids
    own_mix = True
    formula = ("raw token ids; positions before the sequence or at/before the last EOS before t (vllm rule: also "
               "an EOS at t) read 0; embedder e = i*k + j (order i+2): row = (sum_{d<i+2} (x_{t-d} * weights[e][d]) "
               "mod head_moduli[i][j]) mod head_moduli[i][j], weights[e][d] = vocab_size^d mod head_moduli[i][j]; "
               "table row = row + head_offsets[e]")

    def __init__(self, cfg: LongCatConfig, eos_rule: str = "vllm"):
        if eos_rule not in EOS_RULES:
            raise ConfigError(f"eos_rule must be 'vllm' or 'sglang', got {eos_rule!r}")
        self.cfg, self.eos_rule = cfg, eos_rule
        self.layer_ids, self.seed = [0], 0
        self.max_ngram_size, self.n_head_per_ngram = cfg.emb_neighbor_num, cfg.emb_split_num
        self.compressed_tokenizer = RawIds(cfg.vocab_size)
        self.raw_pad_id = self.compressed_pad_id = 0  # a missing position adds 0, as token 0 does
        # vLLM: EOS ids are negated and any negative entry stops the walk, the current one included (-0 is not
        # negative: an EOS id of 0 stops nothing); SGLang: an EOS stops the walk only when looking back
        self.reset_id = None if eos_rule == "vllm" and cfg.eos_token_id == 0 else cfg.eos_token_id
        self.reset_reads_pad = eos_rule == "vllm"
        k, n, sizes = cfg.emb_split_num, cfg.emb_neighbor_num, cfg.sizes
        self.vocab_size_across_layers = {0: [sizes[i * k:(i + 1) * k] for i in range(n - 1)]}
        self.weights = np.array([[pow(cfg.vocab_size, d, M) for d in range(n)] for M in sizes], dtype=np.int64)
        self.layer_multipliers = {0: self.weights}  # (H, n): the engines' ne_weights, per embedder
        self._device_cache: dict = {}

    def mix_rows(self, windows: list[torch.Tensor]) -> torch.Tensor:
        """(1, B*T, H) int64 local ids from the n windows (B*T,) of x_{t-d} (0 beyond a boundary)."""
        dev = windows[0].device
        if str(dev) not in self._device_cache:
            self._device_cache[str(dev)] = (torch.from_numpy(self.weights).to(dev),
                                            torch.tensor(self.cfg.sizes, dtype=torch.int64, device=dev))
        W, M = self._device_cache[str(dev)]  # (H, n), (H,)
        k = self.cfg.emb_split_num
        acc = torch.zeros(len(M), windows[0].numel(), dtype=torch.int64, device=dev)  # (H, BT)
        for d, x in enumerate(windows):
            lo = max(0, d - 1) * k  # embedders of order i+2 > d: e >= (d-1)*k
            # each term below 2^62 (ids and weights below 2^31), reduced before summing: exact in int64
            acc[lo:] += torch.remainder(x[None, :] * W[lo:, d, None], M[lo:, None])
        return torch.remainder(acc, M[:, None]).T.contiguous()[None]  # (1, BT, H)

    def layers_spec(self) -> dict:
        return {"0": {"weights": self.weights.tolist(), "head_moduli": self.vocab_size_across_layers[0],
                      "head_offsets": self.head_offsets(0), "table_rows": int(sum(self.head_sizes(0))),
                      "reset_id": self.reset_id, "reset_reads_pad": self.reset_reads_pad}}

    def config_spec(self) -> dict:
        c = self.cfg
        return {"vocab_size": c.vocab_size, "ngram_vocab_size_ratio": c.ngram_vocab_size_ratio,
                "emb_split_num": c.emb_split_num, "emb_neighbor_num": c.emb_neighbor_num,
                "eos_token_id": c.eos_token_id, "eos_rule": self.eos_rule, "hidden_size": c.hidden_size,
                "max_ngram_size": self.max_ngram_size, "n_head_per_ngram": self.n_head_per_ngram,
                "layer_ids": self.layer_ids, "lookup_table_sha256": self.compressed_tokenizer.lookup_sha256,
                "compressed_pad_id": self.compressed_pad_id}

    @classmethod
    def from_spec(cls, spec: dict, tokenizer=None) -> "LongCatFamily":
        return cls(LongCatConfig.from_config(spec, "hash spec"), spec.get("eos_rule", "vllm"))


@renamed_keywords(backend="kernel")
def hash_mapping(config, eos_rule: str = "vllm", kernel: str = "auto") -> NgramHashMapping:
    """LongCat's n-gram hashing of a config (config.json path or folder, dict, `LongCatConfig` or a config object
    with `vocab_size`, `ngram_vocab_size_ratio`, `emb_split_num`, `emb_neighbor_num`, `eos_token_id`): the engine
    over `LongCatFamily`, keyed by layer 0. `hash(ids, offsets=True)[0]` -> (B, T, k*(n-1)) int32 rows of the
    concatenated table (column e = i*k + j: order i+2, split j), what vLLM's `_compute_oe_ids` returns;
    `hash_continuation(new, history, offsets=True)[0]` the rows of `new` after the ids `history` (the last n-1
    of them suffice). `eos_rule`: "vllm" (an EOS position is an empty n-gram) or "sglang" (it hashes with the
    tokens before it); see the module doc. Hashed by the torch path (no fused kernel for this mix): `kernel` "auto"
    or "torch" (`backend=`: its deprecated spelling)."""
    if kernel not in ("auto", "torch"):
        raise ConfigError(f"LongCat hashing runs on the torch path: kernel must be 'auto' or 'torch', got {kernel!r}")
    return NgramHashMapping.for_family(LongCatFamily(read_config(config), eos_rule), "torch")


# ------------------------------------------------------------------------------------------ tables and forward
class NgramEmbedding(nn.Module):
    """LongCat's input embedding: `(input_ids (B, T), hash_ids (B, T, E) or None, history) -> (B, T, hidden)`.

    mean([word(ids), rows_0 @ P_0, ..., rows_{E-1} @ P_{E-1}]) over its E + 1 vectors, as vLLM's `embed_batched`
    computes it (one bmm over the embedders, then a mean), in `dtype`. `word` (V, hidden), `proj` (E, d, hidden)
    (each `post_projs.{e}.weight` transposed), rows from `table` (the concatenated layout, offsets included).
    """

    def __init__(self, mapping: NgramHashMapping, table: Table, word: torch.Tensor, proj: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.mapping, self.table, self.dtype = mapping, table, dtype
        self.word = word  # (V, hidden), as stored (memory-mapped for the mmap and disk tiers)
        self.proj = proj.to(dtype)  # (E, d, hidden)

    def rows(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, E) rows of the concatenated table -> (B, T, E, d)."""
        if hash_ids.dtype.is_floating_point or hash_ids.dim() != 3 or hash_ids.shape[-1] != self.proj.shape[0]:
            raise ConfigError(f"hash ids must be an integer tensor (B, T, {self.proj.shape[0]}), got {hash_ids.dtype} "
                              f"{list(hash_ids.shape)}")
        flat = hash_ids.reshape(-1).long().cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.table.num_rows):
            raise ConfigError(f"hash ids must lie in [0, {self.table.num_rows}) (offsets added): got "
                              f"[{int(flat.min())}, {int(flat.max())}]")
        return self.table.lookup(flat).view(*hash_ids.shape, -1)

    def forward(self, input_ids: torch.Tensor, hash_ids: torch.Tensor | None = None, history=None) -> torch.Tensor:
        if hash_ids is None:
            hash_ids = self.mapping.hash_continuation(input_ids.cpu(), None if history is None else
                                                      torch.as_tensor(history).cpu(), offsets=True)[0]
        B, T = input_ids.shape
        E = self.proj.shape[0]
        rows = self.rows(hash_ids).reshape(B * T, E, -1).permute(1, 0, 2).to(self.dtype)  # (E, BT, d)
        word = self.word[input_ids.reshape(-1).long().cpu()].to(self.dtype)  # (BT, hidden)
        proj = torch.bmm(rows, self.proj)  # (E, BT, hidden)
        out = torch.cat([word[None], proj], dim=0).mean(dim=0)  # (BT, hidden): E + 1 vectors averaged
        return out.view(B, T, -1).to(input_ids.device)


class LongCatMemory:
    """What `load` returns: `.config` (LongCatConfig), `.mapping` (the engine of `hash_mapping`), `.table` (the
    concatenated n-gram table), `.embedding` (`NgramEmbedding`), `.tier` (`.backend`: its old name). `close()`
    releases files and threads."""

    def __init__(self, config, mapping, table, embedding, tier):
        self.config, self.mapping, self.table, self.embedding, self.tier = config, mapping, table, embedding, tier

    backend = property(lambda self: self.tier, doc="The old name of `tier`.")

    def table_bytes(self) -> int:
        return self.table.num_rows * self.table.dim * torch.empty((), dtype=self.table.dtype).element_size()

    def close(self) -> None:
        self.table.close()


@renamed_keywords(backend="tier")
def load(path, tier: str = "ram", dir=None, dtype: torch.dtype | None = None, eos_rule: str = "vllm",
         **disk_kwargs) -> LongCatMemory:
    """LongCat's n-gram embedding from a checkpoint folder, without its backbone.

    The tables are opened by `tables.open_rows`: tier "ram": the k*(n-1) tables copied into one tensor in RAM
    (the concatenated layout); "mmap": each embedder memory-mapped in place from its shard; "disk": each read in
    place by the cold tier (`DiskTable`: positioned reads, many in flight; `disk_kwargs` such as `queue_depth`).
    `dir` (mmap/disk): first copy the tables, streamed a block of rows at a time, into one file
    `dir/longcat_ngram.safetensors` (the concatenated layout, block checksums; page-aligned 4 KiB for "disk") and
    read that, each block checked on its first read (the released shards carry no sums; `disk_kwargs` then go to
    `DiskTable` or `MmapTable`, e.g. `cache_bytes`).
    The word embedding and projections are read into RAM ("ram") or
    mapped. `dtype`: what the embedding computes in; None: the config's `torch_dtype` (or `dtype`), else
    bfloat16, as vLLM chooses. Everything is checked before any table opens: keys, shapes, dtypes, shard sizes.
    """
    from .checkpoint import CheckpointTensor, weight_map

    check_tier(tier)
    d = Path(path)
    if not d.is_dir():
        raise ConfigError(f"{d}: no such checkpoint folder")
    raw = read_json(d / "config.json", "config.json", "pass a LongCat checkpoint folder", ConfigError)
    cfg = LongCatConfig.from_config(raw, str(d / "config.json"))
    if dtype is None:
        name = _field(raw, "torch_dtype", "dtype")
        dtype = getattr(torch, str(name), None) if name is not None else torch.bfloat16
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"{d / 'config.json'}: torch_dtype {name!r} is not a float dtype; pass dtype=")
    mapping = hash_mapping(cfg, eos_rule)
    wm = weight_map(d)
    E, D, H = cfg.num_embedders, cfg.emb_dim, cfg.hidden_size
    want = [(WORD_KEY, (cfg.vocab_size, H))]
    want += [(f"{PREFIX}embedders.{e}.weight", (M, D)) for e, M in enumerate(cfg.sizes)]
    want += [(f"{PREFIX}post_projs.{e}.weight", (H, D)) for e in range(E)]
    t = {}
    for key, shape in want:
        if key not in wm:
            raise ConfigError(f"{d}: the checkpoint has no {key} (not in its index); LongCat's n-gram embedding needs "
                              f"{WORD_KEY} and {PREFIX}embedders/post_projs.0..{E - 1}.weight")
        t[key] = CheckpointTensor(d, key, wm)  # (checks the shard holds it and is not truncated)
        if t[key].shape != shape or t[key].info["dtype"] not in ROW_DTYPES:
            raise ConfigError(f"{t[key].path}: {key} is {t[key].info['dtype']} {list(t[key].shape)}, the config needs "
                              f"{'/'.join(ROW_DTYPES)} {list(shape)} (vocab_size {cfg.vocab_size}, hidden_size {H}, "
                              f"k*(n-1) = {E} embedders of int(m + 2e + 1) rows)")
    rows = [t[f"{PREFIX}embedders.{e}.weight"] for e in range(E)]
    if len({r.info["dtype"] for r in rows}) != 1:
        raise ConfigError(f"{d}: the n-gram embedders are stored in several dtypes "
                          f"({sorted({r.info['dtype'] for r in rows})}); expected one")
    proj = torch.stack([t[f"{PREFIX}post_projs.{e}.weight"].load().T for e in range(E)])  # (E, d, hidden)
    word = t[WORD_KEY].load() if tier == "ram" else t[WORD_KEY].mapped()
    # the concatenated layout: one tensor in RAM; in place, a segment per embedder; with dir, one checked file
    table = open_rows(rows, tier, dir, file="longcat_ngram.safetensors", name=f"{d}: the n-gram tables",
                      metadata={"source": str(d)}, **disk_kwargs)
    return LongCatMemory(cfg, mapping, table, NgramEmbedding(mapping, table, word, proj, dtype).eval(), tier)


__all__ = ["EOS_RULES", "LongCatConfig", "LongCatFamily", "LongCatMemory", "NgramEmbedding", "SegmentedTable",
           "hash_mapping", "load", "read_config"]
