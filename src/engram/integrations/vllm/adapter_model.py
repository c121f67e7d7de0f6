"""A pretrained base + engram adapter in vLLM: vLLM's own model for the base's architecture with engram's adapter
layers in front of the hooked blocks, as `engram.adapters` puts them on a transformers model.

    class EngramAdapterLlamaForCausalLM(EngramAdapterMixin, LlamaForCausalLM)   (also Mistral, Qwen2, Qwen3)

The folder vLLM loads is a pair folder (`pair.py`): the base's files linked, `config.json` naming one of these
classes and the base and adapter folders. vLLM loads the base's weights into its own modules
(`super().load_weights`); engram reads the adapter's tensors from the adapter folder into an `EngramAdapter`
built as `attach` builds it (same parameter names, `engram_adapter.layers.{i}...`), its tables under
`defer_table_allocation` until their rows arrive; then the table options apply (`overlays.load_table_options`:
`inference.prepare_inference`, and the per-request overlays, each token reading its own request's rows).

Where the delta goes. vLLM's decoder layers return `(mlp_out, residual)` unadded: the next layer's fused
add+RMSNorm adds them. A forward pre-hook on each hooked block i rebuilds the residual stream entering it,
`h = hidden_states + residual` (`hidden_states` alone at block 0), computes Engram_i's delta on `h` (what the
transformers hook sees) and passes `(positions, h + delta, None)`: with residual None the block takes its
unfused branch (`residual = h; x = input_norm(h)`), transformers' order of operations. The step's hash ids
and the short conv's history come from the per-KV-slot store (`state.py`, `step.py`) as in engram's own
vLLM model, so chunked prefill, prefix caching and preemption stay exact. The adapter is replicated on every
tensor-parallel rank (the hidden states between blocks are whole on each). Eager mode only (the hooks and the
host-side hashing run outside vLLM's graph capture): the config hook forces it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from itertools import chain

import torch
import torch.nn as nn
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from ...adapters.files import adapted_digest, adapter_mapping, adapter_tensors
from ...adapters.hooks import EngramAdapter
from ...memory import defer_table_allocation, is_table_key
from .options import table_options
from .overlays import load_table_options
from .pair import LAYERS_PATH, read_pair
from .step import engram_delta, hash_ids, new_state, step_view

PREFIX = "engram_adapter."


class _BlockHook:
    """Forward pre-hook (with kwargs) on vLLM decoder block `layer_id`: the residual stream entering it, plus the
    Engram delta, passed on with residual None (see the module doc)."""

    def __init__(self, model: "EngramAdapterMixin", layer_id: int, block: nn.Module):
        self.model, self.layer_id = model, layer_id
        self.sig = inspect.signature(block.forward)

    def __call__(self, module, args, kwargs):
        m = self.model
        if m._step is None:  # Engram off (engram_scale 0), or nothing scheduled
            return None
        bound = self.sig.bind(*args, **kwargs)
        a = bound.arguments
        hs, res = a["hidden_states"], a["residual"]
        h = hs if res is None else hs + res  # (n_all, D): a new tensor; the fused norms below may write into it
        ids, view, n, choice = m._step
        eng = m.engram_adapter.layers[str(self.layer_id)]
        x = h[:n].to(eng.kv_proj.weight.dtype).unsqueeze(1)  # (n, 1, D): one residual stream
        delta = engram_delta(m.state, eng, x, ids, view, choice)[:, 0].to(h.dtype)  # (n, D)
        if n < h.shape[0]:  # padded tokens (beyond num_actual_tokens): no delta
            delta = torch.cat([delta, delta.new_zeros(h.shape[0] - n, delta.shape[1])])
        a["hidden_states"], a["residual"] = h + delta, None
        return bound.args, bound.kwargs


class EngramAdapterMixin:
    """Put in front of a vLLM model class for a supported base (`pair.ARCHITECTURES`)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        cfg = vllm_config.model_config.hf_config
        self.pair = read_pair(cfg)
        meta = self.pair["meta"]
        self.options = table_options(cfg, meta["engram"])
        ecfg, mapping = adapter_mapping(self.pair["adapter"], meta)
        self.mapping = mapping
        with defer_table_allocation():  # the adapter's rows arrive in load_weights: no init, no storage here
            self.engram_adapter = EngramAdapter(ecfg, meta["hidden_size"], cfg.num_hidden_layers, mapping,
                                                LAYERS_PATH, meta["base"])
        self.engram_adapter.eval()
        self.state = new_state(vllm_config)
        self._step = None  # (hash ids, StepView, n, overlay choice) of the step being run
        self.overlay_bank = None  # the per-request overlays (`overlays.OverlayBank`), set in load_weights
        self._attn_name = self.model.layers[0].self_attn.attn.layer_name
        for i in ecfg.layer_ids:
            block = self.model.layers[i]
            block.register_forward_pre_hook(_BlockHook(self, i, block), with_kwargs=True)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if input_ids is None:
            raise ValueError("engram's adapter in vLLM needs input_ids (Engram hashes token ids; no inputs_embeds)")
        view = step_view(self.state, self._attn_name, input_ids, positions)
        n = view.n if view is not None else input_ids.shape[0]
        on = self.options.scale != 0 and n > 0
        choice = self.overlay_bank.for_step(view) if on and self.overlay_bank is not None else None
        self._step = (hash_ids(self.state, self.mapping, input_ids[:n], view), view, n, choice) if on else None
        try:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        finally:
            self._step = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The base's weights by vLLM's own loader (then the base modules saved with the adapter, in their place);
        the adapter's tensors read by engram; then the table options."""
        a, meta = self.pair["adapter"], self.pair["meta"]
        sd, base_sd, _ = adapter_tensors(a, meta)
        loaded = set(super().load_weights(chain(weights, base_sd.items())))
        params = dict(self.engram_adapter.named_parameters())
        buffers = dict(self.engram_adapter.named_buffers())
        for name, w in sd.items():
            if name in buffers:
                buffers[name].copy_(w)
            elif name not in params:
                raise KeyError(f"{a}: adapter tensor {name!r} has no place in the adapter engram builds for it")
            elif is_table_key(name):  # the table: its real rows, as saved
                mhe = self.engram_adapter.get_submodule(name.rsplit(".embedding.weight", 1)[0])
                mhe.embedding.weight = nn.Parameter(w.to(params[name].dtype).contiguous(), requires_grad=False)
            else:
                with torch.no_grad():
                    params[name].copy_(w)
            loaded.add(PREFIX + name)
        missing = sorted(set(params) - set(sd))
        if missing:
            raise KeyError(f"{a}: the adapter's weights lack {missing[:3]}")
        self.overlay_bank = load_table_options(self, self.options, lambda: adapted_digest(self.pair["base"], a, meta))
        return loaded


class EngramAdapterLlamaForCausalLM(EngramAdapterMixin, LlamaForCausalLM):
    pass


class EngramAdapterMistralForCausalLM(EngramAdapterMixin, MistralForCausalLM):
    pass


class EngramAdapterQwen2ForCausalLM(EngramAdapterMixin, Qwen2ForCausalLM):
    pass


class EngramAdapterQwen3ForCausalLM(EngramAdapterMixin, Qwen3ForCausalLM):
    pass
