"""Hashing throughput: engram's `NgramHashMapping.hash` vs a plain numpy reference-style hash.

Same process, same ids, tutorial config (2 layers x 16 heads), B=8, T=4096 by default.
Outputs are checked bit-identical. Prints a table, then one JSON line.

    python benchmarks/bench_hash.py [--batch 8] [--seq 4096] [--repeats 20]
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _reference import reference_hash  # noqa: E402
from _timing import timeit  # noqa: E402

from engram import EngramConfig, get_hash_mapping  # noqa: E402
from engram.hashing import kernels as hash_kernels  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    m = get_hash_mapping(EngramConfig())
    ids = np.random.default_rng(0).integers(0, m.raw_vocab_size, size=(args.batch, args.seq))
    ntok = ids.size
    ref = reference_hash(m, ids)
    rows = []
    kernels = ["torch"] + (["numba"] if hash_kernels.available() else [])
    t_ref = timeit(lambda: reference_hash(m, ids), args.repeats)
    rows.append(("reference (numpy, % per head)", t_ref, True))
    results = {}
    for be in kernels:
        m.kernel = be
        out = m.hash(ids)
        same = all(np.array_equal(out[l], ref[l]) for l in m.layer_ids)
        t = timeit(lambda: m.hash(ids), args.repeats)
        rows.append((f"engram ({be})", t, same))
        results[be] = (t, same)
    m.kernel = "auto"
    print(f"hash: B={args.batch} T={args.seq}, layers {m.layer_ids}, {16} heads/layer, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'implementation':<32} {'ms':>8} {'Mtok/s':>8} {'speedup':>8} {'identical':>9}")
    for name, t, same in rows:
        print(f"{name:<32} {t * 1e3:>8.2f} {ntok / t / 1e6:>8.2f} {t_ref / t:>8.2f} {str(same):>9}")
    best = min(results, key=lambda b: results[b][0])
    print(json.dumps({
        "bench": "hash", "batch": args.batch, "seq": args.seq, "backend": best,
        "ref_mtok_s": round(ntok / t_ref / 1e6, 3), "engram_mtok_s": round(ntok / results[best][0] / 1e6, 3),
        "speedup": round(t_ref / results[best][0], 2),
        "torch_backend_speedup": round(t_ref / results["torch"][0], 2),
        "identical": all(s for _, s in results.values()),
    }))


if __name__ == "__main__":
    main()
