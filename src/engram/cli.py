"""`engram` command line: `demo` (real blocks by default, `--mock-blocks`), `hash`, `spec`.

Every expected failure (bad config, missing file, bad ids) prints one line
`engram: error: ...` and exits with status 2; no Python traceback. Set ENGRAM_DEBUG=1 to
see tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEMO_TEXT = "Only Alexander the Great could tame the horse Bucephalus."


def _configs(path):
    from .config import BackBoneConfig, EngramConfig, load_config

    if path:
        return load_config(path)
    return EngramConfig(), BackBoneConfig()


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux


def cmd_demo(args) -> int:
    import dataclasses

    import torch

    from .demo import DemoLM
    from .tokenizer import load_tokenizer

    t0 = time.perf_counter()
    engram_cfg, backbone_cfg = _configs(args.config)
    if args.table_dtype:
        engram_cfg = dataclasses.replace(engram_cfg, table_dtype=args.table_dtype)
    torch.manual_seed(args.seed)
    tok = load_tokenizer(engram_cfg.tokenizer_name_or_path)
    ids = tok.encode(args.text, add_special_tokens=False).ids
    if not ids:
        raise ValueError("--text is empty after tokenization; give some text")
    input_ids = torch.tensor([ids], dtype=torch.long)
    mock = args.mock_blocks
    try:
        import transformers  # noqa: F401
    except ImportError:
        if not mock:
            print("  (transformers not installed: real blocks need pip install 'engram[hf]'; using --mock-blocks)")
        mock = True
    print(f"Building demo LLM: {backbone_cfg.num_layers} layers, hidden {backbone_cfg.hidden_size}, hc_mult "
          f"{backbone_cfg.hc_mult}, vocab {backbone_cfg.vocab_size}, Engram at layers {engram_cfg.layer_ids} "
          f"(tables stored as {engram_cfg.table_dtype})", flush=True)
    if mock:
        model = DemoLM(engram_cfg, backbone_cfg).eval()
        engrams = [b.engram for b in model.blocks if b.engram is not None]
        blocks_desc = "attention/MoE inside blocks are pass-through mocks (as in the reference demo)"
    else:
        from . import presets
        from .model import EngramForCausalLM

        cfg = presets.demo(vocab_size=backbone_cfg.vocab_size, hidden_size=backbone_cfg.hidden_size,
                           num_hidden_layers=backbone_cfg.num_layers, hc_mult=backbone_cfg.hc_mult,
                           engram=engram_cfg.to_dict())
        model = EngramForCausalLM(cfg).eval()
        engrams = [b.engram for b in model.model.layers if b.engram is not None]
        blocks_desc = (f"real blocks: RoPE attention ({cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV), "
                       f"SwiGLU FFN ({cfg.intermediate_size}), mHC with {cfg.hc_mult} streams")
    n_table = sum(e.multi_head_embedding.embedding.weight.numel() for e in engrams)
    n_all = sum(p.numel() for p in model.parameters())
    print(f"  parameters: {n_all / 1e6:.1f}M, of which Engram tables {n_table / 1e6:.1f}M; {blocks_desc}")
    t1 = time.perf_counter()
    with torch.no_grad():
        if mock:
            logits, hash_ids, gates = model.forward_with_details(input_ids)
        else:
            out = model(input_ids, return_gates=True)
            logits, gates = out.logits, out["gates"]
            hash_ids = model.model.mapping.hash(input_ids)
    t2 = time.perf_counter()
    print(f"Input text : {args.text!r}")
    print(f"Tokens     : {tok.encode(args.text, add_special_tokens=False).tokens}")
    print(f"Input shape  : {list(input_ids.shape)}")
    print(f"Output shape : {list(logits.shape)}")
    for lid in engram_cfg.layer_ids:
        g = gates[lid]
        print(f"Layer {lid:>2}: hash shape {list(hash_ids[lid].shape)}; gate min {g.min():.4f} max {g.max():.4f} "
              f"mean {g.mean():.4f}")
    print(f"Wall time: build {t1 - t0:.1f} s, forward {t2 - t1:.2f} s, total {t2 - t0:.1f} s; "
          f"peak RSS {_peak_rss_gib():.2f} GiB")
    return 0


def cmd_hash(args) -> int:
    import numpy as np

    from .hashing import get_hash_mapping
    from .tokenizer import load_tokenizer

    engram_cfg, _ = _configs(args.config)
    mapping = get_hash_mapping(engram_cfg)
    tok = load_tokenizer(engram_cfg.tokenizer_name_or_path)
    enc = tok.encode(args.text, add_special_tokens=False)
    ids = np.array([enc.ids], dtype=np.int64).reshape(1, -1)
    comp = mapping.compressed_tokenizer(ids)[0]
    hashes = mapping.hash(ids)
    K = mapping.n_head_per_ngram
    print(f"{'pos':>3}  {'token':<16} {'id':>7} {'comp':>7}")
    for t, (tokstr, i, c) in enumerate(zip(enc.tokens, enc.ids, comp)):
        print(f"{t:>3}  {tokstr!r:<16} {i:>7} {c:>7}")
    for lid in mapping.layer_ids:
        print(f"\nlayer {lid}: per-head row ids [T={ids.shape[1]}, {hashes[lid].shape[-1]}] "
              f"(columns: {', '.join(f'{n}-gram h{k}' for n in range(2, mapping.max_ngram_size + 1) for k in range(K))})")
        for t in range(ids.shape[1]):
            print(f"{t:>3}  " + " ".join(f"{int(v):>7}" for v in hashes[lid][0, t]))
    return 0


def cmd_spec(args) -> int:
    from .hashing import get_hash_mapping

    engram_cfg, _ = _configs(args.config)
    mapping = get_hash_mapping(engram_cfg)
    mapping.save_spec(args.out, include_lookup_table=not args.no_table)
    print(f"wrote hash spec for layers {mapping.layer_ids} to {args.out}")
    return 0


def cmd_train(args) -> int:
    from .config import ConfigError
    from .train import train, train_config

    overrides = {}
    for kv in args.set or []:
        k, _, v = kv.partition("=")
        default = _train_default(k)
        try:
            overrides[k] = type(default)(v) if default is not None else v
        except ValueError:
            raise ConfigError(f"--set {k}={v}: expected a {type(default).__name__} value") from None
    if args.table_backend:
        overrides["table_backend"] = args.table_backend
    if args.table_cache_mb is not None:
        overrides["table_cache_mb"] = args.table_cache_mb
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_torchrun(args, train_config(args.preset, overrides, args.max_steps, world=args.nproc))
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


def _launch_torchrun(args, tcfg) -> int:
    """Relaunch this command under torchrun, one process per rank (settings already validated).

    The data is prepared here first, so the workers find it cached instead of tokenizing it twice.
    A failing worker prints its own one-line error; this reports how many failed, without
    torchrun's traceback.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from .data import prepare

    prepare(args.data, tcfg.tokenizer)
    argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--nproc" and (i == 0 or sys.argv[i] != "--nproc")]
    argv = [a for a in argv if not a.startswith("--nproc=")]
    ns = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={args.nproc}", "-m", "engram.cli", *argv])
    try:
        run(ns)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        print(f"engram: error: {len(e.failures)} of {args.nproc} training processes failed (exit codes {codes}); "
              "their messages are above", file=sys.stderr)
        return 2 if codes == [2] else 1
    return 0


