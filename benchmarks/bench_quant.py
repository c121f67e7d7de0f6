"""Quantized table rows (int8, FP8 e4m3) vs float32 and bfloat16 rows: bytes per row and gather speed.

Table `--rows` x `--dim` (default 4M x 32, the cpu-small preset's row width), gathers of 65,536
uniform rows, dequantized to float32 after the gather (what the Engram layer consumes). Sides:
float32 and bfloat16 rows gathered with `index_select` (bfloat16 then cast to float32, the plain
reference), int8 / fp8 `QuantTable` in RAM, and the same from memory-mapped quantized files
(warm page cache). Interleaved rounds; prints a table, then one JSON line
(`<fmt>_bytes_vs_bf16`, `<fmt>_gather_vs_bf16`, ...).

    python benchmarks/bench_quant.py [--rows 4000000] [--dim 32] [--rounds 5]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import timeit  # noqa: E402

from engram.tables.quant import QuantTable, open_quant_file, quantize_rows, write_quant_file  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    W = torch.randn(args.rows, args.dim)
    Wb = W.to(torch.bfloat16)
    rng = np.random.default_rng(0)
    batches = [torch.from_numpy(rng.integers(0, args.rows, args.batch)) for _ in range(8)]
    sides = {"float32": lambda r: torch.index_select(W, 0, r),
             "bfloat16": lambda r: torch.index_select(Wb, 0, r).float()}
    bytes_per_row = {"float32": 4 * args.dim, "bfloat16": 2 * args.dim}
    with tempfile.TemporaryDirectory() as d:
        for fmt in ("int8", "fp8"):
            codes, scales = quantize_rows(W, fmt)
            t = QuantTable(codes, scales, fmt)
            f = open_quant_file(write_quant_file(Path(d) / f"{fmt}.safetensors", codes, scales, fmt))
            f.gather(torch.arange(args.rows))  # every block checked once (warm, verified)
            sides[fmt] = t.gather
            sides[f"{fmt} (mmap file)"] = f.gather
            bytes_per_row[fmt] = bytes_per_row[f"{fmt} (mmap file)"] = t.bytes_per_row
        res = {k: [] for k in sides}
        for _ in range(args.rounds):
            for k, fn in sides.items():
                it = iter(range(10**9))
                res[k].append(timeit(lambda: fn(batches[next(it) % 8]), 10))
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"table {args.rows:,} x {args.dim}, gathers of {args.batch:,} uniform rows -> float32, "
          f"threads {torch.get_num_threads()}, {args.rounds} interleaved rounds")
    print(f"{'rows':<18} {'bytes/row':>9} {'Mrows/s':>8} {'vs bf16':>8}")
    for k in sides:
        print(f"{k:<18} {bytes_per_row[k]:>9} {args.batch / med[k] / 1e6:>8.1f} {med['bfloat16'] / med[k]:>8.2f}")
    out = {"bench": "quant", "rows": args.rows, "dim": args.dim}
    for k in sides:
        key = k.replace(" (mmap file)", "_mmap")
        out[f"{key}_bytes_vs_bf16"] = round(bytes_per_row[k] / bytes_per_row["bfloat16"], 3)
        out[f"{key}_gather_vs_bf16"] = round(med["bfloat16"] / med[k], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
