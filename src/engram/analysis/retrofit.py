"""`engram experiment retrofit`: teach a pretrained model a new domain: Engram adapter vs LoRA vs both vs full FT.

1. The base: a small Llama (`transformers.LlamaForCausalLM`, `BASE`) pretrained from scratch on the
   Shakespeare train split with its own byte-level BPE tokenizer (`engram adapt --method full` on a
   random initialization). Cached in OUT/retrofit/base: reruns skip it.
2. The new domain: Python source code, the `.py` files of the pinned wheel `networkx==3.4.2`
   (`--data pypi:networkx==3.4.2`, fetched from PyPI into the cache, never committed; split by file).
   Why: a corpus of another kind than verse (identifiers, indentation, API n-grams that repeat
   across files), permissively licensed (BSD-3), pure Python, ~5 MB of train text, available
   offline through the package registry.
3. Each method trains for the same steps on the same batches (same tokens, same seed):
   `full` (every weight), `lora` (rank matched to the Engram adapter's dense trainable parameters:
   the adapter's table rows are its memory, the dense part what it adds to every token's compute),
   `engram` (adapter at layer 1, base frozen), `lora+engram`. 2 seeds.
4. Reported per method: the domain's validation loss, forgetting (Shakespeare validation loss after
   minus before), trainable parameters, median step time, peak RSS (each run in its own process).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from ..training.checkpoint import checkpoints
from ..utils import atomic_write_bytes
from .runs import seed_stats

DOMAIN = "pypi:networkx==3.4.2"
BASE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=512, tie_word_embeddings=False)
TOKENIZER = "bpe:4096"
SETTINGS = {"seq_len": 128, "batch_size": 16, "eval_max_windows": 64}
PRETRAIN = dict(max_steps=1500, overrides={**SETTINGS, "lr": 3e-3, "warmup_steps": 60, "weight_decay": 0.1,
                                           "ckpt_every": 500})
ADAPT = dict(max_steps=400, overrides={**SETTINGS, "lr": 1e-3, "warmup_steps": 20, "weight_decay": 0.0,
                                       "ckpt_every": 200})
LAYERS = [1]
ENGRAM = dict(engram_vocab_size=[20011, 20011], n_embed_per_ngram=64, n_head_per_ngram=4)
METHODS = ("full", "lora", "engram", "lora+engram")


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, flush=True)


def pretrained_base(root: Path, max_steps: int | None = None, progress: bool = True) -> Path:
    """The base model folder (config, weights, tokenizer.json): a random Llama pretrained on Shakespeare."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..tokenizer import load_tokenizer
    from ..training.adapt import adapt
    from ..training.data import load_manifest, prepare

    run = root / "base"
    final = run / "final"
    if (final / "config.json").is_file():
        return final
    tok = Path(load_manifest(prepare(None, TOKENIZER, progress=progress))["tokenizer_file"])
    init = root / "base-init"
    if not (init / "config.json").is_file():
        torch.manual_seed(0)
        n = load_tokenizer(tok).get_vocab_size(with_added_tokens=True)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=n, bos_token_id=0, eos_token_id=0, pad_token_id=1, **BASE))
        model.save_pretrained(init)
        (init / "tokenizer.json").write_bytes(tok.read_bytes())
    _say(progress, f"[retrofit] pretraining the base ({BASE['num_hidden_layers']} layers, hidden {BASE['hidden_size']}) "
                   f"on Shakespeare -> {run}")
    adapt(init, data=None, out=run, method="full", max_steps=max_steps or PRETRAIN["max_steps"],
          overrides=PRETRAIN["overrides"], resume=bool(checkpoints(run)), progress=progress)
    return final


def lora_rank_matching_engram(base: Path) -> tuple[int, int, int]:
    """(rank, LoRA params per rank, Engram adapter dense params): the LoRA rank whose trainable parameters
    come closest to the Engram adapter's dense (non-table) ones."""
    from .. import adapters as ad
    from ..training.adapt import load_base

    model, tok = load_base(base)
    ad.attach(model, LAYERS, tokenizer=tok, **ENGRAM)
    dense = ad.trainable_summary(model)["engram_dense"]
    ad.detach(model)
    ad.freeze_base(model)
    per_rank = ad.trainable_summary(ad.add_lora(model, rank=1))["base_trainable"]
    return max(1, round(dense / per_rank)), per_rank, dense


def _adapt_in_subprocess(kwargs: dict, log: Path) -> None:
    """One run in its own process, so its peak RSS is its own (`summary.json` records it)."""
    cmd = [sys.executable, "-m", "engram.analysis.retrofit", json.dumps(kwargs)]
    with open(log, "a") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise RuntimeError(f"retrofit run {kwargs['out']} failed (exit {r.returncode}); see {log}")


def _step_ms(run_dir: Path, batch_tokens: int) -> float:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    times = [batch_tokens / r["tok_s"] * 1e3 for r in rows if r.get("tok_s") and r["step"] > 5]
    return statistics.median(times)


