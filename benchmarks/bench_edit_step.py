"""One `edit_facts` step on a real base + adapter: target positions only (`logits_to_keep`) against every position.

An edit's loss needs the log-probabilities of the target tokens only, but until this change every position of every
sequence was projected onto the vocabulary and log-softmaxed: a (B, T, V) tensor, V = 49,152 on SmolLM2, for
sequences that are mostly prompt. Both routes run here in one process on the same facts, alternating which goes first
each round, `--steps` steps each (no early stop: `target_prob` is unreachable), and the overlays they produce are
compared (the same rows; values equal up to float rounding). Prints per round the seconds per step of each route,
then the medians and their ratio (full / kept), and one JSON line; `--record FILE` appends it with the environment.

    OMP_NUM_THREADS=1 python benchmarks/bench_edit_step.py --base DIR --adapter DIR [--facts 64] [--steps 3]

Facts: the first `--facts` lines of a facts file (`engram edit`'s JSONL; default: generated "The capital of Name{i}
is" -> " Paris"), edited with `--positions` (default subject+trigger, the rows fact-edits' chosen variant writes).
"""

import argparse
import json
import statistics
import time

import torch
from _record import append_run


def facts_for(args):
    from engram.editing import Fact, read_facts

    if args.facts_file:
        return read_facts(args.facts_file)[:args.facts]
    return [Fact(f"The capital of Name{i} is", " Paris", subject=f"Name{i}") for i in range(args.facts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="a transformers base folder (e.g. `engram base`'s SmolLM2 import)")
    ap.add_argument("--adapter", required=True, help="a trained Engram adapter of that base (engram adapt)")
    ap.add_argument("--facts", type=int, default=64, help="facts edited at once (one chunk at the default --chunk)")
    ap.add_argument("--facts-file", help="engram edit's facts JSONL (default: generated facts)")
    ap.add_argument("--positions", default="subject+trigger")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--record", metavar="FILE", help="append the JSON line, with the environment, to this record")
    args = ap.parse_args()

    from engram.editing import edit_facts
    from engram.inference import load_with_adapter

    model, tok = load_with_adapter(args.base, args.adapter)
    model.eval()
    facts = facts_for(args)
    kw = dict(steps=args.steps, lr=0.1, positions=args.positions, target_prob=0.999999, progress=False,
              chunk=args.chunk)
    rows = {"kept": [], "full": []}
    overlays = {}
    edit_facts(model, tok, facts[:2], **{**kw, "steps": 1})  # warm-up: imports, allocator, oneDNN primitives
    for r in range(args.rounds):
        for route in (("kept", "full") if r % 2 == 0 else ("full", "kept")):
            t = time.perf_counter()
            overlays[route] = edit_facts(model, tok, facts, full_logits=route == "full", **kw)
            rows[route].append((time.perf_counter() - t) / args.steps)
        print(f"round {r}  kept {rows['kept'][-1]:.3f} s/step  full {rows['full'][-1]:.3f} s/step")
    a, b = overlays["kept"], overlays["full"]
    same_rows = all(torch.equal(a.rows[k], b.rows[k]) for k in a.rows) and a.rows.keys() == b.rows.keys()
    diff = max(float((a.values[k] - b.values[k]).abs().max()) for k in a.values)
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratio = round(med["full"] / med["kept"], 3)
    print(f"\nmedians of {args.rounds} rounds, {len(facts)} facts, {args.steps} steps: kept {med['kept']:.3f} s/step, "
          f"full {med['full']:.3f} s/step, full / kept {ratio}x (range {min(rows['full']) / max(rows['kept']):.2f}-"
          f"{max(rows['full']) / min(rows['kept']):.2f}); same rows {same_rows}, max |value difference| {diff:.2e}")
    out = {"base": args.base, "adapter": args.adapter, "facts": len(facts), "positions": args.positions,
           "steps": args.steps, "chunk": args.chunk, "rounds": args.rounds, "seconds_per_step": rows, "median": med,
           "ratio_full_over_kept": ratio, "same_rows": same_rows, "max_value_diff": diff,
           "threads": torch.get_num_threads()}
    print(json.dumps(out))
    if args.record:
        append_run(args.record,
                   "python benchmarks/bench_edit_step.py --base DIR --adapter DIR [--facts 64] [--steps 3]", out)


if __name__ == "__main__":
    main()
