"""Engram table optimizer: lazy row Adam vs torch.optim.SparseAdam vs dense Adam, same table, same process.

A 4M x 64 fp32 table, 65,536 uniformly drawn row lookups per step (a few repeat).
Checks that LazyRowAdam's weights equal SparseAdam's after the timed steps (lazy-Adam semantics).
Prints a table, then one JSON line (`speedup_vs_sparse_adam`, `speedup_vs_dense_adam`).

    python benchmarks/bench_lazy_adam.py [--rows 4000000] [--touched 65536] [--steps 5]
"""

import argparse
import json
import statistics
import time

import torch

from engram.training.optim import LazyRowAdam


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--touched", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    W0 = torch.randn(args.rows, args.dim)
    grads = []
    for _ in range(args.steps + 1):
        idx = torch.randint(0, args.rows, (args.touched,))  # 65k lookups over the table, as in the notes
        grads.append(torch.sparse_coo_tensor(idx[None], torch.randn(args.touched, args.dim), (args.rows, args.dim)))

    def run(kind):
        p = torch.nn.Parameter(W0.clone())
        if kind == "lazy":
            opt = LazyRowAdam([p], lr=1e-3)
        elif kind == "sparse":
            opt = torch.optim.SparseAdam([p], lr=1e-3)
        else:
            opt = torch.optim.Adam([p], lr=1e-3)
        times = []
        for i, g in enumerate(grads):
            p.grad = g.to_dense() if kind == "dense" else g.clone()
            t = time.perf_counter()
            opt.step()
            if i > 0:  # first step allocates the moments
                times.append(time.perf_counter() - t)
        return statistics.median(times), p.detach()

    t_lazy, w_lazy = run("lazy")
    t_sparse, w_sparse = run("sparse")
    t_dense, _ = run("dense")
    diff = (w_lazy - w_sparse).abs().max().item()
    rows_per_step = args.touched
    print(f"table {args.rows:,} x {args.dim}, {args.touched:,} looked-up rows/step, threads {torch.get_num_threads()}")
    print(f"{'optimizer':<22} {'ms/step':>9} {'Mrows/s':>9} {'lazy speedup':>13}")
    for name, t in [("LazyRowAdam (engram)", t_lazy), ("torch SparseAdam", t_sparse), ("torch Adam (dense)", t_dense)]:
        print(f"{name:<22} {t * 1e3:>9.1f} {rows_per_step / t / 1e6:>9.2f} {t / t_lazy:>13.2f}")
    print(f"max |LazyRowAdam - SparseAdam| after {len(grads)} steps: {diff:.2e}")
    print(json.dumps({"bench": "lazy_adam", "rows": args.rows, "touched": args.touched,
                      "lazy_ms": round(t_lazy * 1e3, 2), "sparse_adam_ms": round(t_sparse * 1e3, 2),
                      "dense_adam_ms": round(t_dense * 1e3, 2),
                      "speedup_vs_sparse_adam": round(t_sparse / t_lazy, 2),
                      "speedup_vs_dense_adam": round(t_dense / t_lazy, 2), "max_abs_diff_vs_sparse_adam": diff}))


if __name__ == "__main__":
    main()
