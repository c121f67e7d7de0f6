"""Backbone step cost: forward+backward time with vs without Engram and with vs without mHC, one process.

Small config (hidden 256, 4 layers, vocab 8192, Engram at block 1, B=4, T=256). The four variants
share everything else; each step is timed as the median of `--repeats`. Prints a table, then one
JSON line with `engram_overhead` and `mhc_overhead` (fractions of the step time without them).

    python benchmarks/bench_backbone.py [--repeats 5]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import timeit  # noqa: E402

from engram.model import EngramForCausalLM
from engram.training import presets


def step_time(cfg, ids, repeats):
    torch.manual_seed(0)
    m = EngramForCausalLM(cfg).train()

    def step():
        m.zero_grad(set_to_none=True)
        m(ids, labels=ids).loss.backward()

    return timeit(step, repeats)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    base = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=768,
                engram=dict(engram_vocab_size=[50021, 50021], n_embed_per_ngram=128, n_head_per_ngram=4, layer_ids=[1]))
    ids = torch.randint(0, 8192, (4, 256))
    t = {}
    for hc in (1, 4):
        for eng in (False, True):
            t[(hc, eng)] = step_time(presets.tiny(**base, hc_mult=hc, use_engram=eng), ids, args.repeats)
    print(f"{'variant':<28} {'step s':>8}")
    for (hc, eng), v in t.items():
        print(f"{('mHC x4' if hc == 4 else 'plain residual') + (' + Engram' if eng else ''):<28} {v:>8.3f}")
    engram_overhead = statistics.mean([t[(hc, True)] / t[(hc, False)] - 1 for hc in (1, 4)])
    mhc_overhead = statistics.mean([t[(4, eng)] / t[(1, eng)] - 1 for eng in (False, True)])
    print(json.dumps({"bench": "backbone", "engram_overhead": round(engram_overhead, 3),
                      "mhc_overhead": round(mhc_overhead, 3),
                      "step_s": {f"hc{hc}_{'engram' if eng else 'noengram'}": round(v, 4)
                                 for (hc, eng), v in t.items()}}))


if __name__ == "__main__":
    main()
