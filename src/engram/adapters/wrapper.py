"""Engram adapters in PEFT's shape: `EngramAdapterConfig`, `get_engram_model`, `EngramAdapterModel`.

    config = EngramAdapterConfig(layer_ids=[1], tokenizer="path/to/base")
    model = get_engram_model(AutoModelForCausalLM.from_pretrained("path/to/base"), config)   # base frozen
    model.print_trainable_parameters()
    ... train model(...) ...
    model.save_pretrained("out/adapter")                 # the one adapter format: what engram.save_adapter writes
    model = EngramAdapterModel.from_pretrained(AutoModelForCausalLM.from_pretrained("path/to/base"), "out/adapter")
    with model.disable_adapter():                        # the base's logits, bit for bit
        ...

Why a wrapper with PEFT's names rather than a tuner registered in PEFT. PEFT 0.21 has one registration function,
`peft.utils.register_peft_method(name=, config_cls=, model_cls=)`, but it accepts only a name that is already a member
of PEFT's own `PeftType` enum ("Unknown PEFT type ..., please add an entry to peft.utils.peft_types.PeftType"): it is
how PEFT's built-in tuners register themselves, not an extension point, and a Python enum cannot gain a member from
outside without patching its internals, which the next PEFT release may break (the enum changes with nearly every
release). A PEFT tuner also works by replacing the modules its `target_modules` match with tuner layers, while an
Engram adapter adds new modules in front of decoder layers and hashes the call's `input_ids` in a hook on the layer
list's owner (`hooks.py`), which no target module sees; and PEFT would save its own `adapter_config.json` format, a
second format beside `engram_adapter.json`. So the wrapper keeps PEFT's names and behaviour (`get_engram_model`,
`save_pretrained`, `from_pretrained(base, dir)`, `disable_adapter()`, `print_trainable_parameters()`,
`get_nb_trainable_parameters()`, `unload()`) over engram's own functions (`attach`, `save_adapter`, `load_adapter`,
`detach`), which keep working unchanged, needs no `peft` install, and writes the one adapter format.

`EngramAdapterConfig`, not `EngramConfig`: that name is the Engram layer's own settings (`engram.EngramConfig`); the
adapter config carries those as `options`. `merge_and_unload` is refused: an Engram layer's output is a table row
looked up by the n-gram of the input tokens, not a weight delta, so it cannot be folded into the base's weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch.nn as nn

from ..persist import read_json, write_json
from .hooks import adapter_of
from .introspect import TOKENIZER_FILE, AdapterError, _unwrap
from .lifecycle import attach, detach, trainable_summary
from .loading import load_adapter
from .saving import CONFIG_FILE, read_adapter_config, save_adapter

ADAPTER_CONFIG_FILE = "engram_adapter_config.json"  # `EngramAdapterConfig.save_pretrained`: the settings, no weights
CONFIG_FORMAT = "engram-adapter-config/1"
_NOT_OPTIONS = ("layer_ids", "tokenizer_name_or_path")  # set by attach itself, not `options`


@dataclass
class EngramAdapterConfig:
    """What `get_engram_model` attaches (PEFT's `LoraConfig` for an Engram adapter): `attach`'s arguments.

    `layer_ids`: decoder layers (0-based) that get an Engram layer in front. `options`: `engram.EngramConfig`
    fields (defaults `default_options(hidden, vocab)`: the table sizes follow the base). `tokenizer`: the base's
    `tokenizer.json` or its folder (None: the folder the model was loaded from). `layers_path`: the dotted path of
    the decoder layer list (None: found). `train_base`: leave the base's `requires_grad` as it is (default: frozen).
    `base_model_name_or_path`: the base's name or path (PEFT's field; `get_engram_model` fills it in).
    """

    layer_ids: list[int]
    options: dict = field(default_factory=dict)
    tokenizer: str | None = None
    layers_path: str | None = None
    train_base: bool = False
    base_model_name_or_path: str | None = None

    def __post_init__(self):
        from ..config import EngramConfig

        ids = [self.layer_ids] if isinstance(self.layer_ids, int) else self.layer_ids
        if isinstance(ids, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise AdapterError(f"layer_ids must be decoder layer indices (ints), got {self.layer_ids!r}")
        self.layer_ids = list(ids)
        valid = {f for f in EngramConfig.__dataclass_fields__} - set(_NOT_OPTIONS)
        unknown = sorted(set(self.options) - valid)
        if unknown:
            raise AdapterError(f"unknown Engram option(s) {unknown}; valid: {', '.join(sorted(valid))}")
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, (str, os.PathLike)):
                raise AdapterError("EngramAdapterConfig.tokenizer is a path (a tokenizer.json or its folder); pass a "
                                   "tokenizer object to engram.attach instead")
            self.tokenizer = str(self.tokenizer)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EngramAdapterConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names - {"format"})
        if unknown:
            raise AdapterError(f"unknown EngramAdapterConfig field(s) {unknown}; valid: {', '.join(sorted(names))}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write the settings (no weights) to `save_directory/engram_adapter_config.json`, atomically."""
        d = Path(save_directory)
        d.mkdir(parents=True, exist_ok=True)
        write_json(d / ADAPTER_CONFIG_FILE, {"format": CONFIG_FORMAT, **self.to_dict()})
        return d / ADAPTER_CONFIG_FILE

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> EngramAdapterConfig:
        """The config of a saved adapter (its `engram_adapter.json`, checked against its manifest: exactly the
        settings it was attached with) or of a folder `save_pretrained` wrote."""
        d = Path(directory)
        if (d / CONFIG_FILE).is_file():
            meta = read_adapter_config(d)
            engram = meta["engram"]
            return cls(layer_ids=list(engram["layer_ids"]), options={k: v for k, v in engram.items()
                                                                     if k not in _NOT_OPTIONS},
                       tokenizer=str(d / TOKENIZER_FILE), layers_path=meta["layers_path"])
        if (d / ADAPTER_CONFIG_FILE).is_file():
            raw = read_json(d / ADAPTER_CONFIG_FILE, "Engram adapter config", "save it again", AdapterError)
            if raw.get("format") != CONFIG_FORMAT:
                raise AdapterError(f"{d / ADAPTER_CONFIG_FILE}: format {raw.get('format')!r} is not "
                                   f"{CONFIG_FORMAT!r}")
            return cls.from_dict(raw)
        raise AdapterError(f"{d}: no Engram adapter or adapter config here (expected {CONFIG_FILE} or "
                           f"{ADAPTER_CONFIG_FILE}; write one with save_pretrained)")


