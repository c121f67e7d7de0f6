"""The `engram` command: one thin function per command over the library, and the parser.

Modules that import transformers, matplotlib or torch.distributed (model, training, analysis,
the launcher) are imported inside the commands that use them, so `engram hash` and `engram
--help` do not pay for them (~2 s for transformers alone).

Every expected failure (bad config, missing file, bad ids) prints one line
`engram: error: ...` and exits with status 2; no Python traceback. Set ENGRAM_DEBUG=1 to
see tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .api import ApiError, chat, crosscheck, load_settings
from .config import BackBoneConfig, ConfigError, EngramConfig, TrainConfig, load_config
from .hashing import get_hash_mapping
from .tokenizer import bos_id, encode, load_tokenizer, train_bpe
from .training.data import load_manifest, load_sources, prepare, split_documents
from .training.presets import PRESETS, TRAIN_PRESETS, train_config

DEMO_TEXT = "Only Alexander the Great could tame the horse Bucephalus."


def _configs(path):
    return load_config(path) if path else (EngramConfig(), BackBoneConfig())


# ------------------------------------------------------------------------------------------ model commands
def cmd_demo(args) -> int:
    import dataclasses

    from .demo import run_demo

    ecfg, bcfg = _configs(args.config)
    if args.table_dtype:
        ecfg = dataclasses.replace(ecfg, table_dtype=args.table_dtype)
    print(f"Building demo LLM: {bcfg.num_layers} layers, hidden {bcfg.hidden_size}, hc_mult {bcfg.hc_mult}, vocab "
          f"{bcfg.vocab_size}, Engram at layers {ecfg.layer_ids} (tables stored as {ecfg.table_dtype})", flush=True)
    r = run_demo(args.text, ecfg, bcfg, mock_blocks=args.mock_blocks, seed=args.seed, bos=not args.no_bos)
    if r["mock_blocks"] and not args.mock_blocks:
        print("  (transformers not installed: real blocks need pip install 'engram-torch[hf]'; using --mock-blocks)")
    print(f"  parameters: {r['params'] / 1e6:.1f}M, of which Engram tables {r['table_params'] / 1e6:.1f}M; {r['blocks']}")
    print(f"Input text : {args.text!r}")
    print(f"Tokens     : {r['tokens']}")
    print(_bos_note(r["bos_token"], args.no_bos))
    print(f"Input shape  : {r['input_shape']}")
    print(f"Output shape : {r['output_shape']}")
    for lid, g in r["layers"].items():
        print(f"Layer {lid:>2}: hash shape {g['hash_shape']}; gate min {g['gate_min']:.4f} max {g['gate_max']:.4f} "
              f"mean {g['gate_mean']:.4f}")
    print(f"Wall time: build {r['build_s']:.1f} s, forward {r['forward_s']:.2f} s, total {r['total_s']:.1f} s; "
          f"peak RSS {r['peak_rss_gib']:.2f} GiB")
    return 0


def _bos_note(bos_token, no_bos: bool) -> str:
    if no_bos:
        return "  (tokenized without a BOS token: --no-bos)"
    if bos_token is None:
        return "  (this tokenizer has no BOS token we know; none prepended)"
    return f"  (BOS {bos_token} prepended, as the tutorial's AutoTokenizer does; --no-bos leaves it out)"


def cmd_hash(args) -> int:
    import numpy as np

    ecfg, _ = _configs(args.config)
    mapping = get_hash_mapping(ecfg)
    tok = load_tokenizer(ecfg.tokenizer_name_or_path)
    ids, tokens = encode(tok, args.text, bos=not args.no_bos)
    ids = np.array([ids], dtype=np.int64).reshape(1, -1)
    comp = mapping.compressed_tokenizer(ids)[0]
    hashes = mapping.hash(ids)
    prepended = None if args.no_bos else bos_id(tok)
    print(_bos_note(prepended[1] if prepended else None, args.no_bos).strip())
    print(f"{'pos':>3}  {'token':<16} {'id':>7} {'comp':>7}")
    for t, (tokstr, i, c) in enumerate(zip(tokens, ids[0], comp)):
        print(f"{t:>3}  {tokstr!r:<16} {i:>7} {c:>7}")
    K = mapping.n_head_per_ngram
    for lid in mapping.layer_ids:
        cols = ", ".join(f"{n}-gram h{k}" for n in range(2, mapping.max_ngram_size + 1) for k in range(K))
        print(f"\nlayer {lid}: per-head row ids [T={ids.shape[1]}, {hashes[lid].shape[-1]}] (columns: {cols})")
        for t in range(ids.shape[1]):
            print(f"{t:>3}  " + " ".join(f"{int(v):>7}" for v in hashes[lid][0, t]))
    return 0


def cmd_spec(args) -> int:
    mapping = get_hash_mapping(_configs(args.config)[0])
    mapping.save_spec(args.out, include_lookup_table=not args.no_table)
    print(f"wrote hash spec for layers {mapping.layer_ids} to {args.out}")
    return 0


# ------------------------------------------------------------------------------------------ training
def cmd_train(args) -> int:
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    overrides = TrainConfig.parse_overrides(args.set or [])
    if args.table_backend:
        overrides["table_backend"] = args.table_backend
    if args.table_cache_mb is not None:
        overrides["table_cache_mb"] = args.table_cache_mb
    # settings fail here, before transformers is imported and before N workers start
    tcfg = train_config(args.preset, overrides, args.max_steps, world=args.nproc)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from .training.launch import launch

        return launch(sys.argv[1:], args.nproc, args.data, tcfg.tokenizer)
    from .training.train import train

    summary = train(args.preset, data=args.data, out=args.out or f"runs/{args.preset}", max_steps=args.max_steps,
                    use_engram=not args.no_engram, baseline=args.baseline, resume=args.resume, device=args.device,
                    overrides=overrides)
    if summary.get("interrupted"):
        return 130
    if "final" not in summary:  # a non-zero rank of a --nproc run: rank 0 reports and saves
        return 0
    print(f"done: step {summary['step']}, train loss {summary['train_loss']:.4f}, val loss {summary['val_loss']:.4f}; "
          f"model in {summary['final']}" + (f", curve in {summary['plot']}" if summary.get("plot") else ""))
    return 0


def _load_for_inference(args):
    """(model, tokenizer) from --checkpoint (an engram model) or --base [--adapter] (a transformers model)."""
    if args.base:
        if args.checkpoint:
            raise ValueError("give either --checkpoint (an engram model) or --base [--adapter], not both")
        from .training.adapt import load_with_adapter

        return load_with_adapter(args.base, args.adapter)
    if args.adapter:
        raise ValueError("--adapter needs --base DIR (the pretrained model it was trained on)")
    if not args.checkpoint:
        raise ValueError("give --checkpoint RUN_DIR (an engram model) or --base DIR [--adapter DIR]")
    from .model import load_model

    return load_model(args.checkpoint)


def _with_overlays(model, overlays, table_format=None):
    """--overlay DIR (each checked against the model, then stacked in order: later ones win on shared rows)
    and --table-format (bfloat16, int8 or fp8 rows, dequantized after the gather; overlays are checked
    against the model's own rows first, then applied in front of the converted tables)."""
    loaded = []
    if overlays:
        from .editing import Overlay, check_overlay, model_digest

        loaded = [Overlay.load(d) for d in overlays]
        digest = model_digest(model)  # (hashes the dense weights: once for all overlays)
        for o in loaded:
            check_overlay(model, o, digest=digest)
    if table_format and table_format != "float32":
        from .tables.quant import set_table_format

        set_table_format(model, table_format)
    if loaded:
        from .editing import apply_overlay

        for o in loaded:
            apply_overlay(model, o, check=False)
    return model


def cmd_edit(args) -> int:
    from .editing import edit_facts, edit_report, print_report, read_facts
    from .training.data import text_windows

    if args.out and Path(args.out).is_file():
        raise ValueError(f"--out {args.out} is a file; give a folder for the overlay")
    model, tok = _load_for_inference(args)
    facts = read_facts(args.facts, tok)  # every fact checked before anything runs or is written
    _with_overlays(model, args.overlay)
    windows = text_windows(tok, args.data, args.split, args.seq_len, args.max_windows)
    print(f"editing {len(facts)} facts: rows at {args.positions} positions, orders "
          f"{args.orders or 'highest'}, up to {args.steps} steps", file=sys.stderr)
    overlay = edit_facts(model, tok, facts, steps=args.steps, lr=args.lr, positions=args.positions,
                         orders=args.orders, target_prob=args.target_prob)
    overlay.meta["base"] = str(args.checkpoint or f"{args.base} + {args.adapter}")
    report = edit_report(model, tok, facts, overlay, windows, args.batch_size)
    overlay.meta["summary"] = report["summary"]
    out = overlay.save(args.out, {"report.json": json.dumps(report, indent=1) + "\n"})
    print_report(report)
    print(f"wrote overlay {out} ({overlay.num_rows:,} rows) and {out / 'report.json'}; apply it with --overlay {out}")
    return 0


def cmd_adapt(args) -> int:
    from .training.adapt import adapt

    overrides = TrainConfig.parse_overrides(args.set or [])
    if args.table_backend:
        overrides["table_backend"] = args.table_backend
    options = _engram_options(args.engram or [])
    summary = adapt(args.base, data=args.data, out=args.out, method=args.method, layers=args.layers,
                    lora_rank=args.lora_rank, unfreeze=args.unfreeze, engram_options=options,
                    lora_targets=(args.lora_targets if args.lora_targets in (None, "all-linear")
                                  else args.lora_targets.split(",")),
                    max_steps=args.max_steps, overrides=overrides, resume=args.resume, device=args.device)
    if summary.get("interrupted"):
        return 130
    print(f"done: step {summary['step']}, train loss {summary['train_loss']:.4f}, val loss {summary['val_loss']:.4f}; "
          f"adapter in {summary['final']}")
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


def cmd_eval(args) -> int:
    import math

    from .training.train import evaluate_text

    model, tok = _load_for_inference(args)
    _with_overlays(model, args.overlay, args.table_format)
    loss, n_tokens, n_windows = evaluate_text(model, tok, args.data, args.split, args.seq_len, args.max_windows,
                                              args.batch_size)
    print(f"{args.split} loss {loss:.4f} nats/token, perplexity {math.exp(loss):.2f} "
          f"({n_tokens:,} tokens in {n_windows} windows of {args.seq_len})")
    return 0


def cmd_sample(args) -> int:
    import torch

    from .adapters import generation_pad_id

    model, tok = _load_for_inference(args)
    _with_overlays(model, args.overlay, args.table_format)
    ids = tok.encode(args.prompt, add_special_tokens=False).ids
    if not ids:
        raise ValueError("--prompt is empty after tokenization")
    torch.manual_seed(args.seed)
    greedy = args.temperature <= 0
    out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=not greedy,
                         temperature=None if greedy else args.temperature, top_k=None if greedy else args.top_k,
                         pad_token_id=generation_pad_id(model))
    print(tok.decode(out[0].tolist()))
    return 0


