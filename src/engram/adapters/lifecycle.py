"""Attaching and detaching an adapter, what trains (freeze/unfreeze, LoRA) and the parameter counts."""

from __future__ import annotations

import sys
import types

import torch.nn as nn

from ..config import ConfigError, EngramConfig
from ..errors import install_hint
from ..hashing import NgramHashMapping
from .hooks import EngramAdapter, adapter_of
from .introspect import (
    TOKENIZER_FILE,
    AdapterError,
    _check_vocab,
    _hidden_size,
    _unwrap,
    base_fingerprint,
    compressed_tokenizer,
    default_options,
    find_layers,
    pad_or_eos_id,
)


def attach(model: nn.Module, layer_ids, tokenizer=None, layers_path: str | None = None, train_base: bool = False,
           verbose: bool = True, **engram_options) -> nn.Module:
    """Put Engram layers in front of decoder layers `layer_ids` (0-based) of a transformers causal LM, in place.

    tokenizer: the base model's (a `tokenizer.json`, its folder, a tokenizer object; default: the folder
    the model was loaded from). `engram_options`: `EngramConfig` fields (defaults `default_options`).
    The base is frozen, as PEFT's `get_peft_model` does: afterwards only the adapter (and LoRA weights
    already there) requires grad, so "train the trainable parameters" trains the adapter;
    `train_base=True` leaves the base's flags as they were. `verbose` prints one line saying what trains.
    `detach` restores the base's flags. The logits are unchanged until the adapter is trained (module doc).
    Returns `model`. Every check runs before anything is modified.
    """
    target = _unwrap(model)
    if adapter_of(target) is not None:
        raise AdapterError(f"the model already has an Engram adapter (layers {adapter_of(target).config.layer_ids}); "
                           "engram.detach(model) first")
    if not hasattr(target, "get_input_embeddings"):
        raise AdapterError(f"{type(target).__name__} is not a transformers model (no get_input_embeddings)")
    path, layers = find_layers(target, layers_path)
    ids = list(layer_ids) if not isinstance(layer_ids, int) else [layer_ids]
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(layers)]
    if not ids or bad:
        raise AdapterError(f"layer_ids {bad or ids} out of range: {path} has {len(layers)} layers "
                           f"(0..{len(layers) - 1})")
    ct = compressed_tokenizer(tokenizer, target)
    _check_vocab(ct, target)
    D = _hidden_size(target)
    cfg_pad = pad_or_eos_id(getattr(target, "config", None))
    pad = cfg_pad if cfg_pad is not None and 0 <= cfg_pad < ct.vocab_size else 0
    fields = {f for f in EngramConfig.__dataclass_fields__}
    unknown = sorted(set(engram_options) - fields)
    if unknown:
        raise AdapterError(f"unknown Engram option(s) {unknown}; valid: {', '.join(sorted(fields - {'layer_ids'}))}")
    opts = {**default_options(D, ct.vocab_size), "pad_id": pad, **engram_options, "layer_ids": sorted(ids),
            "tokenizer_name_or_path": TOKENIZER_FILE}
    try:
        cfg = EngramConfig(**opts)
        mapping = NgramHashMapping.from_config(cfg, compressed_tokenizer=ct)
    except ConfigError as e:
        raise AdapterError(f"Engram options: {e}") from None
    emb = target.get_input_embeddings().weight
    adapter = EngramAdapter(cfg, D, len(layers), mapping, path, base_fingerprint(target, ct)).to(emb.device)
    adapter.train(target.training)
    base_flags = {n: p.requires_grad for n, p in target.named_parameters()}
    target.add_module("engram_adapter", adapter)
    adapter._install(target)
    adapter.base_requires_grad = base_flags  # detach() puts these back
    from .clipping import enable_sparse_grad_norm
    from .saving import save_pretrained

    target.save_pretrained = types.MethodType(save_pretrained, target)  # as PEFT's wrappers: saves the adapter
    enable_sparse_grad_norm()  # the tables' sparse gradients work with clip_grad_norm_ (Trainer, accelerate)
    if not train_base:
        freeze_base(target)
    if verbose:
        c = trainable_summary(target)
        print(f"engram.attach: {'base frozen' if not train_base else 'base left as it was'}; trainable "
              f"{c['trainable'] / 1e6:.3f}M of {c['total'] / 1e6:.2f}M parameters ({c['engram_table'] / 1e6:.3f}M in "
              f"Engram tables, {c['base_trainable'] / 1e6:.3f}M base)", file=sys.stderr)
    return model


def detach(model: nn.Module) -> nn.Module:
    """Remove the Engram adapter (hooks, layers, tables, prefetcher): the base model as it was. Returns `model`."""
    target = _unwrap(model)
    adapter = adapter_of(target)
    if adapter is None:
        raise AdapterError("the model has no Engram adapter to detach")
    adapter._remove()
    from ..tables.base import find_tables

    for _, mhe in find_tables(adapter):
        if mhe.table is not None:
            mhe.table.close()
    from ..tables.prefetch import Prefetcher

    Prefetcher.detach(target)
    del target._modules["engram_adapter"]  # where attach() put it
    target.__dict__.pop("save_pretrained", None)  # the base's own save_pretrained again
    flags = getattr(adapter, "base_requires_grad", {})
    for n, p in target.named_parameters():  # the base's requires_grad as before attach
        if n in flags:
            p.requires_grad_(flags[n])
    return model


