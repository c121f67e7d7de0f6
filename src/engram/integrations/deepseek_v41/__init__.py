"""DeepSeek-V4.1's released Engram: its hash family, FP8 rows with ue8m0 scales, and its conv-less module.

Studying or serving DeepSeek's memory needs none of its backbone: `load` reads only the Engram parts of
a checkpoint folder (config.json, tokenizer.json, the safetensors index and the shards it names).

    mem = load("path/to/DeepSeek-V4.1-Flash", tier="disk")         # "ram" | "mmap" | "disk"
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

Modules: `family.py` (config and hash family), `module.py` (the layer), `checkpoint.py` (`load`: a checkpoint
folder's Engram parts, rows opened by `engram.tables.open_rows`), `gguf.py` (llama.cpp's deepseek41 layout).
"""

from .checkpoint import NEEDS, V41Memory, load
from .family import CONFIG_FIELDS, DeepSeekV41Family, V41Config, hash_mapping
from .gguf import V41_KEYS, V41_TABLE, V41_TENSORS, engram_kv, export_gguf, load_gguf, v41_constants
from .module import V41Engram, dequantize_linear

__all__ = ["CONFIG_FIELDS", "DeepSeekV41Family", "NEEDS", "V41Config", "V41Engram", "V41Memory", "V41_KEYS",
           "V41_TABLE", "V41_TENSORS", "dequantize_linear", "engram_kv", "export_gguf", "hash_mapping", "load",
           "load_gguf", "v41_constants"]
