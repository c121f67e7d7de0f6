"""engram against the peers a user would pick instead, in one script: the disk store (EngramDB) and
Engram adapters on transformers models (engram-peft).

    pip install -e '.[hf,fast]' -r benchmarks/requirements-peers.txt   # the peers; never needed by tests or CI
    python benchmarks/bench_peers.py [--part disk|adapters|all] [--rows 2000000] [--rounds 3] [--steps 150]

(engram-peft 1.2.7 needs Python >= 3.12: it imports `typing.override`, though it declares >= 3.10.)

Disk store: the same bfloat16 rows (`--rows` x d, for d = 160 as Qwen3.8-Flash-Next's table and d = 256)
written in both formats (engram's disk-tier file: page-aligned safetensors with 4 KiB block sums;
EngramDB's Store: one fixed-width shard file), the same row ids from hashing real text (Shakespeare, 4,096
tokens, 2 orders x 4 heads, offsets folded into the table), each file evicted from the page cache before
a cold round (`posix_fadvise(DONTNEED)`, resident fraction from `mincore`), then warm. engram's
`DiskTable.gather` (checking each block on first read) vs EngramDB's `Store.fetch` and its io_uring page
reader (`IoUringPageReader.read_pages` of the 4 KiB pages holding the rows, then cut out), with the
device's limit in the same run: the best random reads/s of several access patterns by fio (4 KiB and
16 KiB direct reads, psync x32 and io_uring at depths 8-128, buffered reads with and without
read-ahead, `PATTERNS`; and the whole file read sequentially, which wins when the rows are dense). The
bytes returned are compared for equality.

Adapters: the same random Llama and Qwen3 bases (hidden 256, 4 layers, the `exp` preset's BPE-4096
Shakespeare tokenizer), the same Engram table (2 orders x 4 heads x ~10k rows x 32 dims at layer 1, one
stream, zero-initialized conv), the same Shakespeare batches (8 x 128 tokens), steps, base LR (table at 5x),
no weight decay, the base frozen: `engram.attach` + `build_optimizers` vs `engram_peft.get_engram_model`
+ its `create_optimizer` (SparseAdam rows). Each (side, base) runs in its own child process, alternating,
`--rounds` times, round r with seed r (the base's weights, the batches, the adapter's init): step time
(median after 3 warm-up steps), peak RSS, train loss over the last 10 steps
and val loss after `--steps`, max |logit change| at attach, adapter files' bytes, and max |logit
difference| after a save/load round trip into a fresh base. Prints a table and one JSON line.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_disk import compile_readers, evict, fio_read  # noqa: E402

from engram.tables import write_table_file  # noqa: E402
from engram.tables.disk import DiskTable  # noqa: E402

# access patterns for the device limit: (name, fio arguments); rows/s = reads/s, one row per read
PATTERNS = [
    ("4k direct, psync x32", ["--bs=4k", "--direct=1", "--ioengine=psync", "--numjobs=32", "--iodepth=1"]),
    ("4k direct, io_uring qd8", ["--bs=4k", "--direct=1", "--ioengine=io_uring", "--numjobs=1", "--iodepth=8"]),
    ("4k direct, io_uring qd32", ["--bs=4k", "--direct=1", "--ioengine=io_uring", "--numjobs=1", "--iodepth=32"]),
    ("4k direct, io_uring qd128", ["--bs=4k", "--direct=1", "--ioengine=io_uring", "--numjobs=1", "--iodepth=128"]),
    ("4k direct, io_uring qd32 x4 jobs",
     ["--bs=4k", "--direct=1", "--ioengine=io_uring", "--numjobs=4", "--iodepth=32"]),
    ("16k direct, io_uring qd32", ["--bs=16k", "--direct=1", "--ioengine=io_uring", "--numjobs=1", "--iodepth=32"]),
    ("4k buffered, no read-ahead, psync x32", ["--bs=4k", "--direct=0", "--fadvise_hint=1", "--ioengine=psync",
                                                "--numjobs=32", "--iodepth=1"]),
    ("4k buffered, read-ahead, psync x32", ["--bs=4k", "--direct=0", "--fadvise_hint=0", "--ioengine=psync",
                                             "--numjobs=32", "--iodepth=1"]),
]


def device_limits(path: Path, distinct: int, reads: int = 24_576) -> dict:
    """Rows/s the device gives `distinct` random rows of `path` by each access pattern, by fio (none without
    fio): the random patterns of `PATTERNS` (one row per read, so rows/s = reads/s; each starts from an evicted
    file and does `reads` reads in all, few enough that buffered patterns mostly miss the cache), and reading
    the whole file sequentially in 1 MiB direct reads (rows/s = distinct / the time to read it: the best
    pattern when the rows are dense in a small file)."""
    out = {}
    for name, spec in PATTERNS:
        jobs = int(next(a for a in spec if a.startswith("--numjobs=")).split("=")[1])
        evict(path)
        r = fio_read(path, "--rw=randread", *spec, f"--number_ios={reads // jobs}")
        if r is not None:  # (None: no fio, or an engine this kernel lacks)
            out[name] = float(r["iops"])
    evict(path)
    r = fio_read(path, "--rw=read", "--bs=1m", "--direct=1", "--ioengine=io_uring", "--iodepth=8")
    if r is not None:
        out["whole file, 1 MiB sequential direct"] = distinct * float(r["bw_bytes"]) / path.stat().st_size
    return out


def iouring_rows(reader, fd: int, ids: np.ndarray, width: int) -> bytes:
    """Rows `ids` (`width` bytes each) of a fixed-width file through EngramDB's io_uring page reader: the 4 KiB
    pages holding each row (two where a row straddles a page boundary), read in one call, then cut out."""
    start = ids.astype(np.int64) * width
    first, last = start // 4096, (start + width - 1) // 4096
    pages = np.unique(np.concatenate([first, last]))
    blob = np.frombuffer(b"".join(reader.read_pages([fd] * len(pages), (pages * 4096).tolist())), np.uint8)
    pos = np.searchsorted(pages, first) * 4096 + start % 4096  # each row's first byte in the page blob; a
    # straddling row's second page follows its first in `pages` (both are there, sorted, adjacent numbers)
    return np.lib.stride_tricks.sliding_window_view(blob, width)[pos].tobytes()


def real_row_ids(rows: int, tokens: int = 4096) -> torch.Tensor:
    """Row ids of `tokens` Shakespeare tokens hashed by the reference family (2 orders x 4 heads), into `rows`."""
    from engram.hashing import NgramHashMapping
    from engram.tokenizer import load_tokenizer
    from engram.training.corpora import shakespeare_works

    text = "".join(doc.text for doc in shakespeare_works()[:3])
    tok = load_tokenizer(None)
    ids = np.array(tok.encode(text[:200_000], add_special_tokens=False).ids[:tokens])[None]
    per_head = rows // 8
    m = NgramHashMapping([per_head, per_head], 3, 64, 4, [1], None, 2, 0)
    h = m.hash(ids, offsets=True)[1]  # (1, T, 8), rows of one layer's table
    return torch.from_numpy(np.asarray(h)).reshape(-1) % rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("disk", "adapters", "all"), default="all")
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150, help="adapter training steps")
    ap.add_argument("--dir", help="where to write the files (default: a temp dir)")
    ap.add_argument("--child", nargs=3, metavar=("SIDE", "BASE", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        side, kind, seed = args.child
        print(json.dumps(adapter_child(side, kind, steps=args.steps, seed=int(seed))))
        return
    out = {}
    if args.part in ("adapters", "all"):
        out["adapters"] = adapters(args)
    if args.part in ("disk", "all"):
        out["disk"] = disk(args)
    print(json.dumps(out))


def disk(args) -> dict:
    import engramdb

    ids = real_row_ids(args.rows)
    ids_np = ids.numpy()
    distinct = torch.unique(ids).numel()
    out = {"bench": "peers_disk", "rows": args.rows, "ids": ids.numel(), "distinct": distinct,
           "engramdb": engramdb.__version__, "results": {}}
    print(f"{ids.numel():,} row ids from hashing 4,096 Shakespeare tokens ({distinct:,} distinct); table {args.rows:,} "
          f"rows; {args.rounds} rounds; EngramDB {engramdb.__version__}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)
        for dim in (160, 256):
            torch.manual_seed(dim)
            W = torch.randn(args.rows, dim).to(torch.bfloat16)
            ours = write_table_file(d / f"engram_{dim}.safetensors", W, page_blocks=True)
            store_dir = d / f"engramdb_{dim}"
            store_dir.mkdir()
            (store_dir / "shard_000.bin").write_bytes(W.view(torch.uint8).numpy().tobytes())
            if dim == 160:
                compile_readers(d, W)
            want = W[ids].view(torch.uint8).reshape(len(ids), -1).numpy().tobytes()
            whos = ("engram", "engramdb", "engramdb_iouring")
            res = {f"{w}_{k}": [] for w in whos for k in ("cold", "warm")} | {"resident": []}
            reader = engramdb.IoUringPageReader()
            for _ in range(args.rounds):
                for who in whos:  # alternating: the machine's drift hits all
                    path = ours if who == "engram" else store_dir / "shard_000.bin"
                    res["resident"].append(evict(path))
                    if who == "engram":
                        table = DiskTable(ours)

                        def fetch(t=table):  # its own output: a (N, d) bfloat16 tensor
                            return t.gather(ids)
                    elif who == "engramdb":
                        table = engramdb.Store(str(store_dir), shards=1, rows_per_shard=args.rows, width=2 * dim)

                        def fetch(t=table):
                            return t.fetch(ids_np)  # bytes, as it returns them
                    else:
                        table = _Fd(path)

                        def fetch(t=table):
                            return iouring_rows(reader, t.fd, ids_np, 2 * dim)
                    t = time.perf_counter()
                    got = fetch()
                    res[f"{who}_cold"].append(distinct / (time.perf_counter() - t))
                    got = got if isinstance(got, bytes) else got.view(torch.uint8).numpy().tobytes()
                    assert got == want, f"{who}: rows differ"
                    t = time.perf_counter()
                    for _ in range(5):
                        fetch()
                    res[f"{who}_warm"].append(5 * len(ids) / (time.perf_counter() - t))
                    table.close()
                    del table, fetch
                    gc.collect()
            fio = device_limits(ours, distinct)
            best = max(fio.values()) if fio else float("nan")
            med = {k: statistics.median(v) for k, v in res.items() if k != "resident"}
            out["results"][dim] = {**{k: [round(x) for x in v] for k, v in res.items() if k != "resident"},
                                   "cold_ratio": round(med["engram_cold"] / med["engramdb_cold"], 3),
                                   "cold_ratio_iouring": round(med["engram_cold"] / med["engramdb_iouring_cold"], 3),
                                   "warm_ratio": round(med["engram_warm"] / med["engramdb_warm"], 3),
                                   "warm_ratio_iouring": round(med["engram_warm"] / med["engramdb_iouring_warm"], 3),
                                   "device_limits": {k: round(v) for k, v in fio.items()},
                                   "engram_cold_vs_best_pattern": round(med["engram_cold"] / best, 3),
                                   "max_resident": None if res["resident"][0] is None else max(res["resident"])}
            r = out["results"][dim]
            print(f"d={dim}: cold rows/s engram {med['engram_cold']:,.0f} vs EngramDB Store.fetch "
                  f"{med['engramdb_cold']:,.0f} ({r['cold_ratio']:.2f}x) vs io_uring pages "
                  f"{med['engramdb_iouring_cold']:,.0f} ({r['cold_ratio_iouring']:.2f}x); warm ids/s "
                  f"{med['engram_warm']:,.0f} vs {med['engramdb_warm']:,.0f} ({r['warm_ratio']:.2f}x) vs "
                  f"{med['engramdb_iouring_warm']:,.0f} ({r['warm_ratio_iouring']:.2f}x); bytes identical; "
                  "resident after "
                  "eviction " + ("n/a" if r["max_resident"] is None else f"{r['max_resident']:.1%}"))
            for name, v in fio.items():
                print(f"    device, {name}: {v:,.0f} rows/s")
            print(f"    engram cold vs the best pattern: {r['engram_cold_vs_best_pattern']:.2f}x")
    return out


class _Fd:
    """An open file descriptor with the tables' close()."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDONLY)

    def close(self):
        os.close(self.fd)


