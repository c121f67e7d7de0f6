"""`engram experiment edit`: facts written into table rows (`engram edit`) vs taught by fine-tuning.

1. The model: an `exp`-size Engram LM (hidden 128, 4 blocks) trained on Shakespeare plus a world-facts
   corpus (`world_facts`: every country of the PyPI wheel `countryinfo==1.0.1`, MIT, with its capital,
   subregion and demonym, each stated in three phrasings, 30 shuffled copies), so that it *knows* facts
   an edit can contradict. Cached in OUT/edit/base; `--checkpoint` uses an existing Engram run instead.
2. Three fact sets (seeds 0-2), none filtered for addressability by the memory:
   * **counterfactuals**: `n` facts the model gets right (greedy), each given another object of the
     same relation ("The capital of France is" -> " Lima" where it said " Paris"); paraphrases are
     the other two phrasings; **neighbours** are 3 other known facts of the same relation per edit
     (same relation, other subject), which should not change;
   * **new entities**: `n` made-up entities (`make_facts`, unfiltered): "The home of Quorvane is" ->
     " Padua".
3. Methods, each on one fact set at once: `engram edit` (an overlay of table rows, default settings);
   fine-tuning every weight (`ft`), the same with a KL penalty to the original model on general text
   (`ft+kl`, the usual regularized baseline), and LoRA rank 8 on every linear layer (`lora`). The
   fine-tunings minimize the targets' NLL until greedy decoding produces as many targets as the edit
   did (or `FT_STEPS` steps).
4. Measured per method and fact set: efficacy (greedy produces the new target; counterfactuals and new
   entities apart), generalization (paraphrases), specificity (neighbour prompts still produce their
   true object) and the validation loss change on Shakespeare's validation split; mean ± sd over the
   3 fact sets, differences to the edit with the two-standard-error rule.
Every stage is cached under OUT/edit, so a stopped experiment resumes.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..editing import Fact, applied, edit_facts
from ..persist import write_json
from ..training.data import text_windows
from ..utils import environment
from .facts import WORLD_RELATIONS, fact_sets, world_facts, write_world_corpus
from .runs import difference, publish, read_result, read_run_file, seed_stats


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, flush=True)


def greedy(model, tok, pairs: list[tuple[str, str]], chunk: int = 64) -> list[bool]:
    """For each (prompt, target): does greedy decoding after `prompt` produce `target`'s tokens? One teacher-forced
    forward per chunk: greedy produces the target exactly when every target token is the argmax after the prompt
    and the target tokens before it (right padding leaves a causal model's earlier positions unchanged)."""
    from ..editing.optimize import _batch

    out = []
    for i in range(0, len(pairs), chunk):
        seqs = [(tok.encode(p, add_special_tokens=False).ids, tok.encode(t, add_special_tokens=False).ids)
                for p, t in pairs[i:i + chunk]]
        with torch.no_grad():
            logits = model(_batch([p + t for p, t in seqs], 1)).logits
        out += [logits[b, len(p) - 1: len(p) + len(t) - 1].argmax(-1).tolist() == t for b, (p, t) in enumerate(seqs)]
    return out


def _share(model, tok, pairs) -> float | None:
    return sum(greedy(model, tok, pairs)) / len(pairs) if pairs else None


def known_facts(model, tok, facts: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The facts whose prompt the model completes greedily with the true object."""
    hits = greedy(model, tok, [(WORLD_RELATIONS[r][1].format(s=s), o) for s, r, o in facts])
    return [f for f, h in zip(facts, hits) if h]


# ------------------------------------------------------------------------------------------ measuring
def measure(model, tok, fs: dict, windows, val_before: float) -> dict:
    """Efficacy and generalization (counterfactuals and new entities apart), specificity and the val change."""
    from ..training.train import evaluate

    model.eval()
    out = {}
    for kind in ("counterfactual", "new"):
        facts = fs[kind]
        out[f"efficacy_{kind}"] = _share(model, tok, [(f.prompt, f.target) for f in facts])
        out[f"generalization_{kind}"] = _share(model, tok, [(q, f.target) for f in facts for q in f.paraphrases])
    out["specificity"] = _share(model, tok, [(x["prompt"], x["target"]) for x in fs["neighbours"]])
    out["counterfactual_old_kept"] = _share(model, tok, list(zip([f.prompt for f in fs["counterfactual"]],
                                                                 fs["counterfactual_true"])))
    rels = fs.get("counterfactual_relation") or []
    out["by_relation"] = {rel: {
        "efficacy": _share(model, tok, [(f.prompt, f.target) for f, r in zip(fs["counterfactual"], rels) if r == rel]),
        "specificity": _share(model, tok, [(x["prompt"], x["target"]) for x in fs["neighbours"]
                                           if x.get("relation") == rel]),
    } for rel in dict.fromkeys(rels)}
    out["val_change"] = evaluate(model, windows, 16, torch.device("cpu")) - val_before
    return out


# ------------------------------------------------------------------------------------------ fine-tuning baselines
FT_STEPS = 300
KL_WEIGHT = 1.0


def _finetune_model(model, method: str):
    """(model to train, optimizers) for `method` ft | ft+kl | lora."""
    from ..memory import is_table_key

    if method == "lora":
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        m = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
        params = [p for p in m.parameters() if p.requires_grad]
        return m, [torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)]
    dense = [p for n, p in model.named_parameters() if not is_table_key(n)]
    tables = [p for n, p in model.named_parameters() if is_table_key(n) and p.numel()]
    opts = [torch.optim.AdamW(dense, lr=1e-4, weight_decay=0.0)]
    if tables:
        opts.append(torch.optim.SparseAdam(tables, lr=5e-4))
    return model, opts


def finetune(model_dir: Path, facts: list[Fact], method: str, goal: int, anchor=None, max_steps: int = FT_STEPS,
             kl_weight: float = KL_WEIGHT, seed: int = 0, progress: bool = True):
    """Teach `facts` by fine-tuning (`method` ft | ft+kl | lora) until greedy decoding produces `goal` targets.
    `ft+kl` adds `kl_weight` x KL(original || tuned) of next-token distributions on 8 windows of `anchor` per
    step (general text). Returns (tuned model, tokenizer, {steps, seconds, trainable_params})."""
    from ..editing.optimize import _batch, _sequences, _target_logprobs
    from ..model import load_model

    torch.manual_seed(seed)
    model, tok = load_model(model_dir)
    ref = load_model(model_dir)[0].eval() if method == "ft+kl" else None
    model, opts = _finetune_model(model, method)
    seqs = _sequences(tok, facts)
    ids = _batch([p + t for p, t in seqs], 1)
    gen = torch.Generator().manual_seed(seed)
    t0, step = time.perf_counter(), 0
    for step in range(max_steps + 1):
        model.eval()
        with torch.no_grad():
            logits = model(ids).logits
        hit = sum(logits[b, len(p) - 1: len(p) + len(t) - 1].argmax(-1).tolist() == t for b, (p, t) in enumerate(seqs))
        if progress and step % 50 == 0:
            _say(progress, f"[edit] {method} step {step}: {hit}/{len(facts)} targets greedy")
        if hit >= goal or step == max_steps:
            break
        model.train()
        lps = _target_logprobs(model, ids, seqs)
        loss = torch.stack([lp.mean() for lp in lps]).mean().neg()
        if ref is not None:
            x = torch.from_numpy(anchor[torch.randint(len(anchor), (8,), generator=gen).numpy()]).long()
            with torch.no_grad():
                p0 = F.log_softmax(ref(x).logits, -1)
            kl = F.kl_div(F.log_softmax(model(x).logits, -1), p0, log_target=True, reduction="batchmean") / x.shape[1]
            loss = loss + kl_weight * kl
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts:
            o.step()
    model.eval()
    trainable = sum(p.numel() for o in opts for g in o.param_groups for p in g["params"])
    return model, tok, {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "trainable_params": trainable}


# ------------------------------------------------------------------------------------------ the experiment
METHODS = ("engram-edit", "ft", "ft+kl", "lora")
METRICS = ("efficacy_counterfactual", "efficacy_new", "generalization_counterfactual", "generalization_new",
           "specificity", "val_change")
BASE_STEPS = 1000


def base_model(root: Path, checkpoint: str | None, progress: bool, max_steps: int | None = None,
               preset: str = "exp", copies: int = 30) -> Path:
    """The trained model folder: `checkpoint`, or an Engram model trained (and cached) in ROOT/base on Shakespeare
    plus the world-facts corpus."""
    if checkpoint:
        return Path(checkpoint)
    run = root / "base"
    if not (run / "final" / "config.json").is_file():
        from ..training.checkpoint import checkpoints
        from ..training.train import train

        world = write_world_corpus(world_facts(), root / "world", copies)
        _say(progress, f"[edit] training the {preset} model on Shakespeare + world facts -> {run}")
        train(preset, data=["shakespeare", str(world)], out=run, max_steps=max_steps or BASE_STEPS,
              resume=bool(checkpoints(run)), progress=progress,
              overrides={"batch_size": 16, "eval_max_windows": 64, "ckpt_every": 250})
    return run


def run(out: str | Path = "runs/experiments", checkpoint: str | None = None, n_facts: int = 20, seeds: int = 3,
        max_windows: int = 128, progress: bool = True, record: str | Path | None = None,
        base_steps: int | None = None, preset: str = "exp", ft_steps: int = FT_STEPS, edit_steps: int = 300,
        general: list[str] | None = None) -> dict:
    """The experiment (see the module doc); `general`: the corpus of the validation loss and the KL anchor
    (default Shakespeare). Writes OUT/edit/summary.{json,md}, plot.png; `record`: also `record/edit.json`."""
    from ..model import load_model
    from ..training.train import evaluate

    root = Path(out) / "edit"
    root.mkdir(parents=True, exist_ok=True)
    model_dir = base_model(root, checkpoint, progress, base_steps, preset)
    model_path = model_dir / "final" if (model_dir / "final").is_dir() else model_dir
    model, tok = load_model(model_path)
    windows = text_windows(tok, general, "val", 256, max_windows)
    val_before = evaluate(model, windows, 16, torch.device("cpu"))
    info = read_run_file(model_dir) if (model_dir / "run.json").is_file() else {}
    anchor = text_windows(tok, general, "train", 128, 256)  # general text for the KL penalty
    all_facts = world_facts()
    known_file = root / "known.json"
    if not known_file.is_file():
        _say(progress, f"[edit] scoring {len(all_facts)} world facts")
        write_json(known_file, known_facts(model, tok, all_facts), indent=None)
    known = [tuple(f) for f in read_result(known_file, "known facts", expect=list)]
    if len(known) < n_facts:
        raise ValueError(f"the model knows only {len(known)} of {len(all_facts)} world facts, fewer than the {n_facts} "
                         "counterfactuals per set; train the base longer (base_steps) or lower n_facts")
    per: dict[str, list[dict]] = {m: [] for m in METHODS}
    for seed in range(seeds):
        fs = fact_sets(known, all_facts, n_facts, seed)
        facts = fs["counterfactual"] + fs["new"]
        for method in METHODS:
            f = root / f"seed{seed}-{method}.json"
            if not f.is_file():
                t0 = time.perf_counter()
                if method == "engram-edit":
                    _say(progress, f"[edit] seed {seed}: engram edit of {len(facts)} facts")
                    overlay = edit_facts(model, tok, facts, steps=edit_steps, progress=False)
                    with applied(model, overlay):
                        res = measure(model, tok, fs, windows, val_before)
                    res |= {"rows_changed": overlay.num_rows, "steps": overlay.meta["optimization"]["steps_run"],
                            "seconds": round(time.perf_counter() - t0, 1)}
                else:
                    goal = round(read_result(root / f"seed{seed}-engram-edit.json", "edit result")["efficacy_all"]
                                 * len(facts))
                    _say(progress, f"[edit] seed {seed}: {method} until {goal}/{len(facts)} targets are greedy")
                    tuned, _, info_ft = finetune(model_path, facts, method, goal, anchor, ft_steps, seed=seed,
                                                 progress=progress)
                    res = measure(tuned, tok, fs, windows, val_before) | info_ft
                n = len(fs["counterfactual"])
                res["efficacy_all"] = ((res["efficacy_counterfactual"] * n + res["efficacy_new"] * len(fs["new"]))
                                       / len(facts))
                res |= {"seed": seed, "facts": {"counterfactual": n, "new": len(fs["new"]),
                                                "neighbours": len(fs["neighbours"])}}
                write_json(f, res)
            per[method].append(read_result(f, "edit result"))
    table = {m: {k: seed_stats([r[k] for r in rs]) for k in METRICS} for m, rs in per.items()}
    tests = {m: {k: difference(table["engram-edit"][k], table[m][k]) for k in METRICS} for m in METHODS[1:]}
    by_rel = {m: {rel: {k: seed_stats([r["by_relation"][rel][k] for r in rs if rel in r.get("by_relation", {})
                                        and r["by_relation"][rel][k] is not None])
                        for k in ("efficacy", "specificity")}
                  for rel in WORLD_RELATIONS if any(rel in r.get("by_relation", {}) for r in rs)}
              for m, rs in per.items()}
    summary = {"experiment": "edit", "date": datetime.date.today().isoformat(),
               "command": f"engram experiment edit --seeds {seeds} --record docs/results",
               "model": str(model_path), "model_train": info.get("train", {}), "val_before": val_before,
               "world_facts": len(all_facts), "known_facts": len(known),
               "known_by_relation": {r: sum(f[1] == r for f in known) for r in WORLD_RELATIONS},
               "n_facts": n_facts, "seeds": seeds, "ft_steps": ft_steps, "kl_weight": KL_WEIGHT,
               "methods": table, "tests": tests, "by_relation": by_rel, "runs": per, "environments": [environment()]}
    return publish(summary, root, record, "edit.json", markdown, plot)


LABELS = {"efficacy_counterfactual": "efficacy (counterfactual)", "efficacy_new": "efficacy (new entity)",
          "generalization_counterfactual": "paraphrases (counterfactual)", "generalization_new": "paraphrases (new)",
          "specificity": "specificity (neighbours kept)", "val_change": "val loss change"}


def markdown(s: dict) -> str:
    head = "| method | " + " | ".join(LABELS[k] for k in METRICS) + " | steps |"
    lines = [f"Model: {s['known_facts']} of {s['world_facts']} world facts known (greedy) "
             f"({', '.join(f'{r} {n}' for r, n in s['known_by_relation'].items())}); "
             f"val loss before {s['val_before']:.4f}. "
             f"{s['n_facts']} counterfactuals + {s['n_facts']} new entities per fact set. Every cell: mean ± sample sd "
             f"over n={s['seeds']} fact sets; vs the edit: the verdict on the difference, a finding only beyond "
             "2 se (each difference ± se is in the record's `tests`).", "",
             head, "|---" * (len(METRICS) + 2) + "|"]
    for m, t in s["methods"].items():
        cells = []
        for k in METRICS:
            x = t[k]
            fmt = "+.4f" if k == "val_change" else ".2f"
            cell = f"{x['mean']:{fmt}} ± {x['std']:{fmt[1:] if fmt[0] == '+' else fmt}}"
            if m in s["tests"]:
                d = s["tests"][m][k]
                cell += " (finding)" if d["finding"] else " (no diff.)"
            cells.append(cell)
        steps = seed_stats([r["steps"] for r in s["runs"][m]])["mean"]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {steps:.0f} |")
    if s.get("by_relation"):
        rels = list(next(iter(s["by_relation"].values())))
        lines += ["", f"Counterfactuals by relation (mean ± sd over n={s['seeds']} fact sets): "
                      "efficacy / specificity.", "",
                  "| method | " + " | ".join(rels) + " |", "|---" * (len(rels) + 1) + "|"]
        for m, t in s["by_relation"].items():
            lines.append(f"| {m} | " + " | ".join(
                f"{t[r]['efficacy']['mean']:.2f} ± {t[r]['efficacy']['std']:.2f} / "
                f"{t[r]['specificity']['mean']:.2f} ± {t[r]['specificity']['std']:.2f}" for r in rels) + " |")
    return "\n".join(lines) + "\n"


def plot(s: dict, path: Path) -> None:
    """Grouped bars: each metric's mean ± sd over fact sets, per method; the val change on its own axis."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    import numpy as np

    ms = list(s["methods"])
    ks = [k for k in METRICS if k != "val_change"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [4, 1.3]})
    w = 0.8 / len(ms)
    for i, m in enumerate(ms):
        t = s["methods"][m]
        a.bar(np.arange(len(ks)) + i * w, [t[k]["mean"] for k in ks], w, yerr=[t[k]["std"] for k in ks], capsize=2,
              label=m)
        b.bar(i, t["val_change"]["mean"], yerr=t["val_change"]["std"], capsize=3)
    a.set_xticks(np.arange(len(ks)) + 0.4 - w / 2, [LABELS[k].replace(" (", "\n(") for k in ks], fontsize=7)
    a.set_ylabel("share of prompts (greedy)")
    a.legend(fontsize=7)
    b.set_xticks(range(len(ms)), ms, fontsize=7, rotation=30)
    b.set_ylabel("val loss change")
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"engram experiment edit ({s['seeds']} fact sets, mean ± sd)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