def unfreeze(model: nn.Module, names) -> list[str]:
    """Make base modules trainable (e.g. ["lm_head"], or name suffixes such as "norm"); they are then saved
    with the adapter. Returns the matched module names."""
    target = _unwrap(model)
    adapter = adapter_of(target)
    if adapter is None:
        raise AdapterError("attach an Engram adapter before unfreezing base modules")
    found = []
    for n, m in target.named_modules():
        if n.startswith("engram_adapter") or not n:
            continue
        if any(n == want or n.endswith("." + want) for want in names):
            found.append(n)
            for p in m.parameters():
                p.requires_grad_(True)
    missing = [w for w in names if not any(n == w or n.endswith("." + w) for n in found)]
    if missing:
        raise AdapterError(f"no base module named {missing} (names as in model.named_modules())")
    adapter.base_modules = sorted(set(adapter.base_modules) | set(found))
    return found


def clear_rows(model: nn.Module) -> int:
    """Make an attached adapter *edit-ready*, in place: zero every row of its Engram tables and the value half of
    each layer's `kv_proj` bias (the value it adds at every position whatever the rows), keep the trained keys and
    projections, and return how many rows were cleared. Then the value is `W_v 0 + 0 = 0` at every position, the
    short convolution of zeros adds nothing, and the model's logits equal the base's exactly until an edit writes
    rows (`engram.edit_facts`); an n-gram no edit wrote adds nothing to any text. Tables installed from files
    (`engram.tables`) are refused: clear rows before installing them."""
    import torch

    adapter = adapter_of(model)
    if adapter is None:
        raise AdapterError("clear_rows needs a model with an attached Engram adapter (engram.load_adapter / attach)")
    n = 0
    for layer in adapter.layers.values():
        mhe = layer.multi_head_embedding
        if mhe.table is not None:
            raise AdapterError("clear_rows: this adapter's rows live in an installed table (a file tier); clear them "
                               "on the model in RAM, before installing tables")
        with torch.no_grad():
            mhe.embedding.weight.zero_()
            layer.kv_proj.bias[:layer.hidden_size].zero_()
        n += mhe.embedding.weight.shape[0]
    return n


def freeze_base(model: nn.Module) -> None:
    """requires_grad False on every parameter except the Engram adapter's (and LoRA's, if any)."""
    for n, p in model.named_parameters():
        p.requires_grad_("engram_adapter" in n or "lora_" in n)


def add_lora(model: nn.Module, rank: int = 8, alpha: float | None = None, target_modules=None,
             dropout: float = 0.0) -> nn.Module:
    """Wrap `model` with LoRA on its base (PEFT, the `peft` extra) and keep the Engram adapter
    trainable. `target_modules` None: PEFT's default for the architecture (e.g. q_proj, v_proj; GPT-2 c_attn).
    Returns the PEFT model; `save_adapter` stores its LoRA weights beside the Engram ones, and so do its
    `save_pretrained` and Trainer's checkpoints (`saving.engram_peft_model`), which resume both."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise AdapterError(f"LoRA needs peft: {install_hint('peft')}") from None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"LoRA rank must be a positive integer, got {rank!r}")
    extra = {"exclude_modules": r".*engram_adapter.*"} if target_modules is not None else {}  # (e.g. "all-linear")
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                     target_modules=target_modules, task_type="CAUSAL_LM", **extra)
    pm = get_peft_model(model, cfg)
    for n, p in pm.named_parameters():  # PEFT freezes everything but LoRA: the Engram adapter trains too
        if "engram_adapter" in n:
            p.requires_grad_(True)
    if adapter_of(pm) is None:
        return pm
    from .saving import engram_peft_model

    return engram_peft_model(pm)  # save_pretrained / Trainer checkpoints hold LoRA and Engram together


def trainable_summary(model: nn.Module) -> dict:
    """Parameter counts: total, trainable, and of the trainable: Engram tables (rows wherever they live),
    Engram dense, base (LoRA, unfrozen modules)."""
    from ..memory import is_table_key
    from ..tables.base import find_tables

    out = {"total": 0, "trainable": 0, "engram_table": 0, "engram_dense": 0, "base_trainable": 0}
    for n, p in model.named_parameters():
        k = p.numel()
        out["total"] += k
        if not p.requires_grad or is_table_key(n):
            continue
        out["trainable"] += k
        out["engram_dense" if "engram_adapter" in n else "base_trainable"] += k
    for _, m in find_tables(model):
        trained = m.embedding.weight.requires_grad if m.table is None else getattr(m.table, "requires_grad", True)
        rows = m.num_rows * m.embedding_dim
        out["total"] += rows - m.embedding.weight.numel()  # rows in a file count once
        if trained:
            out["engram_table"] += rows
            out["trainable"] += rows
    return out
