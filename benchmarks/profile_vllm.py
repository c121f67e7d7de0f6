"""Where Engram's time goes inside vLLM: one engine, Engram switched on and off between rounds, each step timed.

`bench_vllm.py`'s model (`--design reference`: the reference's short conv; `v41`: DeepSeek-V4.1's, no conv) in vLLM's
in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the model runs in this process), `--requests` prompts x
`--tokens` greedy tokens per round. Rounds alternate Engram on and off on the same engine (`options.scale`, what
`engram_scale: 0` sets), so the machine's noise falls on both; only the forward is timed in them, and tokens/s on / off
is their ratio. Then `--timed-rounds` with Engram on time each piece of a step (a Python wrapper around each, so the
ratio never comes from these rounds; their forward is printed apart, "forward, timed"): the step's view of the KV
slots (`step_view`), hashing (`hash_ids`), and per Engram layer the table gather, the value / gate projection and
the conv with its slot store (`engram_delta` in all). Medians per step are over every step of the rounds (prefill
steps included, so a mean would be skewed by them). Last, each piece's last call in the engine is replayed
`--replay` times in a loop of its own, same arguments (each writes what it wrote then): the same work warm, beside
its median in the engine ("warm x"), which shows how much of a piece's time there is the engine's forward
leaving its code and data cold.

    python benchmarks/profile_vllm.py [--design reference|v41] [--rounds 5] [--timed-rounds 2] [--replay 50]
                                      [--record FILE]

Prints the per-step medians, the forward with Engram on and off, tokens/s on and off with their ratio (range over
the rounds), and one JSON line; `--record FILE` appends it, with the environment, to a record
(docs/results/bench-vllm.json).
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _record import append_run

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process: its steps can be timed here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
HERE = Path(__file__).resolve().parent

# what is timed: (module, class or None, attribute) -> label; module functions are looked up by the model's module
# at call time, so replacing the module's name times every call
PIECES = [("engram.integrations.vllm.model", None, "step_view", "step view"),
          ("engram.integrations.vllm.model", None, "hash_ids", "hashing"),
          ("engram.integrations.vllm.model", None, "engram_delta", "Engram layers"),
          ("engram.memory", "MultiHeadEmbedding", "gather", "table gather"),
          ("engram.integrations.vllm._kernels", "Layer", "project", "projection (fused)"),
          ("engram.integrations.vllm._kernels", "Layer", "delta", "gate + conv (fused)"),
          ("engram.memory", "Engram", "gated_value", "value + gate (torch)"),
          ("engram.memory", "Engram", "mix_at_taps", "conv step (torch)"),
          # an older engram's, profiled for comparison (its step kernels were the top-level `engram._faststep`)
          ("engram._faststep", "Layer", "project", "projection (fused)"),
          ("engram._faststep", "Layer", "delta", "gate + conv (fused)"),
          ("engram._faststep", None, "conv", "conv step (fused)")]
PARTS = ("table gather", "projection (fused)", "gate + conv (fused)", "value + gate (torch)", "conv step (torch)",
         "conv step (fused)")  # parts of "Engram layers"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--design", choices=("reference", "v41"), default="reference")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each mode timing the forward only")
    ap.add_argument("--timed-rounds", type=int, default=2, help="rounds with Engram on timing each piece")
    ap.add_argument("--replay", type=int, default=50, help="warm calls of each piece's last engine call")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--record", metavar="FILE", help="append the JSON line, with the environment, to this record")
    args = ap.parse_args()
    if min(args.rounds, args.replay, args.requests, args.tokens) < 1 or args.timed_rounds < 0:
        ap.error("--rounds, --replay, --requests and --tokens must be at least 1, --timed-rounds at least 0")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        # built in a child: numba (engram's kernels) must not be loaded in this process before vLLM sets it up
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench_serve; "
                        f"from pathlib import Path; bench_serve.build(Path({str(d)!r}), {args.design!r})"], check=True)
        from vllm import LLM, SamplingParams

        llm = LLM(model=str(d / "run" / "final"), dtype="float32", enforce_eager=True, max_model_len=1024)
        out = profile(llm, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True), args)
    from engram.integrations.vllm.state import vllm_version

    out.update(vllm=vllm_version(), server_threads=os.environ.get("OMP_NUM_THREADS"))
    print(json.dumps(out))
    if args.record:
        append_run(args.record, "python benchmarks/bench_vllm.py", out, key="profiles")


def profile(llm, sampling, args) -> dict:
    import importlib

    import engram.integrations.vllm.model as vm

    times = collections.defaultdict(list)
    label = {"forward": "forward, Engram on"}

    last = {}  # label -> (function, args, kwargs) of the piece's last call
    replaying = False  # (a replayed piece's inner pieces are not timed)

    def timed(owner, name, label):
        f = getattr(owner, name)

        def g(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            if not replaying:
                times[label].append(time.perf_counter() - t)
                last[label] = (f, a, k)
            return r
        setattr(owner, name, g)

    fwd = vm.EngramForCausalLM.forward

    def forward(self, *a, **k):
        t = time.perf_counter()
        r = fwd(self, *a, **k)
        times[label["forward"]].append(time.perf_counter() - t)
        return r
    vm.EngramForCausalLM.forward = forward
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    prompts = [f"Line {i}: the quick brown fox" for i in range(args.requests)]

    def run(mode: str) -> float:
        label["forward"] = f"forward, {mode}"
        model.options.scale = 0.0 if mode == "Engram off" else 1.0
        t = time.perf_counter()
        res = llm.generate(prompts, sampling, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in res) / (time.perf_counter() - t)

    run("warm-up")
    tok_s = {"on": [], "off": []}
    for r in range(args.rounds):  # the forward alone timed
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            tok_s[mode].append(run(f"Engram {mode}"))
    for mod, cls, name, piece in PIECES:  # then each piece
        try:  # (an older engram, profiled for comparison, lacks the newer pieces)
            owner = importlib.import_module(mod)
        except ImportError:
            continue
        owner = getattr(owner, cls) if cls else owner
        if hasattr(owner, name):
            timed(owner, name, piece)
    for _ in range(args.timed_rounds):
        run("timed")
    times.pop("forward, warm-up", None)
    med = {k: round(1e3 * statistics.median(v), 4) for k, v in times.items() if v}
    steps = {k: len(v) for k, v in times.items()}
    warm, replaying = {}, True
    for piece, (f, a, k) in last.items():  # (the step view reads vLLM's forward context: not replayable outside it)
        if piece != "step view":
            ts = []
            for _ in range(args.replay):
                t = time.perf_counter()
                f(*a, **k)
                ts.append(time.perf_counter() - t)
            warm[piece] = round(1e3 * statistics.median(ts), 4)
    ratios = [a / b for a, b in zip(tok_s["on"], tok_s["off"])]
    print(f"{'per step (median, ms)':<28} {'':>8} {'warm':>8}")
    for k, v in med.items():
        tail = f" {warm[k]:>8.3f} ({v / warm[k]:.1f}x)" if k in warm else ""
        print(f"{'  ' * (k in PARTS) + k:<28} {v:>8.3f}{tail}")
    print(f"tokens/s Engram on {statistics.median(tok_s['on']):.0f}, off {statistics.median(tok_s['off']):.0f}: "
          f"on/off {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f} over {args.rounds} rounds)")
    return {"bench": "vllm_profile", "design": args.design, "requests": args.requests, "tokens": args.tokens,
            "rounds": args.rounds, "timed_rounds": args.timed_rounds, "step_ms": med, "warm_ms": warm,
            "steps": steps,
            "tok_s": {k: [round(x, 1) for x in v] for k, v in tok_s.items()},
            "on_off": round(statistics.median(ratios), 4),
            "on_off_range": [round(min(ratios), 4), round(max(ratios), 4)]}


if __name__ == "__main__":
    main()
