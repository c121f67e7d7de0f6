"""`EngramLMConfig`: the Hugging Face config of engram's language model (sizes + the embedded `EngramConfig`)."""

from __future__ import annotations

from transformers import PretrainedConfig

from .config import BackBoneConfig, ConfigError, EngramConfig


class EngramLMConfig(PretrainedConfig):
    """Sizes of the host model plus the embedded `EngramConfig` (as a dict under `engram`).

    ffn: "mlp" (SwiGLU) or "moe" (shared + routed top-k experts, auxiliary-loss-free balancing).
    The shared experts form one SwiGLU of width `shared_intermediate_size` (default
    `moe_intermediate_size * n_shared_experts`; the allocation experiment trims it to hold the
    activated parameters fixed).
    hc_mult: residual streams (1 = plain residual, >1 = mHC). use_engram: False builds the same
    backbone without Engram (the iso-FLOP baseline).
    """

    model_type = "engram"

    def __init__(self, vocab_size=129280, hidden_size=1024, num_hidden_layers=30, num_attention_heads=16,
                 num_key_value_heads=None, intermediate_size=None, ffn="mlp", n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=2, moe_intermediate_size=None, moe_bias_update_speed=1e-3,
                 shared_intermediate_size=None, hc_mult=4,
                 sinkhorn_iters=20, rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 use_engram=True, engram=None, tie_word_embeddings=False, pad_token_id=2, **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.ffn, self.n_routed_experts, self.n_shared_experts = ffn, n_routed_experts, n_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size or hidden_size
        self.moe_bias_update_speed = moe_bias_update_speed
        self.shared_intermediate_size = (self.moe_intermediate_size * n_shared_experts
                                         if shared_intermediate_size is None else shared_intermediate_size)
        self.hc_mult, self.sinkhorn_iters = hc_mult, sinkhorn_iters
        self.rope_theta, self.max_position_embeddings, self.rms_norm_eps = (rope_theta, max_position_embeddings,
                                                                            rms_norm_eps)
        self.use_engram = use_engram
        ecfg = engram if isinstance(engram, EngramConfig) else EngramConfig.from_dict(engram or {})
        self.engram = ecfg.to_dict()
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate_sizes()

    @property
    def engram_config(self) -> EngramConfig:
        return EngramConfig.from_dict(self.engram)

    @property
    def backbone_config(self) -> BackBoneConfig:
        return BackBoneConfig(hidden_size=self.hidden_size, hc_mult=self.hc_mult, vocab_size=self.vocab_size,
                              num_layers=self.num_hidden_layers)

    def validate_sizes(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must divide "
                              f"hidden_size ({self.hidden_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                              f"({self.num_attention_heads})")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ConfigError("head dim (hidden_size // num_attention_heads) must be even for RoPE")
        if self.ffn not in ("mlp", "moe"):
            raise ConfigError(f"ffn must be 'mlp' or 'moe', got {self.ffn!r}")
        if self.ffn == "moe" and not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, n_routed_experts="
                              f"{self.n_routed_experts}]")
        bad = [i for i in self.engram_config.layer_ids if i >= self.num_hidden_layers]
        if self.use_engram and bad:
            raise ConfigError(f"engram layer_ids {bad} are outside [0, {self.num_hidden_layers}) "
                              f"(num_hidden_layers={self.num_hidden_layers}); ids are 0-based block indices")
