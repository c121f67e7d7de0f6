"""`engram train`, `engram adapt` (a run: train a model or an adapter) and what they read: `engram data prepare`,
`engram tokenizer train`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..config import ConfigError, EngramConfig
from ..tokenizer import train_bpe
from ..training.config import TrainConfig
from ..training.data import load_manifest, load_sources, prepare, split_documents
from ..training.presets import resolve_job, train_config
from . import options


def _table_flags(args) -> dict:
    """--table-mode (the training table mode), --table-cache-mb and --report-to -> TrainConfig overrides (they win
    over --set and a config file)."""
    overrides = {}
    if getattr(args, "report_to", None):
        overrides["report_to"] = ",".join(args.report_to)
    if args.table_mode:
        overrides["table_mode"] = args.table_mode
    if getattr(args, "table_cache_mb", None) is not None:
        overrides["table_cache_mb"] = args.table_cache_mb
    return overrides


def _overrides(args) -> dict:
    """--set KEY=VALUE and the table flags -> TrainConfig overrides."""
    return {**TrainConfig.parse_overrides(args.set or []), **_table_flags(args)}


def cmd_train(args) -> int:
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    # the preset, then --config FILE, then --set and --engram; checked whole before any data is read
    job = resolve_job(args.config, args.preset, _train_settings(args))
    overrides = {**job.train, **_table_flags(args)}
    # settings fail here, before the data is prepared and before N workers start (transformers is imported
    # only to check model fields)
    tcfg = train_config(job.preset, overrides, args.max_steps, world=args.nproc)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from ..training.launch import launch

        return launch(sys.argv[1:], args.nproc, args.data, tcfg.tokenizer)
    from ..training.train import train

    out = args.out or f"runs/{Path(job.source).stem if job.source else job.preset}"
    summary = train(job.preset, data=args.data, out=out, max_steps=args.max_steps, use_engram=not args.no_engram,
                    baseline=args.baseline, resume=args.resume, device=args.device, overrides=overrides,
                    model_overrides=job.model or None)
    if summary.get("interrupted"):
        return 130
    if "final" not in summary:  # a non-zero rank of a --nproc run: rank 0 reports and saves
        return 0
    print(f"done: step {summary['step']}, train loss {summary['train_loss']:.4f}, val loss {summary['val_loss']:.4f}; "
          f"model in {summary['final']}" + (f", curve in {summary['plot']}" if summary.get("plot") else ""))
    return 0


def _train_settings(args) -> list[str]:
    """--set KEY=VALUE items, then --engram KEY=VALUE as `model.engram.KEY=VALUE` (the model's Engram fields: the same
    setting, one flag name on train and adapt; checked by `resolve_job` as --set's)."""
    engram = []
    for kv in args.engram or []:
        if "=" not in kv:
            raise ConfigError(f"--engram {kv}: expected KEY=VALUE (an EngramConfig field, e.g. layer_ids=[1,3])")
        engram.append(f"model.engram.{kv}")
    return [*(args.set or []), *engram]


def cmd_adapt(args) -> int:
    from ..training.adapt import adapt

    overrides = _overrides(args)
    engram_options = _engram_options(args.engram or [])
    summary = adapt(args.base, data=args.data, out=args.out, method=args.method, layers=args.layers,
                    lora_rank=args.lora_rank, unfreeze=args.unfreeze, engram_options=engram_options,
                    lora_targets=(args.lora_targets if args.lora_targets in (None, "all-linear")
                                  else args.lora_targets.split(",")),
                    max_steps=args.max_steps, overrides=overrides, resume=args.resume, device=args.device,
                    edit_ready=args.edit_ready)
    if summary.get("interrupted"):
        return 130
    ready = " (edit-ready: rows cleared, the model is the base until an overlay writes rows)" if args.edit_ready else ""
    print(f"done: step {summary['step']}, train loss {summary['train_loss']:.4f}, val loss {summary['val_loss']:.4f}; "
          f"adapter in {summary['final']}{ready}")
    return 0


def _engram_options(items: list[str]) -> dict:
    """--engram KEY=VALUE (EngramConfig fields, JSON values: 3, [1009,1013], true) -> dict."""
    out = {}
    fields = set(EngramConfig.__dataclass_fields__) - {"layer_ids", "tokenizer_name_or_path"}
    for kv in items:
        key, sep, value = kv.partition("=")
        if not sep or key not in fields:
            raise ConfigError(f"--engram {kv}: expected KEY=VALUE with KEY one of {', '.join(sorted(fields))}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def cmd_data_prepare(args) -> int:
    d = prepare(args.data, args.tokenizer)
    m = load_manifest(d)
    print(f"prepared {d}: vocab {m['vocab_size']}, " + ", ".join(
        f"{k} {v['tokens']:,} tokens / {len(v['documents'])} docs" for k, v in m["splits"].items()))
    return 0


def cmd_tokenizer_train(args) -> int:
    docs = split_documents(load_sources(args.data))["train"]
    out = train_bpe((d.text for d in docs), args.vocab, args.out)
    print(f"wrote byte-level BPE tokenizer ({args.vocab} tokens, trained on the train split) to {out}")
    return 0


def add_commands(sub) -> None:
    presets_help = "; ".join(f"{n}: {options.PRESETS[n].summary}" for n in options.TRAIN_PRESETS)
    mode_help = ("mmap: train the Engram tables (and their Adam moments) in memory-mapped files under RUN/tables, "
                 "one per rank with --nproc (default: ram, tables as parameters in RAM / on the device)")
    t = sub.add_parser("train", help="train a preset or your own model (--config) on Shakespeare (default) or --data",
                       parents=[options.run_options("override a training setting (lr=1e-3) or a model field "
                                                    "(model.hidden_size=384)"),
                                options.engram_fields("a field of the model's Engram (EngramConfig; model.engram.KEY "
                                                      "in a --config file), e.g. layer_ids=[1,3] "
                                                      "engram_vocab_size=[20011,20011]"),
                                options.train_table_mode(mode_help)])
    t.add_argument("--preset", metavar=options.preset_metavar(),
                   help=f"the starting point (default cpu-small, or the --config file's preset): {presets_help}")
    t.add_argument("--config", metavar="FILE.toml|FILE.json",
                   help="your own model and training settings over the preset: preset = NAME, [model] "
                        "(EngramLMConfig sizes), [model.engram] (EngramConfig), [train] (TrainConfig); "
                        "--set model.KEY=VALUE / KEY=VALUE and --engram KEY=VALUE then override one field "
                        "(docs/training.md)")
    t.add_argument("--data", action="append", help="local .txt/.jsonl/.parquet file or folder, or hf:NAME (repeatable)")
    t.add_argument("--no-engram", action="store_true", help="same backbone without Engram (iso-FLOP baseline)")
    t.add_argument("--baseline", choices=options.BASELINES,
                   help="iso-param: no Engram, its parameters moved into a wider FFN")
    t.add_argument("--out", help="run directory (default runs/PRESET, or runs/FILE_STEM with --config)")
    t.add_argument("--nproc", type=int, default=1,
                   help="processes (torchrun): Engram tables row-sharded across them, dense parameters with DDP "
                        "(--set dense_parallel=fsdp2: sharded with FSDP2)")
    t.add_argument("--table-cache-mb", type=float, help="mmap: hot-row cache size in MB (default 0)")
    t.set_defaults(func=cmd_train)

    ad = sub.add_parser("adapt", help="train an Engram memory adapter (and/or LoRA) on a pretrained transformers model",
                        parents=[options.run_options(),
                                 options.engram_fields("a field of the adapter's Engram (EngramConfig), e.g. "
                                                       "engram_vocab_size=[20011,20011] n_head_per_ngram=4 (the "
                                                       "layers: --layers)"),
                                 options.train_table_mode("where the Engram tables live while training")])
    ad.add_argument("--base", required=True, help="save_pretrained folder of the base model, with its tokenizer.json, "
                    "or a model id ORG/NAME[@REVISION] in the local Hugging Face cache")
    ad.add_argument("--data", action="append", help="corpus to adapt to (as engram train; default Shakespeare)")
    ad.add_argument("--out", required=True, help="run directory (adapter in OUT/final)")
    ad.add_argument("--method", default="engram", choices=options.METHODS)
    ad.add_argument("--layers", action=options.ListFlag, item=int,
                    help="decoder layers to put Engram in front of, a comma list, e.g. 1,3 (default 1)")
    ad.add_argument("--lora-rank", type=int, help="add LoRA of this rank on the base (needs engram-torch[peft])")
    ad.add_argument("--lora-targets", metavar="all-linear|q_proj,v_proj",
                    help="modules LoRA wraps (default: PEFT's for the architecture, q_proj,v_proj for Llama)")
    ad.add_argument("--unfreeze", action=options.ListFlag, metavar="MODULE[,...]",
                    help="also train these base modules, a comma list (e.g. lm_head)")
    ad.add_argument("--edit-ready", action="store_true",
                    help="save the adapter with its rows cleared (trained projections kept): exactly the base until "
                         "`engram edit` writes facts, the starting point of fact edits")
    ad.set_defaults(func=cmd_adapt)

    dp = sub.add_parser("data", help="data preparation").add_subparsers(dest="data_command", required=True)
    prep = dp.add_parser("prepare", help="tokenize a corpus into uint32 token files + manifest")
    prep.add_argument("--data", action="append")
    prep.add_argument("--tokenizer", default="bpe:8192", help="deepseek | bpe:N | path/to/tokenizer.json")
    prep.set_defaults(func=cmd_data_prepare)

    tk = sub.add_parser("tokenizer", help="tokenizer tools").add_subparsers(dest="tok_command", required=True)
    ttrain = tk.add_parser("train", help="train a byte-level BPE tokenizer on the corpus's train split")
    ttrain.add_argument("--vocab", type=int, default=8192)
    ttrain.add_argument("--data", action="append")
    ttrain.add_argument("--out", default="tokenizer.json")
    ttrain.set_defaults(func=cmd_tokenizer_train)
