"""The adapter module: Engram layers in front of a pretrained model's decoder layers, run from forward
pre-hooks (one on the module that owns the layer list hashes the call's tokens; one per chosen layer
adds the delta). The model's code is not modified."""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn as nn

from ..config import BackBoneConfig, EngramConfig
from ..hashing import NgramHashMapping
from ..memory import Engram
from .introspect import AdapterError, _get


class EngramAdapter(nn.Module):
    """The Engram layers attach() put on a model (`model.engram_adapter`), and the hooks that run them.

    `layers[str(i)]` is the `Engram` in front of decoder layer i (hc_mult = 1: the host has one residual
    stream). `config` is the `EngramConfig`, `mapping` the hashing, `fingerprint` the base at attach time.
    """

    def __init__(self, cfg: EngramConfig, hidden_size: int, num_layers: int, mapping: NgramHashMapping,
                 layers_path: str, fingerprint: dict):
        super().__init__()
        self.config, self.mapping, self.layers_path, self.fingerprint = cfg, mapping, layers_path, fingerprint
        bb = BackBoneConfig(hidden_size=hidden_size, hc_mult=1, vocab_size=mapping.raw_vocab_size,
                            num_layers=num_layers)
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
        self.enabled = True  # False (`disabled()`): both hooks pass every call through untouched

    def extra_repr(self) -> str:
        return f"layers_path={self.layers_path!r}"

    # ---- hooks
    def _install(self, model: nn.Module) -> None:
        parent_path, _, attr = self.layers_path.rpartition(".")
        owner = _get(model, parent_path) if parent_path else model
        layers = getattr(owner, attr)
        self.__dict__["_root"] = model
        sig = inspect.signature(owner.forward)
        self._handles.append(owner.register_forward_pre_hook(_HashingHook(self, owner, sig), with_kwargs=True))
        for i in self.config.layer_ids:
            self._handles.append(layers[i].register_forward_pre_hook(_LayerHook(self, i), with_kwargs=True))

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._inputs, self._cache = {}, None
        self.__dict__["_root"] = None

    @contextlib.contextmanager
    def disabled(self):
        """The base model's own computation inside the block: the hooks stay installed but pass every call through
        untouched (no hashing, no delta, a cache's Engram state left as it is), so the logits are the base's bit
        for bit; on again after (also after an exception). A KV cache filled inside the block holds no Engram
        history: start a new one after it."""
        was = self.enabled
        self.enabled = False
        try:
            yield self
        finally:
            self.enabled = was

    def __getstate__(self) -> dict:
        """`copy.deepcopy` and pickle: the call's transient inputs and cache are not part of the adapter."""
        return {**self.__dict__, "_inputs": {}, "_cache": None}


class _LayerHook:
    """Forward pre-hook on decoder layer `layer_id`: adds the Engram layer's delta to the layer's input hidden
    states. An object, not a closure, so that `copy.deepcopy(model)` gives the copy hooks on its own adapter."""

    def __init__(self, adapter: EngramAdapter, layer_id: int):
        self.adapter, self.layer_id = adapter, layer_id

    def __call__(self, module, args, kwargs):
        ad, layer_id = self.adapter, self.layer_id
        if not ad.enabled:
            return None  # (a pre-hook returning None leaves the call as it was)
        layer = ad.layers[str(layer_id)]
        x = ad._inputs.get(layer_id)
        if x is None:
            raise AdapterError(f"decoder layer {layer_id} ran without Engram inputs: call the whole model "
                               "(its forward hashes the token ids), not the layer alone")
        # hash ids (B, T, H) looked up here, or rows (B, T, H, d) pending on the prefetch thread
        rows = layer.multi_head_embedding(x) if isinstance(x, torch.Tensor) else x.wait()
        h = args[0] if args else kwargs["hidden_states"]  # (B, T, D)
        state = ad._cache.engram_state(layer_id) if ad._cache is not None else None
        dtype = layer.kv_proj.weight.dtype
        delta, gate = layer(h.to(dtype).unsqueeze(2), rows, state)  # (B, T, 1, D), (B, T, 1)
        h = h + delta.squeeze(2).to(h.dtype)
        if ad.gates is not None:
            ad.gates[layer_id] = gate.squeeze(2).detach()
        if args:
            return (h,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": h}


class _HashingHook:
    """Forward pre-hook on the module that owns the decoder layers: sees `input_ids` and the KV cache, keeps
    Engram's decoding state in the cache, and hashes the call's tokens once (or hands them to the prefetcher)."""

    def __init__(self, adapter: "EngramAdapter", owner: nn.Module, sig: inspect.Signature):
        self.adapter, self.owner, self.sig = adapter, owner, sig
        self.cache_name = "cache" if "cache" in sig.parameters else "past_key_values"
        self.keep = adapter.config.max_ngram_size - 1  # ids of history an n-gram reaches back

    def arguments(self, args, kwargs) -> tuple[dict, bool]:
        """The call's arguments by name (**kwargs flattened in), and whether they bound to the signature."""
        try:
            bound = self.sig.bind_partial(*args, **kwargs)
        except TypeError:
            return {**kwargs, **kwargs.get("kwargs", {})}, False
        a = bound.arguments
        return {**a, **a.get("kwargs", {})}, True

    def new_cache(self, args, kwargs):
        """The model would create a plain cache itself: pass it one that keeps Engram's decoding state."""
        from transformers.cache_utils import DynamicCache

        from ..cache import with_ngram_history

        try:
            cache = DynamicCache(config=self.owner.config)
        except TypeError:
            cache = DynamicCache()
        with_ngram_history(cache)
        pos = list(self.sig.parameters).index(self.cache_name)
        if len(args) > pos:
            args = args[:pos] + (cache,) + args[pos + 1:]
        else:
            kwargs = {**kwargs, self.cache_name: cache}
        return cache, args, kwargs

    def __call__(self, module, args, kwargs):
        from ..cache import NgramHistory, with_ngram_history

        if not self.adapter.enabled:
            return None
        a, bound = self.arguments(args, kwargs)
        ids = a.get("input_ids")  # (B, T)
        if ids is None:
            raise AdapterError("Engram hashes token ids: call the model with input_ids (inputs_embeds "
                               "alone cannot be hashed)")
        if ids.dim() != 2:
            raise AdapterError(f"input_ids must be 2-D (batch, seq_len), got shape {tuple(ids.shape)}")
        cache = a.get(self.cache_name, a.get("past_key_values"))
        use_cache = a.get("use_cache")
        if use_cache is None:
            use_cache = getattr(getattr(self.owner, "config", None), "use_cache", False)
        history = None  # (B, <= N-1) ids before this call
        if cache is None and use_cache and bound and self.cache_name in self.sig.parameters:
            cache, args, kwargs = self.new_cache(args, kwargs)
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
            cache.push_ngram_history(ids.detach(), self.keep)
        ad = self.adapter
        ad._cache = cache
        pf = getattr(ad._root, "prefetcher", None)
        if pf is not None:  # hashing and gathers start on the prefetch thread
            ad._inputs = pf.submit(ids, history)
        else:
            ad._inputs = ad.mapping.hash_continuation(ids.detach().cpu(), history)  # {layer: (B, T, H)}
        return args, kwargs


def adapter_of(model: nn.Module) -> EngramAdapter | None:
    """The `EngramAdapter` attached to `model` (also inside a PEFT wrapper), or None."""
    return next((m for m in model.modules() if isinstance(m, EngramAdapter)), None)
