"""bfloat16 (or float16) against float32 for inference on the CPU: speed, memory, greedy agreement, one process.

The model: `--checkpoint DIR` (an engram model), `--base DIR [--adapter DIR]` (a transformers base and its adapter),
or by default the tiny test model, trained here by `engram train`'s `tiny` preset (`--train-steps`, default 20) on
the docstrings of 40 standard-library modules (local text, nothing downloaded) into a temp dir. Each round loads
the model in float32 and in `--dtype` (the order alternating round by round, so machine noise hits both) through
`load_inference_model(..., dtype=)`, the path of every command's `--dtype`, and measures:

  * forward tokens/s: a (`--batch` x `--seq-len`) forward, median of `--repeats` after one warm-up;
  * decode tokens/s: greedy `generate` of `--new-tokens` tokens for each of `--prompts` prompts;
  * memory: the process's resident memory after the load and the runs minus before the load (`rss_mib`: every
    page of the weights touched by then, a checkpoint's memory-mapped ones included) and its peak during load and
    runs (`peak_mib`: Linux's VmHWM, reset before each load through /proc/self/clear_refs), and the bytes of the dense
    weights (`dense_mib`, exact) and of the Engram tables (`table_mib`: they keep their float32 rows under --dtype;
    `--table-format bfloat16` is what halves them);
  * greedy agreement with float32: the share of the `--new-tokens` greedy tokens equal position by position, over
    the prompts (`agree`), and the mean length of the common prefix (`prefix`: after the first difference the two
    texts go on from different contexts, so the later positions say little).

Prints one line per round and dtype, the medians with the ratio (half / float32), then one JSON line; `--record FILE`
appends that line, with the environment, to a JSON record (docs/results/bench-dtype.json).

    python benchmarks/bench_dtype.py [--rounds 3] [--dtype bfloat16] [--checkpoint DIR | --base DIR [--adapter DIR]]
"""

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _record import append_run
from _timing import timeit

from engram.inference import load_inference_model
from engram.memory import is_table_key
from engram.utils import reset_peak_rss

PROMPTS = ["The function returns", "This module provides", "If the argument is", "A list of the", "Return a new",
           "The default value of", "Raise an error when", "For example, the"]
CORPUS_MODULES = ["argparse", "json", "os", "pathlib", "re", "string", "textwrap", "csv", "heapq", "bisect",
                  "collections", "functools", "itertools", "operator", "random", "statistics", "fractions", "decimal",
                  "datetime", "calendar", "shutil", "glob", "fnmatch", "tempfile", "pickle", "copy", "pprint",
                  "difflib", "enum", "numbers", "math", "cmath", "inspect", "dataclasses", "contextlib", "abc",
                  "typing", "logging", "threading", "queue"]


def status_kib(field: str) -> int | None:
    try:
        for line in open("/proc/self/status", encoding="ascii"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def corpus_docstrings(path: Path) -> Path:
    import importlib
    import warnings

    docs = []
    with warnings.catch_warnings():  # (a deprecated attribute warns when read: typing.re)
        warnings.simplefilter("ignore")
        for name in CORPUS_MODULES:
            mod = importlib.import_module(name)
            docs += [mod.__doc__] + [getattr(mod, a).__doc__ for a in sorted(dir(mod))
                                     if not a.startswith("_") and callable(getattr(mod, a, None))]
    path.write_text("\n\n".join(d.strip() for d in docs if isinstance(d, str) and len(d) > 40), encoding="utf-8")
    return path


def tiny_model(root: Path, steps: int) -> Path:
    from engram.training.train import train

    data = corpus_docstrings(root / "docstrings.txt")
    t = time.perf_counter()
    train("tiny", data=[str(data)], out=root / "run", max_steps=steps, progress=False)
    print(f"trained the tiny preset for {steps} steps on {data.stat().st_size / 1e3:.0f} kB of docstrings in "
          f"{time.perf_counter() - t:.1f}s", file=sys.stderr)
    return root / "run"


def weight_bytes(model) -> tuple[int, int]:
    """(dense weights' bytes, Engram tables' bytes held as parameters) of `model`."""
    dense = tables = 0
    for n, p in model.named_parameters():
        if p.is_floating_point():
            if is_table_key(n):
                tables += p.numel() * p.element_size()
            else:
                dense += p.numel() * p.element_size()
    return dense, tables


def greedy(model, tok, prompts, n: int) -> tuple[list[list[int]], float]:
    """(the `n` greedy tokens after each prompt, decode tokens/s)."""
    from engram.adapters import generation_pad_id

    outs, t = [], time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            ids = tok.encode(p, add_special_tokens=False).ids
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=generation_pad_id(model))
            outs.append(out[0, len(ids):].tolist())
    return outs, len(prompts) * n / (time.perf_counter() - t)


