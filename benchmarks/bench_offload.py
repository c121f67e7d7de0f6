"""End-to-end inference throughput with the Engram tables memory-mapped on disk (hot-row cache +
prefetch) vs the same tables in RAM, same model and inputs, one process.

Model: hidden 256, 4 layers, Engram at block 1 with 8 heads x ~520k rows x 64 dims (~1.07 GB fp32).
The table file is written first, so the page cache is warm (a table larger than RAM would page in
from disk; this machine cannot show that). The variants take turns for `--rounds` rounds of
`--batches` fresh batches each (medians over all rounds), so drift in the machine's speed hits all
alike. Prints a table, then one JSON line (`throughput_ratio`: the better mmap variant; both shown).

    python benchmarks/bench_offload.py [--rows-per-head 524288] [--batches 6] [--rounds 3]
"""

import argparse
import json
import statistics
import tempfile
import time

import torch

from engram.model import EngramForCausalLM
from engram.tables import Prefetcher, offload_tables
from engram.training import presets


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-per-head", type=int, default=524288)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--cache-mb", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of all variants, interleaved")
    args = ap.parse_args()
    torch.manual_seed(0)
    r = args.rows_per_head
    cfg = presets.cpu_small(vocab_size=8192, engram=dict(engram_vocab_size=[r, r], n_embed_per_ngram=256,
                                                         n_head_per_ngram=4, layer_ids=[1]))
    model = EngramForCausalLM(cfg).eval()
    gb = sum(p.numel() for n, p in model.named_parameters() if "multi_head_embedding" in n) * 4 / 1e9
    # Zipf-distributed token ids (text-like: frequent tokens and n-grams recur, so hot rows exist)
    g = torch.Generator().manual_seed(0)
    zipf = 1.0 / torch.arange(1, 8191, dtype=torch.float64) ** 1.1

    def draw():
        return [torch.multinomial(zipf, args.batch * args.seq, replacement=True, generator=g)
                .view(args.batch, args.seq) + 2 for _ in range(args.batches)]

    def run(m, batches, prefetch=None):
        ts = []
        with torch.no_grad():
            nxt = prefetch.submit(batches[0]) if prefetch else None
            for i, ids in enumerate(batches):
                t = time.perf_counter()
                rows = nxt
                if prefetch and i + 1 < len(batches):
                    nxt = prefetch.submit(batches[i + 1])  # next batch's lookups overlap this batch's compute
                logits = m(ids, engram_rows=rows).logits
                ts.append(time.perf_counter() - t)
        return logits, ts[1:]

    # the variants take turns, round after round, so that drift in this noisy machine's speed hits all alike
    res = {"ram": [], "cache": [], "nocache": []}
    same = True
    with tempfile.TemporaryDirectory() as d:
        mm = EngramForCausalLM(cfg).eval()
        mm.load_state_dict(model.state_dict())
        tables = offload_tables(mm, "mmap", d, cache_bytes=args.cache_mb << 20)
        slots = tables[1].slots
        pf = Prefetcher(mm)
        for _ in range(args.rounds):
            batches = draw()  # fresh ids every round: no variant replays lookups it has seen
            ref, ts = run(model, batches)
            res["ram"] += ts
            tables[1].slots = slots
            out, ts = run(mm, batches, pf)
            res["cache"] += ts
            hit = tables[1].stats()["hit_rate"]
            tables[1].slots = 0  # same file, cache off: prefetch only
            out2, ts = run(mm, batches, pf)
            res["nocache"] += ts
            same = same and torch.equal(out, ref) and torch.equal(out2, ref)
        pf.close()
    res = {k: statistics.median(v) for k, v in res.items()}
    t_ram = res.pop("ram")
    t_mm = min(res.values())
    best = min(res, key=res.get)
    ntok = args.batch * args.seq
    print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}; Engram table {gb:.2f} GB; "
          f"batch {args.batch} x {args.seq}; threads {torch.get_num_threads()}")
    print(f"{'tables':<28} {'s/batch':>8} {'tok/s':>8}")
    print(f"{'in RAM':<28} {t_ram:>8.3f} {ntok / t_ram:>8.0f}")
    print(f"{'mmap + cache + prefetch':<28} {res['cache']:>8.3f} {ntok / res['cache']:>8.0f}")
    print(f"{'mmap + prefetch (no cache)':<28} {res['nocache']:>8.3f} {ntok / res['nocache']:>8.0f}")
    print(f"identical logits: {same}; cache hit rate {hit:.1%}")
    print(json.dumps({"bench": "offload", "table_gb": round(gb, 2), "tok_s_ram": round(ntok / t_ram),
                      "tok_s_mmap": round(ntok / t_mm), "throughput_ratio": round(t_ram / t_mm, 3),
                      "best_variant": best, "cache_throughput_ratio": round(t_ram / res["cache"], 3),
                      "identical": same, "hit_rate": round(hit, 3)}))


if __name__ == "__main__":
    main()
