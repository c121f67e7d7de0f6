"""Tiny saved bases (Llama, Qwen3, Mistral, Qwen2) with a trained-looking Engram adapter, for the vLLM adapter tests.

Not a test module (tests import it as `from pairs import ...`). The bases fit vLLM's CPU attention (head_dim 32,
float32); the adapter's value projection, conv and table rows are randomized before saving: a fresh adapter's
delta is exactly 0 and a test of it would prove nothing.
"""

from pathlib import Path

import torch
from bases import tale_tokenizer

SHAPE = dict(vocab_size=400, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
             num_hidden_layers=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=1,
             initializer_range=0.3)
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
           "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "head_dim": 32}),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {})}
ENGRAM = dict(engram_vocab_size=[1009, 1013], n_embed_per_ngram=16, n_head_per_ngram=2, conv_zero_init=False)


def save_base(folder: Path, kind: str = "llama", seed: int = 0) -> Path:
    """A tiny random `kind` base saved in float32 with its tokenizer (tokenizer.json, tokenizer_config.json)."""
    import transformers

    from engram.tokenizer import write_tokenizer_files

    cfg_cls, model_cls, extra = CLASSES[kind]
    cfg = getattr(transformers, cfg_cls)(**SHAPE, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    folder = Path(folder)
    model.save_pretrained(folder)
    tok = folder.parent / "tale-tokenizer.json"
    if not tok.is_file():
        tale_tokenizer(tok)
    write_tokenizer_files(folder, tok)
    return folder


def save_adapter_for(base: Path, out: Path, layer: int = 1, seed: int = 0, lora: bool = False,
                     unfreeze=()) -> Path:
    """An adapter on `base` at `layer` with random value rows, conv and table (so its delta is not 0), saved;
    `unfreeze`: base modules saved with it (`engram.adapters.unfreeze`), their weights moved too."""
    import engram
    from engram.adapters import add_lora, save_adapter
    from engram.adapters import unfreeze as unfreeze_modules
    from engram.inference import load_base

    model, tok = load_base(base)
    engram.attach(model, [layer], tokenizer=tok, verbose=False, **ENGRAM)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.engram_adapter.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "multi_head_embedding" in name else 0.3))
        for name in unfreeze_modules(model, list(unfreeze)) if unfreeze else ():
            for p in model.get_submodule(name).parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    if lora:
        model = add_lora(model, rank=2)
    save_adapter(model, out)
    return Path(out)


# the Qwen3 pair's adapter also carries base modules (the final norm, a projection vLLM fuses into qkv_proj)
UNFROZEN = {"qwen3": ("model.norm", "model.layers.0.self_attn.k_proj")}


def base_and_adapter(root: Path, kind: str = "llama") -> tuple[Path, Path]:
    root = Path(root)
    base = save_base(root / f"{kind}-base", kind)
    return base, save_adapter_for(base, root / f"{kind}-adapter", unfreeze=UNFROZEN.get(kind, ()))
