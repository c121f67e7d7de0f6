"""An adapter on disk: only what attach added (`save_adapter`, the attached model's `save_pretrained`, a PEFT
model's beside LoRA) and its model card (`card.py`), its config read back after checking the manifest
(`read_adapter_config`) and its weights into an attached adapter (`load_adapter_weights`); `loading.py` attaches it
to a base and loads it."""

from __future__ import annotations

import os
from pathlib import Path

import torch.nn as nn

from ..hashing import SPEC_FILE
from ..persist import (
    MANIFEST,
    atomic_write_bytes,
    new_dir,
    read_json,
    recover_dir,
    verify_saved,
    write_json,
    write_manifest,
)
from .card import CARD_FILE, adapter_card, write_card
from .hooks import adapter_of
from .introspect import (
    TOKENIZER_FILE,
    AdapterError,
    _unwrap,
)

FORMAT = "engram-adapter/1"
CONFIG_FILE = "engram_adapter.json"
WEIGHTS_FILE = "engram_adapter.safetensors"
BASE_MODULES_FILE = "base_modules.safetensors"
LORA_DIR = "lora"
TRAINER_WEIGHTS_FILE = "model.safetensors"  # `save_pretrained`'s layout: the name Trainer resumes from
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")  # PEFT's save_pretrained, beside the adapter's
ADAPTER_PREFIX = "engram_adapter."  # where attach puts the adapter in the model (`model.engram_adapter`)


def lora_folder(d) -> Path | None:
    """The PEFT LoRA folder of adapter folder `d`: `lora/` (`save_adapter`), `d` itself when PEFT's files sit beside
    the Engram ones (`save_pretrained` of a PEFT model, Trainer's checkpoints), or None (Engram only). A `lora/` that
    lacks PEFT's files is still returned: its reader then refuses it in one line rather than dropping the LoRA."""
    d = Path(d)
    return d / LORA_DIR if (d / LORA_DIR).is_dir() else d if (d / PEFT_FILES[1]).is_file() else None


def save_adapter(model: nn.Module, directory: str | os.PathLike, training: dict | None = None) -> Path:
    """Write only what attach added (and modules `unfreeze`d, and LoRA weights of a PEFT wrapper) to `directory`.

    Files: `engram_adapter.safetensors`, `engram_adapter.json` (Engram config, layers path, base
    fingerprint), `engram_hash_spec.json`, `tokenizer.json` (the compression's tokenizer),
    `base_modules.safetensors` and `lora/` when present, `README.md` (the model card, `card.py`; `training`: what
    the run recorded, shown on it) and `engram_manifest.json` (every file's sha256 but the card's, last). Written to
    a temp folder that `persist.new_dir` swaps into place. `model` may be an `EngramAdapterModel` (`wrapper.py`).
    """
    model = _inner(model)
    target, adapter = _attached(model)
    out = Path(directory)
    lora = model is not target and hasattr(model, "peft_config")
    with new_dir(out, exclude=(CARD_FILE,)) as tmp:  # the manifest written last (the card left out), then swapped in
        _write_adapter(target, adapter, tmp, trainer_layout=False)
        if lora:  # PEFT's own save (the instance's save_pretrained is attach's: it would write the tables again)
            type(model).save_pretrained(model, str(tmp / LORA_DIR))
        write_card(tmp, adapter_card(target, adapter, training, lora))
    return out


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, is_main_process: bool = True,
                    **ignored) -> Path:
    """`model.save_pretrained(dir)` of an attached model (attach installs it; detach removes it), as PEFT's
    wrappers do: the adapter, not the base, written into `dir` beside what is there (a Trainer checkpoint's
    optimizer and state files, a tokenizer).

    Files: `model.safetensors` holding the model's trainable state under its own names (`engram_adapter.*` and
    any `unfreeze`d base modules), so that `Trainer.train(resume_from_checkpoint=...)` restores it with
    `model.load_state_dict(strict=False)`; then `engram_adapter.json`, `engram_hash_spec.json`,
    `tokenizer.json` and `engram_manifest.json` (last, listing these files; the Trainer may write its own
    `tokenizer.json` over ours, so the manifest leaves it out: `load_adapter` checks the tokenizer by its
    compression's digest instead). `engram.load_adapter` (alias `from_pretrained`) reads it.
    `is_main_process` False (other DDP ranks) writes nothing; other Trainer keywords (`state_dict`, ...) are
    ignored: the adapter's tensors are read from the model. The model card (`README.md`, `card.py`) is written too,
    outside the manifest, over PEFT's own card when LoRA is saved.
    """
    model = _inner(model)
    target, adapter = _attached(model)
    d = Path(save_directory)
    if not is_main_process:
        return d
    d.mkdir(parents=True, exist_ok=True)
    (d / MANIFEST).unlink(missing_ok=True)  # until the new manifest is written the folder reads as incomplete
    peft = model is not target and hasattr(model, "peft_config")
    peft_names = []
    if peft:  # LoRA (add_lora): PEFT's own files, as PEFT writes them, for Trainer's PEFT resume path
        type(model).save_pretrained(model, str(d), is_main_process=is_main_process, **ignored)
        peft_names = [n for n in PEFT_FILES if (d / n).is_file()]
    # (not model.safetensors beside a PEFT adapter: Trainer would load that into the PEFT model by the wrong names
    # instead of calling its load_adapter, which engram_peft_model extends to these files)
    names = _write_adapter(target, adapter, d, trainer_layout=not peft)
    write_card(d, adapter_card(target, adapter, lora=peft))
    write_manifest(d, files=[n for n in names if n != TOKENIZER_FILE] + peft_names)
    return d


