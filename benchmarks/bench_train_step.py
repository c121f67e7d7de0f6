"""Training throughput of the `cpu-small` preset with vs without Engram (same backbone), one process.

Full optimizer steps (AdamW + LazyRowAdam) on random token batches of the preset's shape, hashing
included (done by the model, as without a prefetching data pipeline). Prints a table, then one
JSON line with `engram_overhead` (fraction of step time).

    python benchmarks/bench_train_step.py [--steps 8]
"""

import argparse
import json
import statistics
import time

import torch

from engram.model import EngramForCausalLM
from engram.training import presets
from engram.training.optim import build_optimizers


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    tcfg = presets.train_config("cpu-small")
    vocab = int(tcfg.tokenizer.split(":")[1])
    ids = torch.randint(2, vocab, (tcfg.batch_size, tcfg.seq_len))
    models = {}
    for eng in (False, True):
        torch.manual_seed(0)
        cfg = presets.cpu_small(vocab_size=vocab, use_engram=eng,
                                engram={**presets.cpu_small().engram,
                                        "tokenizer_name_or_path": "deepseek-ai/DeepSeek-V3"})
        m = EngramForCausalLM(cfg).train()
        models[eng] = (m, build_optimizers(m, tcfg.lr))

    def step(eng):
        m, opts = models[eng]
        loss = m(ids, labels=ids).loss
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts.values():
            o.step()

    times = {False: [], True: []}
    for eng in (False, True):
        step(eng)
    for _ in range(args.steps):  # interleave so machine noise hits both alike
        for eng in (False, True):
            t = time.perf_counter()
            step(eng)
            times[eng].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    ntok = ids.numel()
    print(f"cpu-small step: batch {tcfg.batch_size} x seq {tcfg.seq_len}, vocab {vocab}, "
          f"threads {torch.get_num_threads()}")
    print(f"{'variant':<16} {'s/step':>8} {'tok/s':>8}")
    for eng in (False, True):
        print(f"{'with Engram' if eng else 'no Engram':<16} {med[eng]:>8.3f} {ntok / med[eng]:>8.0f}")
    overhead = med[True] / med[False] - 1
    print(json.dumps({"bench": "train_step", "preset": "cpu-small", "tok_s_engram": round(ntok / med[True]),
                      "tok_s_no_engram": round(ntok / med[False]), "engram_overhead": round(overhead, 3)}))


if __name__ == "__main__":
    main()
