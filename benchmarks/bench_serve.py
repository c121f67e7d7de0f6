"""`engram serve` under load: N concurrent clients on loopback vs the same prompts through `generate()` in one
process, with a fact overlay chosen per request and without.

The model is the `cpu-small` architecture (hidden 256, 4 layers, 16.8M table parameters; random weights:
decoding cost does not depend on training) saved as a model folder, with an overlay written by
`engram.edit_facts`. In-process: the prompts one after another through `model.generate` (greedy,
`--tokens` new tokens each), as `engram sample` runs them. Served: `engram serve` in a child process,
`--requests` requests from N = 1, 4, 16 client threads (openai client), once for the model and once for
`MODEL+fact`. Prints completion tokens/s, the ratio to in-process, and p50/p99 request latency; then one
JSON line. Greedy answers are checked against the in-process ones.

    python benchmarks/bench_serve.py [--requests 16] [--tokens 32]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch


def build(d: Path, design: str = "reference"):
    """The benchmark model in `d`: `cpu_small` (the reference's Engram design) or, with design="v41", DeepSeek-V4.1's
    (`cpu_small_v41`, no short conv), random weights, its BPE tokenizer and one fact overlay (`d/fact`)."""
    from engram.adapters import generation_pad_id
    from engram.editing import Fact, edit_facts
    from engram.model import EngramForCausalLM, load_model
    from engram.tokenizer import train_bpe
    from engram.training.presets import cpu_small, cpu_small_v41
    from engram.training.train import save_final

    text = [f"Line {i}: the quick brown fox jumps over the lazy dog, said the king to the queen of the tale."
            for i in range(2000)]
    tok_file = train_bpe(text, 2048, d / "tok" / "tokenizer.json", progress=False)
    from engram.tokenizer import load_tokenizer

    torch.manual_seed(0)
    preset = cpu_small_v41 if design == "v41" else cpu_small
    cfg = preset(vocab_size=load_tokenizer(tok_file).get_vocab_size(with_added_tokens=True))
    cfg.engram = {**cfg.engram, "tokenizer_name_or_path": str(tok_file)}
    save_final(EngramForCausalLM(cfg).eval(), d / "run", {"tokenizer_file": str(tok_file)})
    model, tok = load_model(d / "run")
    edit_facts(model, tok, [Fact("the quick brown fox", " sleeps")], steps=20, progress=False).save(d / "fact")
    return model, tok, generation_pad_id(model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    import openai

    prompts = [f"Line {i}: the quick brown fox" for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model, tok, pad = build(d)
        want = {}
        with torch.no_grad():
            model.generate(torch.tensor([tok.encode("warm up", add_special_tokens=False).ids]), max_new_tokens=4,
                           do_sample=False, pad_token_id=pad)  # compiles the kernels, as the server's warm-up does
            t0 = time.perf_counter()
            for p in prompts:
                ids = tok.encode(p, add_special_tokens=False).ids
                out = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False, pad_token_id=pad)
                want[p] = tok.decode(out[0, len(ids):].tolist())
        inproc = len(prompts) * args.tokens / (time.perf_counter() - t0)
        del model
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "engram.cli", "serve", "--checkpoint", str(d / "run"),
                                   "--served-model-name", "m",
                                   "--overlay", f"fact={d / 'fact'}", "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.2)
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
            c.completions.create(model="m", prompt="warm up", max_tokens=4, temperature=0)
            rows = []
            for model_id in ("m", "m+fact"):
                for n in (1, 4, 16):
                    lat, toks, wrong = [], [], []
                    queue = list(prompts)
                    lock = threading.Lock()

                    def worker():
                        while True:
                            with lock:
                                if not queue:
                                    return
                                p = queue.pop()
                            t = time.perf_counter()
                            r = c.completions.create(model=model_id, prompt=p, max_tokens=args.tokens, temperature=0)
                            lat.append(time.perf_counter() - t)
                            toks.append(r.usage.completion_tokens)
                            if model_id == "m" and r.choices[0].text != want[p]:
                                wrong.append(p)

                    t0 = time.perf_counter()
                    threads = [threading.Thread(target=worker) for _ in range(n)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    wall = time.perf_counter() - t0
                    lat.sort()
                    rows.append({"model": model_id, "clients": n, "tok_s": sum(toks) / wall,
                                 "vs_inprocess": sum(toks) / wall / inproc, "p50_s": statistics.median(lat),
                                 "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "greedy_equal": not wrong})
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"in-process generate(): {inproc:,.0f} tokens/s ({len(prompts)} prompts x {args.tokens} tokens)")
    print(f"{'model':<8} {'clients':>7} {'tokens/s':>9} {'vs in-proc':>10} {'p50 s':>7} {'p99 s':>7} {'greedy ==':>9}")
    for r in rows:
        print(f"{r['model']:<8} {r['clients']:>7} {r['tok_s']:>9,.0f} {r['vs_inprocess']:>10.2f} {r['p50_s']:>7.2f} "
              f"{r['p99_s']:>7.2f} {str(r['greedy_equal']) if r['model'] == 'm' else '-':>9}")
    print(json.dumps({"bench": "serve", "inprocess_tok_s": round(inproc), "rows": [
        {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]}))


if __name__ == "__main__":
    main()
