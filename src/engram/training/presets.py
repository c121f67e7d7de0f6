"""Presets: named model configs (functions returning an `EngramLMConfig`, needs `engram-torch[hf]`) with their
training settings, in one registry (`PRESETS`) that the CLI, the trainer and the experiments read.

A run's configuration is a `Job`: a preset (the named starting point), the model fields that override its model
and the training settings that override its `TrainConfig`. `resolve_job` builds one from `engram train --config
FILE` (JSON or TOML: `preset`, `[model]`, `[model.engram]`, `[train]`), `--preset` and `--set` (preset < file <
--set), and checks every key, type and value before any data is read.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, parse_bool
from .config import RENAMED_SETTINGS, TrainConfig, current_settings

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
    overrides = current_settings(overrides or {})  # (old spellings: table_backend=param is table_mode=ram)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(TrainConfig)}
    if unknown:
        raise ConfigError(f"unknown training settings {sorted(unknown)}")
    tcfg = dataclasses.replace(get_preset(name).train, **overrides)
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


def _model_builder(name: str, overrides: dict | None):
    """(base, engram): `base(**kw)` builds preset `name`'s model with `overrides` (EngramLMConfig arguments), then
    `kw`; `engram` is the preset's Engram fields with `overrides["engram"]` merged over them."""
    preset_fn = get_preset(name).model
    overrides = dict(overrides or {})
    engram_over = overrides.pop("engram", {})

    def base(**kw):
        return preset_fn(**{**overrides, **kw})

    # the preset's Engram fields, read without checking its layer_ids against overridden layers (the run's are checked)
    return base, {**base(use_engram=False).engram, **engram_over}


def model_for(name: str, vocab_size: int, pad_id: int, tokenizer_file: str, use_engram: bool = True,
              baseline: str | None = None, overrides: dict | None = None):
    """Model config of a training preset for a given tokenizer.

    baseline=None/"iso-flop": the same backbone (`use_engram=False` removes Engram: iso-FLOP).
    baseline="iso-param": no Engram, and its parameter budget moved into a wider SwiGLU FFN.
    """
    base, engram = _model_builder(name, overrides)
    engram = {**engram, "tokenizer_name_or_path": str(tokenizer_file), "pad_id": pad_id}
    cfg = base(vocab_size=vocab_size, pad_token_id=pad_id, engram=engram, use_engram=use_engram)
    if baseline in (None, "iso-flop"):
        return cfg
    if baseline not in BASELINES:
        raise ConfigError(f"--baseline must be 'iso-flop' or 'iso-param', got {baseline!r}")
    extra = _engram_param_count(base(vocab_size=vocab_size, pad_token_id=pad_id, engram=engram))
    per_unit = 3 * cfg.hidden_size * cfg.num_hidden_layers  # gate, up and down rows per extra FFN unit
    return base(vocab_size=vocab_size, pad_token_id=pad_id, engram=engram, use_engram=False,
                intermediate_size=cfg.intermediate_size + round(extra / per_unit))


# ------------------------------------------------------------------------------------ job configs
# `engram train --config FILE [--preset NAME] [--set KEY=VALUE ...]`: the preset, then the file, then --set.
RUN_SET = {  # model fields every run sets itself (from its tokenizer and flags), and what to do instead
    "model.vocab_size": "the tokenizer sets it: choose its size with train.tokenizer = \"bpe:N\"",
    "model.pad_token_id": "the tokenizer sets it",
    "model.use_engram": "pass --no-engram or --baseline instead",
    "model.engram.tokenizer_name_or_path": "the run hashes with its own tokenizer: set train.tokenizer",
    "model.engram.pad_id": "the tokenizer sets it",
}
ZERO_OK = ("n_shared_experts", "shared_intermediate_size", "sinkhorn_iters")  # integer model fields where 0 means none


@dataclass(frozen=True)
class Job:
    """What one `engram train` run trains: `preset` (the named starting point: its model and training settings),
    `model` (fields overriding the preset's model: `EngramLMConfig` arguments, with `engram` holding `EngramConfig`
    fields) and `train` (`TrainConfig` fields overriding the preset's). Built by `resolve_job`; run by
    `train(job.preset, overrides=job.train, model_overrides=job.model)`, whose run.json records all three
    (`preset`, `model_overrides`, `train` resolved)."""

    preset: str = "cpu-small"
    model: dict = dataclasses.field(default_factory=dict)
    train: dict = dataclasses.field(default_factory=dict)
    source: str = ""  # the file it came from ("" without --config)