def _train_default(key):
    import dataclasses

    from .config import ConfigError
    from .train import TrainConfig

    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    if key not in fields:
        raise ConfigError(f"--set {key}=...: unknown training setting; valid: {', '.join(sorted(fields))}")
    return fields[key]


def _load_checkpoint_dir(path):
    """A run dir (uses DIR/final) or a save_pretrained folder -> (model, tokenizer)."""
    from pathlib import Path

    from .model import EngramForCausalLM
    from .tokenizer import load_tokenizer
    from .checkpoint import CheckpointError

    p = Path(path)
    if (p / "final" / "config.json").is_file():
        p = p / "final"
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise CheckpointError(f"{path}: no model here (expected config.json and model.safetensors, or a run dir with final/)")
    try:
        model = EngramForCausalLM.from_pretrained(p).eval()
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{p}: could not load the model: {str(e).splitlines()[0]}") from None
    tok = load_tokenizer(p / "tokenizer.json" if (p / "tokenizer.json").is_file()
                         else model.config.engram.get("tokenizer_name_or_path"))
    return model, tok


def cmd_eval(args) -> int:
    import math

    import numpy as np
    import torch

    from .data import eval_windows, load_sources, split_documents
    from .train import evaluate

    model, tok = _load_checkpoint_dir(args.checkpoint)
    docs = split_documents(load_sources(args.data))[args.split]
    if not docs:
        raise ValueError(f"the {args.split} split is empty for this data")
    eos = 0 if tok.token_to_id("<|endoftext|>") == 0 else None
    ids = []
    for d in docs:
        ids += tok.encode(d.text, add_special_tokens=False).ids + ([eos] if eos is not None else [])
    windows = eval_windows(np.asarray(ids, dtype=np.uint32), args.seq_len, args.max_windows)
    loss = evaluate(model, windows, args.batch_size, torch.device("cpu"))
    print(f"{args.split} loss {loss:.4f} nats/token, perplexity {math.exp(loss):.2f} "
          f"({windows.size:,} tokens in {len(windows)} windows of {args.seq_len})")
    return 0


