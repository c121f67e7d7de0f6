"""Decoding (batch 1, one token per step, KV cache) with the Engram table in a file colder than the
page cache: does the prefetcher hide the reads? Same model, same tokens, one process.

Model: `cpu-small` shape (hidden 256, 4 layers, Engram at block 1) with a table of 8 heads x
`--rows-per-head` x 32 dims fp32 (default 1M rows per head = 1 GiB). Each step's token is forced (a
logits processor picks a preset random sequence), so every step reads fresh n-gram rows spread
over the whole file, as decoding against a table far larger than RAM does. Variants, interleaved
for `--rounds` rounds on fresh token sequences:
  * ram:             the table as an in-RAM tensor;
  * disk warm:       `DiskTable` on the file with every page cached (a first pass read them);
  * disk cold:       `DiskTable` on the file just evicted (`posix_fadvise(DONTNEED)`, `fincore`
                     shows what is left), rows prefetched while block 0 computes (`Prefetcher.attach`);
  * disk cold, no prefetch: the same, rows read when the Engram layer asks for them.
Prints tokens/s per variant, then one JSON line (`cold_vs_warm`: the prefetched cold decode's
tokens/s over the warm one; target >= 0.9 where the device allows it).

    python benchmarks/bench_decode_cold.py [--rows-per-head 1048576] [--new-tokens 64] [--rounds 5]
                                           [--prefetch-thread]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_disk import evict  # noqa: E402

from engram.model import EngramForCausalLM  # noqa: E402
from engram.tables import Prefetcher, offload_tables, table_file  # noqa: E402
from engram.training import presets  # noqa: E402


class Forced:
    """A logits processor that makes step i emit `seq[i]` (fresh n-grams every step)."""

    def __init__(self, seq: torch.Tensor, start: int):
        self.seq, self.start = seq, start

    def __call__(self, input_ids, scores):
        out = torch.full_like(scores, -float("inf"))
        out[:, self.seq[input_ids.shape[1] - self.start]] = 0
        return out


def decode(model, prompt, seq, prefetch: bool) -> float:
    """Tokens/s of greedy decoding of len(seq) forced tokens after `prompt` (1, P)."""
    from transformers import LogitsProcessorList

    pf = Prefetcher.attach(model) if prefetch else None
    try:
        with torch.no_grad():
            t = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=len(seq), min_new_tokens=len(seq), do_sample=False,
                                 logits_processor=LogitsProcessorList([Forced(seq, prompt.shape[1])]),
                                 pad_token_id=1)
            dt = time.perf_counter() - t
    finally:
        if pf is not None:
            Prefetcher.detach(model)
    assert torch.equal(out[0, prompt.shape[1]:], seq), "forced decoding went astray"
    return len(seq) / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-per-head", type=int, default=1 << 20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefetch-thread", action="store_true",
                    help="prefetch decode steps on the prefetcher's worker too (Prefetcher.inline_below = 0)")
    args = ap.parse_args()
    if args.prefetch_thread:
        Prefetcher.inline_below = 0
    torch.manual_seed(0)
    r = args.rows_per_head
    cfg = presets.cpu_small(vocab_size=8192, engram=dict(engram_vocab_size=[r, r], n_embed_per_ngram=128,
                                                         n_head_per_ngram=4, layer_ids=[1]))
    ram = EngramForCausalLM(cfg).eval()
    state = ram.state_dict()
    g = torch.Generator().manual_seed(1)
    res = {"ram": [], "disk warm": [], "disk cold": [], "disk cold, no prefetch": []}
    resident = []
    with tempfile.TemporaryDirectory(dir=".") as d:
        def disk_model():
            m = EngramForCausalLM(cfg).eval()
            m.load_state_dict(state)
            offload_tables(m, "disk", d)  # reuses the file once written
            return m

        disk_model()  # writes the table file
        path = Path(table_file(d, 1))
        gb = path.stat().st_size / 2**30
        warm_up = torch.randint(2, cfg.vocab_size, (8,), generator=g)  # first calls compile and allocate
        decode(ram, warm_up.view(1, -1), warm_up, prefetch=False)
        decode(disk_model(), warm_up.view(1, -1), warm_up, prefetch=True)
        for _ in range(args.rounds):
            prompt = torch.randint(2, cfg.vocab_size, (1, 16), generator=g)
            seq = torch.randint(2, cfg.vocab_size, (args.new_tokens,), generator=g)
            res["ram"].append(decode(ram, prompt, seq, prefetch=False))
            for name, prefetch in (("disk cold", True), ("disk cold, no prefetch", False)):
                m = disk_model()  # fresh table: pages mapped by an earlier one could not be evicted
                resident.append(evict(path))
                res[name].append(decode(m, prompt, seq, prefetch))
                del m
            m = disk_model()
            decode(m, prompt, seq, prefetch=True)  # reads this sequence's rows: now they are cached
            res["disk warm"].append(decode(m, prompt, seq, prefetch=True))
            del m
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"decode batch 1, {args.new_tokens} forced tokens per round, {args.rounds} rounds; table {gb:.2f} GiB "
          f"(8 heads x {r:,} rows x 32 fp32); resident after eviction: "
          f"{'n/a (no fincore)' if resident[0] is None else f'{max(resident):.1%} at most'}")
    print(f"{'variant':<26} {'tokens/s':>9} {'vs warm':>8}")
    for k, v in med.items():
        print(f"{k:<26} {v:>9.1f} {v / med['disk warm']:>8.2f}")
    ratio = med["disk cold"] / med["disk warm"]
    print(f"target >= 0.9 (cold, prefetched, vs warm): {'met' if ratio >= 0.9 else 'NOT met'}")
    print(json.dumps({"bench": "decode_cold", "cold_vs_warm": round(ratio, 3),
                      "cold_noprefetch_vs_warm": round(med["disk cold, no prefetch"] / med["disk warm"], 3),
                      "warm_vs_ram": round(med["disk warm"] / med["ram"], 3),
                      "tokens_per_s": {k: round(v, 1) for k, v in med.items()}, "table_gib": round(gb, 2),
                      "resident_after_evict": None if resident[0] is None else max(resident)}))


if __name__ == "__main__":
    main()
