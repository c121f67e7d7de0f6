"""Engram memory adapters on pretrained `transformers` causal LMs: attach, detach, save, load.

    model = AutoModelForCausalLM.from_pretrained("path/to/qwen3")
    engram.attach(model, layer_ids=[1], tokenizer="path/to/qwen3")   # exact: same logits as before
    ... train (engram adapt, or engram.optim.build_optimizers on the trainable params) ...
    engram.save_adapter(model, "out/adapter")                        # only what attach added
    engram.load_adapter(AutoModelForCausalLM.from_pretrained(...), "out/adapter")
    engram.detach(model)                                             # the base, untouched

Where the memory goes: in front of decoder layer i the residual stream becomes
`h + Engram_i(h, rows_i)`, `rows_i` looked up from layer i's table for the n-gram hash ids of the
call's tokens (compressed with the base model's own tokenizer). Two forward pre-hooks do it: one on
the module that owns the layer list (it sees `input_ids` and the KV cache: hashes once per call), one
on each chosen layer (it adds the delta). The model's code is not modified; `detach` removes both.

Exact at attach: the value rows of every layer's fused projection (`kv_proj.weight[:D]`, `kv_proj.bias[:D]`)
start at zero, so the value, the gated value, its short conv (RMSNorm(0) = 0, SiLU(0) = 0) and the delta
are exactly 0.0 and the logits equal the base's bit for bit. The tables keep their N(0, 1) init and the
keys their default init, so the first step already moves the value rows (the gradient of a zero-initialized
LoRA B, the same idea); the tables' gradients flow from the second step on.

Decoding: the cache (`generate()`'s, or one passed in) carries Engram's state (the last N-1 ids and each
layer's short-conv inputs; `engram.model.NgramHistory`), so cached decoding equals full recomputes.
"""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from .config import BackBoneConfig, ConfigError, EngramConfig
from .hashing import NgramHashMapping
from .memory import Engram
from .tokenizer import CompressedTokenizer, TokenizerError
from .manifest import MANIFEST, IntegrityError, verify_manifest, write_manifest
from .persist import atomic_write_bytes, read_json, recover_dir, replace_dir, temp_dir_for, write_json
from .utils import sha256_bytes, sha256_file

FORMAT = "engram-adapter/1"
CONFIG_FILE = "engram_adapter.json"
WEIGHTS_FILE = "engram_adapter.safetensors"
BASE_MODULES_FILE = "base_modules.safetensors"
TOKENIZER_FILE = "tokenizer.json"
SPEC_FILE = "engram_hash_spec.json"
LORA_DIR = "lora"

# where decoder families keep their layers (Llama/Qwen/Mistral/Gemma, OPT, GPT-2/GPT-J, GPT-NeoX/Pythia, Falcon, MPT)
LAYER_LISTS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers", "transformer.layers",
               "transformer.blocks", "model.language_model.layers")
# architecture-defining config fields compared by the base fingerprint (whichever the config has)
_FINGERPRINT_KEYS = ("model_type", "vocab_size", "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer",
                     "num_attention_heads", "n_head", "num_key_value_heads", "intermediate_size", "n_inner",
                     "head_dim", "tie_word_embeddings")


class AdapterError(ValueError):
    """An adapter cannot be attached, saved or loaded; the message names the problem and the fix."""


def default_options(hidden_size: int, vocab_size: int) -> dict:
    """Engram settings an adapter gets unless given: bigrams and trigrams, 4 heads each, rows per head ~2x
    the vocabulary (next unused primes), 64-dim head rows (n_embed_per_ngram = min(256, hidden)), the
    paper's zero-initialized conv."""
    e = min(256, hidden_size)
    e -= e % 4
    return dict(max_ngram_size=3, n_head_per_ngram=4, n_embed_per_ngram=max(4, e),
                engram_vocab_size=[2 * vocab_size, 2 * vocab_size], conv_zero_init=True)


