"""Presets: named model configs (functions returning an `EngramLMConfig`, needs `engram-torch[hf]`) with their
training settings, in one registry (`PRESETS`) that the CLI, the trainer and the experiments read."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..config import ConfigError, TrainConfig

# What `engram adapt --method` trains on a pretrained base (training/adapt.py).
ADAPT_METHODS = ("engram", "lora", "lora+engram", "full")


def tiny(**overrides):
    """Tests: hidden 32, 2 layers, 4 streams, small tables; a forward takes milliseconds on CPU."""
    from ..model import EngramLMConfig

    kw = dict(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, hc_mult=4, max_position_embeddings=256,
              engram=dict(engram_vocab_size=[1009, 1013], n_embed_per_ngram=16, n_head_per_ngram=2, layer_ids=[1],
                          conv_zero_init=True))
    kw.update(overrides)
    return EngramLMConfig(**kw)


def demo(**overrides):
    """The tutorial's config with real blocks: 30 layers, hidden 1024, 4 mHC streams, dense SwiGLU FFN,
    Engram at [1, 15] with 2 x 10.3M-row tables stored in bfloat16."""
    from ..model import EngramLMConfig

    kw = dict(vocab_size=129280, hidden_size=1024, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=4,
              intermediate_size=2048, hc_mult=4, ffn="mlp", engram=dict(table_dtype="bfloat16"))
    kw.update(overrides)
    return EngramLMConfig(**kw)


# ------------------------------------------------------------------------------------ training presets
CPU_SMALL_ENGRAM = dict(engram_vocab_size=[65536, 65536], max_ngram_size=3, n_embed_per_ngram=128, n_head_per_ngram=4,
                        layer_ids=[1], pad_id=1)  # cpu-small's table, with or without the short conv


def cpu_small(**overrides):
    """~10 minutes on 2 CPU cores: hidden 256, 4 layers, SwiGLU 768, plain residual (mHC costs ~+80% step
    time in eager PyTorch on a CPU at this size: `benchmarks/bench_backbone.py`), one Engram layer at
    block 1 with 2 orders x 4 heads x ~65k rows x 32 dims (16.8M table parameters), conv zero-init."""
    from ..model import EngramLMConfig

    kw = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=768, hc_mult=1, max_position_embeddings=1024, pad_token_id=1,
              engram=dict(CPU_SMALL_ENGRAM, conv_zero_init=True))
    kw.update(overrides)
    return EngramLMConfig(**kw)


def exp(**overrides):
    """Evidence experiments (`engram experiment`): hidden 128, 4 layers, plain residual, one Engram
    layer at block 1 with 2 orders x 4 heads x ~20k rows x 16 dims; ~1-2 minutes per run on 2 cores."""
    from ..model import EngramLMConfig

    kw = dict(vocab_size=4096, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=384, hc_mult=1, max_position_embeddings=512, pad_token_id=1,
              engram=dict(engram_vocab_size=[20011, 20011], max_ngram_size=3, n_embed_per_ngram=64,
                          n_head_per_ngram=4, layer_ids=[1], pad_id=1, conv_zero_init=True))
    kw.update(overrides)
    return EngramLMConfig(**kw)


def cpu_small_v41(**overrides):
    """cpu-small with DeepSeek-V4.1's Engram design: no short conv (the gate is the reference's, as V4.1's);
    serve its tables as V4.1 stores them with `--table-format fp8_ue8m0` (its 32-wide rows fit the blocks)."""
    kw = dict(engram=dict(CPU_SMALL_ENGRAM, use_short_conv=False))
    kw.update(overrides)
    return cpu_small(**kw)


@dataclass(frozen=True)
class Preset:
    """A named configuration: the model (`model(**overrides) -> EngramLMConfig`) and, for trainable
    presets, the training settings (`TrainConfig`)."""

    name: str
    model: Callable
    train: TrainConfig | None
    summary: str


PRESET_CPU_SMALL_TRAIN = TrainConfig(tokenizer="bpe:8192", seq_len=256, batch_size=8, max_steps=800, lr=2e-3,
                                     warmup_steps=80, eval_max_windows=128, ckpt_every=200)

# The one list of presets: the CLI, the trainer and the experiments read it.
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("tiny", tiny, TrainConfig(tokenizer="bpe:512", seq_len=32, batch_size=4, max_steps=20, lr=3e-3,
                                     warmup_steps=2, eval_every=5, eval_max_windows=4, ckpt_every=5),
           "tests: hidden 32, 2 layers, 20 steps in seconds"),
    Preset("exp", exp, TrainConfig(tokenizer="bpe:4096", seq_len=128, batch_size=8, max_steps=500, lr=3e-3,
                                   warmup_steps=40, eval_max_windows=96, ckpt_every=250),
           "evidence experiments: hidden 128, 4 layers, ~1-2 min per run"),
    Preset("cpu-small", cpu_small, PRESET_CPU_SMALL_TRAIN,
           "hidden 256, 4 layers, 16.8M table params, ~10 min on 2 cores"),
    Preset("cpu-small-v41", cpu_small_v41, PRESET_CPU_SMALL_TRAIN,
           "cpu-small with DeepSeek-V4.1's design: no short conv; serve with --table-format fp8_ue8m0"),
    Preset("demo", demo, None, "the tutorial's 30-layer demo model (not trainable on a CPU)"),
)}
TRAIN_PRESETS = tuple(name for name, p in PRESETS.items() if p.train is not None)


def get_preset(name: str, trainable: bool = True) -> Preset:
    """The preset `name`; `trainable=True` also requires training settings."""
    names = TRAIN_PRESETS if trainable else tuple(PRESETS)
    if name not in names:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(names)}")
    return PRESETS[name]


def train_config(name: str, overrides: dict | None = None, max_steps: int | None = None,
                 world: int = 1) -> TrainConfig:
    """The validated training settings of a run: preset `name`'s, then `overrides`, then `max_steps`.

    `world` > 1 also checks what data-parallel runs need (the batch divides over the ranks).
    """
    unknown = set(overrides or {}) - {f.name for f in dataclasses.fields(TrainConfig)}
    if unknown:
        raise ConfigError(f"unknown training settings {sorted(unknown)}")
    tcfg = dataclasses.replace(get_preset(name).train, **(overrides or {}))
    if max_steps is not None:
        tcfg = dataclasses.replace(tcfg, max_steps=max_steps)
    tcfg.validate()
    if world > 1 and tcfg.batch_size % world:
        raise ConfigError(f"batch_size {tcfg.batch_size} does not divide by --nproc {world}; "
                          f"use --set batch_size=N with N a multiple of {world}")
    return tcfg


def _engram_param_count(cfg) -> int:
    """Parameters an Engram-enabled config spends on Engram, counted on a meta-device model (no memory)."""
    import torch

    from ..model import EngramForCausalLM

    with torch.device("meta"):
        model = EngramForCausalLM(cfg)
    return sum(p.numel() for name, p in model.named_parameters() if ".engram." in name)


BASELINES = ("iso-flop", "iso-param")  # what `--baseline` compares an Engram model with


def model_for(name: str, vocab_size: int, pad_id: int, tokenizer_file: str, use_engram: bool = True,
              baseline: str | None = None, overrides: dict | None = None):
    """Model config of a training preset for a given tokenizer.

    baseline=None/"iso-flop": the same backbone (`use_engram=False` removes Engram: iso-FLOP).
    baseline="iso-param": no Engram, and its parameter budget moved into a wider SwiGLU FFN.
    """
    preset_fn = get_preset(name).model
    overrides = dict(overrides or {})
    engram_over = overrides.pop("engram", {})

    def base(**kw):
        return preset_fn(**{**overrides, **kw})

    proto = base()
    engram = {**proto.engram, **engram_over, "tokenizer_name_or_path": str(tokenizer_file), "pad_id": pad_id}
    cfg = base(vocab_size=vocab_size, pad_token_id=pad_id, engram=engram, use_engram=use_engram)
    if baseline in (None, "iso-flop"):
        return cfg
    if baseline not in BASELINES:
        raise ConfigError(f"--baseline must be 'iso-flop' or 'iso-param', got {baseline!r}")
    extra = _engram_param_count(base(vocab_size=vocab_size, pad_token_id=pad_id, engram=engram))
    per_unit = 3 * cfg.hidden_size * cfg.num_hidden_layers  # gate, up and down rows per extra FFN unit
    return base(vocab_size=vocab_size, pad_token_id=pad_id, engram=engram, use_engram=False,
                intermediate_size=cfg.intermediate_size + round(extra / per_unit))