def cmd_verify(args) -> int:
    from .verify import verify_path, write_missing_block_sums

    if args.write_blocks:
        for f in write_missing_block_sums(args.path):
            print(f"wrote block checksums {f}")
    results = verify_path(args.path)
    for what, status, detail in results:
        print(f"{status:<10} {what}" + (f": {detail}" if detail else ""))
    n = {k: sum(s == k for _, s, _ in results) for k in ("ok", "unverified", "BAD")}
    print(f"{n['ok']} of {len(results)} intact" + (f", {n['unverified']} unverified (no checksums)" if n["unverified"]
                                                    else "") + (f"; {n['BAD']} damaged" if n["BAD"] else ""))
    return 1 if n["BAD"] else 0


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


# ------------------------------------------------------------------------------------------ analysis
def cmd_experiment(args) -> int:
    from .analysis import experiments

    if args.list or not args.name:
        print(experiments.__doc__.split("Experiments:")[1].rstrip())
        return 0
    for n in experiments.EXPERIMENTS if args.name == "all" else [args.name]:
        experiments.run_experiment(n, out=args.out, seeds=args.seeds, preset=args.preset, data=args.data,
                                   max_steps=args.max_steps, size=args.size, checkpoint=args.checkpoint,
                                   scale=args.scale, record=args.record, plan_only=args.plan_only,
                                   finished_only=args.finished_only,
                                   variants_only=args.variants.split(",") if args.variants else None)
    return 0


