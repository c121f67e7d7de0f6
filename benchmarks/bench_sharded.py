"""Sharded lookup throughput: 2 gloo ranks on loopback, each looking up `--rows` random rows of a
row-sharded table per call (all-to-all of ids and rows), vs a local index_select in the same run.
Prints a table, then one JSON line (`mrows_s_per_rank`).

    python benchmarks/bench_sharded.py [--table-rows 4000000] [--rows 65536]
"""

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engram.distributed import ShardedTable


def worker(rank, world, port, args, outfile):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    table = ShardedTable(args.table_rows, 64)
    g = torch.Generator().manual_seed(rank)
    ids = [torch.randint(0, args.table_rows, (args.rows,), generator=g) for _ in range(args.repeats + 1)]
    local = torch.randn(args.table_rows // world, 64)
    ts, tl = [], []
    with torch.no_grad():
        for i, x in enumerate(ids):
            dist.barrier()
            t = time.perf_counter()
            table(x)
            if i:
                ts.append(time.perf_counter() - t)
            t = time.perf_counter()
            torch.index_select(local, 0, x % local.shape[0])
            if i:
                tl.append(time.perf_counter() - t)
    res = torch.tensor([statistics.median(ts), statistics.median(tl)])
    dist.all_reduce(res)
    if rank == 0:
        with open(outfile, "w") as f:
            json.dump((res / world).tolist(), f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table-rows", type=int, default=4_000_000)
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(worker, args=(2, port, args, out), nprocs=2, join=True)
        t_sh, t_loc = json.load(open(out))
    print(f"2 gloo ranks (1 thread each), table {args.table_rows:,} x 64 fp32 row-sharded, {args.rows:,} lookups/rank")
    print(f"{'lookup':<28} {'ms':>8} {'Mrows/s/rank':>13}")
    print(f"{'sharded (all-to-all)':<28} {t_sh * 1e3:>8.1f} {args.rows / t_sh / 1e6:>13.2f}")
    print(f"{'local index_select':<28} {t_loc * 1e3:>8.1f} {args.rows / t_loc / 1e6:>13.2f}")
    print(json.dumps({"bench": "sharded", "world": 2, "mrows_s_per_rank": round(args.rows / t_sh / 1e6, 3),
                      "local_mrows_s": round(args.rows / t_loc / 1e6, 3), "sharded_vs_local": round(t_loc / t_sh, 3)}))


if __name__ == "__main__":
    main()
