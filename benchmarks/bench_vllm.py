"""Engram served by vLLM on loopback, at 1, 4 and 16 concurrent clients: tokens/s and p50/p99 latency.

engram's own model (`--design reference`: the reference's short conv; `v41`: DeepSeek-V4.1's, no conv), four ways:
(a) vLLM with engram's plugin (tables in RAM), (b) `engram serve` (engram's own engine), (c) vLLM serving the
same model with Engram switched off (`engram_scale: 0`), (d) = (a) with the tables on the disk tier. The model is
`bench_serve.py`'s (the `cpu-small` architecture, random weights, a BPE tokenizer trained on the prompts' text).

A pretrained base with an Engram adapter (`--base DIR`, e.g. SmolLM2-135M-Instruct from `engram base import
smollm2-135m-instruct runs/bases/smollm2`; the adapter: `engram.attach` at layer 1 with its defaults, value rows
randomized so its delta is not 0), three ways: (e) vLLM serving the base alone, (f) vLLM serving base + adapter
(the pair folder `integrations/vllm/pair.py` writes), (g) `engram serve --base --adapter`.

Per-request overlays on engram's own model (issue 58): (h) `engram serve --engine vllm` with 16 overlays of 20 facts
loaded (`--overlay oK=DIR`, `--allow-overlay-updates`; each overlay's facts are request K's prompt and 19 lines no
request reads, written by `edit_facts`, `bench_overlay_bank.make_overlays`), every request naming none; (i) the same
server, request K naming overlay K (`model: m+oK`): 16 clients, 16 overlays, one batch. Then, on (h)'s server,
overlays loaded and unloaded under load (`POST /v1/load_overlay`, `/v1/unload_overlay`, one every
`--update-every` s) while 16 streaming clients decode: each call's time, and the gaps between a request's
tokens that overlap a call against the request's median gap (the latency a call adds to running requests), beside
the same clients streaming with no call made (the noise floor).

Every request: a different prompt, `--tokens` greedy tokens (`ignore_eos` on vLLM's side, so every engine produces
the same count). The servers of a group run side by side and are measured in turn (a round: every setup once,
in rotating order), so the machine's noise falls on all of them. Needs vLLM (docs/serve.md, "The vLLM engine");
run it in that env:

    python benchmarks/bench_vllm.py [--design reference|v41] [--base DIR] [--setups abcdefghi] [--runs 3]
                                    [--tokens 64] [--record FILE]

Prints a table, the ratios the issues ask for (a/b, a/c, d/a; f/e and f/g; i/h, target >= 0.9, and h/a) with their
range over the rounds, the overlay updates' added latency (target < 100 ms), and
one JSON line; `--record FILE` appends it, with the environment, to a record (docs/results/bench-vllm.json).
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _record import append_run  # noqa: E402
from bench_overlay_bank import make_overlays  # noqa: E402
from bench_serve import build, free_port  # noqa: E402  (the same model as engram serve's benchmark)

VLLM = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]
RATIOS = {"a/b": ("a vllm+engram", "b engram serve"), "a/c": ("a vllm+engram", "c vllm engram off"),
          "d/a": ("d vllm+engram disk", "a vllm+engram"), "f/e": ("f vllm base+adapter", "e vllm base"),
          "f/g": ("f vllm base+adapter", "g engram serve base+adapter"),
          "i/h": ("i vllm+engram 16 overlays chosen", "h vllm+engram overlays, none chosen"),
          "h/a": ("h vllm+engram overlays, none chosen", "a vllm+engram")}
OVERLAYS, FACTS = 16, 20  # (h)/(i): overlays loaded, facts per overlay


class Setup(NamedTuple):
    """One measured setup: its server's command (None: it uses setup `on`'s server), whether it is vLLM, and the
    model each request names (None: "m" for all)."""
    argv: list | None
    vllm: bool
    models: list | None = None
    on: str | None = None


def start(argv, log, env=None):
    port = int(argv[argv.index("--port") + 1])
    p = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                         env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **(env or {})))
    for _ in range(300):
        if p.poll() is not None:
            raise RuntimeError(f"server exited: {Path(log).read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return p, port
        except OSError:
            time.sleep(2)
    raise RuntimeError("server did not start")


def stop(p):
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)


def one(port, prompt, tokens, vllm, model="m"):
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    if vllm:
        body.update(ignore_eos=True, return_token_ids=True)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    r = json.load(urllib.request.urlopen(req, timeout=900))
    c = r["choices"][0]
    return time.perf_counter() - t, r["usage"]["completion_tokens"], c.get("token_ids") or c["text"]


def measure(port, prompts, tokens, clients, vllm, models=None):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        res = list(ex.map(lambda a: one(port, a[0], tokens, vllm, a[1]), zip(prompts, models or ["m"] * len(prompts))))
    wall = time.perf_counter() - t0
    lat = sorted(r[0] for r in res)
    return {"tok_s": sum(r[1] for r in res) / wall, "p50_s": statistics.median(lat),
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "texts": [r[2] for r in res]}


def adapter_for(base: Path, out: Path) -> Path:
    """An Engram adapter on `base` at layer 1 with `engram.attach`'s defaults (what `engram adapt` attaches), its
    value projection and conv randomized (a fresh adapter's delta is 0), saved to `out`."""
    import engram
    from engram.adapters import save_adapter
    from engram.inference import load_base

    model, tok = load_base(base)
    engram.attach(model, [1], tokenizer=tok, verbose=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.engram_adapter.named_parameters():
            if "norm" not in name and "multi_head_embedding" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    save_adapter(model, out)
    return out


def greedy(model, tok, pad, prompts, tokens) -> dict:
    """{prompt: (ids, text)}: `tokens` greedy tokens of `model` (its in-process `generate`) after each prompt."""
    want = {}
    with torch.no_grad():
        for p in prompts:
            ids = tok.encode(p, add_special_tokens=False).ids
            out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                                 pad_token_id=pad)[0, len(ids):].tolist()
            want[p] = (out, tok.decode(out))
    return want


def overlay_fact(k: int, i: int) -> tuple[str, str]:
    """Overlay k's fact i: request k's prompt (i = 0), then lines no request reads."""
    return f"Line {k + OVERLAYS * i}: the quick brown fox", " sleeps under the king"


def engram_setups(d: Path, design: str, prompts, tokens, overlays: bool = False):
    """Setups a-d (and, with `overlays`, h-i) on engram's own model (built in `d`) and its greedy ids / text per
    setup and prompt, in process (for (i): with the request's overlay applied)."""
    from engram.cli.options import with_overlays
    from engram.model import load_model

    model, tok, pad = build(d, design)
    plain = greedy(model, tok, pad, prompts, tokens)
    del model
    run, api = str(d / "run"), [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    setups = {
        "a vllm+engram": Setup([*api, "--model", run + "/final", "--served-model-name", "m", *VLLM], True),
        "b engram serve": Setup([sys.executable, "-m", "engram.cli", "serve", "--checkpoint", run,
                                 "--served-model-name", "m"], False),
        "c vllm engram off": Setup([*api, "--model", run + "/final", "--served-model-name", "m", *VLLM,
                                    "--hf-overrides", json.dumps({"engram_scale": 0})], True),
        "d vllm+engram disk": Setup([*api, "--model", run + "/final", "--served-model-name", "m", *VLLM,
                                     "--hf-overrides", json.dumps({"engram_table_tier": "disk",
                                                                   "engram_table_dir": str(d / "t")})], True),
    }
    want = {k: plain for k in setups}
    if overlays:
        dirs = make_overlays(d / "run", d / "ov", OVERLAYS, FACTS, steps=5, fact=overlay_fact)
        chosen = {}
        for k, folder in enumerate(dirs):  # (i)'s reference: each prompt with its own request's overlay alone
            mine = prompts[k::OVERLAYS]
            m, _ = load_model(run)
            chosen.update(greedy(with_overlays(m, [str(folder)]), tok, pad, mine, tokens))
        h = "h vllm+engram overlays, none chosen"
        setups[h] = Setup([sys.executable, "-m", "engram.cli", "serve", "--checkpoint", run, "--engine", "vllm",
                           "--served-model-name", "m", "--allow-overlay-updates",
                           *[f"--overlay=o{k}={p}" for k, p in enumerate(dirs)], "--vllm-args", " ".join(VLLM)],
                          True)
        setups["i vllm+engram 16 overlays chosen"] = Setup(
            None, True, [f"m+o{j % OVERLAYS}" for j in range(len(prompts))], on=h)
        want.update({h: plain, "i vllm+engram 16 overlays chosen": chosen})
    return setups, want, (d / "ov" if overlays else None)


def adapter_setups(d: Path, base: Path, prompts, tokens):
    """Setups e-g on `base` + an adapter, and the pair's greedy ids / text per prompt (`load_with_adapter`)."""
    from engram.inference import load_with_adapter
    from engram.integrations.vllm.pair import write_pair

    adapter = adapter_for(base, d / "adapter")
    pair = write_pair(base, adapter, d / "pair")
    model, tok = load_with_adapter(base, adapter)
    # as vLLM's ignore_eos: an EOS that wins is emitted and decoding goes on (min_new_tokens would forbid it instead)
    pad = model.generation_config.pad_token_id
    model.generation_config.eos_token_id = None
    want = greedy(model, tok, pad, prompts, tokens)
    del model
    api = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--served-model-name", "m", *VLLM]
    setups = {
        "e vllm base": Setup([*api, "--model", str(base)], True),
        "f vllm base+adapter": Setup([*api, "--model", str(pair)], True),
        "g engram serve base+adapter": Setup([sys.executable, "-m", "engram.cli", "serve", "--base", str(base),
                                              "--adapter", str(adapter), "--name", "m"], False),
    }
    return setups, {k: want for k in setups}, None


def stream(port, prompt, tokens, model, first: threading.Event | None = None) -> list[float]:
    """One streamed greedy completion: the arrival time of each chunk that carries tokens (`first` set at the
    first)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            if line.startswith(b"data: {") and any(c.get("token_ids") for c in json.loads(line[6:])["choices"]):
                times.append(time.perf_counter())
                if first is not None:
                    first.set()
    return times


def post(port, path, body) -> float:
    """Seconds one JSON POST took (an error status raises)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    urllib.request.urlopen(req, timeout=300).read()
    return time.perf_counter() - t


def updates_under_load(port, prompts, tokens, models, folder: Path, every: float, calls: bool) -> dict:
    """Streaming clients decode while, from their first token on, every `every` s an overlay is loaded then unloaded
    (`calls`; without, the same schedule with no call: the noise floor). Each call's seconds; the excess of every
    inter-token gap that overlaps a call window (or, without calls, the same windows) over its request's median
    gap."""
    windows, spent, done, first = [], {"load": [], "unload": []}, threading.Event(), threading.Event()

    def updater():
        j = 0
        first.wait(600)
        done.wait(0.2)  # every request is decoding by now
        while not done.is_set():
            t0 = time.perf_counter()
            if calls:
                spent["load"].append(post(port, "/v1/load_overlay", {"overlay_name": f"x{j}",
                                                                     "overlay_path": str(folder / f"o{j % OVERLAYS}")}))
                spent["unload"].append(post(port, "/v1/unload_overlay", {"overlay_name": f"x{j}"}))
            else:
                time.sleep(0.05)
            windows.append((t0, time.perf_counter()))
            j += 1
            done.wait(every)

    th = threading.Thread(target=updater)
    th.start()
    try:
        with ThreadPoolExecutor(len(prompts)) as ex:
            arrivals = list(ex.map(lambda a: stream(port, a[0], tokens, a[1], first), zip(prompts, models)))
    finally:
        done.set()
        th.join()
    per_window = [[] for _ in windows]  # each window: the excess of every gap overlapping it, every request
    for ts in arrivals:
        gaps = list(zip(ts, ts[1:]))
        med = statistics.median(b - a for a, b in gaps)
        for k, (w0, w1) in enumerate(windows):
            per_window[k] += [(b - a) - med for a, b in gaps if a < w1 and b > w0]
    excess = sorted(x for w in per_window for x in w) or [float("nan")]
    return {"windows": len(windows), "load_ms": [round(1000 * x, 1) for x in spent["load"]],
            "unload_ms": [round(1000 * x, 1) for x in spent["unload"]], "overlapping_gaps": len(excess),
            "added_ms_median": round(1000 * statistics.median(excess), 1), "added_ms_max": round(1000 * excess[-1], 1),
            # per window (a load + unload, or the same span without), the most it delayed any running request
            "window_added_ms": [round(1000 * max(w), 1) if w else None for w in per_window]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--design", choices=("reference", "v41"), default="reference",
                    help="engram's model: the reference's Engram design (short conv) or DeepSeek-V4.1's (no conv)")
    ap.add_argument("--base", type=Path, help="a pretrained base folder: run setups e-g (its adapter) too")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--setups", default="abcdefghi", help="which setups to run, by letter (default all: abcdefghi; "
                    "(i) runs on (h)'s server, and the overlay updates under load run whenever (h) does)")
    ap.add_argument("--update-every", type=float, default=1.0, metavar="S",
                    help="(h): seconds between overlay load+unload calls under load")
    ap.add_argument("--update-tokens", type=int, default=256,
                    help="(h): greedy tokens per streaming request while overlays are loaded and unloaded")
    ap.add_argument("--record", metavar="FILE", help="append the JSON line, with the environment, to this record "
                                                     "(docs/results/bench-vllm.json)")
    args = ap.parse_args()
    if args.base is not None and not (args.base / "config.json").is_file():
        sys.exit(f"bench_vllm: --base {args.base} is not a model folder (make one: engram base import "
                 f"smollm2-135m-instruct {args.base})")
    prompts = [f"Line {i}: the quick brown fox" for i in range(args.requests)]
    rows, texts, want, startup = [], {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        groups = []
        if set(args.setups) & set("abcdhi"):
            groups.append(engram_setups(Path(tmp) / "engram", args.design, prompts, args.tokens,
                                        overlays=bool(set(args.setups) & set("hi"))))
        if args.base is not None and set(args.setups) & set("efg"):
            groups.append(adapter_setups(Path(tmp) / "adapter", args.base, prompts, args.tokens))
        updates = []
        for setups, w, ov in groups:
            chosen = {k: v for k, v in setups.items() if k[0] in args.setups}
            if not chosen:
                continue
            want.update({k: w[k] for k in chosen})
            servers = {}
            try:
                for name in dict.fromkeys(v.on or k for k, v in chosen.items()):  # side by side: measured in turn
                    t0 = time.perf_counter()
                    servers[name] = start(setups[name].argv + ["--port", str(free_port())],
                                          Path(tmp) / f"{name[0]}.log")  # (process, port)
                    startup[name] = time.perf_counter() - t0
                    measure(servers[name][1], prompts[:2], 4, 2, setups[name].vllm)  # warm-up
                names = list(chosen)
                for n in args.clients:
                    for r in range(args.runs):
                        for name in names[r % len(names):] + names[: r % len(names)]:  # rotating order
                            st = chosen[name]
                            m = measure(servers[st.on or name][1], prompts, args.tokens, n, st.vllm, st.models)
                            texts.setdefault(name, m.pop("texts"))
                            rows.append({"setup": name, "clients": n, "run": r,
                                         "startup_s": startup[st.on or name], **m})
                h = "h vllm+engram overlays, none chosen"
                if h in servers:  # overlays loaded and dropped while 16 clients stream, and the same without
                    models = [f"m+o{j % OVERLAYS}" for j in range(len(prompts))]
                    for r in range(args.runs):
                        for calls in (True, False):
                            updates.append({"run": r, "calls": calls, **updates_under_load(
                                servers[h][1], prompts, args.update_tokens, models, ov, args.update_every, calls)})
                            print(f"updates under load, round {r}, {'with' if calls else 'without'} calls: "
                                  f"{updates[-1]}", file=sys.stderr)
            finally:
                for p, _ in servers.values():
                    stop(p)
    # vLLM: token ids (its detokenizer holds back a trailing partial UTF-8 character, so texts may differ there);
    # engram serve: text. (c runs without Engram and e without the adapter: they are expected to differ.) A real
    # base's greedy tokens may part at a near tie of its logits (GEMMs round differently in vLLM), so each setup
    # reports how many prompts agree to the end and, per prompt, how many leading tokens (or characters) agree.
    def prefix(a, b):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    agree = {}
    for k, v in texts.items():
        ref = [want[k][p][0 if isinstance(v[0], list) else 1] for p in prompts]
        agree[k] = {"equal": sum(a == b for a, b in zip(v, ref)), "of": len(prompts),
                    "prefix": [prefix(a, b) for a, b in zip(v, ref)]}

    def med(setup, n, key="tok_s"):
        got = [r[key] for r in rows if r["setup"] == setup and r["clients"] == n]
        return statistics.median(got) if got else float("nan")

    names = list(texts)
    print(f"{'setup':<28} {'clients':>7} {'tokens/s (runs)':>26} {'p50 s':>7} {'p99 s':>7}")
    for s in names:
        for n in args.clients:
            runs = ", ".join(f"{r['tok_s']:.0f}" for r in rows if r["setup"] == s and r["clients"] == n)
            print(f"{s:<28} {n:>7} {runs:>26} {med(s, n, 'p50_s'):>7.2f} {med(s, n, 'p99_s'):>7.2f}")
    ratios = {f"{k} at {n}": med(x, n) / med(y, n) for k, (x, y) in RATIOS.items() for n in args.clients
              if x in names and y in names}
    # the same ratio run by run (a round measures every setup once, back to back): its range over the rounds
    spread = {}
    for k, (x, y) in RATIOS.items():
        for n in args.clients:
            rs = [a["tok_s"] / b["tok_s"] for a in rows for b in rows if a["setup"] == x and b["setup"] == y
                  and a["clients"] == b["clients"] == n and a["run"] == b["run"]]
            if rs:
                spread[f"{k} at {n}"] = (min(rs), max(rs))
    print("ratios (medians; per-round range):",
          ", ".join(f"{k} {v:.2f} ({spread[k][0]:.2f}-{spread[k][1]:.2f})" for k, v in ratios.items()))
    print("prompts whose greedy output equals engram's in-process generate():",
          {k: f"{v['equal']}/{v['of']}" for k, v in agree.items()})
    update_summary = {}
    for calls in (True, False):  # the latency an overlay update adds to running requests, and the floor without
        u = [x for x in updates if x["calls"] == calls and x["overlapping_gaps"]]
        w = sorted(v for x in u for v in x["window_added_ms"] if v is not None)
        if not w:
            continue
        key = "calls" if calls else "no_calls"
        update_summary[key] = {"rounds": len(u), "windows": len(w), "median_ms": statistics.median(w),
                               "under_100ms": sum(v < 100 for v in w), "max_ms": w[-1]}
        if calls:
            update_summary[key].update(load_ms_median=statistics.median(t for x in u for t in x["load_ms"]),
                                       unload_ms_median=statistics.median(t for x in u for t in x["unload_ms"]))
        print(f"overlay updates under load ({'load+unload calls' if calls else 'no calls, same windows'}): "
              f"{update_summary[key]}")
    if updates and not update_summary:
        print("overlay updates under load: no window overlapped a running request (raise --update-tokens)")
    from engram.integrations.vllm.state import vllm_version

    out = {"bench": "vllm", "design": args.design, "base": args.base.name if args.base else None,
           "tokens": args.tokens, "requests": args.requests, "vllm": vllm_version(),
           "update_tokens": args.update_tokens, "update_every_s": args.update_every,
           "server_threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")},
           "ratios": {k: round(v, 3) for k, v in ratios.items()},
           "ratio_ranges": {k: [round(a, 3), round(b, 3)] for k, (a, b) in spread.items()},
           "startup_s": {k: round(v, 1) for k, v in startup.items()}, "agree": agree, "updates": updates,
           "update_summary": update_summary,
           "table": {s: {str(n): [round(r["tok_s"], 1) for r in rows if r["setup"] == s and r["clients"] == n]
                         for n in args.clients} for s in names},  # tokens/s per setup, clients and round
           "rows": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "startup_s"}
                    for r in rows]}
    print(json.dumps(out))
    if args.record:
        append_run(args.record, "python benchmarks/bench_vllm.py", out)


if __name__ == "__main__":
    main()