# ------------------------------------------------------------------------------------------ adapters
ROWS, HEADS, HEAD_DIM, LAYER, LR, BATCH, SEQ = 10_007, 4, 32, 1, 3e-3, 8, 128


def _base(kind: str, vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen3ForCausalLM(Qwen3Config(head_dim=64, **common))


def _batches(steps: int, seed: int):
    from engram.training.data import eval_windows, load_split, prepare

    d = prepare(None, "bpe:4096", progress=False)
    train, val = load_split(d, "train"), load_split(d, "val")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(train) - SEQ, size=(steps, BATCH))
    xs = [torch.from_numpy(np.stack([train[s:s + SEQ] for s in row]).astype(np.int64)) for row in starts]
    return d / "tokenizer.json", xs, torch.from_numpy(eval_windows(val, SEQ, 32).astype(np.int64))


def adapter_child(side: str, kind: str, steps: int, seed: int) -> dict:
    """One (side, base, seed) run in this process: attach, exactness, `steps` steps, val loss, save, reload.
    The seed draws the base's weights, the batches and (through torch's generator) the adapter's init."""
    import resource
    import shutil

    tok_path, xs, val = _batches(steps, seed)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size()
    model = _base(kind, vocab, seed).train()
    probe = val[:2]
    with torch.no_grad():
        before = model(input_ids=probe).logits
    if side == "engram":
        import engram
        from engram.training.optim import build_optimizers

        engram.attach(model, [LAYER], tokenizer=tok_path, verbose=False, engram_vocab_size=[ROWS, ROWS],
                      n_head_per_ngram=HEADS, n_embed_per_ngram=HEADS * HEAD_DIM, max_ngram_size=3, pad_id=1)
        opts = list(build_optimizers(model, LR, weight_decay=0.0).values())
        net = model
    else:
        from engram_peft import EngramConfig, get_engram_model
        from transformers import PreTrainedTokenizerFast

        hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_path), pad_token="<|pad|>", eos_token="<|endoftext|>")
        cfg = EngramConfig(engram_vocab_size_per_ngram=[HEADS * ROWS] * 2, ngram_sizes=[2, 3], max_ngram_size=3,
                           n_head_per_ngram=HEADS, embedding_dim=2 * HEADS * HEAD_DIM, target_layers=[LAYER], hc_mult=1,
                           pad_id=1, learning_rate_multiplier=5.0, weight_decay=0.0)
        net = get_engram_model(model, cfg, tokenizer=hf_tok, train_mode="engram_only")
        opts = [net.create_optimizer(base_learning_rate=LR)]
    with torch.no_grad():
        exact = (net(input_ids=probe).logits - before).abs().max().item()
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    times, losses = [], []
    for x in xs:
        t = time.perf_counter()
        loss = net(input_ids=x, labels=x).loss
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts:
            o.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    net.eval()
    with torch.no_grad():
        val_loss = statistics.fmean(net(input_ids=val[i:i + 8], labels=val[i:i + 8]).loss.item()
                                    for i in range(0, len(val), 8))
        trained = net(input_ids=probe).logits
    tmp = Path(tempfile.mkdtemp())
    try:
        t = time.perf_counter()
        if side == "engram":
            engram.save_adapter(net, tmp / "a")
        else:
            net.save_pretrained(str(tmp / "a"))
        save_s = time.perf_counter() - t
        size = sum(f.stat().st_size for f in (tmp / "a").rglob("*") if f.is_file())
        fresh = _base(kind, vocab, seed).eval()
        t = time.perf_counter()
        if side == "engram":
            again = engram.load_adapter(fresh, tmp / "a").eval()
        else:
            from engram_peft import EngramModel

            again = EngramModel.from_pretrained(fresh, str(tmp / "a"), tokenizer=hf_tok).eval()
        load_s = time.perf_counter() - t
        with torch.no_grad():
            roundtrip = (again(input_ids=probe).logits - trained).abs().max().item()
    finally:
        shutil.rmtree(tmp)
    return {"side": side, "base": kind, "seed": seed, "step_s": statistics.median(times[3:]),
            "train_loss_last10": statistics.fmean(losses[-10:]),
            "val_loss": val_loss, "exact_at_attach": exact, "trainable": trainable, "adapter_bytes": size,
            "save_s": save_s, "load_s": load_s, "roundtrip_max_diff": roundtrip,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def adapters(args) -> dict:
    import subprocess
    from importlib.metadata import version

    import engram_peft  # noqa: F401  (fail here, not in a child, if the peer is missing)

    runs = []
    for r in range(args.rounds):
        for kind in ("llama", "qwen3"):
            for side in (("engram", "peft") if r % 2 == 0 else ("peft", "engram")):  # alternate who goes first
                p = subprocess.run([sys.executable, __file__, "--child", side, kind, str(r),
                                    "--steps", str(args.steps)], capture_output=True, text=True)
                if p.returncode:
                    raise SystemExit(f"{side} on {kind} failed:\n{p.stderr[-3000:]}")
                runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
                print(f"round {r} {kind:5s} {side:6s}: " + ", ".join(
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in runs[-1].items()
                    if k not in ("side", "base")), flush=True)
    from engram.analysis.runs import difference, seed_stats
    from engram.utils import environment

    out = {"engram_peft": version("engram-peft"), "steps": args.steps, "rounds": args.rounds, "runs": runs, "bases": {},
           "environment": environment()}
    print("\n| base | engram / engram-peft step time | val loss engram vs peft (mean ± sd) | "
          "exact at attach (max |dlogit|) | adapter bytes | round trip max |dlogit| | peak RSS MiB |"
          "\n|---|---|---|---|---|---|---|")
    for kind in ("llama", "qwen3"):
        e = [x for x in runs if x["base"] == kind and x["side"] == "engram"]
        p = [x for x in runs if x["base"] == kind and x["side"] == "peft"]
        ratios = [a["step_s"] / b["step_s"] for a, b in zip(e, p)]
        b = {"step_ratio": [round(x, 3) for x in ratios],
             "val_loss": {"engram": seed_stats([x["val_loss"] for x in e]),
                          "peft": seed_stats([x["val_loss"] for x in p])},
             "exact_at_attach": {"engram": max(x["exact_at_attach"] for x in e),
                                 "peft": max(x["exact_at_attach"] for x in p)},
             "adapter_bytes": {"engram": e[0]["adapter_bytes"], "peft": p[0]["adapter_bytes"]},
             "roundtrip": {"engram": max(x["roundtrip_max_diff"] for x in e),
                           "peft": max(x["roundtrip_max_diff"] for x in p)},
             "peak_rss_mib": {"engram": max(x["peak_rss_mib"] for x in e),
                              "peft": max(x["peak_rss_mib"] for x in p)},
             "trainable": {"engram": e[0]["trainable"], "peft": p[0]["trainable"]}}
        b["val_loss"]["engram - peft"] = difference(b["val_loss"]["peft"], b["val_loss"]["engram"])
        out["bases"][kind] = b
        ve, vp, d = b["val_loss"]["engram"], b["val_loss"]["peft"], b["val_loss"]["engram - peft"]
        print(f"| {kind} | {min(ratios):.2f}-{max(ratios):.2f}x | {ve['mean']:.4f} ± {ve['std']:.4f} vs "
              f"{vp['mean']:.4f} ± {vp['std']:.4f} (n={ve['n']}; {d['diff']:+.4f} ± {d['se']:.4f} se"
              f"{', a finding' if d['finding'] else ''}) | {b['exact_at_attach']['engram']:.2g} vs "
              f"{b['exact_at_attach']['peft']:.2g} | {b['adapter_bytes']['engram']:,} vs "
              f"{b['adapter_bytes']['peft']:,} | "
              f"{b['roundtrip']['engram']:.2g} vs {b['roundtrip']['peft']:.2g} | {b['peak_rss_mib']['engram']:.0f} vs "
              f"{b['peak_rss_mib']['peft']:.0f} |")
    return out


if __name__ == "__main__":
    main()
