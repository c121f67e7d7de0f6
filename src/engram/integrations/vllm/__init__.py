"""engram's models in vLLM, through vLLM's plugin mechanism (no fork of vLLM).

    pip install -e '.[vllm]' vllm         # (CPU: see docs/serve.md for the install that works)
    python -m vllm.entrypoints.openai.api_server --model runs/cpu-small/final --dtype float32 --enforce-eager
    engram serve runs/cpu-small --engine vllm       # the same, with engram's option names

vLLM runs every function of the `vllm.general_plugins` entry-point group once per process (API server,
engine core, every worker): `register()` below is that entry point. It only registers names, so it is cheap
and safe to call again: engram's config class with transformers' `AutoConfig` (vLLM parses `config.json`
with it), the architecture `EngramForCausalLM` with vLLM's `ModelRegistry` in the lazy "module:Class" form
(the model module, which imports vLLM's layers, is imported by the workers only), and a config hook that
checks engram's table options (`--hf-overrides`, `options.py`) in the API server, before any worker starts.

A pretrained base + Engram adapter: `pair.py` writes a folder naming `EngramAdapter<Arch>` (the base's own
files linked), served by `adapter_model.py` (vLLM's own model for the base, engram's adapter layers hooked in).

Overlays chosen per request (`--overlay NAME=DIR`: the `engram_overlays` option): `overlays.py` keeps every
loaded overlay's rows beside the tables and puts each token's own request's rows into the step's gather;
`routing.py` tells the steps which request chose which overlays (a vLLM logits processor that follows the persistent
batch, which the config hook adds) and routes the model ids `MODEL+NAME` (an ASGI middleware, `--middleware`).

Pieces: `model.py` (the model, written with vLLM's layers), `step.py` (a step's hashing and Engram deltas),
`state.py` (the n-gram ids and conv inputs of earlier positions, kept per KV-cache slot), `options.py` (table
options, the config hooks), `overlays.py` and `routing.py` (overlays per request), `launcher.py` (`engram serve
--engine vllm`), `pair.py`, `adapter_model.py`, and `_kernels.py` (the numba kernels of `step.py` and `state.py`).
"""

from __future__ import annotations

ARCHITECTURE = "EngramForCausalLM"
MODEL_CLASS = "engram.integrations.vllm.model:EngramForCausalLM"
# a pretrained base + adapter (pair.py, adapter_model.py): vLLM's own model per base architecture, wrapped
ADAPTER_ARCHITECTURES = {f"EngramAdapter{a}": f"engram.integrations.vllm.adapter_model:EngramAdapter{a}"
                         for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")}

_registered = False


def register() -> None:
    """The `vllm.general_plugins` entry point: make vLLM know engram's config and architecture (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from ...model_config import EngramLMConfig

    AutoConfig.register("engram", EngramLMConfig, exist_ok=True)
    archs = ModelRegistry.get_supported_archs()
    for arch, cls in {ARCHITECTURE: MODEL_CLASS, **ADAPTER_ARCHITECTURES}.items():
        if arch not in archs:
            ModelRegistry.register_model(arch, cls)
    try:  # the config hook: validates the table options in the API server (a vLLM-internal table)
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP

        from .options import EngramAdapterVllmConfig, EngramVllmConfig

        MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, EngramVllmConfig)
        for arch in ADAPTER_ARCHITECTURES:
            MODELS_CONFIG_MAP.setdefault(arch, EngramAdapterVllmConfig)
    except ImportError:  # another vLLM layout: the workers still validate the options when they load the model
        pass
    _registered = True