def run(out: str | Path = "runs/experiments", seeds: int = 2, max_steps: int | None = None,
        pretrain_steps: int | None = None, progress: bool = True) -> dict:
    from ..config import TrainConfig
    from ..training.adapt import evaluate_on, load_base

    root = Path(out) / "retrofit"
    root.mkdir(parents=True, exist_ok=True)
    base = pretrained_base(root, pretrain_steps, progress)
    rank, per_rank, dense = lora_rank_matching_engram(base)
    _say(progress, f"[retrofit] LoRA rank {rank} ({rank * per_rank:,} params) matches the Engram adapter's {dense:,} "
                   "dense params")
    tcfg = TrainConfig(**{**TrainConfig().to_dict(), **ADAPT["overrides"], "tokenizer": str((base / "tokenizer.json").resolve())})
    before_file = root / "base_eval.json"
    if not before_file.is_file():
        model, _ = load_base(base)
        before = {"domain": evaluate_on(model, [DOMAIN], tcfg), "shakespeare": evaluate_on(model, None, tcfg)}
        atomic_write_bytes(before_file, json.dumps(before).encode())
    before = json.loads(before_file.read_text())
    steps = max_steps or ADAPT["max_steps"]
    results: dict[str, list[dict]] = {}
    for seed in range(seeds):
        for method in METHODS:
            run_dir = root / f"{method}-seed{seed}"
            if not (run_dir / "summary.json").is_file():
                _say(progress, f"[retrofit] {method} seed {seed} -> {run_dir}")
                kw = dict(base=str(base), data=[DOMAIN], out=str(run_dir), method=method, max_steps=steps,
                          overrides={**ADAPT["overrides"], "seed": seed}, resume=bool(checkpoints(run_dir)),
                          progress=False, extra_eval={"shakespeare": None})
                if "engram" in method:
                    kw.update(layers=LAYERS, engram_options=ENGRAM)
                if "lora" in method:
                    kw["lora_rank"] = rank
                _adapt_in_subprocess(kw, root / "runs.log")
            s = json.loads((run_dir / "summary.json").read_text())
            results.setdefault(method, []).append({
                "seed": seed, "domain_val": s["val_loss"], "shakespeare_val": s["extra_eval"]["shakespeare"],
                "step_ms": _step_ms(run_dir, tcfg.seq_len * tcfg.batch_size), "peak_rss_mib": s["peak_rss_mib"],
                "trainable": s["trainable"]})
    table = {m: {"domain_val": seed_stats([r["domain_val"] for r in rs]),
                 "forgetting": seed_stats([r["shakespeare_val"] - before["shakespeare"] for r in rs]),
                 "step_ms": seed_stats([r["step_ms"] for r in rs]), "peak_rss_mib": seed_stats([r["peak_rss_mib"] for r in rs]),
                 "trainable": rs[0]["trainable"]} for m, rs in results.items()}
    summary = {"experiment": "retrofit", "domain": DOMAIN, "base": BASE, "tokenizer": TOKENIZER,
               "pretrain_steps": pretrain_steps or PRETRAIN["max_steps"], "adapt_steps": steps,
               "tokens_per_step": tcfg.seq_len * tcfg.batch_size, "seeds": seeds, "lora_rank": rank,
               "engram": {"layers": LAYERS, **ENGRAM}, "before": before, "methods": table, "runs": results}
    atomic_write_bytes(root / "summary.json", json.dumps(summary, indent=1).encode())
    md = markdown(summary)
    atomic_write_bytes(root / "summary.md", md.encode())
    _plot(summary, root / "plot.png")
    print(md)
    return summary


def markdown(s: dict) -> str:
    b = s["before"]
    lines = [f"Base before adaptation: {s['domain'][5:]} val loss {b['domain']:.4f}, Shakespeare val loss "
             f"{b['shakespeare']:.4f}. {s['adapt_steps']} steps x {s['tokens_per_step']:,} tokens, {s['seeds']} seeds "
             "(mean ± half-range).", "",
             "| method | domain val loss | forgetting (Shakespeare Δ) | trainable dense | trainable table params | "
             "step time (ms) | peak RSS (MiB) |", "|---|---|---|---|---|---|---|"]
    for m, r in s["methods"].items():
        t = r["trainable"]
        name = f"{m} (r={s['lora_rank']})" if "lora" in m else m
        lines.append(f"| {name} | {r['domain_val']['mean']:.4f} ± {r['domain_val']['spread']:.4f} | "
                     f"{r['forgetting']['mean']:+.4f} ± {r['forgetting']['spread']:.4f} | "
                     f"{t['engram_dense'] + t['base_trainable']:,} | {t['engram_table']:,} | "
                     f"{r['step_ms']['mean']:.0f} | {r['peak_rss_mib']['mean']:.0f} |")
    return "\n".join(lines) + "\n"


def _plot(s: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ms = list(s["methods"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.bar(ms, [s["methods"][m]["domain_val"]["mean"] for m in ms],
          yerr=[s["methods"][m]["domain_val"]["spread"] for m in ms])
    a.axhline(s["before"]["domain"], color="gray", ls="--", label="base (before)")
    lo = min(s["methods"][m]["domain_val"]["mean"] for m in ms)
    a.set_ylim(lo - 0.3, s["before"]["domain"] + 0.1)
    a.set_ylabel(f"{s['domain'][5:]} val loss")
    a.legend()
    b.bar(ms, [s["methods"][m]["forgetting"]["mean"] for m in ms],
          yerr=[s["methods"][m]["forgetting"]["spread"] for m in ms])
    b.set_ylabel("Shakespeare val loss change")
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("engram experiment retrofit")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":  # one run: engram.training.adapt.adapt(**json) (see _adapt_in_subprocess)
    from ..training.adapt import adapt as _adapt

    _adapt(**json.loads(sys.argv[1]))
