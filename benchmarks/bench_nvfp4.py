"""NVFP4 rows (Qwen4Exp's packed format: 90 bytes per 160-wide row) vs FP8 and bfloat16 rows, warm in RAM and
cold from the disk tier, side by side in one process.

One logical table, `--rows` x 160 (Qwen3.8-Flash-Next's row width), stored four ways and decoded to bfloat16
(what Qwen4Exp serves): "bfloat16" (`InRamTable` / `DiskTable`, 320 B), "fp8" (engram's e4m3 + a power-of-two
scale per row, `QuantTable`, 161 B: the size of the community FP8 checkpoint's rows), "fp8_ue8m0" (e4m3 + a
scale byte per 32 values, `BlockFp8Table`, 165 B) and "nvfp4" (`NvFp4Table`, 90 B). Warm: gathers of
65,536 uniform ids from RAM, interleaved over `--rounds`. Cold: each written as the disk tier writes files
(page-aligned, 4 KiB block sums; block-scaled rows packed with their scales, one read per row), evicted
from the page cache (posix_fadvise DONTNEED; the resident fraction after it by fincore, i.e. mincore) before
every gather, and the distinct rows of one 4,096-token chunk (4,096 x `--heads` ids) gathered, every block
checked on its first read. Rows are checked against the in-RAM decode. Prints per-round rates, ratios against
bfloat16 as median [min, max] over rounds, and one JSON line.

    python benchmarks/bench_nvfp4.py [--rows 2000000] [--heads 16] [--rounds 5]
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
from bench_disk import cold_gather, compile_readers  # noqa: E402

from engram.tables import InRamTable, write_table_file  # noqa: E402
from engram.tables.disk import DiskTable  # noqa: E402
from engram.tables.files import write_safetensors  # noqa: E402
from engram.tables.quant import (  # noqa: E402
    BlockFp8Table,
    NvFp4Table,
    QuantTable,
    open_nvfp4_file,
    open_quant_file,
    pack_nvfp4_rows,
    pack_ue8m0_rows,
    quantize_nvfp4,
    quantize_rows,
    quantize_ue8m0,
    write_nvfp4_file,
    write_quant_file,
)

D = 160
FORMATS = ("bfloat16", "fp8", "fp8_ue8m0", "nvfp4")


def rounds_of(tables: dict, rounds: int, n: int = 65536) -> dict:
    """{format: [rows/s per round]}: 5 gathers of n uniform ids per round, formats interleaved."""
    g = torch.Generator().manual_seed(1)
    out = {k: [] for k in tables}
    for _ in range(rounds):
        ids = torch.randint(0, next(iter(tables.values())).num_rows, (n,), generator=g)
        for k, t in tables.items():  # interleaved: the machine's drift hits every format
            t.gather(ids)
            t0 = time.perf_counter()
            for _ in range(5):
                t.gather(ids)
            out[k].append(5 * n / (time.perf_counter() - t0))
    return out


def ratio(a: list, b: list) -> str:
    r = [x / y for x, y in zip(a, b)]
    return f"{statistics.median(r):.2f} [{min(r):.2f}, {max(r):.2f}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--heads", type=int, default=16, help="hash columns per token (Qwen3.8-Flash-Next: 8 + 8)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", help="where to write the table files (default: a temp dir)")
    args = ap.parse_args()
    torch.manual_seed(0)
    W = (torch.randn(args.rows, D) * 0.02).to(torch.bfloat16)
    codes8, scales8 = quantize_rows(W, "fp8")
    ue_codes, ue_scales = quantize_ue8m0(W)
    ue_packed = pack_ue8m0_rows(ue_codes, ue_scales)  # (rows, 165)
    nv_codes, nv_scales, g = quantize_nvfp4(W)
    nv_packed = pack_nvfp4_rows(nv_codes, nv_scales)  # (rows, 90)
    ram = {"bfloat16": InRamTable(W), "fp8": QuantTable(codes8, scales8, "fp8", torch.bfloat16),
           "fp8_ue8m0": BlockFp8Table(packed=ue_packed), "nvfp4": NvFp4Table(packed=nv_packed, global_scale=g)}
    bytes_per_row = {k: (2 * D if k == "bfloat16" else t.bytes_per_row) for k, t in ram.items()}
    warm = rounds_of(ram, args.rounds)
    rng = np.random.default_rng(0)
    chunks = [torch.from_numpy(rng.integers(0, args.rows, 4096 * args.heads)) for _ in range(args.rounds)]
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        d = Path(d)
        files = {"bfloat16": write_table_file(d / "bf16.safetensors", W, page_blocks=True),
                 "fp8": write_quant_file(d / "fp8.safetensors", codes8, scales8, "fp8", page_blocks=True),
                 "fp8_ue8m0": write_safetensors(d / "ue8m0.safetensors",
                                                [("rows", torch.uint8, tuple(ue_packed.shape), iter([ue_packed]))],
                                                block_sums=True, page_blocks=True),
                 "nvfp4": write_nvfp4_file(d / "nvfp4.safetensors", iter([nv_packed]), args.rows, D, g,
                                           page_blocks=True)}
        opener = {"bfloat16": lambda f: DiskTable(f), "fp8": lambda f: open_quant_file(f, torch.bfloat16, "disk"),
                  "fp8_ue8m0": lambda f: BlockFp8Table(packed=DiskTable(f, tensor="rows")),
                  "nvfp4": lambda f: open_nvfp4_file(f, "disk")}
        compile_readers(d, W)
        cold, resident = {k: [] for k in files}, []
        for ids in chunks:
            for k, f in files.items():
                rate, left = cold_gather(opener[k](f), f, ids, ram[k].gather(ids).float())
                cold[k].append(rate)
                resident.append(left)
        sizes = {k: f.stat().st_size for k, f in files.items()}
    print(f"table {args.rows:,} x {D}, decoded to bfloat16; warm: 65,536 ids x 5 per round; cold: "
          f"{4096 * args.heads:,} ids per gather; {args.rounds} rounds; resident after eviction: "
          f"{'n/a (no fincore)' if resident[0] is None else f'{max(resident):.1%} at most'}")
    print(f"{'rows':<10} {'B/row':>5} {'file MB':>8} {'warm Mrows/s':>12} {'ns/row':>7} {'cold rows/s':>11} "
          f"{'warm vs bf16':>18} {'cold vs bf16':>18}")
    for k in FORMATS:
        w, c = statistics.median(warm[k]), statistics.median(cold[k])
        print(f"{k:<10} {bytes_per_row[k]:>5} {sizes[k] / 1e6:>8.1f} {w / 1e6:>12.2f} {1e9 / w:>7.1f} {c:>11,.0f} "
              f"{ratio(warm[k], warm['bfloat16']):>18} {ratio(cold[k], cold['bfloat16']):>18}")
    print("per round, warm Mrows/s: " + "; ".join(f"{k} {[round(x / 1e6, 2) for x in warm[k]]}" for k in FORMATS))
    print("per round, cold rows/s:  " + "; ".join(f"{k} {[round(x) for x in cold[k]]}" for k in FORMATS))
    out = {"bench": "nvfp4_rows", "rows": args.rows, "dim": D, "rounds": args.rounds,
           "bytes_per_row": bytes_per_row,
           "warm_vs_bf16": {k: ratio(warm[k], warm["bfloat16"]) for k in FORMATS[1:]},
           "cold_vs_bf16": {k: ratio(cold[k], cold["bfloat16"]) for k in FORMATS[1:]},
           "warm_nvfp4_vs_fp8": ratio(warm["nvfp4"], warm["fp8"]),
           "cold_nvfp4_vs_fp8": ratio(cold["nvfp4"], cold["fp8"]),
           "warm_rows_s": {k: round(statistics.median(v)) for k, v in warm.items()},
           "cold_rows_s": {k: round(statistics.median(v)) for k, v in cold.items()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
