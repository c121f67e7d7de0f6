"""An adapter on disk: only what attach added, checked against its manifest and its base on load."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.nn as nn

from ..hashing import SPEC_FILE
from ..persist import (
    atomic_write_bytes,
    new_dir,
    read_json,
    recover_dir,
    verify_saved,
    write_json,
)
from .hooks import adapter_of
from .introspect import (
    TOKENIZER_FILE,
    AdapterError,
    _fingerprint_mismatch,
    _unwrap,
    base_fingerprint,
    compressed_tokenizer,
)
from .lifecycle import attach, detach

FORMAT = "engram-adapter/1"
CONFIG_FILE = "engram_adapter.json"
WEIGHTS_FILE = "engram_adapter.safetensors"
BASE_MODULES_FILE = "base_modules.safetensors"
LORA_DIR = "lora"


def save_adapter(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write only what attach added (and modules `unfreeze`d, and LoRA weights of a PEFT wrapper) to `directory`.

    Files: `engram_adapter.safetensors`, `engram_adapter.json` (Engram config, layers path, base
    fingerprint), `engram_hash_spec.json`, `tokenizer.json` (the compression's tokenizer),
    `base_modules.safetensors` and `lora/` when present, and `engram_manifest.json` (every file's sha256,
    last). Written to a temp folder that `persist.new_dir` swaps into place.
    """
    from ..tables import table_entries, write_safetensors

    target = _unwrap(model)
    adapter = adapter_of(target)
    if adapter is None:
        raise AdapterError("the model has no Engram adapter to save (engram.attach it first)")
    out = Path(directory)
    with new_dir(out) as tmp:  # the checksum manifest is written last, then the folder swapped in
        write_safetensors(tmp / WEIGHTS_FILE, table_entries(adapter, adapter.state_dict()), {"format": FORMAT})
        if adapter.base_modules:
            sd = target.state_dict()
            keys = sorted(k for k in sd if any(k.startswith(m + ".") for m in adapter.base_modules))
            from safetensors.torch import save_file

            save_file({k: sd[k].detach().cpu().contiguous() for k in keys}, str(tmp / BASE_MODULES_FILE))
        ct = adapter.mapping.compressed_tokenizer
        if ct.tokenizer_file is not None:
            shutil.copy(ct.tokenizer_file, tmp / TOKENIZER_FILE)
        else:
            atomic_write_bytes(tmp / TOKENIZER_FILE, ct.tokenizer.to_str().encode("utf-8"))
        adapter.mapping.save_spec(tmp / SPEC_FILE, include_lookup_table=False)
        if model is not target and hasattr(model, "peft_config"):
            model.save_pretrained(str(tmp / LORA_DIR))
        meta = {"format": FORMAT, "engram": adapter.config.to_dict(), "layers_path": adapter.layers_path,
                "hidden_size": adapter.layers[str(adapter.config.layer_ids[0])].hidden_size,
                "base": adapter.fingerprint, "base_modules": adapter.base_modules}
        write_json(tmp / CONFIG_FILE, meta)
    return out


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


def load_adapter(model: nn.Module, directory: str | os.PathLike, tokenizer=None, lora: bool = True) -> nn.Module:
    """Re-attach a saved adapter to `model` and load its weights; returns the model (a PEFT model when the
    adapter has LoRA weights and `lora`). Refuses a different base or tokenizer (one-line `AdapterError`);
    nothing is modified when it refuses."""
    from safetensors.torch import load_file

    d = Path(directory)
    meta = read_adapter_config(d)
    target = _unwrap(model)
    if adapter_of(target) is not None:
        raise AdapterError("the model already has an Engram adapter; engram.detach(model) first")
    ct = compressed_tokenizer(tokenizer if tokenizer is not None else d / TOKENIZER_FILE)
    if ct.lookup_sha256 != meta["base"]["vocab"]["lookup_sha256"]:
        raise AdapterError(f"{d} was trained with another tokenizer (its compression differs); use the adapter's "
                           f"{TOKENIZER_FILE} or the base model's own tokenizer")
    why = _fingerprint_mismatch(meta["base"], base_fingerprint(target, ct))
    if why:
        raise AdapterError(f"{d} was saved for another base model: {why}")
    ecfg = {k: v for k, v in meta["engram"].items() if k not in ("layer_ids", "tokenizer_name_or_path")}
    attach(target, meta["engram"]["layer_ids"], tokenizer=ct, layers_path=meta["layers_path"], verbose=False, **ecfg)
    adapter = adapter_of(target)
    try:
        spec = read_json(d / SPEC_FILE, "hash manifest", "save the adapter again", AdapterError)
        adapter.mapping.check_spec(spec, str(d), AdapterError)
        sd = load_file(str(d / WEIGHTS_FILE), device=str(target.get_input_embeddings().weight.device))
        missing, unexpected = adapter.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise AdapterError(f"{d / WEIGHTS_FILE} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
        if meta.get("base_modules"):
            base_sd = load_file(str(d / BASE_MODULES_FILE))
            _, unexpected = target.load_state_dict(base_sd, strict=False)
            if unexpected:
                raise AdapterError(f"{d / BASE_MODULES_FILE}: the model has no {unexpected[:3]}")
            adapter.base_modules = list(meta["base_modules"])
    except AdapterError:
        detach(target)
        raise
    except Exception as e:
        detach(target)
        raise AdapterError(f"{d}: could not load the adapter: {str(e).splitlines()[0]}") from None
    if lora and (d / LORA_DIR).is_dir():
        try:
            from peft import PeftModel
        except ImportError:
            raise AdapterError(f"{d} holds LoRA weights: pip install 'engram-torch[peft]' "
                               "(or pass lora=False)") from None
        model = PeftModel.from_pretrained(target, str(d / LORA_DIR))
    return model
