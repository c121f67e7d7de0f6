"""Row-gather throughput of each table backend vs plain torch.index_select and vs streaming-copy bandwidth.

Table: `--rows` x 64 fp32 (default 4M rows = 1 GiB), gathers of 65,536 rows, uniform and Zipf(1.1)
row ids. `index_select` allocates its output each call; the in-RAM backend gathers into a
preallocated buffer (`gather(rows, out=buf)`). The memory-mapped file is written first, so its pages
are in the page cache (warm).
Prints a table, then one JSON line (`inram_vs_index_select`, `mmap_cached_vs_inram`, ...).

    python benchmarks/bench_gather.py [--rows 4000000] [--cache-mb 64]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import timeit  # noqa: E402

from engram.tables import InRamTable, MmapTable, write_table_file


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--cache-mb", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    W = torch.randn(args.rows, 64)
    gb = W.numel() * 4 / 1e9
    dst = torch.empty_like(W)
    t_copy = timeit(lambda: dst.copy_(W), 3)  # streaming copy into preallocated memory: the machine's limit
    bw_rows = W.shape[0] / t_copy / 1e6  # rows/s a streaming copy moves
    rng = np.random.default_rng(0)
    ids = {
        "uniform": [torch.from_numpy(rng.integers(0, args.rows, args.batch)) for _ in range(8)],
        "zipf": [torch.from_numpy((rng.zipf(1.1, args.batch) - 1) % args.rows) for _ in range(8)],
    }
    with tempfile.TemporaryDirectory() as d:
        f = write_table_file(Path(d) / "t.safetensors", W)
        backends = {
            "inram": InRamTable(W),
            "mmap (no cache)": MmapTable(f, cache_bytes=0),
            "mmap + lru cache": MmapTable(f, cache_bytes=args.cache_mb << 20, policy="lru"),
            "mmap + lfu cache": MmapTable(f, cache_bytes=args.cache_mb << 20, policy="lfu"),
        }
        res = {}
        for dist, batches in ids.items():
            it = iter(range(10**9))
            res[(dist, "index_select")] = timeit(lambda: torch.index_select(W, 0, batches[next(it) % 8]))
            buf = torch.empty(args.batch, 64)
            for name, b in backends.items():
                for x in batches:  # warm the cache on this distribution
                    b.gather(x)
                it = iter(range(10**9))
                if name == "inram":  # the in-RAM backend gathers into a preallocated buffer
                    res[(dist, name)] = timeit(lambda: b.gather(batches[next(it) % 8], out=buf))
                else:
                    res[(dist, name)] = timeit(lambda: b.gather(batches[next(it) % 8]))
        stats = {name: b.stats() for name, b in backends.items() if "cache" in name and "no cache" not in name}
    mrows = {k: args.batch / v / 1e6 for k, v in res.items()}
    print(f"table {args.rows:,} x 64 fp32 ({gb:.2f} GB), gathers of {args.batch:,} rows, "
          f"threads {torch.get_num_threads()}; streaming copy {W.numel() * 4 / t_copy / 1e9:.1f} GB/s "
          f"= {bw_rows:.1f} Mrows/s")
    print(f"{'backend':<20} {'uniform Mrows/s':>16} {'zipf Mrows/s':>14}")
    for name in ["index_select", *backends]:
        print(f"{name:<20} {mrows[('uniform', name)]:>16.1f} {mrows[('zipf', name)]:>14.1f}")
    for name, s in stats.items():
        print(f"{name}: hit rate {s['hit_rate']:.1%} over both distributions")
    out = {
        "bench": "gather", "rows": args.rows, "streaming_copy_mrows_s": round(bw_rows, 1),
        "inram_vs_index_select": round(mrows[("uniform", "inram")] / mrows[("uniform", "index_select")], 2),
        "inram_vs_index_select_zipf": round(mrows[("zipf", "inram")] / mrows[("zipf", "index_select")], 2),
        "mmap_uncached_vs_inram": round(mrows[("uniform", "mmap (no cache)")] / mrows[("uniform", "inram")], 2),
        "mmap_cached_vs_inram": round(mrows[("zipf", "mmap + lru cache")] / mrows[("zipf", "inram")], 2),
        "mmap_lfu_cached_vs_inram": round(mrows[("zipf", "mmap + lfu cache")] / mrows[("zipf", "inram")], 2),
        "inram_vs_streaming_copy": round(mrows[("uniform", "inram")] / bw_rows, 3),
        "hit_rate": {k: round(v["hit_rate"], 3) for k, v in stats.items()},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
