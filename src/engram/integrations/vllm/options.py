"""engram's table options inside vLLM: flat `--hf-overrides` keys, checked with engram's own code and errors.

    --hf-overrides '{"engram_table_tier": "mmap", "engram_table_dir": "/tmp/tables",
                     "engram_table_format": "int8", "engram_overlay": ["edits/capitals"]}'

| key | values | as in `engram serve` |
|---|---|---|
| `engram_table_tier` | `ram` (default), `mmap`, `disk` | `--table-tier` |
| `engram_table_dir` | folder for the mmap/disk table files | `--table-dir` |
| `engram_table_format` | `float32`, `bfloat16`, `int8`, `fp8`, `fp8_ue8m0`, `nvfp4` | `--table-format` |
| `engram_overlay` | an overlay folder or a list of them, stacked in order, for every request | `--overlay DIR` |
| `engram_overlays` | `{"NAME": "DIR", ...}`: overlays each request chooses (`overlays.py`) | `--overlay NAME=DIR` |
| `engram_scale` | 1 (default); 0 switches Engram off (the backbone alone, for benchmarks) | `engram_disabled()` |

Flat keys, because vLLM replaces a dict-valued override wholesale: `{"engram": {...}}` would wipe the
saved Engram config. `config.update` skips `EngramLMConfig`'s own validation, so the values are checked
here: by `check()` in the API server (vLLM's per-architecture config hook, before any worker starts) and
again by the workers when they load the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import ConfigError

KEYS = ("engram_table_tier", "engram_table_dir", "engram_table_format", "engram_overlay", "engram_overlays",
        "engram_scale")
SELECTOR = "engram.integrations.vllm.routing:OverlaySelector"  # the logits processor that tells steps the choices


@dataclass
class TableOptions:
    tier: str = "ram"
    directory: str | None = None
    format: str | None = None
    overlays: list[str] = field(default_factory=list)
    per_request: dict[str, str] = field(default_factory=dict)  # {name: folder}: chosen by each request
    scale: float = 1.0


def table_options(hf_config, engram: dict | None = None) -> TableOptions:
    """The options set on `hf_config` (by `--hf-overrides`), checked; engram's errors for bad values. `engram`: the
    Engram config they apply to (default: the model's own, `hf_config.engram`; an adapter's for a pair)."""
    import torch.nn as nn

    from ...tables.offload import offload_tables
    from ...tables.quant import check_table_format

    if engram is None:
        if not isinstance(getattr(hf_config, "engram", None), dict):
            raise ConfigError("config.engram must be the saved Engram config (a JSON object); set table options "
                              f"with the flat --hf-overrides keys {', '.join(KEYS)}, never a dict under 'engram'")
        engram = hf_config.engram
    if engram.get("hash_mode") == "shuffled":
        raise ConfigError("hash_mode 'shuffled' (an ablation) keys each lookup by its position inside one hash call; "
                          "vLLM hashes step by step and cannot reproduce it: serve this model with engram serve")
    o = TableOptions(tier=getattr(hf_config, "engram_table_tier", None) or "ram",
                     directory=getattr(hf_config, "engram_table_dir", None) or None,
                     format=getattr(hf_config, "engram_table_format", None) or None,
                     scale=getattr(hf_config, "engram_scale", 1.0))
    ov = getattr(hf_config, "engram_overlay", None) or []
    o.overlays = [ov] if isinstance(ov, str) else list(ov)
    from .overlays import OverlayChoiceError, check_names

    try:
        o.per_request = check_names(getattr(hf_config, "engram_overlays", None) or {})
    except OverlayChoiceError as e:
        raise ConfigError(str(e)) from None
    offload_tables(nn.Module(), o.tier, o.directory)  # engram's own check of tier and folder (no tables: no work)
    if o.format is not None:
        check_table_format(o.format)  # engram's own check (set_table_format's)
    if isinstance(o.scale, bool) or not isinstance(o.scale, (int, float)) or o.scale not in (0, 1):
        raise ConfigError(f"engram_scale must be 1 (Engram on) or 0 (off), got {o.scale!r}")
    return o


def check(hf_config, engram: dict | None = None) -> TableOptions:
    """`table_options`, plus each overlay folder read and verified (`Overlay.load`: checksums, format); the
    per-request overlays' names recorded for this process's request checks (`overlays.REGISTRY`)."""
    from ...editing import Overlay
    from .overlays import REGISTRY

    o = table_options(hf_config, engram)
    for d in [*o.overlays, *o.per_request.values()]:
        Overlay.load(d)
    REGISTRY.names = tuple(o.per_request)
    return o


def enable_selection(model_config, o: TableOptions) -> None:
    """With per-request overlays: engram's logits processor added to the model config (it passes each request's
    choice to the steps; vLLM builds it in every worker and checks each request with it in the API server), and the
    served model names recorded for `MODEL+NAME` routing (`routing.OverlayRouting`)."""
    from ...serving.engine import overlay_updates_allowed

    if not (o.per_request or overlay_updates_allowed()):  # (a server started empty may load overlays later)
        return
    from .overlays import REGISTRY

    procs = list(model_config.logits_processors or [])
    if SELECTOR not in procs:
        model_config.logits_processors = [*procs, SELECTOR]
    served = model_config.served_model_name
    REGISTRY.served = tuple([served] if isinstance(served, str) else served or [model_config.model])


def check_lora(vllm_config) -> None:
    """A pair whose adapter holds LoRA beside Engram (`pair.lora_info`): refused in one line when vLLM runs without
    LoRA (every request would run without it), cannot load that LoRA (vLLM's own `PEFTHelper` checks: rank over
    --max-lora-rank, DoRA, bias, ...), or is given overlays (`pair.LORA_OVERLAYS`), before any worker starts."""
    from pathlib import Path

    from .pair import KEY, LORA_OVERLAYS, lora_info

    mc = vllm_config.model_config
    hf = getattr(mc, "hf_config", None)
    entry = getattr(hf, KEY, None) or {}
    arch = (getattr(hf, "architectures", None) or ["?"])[0].removeprefix("EngramAdapter")
    lora = lora_info(Path(entry["adapter"]), arch) if entry.get("adapter") else None
    if lora is None:
        return
    from ...serving.engine import overlay_updates_allowed

    if getattr(hf, "engram_overlay", None) or getattr(hf, "engram_overlays", None) or overlay_updates_allowed():
        raise ConfigError(LORA_OVERLAYS)
    lc = getattr(vllm_config, "lora_config", None)
    if lc is None:
        from .launcher import max_lora_rank

        raise ConfigError(f"the pair's adapter {entry['adapter']} holds LoRA beside Engram, and vLLM runs without "
                          f"LoRA: start it with --enable-lora --max-lora-rank {max_lora_rank(lora['rank'])} "
                          f"--lora-modules NAME={lora['path']} and name NAME in requests (engram serve --engine vllm "
                          "does)")
    from vllm.lora.peft_helper import PEFTHelper

    try:
        peft = PEFTHelper.from_local_dir(lora["path"], getattr(hf, "max_position_embeddings", None))
        peft.validate_legal(lc)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{lora['path']}: vLLM cannot serve this LoRA: {str(e).splitlines()[0]}") from None


def check_runner(vllm_config) -> None:
    """Per-request overlays follow vLLM's V1 model runner's persistent batch (what its logits processors see);
    the V2 runner (GPUs, by default where it applies) passes requests otherwise: refused in one line."""
    from ...serving.engine import overlay_updates_allowed

    if not (getattr(getattr(vllm_config.model_config, "hf_config", None), "engram_overlays", None)
            or overlay_updates_allowed()):
        return
    try:
        v2 = bool(vllm_config.use_v2_model_runner)
    except Exception:  # (a vLLM without the V2 runner)
        v2 = False
    if v2:
        raise ConfigError("engram's per-request overlays (engram_overlays) follow vLLM's V1 model runner: start vLLM "
                          "with VLLM_USE_V2_MODEL_RUNNER=0")


def check_updates(vllm_config) -> None:
    """Overlays loaded while serving (ENGRAM_ALLOW_OVERLAY_UPDATES): the workers need engram's worker extension (how
    the routes reach their banks), and one API server (the in-flight counts that decide when an unloaded overlay
    goes live in it, as vLLM requires for its runtime LoRA updates)."""
    from ...serving.engine import overlay_updates_allowed

    if not overlay_updates_allowed():
        return
    from .overlays import WORKER

    pc = getattr(vllm_config, "parallel_config", None)
    if pc is not None:
        ext = getattr(pc, "worker_extension_cls", "") or ""
        if ext and ext != WORKER:
            raise ConfigError(f"overlay updates need vLLM's worker extension {WORKER}, and --worker-extension-cls "
                              f"names {ext}: drop it or start without overlay updates")
        pc.worker_extension_cls = WORKER
        if getattr(pc, "_api_process_count", 1) > 1:
            raise ConfigError("overlay updates need one API server (--api-server-count 1): the routes count the "
                              "requests using each overlay in that process")


try:
    from vllm.model_executor.models.config import VerifyAndUpdateConfig
except ImportError:  # pragma: no cover - only imported where vLLM is installed
    VerifyAndUpdateConfig = object


class EngramVllmConfig(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook (`MODELS_CONFIG_MAP`): checks the options before the engine starts."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        enable_selection(model_config, check(model_config.hf_config))

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        check_runner(vllm_config)
        check_updates(vllm_config)
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ConfigError("engram's vLLM model does not support speculative decoding (its per-slot n-gram state "
                              "assumes every scheduled token is kept)")
        if getattr(vllm_config, "kv_transfer_config", None) is not None:
            raise ConfigError("engram's vLLM model does not support KV connectors: KV imported from elsewhere "
                              "arrives without the n-gram ids and conv inputs Engram keeps per slot")


class EngramAdapterVllmConfig(VerifyAndUpdateConfig):
    """The config hook of the base + adapter architectures (`adapter_model.py`): the pair checked (`pair.read_pair`:
    the wrong base refused in engram's words), the table options and overlays checked, an adapter's LoRA checked
    against vLLM's LoRA settings (`check_lora`), eager mode forced."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        from .pair import read_pair

        o = check(model_config.hf_config, read_pair(model_config.hf_config)["meta"]["engram"])
        enable_selection(model_config, o)
        model_config.enforce_eager = True

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        EngramVllmConfig.verify_and_update_config(vllm_config)
        check_lora(vllm_config)
        pc = getattr(vllm_config, "parallel_config", None)
        if pc is not None and getattr(pc, "pipeline_parallel_size", 1) > 1:
            raise ConfigError("engram's adapter in vLLM does not support pipeline parallel (the n-gram hashing runs "
                              "on the first stage's token ids); use --tensor-parallel-size")
        mc = vllm_config.model_config
        if getattr(mc, "enable_prompt_embeds", False):
            raise ConfigError("engram's adapter in vLLM does not support prompt embeddings (Engram hashes token ids)")
        mc.enforce_eager = True  # hooks and host-side hashing: no graph capture (decided after this hook)