def cmd_results(args) -> int:
    from .analysis import report

    return report.main(args.dir, args.template, args.out, args.img, check=args.check)


def cmd_gates(args) -> int:
    from .analysis import gates as G
    from .model import load_model

    model, tok = load_model(args.checkpoint)
    _with_overlays(model, args.overlay)
    tokens, gates = G.compute_gates(model, tok, args.text)
    print(G.terminal(tokens, gates))
    for layer in sorted(gates):
        g = gates[layer]
        print(f"layer {layer}: gate min {g.min():.3f} max {g.max():.3f} mean {g.mean():.3f}")
    if args.out:
        G.save(tokens, gates, Path(args.out), title=args.text)
        print(f"wrote {args.out}")
    if args.summary:
        for layer, r in G.run_gate_summary(model, Path(args.checkpoint)).items():
            print(f"layer {layer}: mean gate on frequent n-gram completions {r['entity_completion']:.3f} "
                  f"({r['n_entity']} tokens) vs function words {r['function_words']:.3f} ({r['n_function']} tokens); "
                  f"all {r['all']:.3f}")
    return 0


def cmd_stats(args) -> int:
    from .analysis import stats as S

    if args.v41:
        return _stats_v41(args, S)
    r = S.report(args.data, args.tokenizer, args.sizes)
    c = r["compression"]
    print(f"tokenizer {Path(r['tokenizer_file']).name}: {c['vocab']:,} ids -> {c['compressed']:,} compressed "
          f"({c['reduction']:.2%} reduction); largest merged groups:")
    for g in c["largest_groups"]:
        print(f"  {g['size']:>3} ids: {g['tokens']}")
    print(f"\nrow usage on the train split ({r['train_tokens']:,} tokens), one head per order:")
    print(f"{'order':>5} {'rows':>9} {'distinct':>9} {'used':>9} {'usage':>7} {'collide':>8}")
    for u in r["row_usage"]:
        print(f"{u['order']:>5} {u['table_rows']:>9,} {u['distinct_ngrams']:>9,} {u['rows_used']:>9,} "
              f"{u['row_usage']:>7.1%} {u['collision_rate']:>8.1%}")
    for n, cnt in r["zipf"].items():
        top = cnt[: max(1, len(cnt) // 100)].sum() / cnt.sum()
        print(f"{n}-grams: {len(cnt):,} distinct; top 1% of them cover {top:.1%} of occurrences")
    if args.out:
        S.plot_zipf(r["zipf"], Path(args.out))
        print(f"wrote {args.out}")
    return 0


def _stats_v41(args, S) -> int:
    """`engram stats --v41 DIR`: a DeepSeek-V4.1 checkpoint's own hashing on a corpus (its tokenizer)."""
    import numpy as np

    from .integrations import deepseek_v41 as v41
    from .training.data import load_manifest, load_split, prepare

    d = Path(args.v41)
    mapping = v41.hash_mapping(d / "config.json", d / "tokenizer.json")
    data_dir = prepare(args.data, str((d / "tokenizer.json").resolve()))
    ids = np.asarray(load_split(data_dir, "train"), dtype=np.int64)
    print(f"{d.name}: hashing of layers {mapping.layer_ids} on {len(ids):,} train tokens of "
          f"{load_manifest(data_dir).get('sources', args.data or 'shakespeare')}")
    print(f"{'layer':>5} {'order':>5} {'head':>4} {'rows':>11} {'distinct':>9} {'used':>9} {'usage':>8} {'collide':>8}")
    for u in S.mapping_usage(mapping, ids):
        print(f"{u['layer']:>5} {u['order']:>5} {u['head']:>4} {u['head_rows']:>11,} {u['distinct_ngrams']:>9,} "
              f"{u['rows_used']:>9,} {u['row_usage']:>8.3%} {u['collision_rate']:>8.2%}")
    return 0


# ------------------------------------------------------------------------------------------ model channel
def cmd_ask(args) -> int:
    s = load_settings(args.model, args.base_url)
    if s.note:
        print(f"engram: note: {s.note}", file=sys.stderr)
    print(chat([{"role": "user", "content": args.prompt}], s, timeout=args.timeout, retries=args.retries))
    return 0


def cmd_crosscheck(args) -> int:
    from .model import load_model

    s = load_settings(args.model, args.base_url)
    if s.note:
        print(f"engram: note: {s.note}", file=sys.stderr)
    model, tok = load_model(args.checkpoint)
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
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"gate > {res['threshold']} vs token ends an entity: precision {fmt(res['precision'])}, "
          f"recall {fmt(res['recall'])}")
    return 0


# ------------------------------------------------------------------------------------------ parser
def _model_commands(sub) -> None:
    d = sub.add_parser("demo", help="run the tutorial's forward demo (30 layers, Engram at [1, 15])")
    d.add_argument("--text", default=DEMO_TEXT)
    d.add_argument("--config", help="engram_config.json with sections 'engram' and 'backbone'")
    d.add_argument("--table-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="storage dtype of the Engram tables (default bfloat16: 2 x 662M rows fit the 8 GiB budget)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--mock-blocks", action="store_true",
                   help="the reference demo's pass-through attention/MoE instead of real blocks")
    d.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token (the tutorial does)")
    d.set_defaults(func=cmd_demo)

    h = sub.add_parser("hash", help="print tokens, compressed ids and per-head row ids of TEXT")
    h.add_argument("text")
    h.add_argument("--config")
    h.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token (the tutorial does)")
    h.set_defaults(func=cmd_hash)

    s = sub.add_parser("spec", help="write the self-describing hashing manifest (JSON)")
    s.add_argument("--out", required=True)
    s.add_argument("--config")
    s.add_argument("--no-table", action="store_true", help="omit the inline token->compressed-id lookup table")
    s.set_defaults(func=cmd_spec)


def _training_commands(sub) -> None:
    presets_help = "; ".join(f"{n}: {PRESETS[n].summary}" for n in TRAIN_PRESETS)
    t = sub.add_parser("train", help="train a preset on Shakespeare (default) or --data")
    t.add_argument("--preset", default="cpu-small", metavar="{" + ",".join(TRAIN_PRESETS) + "}", help=presets_help)
    t.add_argument("--data", action="append", help="local .txt/.jsonl/.parquet file or folder, or hf:NAME (repeatable)")
    t.add_argument("--no-engram", action="store_true", help="same backbone without Engram (iso-FLOP baseline)")
    t.add_argument("--baseline", choices=["iso-flop", "iso-param"],
                   help="iso-param: no Engram, its parameters moved into a wider FFN")
    t.add_argument("--max-steps", type=int)
    t.add_argument("--out", help="run directory (default runs/PRESET)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last good checkpoint")
    t.add_argument("--device", help="cpu | cuda (default: cuda if available)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a training setting, e.g. lr=1e-3")
    t.add_argument("--nproc", type=int, default=1,
                   help="processes (torchrun): Engram tables row-sharded across them, dense parameters with DDP "
                        "(--set dense_parallel=fsdp2: sharded with FSDP2)")
    t.add_argument("--table-backend", choices=["param", "mmap"],
                   help="mmap: train the Engram tables (and their Adam moments) in memory-mapped files "
                        "under RUN/tables, one per rank with --nproc (default: param, tables in RAM)")
    t.add_argument("--table-cache-mb", type=float, help="mmap: hot-row cache size in MB (default 0)")
    t.set_defaults(func=cmd_train)

    ad = sub.add_parser("adapt", help="train an Engram memory adapter (and/or LoRA) on a pretrained transformers model")
    ad.add_argument("--base", required=True, help="save_pretrained folder of the base model, with its tokenizer.json")
    ad.add_argument("--data", action="append", help="corpus to adapt to (as engram train; default Shakespeare)")
    ad.add_argument("--out", required=True, help="run directory (adapter in OUT/final)")
    ad.add_argument("--method", default="engram", choices=["engram", "lora", "lora+engram", "full"])
    ad.add_argument("--layers", help="decoder layers to put Engram in front of, e.g. 1,3 (default 1)")
    ad.add_argument("--lora-rank", type=int, help="add LoRA of this rank on the base (needs engram-torch[peft])")
    ad.add_argument("--lora-targets", metavar="all-linear|q_proj,v_proj",
                    help="modules LoRA wraps (default: PEFT's for the architecture, q_proj,v_proj for Llama)")
    ad.add_argument("--unfreeze", action="append", metavar="MODULE", help="also train this base module (e.g. lm_head)")
    ad.add_argument("--engram", action="append", metavar="KEY=VALUE",
                    help="Engram option, e.g. engram_vocab_size=[20011,20011] n_head_per_ngram=4")
    ad.add_argument("--max-steps", type=int)
    ad.add_argument("--resume", action="store_true", help="continue the run in --out from its last good checkpoint")
    ad.add_argument("--device", help="cpu | cuda (default: cuda if available)")
    ad.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a training setting, e.g. lr=1e-3")
    ad.add_argument("--table-backend", choices=["param", "mmap"], help="where the Engram tables live while training")
    ad.set_defaults(func=cmd_adapt)

    e = sub.add_parser("eval", help="validation loss and perplexity of a checkpoint")
    e.add_argument("--checkpoint", help="run dir or save_pretrained folder of an engram model")
    e.add_argument("--base", help="a pretrained transformers model folder (with --adapter: plus that adapter)")
    e.add_argument("--adapter", help="Engram adapter folder (or LoRA folder, or an `engram adapt` run dir)")
    e.add_argument("--data", action="append")
    e.add_argument("--split", default="val", choices=["train", "val", "test"])
    e.add_argument("--seq-len", type=int, default=256)
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--max-windows", type=int, default=None)
    e.add_argument("--overlay", action="append", metavar="DIR",
                    help="apply this engram edit overlay (repeatable: stacked in order; leave out to undo)")
    e.add_argument("--table-format", choices=["float32", "bfloat16", "int8", "fp8", "fp8_ue8m0"],
                    help="serve the Engram tables as these rows (int8/fp8: per-row scale, dequantized after the gather)")
    e.set_defaults(func=cmd_eval)

    sm = sub.add_parser("sample", help="generate text from a checkpoint")
    sm.add_argument("--checkpoint", help="run dir or save_pretrained folder of an engram model")
    sm.add_argument("--base", help="a pretrained transformers model folder (with --adapter: plus that adapter)")
    sm.add_argument("--adapter", help="Engram adapter folder (or LoRA folder, or an `engram adapt` run dir)")
    sm.add_argument("--prompt", required=True)
    sm.add_argument("--max-new-tokens", type=int, default=60)
    sm.add_argument("--temperature", type=float, default=0.8, help="0: greedy decoding")
    sm.add_argument("--top-k", type=int, default=50)
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--overlay", action="append", metavar="DIR",
                    help="apply this engram edit overlay (repeatable: stacked in order; leave out to undo)")
    sm.add_argument("--table-format", choices=["float32", "bfloat16", "int8", "fp8", "fp8_ue8m0"],
                    help="serve the Engram tables as these rows (int8/fp8: per-row scale, dequantized after the gather)")
    sm.set_defaults(func=cmd_sample)

    ed = sub.add_parser("edit", help="write facts into Engram table rows: an overlay for --overlay (engram edit)")
    ed.add_argument("--checkpoint", help="run dir or save_pretrained folder of an engram model")
    ed.add_argument("--base", help="a pretrained transformers model folder (with --adapter: its Engram adapter)")
    ed.add_argument("--adapter", help="Engram adapter folder (or an `engram adapt` run dir)")
    ed.add_argument("--facts", required=True, help='JSONL, one {"prompt": ..., "target": ...} per line '
                    '(optional "paraphrases": [...], "passages": [...])')
    ed.add_argument("--out", required=True, help="overlay folder to write (with report.json)")
    ed.add_argument("--steps", type=int, default=300, help="most optimization steps (stops once every fact is met)")
    ed.add_argument("--lr", type=float, default=0.1, help="Adam learning rate on the edited rows")
    ed.add_argument("--positions", default="trigger", choices=["trigger", "all"],
                    help="trigger: rows read where the target is predicted; all: every prompt position too")
    ed.add_argument("--orders", type=int, nargs="+", help="n-gram orders whose rows change (default: the highest)")
    ed.add_argument("--target-prob", type=float, default=0.9, help="stop when every target token has this probability")
    ed.add_argument("--data", action="append", help="text for the collision set and locality (default Shakespeare)")
    ed.add_argument("--split", default="val", choices=["train", "val", "test"])
    ed.add_argument("--seq-len", type=int, default=256)
    ed.add_argument("--max-windows", type=int, default=64)
    ed.add_argument("--batch-size", type=int, default=16)
    ed.add_argument("--overlay", action="append", metavar="DIR",
                    help="apply this engram edit overlay (repeatable: stacked in order; leave out to undo)")
    ed.set_defaults(func=cmd_edit)

    vf = sub.add_parser("verify", help="check a run, model, adapter, overlay or checkpoint folder against its checksums")
    vf.add_argument("path")
    vf.add_argument("--write-blocks", action="store_true",
                    help="first add block checksums to table files that have none (trust their current contents)")
    vf.set_defaults(func=cmd_verify)

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


