"""Use a trained model: `engram eval`, `sample`, `serve` (an OpenAI-compatible server), and the client side of
that protocol: `engram ask` / `crosscheck` against any such server (`client.py`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import install_hint
from ..serving.defaults import SERVE_MAX_BODY, SERVE_READ_TIMEOUT, SERVE_SHUTDOWN_TIMEOUT
from . import options


def cmd_eval(args) -> int:
    import math

    from ..training.train import evaluate_text

    model, tok = options.load_for_inference(args)
    options.with_overlays(model, args.overlay, args.table_format)
    loss, n_tokens, n_windows = evaluate_text(model, tok, args.data, args.split, args.seq_len, args.max_windows,
                                              args.batch_size)
    print(f"{args.split} loss {loss:.4f} nats/token, perplexity {math.exp(loss):.2f} "
          f"({n_tokens:,} tokens in {n_windows} windows of {args.seq_len})")
    return 0


def cmd_sample(args) -> int:
    import torch

    from ..adapters import generation_pad_id
    from ..placement import model_device

    model, tok = options.load_for_inference(args)
    options.with_overlays(model, args.overlay, args.table_format)
    ids = tok.encode(args.prompt, add_special_tokens=False).ids
    if not ids:
        raise ValueError("--prompt is empty after tokenization")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p {args.top_p}: give a probability mass in (0, 1] (1: every token)")
    torch.manual_seed(args.seed)
    greedy = args.temperature <= 0
    out = model.generate(torch.tensor([ids], device=model_device(model)), max_new_tokens=args.max_new_tokens,
                         do_sample=not greedy,
                         temperature=None if greedy else args.temperature,
                         top_k=None if greedy or args.top_k < 1 else args.top_k,
                         top_p=None if greedy or args.top_p >= 1 else args.top_p,
                         pad_token_id=generation_pad_id(model))
    print(tok.decode(out[0].tolist()))
    return 0


def cmd_serve(args) -> int:
    if args.engine == "vllm":
        from ..integrations.vllm.launcher import launch

        if args.dtype or args.device:  # (vLLM chooses its own device; its dtype is one of its flags)
            raise ValueError("--dtype and --device are engram's engine's; with --engine vllm give vLLM's own flags: "
                             "--vllm-args '--dtype bfloat16' (the device: CUDA_VISIBLE_DEVICES)")
        return launch(args)
    if args.tensor_parallel_size != 1 or args.vllm_args:
        raise ValueError("--tensor-parallel-size and --vllm-args need --engine vllm")
    from ..serving import load_engine
    from ..serving.app import serve

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401  (GET /metrics)
        import uvicorn  # noqa: F401
    except ImportError:
        raise ImportError(f"engram serve needs FastAPI, uvicorn and prometheus-client: {install_hint('serve')}") \
            from None
    if (args.path is None) == (args.base is None):
        raise ValueError("give a model: --checkpoint DIR (a run dir, model folder or qwen4_exp folder) "
                         "or --base DIR [--adapter DIR]")
    overlays = options.overlay_dirs(args.overlay, need_names=True)
    for flag in ("max_body_bytes", "read_timeout", "shutdown_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    engine = load_engine(args.path, args.base, args.adapter, overlays, args.table_tier, args.table_format,
                         args.table_dir, args.name, args.chat_template, dtype=args.dtype, device=args.device)
    serve(engine, args.host, args.port, args.api_key or os.environ.get("ENGRAM_API_KEY") or None,
          max_body=args.max_body_bytes, read_timeout=args.read_timeout, shutdown_timeout=args.shutdown_timeout,
          allow_overlay_updates=args.allow_overlay_updates)
    # shut down, engine closed, nothing left to write: skip the interpreter's teardown of torch and transformers
    # (1-3 s on two busy cores), so SIGTERM ends the process within --shutdown-timeout
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _settings(args):
    """The client's settings from --model / --base-url (and the environment); a note if the URL was normalized."""
    from .client import load_settings

    s = load_settings(args.model, args.base_url)
    if s.note:
        print(f"engram: note: {s.note}", file=sys.stderr)
    return s


def cmd_ask(args) -> int:
    from .client import chat

    s = _settings(args)
    print(chat([{"role": "user", "content": args.prompt}], s, timeout=args.timeout, retries=args.retries))
    return 0


def cmd_crosscheck(args) -> int:
    from .client import crosscheck

    s = _settings(args)
    model, tok = options.load_for_inference(args)
    res = crosscheck(args.text, model, tok, s, threshold=args.threshold, timeout=args.timeout, retries=args.retries)
    if args.json:
        print(json.dumps(res, indent=1, ensure_ascii=False))
        return 0
    print(f"entities and phrases from {s.model}: {res['entities']}")
    layers = list(res["tokens"][0]["gates"]) if res["tokens"] else []
    print(f"{'token':<18}" + "".join(f"{'gate L' + l:>10}" for l in layers) + f"{'entity':>9}")
    for r in res["tokens"]:
        mark = "ends" if r["ends"] else ("inside" if r["inside"] else "")
        print(f"{r['token']!r:<18}" + "".join(f"{r['gates'][l]:>10.3f}" for l in layers) + f"{mark:>9}")
    p, r = ("n/a" if v is None else f"{v:.2f}" for v in (res["precision"], res["recall"]))
    print(f"gate > {res['threshold']} vs token ends an entity: precision {p}, recall {r}")
    return 0


