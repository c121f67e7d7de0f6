"""`engram edit` at 100, 1,000 and 10,000 facts: wall seconds and peak RSS of the whole command.

Model: the tests' tiny run (`engram train tiny`, 10 steps on tests/conftest.py's 400-line corpus), trained into a
temp folder unless `--checkpoint` names one. Facts: distinct generated prompts "The king sat on Line N" (the last
n-gram differs from fact to fact, so the edited rows, the collision set and the hash-shared rows grow with the
count), targets " dog" or " the king" (one and two tokens), one paraphrase and one passage each. Each size runs
`engram edit ... --steps 2 --chunk CHUNK` in a fresh interpreter, which reports its own peak (`VmHWM`,
`utils.peak_rss_mib`); the overlay and report.json are checked to hold every fact.

`--facts FILE` edits the first N facts (after `--shuffle SEED`) of a real `--facts` file instead (e.g. the fact set's
`python -m engram_experiments.factset facts.jsonl --edit-facts edit.jsonl`: countries, cities, elements and invented
entities with paraphrases and a question), on `--checkpoint` (e.g. the README's `runs/cpu-small`); `--steps 300`
is `engram edit`'s default (an edit stops early once every target is reached). `--patience N` runs each size twice
in this process, the full edit and the same edit with `engram edit --patience N` (which ends an edit whose facts
conflict once N steps meet no more facts), and prints the ratio of their times and the difference of their greedy
and paraphrase hits; `--positions` passes engram edit's. `--record FILE` appends the rows, with the environment, to
a JSON record (docs/results/bench-edit-scale.json).

    OMP_NUM_THREADS=1 python benchmarks/bench_edit_scale.py [--sizes 100 1000 10000] [--chunk 64] [--steps 2]
        [--checkpoint DIR] [--facts FILE] [--shuffle SEED] [--positions P] [--patience N] [--record FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _record import append_run

CHILD = """
import json, sys
from engram.cli import main
from engram.utils import peak_rss_mib
code = main(sys.argv[2:])
print(json.dumps({"code": code, "peak_rss_mib": peak_rss_mib()}), file=open(sys.argv[1], "w"))
"""


def write_facts(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"The king sat on Line {i}", "target": " dog" if i % 2 else " the king",
                                "paraphrases": [f"the cat ran to Line {i}"],
                                "passages": [f"the dog ran to the mat. The king sat on Line {i}"]}) + "\n")


def tiny_checkpoint(root: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import TINY_CORPUS

    from engram.training.train import train

    (root / "c.txt").write_text(TINY_CORPUS)
    train("tiny", data=[str(root / "c.txt")], out=root / "run", max_steps=10,
          overrides={"ckpt_every": 5, "eval_every": 5}, progress=False)
    return root / "run"


def edit_once(out: Path, n: int, argv: list) -> dict:
    """`engram edit argv --out out` in a fresh interpreter: its wall seconds, peak RSS, rows, steps and summary."""
    res = out.with_suffix(".res.json")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, str(res), *map(str, argv + ["--out", out])], capture_output=True,
                       text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"engram edit failed at {n} facts:\n{p.stderr[-2000:]}")
    r = json.loads(res.read_text())
    report = json.loads((out / "report.json").read_text())
    meta = json.loads((out / "overlay.json").read_text())
    assert len(report["facts"]) == n and len(meta["facts"]) == n, "the report or overlay misses facts"
    opt = meta.get("optimization", {})
    return {"facts": n, "seconds": round(seconds, 1), "peak_rss_mib": round(r["peak_rss_mib"], 1),
            "rows_changed": report["summary"]["rows_changed"], "steps_run": opt.get("steps_run"),
            "stopped": opt.get("stopped"),
            "summary": {k: v for k, v in report["summary"].items() if isinstance(v, (int, float))}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--checkpoint", help="an engram run or model folder (default: train the tiny one)")
    ap.add_argument("--facts", type=Path, help="a real --facts file: edit its first N facts (default: generated)")
    ap.add_argument("--shuffle", type=int, metavar="SEED", help="with --facts: shuffle its facts with SEED first (the "
                    "fact set's file is in relation order)")
    ap.add_argument("--positions", choices=["trigger", "all", "subject", "subject+trigger"],
                    help="engram edit's --positions (default: its own, trigger)")
    ap.add_argument("--patience", type=int, metavar="N", help="also run each size with engram edit --patience N, "
                    "beside the full edit, and print the ratio of their times and the difference of their hits")
    ap.add_argument("--record", help="append the rows, with the environment, to this JSON record")
    args = ap.parse_args()
    real = args.facts.read_text().splitlines() if args.facts else None
    if real is not None and args.shuffle is not None:
        import random

        random.Random(args.shuffle).shuffle(real)
    if real is not None and max(args.sizes) > len(real):
        sys.exit(f"bench_edit_scale: --facts {args.facts} holds {len(real)} facts, fewer than {max(args.sizes)}")
    variants = [("", [])] + ([(f"patience {args.patience}", ["--patience", args.patience])] if args.patience else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = Path(args.checkpoint) if args.checkpoint else tiny_checkpoint(tmp)
        corpus = tmp / "c.txt"
        if not corpus.is_file():
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from conftest import TINY_CORPUS

            corpus.write_text(TINY_CORPUS)
        print(f"{'facts':>7} {'variant':>12} {'seconds':>8} {'peak RSS MiB':>13} {'rows':>6} {'steps':>6} "
              f"{'greedy':>7} {'paraphr.':>9}")
        for n in args.sizes:
            facts = tmp / f"facts{n}.jsonl"
            if real is None:
                write_facts(facts, n)
            else:
                facts.write_text("\n".join(real[:n]) + "\n")
            base = ["edit", "--checkpoint", ckpt, "--facts", facts, "--data", corpus, "--split", "train",
                    "--seq-len", 32, "--max-windows", 16, "--steps", args.steps, "--chunk", args.chunk,
                    *(["--positions", args.positions] if args.positions else [])]
            done = []
            for name, extra in variants:  # side by side: the full edit, then the same edit with --patience
                row = edit_once(tmp / f"ov{n}{name.replace(' ', '')}", n, base + extra)
                row["variant"] = name or "full"
                s = row["summary"]
                print(f"{n:>7,} {row['variant']:>12} {row['seconds']:>8.1f} {row['peak_rss_mib']:>13.0f} "
                      f"{row['rows_changed']:>6,} {row['steps_run']!s:>6} {s.get('greedy_after', 0):>7.3f} "
                      f"{s.get('paraphrases_greedy_after') or 0:>9.3f}", flush=True)
                done.append(row)
            if len(done) == 2:
                a, b = (d["summary"] for d in done)

                def gain(k):
                    return (b.get(k) or 0) - (a.get(k) or 0)

                print(f"{n:>7,} patience/full: time {done[1]['seconds'] / done[0]['seconds']:.2f}x, greedy "
                      f"{gain('greedy_after'):+.3f}, paraphrases {gain('paraphrases_greedy_after'):+.3f}", flush=True)
            rows += done
    if args.record:
        append_run(args.record, "python benchmarks/bench_edit_scale.py",
                   {"checkpoint": args.checkpoint or "the tiny preset, 10 steps",
                    "facts_file": str(args.facts) if args.facts else None, "shuffle": args.shuffle,
                    "steps": args.steps, "chunk": args.chunk, "positions": args.positions,
                    "patience": args.patience, "rows": rows})


if __name__ == "__main__":
    main()
