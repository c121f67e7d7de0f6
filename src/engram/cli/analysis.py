"""`engram gates` and `engram stats`: look inside a model and what its tables see (`engram.analysis`). The evidence
experiments' commands (`experiment`, `results`) come from the `engram_experiments` package (`engram.cli` plugins)."""

from __future__ import annotations

from pathlib import Path

from . import options


def cmd_gates(args) -> int:
    from ..analysis import gates as G

    if args.summary and not args.checkpoint:
        raise ValueError("--summary reads the val split of a run: give --checkpoint RUN_DIR (an engram run)")
    model, tok = options.load_for_inference(args)
    options.with_overlays(model, args.overlay)
    tokens, gates = G.compute_gates(model, tok, args.text)
    print(G.terminal(tokens, gates))
    for layer in sorted(gates):
        g = gates[layer]
        print(f"layer {layer}: gate min {g.min():.3f} max {g.max():.3f} mean {g.mean():.3f}")
    if args.out:
        G.save(tokens, gates, Path(args.out), title=args.text)
        print(f"wrote {args.out}")
    if args.record and not args.summary:
        print("engram: --record writes the --summary; add --summary")
        return 2
    if args.summary:
        summary = G.run_gate_summary(model, Path(args.checkpoint))
        if args.record:
            from ..persist import write_json
            from ..utils import environment

            write_json(Path(args.record), {"experiment": "gates", "command": _command_line(),
                                           "environment": environment(), "checkpoint": args.checkpoint,
                                           "summary": {str(k): v for k, v in summary.items()}})
            print(f"wrote {args.record}")
        for layer, r in summary.items():
            print(f"layer {layer}: mean gate on frequent n-gram completions {r['entity_completion']:.3f} "
                  f"({r['n_entity']} tokens) vs function words {r['function_words']:.3f} ({r['n_function']} tokens); "
                  f"all {r['all']:.3f}")
    return 0


def _command_line() -> str:
    """The command as typed (`engram ...`), for the record it writes."""
    import shlex
    import sys

    return "engram " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def cmd_stats(args) -> int:
    from ..analysis import stats as S

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
    for n, z in r["zipf_top"].items():
        print(f"{n}-grams: {z['distinct']:,} distinct; top 1% of them cover {z['top1pct_share']:.1%} of occurrences")
    if args.record:
        S.record(r, Path(args.record), _command_line())
        print(f"wrote {args.record}")
    if args.out:
        S.plot_zipf(r["zipf"], Path(args.out))
        print(f"wrote {args.out}")
    return 0


def _stats_v41(args, S) -> int:
    """`engram stats --v41 DIR`: a DeepSeek-V4.1 checkpoint's own hashing on a corpus (its tokenizer)."""
    import numpy as np

    from ..integrations import deepseek_v41 as v41
    from ..training.data import load_manifest, load_split, prepare

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


def add_commands(sub) -> None:
    ga = sub.add_parser("gates", help="token-level Engram gate heatmap (terminal, --out FILE.png or FILE.html)",
                        parents=[options.model_source(), options.overlays()])
    ga.add_argument("--text", required=True)
    ga.add_argument("--out")
    ga.add_argument("--summary", action="store_true", help="mean gate on n-gram completions vs function words (val)")
    ga.add_argument("--record", metavar="FILE", help="also write the --summary, command and environment to FILE "
                                                     "(docs/results/gates.json: `engram results` renders it)")
    ga.set_defaults(func=cmd_gates)

    st = sub.add_parser("stats", help="tokenizer compression, table row usage/collisions, n-gram Zipf plot")
    st.add_argument("--data", action="append")
    st.add_argument("--tokenizer", default="deepseek", help="deepseek | bpe:N | path/to/tokenizer.json")
    st.add_argument("--sizes", action=options.ListFlag, item=int, spaced=True, default=[1000, 10000, 100000, 1000000],
                    help="table rows to measure, a comma list (default 1000,10000,100000,1000000)")
    st.add_argument("--out", help="rank-frequency plot (.png)")
    st.add_argument("--record", metavar="FILE", help="also write the measurements, command and environment to FILE "
                                                     "(docs/results/stats.json: `engram results` renders it)")
    st.add_argument("--v41", metavar="DIR", help="a DeepSeek-V4.1 checkpoint folder: its own hashing's row use and "
                    "collisions on --data (tokenized with its tokenizer)")
    st.set_defaults(func=cmd_stats)
