"""Cost of per-block table checksums: verified vs unverified memory-mapped gathers, opens and writes.

Table `--rows` x 64 fp32 (default 4M rows = 1 GiB) written twice, with and without block sums
(`write_safetensors(block_sums=...)`); warm page cache. Gathers of 65,536 uniform rows from a
`MmapTable` without a hot-row cache, timed in interleaved rounds:
  * plain: the same file read without verification (what engram did before);
  * verified, steady: every block already checked once (the check is one integer compare);
  * verified, partial: the ids avoid the last block, so the table is never fully checked and every
    gather pays the per-row block lookup (a huge table that is only partly read).
Also: open time, one full verification pass (`engram verify`) vs sha256 of the same file, and the
write overhead of computing the sums while streaming. Prints a table, then one JSON line
(`warm_verified_vs_plain`, `warm_partial_vs_plain`; target >= 0.97, i.e. <= 3% slower), and the
check's own time per gather as a share of a plain gather (`check_share_of_gather`), which the
machine's noise blurs less than a ratio of two gather timings.

    python benchmarks/bench_blocks.py [--rows 4000000] [--rounds 5]
"""

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import timeit  # noqa: E402

from engram.tables import MmapTable  # noqa: E402
from engram.tables.blocks import BlockVerifier, UnverifiedTableWarning  # noqa: E402
from engram.tables.files import tensor_entry, write_safetensors  # noqa: E402


def sha256_gbs(path: Path) -> float:
    t = time.perf_counter()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return path.stat().st_size / (time.perf_counter() - t) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    W = torch.randn(args.rows, 64)
    rng = np.random.default_rng(0)
    rows_per_block = (1 << 16) // (64 * 4)
    last_block_start = (args.rows - 1) // rows_per_block * rows_per_block
    batches = [torch.from_numpy(rng.integers(0, last_block_start, args.batch)) for _ in range(8)]
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        plain_f = write_safetensors(Path(d) / "plain.safetensors", [tensor_entry("weight", W)])
        t_write_plain = time.perf_counter() - t
        t = time.perf_counter()
        sums_f = write_safetensors(Path(d) / "sums.safetensors", [tensor_entry("weight", W)], block_sums=True)
        t_write_sums = time.perf_counter() - t
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnverifiedTableWarning)
            t_open_plain = timeit(lambda: MmapTable(plain_f, cache_bytes=0), 5)
        plain = MmapTable(sums_f, cache_bytes=0)
        plain.blocks = None  # the same file and pages, read without verification
        t_open_sums = timeit(lambda: MmapTable(sums_f, cache_bytes=0), 5)
        steady = MmapTable(sums_f, cache_bytes=0)
        steady.gather(torch.arange(args.rows))  # every block checked once
        assert steady.blocks.unverified == 0
        partial = MmapTable(sums_f, cache_bytes=0)
        for x in batches:
            partial.gather(x)
        v = BlockVerifier.open(sums_f)
        t = time.perf_counter()
        assert v.check_all() == []
        full_check_gbs = sums_f.stat().st_size / (time.perf_counter() - t) / 1e9
        sha_gbs = sha256_gbs(sums_f)
        res = {"plain": [], "verified, steady": [], "verified, partial": []}
        tables = {"plain": plain, "verified, steady": steady, "verified, partial": partial}
        for _ in range(args.rounds):  # interleaved: the machine's drift hits every variant alike
            for name, tb in tables.items():
                it = iter(range(10**9))
                res[name].append(timeit(lambda: tb.gather(batches[next(it) % 8]), 10))
        assert partial.blocks.unverified > 0, "the partial table should never be fully checked"
        it = iter(range(10**9))  # the check alone, as the partial table pays it on every gather
        t_check = timeit(lambda: partial.blocks.check_rows(batches[next(it) % 8], 0, 64 * 4), 50)
    med = {k: statistics.median(v) for k, v in res.items()}
    mrows = {k: args.batch / v / 1e6 for k, v in med.items()}
    gb = W.numel() * 4 / 1e9
    print(f"table {args.rows:,} x 64 fp32 ({gb:.2f} GB), 64 KiB blocks ({rows_per_block} rows), gathers of "
          f"{args.batch:,} uniform rows, warm page cache, {args.rounds} interleaved rounds")
    print(f"{'gather':<20} {'Mrows/s':>8} {'vs plain':>9}")
    for k in res:
        print(f"{k:<20} {mrows[k]:>8.2f} {med['plain'] / med[k]:>9.3f}")
    print(f"block check alone (partial table): {t_check * 1e6:.0f} us per gather = "
          f"{t_check / med['plain']:.1%} of a plain gather")
    print(f"open: {t_open_plain * 1e3:.2f} ms plain, {t_open_sums * 1e3:.2f} ms with sums; full check "
          f"{full_check_gbs:.2f} GB/s vs sha256 {sha_gbs:.2f} GB/s; write {t_write_plain:.2f} s plain, "
          f"{t_write_sums:.2f} s with sums")
    out = {"bench": "blocks", "rows": args.rows,
           "warm_verified_vs_plain": round(med["plain"] / med["verified, steady"], 3),
           "warm_partial_vs_plain": round(med["plain"] / med["verified, partial"], 3),
           "check_us": round(t_check * 1e6, 1), "check_share_of_gather": round(t_check / med["plain"], 4),
           "open_ms_plain": round(t_open_plain * 1e3, 2), "open_ms_sums": round(t_open_sums * 1e3, 2),
           "full_check_gb_s": round(full_check_gbs, 2), "sha256_gb_s": round(sha_gbs, 2),
           "write_overhead": round(t_write_sums / t_write_plain - 1, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
