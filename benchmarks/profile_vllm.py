"""Where Engram's time goes inside vLLM: one engine, Engram switched on and off between rounds, each step timed.

`bench_vllm.py`'s model (`--design reference`: the reference's short conv; `v41`: DeepSeek-V4.1's, no conv) in vLLM's
in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the model runs in this process), `--requests` prompts x
`--tokens` greedy tokens per round. Rounds alternate Engram on and off on the same engine (`options.scale`, what
`engram_scale: 0` sets), so the machine's noise falls on both. With Engram on, each piece of a step is timed: the
step's view of the KV slots (`step_view`), hashing (`hash_ids`), and per Engram layer the table gather, the value /
gate projection and the conv with its slot store (`engram_delta` in all). Medians per step are over every step of
the rounds (prefill steps included, so a mean would be skewed by them).

    python benchmarks/profile_vllm.py [--design reference|v41] [--rounds 5] [--record FILE]

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

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process: its steps can be timed here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
HERE = Path(__file__).resolve().parent

# what is timed: (module, class or None, attribute) -> label; module functions are looked up by the model's module
# at call time, so replacing the module's name times every call
PIECES = [("engram.integrations.vllm.model", None, "step_view", "step view"),
          ("engram.integrations.vllm.model", None, "hash_ids", "hashing"),
          ("engram.integrations.vllm.model", None, "engram_delta", "Engram layers"),
          ("engram.memory", "MultiHeadEmbedding", "gather", "table gather"),
          ("engram._faststep", "Layer", "project", "projection (fused)"),
          ("engram._faststep", "Layer", "delta", "gate + conv (fused)"),
          ("engram.memory", "Engram", "gated_value", "value + gate (torch)"),
          ("engram.memory", "Engram", "mix_at_taps", "conv step (torch)"),
          ("engram._faststep", None, "conv", "conv step (fused)")]  # an older engram's (profiled for comparison)
PARTS = ("table gather", "projection (fused)", "gate + conv (fused)", "value + gate (torch)", "conv step (torch)",
         "conv step (fused)")  # parts of "Engram layers"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--design", choices=("reference", "v41"), default="reference")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--record", metavar="FILE", help="append the JSON line, with the environment, to this record")
    args = ap.parse_args()
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
        from engram.persist import write_json
        from engram.utils import environment

        rec = Path(args.record)
        data = (json.loads(rec.read_text()) if rec.exists()
                else {"command": "python benchmarks/bench_vllm.py", "runs": []})
        data.setdefault("profiles", []).append({**out, "argv": sys.argv[1:], "environment": environment(),
                                                "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
        write_json(rec, data)


def profile(llm, sampling, args) -> dict:
    import importlib

    import engram.integrations.vllm.model as vm

    times = collections.defaultdict(list)
    on = {"now": True}

    def timed(owner, name, label):
        f = getattr(owner, name)

        def g(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            if on["now"]:
                times[label].append(time.perf_counter() - t)
            return r
        setattr(owner, name, g)

    for mod, cls, name, label in PIECES:
        try:  # (an older engram, profiled for comparison, lacks the newer pieces)
            owner = importlib.import_module(mod)
        except ImportError:
            continue
        owner = getattr(owner, cls) if cls else owner
        if hasattr(owner, name):
            timed(owner, name, label)
    fwd = vm.EngramForCausalLM.forward

    def forward(self, *a, **k):
        t = time.perf_counter()
        r = fwd(self, *a, **k)
        times["forward, Engram " + ("on" if on["now"] else "off")].append(time.perf_counter() - t)
        return r
    vm.EngramForCausalLM.forward = forward
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    prompts = [f"Line {i}: the quick brown fox" for i in range(args.requests)]
    llm.generate(prompts[:2], sampling, use_tqdm=False)  # warm-up
    tok_s = {"on": [], "off": []}
    for r in range(args.rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            on["now"] = mode == "on"
            model.options.scale = 1.0 if on["now"] else 0.0
            t = time.perf_counter()
            res = llm.generate(prompts, sampling, use_tqdm=False)
            tok_s[mode].append(sum(len(o.outputs[0].token_ids) for o in res) / (time.perf_counter() - t))
    ratios = [a / b for a, b in zip(tok_s["on"], tok_s["off"])]
    med = {k: round(1e3 * statistics.median(v), 4) for k, v in times.items() if v}
    print(f"{'per step (median, ms)':<28} {'':>8}")
    for k, v in med.items():
        print(f"{'  ' * (k in PARTS) + k:<28} {v:>8.3f}")
    print(f"tokens/s Engram on {statistics.median(tok_s['on']):.0f}, off {statistics.median(tok_s['off']):.0f}: "
          f"on/off {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f} over {args.rounds} rounds)")
    return {"bench": "vllm_profile", "design": args.design, "requests": args.requests, "tokens": args.tokens,
            "rounds": args.rounds, "step_ms": med, "steps": {k: len(v) for k, v in times.items()},
            "tok_s": {k: [round(x, 1) for x in v] for k, v in tok_s.items()},
            "on_off": round(statistics.median(ratios), 4),
            "on_off_range": [round(min(ratios), 4), round(max(ratios), 4)]}


if __name__ == "__main__":
    main()
