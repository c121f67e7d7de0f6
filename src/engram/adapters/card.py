"""The model card (`README.md`, Hugging Face's format) written beside every saved adapter and overlay: the one home.

A card is YAML front matter (`library_name: engram`, `base_model`, `tags`; written by `huggingface_hub`'s
`ModelCardData`, which `tokenizers`, a core dependency, brings) and prose saying what the folder holds: the base
(its name or path and the fingerprint or digest the folder is checked against), the hash manifest's digest (what
overlays record as `hash_spec_sha256`), how it was trained or optimized (data, steps, measured losses) when that is
known, and for an overlay how many facts and which rows it writes.

The card documents the folder and is never read back: `load_adapter` and `Overlay.load` ignore it, and the checksum
manifest leaves it out (`CARD_FILE` in `new_dir(exclude=...)`), so a card edited by hand (as on a hub) does not make
the folder read as corrupt. Written atomically (`persist.atomic_write_bytes`).

`training` (an adapter's, passed to `save_adapter(..., training=...)`): a dict of what the run recorded. Keys shown by
name, each optional: `command` (what trained it, e.g. "engram adapt"), `data` (sources), `steps`, `tokens`
(training tokens seen), `train_loss` and `val_loss` (measured at `steps`), `settings` (a dict: lr, batch size, ...);
any other key is listed as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..persist import atomic_write_bytes

CARD_FILE = "README.md"
ADAPTER_TAGS = ["engram", "engram-adapter", "n-gram-memory"]
OVERLAY_TAGS = ["engram", "engram-overlay", "knowledge-editing"]
_TRAINING_KEYS = ("command", "data", "steps", "tokens", "train_loss", "val_loss", "settings")


def front_matter(base_model: str | None, tags: list[str]) -> str:
    """The card's YAML header (between `---` lines): library_name engram, `base_model` when known, `tags`."""
    from huggingface_hub import ModelCardData

    data = ModelCardData(library_name="engram", base_model=base_model or None, tags=list(tags))
    return f"---\n{data.to_yaml()}\n---\n"


def adapter_card(target, adapter, training: dict | None = None, lora: bool = False) -> str:
    """The card of an adapter saved from `target` (the transformers model) with `adapter` (its `EngramAdapter`).

    `training`: what the run recorded (module doc); None: the card says it was not recorded. `lora`: LoRA weights
    are saved with it."""
    cfg, fp = adapter.config, adapter.fingerprint
    name = base_name(target)
    tags = ADAPTER_TAGS + (["lora", "peft"] if lora else [])
    cfg_fp, vocab, emb = fp.get("config", {}), fp.get("vocab", {}), fp.get("embedding", {})
    orders = ", ".join(str(n) for n in range(2, cfg.max_ngram_size + 1))
    lines = [
        front_matter(name, tags),
        f"# Engram adapter for {_code(name) if name else 'an unnamed base model'}",
        "",
        "Engram memory layers (hashed n-gram tables, DeepSeek's Engram) in front of decoder layers "
        f"{list(cfg.layer_ids)} (`{adapter.layers_path}`) of a frozen `transformers` causal LM, saved by engram. "
        "Load it on its base:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "from engram.adapters import EngramAdapterModel",
        "",
        f"base = AutoModelForCausalLM.from_pretrained({json.dumps(name or 'path/to/base')})",
        'model = EngramAdapterModel.from_pretrained(base, "path/to/this/folder")',
        "```",
        "",
        "## Base model",
        "",
        f"- name or path: {_code(name) if name else 'not recorded (the model was not loaded from a folder)'}",
        f"- architecture: {_code(cfg_fp.get('model_type', '?'))}, "
        + ", ".join(f"{k} {v}" for k, v in cfg_fp.items() if k != "model_type"),
        f"- fingerprint `load_adapter` checks: vocabulary of {vocab.get('size', '?')} tokens (compression sha256 "
        f"`{vocab.get('lookup_sha256', '?')}`), input embedding {emb.get('shape', '?')} (sha256 of 256 sampled rows "
        f"`{emb.get('sample_sha256', '?')}`)",
        "",
        "## Engram",
        "",
        f"- layers {list(cfg.layer_ids)}; n-gram orders {orders}, {cfg.n_head_per_ngram} heads per order, table "
        f"rows per head {list(cfg.engram_vocab_size)} by order (each head: the next unused prime above), "
        f"{cfg.n_embed_per_ngram // cfg.n_head_per_ngram}-dim head rows, tables in {cfg.table_dtype}",
        f"- hash manifest digest (`hash_spec_sha256` in overlays made for it): `{adapter.mapping.spec_digest()}` "
        f"(family {_code(adapter.mapping.family.name)})",
    ]
    if adapter.base_modules:
        lines.append(f"- base modules trained and saved with it: {', '.join(map(_code, adapter.base_modules))}")
    if lora:
        lines.append("- LoRA weights on the base saved with it (PEFT)")
    lines += ["", "## Training", ""] + _training_lines(training)
    lines += ["", "## Files", "",
              "`engram_manifest.json` lists every file's size and sha256 (this card excepted: edit it freely); "
              "`engram_adapter.json` holds the Engram settings and the base fingerprint."]
    return "\n".join(lines) + "\n"