def get_engram_model(model: nn.Module, config: EngramAdapterConfig, verbose: bool = False) -> EngramAdapterModel:
    """Attach the Engram adapter `config` describes to `model` (in place, as PEFT's `get_peft_model`: the base
    frozen unless `config.train_base`) and return it wrapped. The logits equal the base's until the adapter trains.
    `verbose`: `attach`'s one line on what trains."""
    if not isinstance(config, EngramAdapterConfig):
        raise AdapterError(f"get_engram_model takes an EngramAdapterConfig, got {type(config).__name__} (an "
                           "engram.EngramConfig's fields go in EngramAdapterConfig(options=...))")
    attach(model, config.layer_ids, tokenizer=config.tokenizer, layers_path=config.layers_path,
           train_base=config.train_base, verbose=verbose, **config.options)
    from .card import base_name

    name = config.base_model_name_or_path or base_name(_unwrap(model))
    return EngramAdapterModel(model, dataclasses.replace(config, base_model_name_or_path=name))


class EngramAdapterModel(nn.Module):
    """A transformers causal LM with an Engram adapter attached, in PEFT's `PeftModel` shape.

    `base_model` is the model it wraps (the adapter lives inside it, at `engram_adapter`, as `attach` puts it; a
    `PeftModel` when LoRA is attached too); `forward` and `generate` are its own, and any other attribute
    (`config`, `device`, ...) is read from it. `adapter_config` is the `EngramAdapterConfig`.
    """

    wraps_engram_adapter = True  # (saving.py saves what the wrapper wraps: it reads this on the class)

    def __init__(self, model: nn.Module, config: EngramAdapterConfig):
        super().__init__()
        if adapter_of(model) is None:
            raise AdapterError("EngramAdapterModel wraps a model with an Engram adapter attached: use "
                               "get_engram_model(model, config) or EngramAdapterModel.from_pretrained(model, dir)")
        self.base_model = model
        self.adapter_config = config

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.base_model.generate(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":  # (not set yet: no recursion)
                raise
            return getattr(self.base_model, name)

    def get_base_model(self) -> nn.Module:
        """The transformers model (the adapter still attached: `unload()` removes it)."""
        return _unwrap(self.base_model)

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True,
                        training: dict | None = None, **ignored) -> Path:
        """Save the adapter only, as `engram.save_adapter(model, dir)` writes it (the one adapter format, model card
        included; `training`: what the run recorded, for the card). `is_main_process` False writes nothing."""
        if not is_main_process:
            return Path(save_directory)
        return save_adapter(self.base_model, save_directory, training=training)

    @classmethod
    def from_pretrained(cls, model: nn.Module, model_id: str | os.PathLike, is_trainable: bool = False,
                        tokenizer=None, lora: bool = True, dtype=None, device=None) -> EngramAdapterModel:
        """Load the adapter saved in folder `model_id` onto base `model` (`engram.load_adapter`: refuses another
        base or tokenizer). As PEFT: `is_trainable` False (the default) freezes the adapter and sets eval mode;
        True leaves it trainable, LoRA weights included (the base frozen). `tokenizer`, `lora`, `dtype`, `device`:
        `load_adapter`'s."""
        config = EngramAdapterConfig.from_pretrained(model_id)
        loaded = load_adapter(model, model_id, tokenizer=tokenizer, lora=lora, dtype=dtype, device=device)
        if config.base_model_name_or_path is None:
            from .card import base_name

            config.base_model_name_or_path = base_name(_unwrap(loaded))
        wrapped = cls(loaded, config)
        for n, p in wrapped.named_parameters():  # (load_adapter leaves the adapter trainable, LoRA frozen)
            if not is_trainable or "lora_" in n:
                p.requires_grad_(is_trainable)
        if not is_trainable:
            wrapped.eval()
        return wrapped

    @contextlib.contextmanager
    def disable_adapter(self):
        """Inside the block the model computes as its base alone, bit for bit (the Engram hooks pass calls through;
        LoRA, when attached, disabled by PEFT's own `disable_adapter`); the adapter is back on after."""
        with contextlib.ExitStack() as stack:
            if callable(getattr(self.base_model, "disable_adapter", None)):  # a PeftModel (LoRA)
                stack.enter_context(self.base_model.disable_adapter())
            stack.enter_context(adapter_of(self.base_model).disabled())
            yield

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable parameters, all parameters), as PEFT's; an Engram table's rows count once wherever they live
        (in RAM, or in a file: `trainable_summary`)."""
        c = trainable_summary(self.base_model)
        return c["trainable"], c["total"]

    def print_trainable_parameters(self) -> None:
        """One line in PEFT's words: trainable params, all params, trainable %."""
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: "
              f"{100 * trainable / max(total, 1):.4f}")

    def unload(self) -> nn.Module:
        """Remove the adapter (`engram.detach`) and return the base model as it was (its `requires_grad` flags too).
        With LoRA attached, the PEFT model is returned: PEFT's own `unload()` removes LoRA."""
        detach(self.base_model)
        return self.base_model

    def merge_and_unload(self, *args, **kwargs):
        """Refused: an Engram adapter cannot be merged into the base's weights (module doc)."""
        raise AdapterError("an Engram adapter cannot be merged into the base's weights (its output is a table row "
                           "looked up by the input's n-grams, not a weight delta); keep it attached, or unload() "
                           "to get the base back")
