"""Loading a model for inference: a model folder of any registered kind, or a pretrained base with its adapter.

    model, tok = load_inference_model("runs/tiny")                        # a folder: its kind says how (kinds.py)
    model, tok = load_inference_model(base="bases/llama", adapter="runs/adapt", table_tier="disk", table_dir=d)
    model, tok_file = load_base("bases/llama")                            # the transformers base alone
    model, tok_file = load_base("HuggingFaceTB/SmolLM2-135M@main")        # a model id in the local HF cache (hub.py)
    model, tok = load_inference_model("runs/tiny", dtype="bfloat16", device="cuda")   # --dtype, --device

`dtype` and `device` (every loader here; `--dtype`/`--device` on the commands) are the dense weights' dtype and where
the model runs; the Engram tables keep their rows' own dtype (`engram.placement`). None: as loaded before these
options existed (float32 for an engram model, a base in its checkpoint's dtype; the CPU).

A base is a `save_pretrained` folder or a model id (`org/name`, `org/name@REVISION`, or `revision=`) found in the
local Hugging Face cache (`hub.resolve_model_dir`, called by `load_base`, so by every loader here; never the network).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from ..deprecation import renamed_keywords
from ..errors import install_hint
from ..placement import check_placement, place
from .hub import resolve_model_dir
from .kinds import find_folder_kind


def load_base(base: str | os.PathLike, device=None, dtype=None, revision: str | None = None):
    """(model, tokenizer.json path) of a `save_pretrained` folder holding a causal LM and its tokenizer.json, loaded
    by transformers in `dtype` (None: the checkpoint's own, transformers' "auto") and moved to `device` (None: the
    CPU). `base` may be a model id in the local Hugging Face cache ("org/name", "org/name@REVISION"; `revision`: a
    branch, tag or commit of it): its snapshot folder is loaded (`hub.resolve_model_dir`)."""
    from transformers import AutoModelForCausalLM

    dtype, device = check_placement(dtype, device)
    d = resolve_model_dir(base, revision)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--base {base}: no model here (expected a save_pretrained folder with config.json)")
    tok = d / "tokenizer.json"
    if not tok.is_file():
        raise FileNotFoundError(f"--base {base}: no tokenizer.json beside the model (Engram hashes with the base "
                                "model's own tokenizer; save it there with tokenizer.save_pretrained)")
    try:
        model = AutoModelForCausalLM.from_pretrained(d, **({"dtype": dtype} if dtype is not None else {}))
    except (ValueError, OSError) as e:
        raise ValueError(f"--base {base}: could not load the model: {str(e).splitlines()[0]}") from None
    return model.to(device or "cpu"), tok


def load_with_adapter(base, adapter=None, device=None, dtype=None, revision: str | None = None):
    """(model in eval mode, `tokenizers` tokenizer): the base (a folder or a cached model id at `revision`, as
    `load_base`), with the adapter in `adapter` when given (an Engram adapter folder, a PEFT LoRA folder, or a run
    dir whose final/ holds either); with `dtype`, the dense weights of both in it (the Engram tables in their own),
    all on `device`.

    The base loads straight in `dtype`, except float16 with an adapter: then the base loads as saved and is cast
    after the adapter is checked, since an Engram adapter recognises its base by a bfloat16-rounded sample of the
    embedding, which float32 and bfloat16 weights round to exactly and float16 ones (rounded twice) not always."""
    import torch

    from ..adapters import CONFIG_FILE, load_adapter
    from ..tokenizer import load_tokenizer

    dtype, device = check_placement(dtype, device)
    model, tok_file = load_base(base, device, None if dtype == torch.float16 and adapter is not None else dtype,
                                revision)
    if adapter is not None:
        a = Path(adapter)
        if (a / "final").is_dir():
            a = a / "final"
        if (a / CONFIG_FILE).is_file():
            model = load_adapter(model, a)
        elif (a / "adapter_config.json").is_file():
            try:
                from peft import PeftModel
            except ImportError:
                raise ImportError(f"{a} is a LoRA adapter: {install_hint('peft')}") from None
            model = PeftModel.from_pretrained(model, str(a))
        else:
            raise FileNotFoundError(f"--adapter {adapter}: no adapter here (expected engram_adapter.json or a PEFT "
                                    "adapter_config.json, or a run dir with final/)")
    return place(model, dtype, device).eval(), load_tokenizer(tok_file)


@renamed_keywords(table_backend="table_tier")
def load_inference_model(path=None, base=None, adapter=None, table_tier: str = "ram", table_dir=None, dtype=None,
                         device=None, revision: str | None = None):
    """(model in eval mode, tokenizer) of a model folder `path` of any folder kind (an engram run dir / model
    folder, or a kind an installed package declares, e.g. a qwen4_exp checkpoint with its n-gram tables served by
    engram), or of a pretrained transformers `base` (a folder, or a model id in the local Hugging Face cache at
    `revision`: `load_base`) with its Engram or LoRA `adapter`; the tables in tier
    `table_tier` ("ram", or "mmap"/"disk" files under `table_dir`; `table_backend=` is its deprecated spelling).
    `dtype` / `device`: the dense weights' dtype and the device (module doc; None: as loaded, on the CPU), checked
    before anything loads. What `engram serve`, `edit`, `eval` and `sample` load."""
    if table_tier != "ram" and not table_dir:
        raise ValueError(f"--table-tier {table_tier} needs --table-dir DIR for the table files")
    dtype, device = check_placement(dtype, device)
    if base is None:
        if revision is not None:
            raise ValueError(f"revision={revision!r} selects a version of a base model id; give base= with it")
        _, kind = find_folder_kind(path)  # (a kind opens its tables in their tier as they load)
        if _takes_placement(kind.load):
            return kind.load(Path(path), table_tier, table_dir, dtype=dtype, device=device)
        model, tok = kind.load(Path(path), table_tier, table_dir)  # (a kind that does not place: placed here)
        return place(model, dtype, device) if dtype is not None or device is not None else model, tok
    model, tok = load_with_adapter(base, adapter, dtype=dtype, revision=revision)  # (tables: tier, then device)
    if table_tier != "ram":
        from ..tables import offload_tables

        offload_tables(model, table_tier, table_dir)
    return place(model, None, device), tok


def _takes_placement(load) -> bool:
    """Whether a folder kind's `load` takes `dtype=` and `device=` (engram's own does; a kind declared before
    they existed takes (path, tier, table_dir) only, and its model is placed after it loads)."""
    try:
        params = inspect.signature(load).parameters
    except (TypeError, ValueError):
        return False
    return {"dtype", "device"} <= set(params) or any(p.kind is p.VAR_KEYWORD for p in params.values())