def overlay_card(meta: dict, rows_per_layer: dict[int, int]) -> str:
    """The card of an overlay: `meta` its `overlay.json` (what `edit_facts` and `engram edit` record),
    `rows_per_layer` {layer: rows written}."""
    facts = meta.get("facts") or []
    summary = meta.get("summary") or {}
    opt, settings = meta.get("optimization") or {}, meta.get("settings") or {}
    base = meta.get("base")
    total = sum(rows_per_layer.values())
    lines = [
        front_matter(base, OVERLAY_TAGS),
        f"# Engram overlay for {_code(base) if base else 'an Engram model'}",
        "",
        "Edited rows of an Engram model's memory tables (`engram edit`, `engram.edit_facts`), applied in front of the "
        "tables at lookup time: only n-grams that hash to these rows read something new (the edited facts', and any "
        "that collide with them: `engram edit`'s report measures the collisions and the locality); removing the "
        "overlay is the undo. Apply it with `--overlay path/to/this/folder` or "
        "`engram.apply_overlay(model, \"path/to/this/folder\")`.",
        "",
        "## What it was made for",
        "",
        f"- model: {_code(base) if base else 'not recorded'}",
        f"- model digest (`base_digest`, checked when applied): `{meta.get('base_digest', '?')}`",
        f"- hash manifest digest (`hash_spec_sha256`): `{meta.get('hash_spec_sha256', '?')}`"
        + (f" (family {_code(meta['hash_family'])})" if meta.get("hash_family") else ""),
    ]
    if meta.get("stacked_on"):
        lines.append(f"- made on top of overlays: {', '.join(map(_code, meta['stacked_on']))}")
    lines += ["", "## Edits", ""]
    given = summary.get("facts")
    lines.append(f"- facts: {given if given is not None else len(facts)}"
                 + (f" ({len(facts)} contexts optimized, paraphrases or chat turns included)"
                    if given is not None and given != len(facts) else ""))
    lines.append(f"- rows written: {total:,} in layers "
                 + ", ".join(f"{lid} ({n:,})" for lid, n in sorted(rows_per_layer.items())))
    if settings:
        lines.append("- settings: " + _inline(settings))
    if opt:
        lines.append(f"- optimization: {opt.get('steps_run', '?')} steps, final loss (mean target NLL) "
                     f"{_loss(opt.get('final_loss'))}, facts at target {opt.get('facts_at_target', '?')}")
    if summary:
        lines.append("- report (`report.json` when `engram edit` wrote it): "
                     + _inline({k: v for k, v in summary.items() if k != "facts"}))
    for f in facts[:5]:
        lines.append(f"- e.g. {_code(f.get('prompt', ''))} -> {_code(f.get('target', ''))}")
    if len(facts) > 5:
        lines.append(f"- ... and {len(facts) - 5:,} more (all in `overlay.json`)")
    lines += ["", "## Files", "",
              "`overlay.safetensors` (row ids and values per layer), `overlay.json` (what it was made for, facts, "
              "settings); `engram_manifest.json` lists their sha256 (this card excepted: edit it freely)."]
    return "\n".join(lines) + "\n"


def write_card(directory, text: str) -> Path:
    """Write `text` as `directory/README.md`, atomically; returns its path."""
    path = Path(directory) / CARD_FILE
    atomic_write_bytes(path, text.encode("utf-8"))
    return path


def base_name(model) -> str | None:
    """The name or path `model` was loaded from (transformers' `config._name_or_path`), or None."""
    cfg = getattr(model, "config", None)
    name = getattr(cfg, "_name_or_path", None) or getattr(model, "name_or_path", None)
    return str(name) if name else None


def _training_lines(training: dict | None) -> list[str]:
    if not training:
        return ["Not recorded: saved without a training record (`save_adapter(model, dir, training={...})` adds "
                "one)."]
    t = dict(training)
    out = []
    if "command" in t:
        out.append(f"- trained by: {_code(t['command'])}")
    if t.get("data"):
        data = t["data"] if isinstance(t["data"], (list, tuple)) else [t["data"]]
        out.append(f"- data: {', '.join(_code(str(d)) for d in data)}")
    if "steps" in t or "tokens" in t:
        tokens = f", {_num(t['tokens'])} training tokens" if "tokens" in t else ""
        out.append(f"- steps: {t.get('steps', '?')}{tokens}")
    losses = [f"{k.replace('_', ' ')} {_loss(t[k])}" for k in ("train_loss", "val_loss") if t.get(k) is not None]
    if losses:
        out.append(f"- measured losses (nats per token, at step {t.get('steps', '?')}): {', '.join(losses)}")
    if t.get("settings"):
        out.append("- settings: " + _inline(t["settings"]))
    out += [f"- {k}: {_inline(v) if isinstance(v, dict) else v}" for k, v in t.items() if k not in _TRAINING_KEYS]
    return out


def _inline(d: dict) -> str:
    return ", ".join(f"{k} {_num(v)}" for k, v in d.items())


def _num(v) -> str:
    """A float to 6 significant digits, an int with thousands separators, anything else as it prints."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return f"{v:.6g}" if isinstance(v, float) else f"{v:,}"


def _loss(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _code(s) -> str:
    """`s` as inline code (backticks inside it replaced, so the span cannot end early)."""
    return "`" + str(s).replace("`", "'") + "`"