def _analysis_commands(sub) -> None:
    ex = sub.add_parser("experiment", help="evidence experiments (iso, placement, capacity, ablations, sensitivity, "
                                           "retrofit, edit, allocation, all)")
    ex.add_argument("name", nargs="?")
    ex.add_argument("--list", action="store_true")
    ex.add_argument("--seeds", type=int, default=3)
    ex.add_argument("--out", default="runs/experiments")
    ex.add_argument("--record", metavar="DIR", help="also write the per-seed results to DIR/NAME.json "
                                                    "(docs/results in this repository; `engram results` renders them)")
    ex.add_argument("--preset", default="exp", metavar="{" + ",".join(TRAIN_PRESETS) + "}",
                    help="model/training preset of every run")
    ex.add_argument("--data", action="append")
    ex.add_argument("--max-steps", type=int)
    ex.add_argument("--size", default="default", choices=["default", "small"], help="small: fewer capacity points")
    ex.add_argument("--checkpoint", help="edit: a trained cpu-small run to edit (default: train one in OUT/edit/base)")
    ex.add_argument("--scale", default="cpu", choices=["cpu", "gpu", "tiny"],
                    help="allocation: cpu (hidden 128, ~100 min on 2 cores), gpu (hidden 512, 12 layers), tiny (tests)")
    ex.add_argument("--finished-only", action="store_true",
                    help="train nothing: summarize (and --record) the runs that have finished")
    ex.add_argument("--variants", metavar="A,B",
                    help="allocation: train only these variants (e.g. moe-E16,moe-E14+engram); the others are "
                         "reported where their runs finished")
    ex.add_argument("--plan-only", action="store_true",
                    help="allocation: write and print the accounting (parameters, widths, primes, FLOPs); train nothing")
    ex.set_defaults(func=cmd_experiment)

    rs = sub.add_parser("results", help="regenerate docs/results.md and its plots from the per-seed files in docs/results/")
    rs.add_argument("--dir", default="docs/results", help="per-seed JSON files (default docs/results)")
    rs.add_argument("--template", default="docs/results.in.md")
    rs.add_argument("--out", default="docs/results.md")
    rs.add_argument("--img", default="docs/img", help="where the plots go ('' for none)")
    rs.add_argument("--check", action="store_true", help="only check that OUT is up to date (exit 1 if not)")
    rs.set_defaults(func=cmd_results)

    ga = sub.add_parser("gates", help="token-level Engram gate heatmap (terminal, --out FILE.png or FILE.html)")
    ga.add_argument("--checkpoint", required=True)
    ga.add_argument("--text", required=True)
    ga.add_argument("--out")
    ga.add_argument("--summary", action="store_true", help="mean gate on n-gram completions vs function words (val)")
    ga.add_argument("--overlay", action="append", metavar="DIR",
                    help="apply this engram edit overlay (repeatable: stacked in order; leave out to undo)")
    ga.set_defaults(func=cmd_gates)

    st = sub.add_parser("stats", help="tokenizer compression, table row usage/collisions, n-gram Zipf plot")
    st.add_argument("--data", action="append")
    st.add_argument("--tokenizer", default="deepseek", help="deepseek | bpe:N | path/to/tokenizer.json")
    st.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000, 1000000])
    st.add_argument("--out", help="rank-frequency plot (.png)")
    st.add_argument("--v41", metavar="DIR", help="a DeepSeek-V4.1 checkpoint folder: its own hashing's row use and "
                    "collisions on --data (tokenized with its tokenizer)")
    st.set_defaults(func=cmd_stats)