def _channel() -> argparse.ArgumentParser:
    """The server `engram ask` / `crosscheck` talk to: --model, --base-url, --timeout, --retries."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", help="model id (default $ENGRAM_MODEL or deepseek-chat)")
    p.add_argument("--base-url", help="OpenAI-compatible base URL (default $ENGRAM_BASE_URL or DeepSeek)")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--retries", type=int, default=3, help="retries with backoff on 429/5xx")
    return p


def add_commands(sub) -> None:
    e = sub.add_parser("eval", help="validation loss and perplexity of a checkpoint",
                       parents=[options.model_source(), options.eval_windows(max_windows=None), options.overlays(),
                                options.table_format(), options.table_tier()])
    e.set_defaults(func=cmd_eval)

    sm = sub.add_parser("sample", help="generate text from a checkpoint",
                        parents=[options.model_source(), options.overlays(), options.table_format(),
                                 options.table_tier()])
    sm.add_argument("--prompt", required=True)
    sm.add_argument("--max-new-tokens", type=int, default=60)
    sm.add_argument("--temperature", type=float, default=0.8, help="0: greedy decoding")
    sm.add_argument("--top-k", type=int, default=50, help="sample from the k likeliest tokens (0: all; default 50)")
    sm.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus sampling: from the likeliest tokens whose probabilities sum to P (1, the default: "
                         "all; as engram serve's top_p)")
    sm.add_argument("--seed", type=int, default=0)
    sm.set_defaults(func=cmd_sample)

    # (--checkpoint and --served-model-name are parsed into `path` and `name`: what `integrations.vllm.launcher` reads)
    sv = sub.add_parser("serve", help="an OpenAI-compatible server for an Engram model (overlays chosen per request)",
                        parents=[options.model_source(checkpoint_help="run dir or model folder (engram, or a "
                                                      "qwen4_exp model)", checkpoint_dest="path"),
                                 options.overlays(metavar="NAME=DIR", help="load a fact overlay, served as model "
                                                  "MODEL+NAME, chosen per request (repeatable; also with --engine "
                                                  "vllm, where a plain DIR is applied to every request)"),
                                 options.table_format(), options.table_tier()])
    sv.add_argument("path", nargs="?", action=options.DeprecatedFlag, new="--checkpoint", old="engram serve PATH")
    sv.add_argument("--served-model-name", dest="name", metavar="NAME",
                    help="the model id clients send (default: the folder's name; as vLLM's flag)")
    sv.add_argument("--name", dest="name", action=options.DeprecatedFlag, new="--served-model-name")
    sv.add_argument("--chat-template", help="'plain' (role: content lines) or a Jinja file; default: the tokenizer's "
                    "own (tokenizer_config.json), else /v1/chat/completions is refused")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default $ENGRAM_API_KEY; none: open)")
    sv.add_argument("--max-body-bytes", type=int, default=SERVE_MAX_BODY,
                    help="largest request body taken; larger ones get 413 (default 1 MiB)")
    sv.add_argument("--read-timeout", type=float, default=SERVE_READ_TIMEOUT,
                    help="seconds a client gets to send a request's headers, and again its body (default 30; 408)")
    sv.add_argument("--shutdown-timeout", type=float, default=SERVE_SHUTDOWN_TIMEOUT,
                    help="on SIGTERM, seconds requests in flight get to finish before they are cancelled (default 30)")
    sv.add_argument("--allow-overlay-updates", action="store_true", default=None,
                    help="add POST /v1/load_overlay and /v1/unload_overlay, both engines (default off: 404; or "
                         "ENGRAM_ALLOW_OVERLAY_UPDATES=1, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    sv.add_argument("--engine", default="engram", choices=("engram", "vllm"),
                    help="engram: this process, one request at a time, overlays per request; vllm: vLLM's OpenAI "
                    "server (continuous batching, tensor parallel, overlays per request; docs/serve.md)")
    sv.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="--engine vllm: ranks (CPU: one per core group)")
    sv.add_argument("--max-model-len", type=int, help="--engine vllm: the longest sequence (default: the model's "
                    "context, at most 4096); sizes the KV cache")
    sv.add_argument("--max-num-seqs", type=int, help="--engine vllm: sequences decoded at once (default 16); sizes "
                    "the KV cache")
    sv.add_argument("--kv-cache-gib", type=float, help="--engine vllm on a CPU: the KV cache's GiB (default: what "
                    "--max-num-seqs sequences of --max-model-len tokens need, printed at startup; vLLM's own default "
                    "takes 92%% of RAM)")
    sv.add_argument("--vllm-args", help="--engine vllm: more vLLM server flags, one quoted string "
                    "(e.g. \"--max-num-batched-tokens 256 --max-model-len 2048\")")
    sv.set_defaults(func=cmd_serve)

    a = sub.add_parser("ask", help="one chat completion through an OpenAI-compatible API (checks the channel)",
                       parents=[_channel()])
    a.add_argument("prompt")
    a.set_defaults(func=cmd_ask)

    x = sub.add_parser("crosscheck", help="compare a model's gates with a hosted model's entities in TEXT",
                       parents=[_channel(), options.model_source()])
    x.add_argument("text")
    x.add_argument("--threshold", type=float, default=0.5)
    x.add_argument("--json", action="store_true")
    x.set_defaults(func=cmd_crosscheck)
