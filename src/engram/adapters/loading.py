"""Loading a saved adapter onto a base model: `load_adapter` (alias `from_pretrained`, PEFT's name), for both
layouts `saving.py` writes, refusing another base or tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import torch.nn as nn

from ..errors import install_hint
from ..hashing import SPEC_FILE
from ..persist import read_json
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
from .saving import (
    engram_peft_model,
    load_adapter_weights,
    lora_folder,
    read_adapter_config,
)


def load_adapter(model: nn.Module, directory: str | os.PathLike, tokenizer=None, lora: bool = True, dtype=None,
                 device=None) -> nn.Module:
    """Re-attach a saved adapter to `model` and load its weights; returns the model (a PEFT model when the
    adapter has LoRA weights and `lora`). Refuses a different base or tokenizer (one-line `AdapterError`);
    nothing is modified when it refuses.

    `dtype` ("float32", "bfloat16", "float16" or a torch dtype) and `device`: then the whole model, base and adapter,
    is put there after the adapter is checked and loaded (`placement.place`: the dense weights in `dtype`, the
    Engram tables in their rows' own dtype). None (the default): the base stays as it is and the adapter is built
    in float32 on the base's device (its hooks cast the hidden states to it and back)."""
    from ..placement import check_placement, place

    dtype, device = check_placement(dtype, device)
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
        load_adapter_weights(target, d, meta)
    except AdapterError:
        detach(target)
        raise
    except Exception as e:
        detach(target)
        raise AdapterError(f"{d}: could not load the adapter: {str(e).splitlines()[0]}") from None
    # LoRA: in lora/ (save_adapter) or beside the adapter (save_pretrained of a PEFT model, e.g. Trainer's)
    lora_dir = lora_folder(d)
    if lora and lora_dir is not None:
        try:
            from peft import PeftModel
        except ImportError:
            raise AdapterError(f"{d} holds LoRA weights: {install_hint('peft')} "
                               "(or pass lora=False)") from None
        model = engram_peft_model(PeftModel.from_pretrained(target, str(lora_dir)))
    return place(model, dtype, device)


from_pretrained = load_adapter  # engram.adapters.from_pretrained(base, dir), as PeftModel.from_pretrained(base, dir)