def measure(load, dtype: str, args, prompts, reference=None) -> tuple[dict, list]:
    gc.collect()
    peak_ok = reset_peak_rss()
    rss0 = status_kib("VmRSS")
    t = time.perf_counter()
    model, tok = load(dtype)
    load_s = time.perf_counter() - t
    vocab = model.get_input_embeddings().weight.shape[0]
    x = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fwd = timeit(lambda m=model: m(input_ids=x), repeats=args.repeats)
    tokens, decode = greedy(model, tok, prompts, args.new_tokens)
    rss_used = status_kib("VmRSS")  # (after the runs: every page of the weights touched, mapped ones included)
    dense, tables = weight_bytes(model)
    row = {"dtype": dtype, "load_s": round(load_s, 3), "forward_tok_s": round(args.batch * args.seq_len / fwd, 1),
           "decode_tok_s": round(decode, 2), "dense_mib": round(dense / 2**20, 3),
           "table_mib": round(tables / 2**20, 3),
           "rss_mib": round((rss_used - rss0) / 1024, 1) if rss0 is not None else None,
           "peak_mib": round((status_kib("VmHWM") - rss0) / 1024, 1) if rss0 is not None and peak_ok else None}
    if reference is not None:
        same = [sum(a == b for a, b in zip(r, o)) for r, o in zip(reference, tokens)]
        prefix = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(reference, tokens)]
        row.update(agree=round(sum(same) / sum(len(r) for r in reference), 4),
                   prefix=round(statistics.mean(prefix), 2))
    del model, tok
    gc.collect()
    return row, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="an engram model (run dir or save_pretrained folder)")
    ap.add_argument("--base", help="a transformers base folder (with --adapter: and its adapter)")
    ap.add_argument("--adapter")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="measured against float32")
    ap.add_argument("--train-steps", type=int, default=20, help="steps of the default tiny model's training")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help=f"greedy prompts (at most {len(PROMPTS)})")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--record", metavar="FILE", help="append the JSON line, with the environment, to this record")
    args = ap.parse_args()
    prompts = PROMPTS[:args.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        if args.base:
            where = {"base": args.base, "adapter": args.adapter}
            model_name = f"{args.base} + {args.adapter}" if args.adapter else args.base
        else:
            where = {"path": args.checkpoint or tiny_model(Path(tmp), args.train_steps)}
            model_name = args.checkpoint or f"the tiny preset, {args.train_steps} steps"

        def load(dtype):
            return load_inference_model(**where, dtype=dtype)

        # the float32 reference tokens first (and everything imported and compiled once, outside the rounds)
        _, ref = measure(load, "float32", args, prompts)
        rows = {"float32": [], args.dtype: []}
        for r in range(args.rounds):
            for dtype in (("float32", args.dtype) if r % 2 == 0 else (args.dtype, "float32")):
                row, _ = measure(load, dtype, args, prompts, ref)
                rows[dtype].append(row)
                print(f"round {r}  {dtype:<9} forward {row['forward_tok_s']:>10,.0f} tok/s  decode "
                      f"{row['decode_tok_s']:>8,.1f} tok/s  dense {row['dense_mib']:>8.2f} MiB  rss +{row['rss_mib']} "
                      f"MiB  peak +{row['peak_mib']} MiB  agree {row['agree']:.3f}  prefix {row['prefix']:.1f}")

    def med(dtype, key):
        vals = [x[key] for x in rows[dtype] if x.get(key) is not None]
        return statistics.median(vals) if vals else None

    keys = ("forward_tok_s", "decode_tok_s", "dense_mib", "table_mib", "rss_mib", "peak_mib", "load_s", "agree",
            "prefix")
    summary = {d: {k: med(d, k) for k in keys} for d in rows}
    ratio = {k: round(summary[args.dtype][k] / summary["float32"][k], 3)
             for k in keys[:7] if summary["float32"][k] and summary[args.dtype][k] is not None}
    print(f"\nmedians of {args.rounds} rounds, {args.dtype} / float32: " +
          ", ".join(f"{k} {v}x" for k, v in ratio.items()) +
          f"; greedy agreement {summary[args.dtype]['agree']:.3f} (prefix {summary[args.dtype]['prefix']:.1f} of "
          f"{args.new_tokens} tokens over {len(prompts)} prompts)")
    out = {"model": str(model_name), "dtype": args.dtype, "rounds": args.rounds, "batch": args.batch,
           "seq_len": args.seq_len, "new_tokens": args.new_tokens, "prompts": len(prompts), "median": summary,
           "ratio": ratio, "runs": rows, "threads": torch.get_num_threads(),
           "cpu_native_half": _cpu_native(args.dtype)}
    print(json.dumps(out))
    if args.record:
        append_run(args.record, "python benchmarks/bench_dtype.py [--rounds 3] [--dtype bfloat16] "
                   "[--checkpoint DIR | --base DIR [--adapter DIR]]", out)


def _cpu_native(dtype: str) -> bool | None:
    """Whether oneDNN has native kernels for `dtype` on this CPU (AVX512-BF16 / AMX): what decides the speed."""
    try:
        return bool({"bfloat16": torch.ops.mkldnn._is_mkldnn_bf16_supported,
                     "float16": torch.ops.mkldnn._is_mkldnn_fp16_supported}[dtype]())
    except Exception:
        return None


if __name__ == "__main__":
    main()
