"""Loading a model for inference: a model folder of any registered kind, or a pretrained base with its adapter.

    model, tok = load_inference_model("runs/tiny")                        # a folder: its kind says how (kinds.py)
    model, tok = load_inference_model(base="bases/llama", adapter="runs/adapt", table_tier="disk", table_dir=d)
    model, tok_file = load_base("bases/llama")                            # the transformers base alone
"""

from __future__ import annotations

import os
from pathlib import Path

from ..deprecation import renamed_keywords
from .kinds import find_folder_kind


def load_base(base: str | os.PathLike, device=None):
    """(model, tokenizer.json path) of a `save_pretrained` folder holding a causal LM and its tokenizer.json."""
    from transformers import AutoModelForCausalLM

    d = Path(base)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--base {base}: no model here (expected a save_pretrained folder with config.json)")
    tok = d / "tokenizer.json"
    if not tok.is_file():
        raise FileNotFoundError(f"--base {base}: no tokenizer.json beside the model (Engram hashes with the base "
                                "model's own tokenizer; save it there with tokenizer.save_pretrained)")
    try:
        model = AutoModelForCausalLM.from_pretrained(d)
    except (ValueError, OSError) as e:
        raise ValueError(f"--base {base}: could not load the model: {str(e).splitlines()[0]}") from None
    return model.to(device or "cpu"), tok


def load_with_adapter(base, adapter=None, device=None):
    """(model in eval mode, `tokenizers` tokenizer): the base, with the adapter in `adapter` when given (an
    Engram adapter folder, a PEFT LoRA folder, or a run dir whose final/ holds either)."""
    from ..adapters import CONFIG_FILE, load_adapter
    from ..tokenizer import load_tokenizer

    model, tok_file = load_base(base, device)
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
                raise ImportError(f"{a} is a LoRA adapter: pip install 'engram-torch[peft]'") from None
            model = PeftModel.from_pretrained(model, str(a))
        else:
            raise FileNotFoundError(f"--adapter {adapter}: no adapter here (expected engram_adapter.json or a PEFT "
                                    "adapter_config.json, or a run dir with final/)")
    return model.eval(), load_tokenizer(tok_file)


@renamed_keywords(table_backend="table_tier")
def load_inference_model(path=None, base=None, adapter=None, table_tier: str = "ram", table_dir=None):
    """(model in eval mode, tokenizer) of a model folder `path` of any folder kind (an engram run dir / model
    folder, or a kind an installed package declares, e.g. a qwen4_exp checkpoint with its n-gram tables served by
    engram), or of a pretrained transformers `base` with its Engram or LoRA `adapter`; the tables in tier
    `table_tier` ("ram", or "mmap"/"disk" files under `table_dir`; `table_backend=` is its deprecated spelling).
    What `engram serve`, `edit`, `eval` and `sample` load."""
    if table_tier != "ram" and not table_dir:
        raise ValueError(f"--table-tier {table_tier} needs --table-dir DIR for the table files")
    if base is None:
        _, kind = find_folder_kind(path)  # (a kind opens its tables in their tier as they load)
        return kind.load(Path(path), table_tier, table_dir)
    model, tok = load_with_adapter(base, adapter)
    if table_tier != "ram":
        from ..tables import offload_tables

        offload_tables(model, table_tier, table_dir)
    return model, tok