def cmd_sample(args) -> int:
    import torch

    model, tok = _load_checkpoint_dir(args.checkpoint)
    ids = tok.encode(args.prompt, add_special_tokens=False).ids
    if not ids:
        raise ValueError("--prompt is empty after tokenization")
    torch.manual_seed(args.seed)
    out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                         temperature=args.temperature if args.temperature > 0 else None, top_k=args.top_k,
                         pad_token_id=model.config.pad_token_id)
    print(tok.decode(out[0].tolist()))
    return 0


def cmd_data_prepare(args) -> int:
    from .data import load_manifest, prepare

    d = prepare(args.data, args.tokenizer)
    m = load_manifest(d)
    print(f"prepared {d}: vocab {m['vocab_size']}, " + ", ".join(
        f"{k} {v['tokens']:,} tokens / {len(v['documents'])} docs" for k, v in m["splits"].items()))
    return 0


def cmd_tokenizer_train(args) -> int:
    from .data import load_sources, split_documents
    from .tokenizer import train_bpe

    docs = split_documents(load_sources(args.data))["train"]
    out = train_bpe((d.text for d in docs), args.vocab, args.out)
    print(f"wrote byte-level BPE tokenizer ({args.vocab} tokens, trained on the train split) to {out}")
    return 0


def cmd_experiment(args) -> int:
    from .analysis.experiments import EXPERIMENTS, run_experiment

    if args.list or not args.name:
        from .analysis import experiments

        print(experiments.__doc__.split("Experiments:")[1].rstrip())
        return 0
    names = EXPERIMENTS if args.name == "all" else [args.name]
    for n in names:
        run_experiment(n, out=args.out, seeds=args.seeds, preset=args.preset, data=args.data,
                       max_steps=args.max_steps, size=args.size)
    return 0