def _channel_commands(sub) -> None:
    for name, helptext in (("ask", "one chat completion through an OpenAI-compatible API (checks the channel)"),
                           ("crosscheck", "compare a checkpoint's gates with a hosted model's entities in TEXT")):
        a = sub.add_parser(name, help=helptext)
        a.add_argument("prompt" if name == "ask" else "text")
        if name == "crosscheck":
            a.add_argument("--checkpoint", required=True)
            a.add_argument("--threshold", type=float, default=0.5)
            a.add_argument("--json", action="store_true")
        a.add_argument("--model", help="model id (default $ENGRAM_MODEL or deepseek-chat)")
        a.add_argument("--base-url", help="OpenAI-compatible base URL (default $ENGRAM_BASE_URL or DeepSeek)")
        a.add_argument("--timeout", type=float, default=60.0)
        a.add_argument("--retries", type=int, default=3, help="retries with backoff on 429/5xx")
        a.set_defaults(func=cmd_ask if name == "ask" else cmd_crosscheck)


def cmd_serve(args) -> int:
    from .serving import load_engine
    from .serving.app import serve

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ImportError("engram serve needs FastAPI and uvicorn: pip install 'engram-torch[serve]'") from None
    if (args.path is None) == (args.base is None):
        raise ValueError("give a model (PATH: a run dir, model folder or qwen4_exp folder) or --base DIR [--adapter DIR]")
    overlays = {}
    for spec in args.overlay or []:
        name, sep, d = spec.partition("=")
        if not sep or not name or not d or "+" in name:
            raise ValueError(f"--overlay {spec!r}: expected NAME=DIR (a name without '+')")
        if name in overlays:
            raise ValueError(f"--overlay {name} given twice")
        overlays[name] = d
    if args.table_backend != "ram" and not args.table_dir:
        raise ValueError(f"--table-backend {args.table_backend} needs --table-dir DIR for the table files")
    engine = load_engine(args.path, args.base, args.adapter, overlays, args.table_backend, args.table_format,
                         args.table_dir, args.name, args.chat_template)
    serve(engine, args.host, args.port, args.api_key or os.environ.get("ENGRAM_API_KEY") or None)
    return 0