# ------------------------------------------------------------------------------------------ finding things
def _get(root: nn.Module, path: str):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (attach/load go on the inner model)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def find_layers(model: nn.Module, layers_path: str | None = None) -> tuple[str, nn.ModuleList]:
    """(dotted path, the decoder layer list) of a causal LM: `layers_path` or the first conventional one found."""
    model = _unwrap(model)
    for path in ([layers_path] if layers_path else LAYER_LISTS):
        obj = _get(model, path)
        if isinstance(obj, nn.ModuleList) and len(obj):
            return path, obj
    if layers_path:
        raise AdapterError(f"{type(model).__name__} has no layer list at {layers_path!r} (an nn.ModuleList of "
                           "decoder layers); check the name with print(model)")
    raise AdapterError(f"{type(model).__name__}: no decoder layer list found (looked for {', '.join(LAYER_LISTS)}); "
                       "pass layers_path='<dotted path of the nn.ModuleList of decoder layers>'")


def _hidden_size(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for k in ("hidden_size", "n_embd", "d_model"):
        v = getattr(cfg, k, None) if cfg is not None else None
        if isinstance(v, int) and v > 0:
            return v
    return model.get_input_embeddings().weight.shape[1]


def compressed_tokenizer(tokenizer, model: nn.Module | None = None) -> CompressedTokenizer:
    """The compression of `tokenizer` (path, folder, tokenizer object or a `CompressedTokenizer`); None: the
    `tokenizer.json` in the folder the model was loaded from."""
    if isinstance(tokenizer, CompressedTokenizer):
        return tokenizer
    if tokenizer is None:
        src = getattr(getattr(model, "config", None), "_name_or_path", "") if model is not None else ""
        if not src or not (Path(src) / TOKENIZER_FILE).is_file():
            raise AdapterError("attach needs the base model's tokenizer: pass tokenizer=<tokenizer.json, its folder "
                               "or a fast tokenizer object> (hashing uses that tokenizer's compression)")
        tokenizer = src
    try:
        return CompressedTokenizer(tokenizer)
    except TokenizerError as e:
        raise AdapterError(str(e)) from None


def pad_or_eos_id(config) -> int | None:
    """A model config's pad token id, else its (first) EOS id, else None."""
    for v in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        v = v[0] if isinstance(v, (list, tuple)) and v else v
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def generation_pad_id(model) -> int:
    """The pad id to give `generate()` and to pad batches with: `pad_or_eos_id` of the model's config, else 0."""
    pad = pad_or_eos_id(getattr(model, "config", None))
    return 0 if pad is None else pad


def _check_vocab(ct: CompressedTokenizer, model: nn.Module) -> None:
    """The tokenizer must be the model's: every id it makes has an embedding row, and the embedding is not
    much larger than the vocabulary (models pad it, e.g. Qwen3 151,669 -> 151,936)."""
    rows = model.get_input_embeddings().weight.shape[0]
    slack = max(1024, rows // 20)
    if ct.vocab_size > rows or ct.vocab_size < rows - slack:
        raise AdapterError(f"tokenizer has {ct.vocab_size:,} tokens but the model's embedding has {rows:,} rows: "
                           "this is not the model's tokenizer; pass the one it was trained with")


def base_fingerprint(model: nn.Module, ct: CompressedTokenizer) -> dict:
    """What identifies a base model: its architecture config, its vocabulary (the compression table's
    sha256) and its input embedding (shape + sha256 of 256 evenly spaced rows, rounded to bfloat16 so the
    same weights loaded in another dtype match)."""
    cfg = model.config.to_dict() if getattr(model, "config", None) is not None else {}
    emb = model.get_input_embeddings().weight.detach()
    idx = torch.linspace(0, emb.shape[0] - 1, min(256, emb.shape[0])).round().long().to(emb.device)
    sample = emb.index_select(0, idx).to(torch.bfloat16).float().cpu().contiguous()
    return {"config": {k: cfg[k] for k in _FINGERPRINT_KEYS if k in cfg},
            "vocab": {"size": ct.vocab_size, "lookup_sha256": ct.lookup_sha256},
            "embedding": {"shape": list(emb.shape), "sample_sha256": sha256_bytes(sample.numpy().tobytes())}}


def _fingerprint_mismatch(saved: dict, now: dict) -> str | None:
    for k in sorted(set(saved["config"]) | set(now["config"]), key=lambda k: _FINGERPRINT_KEYS.index(k)):
        if saved["config"].get(k) != now["config"].get(k):
            return f"config {k} is {now['config'].get(k)!r}, the adapter's base had {saved['config'].get(k)!r}"
    if saved["vocab"] != now["vocab"]:
        return "its tokenizer compresses differently (another vocabulary)"
    if saved["embedding"]["shape"] != now["embedding"]["shape"]:
        return f"embedding shape {now['embedding']['shape']} != {saved['embedding']['shape']}"
    if saved["embedding"]["sample_sha256"] != now["embedding"]["sample_sha256"]:
        return "its embedding weights differ (another checkpoint of this architecture)"
    return None


# ------------------------------------------------------------------------------------------ the adapter
class EngramAdapter(nn.Module):
    """The Engram layers attach() put on a model (`model.engram_adapter`), and the hooks that run them.

    `layers[str(i)]` is the `Engram` in front of decoder layer i (hc_mult = 1: the host has one residual
    stream). `config` is the `EngramConfig`, `mapping` the hashing, `fingerprint` the base at attach time.
    """

    def __init__(self, cfg: EngramConfig, hidden_size: int, num_layers: int, mapping: NgramHashMapping,
                 layers_path: str, fingerprint: dict):
        super().__init__()
        self.config, self.mapping, self.layers_path, self.fingerprint = cfg, mapping, layers_path, fingerprint
        bb = BackBoneConfig(hidden_size=hidden_size, hc_mult=1, vocab_size=mapping.raw_vocab_size, num_layers=num_layers)
        self.layers = nn.ModuleDict({str(i): Engram(i, cfg, bb, mapping) for i in cfg.layer_ids})
        D = hidden_size
        with torch.no_grad():
            for layer in self.layers.values():  # value rows at zero: delta == 0.0 exactly (see the module doc)
                layer.kv_proj.weight[:D].zero_()
                layer.kv_proj.bias[:D].zero_()
        self.base_modules: list[str] = []  # base modules unfrozen for training (`unfreeze`): saved with the adapter
        self.gates: dict | None = None  # {layer: (B, T)} of the last forward when set to {} (analysis)
        self._inputs: dict = {}
        self._cache = None
        self._handles: list = []
        self._root = None  # the model attach() was called on (not a submodule: no cycle in the module tree)

    def extra_repr(self) -> str:
        return f"layers_path={self.layers_path!r}"

    # ---- hooks
    def _install(self, model: nn.Module) -> None:
        parent_path, _, attr = self.layers_path.rpartition(".")
        owner = _get(model, parent_path) if parent_path else model
        layers = getattr(owner, attr)
        self.__dict__["_root"] = model
        sig = inspect.signature(owner.forward)
        self._handles.append(owner.register_forward_pre_hook(self._make_owner_hook(owner, sig), with_kwargs=True))
        for i in self.config.layer_ids:
            self._handles.append(layers[i].register_forward_pre_hook(self._make_layer_hook(i), with_kwargs=True))

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._inputs, self._cache = {}, None
        self.__dict__["_root"] = None

    def _make_owner_hook(self, owner: nn.Module, sig: inspect.Signature):
        from transformers.cache_utils import DynamicCache

        from .model import NgramHistory, with_ngram_history

        cache_name = "cache" if "cache" in sig.parameters else "past_key_values"
        keep = self.config.max_ngram_size - 1

        def hook(module, args, kwargs):
            try:
                bound = sig.bind_partial(*args, **kwargs)
            except TypeError:
                bound = None
            a = bound.arguments if bound is not None else kwargs
            a = {**a, **a.get("kwargs", {})}
            ids = a.get("input_ids")
            if ids is None:
                raise AdapterError("Engram hashes token ids: call the model with input_ids (inputs_embeds "
                                   "alone cannot be hashed)")
            if ids.dim() != 2:
                raise AdapterError(f"input_ids must be 2-D (batch, seq_len), got shape {tuple(ids.shape)}")
            cache = a.get(cache_name, a.get("past_key_values"))
            use_cache = a.get("use_cache")
            if use_cache is None:
                use_cache = getattr(getattr(owner, "config", None), "use_cache", False)
            history = None
            if cache is None and use_cache and bound is not None and cache_name in sig.parameters:
                # the model would create a plain cache itself: give it one that keeps Engram's decoding state
                try:
                    cache = DynamicCache(config=owner.config)
                except TypeError:
                    cache = DynamicCache()
                with_ngram_history(cache)
                pos = list(sig.parameters).index(cache_name)
                if len(args) > pos:
                    args = args[:pos] + (cache,) + args[pos + 1:]
                else:
                    kwargs = {**kwargs, cache_name: cache}
            elif cache is not None:
                if not isinstance(cache, NgramHistory):
                    if cache.get_seq_length() > 0:
                        raise AdapterError(f"this {type(cache).__name__} was filled without Engram's token history "
                                           "(before attach, or by another model); start from an empty cache")
                    with_ngram_history(cache)
                if cache.get_seq_length() == 0:
                    cache.clear_engram()  # a fresh (or reset) cache: decoding starts here
                else:
                    history = cache.ngram_history
                cache.push_ngram_history(ids.detach(), keep)
            self._cache = cache
            pf = getattr(self._root, "prefetcher", None)
            if pf is not None:  # hashing and gathers start on the prefetch thread
                self._inputs = pf.submit(ids, history)
            else:
                self._inputs = self.mapping.hash_continuation(ids.detach().cpu(), history)
            return args, kwargs

        return hook

    def _make_layer_hook(self, layer_id: int):
        layer = self.layers[str(layer_id)]

        def hook(module, args, kwargs):
            x = self._inputs.get(layer_id)
            if x is None:
                raise AdapterError(f"decoder layer {layer_id} ran without Engram inputs: call the whole model "
                                   "(its forward hashes the token ids), not the layer alone")
            # hash ids (B, T, H) looked up here, or rows (B, T, H, d) pending on the prefetch thread
            rows = layer.multi_head_embedding(x) if isinstance(x, torch.Tensor) else x.wait()
            h = args[0] if args else kwargs["hidden_states"]  # (B, T, D)
            state = self._cache.engram_state(layer_id) if self._cache is not None else None
            dtype = layer.kv_proj.weight.dtype
            delta, gate = layer(h.to(dtype).unsqueeze(2), rows, state)  # (B, T, 1, D), (B, T, 1)
            h = h + delta.squeeze(2).to(h.dtype)
            if self.gates is not None:
                self.gates[layer_id] = gate.squeeze(2).detach()
            if args:
                return (h,) + tuple(args[1:]), kwargs
            return args, {**kwargs, "hidden_states": h}

        return hook


def adapter_of(model: nn.Module) -> EngramAdapter | None:
    """The `EngramAdapter` attached to `model` (also inside a PEFT wrapper), or None."""
    return next((m for m in model.modules() if isinstance(m, EngramAdapter)), None)


# ------------------------------------------------------------------------------------------ public API
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
        raise AdapterError(f"layer_ids {bad or ids} out of range: {path} has {len(layers)} layers (0..{len(layers) - 1})")
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
    if not train_base:
        freeze_base(target)
    if verbose:
        c = trainable_summary(target)
        import sys

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
    from .tables.base import find_tables

    for _, mhe in find_tables(adapter):
        if mhe.table is not None:
            mhe.table.close()
    from .tables.prefetch import Prefetcher

    Prefetcher.detach(target)
    del target._modules["engram_adapter"]  # where attach() put it
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


def freeze_base(model: nn.Module) -> None:
    """requires_grad False on every parameter except the Engram adapter's (and LoRA's, if any)."""
    for n, p in model.named_parameters():
        p.requires_grad_("engram_adapter" in n or "lora_" in n)


def add_lora(model: nn.Module, rank: int = 8, alpha: float | None = None, target_modules=None,
             dropout: float = 0.0) -> nn.Module:
    """Wrap `model` with LoRA on its base (PEFT, `pip install 'engram-torch[peft]'`) and keep the Engram adapter
    trainable. `target_modules` None: PEFT's default for the architecture (e.g. q_proj, v_proj; GPT-2 c_attn).
    Returns the PEFT model; `save_adapter` stores its LoRA weights beside the Engram ones."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise AdapterError("LoRA needs peft: pip install 'engram-torch[peft]'") from None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"LoRA rank must be a positive integer, got {rank!r}")
    extra = {"exclude_modules": r".*engram_adapter.*"} if target_modules is not None else {}  # (e.g. "all-linear")
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                     target_modules=target_modules, task_type="CAUSAL_LM", **extra)
    pm = get_peft_model(model, cfg)
    for n, p in pm.named_parameters():  # PEFT freezes everything but LoRA: the Engram adapter trains too
        if "engram_adapter" in n:
            p.requires_grad_(True)
    return pm


def save_adapter(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write only what attach added (and modules `unfreeze`d, and LoRA weights of a PEFT wrapper) to `directory`.

    Files: `engram_adapter.safetensors`, `engram_adapter.json` (Engram config, layers path, base
    fingerprint), `engram_hash_spec.json`, `tokenizer.json` (the compression's tokenizer),
    `base_modules.safetensors` and `lora/` when present, and `engram_manifest.json` (every file's sha256,
    last). Written to a temp folder that `persist.replace_dir` moves into place.
    """
    from .tables import table_entries, write_safetensors

    target = _unwrap(model)
    adapter = adapter_of(target)
    if adapter is None:
        raise AdapterError("the model has no Engram adapter to save (engram.attach it first)")
    out = Path(directory)
    tmp = temp_dir_for(out)
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
    write_manifest(tmp)  # last
    return replace_dir(tmp, out)


def read_adapter_config(directory: str | os.PathLike, verify: bool = True) -> dict:
    """The adapter's `engram_adapter.json`, after checking every file against the folder's manifest (`verify`)."""
    d = Path(directory)
    recover_dir(d)
    f = d / CONFIG_FILE
    if not f.is_file():
        raise AdapterError(f"{d}: no Engram adapter here (expected {CONFIG_FILE}; save one with engram.save_adapter)")
    meta = read_json(f, "adapter config", "save the adapter again", AdapterError)
    if verify and "files" not in meta:  # adapters before 0.2 listed their digests in engram_adapter.json
        if not (d / MANIFEST).is_file():
            raise AdapterError(f"{d / MANIFEST} is missing (adapter incomplete); save the adapter again")
        try:
            verify_manifest(d, "save the adapter again")
        except IntegrityError as e:
            raise AdapterError(f"adapter corrupt: {e}") from None
    if meta.get("format") != FORMAT:
        raise AdapterError(f"{f}: format {meta.get('format')!r} is not {FORMAT!r}")
    for name, digest in meta.get("files", {}).items() if verify else ():
        if not (d / name).is_file():
            raise AdapterError(f"{d / name} is missing (adapter incomplete)")
        if sha256_file(d / name) != digest:
            raise AdapterError(f"{d / name} is truncated or corrupt (sha256 mismatch)")
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
            raise AdapterError(f"{d} holds LoRA weights: pip install 'engram-torch[peft]' (or pass lora=False)") from None
        model = PeftModel.from_pretrained(target, str(d / LORA_DIR))
    return model


def trainable_summary(model: nn.Module) -> dict:
    """Parameter counts: total, trainable, and of the trainable: Engram tables (rows wherever they live),
    Engram dense, base (LoRA, unfrozen modules)."""
    from .memory import is_table_key
    from .tables.base import find_tables

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


__all__ = ["AdapterError", "EngramAdapter", "adapter_of", "add_lora", "attach", "default_options", "detach", "find_layers",
           "freeze_base", "load_adapter", "read_adapter_config", "save_adapter", "trainable_summary", "unfreeze"]
