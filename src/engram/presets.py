"""Model presets: functions returning an `EngramLMConfig` (needs `engram[hf]`)."""

from __future__ import annotations


def tiny(**overrides):
    """Tests: hidden 32, 2 layers, 4 streams, small tables; a forward takes milliseconds on CPU."""
    from .model import EngramLMConfig

    kw = dict(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, hc_mult=4, max_position_embeddings=256,
              engram=dict(engram_vocab_size=[1009, 1013], n_embed_per_ngram=16, n_head_per_ngram=2, layer_ids=[1],
                          conv_zero_init=True))
    kw.update(overrides)
    return EngramLMConfig(**kw)


def demo(**overrides):
    """The tutorial's config with real blocks: 30 layers, hidden 1024, 4 mHC streams, dense SwiGLU FFN,
    Engram at [1, 15] with 2 x 10.3M-row tables stored in bfloat16."""
    from .model import EngramLMConfig

    kw = dict(vocab_size=129280, hidden_size=1024, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=4,
              intermediate_size=2048, hc_mult=4, ffn="mlp", engram=dict(table_dtype="bfloat16"))
    kw.update(overrides)
    return EngramLMConfig(**kw)
