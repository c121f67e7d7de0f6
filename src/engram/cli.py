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
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("engram: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, ImportError, KeyError) as e:
        if os.environ.get("ENGRAM_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"engram: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
