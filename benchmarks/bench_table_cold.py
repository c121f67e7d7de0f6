"""Training with the Engram table in a file colder than the page cache: read-ahead on vs off, vs warm.

A `cpu-small`-shaped model whose table (`--rows-per-head` x 8 heads x 32 dims, default 1 GiB, plus
2 GiB of Adam moments in the same file) lives in a memory-mapped training file. Batches are uniform
random tokens (every n-gram new: the rows a step touches are spread over the whole table, as in a
table far larger than RAM) from the real data pipeline (`data.Batcher`, hashing ahead on its thread).
Three runs, each on the same file:
  * warm: the file as the first commit leaves it (it sums every block: one pass, all pages cached);
  * cold: evicted after the table is opened and committed (`madvise(MADV_PAGEOUT)` on its mappings, then
    `posix_fadvise(DONTNEED)`; `fincore` shows what is left);
    each step's rows and moments page in by faults when the step reads them;
  * cold + read-ahead: evicted too, and the pipeline pages in the next batch's rows and moments
    while the current step computes (`tables.readahead_for`, what `engram train` wires in).
Step time includes waiting for the batch. Prints a table, then one JSON line (`cold_vs_warm`,
`cold_readahead_vs_warm`; target >= 0.8 with read-ahead).

    python benchmarks/bench_table_cold.py [--rows-per-head 1048576] [--steps 10]
"""

import argparse
import gc
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_disk import evict  # noqa: E402

from engram.memory import defer_table_allocation  # noqa: E402
from engram.model import EngramForCausalLM  # noqa: E402
from engram.tables import offload_tables, readahead_for, table_file  # noqa: E402
from engram.training import presets  # noqa: E402
from engram.training.data import Batcher  # noqa: E402
from engram.training.optim import build_optimizers  # noqa: E402


def page_out(table) -> float | None:
    """Evict a table file that is mapped (MADV_PAGEOUT on each mapping, then DONTNEED); returns what stays resident."""
    for arr in list(table._arrays) + ([table.blocks.data] if table.blocks is not None else []):
        arr._mmap.madvise(getattr(mmap, "MADV_PAGEOUT", 21))  # (21: MADV_PAGEOUT, Linux >= 5.4)
    return evict(table.path)


def run(cfg, d, tokens, args, readahead: bool, cold: bool = False) -> tuple[list[float], float | None]:
    torch.manual_seed(0)
    with defer_table_allocation():
        model = EngramForCausalLM(cfg).train()
    tables = offload_tables(model, "mmap", d, cache_bytes=0, trainable=True, init_seed=0)
    resident = None
    for tb in tables.values():
        tb.durable = False
        tb.commit(0)  # (sums every block of a reopened file: one pass that leaves it in the page cache)
        if cold:
            resident = page_out(tb)
    opts = build_optimizers(model, 1e-3)
    batcher = Batcher(tokens, args.seq, args.batch, seed=0, hash_mapping=model.model.mapping,
                      readahead=readahead_for(model) if readahead else None)
    times, losses = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        ids, hashes = batcher.next()
        loss = model(ids, labels=ids, hash_ids=hashes).loss
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts.values():
            o.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    if batcher._pending is not None:
        batcher._pending[0].join()
    for tb in tables.values():
        tb.close()
    del model, tables, opts, batcher
    gc.collect()
    return times, resident


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-per-head", type=int, default=1 << 20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dir", help="where to write the table file (default: a temp dir)")
    args = ap.parse_args()
    r = args.rows_per_head
    cfg = presets.cpu_small(vocab_size=8192, engram=dict(engram_vocab_size=[r, r], n_embed_per_ngram=128,
                                                         n_head_per_ngram=4, layer_ids=[1]))
    tokens = np.random.default_rng(0).integers(2, 8192, args.batch * args.seq * (args.steps + 2)).astype(np.uint32)
    res, resident = {}, {}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        run(cfg, d, tokens, argparse.Namespace(**{**vars(args), "steps": 1}), False)  # creates the table file
        f = table_file(d, 1)
        for name, ahead in (("warm", False), ("cold", False), ("cold + read-ahead", True)):
            times, resident[name] = run(cfg, d, tokens, args, ahead, cold=name != "warm")
            res[name] = statistics.median(times[1:])
        size_gb = os.path.getsize(f) / 2**30
    ntok = args.batch * args.seq
    print(f"table file {size_gb:.2f} GiB (rows + Adam moments), batch {args.batch} x {args.seq} uniform random tokens, "
          f"{args.steps} steps per run (median of steps 2+), threads {torch.get_num_threads()}; resident after "
          f"eviction: " + ", ".join(f"{k} {'n/a' if v is None else f'{v:.1%}'}" for k, v in resident.items()
                                     if k != "warm"))
    print(f"{'table file':<20} {'s/step':>8} {'tok/s':>8} {'vs warm':>8}")
    for k, t in res.items():
        print(f"{k:<20} {t:>8.3f} {ntok / t:>8.0f} {res['warm'] / t:>8.2f}")
    print(json.dumps({"bench": "table_cold", "file_gib": round(size_gb, 2),
                      "cold_vs_warm": round(res["warm"] / res["cold"], 3),
                      "cold_readahead_vs_warm": round(res["warm"] / res["cold + read-ahead"], 3)}))


if __name__ == "__main__":
    main()