def engram_peft_model(pm: nn.Module) -> nn.Module:
    """Give a PEFT model around an attached base (`add_lora`, `load_adapter` of an adapter with LoRA) Engram's
    `save_pretrained` and a `load_adapter` that also loads the Engram weights, so that `Trainer.save_model` and
    every checkpoint hold LoRA and Engram together (PEFT's files beside `save_pretrained`'s) and
    `Trainer.train(resume_from_checkpoint=...)`, which calls `model.load_adapter(checkpoint, ...)` on a PEFT
    model, restores both. Returns `pm`."""
    import types

    def load_adapter(self, model_id, adapter_name, *args, **kwargs):
        out = type(self).load_adapter(self, model_id, adapter_name, *args, **kwargs)
        if (Path(model_id) / CONFIG_FILE).is_file():
            load_adapter_weights(_unwrap(self), Path(model_id))
        return out

    pm.save_pretrained = types.MethodType(save_pretrained, pm)
    pm.load_adapter = types.MethodType(load_adapter, pm)
    return pm


def _inner(model: nn.Module) -> nn.Module:
    """What an `EngramAdapterModel` (`wrapper.py`, which marks its class `wraps_engram_adapter`) wraps; any other
    model as it is. (Read on the class: the wrapper forwards unknown attributes to what it wraps.)"""
    return model.base_model if getattr(type(model), "wraps_engram_adapter", False) else model


def _attached(model: nn.Module):
    """(the transformers model inside any PEFT wrapper, its `EngramAdapter`), or AdapterError."""
    target = _unwrap(model)
    adapter = adapter_of(target)
    if adapter is None:
        raise AdapterError("the model has no Engram adapter to save (engram.attach it first)")
    return target, adapter