def _serve_command(sub) -> None:
    sv = sub.add_parser("serve", help="an OpenAI-compatible server for an Engram model (overlays chosen per request)")
    sv.add_argument("path", nargs="?", help="run dir or model folder (engram, or a qwen4_exp model)")
    sv.add_argument("--base", help="a pretrained transformers model folder (with --adapter: plus that adapter)")
    sv.add_argument("--adapter", help="Engram adapter folder (or LoRA folder, or an `engram adapt` run dir)")
    sv.add_argument("--overlay", action="append", metavar="NAME=DIR",
                    help="load a fact overlay, served as model MODEL+NAME (repeatable)")
    sv.add_argument("--table-backend", default="ram", choices=["ram", "mmap", "disk"])
    sv.add_argument("--table-dir", help="where mmap/disk table files go")
    sv.add_argument("--table-format", choices=["float32", "bfloat16", "int8", "fp8", "fp8_ue8m0"])
    sv.add_argument("--name", help="the model id clients send (default: the folder's name)")
    sv.add_argument("--chat-template", help="'plain' (role: content lines) or a Jinja file; default: the tokenizer's "
                    "own (tokenizer_config.json), else /v1/chat/completions is refused")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default $ENGRAM_API_KEY; none: open)")
    sv.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engram", description="Engram: conditional memory via hashed n-gram lookup")
    sub = p.add_subparsers(dest="command", required=True)
    for group in (_model_commands, _training_commands, _analysis_commands, _channel_commands, _serve_command):
        group(sub)
    return p


def _warning_line(message, category, filename, lineno, file=None, line=None):
    print(f"engram: warning: {message}", file=sys.stderr)


def main(argv=None) -> int:
    import warnings

    args = build_parser().parse_args(argv)
    warnings.showwarning = _warning_line  # one line, no source location
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("engram: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, ImportError, KeyError, FloatingPointError, ApiError) as e:
        if os.environ.get("ENGRAM_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"engram: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
