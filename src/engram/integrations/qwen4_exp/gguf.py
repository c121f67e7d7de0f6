"""llama.cpp's qwen4exp GGUF layout: the n-gram table `per_layer_token_embd.weight` and its hash constants under
`{arch}.ple.*` (key names read off llama.cpp's sources, see docs/models.md; llama.cpp reads one PLE layer), read
(`gguf_hash_mapping`, `serve_gguf_table`) and written (`export_gguf`) through the container `tables.gguf`."""

from __future__ import annotations

import numpy as np
import torch

from ...config import ConfigError
from ...deprecation import renamed_keywords
from ...hashing import NgramHashMapping
from ...tables.gguf import (
    FIX,
    GgufError,
    GgufFile,
    check_constants,
    decode_rows,
    open_table,
    prime_base,
    u64s,
    write_gguf,
)
from .family import Qwen4ExpFamily, hash_mapping, text_config
from .served import ServedNGramEmbedding, _ple_layers

# llama.cpp's key names (src/llama-arch.cpp, gguf-py/gguf/constants.py of the llama.cpp that llama-cpp-python
# 0.3.36 vendors). `{arch}` is general.architecture.
PLE_TABLE = "per_layer_token_embd.weight"
PLE_KEYS = {k: "{arch}.ple." + k for k in ("layers", "ngram_size", "heads_per_ngram", "conv_kernel",
                                            "layer_multipliers", "head_offsets", "head_vocab_sizes",
                                            "eos_token_id", "image_token_id")}
PLE_KEYS["row_dim"] = "{arch}.embedding_length_per_layer_input"
VOCAB_KEY = "{arch}.vocab_size"


def ple_constants(f: GgufFile) -> dict:
    """qwen4exp's PLE keys: {layer (0-indexed decoder layer), ngram_size, heads_per_ngram, conv_kernel,
    eos_token_id, multipliers [ngram_size], head_offsets [H], head_vocab_sizes [H], vocab_size, row_dim}."""
    layers = [int(x) for x in f.key(PLE_KEYS["layers"])]
    if len(layers) != 1:
        raise GgufError(f"{f.path}: {PLE_KEYS['layers'].format(arch=f.arch)} lists {len(layers)} layers; llama.cpp's "
                        "qwen4exp (and this reader) take exactly one PLE layer")
    c = {"layer": layers[0]}
    for k in ("ngram_size", "heads_per_ngram", "conv_kernel", "eos_token_id"):
        c[k] = int(f.key(PLE_KEYS[k]))
    H = (c["ngram_size"] - 1) * c["heads_per_ngram"]
    for k, n in (("layer_multipliers", c["ngram_size"]), ("head_offsets", H), ("head_vocab_sizes", H)):
        v = np.asarray(f.key(PLE_KEYS[k]))
        if v.ndim != 1 or len(v) != n or not np.issubdtype(v.dtype, np.integer):
            raise GgufError(f"{f.path}: {PLE_KEYS[k].format(arch=f.arch)} must be {n} integers (ngram_size "
                            f"{c['ngram_size']}, heads_per_ngram {c['heads_per_ngram']}); {FIX}")
        c[k] = [int(x) for x in v]
    c["multipliers"] = c.pop("layer_multipliers")
    c["vocab_size"] = _vocab_size(f)
    c["row_dim"] = int(f.key(PLE_KEYS["row_dim"], required=False) or f.tensor(PLE_TABLE).shape[1])
    return c


