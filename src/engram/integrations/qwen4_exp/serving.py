"""Serving a loaded Qwen4Exp model's n-gram tables from engram (`serve_tables`, `from_pretrained`): engram's kernel
hashes, a table opened by `tables.open_rows` holds the rows, in any tier."""

from __future__ import annotations

import torch.nn as nn

from ...config import ConfigError
from ...deprecation import renamed_keywords
from ...inference import FolderKind
from ...persist import read_json
from .family import hash_mapping, text_config
from .served import ServedNGramEmbedding, _ple_layers


@renamed_keywords(backend="tier")
def serve_tables(model, tier: str = "ram", dir=None, cache_mb: float = 0.0, prefetch: bool = True,
                 checkpoint=None, gguf=None):
    """Serve a loaded Qwen4Exp model's n-gram tables from engram: our kernel hashes, an engram tier holds the rows.

    The rows are opened by `tables.open_rows`: tier "ram": the table tensor is used where it is (no copy);
    "mmap": each table is written, a block of rows at a time, to `dir/engram_table_L{ple layer}.safetensors` and
    memory-mapped (hot-row cache of `cache_mb`), and the model's copy is freed; "disk": written the same way
    (page-aligned, 4 KiB block sums) and read by the cold tier, `DiskTable` (many positioned reads in flight,
    each block checked on its first read; for tables colder than the page cache). `prefetch`: every forward
    hashes and gathers on a thread while the layers before the first PLE run. Prefill logits and cached
    `generate()` equal transformers' own; `save_pretrained` writes `ngram_embedding.weight` back, so the saved
    model loads in plain transformers. `checkpoint`: take the rows from that checkpoint's `split_ngram_parts`
    shards, one shard in RAM at a time, instead of from the model's tensor (which may then be empty: see
    `from_pretrained`). `gguf`: read the rows in place from a llama.cpp qwen4exp GGUF file's
    `per_layer_token_embd` instead (`serve_gguf_table`).
    Returns the model.
    """
    import math

    from ...tables.rows import check_tier, open_rows
    from .checkpoint import table_rows
    from .gguf import serve_gguf_table

    check_tier(tier, needs_dir=dir is None and gguf is None, where="serve_tables")
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
            table, pad_rows = serve_gguf_table(gguf, mapping, lid, padded, tier, dim)
        else:
            if checkpoint is None:  # the tensor transformers loaded (no copy in RAM)
                if w.shape[0] != padded:
                    raise ConfigError(f"layer {i}: the model's n-gram table has {w.shape[0]:,} rows, its config "
                                      f"needs {padded:,} (loaded without its table? pass checkpoint=)")
                source, codec, pad_rows = w[:used], None, w[used:].clone()
            else:  # its shards, a shard at a time: float rows, or NVFP4 rows kept packed in any tier
                source, codec, pad_rows = table_rows(checkpoint, i, padded, used, dim, cfg.split_ngram_parts, w.dtype)
            table = open_rows(source, tier, dir, codec=codec, dtype=w.dtype, name=f"layer {i}",
                              file=f"engram_table_L{lid}{'.nvfp4' if codec else ''}.safetensors",
                              metadata={"layer": str(lid), **({"source": str(checkpoint)} if checkpoint else {})},
                              cache_bytes=int(cache_mb * 2**20))
        served[lid] = ple.ple_embedding = ServedNGramEmbedding(orig, mapping, lid, table, pad_rows)
        del orig  # (mmap: the model's copy of the table is released here)
    if prefetch:
        _attach_prefetch(owner, served, mapping)
    return model


def _attach_prefetch(owner, served: dict, mapping) -> None:
    """A pre-hook on the text model: hash and gather every served table's rows on a thread for this call."""
    from ...tables.prefetch import Prefetcher

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


@renamed_keywords(backend="tier")
def load_folder(path, tier: str = "ram", dir=None):
    """(model, tokenizer) of a Qwen4Exp model folder: `from_pretrained` (tables served by engram) and the folder's
    tokenizer.json. What `engram serve PATH` and `engram edit --checkpoint PATH` load for such a folder (its
    `FOLDER_KIND`)."""
    from pathlib import Path

    from ...tokenizer import load_tokenizer

    return from_pretrained(path, tier, dir), load_tokenizer(Path(path) / "tokenizer.json")


# the folder kind `engram.inference` finds through the entry-point group `engram.folder_kinds` (pyproject.toml)
FOLDER_KIND = FolderKind("a Qwen4Exp model folder (config.json model_type qwen4_exp), its n-gram tables served by "
                         "engram", is_model_folder, load_folder)


@renamed_keywords(backend="tier")
def from_pretrained(path, tier: str = "mmap", dir=None, cache_mb: float = 0.0, prefetch: bool = True, gguf=None,
                    **kwargs):
    """Load a Qwen4Exp checkpoint with its n-gram tables served by engram, never holding a whole table in RAM
    (tier "mmap"): the backbone loads through transformers with the table left out (its modules get an
    empty table and its `split_ngram_parts` shards are skipped), then `serve_tables(..., checkpoint=path)`
    streams each table into `dir`, one shard at a time. `gguf`: the table is read in place from that llama.cpp
    GGUF file instead (its shards in `path` are not read). `kwargs` go to transformers' `from_pretrained`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mq

    if tier in ("mmap", "disk") and dir is None and gguf is None:
        raise ConfigError(f"from_pretrained(tier={tier!r}) needs dir= for the table files")
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
    return serve_tables(model, tier=tier, dir=dir, cache_mb=cache_mb, prefetch=prefetch,
                        checkpoint=None if gguf is not None else path, gguf=gguf)
