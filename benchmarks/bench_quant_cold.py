"""Quantized rows on the cold disk tier: bfloat16 vs FP8 / int8 table files read cold by `DiskTable`.

One logical table, `--rows` x `--dim` (default 4M x 160: the released qwen4_exp row width), written
three ways as the disk tier writes files (page-aligned, 4 KiB block sums): bfloat16 rows, FP8 e4m3
codes + a power-of-two scale per row, int8 codes + a float16 scale per row. Before every cold round
each file is evicted from the page cache (`posix_fadvise(DONTNEED)`, `fincore` when present) and a
fresh table gathers the distinct rows of one 4,096-token prefill chunk (4,096 x `--heads` uniform
ids), dequantized to float32 (quantized: codes read by `DiskTable`, scales in RAM), every block
checked on its first read. Prints bytes per row, file size, cold rows/s and the ratio to bfloat16;
then one JSON line (`<fmt>_bytes_vs_bf16`, `<fmt>_cold_vs_bf16`). Rows are checked against the
in-RAM dequantization.

    python benchmarks/bench_quant_cold.py [--rows 4000000] [--dim 160] [--heads 8] [--rounds 3]
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
from bench_disk import cold_gather, compile_readers  # noqa: E402

from engram.tables import write_table_file  # noqa: E402
from engram.tables.disk import DiskTable  # noqa: E402
from engram.tables.quant import QuantTable, open_quant_file, quantize_rows, write_quant_file  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=160)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="where to write the table files (default: a temp dir)")
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    chunks = [torch.from_numpy(rng.integers(0, args.rows, 4096 * args.heads)) for _ in range(args.rounds)]
    W = torch.randn(args.rows, args.dim).to(torch.bfloat16)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        files, want, per_row = {}, {}, {}
        files["bfloat16"] = write_table_file(Path(d) / "bf16.safetensors", W, page_blocks=True)
        want["bfloat16"], per_row["bfloat16"] = (lambda ids: W[ids].float()), 2 * args.dim
        for fmt in ("fp8", "int8"):
            codes, scales = quantize_rows(W, fmt)
            files[fmt] = write_quant_file(Path(d) / f"{fmt}.safetensors", codes, scales, fmt, page_blocks=True)
            ram = QuantTable(codes, scales, fmt)
            want[fmt], per_row[fmt] = ram.gather, ram.bytes_per_row
        compile_readers(d, W)
        res, resident = {k: [] for k in files}, []
        for ids in chunks:
            for fmt, f in files.items():
                table = DiskTable(f) if fmt == "bfloat16" else open_quant_file(f, tier="disk")
                rate, left = cold_gather(table, f, ids, want[fmt](ids))
                res[fmt].append(rate)
                resident.append(left)
    med = {k: statistics.median(v) for k, v in res.items()}
    sizes = {k: per_row[k] * args.rows / 2**30 for k in files}
    print(f"table {args.rows:,} x {args.dim}, cold rounds {args.rounds}, {4096 * args.heads:,} ids per gather; "
          f"resident after eviction: {'n/a' if resident[0] is None else f'{max(resident):.1%} at most'}")
    print(f"{'rows':<10} {'bytes/row':>9} {'file GiB':>9} {'cold rows/s':>12} {'vs bf16':>8}")
    for k in files:
        print(f"{k:<10} {per_row[k]:>9} {sizes[k]:>9.2f} {med[k]:>12,.0f} {med[k] / med['bfloat16']:>8.2f}")
    out = {"bench": "quant_cold", "rows": args.rows, "dim": args.dim}
    for k in ("fp8", "int8"):
        out[f"{k}_bytes_vs_bf16"] = round(per_row[k] / per_row["bfloat16"], 3)
        out[f"{k}_cold_vs_bf16"] = round(med[k] / med["bfloat16"], 3)
    out["cold_rows_s"] = {k: round(v) for k, v in med.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