def ple_kv(mapping, layer_id: int, conv_kernel: int, row_dim: int) -> dict:
    """The `{arch}.ple.*` metadata of PLE layer `layer_id` (1-indexed) of a qwen4_exp `mapping`, typed as llama.cpp's
    converter writes them (`gguf_writer.add_ple_*`): the layer 0-indexed, u32 sizes, u64 constants."""
    lid = int(layer_id)
    kv = {PLE_KEYS["layers"]: ("ARRAY[INT32]", [lid - 1]),
          PLE_KEYS["ngram_size"]: ("UINT32", mapping.max_ngram_size),
          PLE_KEYS["heads_per_ngram"]: ("UINT32", mapping.n_head_per_ngram),
          PLE_KEYS["conv_kernel"]: ("UINT32", int(conv_kernel)),
          PLE_KEYS["eos_token_id"]: ("UINT32", int(mapping.reset_id)),
          PLE_KEYS["row_dim"]: ("UINT32", int(row_dim)),
          PLE_KEYS["layer_multipliers"]: u64s(mapping.layer_multipliers[lid]),
          PLE_KEYS["head_offsets"]: u64s(mapping.head_offsets(lid)),
          PLE_KEYS["head_vocab_sizes"]: u64s(mapping.head_sizes(lid)),
          VOCAB_KEY: ("UINT32", int(mapping.raw_vocab_size))}
    return kv


def _vocab_size(f: GgufFile) -> int:
    v = f.key(VOCAB_KEY, required=False)
    if v is None:
        toks = f.meta.get("tokenizer.ggml.tokens")
        if toks is None:
            raise GgufError(f"{f.path} has neither {VOCAB_KEY.format(arch=f.arch)!r} nor tokenizer.ggml.tokens: the "
                            f"vocabulary size (which the hash multipliers derive from) is unknown; {FIX}")
        v = len(toks)
    return int(v)



@renamed_keywords(backend="kernel")
def gguf_hash_mapping(path, seed: int = 1234, ngram_vocab_size_base: int | None = None,
                      kernel: str = "auto") -> NgramHashMapping:
    """The `qwen4_exp` mapping of a llama.cpp qwen4exp GGUF file, from its `{arch}.ple.*` keys (`tables.gguf`).

    The family is rebuilt by its rules from the file's vocabulary size, n-gram size, heads, EOS id and PLE layer,
    with `seed` (the checkpoint config's; transformers' default 1234, which the released config leaves out) and
    `ngram_vocab_size_base` (default: the smallest base whose primes are the file's table sizes); the file's
    multipliers, table sizes and offsets must then equal the derived ones, so hashing is exactly the
    safetensors checkpoint's (the same identity digest) and a damaged constant is refused. `kernel`: as
    `NgramHashMapping`'s (`backend=`: its deprecated spelling)."""
    f = path if isinstance(path, GgufFile) else GgufFile(path)
    c = ple_constants(f)
    lid = c["layer"] + 1  # the file's layer is 0-indexed, ple_layer_ids 1-indexed
    base = ngram_vocab_size_base or prime_base(c["head_vocab_sizes"][0])
    family = Qwen4ExpFamily(c["vocab_size"], c["ngram_size"], c["heads_per_ngram"], [lid], base, seed,
                            c["eos_token_id"])
    check_constants(f.path, {k: c[k] for k in ("multipliers", "head_vocab_sizes", "head_offsets")},
                    {"multipliers": family.layer_multipliers[lid], "head_vocab_sizes": family.head_sizes(lid),
                     "head_offsets": family.head_offsets(lid)},
                    f"qwen4_exp's rules derive from its other keys with seed {seed}",
                    "pass seed= (the checkpoint config's) if it is not 1234, else re-convert the file")
    return NgramHashMapping.for_family(family, kernel)


def serve_gguf_table(gguf, mapping: NgramHashMapping, lid: int, padded: int, tier: str, dim: int):
    """(table, pad rows) of PLE layer `lid` read in place from a qwen4exp GGUF file (`tables.gguf.open_table`:
    "ram" decodes it into RAM, "mmap" maps it, "disk" reads it by the cold tier), after checking that the file's
    hash constants are `mapping`'s. The rows past those the heads address come back as the pad rows (zeros
    beyond the file's, up to the checkpoint's `padded`)."""
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
    table = open_table(f, PLE_TABLE, tier, rows=used)
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
