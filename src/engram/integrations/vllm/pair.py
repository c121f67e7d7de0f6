"""A base + adapter pair as a folder vLLM serves: the base's files linked (its weights are not copied), its
`config.json` naming engram's wrapper of vLLM's own model for the base's architecture and where the pair is.

    python -m engram.integrations.vllm.pair --base BASE --adapter ADAPTER --out PAIR
    python -m vllm.entrypoints.openai.api_server --model PAIR --dtype float32 --enforce-eager
    engram serve --base BASE --adapter ADAPTER --engine vllm     # the same, the pair cached under engram's cache

The folder: every file of the base's folder as a symbolic link (weights, tokenizer, generation config, chat
template) but `config.json`, which is the base's with `architectures: ["EngramAdapter<Arch>"]` and an
`engram_pair` entry {format, base, adapter (absolute paths), base fingerprint, adapter manifest sha256, lora}. vLLM
then loads the base's own weights with its own model for the architecture (`adapter_model.py`) and engram reads
the adapter's tensors from the adapter folder.

An adapter with LoRA beside Engram (`engram adapt --method lora+engram`): the pair serves the Engram part, and
vLLM's own LoRA support the LoRA part, from the adapter's PEFT folder (`lora` in the entry: {path, rank}, from
`lora_info`), given to vLLM as `--enable-lora --max-lora-rank R --lora-modules NAME=PATH`; vLLM applies a LoRA
only to requests that name it, so `engram serve` gives the LoRA the served name (`launcher.lora_flags`).

Every check (`check_pair`) runs when the pair is written, again in vLLM's API server before any worker starts, and
in the workers: each refusal is one line.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

from ...adapters.introspect import AdapterError
from ...inference.hub import resolve_model_dir
from ...persist import MANIFEST, read_json, write_json

FORMAT = "engram-vllm-pair/1"
KEY = "engram_pair"
# the base architectures served (vLLM's own model for each, with engram's adapter layers) -> the pair's name
ARCHITECTURES = {a: f"EngramAdapter{a}" for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                                   "Qwen3ForCausalLM")}
LAYERS_PATH = "model.layers"  # where vLLM's models (and transformers') of these architectures keep their blocks
# the modules a LoRA may sit on: the projections vLLM's models of these architectures wrap with their LoRA layers
# (as PEFT names them; vLLM packs q/k/v into qkv_proj and gate/up into gate_up_proj, `packed_modules_mapping`)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# overlays are checked against the digest of the model they were fit on (`editing.check_overlay`); with a LoRA that
# is the PEFT model (`model_digest` of `load_adapter`'s result), which the pair's digest from files (base + Engram,
# `adapters.files.adapted_digest`) is not: refused rather than checked against the wrong weights
LORA_OVERLAYS = ("overlays on an adapter with LoRA beside Engram are not served by vLLM yet (they are checked against "
                 "the model with its LoRA, which engram's vLLM path does not digest): serve them with --engine engram")
LORA_KEY = re.compile(rf"base_model\.model\.{re.escape(LAYERS_PATH)}\.\d+\.(self_attn|mlp)\."
                      rf"({'|'.join(LORA_MODULES)})\.lora_[AB]\.weight")


def adapter_dir(adapter) -> Path:
    """An adapter folder, or a run dir whose final/ holds one."""
    a = Path(adapter)
    return a / "final" if (a / "final" / "engram_adapter.json").is_file() else a


def check_pair(base, adapter) -> dict:
    """Everything that decides whether vLLM can serve adapter `adapter` on base `base`; returns {"base", "adapter"
    (absolute paths), "meta" (the adapter's config), "architecture" (the base's), "lora" (`lora_info`: the LoRA saved
    beside Engram, which vLLM applies itself, or None)} or raises a one-line AdapterError."""
    from ...adapters.files import adapter_mapping, check_base
    from ...adapters.saving import PEFT_FILES, read_adapter_config

    b, a = resolve_model_dir(base).resolve(), adapter_dir(adapter).resolve()
    if not (b / "config.json").is_file():
        raise AdapterError(f"--base {base}: no model here (expected a save_pretrained folder with config.json)")
    if (a / PEFT_FILES[1]).is_file() and not (a / "engram_adapter.json").is_file():
        raise AdapterError(f"--adapter {adapter} is a LoRA adapter without Engram: serve it with vLLM's own LoRA "
                           "support (--enable-lora --lora-modules), or with --engine engram")
    meta = read_adapter_config(a)  # (the manifest lists the LoRA's files too: checked here with the rest)
    cfg = read_json(b / "config.json", "model config", "save the base again", AdapterError)
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise AdapterError(f"--base {base}: architecture {arch!r} is not one engram's vLLM adapter path wraps "
                           f"({', '.join(ARCHITECTURES)}); serve the pair with --engine engram")
    if meta.get("layers_path") != LAYERS_PATH:
        raise AdapterError(f"--adapter {adapter}: its layers sit at {meta.get('layers_path')!r}, vLLM's "
                           f"{arch} keeps them at {LAYERS_PATH!r}; serve the pair with --engine engram")
    if meta["engram"].get("hash_mode") == "shuffled":
        raise AdapterError(f"--adapter {adapter}: hash_mode 'shuffled' (an ablation) cannot be reproduced step by "
                           "step; serve the pair with --engine engram")
    adapter_mapping(a, meta)  # tokenizer and hash manifest
    check_base(b, a, meta)  # "... was saved for another base model: ..."
    return {"base": b, "adapter": a, "meta": meta, "architecture": arch, "lora": lora_info(a, arch)}


def lora_info(a: Path, arch: str) -> dict | None:
    """{"path" (the PEFT folder vLLM loads with --lora-modules), "rank" (the largest, rank_pattern included)} of the
    LoRA saved in adapter folder `a`, or None. Refused in one line: a LoRA whose weights sit on modules other than
    the decoder blocks' projections (`LORA_MODULES`: what vLLM's models of these architectures take LoRA on; e.g.
    Engram's own layers, embeddings, `modules_to_save`), since vLLM's loader would stop the server on them."""
    from ...adapters.saving import PEFT_FILES, lora_folder

    d = lora_folder(a)
    if d is None:
        return None
    cfg = read_json(d / PEFT_FILES[1], "LoRA config", "save the adapter again", AdapterError)
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{d}: a PEFT {cfg.get('peft_type')!r} adapter, not LoRA: vLLM serves only LoRA; serve the "
                           "pair with --engine engram")
    weights = d / PEFT_FILES[0]
    if not weights.is_file():
        raise AdapterError(f"{d}: no {PEFT_FILES[0]} (vLLM reads LoRA weights from it); save the adapter again")
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        keys = list(f.keys())
    bad = sorted({k for k in keys if not LORA_KEY.fullmatch(k)})
    if bad or not keys:
        raise AdapterError(f"{d}: LoRA weights on {bad[:2] or 'nothing'}: vLLM's {arch} takes LoRA only on the "
                           f"blocks' {', '.join(LORA_MODULES)}; serve the pair with --engine engram")
    ranks = [cfg.get("r"), *(cfg.get("rank_pattern") or {}).values()]
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in ranks):
        raise AdapterError(f"{d / PEFT_FILES[1]}: LoRA ranks {ranks} must be positive integers; save the adapter again")
    return {"path": str(d), "rank": max(ranks)}


def manifest_sha(a: Path) -> str:
    f = Path(a) / MANIFEST
    return hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else ""


def write_pair(base, adapter, out) -> Path:
    """Check the pair (`check_pair`) and write its folder at `out` (replacing a pair folder there); returns it."""
    info = check_pair(base, adapter)
    b, a, out = info["base"], info["adapter"], Path(out)
    if out.exists() and not (out / "config.json").is_file() and any(out.iterdir()):
        raise AdapterError(f"--out {out}: a folder with other files; give a new or empty folder")
    old = read_json(out / "config.json", "config", "give a new folder", AdapterError) \
        if (out / "config.json").is_file() else None
    if old is not None and KEY not in old:
        raise AdapterError(f"--out {out}: holds a model that is not an engram pair; give a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():  # (a pair written before: its links and config)
        if f.is_symlink() or f.name == "config.json":
            f.unlink()
    for f in sorted(b.iterdir()):
        if f.is_file() and f.name != "config.json":
            os.symlink(f, out / f.name)
    cfg = read_json(b / "config.json", "model config", "save the base again", AdapterError)
    cfg["architectures"] = [ARCHITECTURES[info["architecture"]]]
    cfg[KEY] = {"format": FORMAT, "base": str(b), "adapter": str(a), "base_fingerprint": info["meta"]["base"],
                "adapter_manifest_sha256": manifest_sha(a), "lora": info["lora"]}
    write_json(out / "config.json", cfg)
    return out


def cached_pair(base, adapter) -> Path:
    """The pair folder of (base, adapter) under engram's cache dir, written (checked) on every call."""
    from ...utils import cache_dir

    b, a = resolve_model_dir(base).resolve(), adapter_dir(adapter).resolve()
    key = hashlib.sha256(f"{b}\n{a}".encode()).hexdigest()[:16]
    return write_pair(b, a, cache_dir() / "vllm-pairs" / f"{a.name}-{key}")


def read_pair(hf_config) -> dict:
    """`check_pair` of the pair a vLLM model config (`engram_pair`) names: the base and adapter checked again as
    they are now (the base folder or the adapter may have changed since the pair was written)."""
    p = getattr(hf_config, KEY, None)
    if not isinstance(p, dict) or p.get("format") != FORMAT:
        raise AdapterError(f"config.{KEY} must be the entry engram writes ({FORMAT}); write the pair folder with "
                           "python -m engram.integrations.vllm.pair")
    for k in ("base", "adapter"):
        if not Path(p.get(k, "")).is_dir():
            raise AdapterError(f"the pair's {k} {p.get(k)!r} is not a folder any more; write the pair again")
    return check_pair(p["base"], p["adapter"])


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m engram.integrations.vllm.pair",
                                 description="Write the folder vLLM serves for a base + Engram adapter pair.")
    ap.add_argument("--base", required=True, help="the base model's save_pretrained folder")
    ap.add_argument("--adapter", required=True, help="the Engram adapter folder (or its run dir)")
    ap.add_argument("--out", required=True, help="the pair folder to write")
    args = ap.parse_args(argv)
    try:
        print(write_pair(args.base, args.adapter, args.out))
    except (AdapterError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
