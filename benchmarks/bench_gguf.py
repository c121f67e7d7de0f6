"""GGUF tables (llama.cpp's files) read lazily by the disk tier vs the same rows from engram's own table files, cold
and warm, side by side in one process.

One logical table, `--rows` x `--dim` (160: qwen4exp's PLE rows), written four ways: engram's own disk-tier file
(bfloat16, page-aligned safetensors with 4 KiB block sums: what `offload_tables(..., "disk")` writes); a GGUF with
the same bfloat16 rows (`tables.gguf.write_gguf`: page-aligned tensors, 4 KiB block sums); the same GGUF without
block sums (as llama.cpp's converter writes it: reads unchecked); and a Q8_0 GGUF (what llama.cpp's converters
write for these tables: 32 int8 codes + one float16 scale per block, 170 bytes for 160 values, decoded after the
gather). Each is read through `DiskTable` (the GGUF ones through `open_table(..., "disk")`).

Cold: the file evicted from the page cache (fsync + posix_fadvise DONTNEED; fincore, which uses mincore, reports
what stays resident), a fresh table opened, and the rows of one 4,096-token chunk (4,096 x `--heads` uniform ids)
gathered, every block checked on its first read where the file has sums. Warm: the same table after that gather,
the same ids gathered 5 times from the pages it has read (its mapping). Files are interleaved in every round, so
the machine's drift hits all of them; rows are checked against the in-RAM values (Q8_0: their decode). Prints a
table, the ratios to engram's own file, and one JSON line.

    python benchmarks/bench_gguf.py [--rows 1000000] [--dim 160] [--heads 16] [--rounds 3]
"""

import argparse
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
from bench_disk import compile_readers, evict  # noqa: E402

from engram.tables import write_table_file  # noqa: E402
from engram.tables.blocks import UnverifiedTableWarning  # noqa: E402
from engram.tables.disk import DiskTable  # noqa: E402
from engram.tables.gguf import decode_rows, encode_rows, open_table, write_gguf  # noqa: E402

NAME = "per_layer_token_embd.weight"


def opener(kind: str, path: Path):
    if kind == "engram bf16":
        return lambda: DiskTable(path)
    return lambda: open_table(path, NAME, "disk", dtype=torch.bfloat16 if "bf16" in kind else torch.float32)


def one_round(open_table_, path: Path, ids: torch.Tensor, want: torch.Tensor, warm_reps: int = 5):
    """(cold distinct rows/s, warm ids/s, resident fraction after eviction) of one fresh table over `path`."""
    resident = evict(path)
    table = open_table_()
    t = time.perf_counter()
    got = table.gather(ids)
    cold = torch.unique(ids).numel() / (time.perf_counter() - t)
    assert torch.equal(got.float(), want), f"{path.name}: rows differ"
    t = time.perf_counter()
    for _ in range(warm_reps):
        got = table.gather(ids)
    warm = warm_reps * ids.numel() / (time.perf_counter() - t)
    assert torch.equal(got.float(), want), f"{path.name}: warm rows differ"
    table.close()
    return cold, warm, resident


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=160)
    ap.add_argument("--heads", type=int, default=16, help="hash columns per token (qwen4exp: 16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="where to write the table files (default: a temp dir)")
    args = ap.parse_args()
    torch.manual_seed(0)
    W = torch.randn(args.rows, args.dim).to(torch.bfloat16)
    Wq = decode_rows(encode_rows(W.float(), "Q8_0"), "Q8_0", args.dim)  # what the Q8_0 file's rows decode to
    rng = np.random.default_rng(0)
    chunks = [torch.from_numpy(rng.integers(0, args.rows, 4096 * args.heads)) for _ in range(args.rounds)]
    with tempfile.TemporaryDirectory(dir=args.dir) as d, warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedTableWarning)  # (the llama.cpp-style file has no sums, by design)
        d = Path(d)
        files = {"engram bf16": write_table_file(d / "engram.safetensors", W, page_blocks=True),
                 "gguf bf16": write_gguf(d / "bf16.gguf", "qwen4exp", {}, [(NAME, "BF16", W)]),
                 "gguf bf16, no sums": write_gguf(d / "nosums.gguf", "qwen4exp", {}, [(NAME, "BF16", W)],
                                                  block_sums=False),
                 "gguf q8_0": write_gguf(d / "q8.gguf", "qwen4exp", {}, [(NAME, "Q8_0", W.float())])}
        want = {k: (lambda ids, k=k: (Wq if "q8" in k else W)[ids].float()) for k in files}
        compile_readers(d, W)
        cold, warm, resident = {k: [] for k in files}, {k: [] for k in files}, []
        for ids in chunks:
            for k, f in files.items():
                c, w, left = one_round(opener(k, f), f, ids, want[k](ids))
                cold[k].append(c)
                warm[k].append(w)
                resident.append(left)
        sizes = {k: f.stat().st_size for k, f in files.items()}
    c = {k: statistics.median(v) for k, v in cold.items()}
    w = {k: statistics.median(v) for k, v in warm.items()}
    base = "engram bf16"
    print(f"table {args.rows:,} x {args.dim}; {4096 * args.heads:,} ids per gather (one 4,096-token chunk), "
          f"{args.rounds} rounds; threads {torch.get_num_threads()}; resident after eviction: "
          f"{'n/a (no fincore)' if resident[0] is None else f'{max(resident):.1%} at most'}")
    print(f"{'file':<20} {'MiB':>7} {'cold rows/s':>12} {'vs engram':>9} {'warm Mids/s':>12} {'vs engram':>9}"
          f"   cold runs / warm runs (Mids/s)")
    for k in files:
        print(f"{k:<20} {sizes[k] / 2**20:>7.0f} {c[k]:>12,.0f} {c[k] / c[base]:>9.2f} {w[k] / 1e6:>12.2f} "
              f"{w[k] / w[base]:>9.2f}   {[round(x) for x in cold[k]]} / {[round(x / 1e6, 2) for x in warm[k]]}")
    out = {"bench": "gguf", "rows": args.rows, "dim": args.dim, "ids": 4096 * args.heads,
           "cold_rows_s": {k: round(v) for k, v in c.items()}, "warm_ids_s": {k: round(v) for k, v in w.items()},
           "cold_vs_engram": {k: round(c[k] / c[base], 3) for k in files if k != base},
           "warm_vs_engram": {k: round(w[k] / w[base], 3) for k in files if k != base},
           "cold_ratio_range": {k: [round(min(a / b for a, b in zip(cold[k], cold[base])), 3),
                                    round(max(a / b for a, b in zip(cold[k], cold[base])), 3)]
                                for k in files if k != base}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