def resolve_job(path=None, preset: str | None = None, sets: list[str] | tuple = ()) -> Job:
    """The job of `engram train`: preset `preset` (or the file's `preset`, or cpu-small), the fields of the
    config file `path` (JSON or TOML), then `--set KEY=VALUE` items (`model.KEY=VALUE`, `model.engram.KEY=VALUE`:
    the model; `KEY=VALUE` or `train.KEY=VALUE`: training settings). Every key, type and value is checked here
    (one-line `ConfigError`s naming the key and the fix); the model is built once to run its own checks."""
    data = read_job_file(path) if path else {}
    where = str(path) if path else "--set"
    file_preset = data.get("preset")
    if file_preset is not None and not isinstance(file_preset, str):
        raise ConfigError(f"{where}: preset must be a preset's name (a string), e.g. preset = \"cpu-small\"; "
                          f"got {file_preset!r}")
    if preset and file_preset and preset != file_preset:
        raise ConfigError(f"--preset {preset} disagrees with preset = {file_preset!r} in {where}; give one of them")
    name = preset or file_preset or "cpu-small"
    get_preset(name)
    for key in data:
        if key not in ("preset", "model", "train"):
            _unknown(key, where, name)
    model_file = _section(data, "model", where)
    train = _check_train(name, _section(data, "train", where), where)
    model = _check_model(name, model_file, where) if model_file else {}
    sources = [where] if model_file else []  # where the model fields came from, for the model's own checks
    for kv in sets:
        key, sep, value = kv.partition("=")
        if not sep:
            raise ConfigError(f"--set {kv}: expected KEY=VALUE, e.g. lr=1e-3 or model.hidden_size=384")
        if key.startswith("model."):
            *parents, leaf = key.split(".")[1:]
            item = {leaf: _set_value(value)}
            for parent in reversed(parents):
                item = {parent: item}
            item = _check_model(name, item, f"--set {kv}")
            sources.append(f"--set {kv}")
            model = {**model, **item, **({"engram": {**model.get("engram", {}), **item["engram"]}}
                                         if "engram" in item else {})}
        else:
            key = key.removeprefix("train.")
            if key not in {f.name for f in dataclasses.fields(TrainConfig)} and key not in RENAMED_SETTINGS:
                near = _nearest(f"train.{key}", name)
                if near:
                    raise ConfigError(f"--set {kv}: unknown training setting; did you mean "
                                      f"{near.removeprefix('train.')}?")
            train.update(TrainConfig.parse_overrides([f"{key}={value}"]))
    if model:
        try:  # the model config's own checks (sizes that divide, layer ids in range, ...)
            base, engram = _model_builder(name, model)
            base(engram=engram)
        except ConfigError as e:
            raise ConfigError(f"{' with '.join(sources)}: {e}") from None
    return Job(name, model, train, str(path) if path else "")


def read_job_file(path) -> dict:
    """The settings in a job config file: `.json`, or `.toml` (tomllib; `tomli` on Python 3.10)."""
    p = Path(path)
    kind = p.suffix.lower()
    if kind not in (".json", ".toml"):
        raise ConfigError(f"--config {p}: name the file *.json or *.toml (its suffix says how to read it)")
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--config {p}: no such file") from None
    except OSError as e:
        raise ConfigError(f"--config {p}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {p}: not UTF-8 text (byte {e.start})") from None
    if kind == ".json":
        try:
            data = json.loads(text, object_pairs_hook=lambda pairs: _no_duplicates(pairs, p))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    else:
        from ..utils import parse_toml

        data = parse_toml(text, str(p), ConfigError)
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be an object with preset, model and train; "
                          f"got a JSON {type(data).__name__}")
    return data


def _no_duplicates(pairs, path) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"{path}: key {key!r} is given twice; keep one")
        out[key] = value
    return out


def _section(data: dict, name: str, where: str) -> dict:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {name} must be a table of settings ([{name}] in TOML, an object in JSON), "
                          f"got {value!r}")
    return value


def _valid_keys(preset: str) -> list[str]:
    top, engram, _ = _model_fields(preset)
    keys = (["preset"] + [f"model.{k}" for k in top if k != "engram"] + [f"model.engram.{k}" for k in engram]
            + [f"train.{f.name}" for f in dataclasses.fields(TrainConfig)])
    return [k for k in keys if k not in RUN_SET]


