"""engram against the peers a user would pick instead, in one process: the disk store (EngramDB).

    pip install -r benchmarks/requirements-peers.txt        # the peers; never needed by the tests or CI
    python benchmarks/bench_peers.py [--rows 2000000] [--rounds 3]

Disk store: the same bfloat16 rows (`--rows` x d, for d = 160 as Qwen3.8-Flash-Next's table and d = 256)
written in both formats (engram's disk-tier file: page-aligned safetensors with 4 KiB block sums;
EngramDB's Store: one fixed-width shard file), the same row ids from hashing real text (Shakespeare, 4,096
tokens, 2 orders x 4 heads, offsets folded into the table), each file evicted from the page cache before
a cold round (`posix_fadvise(DONTNEED)`, resident fraction from `mincore`), then warm. engram's
`DiskTable.gather` (checking each block on first read) vs EngramDB's `Store.fetch` (and its io_uring
page reader where the kernel allows), with fio's 4 KiB random-read limit in the same run; the bytes
returned are compared for equality. Prints a table and one JSON line. (The adapter comparison with
engram-peft is not in this script yet.)
"""

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_disk import compile_readers, evict, fio_reads_per_s  # noqa: E402

from engram.tables import write_table_file  # noqa: E402
from engram.tables.disk import DiskTable  # noqa: E402


def real_row_ids(rows: int, tokens: int = 4096) -> torch.Tensor:
    """Row ids of `tokens` Shakespeare tokens hashed by the reference family (2 orders x 4 heads), into `rows`."""
    from engram.hashing import NgramHashMapping
    from engram.tokenizer import load_tokenizer
    from engram.training.data import shakespeare_works

    text = "".join(doc.text for doc in shakespeare_works()[:3])
    tok = load_tokenizer(None)
    ids = np.array(tok.encode(text[:200_000], add_special_tokens=False).ids[:tokens])[None]
    per_head = rows // 8
    m = NgramHashMapping([per_head, per_head], 3, 64, 4, [1], None, 2, 0)
    h = m.hash(ids, offsets=True)[1]  # (1, T, 8), rows of one layer's table
    return torch.from_numpy(np.asarray(h)).reshape(-1) % rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="where to write the files (default: a temp dir)")
    args = ap.parse_args()
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
            res = {"engram_cold": [], "engramdb_cold": [], "engram_warm": [], "engramdb_warm": [], "resident": []}
            for _ in range(args.rounds):
                for who in ("engram", "engramdb"):  # alternating: the machine's drift hits both
                    path = ours if who == "engram" else store_dir / "shard_000.bin"
                    res["resident"].append(evict(path))
                    if who == "engram":
                        table = DiskTable(ours)

                        def fetch(t=table):  # its own output: a (N, d) bfloat16 tensor
                            return t.gather(ids)
                    else:
                        table = engramdb.Store(str(store_dir), shards=1, rows_per_shard=args.rows, width=2 * dim)

                        def fetch(t=table):
                            return t.fetch(ids_np)  # bytes, as it returns them
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
            fio = fio_reads_per_s(ours, 32)
            med = {k: statistics.median(v) for k, v in res.items() if k != "resident"}
            out["results"][dim] = {**{k: [round(x) for x in v] for k, v in res.items() if k != "resident"},
                                   "cold_ratio": round(med["engram_cold"] / med["engramdb_cold"], 3),
                                   "warm_ratio": round(med["engram_warm"] / med["engramdb_warm"], 3),
                                   "fio": {k: round(v) for k, v in fio.items()},
                                   "max_resident": None if res["resident"][0] is None else max(res["resident"])}
            r = out["results"][dim]
            print(f"d={dim}: cold rows/s engram {med['engram_cold']:,.0f} vs EngramDB {med['engramdb_cold']:,.0f} "
                  f"({r['cold_ratio']:.2f}x); warm ids/s {med['engram_warm']:,.0f} vs {med['engramdb_warm']:,.0f} "
                  f"({r['warm_ratio']:.2f}x); fio 4 KiB {r['fio']}; bytes identical; resident after eviction "
                  + ("n/a" if r["max_resident"] is None else f"{r['max_resident']:.1%}"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
