"""Engram memory adapters on pretrained `transformers` causal LMs: attach, detach, save, load.

    model = AutoModelForCausalLM.from_pretrained("path/to/qwen3")
    engram.attach(model, layer_ids=[1], tokenizer="path/to/qwen3")   # exact: same logits as before
    ... train (engram adapt; transformers.Trainer / TRL with optimizers=engram.hf_optimizers(model, args);
        or your own loop with engram.training.optim.build_optimizers on the trainable params) ...
    engram.save_adapter(model, "out/adapter")                        # only what attach added
    engram.load_adapter(AutoModelForCausalLM.from_pretrained(...), "out/adapter")
    engram.detach(model)                                             # the base, untouched

The same in PEFT's shape (`wrapper.py`, which says why a wrapper and not a tuner registered in PEFT):
`model = get_engram_model(base, EngramAdapterConfig(layer_ids=[1]))`, `model.save_pretrained(dir)`,
`EngramAdapterModel.from_pretrained(base, dir)`, `with model.disable_adapter(): ...` (the base, bit for bit).

Where the memory goes: in front of decoder layer i the residual stream becomes
`h + Engram_i(h, rows_i)`, `rows_i` looked up from layer i's table for the n-gram hash ids of the
call's tokens (compressed with the base model's own tokenizer). Two forward pre-hooks do it: one on
the module that owns the layer list (it sees `input_ids` and the KV cache: hashes once per call), one
on each chosen layer (it adds the delta). The model's code is not modified; `detach` removes both.

Exact at attach: the value rows of every layer's fused projection (`kv_proj.weight[:D]`, `kv_proj.bias[:D]`)
start at zero, so the value, the gated value, its short conv (RMSNorm(0) = 0, SiLU(0) = 0) and the delta
are exactly 0.0 and the logits equal the base's bit for bit. The tables keep their N(0, 0.02) init
(`table_init_std` of `default_options`; 1.0 gives the reference's N(0, 1)) and the keys their default init, so
the first step already moves the value rows (the gradient of a zero-initialized LoRA B, the same idea); the
tables' gradients flow from the second step on.

Decoding: the cache (`generate()`'s, or one passed in) carries Engram's state (the last N-1 ids and each
layer's short-conv inputs; `engram.cache.NgramHistory`), so cached decoding equals full recomputes.

Files: `introspect.py` (finding a base's layers, tokenizer and fingerprint), `hooks.py` (the adapter module and
its forward pre-hooks), `lifecycle.py` (attach, detach, what trains), `saving.py` (save: `save_adapter`, the
attached model's `save_pretrained`), `loading.py` (`load_adapter`, alias `from_pretrained`), `clipping.py`
(clipping the tables' sparse gradients, which `attach` enables). Trainer / TRL / accelerate's optimizer argument,
`engram.hf_optimizers`, lives with the optimizers (`engram.training.hf`: what clipping and DDP do there too).
`wrapper.py` (`EngramAdapterConfig`, `get_engram_model`, `EngramAdapterModel`: PEFT's names), `card.py` (the
`README.md` model card every saved adapter and overlay carries).
"""

from .card import CARD_FILE
from .hooks import EngramAdapter, adapter_of
from .introspect import (
                         LAYER_LISTS,
                         AdapterError,
                         base_fingerprint,
                         compressed_tokenizer,
                         default_options,
                         find_layers,
                         generation_pad_id,
                         pad_or_eos_id,
)
from .lifecycle import (
                         add_lora,
                         attach,
                         clear_rows,
                         detach,
                         freeze_base,
                         trainable_summary,
                         unfreeze,
)
from .loading import from_pretrained, load_adapter
from .saving import (
                         BASE_MODULES_FILE,
                         CONFIG_FILE,
                         FORMAT,
                         LORA_DIR,
                         SPEC_FILE,
                         WEIGHTS_FILE,
                         read_adapter_config,
                         save_adapter,
                         save_pretrained,
)
from .wrapper import EngramAdapterConfig, EngramAdapterModel, get_engram_model

__all__ = ["AdapterError", "EngramAdapter", "EngramAdapterConfig", "EngramAdapterModel", "get_engram_model",
           "adapter_of", "add_lora", "attach", "clear_rows", "base_fingerprint",
           "compressed_tokenizer", "default_options", "detach", "find_layers", "freeze_base", "from_pretrained",
           "generation_pad_id",
           "load_adapter", "pad_or_eos_id", "read_adapter_config", "save_adapter", "save_pretrained",
           "trainable_summary", "unfreeze",
           "LAYER_LISTS", "FORMAT", "CONFIG_FILE", "WEIGHTS_FILE", "BASE_MODULES_FILE", "SPEC_FILE", "LORA_DIR",
           "CARD_FILE"]
