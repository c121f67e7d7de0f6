"""DeepSeek-V4.1's FP8 rows (e4m3 codes + a ue8m0 scale per 32 values, 264 bytes per 256-wide row) vs bfloat16
rows (512 bytes), warm in RAM and cold from the disk tier, side by side in one process.

One logical table, `--rows` x 256. Warm: gathers of 65,536 uniform ids from RAM, dequantized to bfloat16
(`BlockFp8Table` over packed rows) vs `InRamTable` over bfloat16 rows, interleaved over `--rounds`. Cold:
both written as the disk tier writes files (page-aligned, 4 KiB block sums: FP8 rows packed with their
scales, one read per row), evicted from the page cache before every round, and the distinct rows of one
4,096-token chunk (4,096 x `--heads` ids) gathered by `DiskTable`, every block checked on its first read;
with fio installed, fio's 4 KiB random-read limit in the same run. Rows are checked against the in-RAM
dequantization. Prints a table and one JSON line.

    python benchmarks/bench_v41.py [--rows 2000000] [--heads 24] [--rounds 3]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_disk import cold_gather, compile_readers, fio_reads_per_s  # noqa: E402

from engram.tables import InRamTable, write_table_file  # noqa: E402
from engram.tables.disk import DiskTable  # noqa: E402
from engram.tables.files import write_safetensors  # noqa: E402
from engram.tables.quant import BlockFp8Table, pack_ue8m0_rows, quantize_ue8m0  # noqa: E402

D = 256


def warm(tables: dict, rounds: int, n: int = 65536) -> dict:
    g = torch.Generator().manual_seed(1)
    out = {k: [] for k in tables}
    for _ in range(rounds):
        ids = torch.randint(0, next(iter(tables.values())).num_rows, (n,), generator=g)
        for k, t in tables.items():  # interleaved: the machine's drift hits both
            t.gather(ids)
            t0 = time.perf_counter()
            for _ in range(5):
                t.gather(ids)
            out[k].append(5 * n / (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--heads", type=int, default=24, help="hash columns per token: (N-1) x heads")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="where to write the table files (default: a temp dir)")
    args = ap.parse_args()
    torch.manual_seed(0)
    W = torch.randn(args.rows, D).to(torch.bfloat16)
    codes, scales = quantize_ue8m0(W)
    packed = pack_ue8m0_rows(codes, scales)  # (rows, 264)
    fp8_ram, bf16_ram = BlockFp8Table(packed=packed), InRamTable(W)
    w = warm({"bfloat16": bf16_ram, "fp8_ue8m0": fp8_ram}, args.rounds)
    rng = np.random.default_rng(0)
    chunks = [torch.from_numpy(rng.integers(0, args.rows, 4096 * args.heads)) for _ in range(args.rounds)]
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        files = {"bfloat16": write_table_file(Path(d) / "bf16.safetensors", W, page_blocks=True),
                 "fp8_ue8m0": write_safetensors(Path(d) / "v41.safetensors",
                                                [("rows", torch.uint8, tuple(packed.shape), iter([packed]))],
                                                block_sums=True, page_blocks=True)}
        want = {"bfloat16": lambda ids: W[ids].float(), "fp8_ue8m0": lambda ids: fp8_ram.gather(ids).float()}
        compile_readers(d, W)
        fio = fio_reads_per_s(files["bfloat16"], 32)
        cold, resident = {k: [] for k in files}, []
        for ids in chunks:
            for k, f in files.items():
                table = DiskTable(f) if k == "bfloat16" else BlockFp8Table(packed=DiskTable(f, tensor="rows"))
                rate, left = cold_gather(table, f, ids, want[k](ids))
                cold[k].append(rate)
                resident.append(left)
    c = {k: statistics.median(v) for k, v in cold.items()}
    print(f"table {args.rows:,} x {D}; warm: 65,536 ids x 5 per round; cold: {4096 * args.heads:,} ids per gather, "
          f"{args.rounds} rounds; resident after eviction: "
          f"{'n/a' if resident[0] is None else f'{max(resident):.1%} at most'}")
    print(f"{'rows':<10} {'bytes/row':>9} {'warm Mrows/s':>13} {'cold rows/s':>12} {'cold runs':>28}")
    for k, b in (("bfloat16", 2 * D), ("fp8_ue8m0", D + D // 32)):
        print(f"{k:<10} {b:>9} {w[k] / 1e6:>13.2f} {c[k]:>12,.0f} {str([round(x) for x in cold[k]]):>28}")
    lim = max(fio.values()) if fio else None  # the best engine: the device's 4 KiB random-read limit
    if lim:
        print("fio 4 KiB random reads, depth 32: " + ", ".join(f"{k} {v:,.0f}/s" for k, v in fio.items()))
    out = {"bench": "v41_rows", "rows": args.rows, "bytes_vs_bf16": round((D + D // 32) / (2 * D), 3),
           "warm_fp8_vs_bf16": round(w["fp8_ue8m0"] / w["bfloat16"], 3),
           "cold_fp8_vs_bf16": round(c["fp8_ue8m0"] / c["bfloat16"], 3),
           "cold_rows_s": {k: round(v) for k, v in c.items()},
           "cold_fp8_vs_fio": round(c["fp8_ue8m0"] / lim, 3) if lim else None}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