def cmd_gates(args) -> int:
    from pathlib import Path

    from .analysis import gates as G

    model, tok = _load_checkpoint_dir(args.checkpoint)
    tokens, gates = G.compute_gates(model, tok, args.text)
    print(G.terminal(tokens, gates))
    for layer in sorted(gates):
        g = gates[layer]
        print(f"layer {layer}: gate min {g.min():.3f} max {g.max():.3f} mean {g.mean():.3f}")
    if args.out:
        out = Path(args.out)
        if out.suffix == ".html":
            G.save_html(tokens, gates, out, title=f"Engram gates: {args.text[:60]}")
        elif out.suffix == ".png":
            G.save_png(tokens, gates, out, title=args.text[:80])
        else:
            raise ValueError(f"--out {out}: use a .png or .html file name")
        print(f"wrote {out}")
    if args.summary:
        import json

        p = Path(args.checkpoint)
        run = p if (p / "run.json").is_file() else p.parent
        if not (run / "run.json").is_file():
            raise ValueError("--summary needs a run directory (with run.json) to find the val split")
        info = json.loads((run / "run.json").read_text())
        for layer, r in G.gate_summary(model, Path(info["data_dir"]), info["train"]["seq_len"]).items():
            print(f"layer {layer}: mean gate on frequent n-gram completions {r['entity_completion']:.3f} "
                  f"({r['n_entity']} tokens) vs function words {r['function_words']:.3f} ({r['n_function']} tokens); "
                  f"all {r['all']:.3f}")
    return 0


def cmd_stats(args) -> int:
    from pathlib import Path

    import numpy as np

    from .analysis import stats as S
    from .data import load_manifest, load_split, prepare
    from .tokenizer import CompressedTokenizer, load_tokenizer

    d = prepare(args.data, args.tokenizer)
    m = load_manifest(d)
    ct = CompressedTokenizer(m["tokenizer_file"])
    tok = load_tokenizer(m["tokenizer_file"])
    rep = S.compression_report(ct, tok)
    print(f"tokenizer {Path(m['tokenizer_file']).name}: {rep['vocab']:,} ids -> {rep['compressed']:,} compressed "
          f"({rep['reduction']:.2%} reduction); largest merged groups:")
    for g in rep["largest_groups"]:
        print(f"  {g['size']:>3} ids: {g['tokens']}")
    comp = ct(np.asarray(load_split(d, "train"), dtype=np.int64))
    print(f"\nrow usage on the train split ({len(comp):,} tokens), one head per order:")
    print(f"{'order':>5} {'rows':>9} {'distinct':>9} {'used':>9} {'usage':>7} {'collide':>8}")
    for r in S.row_usage(comp, args.sizes):
        print(f"{r['order']:>5} {r['table_rows']:>9,} {r['distinct_ngrams']:>9,} {r['rows_used']:>9,} "
              f"{r['row_usage']:>7.1%} {r['collision_rate']:>8.1%}")
    counts = S.zipf(comp)
    for n, c in counts.items():
        print(f"{n}-grams: {len(c):,} distinct; top 1% of them cover {c[: max(1, len(c) // 100)].sum() / c.sum():.1%} "
              "of occurrences")
    if args.out:
        S.plot_zipf(counts, Path(args.out))
        print(f"wrote {args.out}")
    return 0


def cmd_ask(args) -> int:
    from .api import chat, load_settings

    s = load_settings(args.model, args.base_url)
    if s.note:
        print(f"engram: note: {s.note}", file=sys.stderr)
    print(chat([{"role": "user", "content": args.prompt}], s, timeout=args.timeout, retries=args.retries))
    return 0


