"""The tiny random transformers bases the tests share, and the text their tokenizers are trained on.

Not a test module: tests import it as `from bases import ...` (pytest puts tests/ on sys.path, as for conftest).
transformers is imported only when a base is built, so importing this needs nothing beyond torch.
"""

import torch

TALE = [f"The quick brown fox jumps over the lazy dog, line {i} of the tale, said the king." for i in range(300)]


def tale_tokenizer(path, vocab=400):
    """A byte-level BPE tokenizer trained on TALE, written to `path` (a tokenizer.json); returns its path."""
    from engram.tokenizer import train_bpe

    return train_bpe(TALE, vocab, path, progress=False)


# kind -> (config class, model class, the config's shape beyond vocab and hidden size)
_KINDS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=128)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_head=4, n_positions=128)),
}
# initializer_range 0.3: a random frozen lm_head with HF's 0.02 can barely move the logits whatever the hidden
_IDS_AND_INIT = dict(bos_token_id=0, eos_token_id=0, pad_token_id=1, initializer_range=0.3)


def tiny_base(kind="llama", vocab=400, hidden=32, seed=0, **config):
    """A tiny random `kind` ("llama" | "qwen3" | "gpt2") causal LM: 2 layers, 4 heads, BOS = EOS = 0, pad 1,
    initializer_range 0.3; `config` overrides any config field. Drawn after `torch.manual_seed(seed)` (`seed=None`:
    from the global generator as it stands). In training mode, as transformers builds it."""
    import transformers

    config_cls, model_cls, shape = _KINDS[kind]
    size = {"n_embd" if kind == "gpt2" else "hidden_size": hidden}
    cfg = getattr(transformers, config_cls)(**{**shape, **size, "vocab_size": vocab, **_IDS_AND_INIT, **config})
    if seed is not None:
        torch.manual_seed(seed)
    return getattr(transformers, model_cls)(cfg)


# ------------------------------------------------------------------------------------------ qwen4_exp
# (callers skip first when the installed transformers has no qwen4_exp)
def qwen4_config(**kw):
    """A small Qwen4ExpTextConfig (4 layers, PLE tables on layers 1 and 3, EOS 7); `kw` overrides any field."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    base = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=4, ple_layer_ids=[1, 3], heads_per_ngram=2,
                ple_embed_dim=32, layer_types=["linear_attention"] * 4, eos_token_id=7)
    return Qwen4ExpTextConfig(**{**base, **kw})


def ids_with_eos(cfg, B, T, seed, eos_every=9):
    """(B, T) random ids under `cfg.vocab_size`, about one in `eos_every` of them `cfg.eos_token_id`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    ids[torch.rand(B, T, generator=g) < 1 / eos_every] = cfg.eos_token_id  # documents of random lengths
    ids[:, 0] = cfg.eos_token_id if seed % 2 else ids[:, 0]
    return ids


def tiny_qwen4(seed=0, **kw):
    """A tiny random Qwen4ExpForCausalLM (3 layers, MoE, the hashing of qwen4_config), in eval mode."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

    cfg = qwen4_config(**{**dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 ple_layer_ids=[1, 3],
                                 layer_types=["linear_attention", "full_attention", "linear_attention"],
                                 ngram_vocab_size_base=5003, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                                 linear_value_head_dim=16, hc_lowrank=8, split_ngram_parts=4, indexer_n_heads=2,
                                 indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=64, indexer_compress_ratio=4),
                          **kw})
    torch.manual_seed(seed)
    return Qwen4ExpForCausalLM(cfg).eval()