def _write_adapter(target: nn.Module, adapter: nn.Module, d: Path, trainer_layout: bool) -> list[str]:
    """Write the adapter's files into folder `d` (each atomically); returns their names.

    `trainer_layout`: the weights go to `model.safetensors` under the model's names, unfrozen base modules
    included (`save_pretrained`); else to `engram_adapter.safetensors` under the adapter's names, base modules
    to `base_modules.safetensors` (`save_adapter`).
    """
    from ..tables import table_entries, tensor_entry, write_safetensors

    sd = target.state_dict() if adapter.base_modules else {}
    base_keys = sorted(k for k in sd if any(k.startswith(m + ".") for m in adapter.base_modules))
    entries = table_entries(adapter, adapter.state_dict())
    base = [tensor_entry(k, sd[k].detach().cpu().contiguous()) for k in base_keys]
    if trainer_layout:
        weights = TRAINER_WEIGHTS_FILE
        entries = [(ADAPTER_PREFIX + n, *rest) for n, *rest in entries] + base
    else:
        weights = WEIGHTS_FILE
    write_safetensors(d / weights, entries, {"format": FORMAT})
    names = [weights]
    if base and not trainer_layout:
        write_safetensors(d / BASE_MODULES_FILE, base, {"format": FORMAT})
        names.append(BASE_MODULES_FILE)
    ct = adapter.mapping.compressed_tokenizer
    tok = ct.tokenizer.to_str().encode("utf-8") if ct.tokenizer_file is None else Path(ct.tokenizer_file).read_bytes()
    atomic_write_bytes(d / TOKENIZER_FILE, tok)
    adapter.mapping.save_spec(d / SPEC_FILE, include_lookup_table=False)
    meta = {"format": FORMAT, "engram": adapter.config.to_dict(), "layers_path": adapter.layers_path,
            "hidden_size": adapter.layers[str(adapter.config.layer_ids[0])].hidden_size,
            "base": adapter.fingerprint, "base_modules": adapter.base_modules}
    if trainer_layout:
        meta["weights_file"] = weights
    write_json(d / CONFIG_FILE, meta)
    return names + [TOKENIZER_FILE, SPEC_FILE, CONFIG_FILE]


def read_adapter_config(directory: str | os.PathLike, verify: bool = True) -> dict:
    """The adapter's `engram_adapter.json`, after checking every file against the folder's manifest (`verify`)."""
    d = Path(directory)
    recover_dir(d)
    f = d / CONFIG_FILE
    if not f.is_file():
        raise AdapterError(f"{d}: no Engram adapter here (expected {CONFIG_FILE}; save one with engram.save_adapter)")
    meta = read_json(f, "adapter config", "save the adapter again", AdapterError)
    if verify:  # adapters before 0.2 listed their digests in engram_adapter.json
        verify_saved(d, meta.get("files"), "adapter", "save the adapter again", AdapterError)
    if meta.get("format") != FORMAT:
        raise AdapterError(f"{f}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def load_adapter_weights(target: nn.Module, d: Path, meta: dict | None = None) -> None:
    """Load the weights of adapter folder `d` (either layout) into `target`'s attached adapter, and the unfrozen base
    modules saved with it. `meta`: its `engram_adapter.json` (default: read and checked)."""
    meta = meta if meta is not None else read_adapter_config(d)
    adapter = adapter_of(target)
    weights = d / meta.get("weights_file", WEIGHTS_FILE)
    sd, base_sd, base_file = adapter_tensors(d, meta, str(target.get_input_embeddings().weight.device))
    missing, unexpected = adapter.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise AdapterError(f"{weights} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if meta.get("base_modules"):
        _, unexpected = target.load_state_dict(base_sd, strict=False)
        if unexpected:
            raise AdapterError(f"{base_file}: the model has no {unexpected[:3]}")
        adapter.base_modules = list(meta["base_modules"])


def adapter_tensors(d: Path, meta: dict, device: str = "cpu") -> tuple[dict, dict, Path]:
    """(the adapter's tensors by the adapter's names, the base modules saved with it by the base's names, the file
    those came from) of adapter folder `d`, either layout (`save_adapter`'s or `save_pretrained`'s)."""
    from safetensors.torch import load_file

    d = Path(d)
    weights = d / meta.get("weights_file", WEIGHTS_FILE)
    sd = load_file(str(weights), device=device)
    base_sd, base_file = {}, d / BASE_MODULES_FILE
    if weights.name == TRAINER_WEIGHTS_FILE:  # `save_pretrained`'s layout: the model's names, base modules too
        base_sd = {k: v for k, v in sd.items() if not k.startswith(ADAPTER_PREFIX)}
        sd = {k[len(ADAPTER_PREFIX):]: v for k, v in sd.items() if k.startswith(ADAPTER_PREFIX)}
        base_file = weights
    elif meta.get("base_modules"):
        base_sd = load_file(str(base_file), device=device)
    return sd, base_sd, base_file