def cmd_crosscheck(args) -> int:
    import json

    from .api import crosscheck, load_settings

    s = load_settings(args.model, args.base_url)
    if s.note:
        print(f"engram: note: {s.note}", file=sys.stderr)
    model, tok = _load_checkpoint_dir(args.checkpoint)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engram", description="Engram: conditional memory via hashed n-gram lookup")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run the tutorial's forward demo (30 layers, Engram at [1, 15])")
    d.add_argument("--text", default=DEMO_TEXT)
    d.add_argument("--config", help="engram_config.json with sections 'engram' and 'backbone'")
    d.add_argument("--table-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="storage dtype of the Engram tables (default bfloat16: 2 x 662M rows fit the 8 GiB budget)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--mock-blocks", action="store_true",
                   help="the reference demo's pass-through attention/MoE instead of real blocks")
    d.set_defaults(func=cmd_demo)

    h = sub.add_parser("hash", help="print tokens, compressed ids and per-head row ids of TEXT")
    h.add_argument("text")
    h.add_argument("--config")
    h.set_defaults(func=cmd_hash)

    s = sub.add_parser("spec", help="write the self-describing hashing manifest (JSON)")
    s.add_argument("--out", required=True)
    s.add_argument("--config")
    s.add_argument("--no-table", action="store_true", help="omit the inline token->compressed-id lookup table")
    s.set_defaults(func=cmd_spec)

    t = sub.add_parser("train", help="train a preset on Shakespeare (default) or --data")
    t.add_argument("--preset", default="cpu-small", help="tiny | cpu-small")
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

    e = sub.add_parser("eval", help="validation loss and perplexity of a checkpoint")
    e.add_argument("--checkpoint", required=True, help="run dir or save_pretrained folder")
    e.add_argument("--data", action="append")
    e.add_argument("--split", default="val", choices=["train", "val", "test"])
    e.add_argument("--seq-len", type=int, default=256)
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--max-windows", type=int, default=None)
    e.set_defaults(func=cmd_eval)

    sm = sub.add_parser("sample", help="generate text from a checkpoint")
    sm.add_argument("--checkpoint", required=True)
    sm.add_argument("--prompt", required=True)
    sm.add_argument("--max-new-tokens", type=int, default=60)
    sm.add_argument("--temperature", type=float, default=0.8)
    sm.add_argument("--top-k", type=int, default=50)
    sm.add_argument("--seed", type=int, default=0)
    sm.set_defaults(func=cmd_sample)

    dp = sub.add_parser("data", help="data preparation")
    dsub = dp.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="tokenize a corpus into uint32 token files + manifest")
    prep.add_argument("--data", action="append")
    prep.add_argument("--tokenizer", default="bpe:8192", help="deepseek | bpe:N | path/to/tokenizer.json")
    prep.set_defaults(func=cmd_data_prepare)

    ex = sub.add_parser("experiment", help="evidence experiments (iso, placement, capacity, ablations, sensitivity, all)")
    ex.add_argument("name", nargs="?")
    ex.add_argument("--list", action="store_true")
    ex.add_argument("--seeds", type=int, default=2)
    ex.add_argument("--out", default="runs/experiments")
    ex.add_argument("--preset", default="exp", help="model/training preset of every run (default exp)")
    ex.add_argument("--data", action="append")
    ex.add_argument("--max-steps", type=int)
    ex.add_argument("--size", default="default", choices=["default", "small"], help="small: fewer capacity points")
    ex.set_defaults(func=cmd_experiment)

    ga = sub.add_parser("gates", help="token-level Engram gate heatmap (terminal, --out FILE.png or FILE.html)")
    ga.add_argument("--checkpoint", required=True)
    ga.add_argument("--text", required=True)
    ga.add_argument("--out")
    ga.add_argument("--summary", action="store_true", help="mean gate on n-gram completions vs function words (val)")
    ga.set_defaults(func=cmd_gates)

    st = sub.add_parser("stats", help="tokenizer compression, table row usage/collisions, n-gram Zipf plot")
    st.add_argument("--data", action="append")
    st.add_argument("--tokenizer", default="deepseek", help="deepseek | bpe:N | path/to/tokenizer.json")
    st.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000, 1000000])
    st.add_argument("--out", help="rank-frequency plot (.png)")
    st.set_defaults(func=cmd_stats)

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

    tk = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = tk.add_subparsers(dest="tok_command", required=True)
    ttrain = tsub.add_parser("train", help="train a byte-level BPE tokenizer on the corpus's train split")
    ttrain.add_argument("--vocab", type=int, default=8192)
    ttrain.add_argument("--data", action="append")
    ttrain.add_argument("--out", default="tokenizer.json")
    ttrain.set_defaults(func=cmd_tokenizer_train)
    return p


def main(argv=None) -> int:
    from .api import ApiError

    parser = build_parser()
    args = parser.parse_args(argv)
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
