"""`engram demo`, `hash`, `spec` (the model and its hashing, from a config) and `engram verify` (saved folders)."""

from __future__ import annotations

from pathlib import Path

from ..config import BackBoneConfig, EngramConfig, load_config
from ..errors import install_hint
from ..hashing import get_hash_mapping
from ..tokenizer import bos_id, encode, load_tokenizer
from . import options

DEMO_TEXT = "Only Alexander the Great could tame the horse Bucephalus."


def _configs(path):
    return load_config(path) if path else (EngramConfig(), BackBoneConfig())


def _bos_note(bos_token, no_bos: bool) -> str:
    if no_bos:
        return "  (tokenized without a BOS token: --no-bos)"
    if bos_token is None:
        return "  (this tokenizer has no BOS token we know; none prepended)"
    return f"  (BOS {bos_token} prepended, as the tutorial's AutoTokenizer does; --no-bos leaves it out)"


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
        print(f"  (transformers not installed: real blocks need {install_hint('hf')}; using --mock-blocks)")
    print(f"  parameters: {r['params'] / 1e6:.1f}M, of which Engram tables {r['table_params'] / 1e6:.1f}M; "
          f"{r['blocks']}")
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


def cmd_base(args) -> int:
    from ..integrations import gguf_bases

    if args.base_command == "fetch":
        print(gguf_bases.fetch(args.name, args.dir))
    elif args.base_command == "import":
        src = args.file
        if src in gguf_bases.KNOWN and not Path(src).exists():  # a known name: fetched (or found in the cache) first
            src = gguf_bases.fetch(src)
        out = gguf_bases.import_gguf(src, args.out, overwrite=args.overwrite)
        print(f"{out}: a transformers folder (give it to --base, engram.attach(..., tokenizer=...))")
    else:  # list
        for name, k in sorted(gguf_bases.KNOWN.items()):
            print(f"{name}: {k.about}; {k.license}; from {k.pip_spec}")
    return 0


def add_commands(sub) -> None:
    d = sub.add_parser("demo", help="run the tutorial's forward demo (30 layers, Engram at [1, 15])",
                       parents=[options.config(), options.no_bos()])
    d.add_argument("--text", default=DEMO_TEXT)
    d.add_argument("--table-dtype", default="bfloat16", choices=options.TABLE_DTYPES,
                   help="storage dtype of the Engram tables (default bfloat16: 2 x 662M parameters, two tables "
                        "of 10.3M rows x 64, fit the 8 GiB budget)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--mock-blocks", action="store_true",
                   help="the reference demo's pass-through attention/MoE instead of real blocks")
    d.set_defaults(func=cmd_demo)

    h = sub.add_parser("hash", help="print tokens, compressed ids and per-head row ids of TEXT",
                       parents=[options.config(), options.no_bos()])
    h.add_argument("text")
    h.set_defaults(func=cmd_hash)

    s = sub.add_parser("spec", help="write the self-describing hashing manifest (JSON)", parents=[options.config()])
    s.add_argument("--out", required=True)
    s.add_argument("--no-table", action="store_true", help="omit the inline token->compressed-id lookup table")
    s.set_defaults(func=cmd_spec)

    b = sub.add_parser("base", help="pretrained bases from GGUF files: list, fetch a known one, import one into a "
                                    "transformers folder (docs/adapters.md)")
    bsub = b.add_subparsers(dest="base_command", required=True)
    bsub.add_parser("list", help="the known GGUF bases").set_defaults(func=cmd_base)
    bf = bsub.add_parser("fetch", help="fetch a known base's GGUF file into the cache (checked by sha256); prints its "
                                       "path")
    bf.add_argument("name")
    bf.add_argument("--dir", help="cache folder (default $ENGRAM_BASES_DIR or ~/.cache/engram/bases)")
    bf.set_defaults(func=cmd_base)
    bi = bsub.add_parser("import", help="write a GGUF file's model and tokenizer as a transformers folder, once")
    bi.add_argument("file", help="a .gguf file, or a known base's name (engram base list), fetched first")
    bi.add_argument("out")
    bi.add_argument("--overwrite", action="store_true")
    bi.set_defaults(func=cmd_base)

    vf = sub.add_parser("verify",
                        help="check a run, model, adapter, overlay or checkpoint folder against its checksums")
    vf.add_argument("path")
    vf.add_argument("--write-blocks", action="store_true",
                    help="first add block checksums to table files that have none (trust their current contents)")
    vf.set_defaults(func=cmd_verify)
