"""engram's models in vLLM, through vLLM's plugin mechanism (no fork of vLLM).

    pip install 'engram-torch[vllm]' vllm          # (CPU: see docs/serve.md for the install that works)
    python -m vllm.entrypoints.openai.api_server --model runs/cpu-small/final --dtype float32 --enforce-eager
    engram serve runs/cpu-small --engine vllm       # the same, with engram's option names

vLLM runs every function of the `vllm.general_plugins` entry-point group once per process (API server,
engine core, every worker): `register()` below is that entry point. It only registers names, so it is cheap
and safe to call again: engram's config class with transformers' `AutoConfig` (vLLM parses `config.json`
with it), the architecture `EngramForCausalLM` with vLLM's `ModelRegistry` in the lazy "module:Class" form
(the model module, which imports vLLM's layers, is imported by the workers only), and a config hook that
checks engram's table options (`--hf-overrides`, `options.py`) in the API server, before any worker starts.

Pieces: `model.py` (the model, written with vLLM's layers), `state.py` (the n-gram ids and conv inputs of
earlier positions, kept per KV-cache slot), `options.py` (table options), `launcher.py` (`engram serve
--engine vllm`).
"""

from __future__ import annotations

ARCHITECTURE = "EngramForCausalLM"
MODEL_CLASS = "engram.integrations.vllm.model:EngramForCausalLM"

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
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    try:  # the config hook: validates the table options in the API server (a vLLM-internal table)
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP

        from .options import EngramVllmConfig

        MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, EngramVllmConfig)
    except ImportError:  # another vLLM layout: the workers still validate the options when they load the model
        pass
    _registered = True