def _nearest(key: str, preset: str) -> str | None:
    """The valid key nearest to dotted `key`: the same name in another section, else the closest by difflib."""
    valid = _valid_keys(preset)
    leaf = key.rsplit(".", 1)[-1]
    near = [k for k in valid if k.rsplit(".", 1)[-1] == leaf] or difflib.get_close_matches(key, valid, n=1)
    if not near:
        leaves = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in valid], n=1)
        near = [k for k in valid if leaves and k.rsplit(".", 1)[-1] == leaves[0]]
    return near[0] if near else None


def _unknown(key: str, where: str, preset: str):
    near = _nearest(key, preset)
    hint = f"did you mean {near}?" if near else "the file takes preset, [model], [model.engram] and [train]"
    raise ConfigError(f"{where}: unknown key {key}; {hint}")


def _model_fields(preset: str) -> tuple[dict, dict, set]:
    """({EngramLMConfig argument: the preset's value}, {EngramConfig field: the preset's value}, the arguments
    whose default is None: derived from the others, e.g. intermediate_size = 4 * hidden_size)."""
    from ..model import EngramLMConfig

    proto = get_preset(preset).model()
    params = {k: p for k, p in inspect.signature(EngramLMConfig.__init__).parameters.items()
              if k != "self" and p.kind is p.POSITIONAL_OR_KEYWORD}
    return ({k: getattr(proto, k) for k in params}, dict(proto.engram),
            {k for k, p in params.items() if p.default is None})


def _check_model(preset: str, model: dict, where: str) -> dict:
    """The model fields of a job, each checked: a known key, the preset's value's type; returned typed."""
    top, engram, derived = _model_fields(preset)
    out = {}
    for key, value in model.items():
        if f"model.{key}" in RUN_SET:
            raise ConfigError(f"{where}: model.{key} cannot be set: {RUN_SET[f'model.{key}']}")
        if key not in top:
            _unknown(f"model.{key}", where, preset)
        if key == "engram":
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: model.engram must be a table of EngramConfig fields ([model.engram] "
                                  f"in TOML, an object in JSON), got {value!r}")
            out[key] = {}
            for k, v in value.items():
                if f"model.engram.{k}" in RUN_SET:
                    raise ConfigError(f"{where}: model.engram.{k} cannot be set: "
                                      f"{RUN_SET[f'model.engram.{k}']}")
                if k not in engram:
                    _unknown(f"model.engram.{k}", where, preset)
                out[key][k] = _typed(f"model.engram.{k}", v, engram[k], where)
            continue
        out[key] = _typed(f"model.{key}", value, top[key], where, nullable=key in derived)
        if isinstance(out[key], int) and not isinstance(out[key], bool) and out[key] < (0 if key in ZERO_OK else 1):
            raise ConfigError(f"{where}: model.{key} must be {'>= 0' if key in ZERO_OK else 'positive'}, "
                              f"got {out[key]}")
    return out


def _check_train(preset: str, train: dict, where: str) -> dict:
    """The training settings of a job, each a known `TrainConfig` field of its default's type; returned typed."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    out = {}
    for key, value in current_settings(train).items():  # (old spellings renamed: table_backend -> table_mode)
        if key not in defaults:
            _unknown(f"train.{key}", where, preset)
        out[key] = _typed(f"train.{key}", value, defaults[key], where)
    return out


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list of integers"}


def _typed(key: str, value, example, where: str, nullable: bool = False):
    """`value` if it has `example`'s type (an integer also passes as a float, returned as one), else a ConfigError."""
    kind = type(example)
    if example is None or (value is None and nullable):
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is list:
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not ok:
        raise ConfigError(f"{where}: {key} must be {_KINDS.get(kind, kind.__name__)} (the preset's is "
                          f"{_shown(example)}), got {_shown(value)}")
    return list(value) if kind is list else value


def _shown(value) -> str:
    """`value` as the file would write it (JSON; a TOML date, which JSON has not, as Python writes it)."""
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _set_value(text: str):
    """A `--set model.KEY=VALUE` value: JSON (3, 1e-3, [1, 4], true, "x"), else the text as a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return parse_bool(text) if text.lower() in ("true", "false", "yes", "no", "on", "off") else text
