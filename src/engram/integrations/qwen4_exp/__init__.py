"""Qwen3.8-Flash-Next (`transformers` model type `qwen4_exp`): its n-gram tables hashed by engram's kernel.

The model's `Qwen4ExpTextNGramEmbedding` is Engram's lookup with another hash family (raw ids,
SplitMix64 multipliers, consecutive primes, EOS document resets: `Qwen4ExpFamily`) and its
`Qwen4ExpTextPLELayer` is Engram's gate and conv. The installed transformers is the reference.

    mapping = hash_mapping(model.config.text_config)     # or the text config itself
    rows = mapping.hash(input_ids)                       # {ple_layer_id (1-indexed): (B, T, H)} before offsets
    model = from_pretrained(path, tier="disk", dir=d)    # the tables served by engram, in any tier

Modules: `family.py` (the hash family), `served.py` (the module standing in for transformers'), `serving.py`
(`serve_tables`, `from_pretrained`; `FOLDER_KIND`, how `engram.inference` recognises and loads such a folder,
declared in the entry-point group `engram.folder_kinds`), `checkpoint.py` (the tables' shards: float or NVFP4),
`gguf.py` (llama.cpp's qwen4exp layout: reading and writing GGUF files). The tables are opened by
`engram.tables.open_rows`.
"""

from .checkpoint import checkpoint_shards, table_rows
from .family import (
    Qwen4ExpFamily,
    consecutive_primes,
    eos_id,
    hash_mapping,
    splitmix64,
    splitmix_multipliers,
    text_config,
    transformers_hashing,
)
from .gguf import PLE_KEYS, PLE_TABLE, export_gguf, gguf_hash_mapping, ple_constants, ple_kv, serve_gguf_table
from .served import ServedNGramEmbedding
from .serving import FOLDER_KIND, from_pretrained, is_model_folder, load_folder, serve_tables

__all__ = ["FOLDER_KIND", "PLE_KEYS", "PLE_TABLE", "Qwen4ExpFamily", "ServedNGramEmbedding", "checkpoint_shards",
           "consecutive_primes", "eos_id", "export_gguf", "from_pretrained", "gguf_hash_mapping", "hash_mapping",
           "is_model_folder", "load_folder", "ple_constants", "ple_kv", "serve_gguf_table", "serve_tables",
           "splitmix64", "splitmix_multipliers", "table_rows", "text_config", "transformers_hashing"]
