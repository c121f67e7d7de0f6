"""`engram experiment smollm2-edit`: counterfactual edits of facts a real pretrained model knows. SmolLM2-135M-Instruct
with an Engram adapter (the model `engram edit` works on), taught that capitals it names correctly are other
capitals: `engram edit` (an overlay of table rows) vs fine-tuning every weight, fine-tuning + KL and LoRA, each for
fixed step budgets.

Every choice is read from the preregistration `docs/prereg/smollm2-edit.toml` (`analysis/prereg.py`):

1. The starting model: the base imported from its GGUF file with the Engram adapter §12 selected (Shakespeare,
   its learning rate, 50 steps, seed 0), trained here and cached in OUT/smollm2-edit/adapter. Every method starts
   from it; an edit needs a trained adapter (a fresh one has a zero value projection).
2. Known facts: `known_facts.known_facts`, the shipped facts the starting model completes with the true object by
   greedy decoding (teacher-forced argmax: `editing.greedy`); the base alone's count is reported beside it.
3. Fact sets: the known facts of one relation (capitals) shuffled with a fixed seed and cut into disjoint test
   sets of k facts; a selection set of k known facts of another relation (languages) apart from them. Each fact's
   target is another object of its relation (`known_facts.counterfactuals`, seeded by the set).
4. Per method and budget, on the edited set: efficacy (greedy produces the new object after the prompt),
   paraphrases (after the fact's paraphrase), specificity on the known unedited facts of the same relation and of
   the other relations (still produce their true object), and fluency: val loss change on general text.
5. Learning rates: each method's grid run on the selection set; the point with the highest editing score
   (the mean of efficacy and both specificities at the last budget; `selection_rank` breaks ties), the grid
   extended once past an end that holds it. Then every test set at the chosen rates; the family: each
   fine-tuning vs the edit at the last budget on the five metrics, paired t over the test sets, Holm.

Every run is cached (OUT/smollm2-edit/<set>-<method>-lr<lr>.json), so a stopped experiment resumes.
"""

from __future__ import annotations

import datetime
import random
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from engram.editing import Fact, applied, edit_facts
from engram.persist import write_json

from . import prereg
from .edit import fact_share, finetune
from .known_facts import all_facts, counterfactuals, known_facts
from .records import fmt_pm
from .registry import Experiment, register
from .retrofit import extend_grid, say
from .runs import ExperimentError, detectable, index_environments, publish, read_result, seed_stats, verdict

NAME = "smollm2-edit"
METRICS = ("efficacy", "paraphrases", "specificity_same", "specificity_other", "fluency_change")
LABELS = {"efficacy": "efficacy", "paraphrases": "paraphrases", "specificity_same": "specificity (same relation)",
          "specificity_other": "specificity (other relations)", "fluency_change": "Δ general loss"}
EDIT_TARGET_PROB = 0.9999  # the edit's early stop (every target at this probability) effectively off: a fixed budget


def starting_adapter(root: Path, base: Path, d: dict, progress: bool) -> Path:
    """The Engram adapter every method starts from, trained (once) as the prereg's [adapter] says."""
    from engram.training.adapt import adapt
    from engram.training.checkpoint import checkpoints

    a, run_dir = d["adapter"], root / "adapter"
    if not (run_dir / "summary.json").is_file():
        say(progress, f"[{NAME}] training the starting adapter ({a['data']}, {a['steps']} steps) -> {run_dir}")
        settings = {k: a[k] for k in ("seq_len", "batch_size", "warmup_steps", "weight_decay", "lr", "seed")}
        adapt(base=str(base), data=[a["data"]], out=str(run_dir), method="engram", layers=a["layers"],
              max_steps=a["steps"], overrides={**settings, "ckpt_every": a["steps"], "eval_every": a["steps"]},
              resume=bool(checkpoints(run_dir)), progress=progress)
    return run_dir


def fact_sets(facts: list[tuple[str, Fact]], d: dict) -> dict[str, list[tuple[str, Fact, str]]]:
    """{"test-0": ..., "selection": ...}: disjoint sets of (relation, counterfactual fact, true target) as the
    prereg's [sets] says (k facts each, the test sets from one relation, the selection set from another)."""
    s = d["sets"]
    rng = random.Random(s["seed"])
    pool = [rf for rf in facts if rf[0] == s["relation"]]
    rng.shuffle(pool)
    k = min(s["size"], len(pool) // s["count"])
    sel_pool = [rf for rf in facts if rf[0] == s["selection_relation"]]
    rng.shuffle(sel_pool)
    if k < s["min_size"] or len(sel_pool) < k:
        raise ExperimentError(f"the starting model knows {len(pool)} facts of {s['relation']!r} and {len(sel_pool)} of "
                              f"{s['selection_relation']!r}: too few for {s['count']} test sets and a selection set "
                              f"of at least {s['min_size']} facts")
    out = {f"test-{i}": counterfactuals(pool[i * k:(i + 1) * k], seed=s["seed"] + 1 + i) for i in range(s["count"])}
    out["selection"] = counterfactuals(sel_pool[:k], seed=s["seed"])
    return out


def measure(model, tok, edited: list[tuple[str, Fact, str]], facts: list[tuple[str, Fact]], windows,
            before: float) -> dict:
    """The five metrics of `model` for the edited set `edited` (`facts`: every known fact; those not edited are the
    specificity prompts, split by whether their relation is one of the edited facts')."""
    from engram.training.train import evaluate

    model.eval()
    prompts = {f.prompt for _, f, _ in edited}
    rels = {r for r, _, _ in edited}
    rest = [(r, f) for r, f in facts if f.prompt not in prompts]
    share = partial(fact_share, model, tok)  # the share of (prompt, target) pairs greedy decoding gets right
    return {"efficacy": share([(f.prompt, f.target) for _, f, _ in edited]),
            "paraphrases": share([(p, f.target) for _, f, _ in edited for p in f.paraphrases]),
            "old_kept": share([(f.prompt, true) for _, f, true in edited]),
            "specificity_same": share([(f.prompt, f.target) for r, f in rest if r in rels]),
            "specificity_other": share([(f.prompt, f.target) for r, f in rest if r not in rels]),
            "n_same": sum(r in rels for r, _ in rest), "n_other": sum(r not in rels for r, _ in rest),
            "fluency_change": evaluate(model, windows, 8, torch.device("cpu")) - before}


def score(m: dict) -> float:
    """The editing score a learning rate is selected by: the mean of efficacy and both specificities. (Amendments
    1 and 3 of docs/prereg/smollm2-edit.toml: the first score, a harmonic mean that also took paraphrases, was 0 at
    every rate of the edit, which reaches no paraphrase, and of ft, which broke every other fact of the relation;
    a 0 anywhere made every rate tie.)"""
    return statistics.fmean(m[k] for k in ("efficacy", "specificity_same", "specificity_other"))


def selection_rank(at: dict[float, dict]) -> dict[float, int]:
    """{lr: rank} of a method's selection-set measurements {lr: metrics at the last budget}, 0 the best: the highest
    score, then the highest efficacy, then the larger rate (so that a grid where nothing is learned yet is extended
    upward; amendment 2 dropped the fluency tie-break, which had sent such a grid downward)."""
    order = sorted(at, key=lambda lr: (-score(at[lr]), -at[lr]["efficacy"], -lr))
    return {lr: i for i, lr in enumerate(order)}


def run(out: str | Path = "runs/experiments", progress: bool = True, record: str | Path | None = None,
        repo: Path | None = None, budgets: list[int] | None = None) -> dict:
    """The preregistered design (resumable), then summary.json/.md and plot.png in OUT/smollm2-edit; `record`: also
    `record/smollm2-edit.json`. `budgets` overrides the prereg's for a trial (then nothing can be recorded)."""
    from engram.inference import load_base, load_with_adapter
    from engram.training.data import text_windows
    from engram.utils import environment

    from .smollm2_adapt import smollm2_base

    if record is not None and budgets is not None:
        raise ExperimentError("--max-steps departs from the preregistered budgets; drop it to --record")
    pre = prereg.load(NAME, record=record is not None, repo=repo)
    d = pre.design
    root = Path(out) / NAME
    root.mkdir(parents=True, exist_ok=True)
    base = smollm2_base(root, d["base"], progress, NAME)
    adapter = starting_adapter(root, base, d, progress)
    budgets = sorted(budgets or d["budgets"])
    model, tok = load_with_adapter(base, adapter)
    ev = d["evaluation"]
    windows = text_windows(tok, [ev["general"]], "val", ev["seq_len"], ev["windows"])  # (W, T) fluency text
    anchor = text_windows(tok, [ev["general"]], "train", ev["seq_len"], ev["anchor_windows"])  # ft+kl's KL text
    known_file = root / "known.json"
    if not known_file.is_file():
        say(progress, f"[{NAME}] which of the {len(all_facts())} facts the base and the starting model know")
        from engram.training.train import evaluate

        base_model = load_base(base)[0].eval()
        write_json(known_file, {"base": [f.prompt for _, f in known_facts(base_model, tok)],
                                "start": [f.prompt for _, f in known_facts(model, tok)],
                                "general_before": evaluate(model.eval(), windows, 8, torch.device("cpu"))})
        del base_model
    kn = read_result(known_file, "known facts")
    facts = [(r, f) for r, f in all_facts() if f.prompt in set(kn["start"])]
    before = kn["general_before"]
    sets = fact_sets(facts, d)

    def one(set_name: str, method: str, lr: float) -> dict:
        """One method at one learning rate on one fact set, measured after every budget (cached)."""
        f = root / f"{set_name}-{method}-lr{lr:g}.json"
        if f.is_file():
            return read_result(f, f"{NAME} run")
        edited = sets[set_name]
        edits = [fact for _, fact, _ in edited]
        at: dict[str, dict] = {}
        say(progress, f"[{NAME}] {set_name}: {method} lr {lr:g}, budgets {budgets}")
        if method == "engram-edit":
            secs = 0.0
            for b in budgets:
                ov = edit_facts(model, tok, edits, steps=b, lr=lr, target_prob=EDIT_TARGET_PROB, progress=False)
                with applied(model, ov):
                    at[str(b)] = measure(model, tok, edited, facts, windows, before)
                at[str(b)]["rows_changed"] = ov.num_rows
                secs = ov.meta["optimization"]["seconds"]  # the last (largest) budget's optimization
            extra = {"train_seconds": round(secs, 2), "trainable_params": None}
        else:
            spent = [0.0]

            def on_budget(step, m):
                t0 = time.perf_counter()
                at[str(step)] = measure(m, tok, edited, facts, windows, before)
                spent[0] += time.perf_counter() - t0

            seed = d["sets"]["seed"]
            info = finetune(lambda: load_with_adapter(base, adapter), edits, method, budgets, on_budget, lr,
                            d["methods"][method].get("kl", 0.0), anchor, seed=seed, progress=False,
                            kl_windows=ev["kl_windows"])
            extra = {"train_seconds": round(info["seconds"] - spent[0], 2),
                     "trainable_params": info["trainable_params"]}
        rec = {"set": set_name, "method": method, "lr": lr, "budgets": at, **extra,
               "seconds_per_step": extra["train_seconds"] / budgets[-1], "environment": environment()}
        write_json(f, rec)
        return rec

    # the selection set: each method's grid, extended once past an end that holds the best score
    last = str(budgets[-1])
    runs: list[dict] = []
    grids, extended, chosen_lr = {}, {}, {}
    for m, spec in d["methods"].items():
        grids[m], extended[m] = sorted(spec["lrs"]), {}
        while True:
            rs = {lr: one("selection", m, lr) for lr in grids[m]}
            key = selection_rank({lr: r["budgets"][last] for lr, r in rs.items()})  # extend_grid minimizes
            nxt = extend_grid(grids[m], key, extended[m], limit=d["selection"]["extend"])
            if nxt is None:
                break
            grids[m] = sorted(grids[m] + [nxt])
        chosen_lr[m] = min(key, key=key.get)
        runs += list(rs.values())

    # the test sets at the chosen learning rates
    tests_sets = [s for s in sets if s.startswith("test-")]
    for s in tests_sets:
        runs += [one(s, m, chosen_lr[m]) for m in d["methods"]]
    rows = [{"set": r["set"], "method": r["method"], "lr": r["lr"], "budget": int(b), **v,
             "train_seconds": r["train_seconds"], "seconds_per_step": r["seconds_per_step"],
             "trainable_params": r["trainable_params"], "environment": r["environment"]}
            for r in runs for b, v in r["budgets"].items()]
    summary = {"experiment": NAME, "date": datetime.date.today().isoformat(),
               "command": f"engram experiment {NAME} --record docs/results", "prereg": pre.stamp(), "design": d,
               "budgets": budgets, "known": {"base": len(kn["base"]), "start": len(kn["start"]),
                                             "of": len(all_facts()),
                                             "by_relation": {r: sum(x == r for x, _ in facts) for r in
                                                             dict.fromkeys(r for r, _ in all_facts())}},
               "general_before": before,
               "sets": {s: [{"relation": r, "prompt": f.prompt, "target": f.target, "true": t} for r, f, t in v]
                        for s, v in sets.items()},
               "grids": grids, "extended": extended, "chosen_lr": chosen_lr, "runs": rows}
    summary["environments"] = index_environments(summary["runs"]) or [environment()]
    summary |= analyse(summary)
    return publish(summary, root, record, f"{NAME}.json", markdown, plot)


def _cell(runs: list[dict], method: str, budget: int, key: str) -> dict:
    rs = sorted((r for r in runs if r["method"] == method and r["budget"] == budget and r["set"].startswith("test-")
                 and r["lr"] == r["chosen_lr"]), key=lambda r: r["set"])
    return {"sets": [int(r["set"].split("-")[1]) for r in rs], "values": [r[key] for r in rs]}


def analyse(s: dict) -> dict:
    """Per method and budget, mean ± sd over the test sets; the preregistered family (each fine-tuning vs the edit
    at the last budget, paired by test set, Holm)."""
    from .significance import compare, holm, is_finding

    runs = [{**r, "chosen_lr": s["chosen_lr"][r["method"]]} for r in s["runs"]]
    t = s["design"]["test"]
    table = {m: {str(b): {k: seed_stats(_cell(runs, m, b, k)["values"]) for k in (*METRICS, "old_kept")}
                 for b in s["budgets"]} for m in s["chosen_lr"]}
    tests = []
    for a, b in t["pairs"]:
        for k in t["metrics"]:
            ca, cb = _cell(runs, a, t["budget"], k), _cell(runs, b, t["budget"], k)
            r = compare(ca["values"], cb["values"], ca["sets"], cb["sets"])
            tests.append({"a": a, "b": b, "metric": k, "budget": t["budget"], "kind": r.kind, "diff": r.diff,
                          "se": r.se, "df": r.df, "p": r.p, "n": r.n_a, "min_detectable": detectable(r)})
    for x, adj in zip(tests, holm([x["p"] for x in tests])):
        x["p_holm"], x["finding"] = adj, is_finding(adj)
    return {"table": table, "tests": tests}


def markdown(s: dict) -> str:
    """The known facts, the selection grid, every method at every budget on the test sets, the tests, the cost."""
    from .significance import fmt_p

    kn, n = s["known"], s["design"]["sets"]["count"]
    k = len(s["sets"]["test-0"])
    last = str(s["budgets"][-1])
    lines = [f"Preregistration `{s['prereg']['file']}` (blob {str(s['prereg']['blob'])[:10]}, "
             f"{s['prereg']['status']}; run at commit {str(s['prereg']['commit'])[:10]}).", "",
             f"Known facts (greedy): the base {kn['base']} of {kn['of']}, the starting model (base + adapter) "
             f"{kn['start']} (" + ", ".join(f"{r} {c}" for r, c in kn["by_relation"].items()) + f"). {n} disjoint "
             f"test sets of {k} {s['design']['sets']['relation']} facts, a selection set of {k} "
             f"{s['design']['sets']['selection_relation']} facts; general text loss before "
             f"{s['general_before']:.4f}.", "",
             f"Selection set (editing score at {last} steps per learning rate; the chosen one in bold):", "",
             "| method | lr: score |", "|---|---|"]
    for m, lrs in s["grids"].items():
        cells = []
        for lr in lrs:
            r = next(r for r in s["runs"] if r["set"] == "selection" and r["method"] == m and r["lr"] == lr
                     and str(r["budget"]) == last)
            txt = f"{lr:g}: {score(r):.3f}"
            cells.append(f"**{txt}**" if lr == s["chosen_lr"][m] else txt)
        edge = "" if min(lrs) < s["chosen_lr"][m] < max(lrs) else " (edge: the grid's end after its extension)"
        lines.append(f"| {m} | " + "; ".join(cells) + edge + " |")
    lines += ["", f"Test sets at the chosen learning rates (mean ± sd over n={n} fact sets):", "",
              "| method | lr | steps | " + " | ".join(LABELS[k] for k in METRICS) + " | old answer kept |",
              "|---" * (len(METRICS) + 4) + "|"]
    for m, per in s["table"].items():
        for b, t in per.items():
            cells = [fmt_pm(t[k]["mean"], t[k]["std"], sign=True) if k.endswith("_change")
                     else fmt_pm(t[k]["mean"], t[k]["std"], places=2) for k in (*METRICS, "old_kept")]
            lines.append(f"| {m} | {s['chosen_lr'][m]:g} | {b} | " + " | ".join(cells) + " |")
    cost = {m: seed_stats([r["seconds_per_step"] for r in s["runs"] if r["method"] == m and r["set"].startswith(
        "test-") and r["lr"] == s["chosen_lr"][m] and str(r["budget"]) == last]) for m in s["chosen_lr"]}
    params = {m: next((r["trainable_params"] for r in s["runs"] if r["method"] == m), None) for m in s["chosen_lr"]}
    lines += ["", "Cost per step (seconds, the training steps alone, over the test sets; one process, 2 threads, on a "
                  "machine running other work beside it: a rough cost, not a benchmark) and what each method "
                  "changes:", "", "| method | s/step | trainable parameters |", "|---|---|---|"]
    for m, c in cost.items():
        rows = next((r["rows_changed"] for r in s["runs"] if r["method"] == m and "rows_changed" in r), None)
        what = f"{rows} table rows (overlay)" if rows is not None else f"{params[m]:,}"
        lines.append(f"| {m} | {c['mean']:.3f} ± {c['std']:.3f} | {what} |")
    lines += ["", f"Tests (preregistered family of {len(s['tests'])}: B - A at {s['design']['test']['budget']} steps, "
                  "paired t over the test sets, Holm-adjusted; a finding when Holm p < 0.05, otherwise the difference "
                  "the test could have detected at 80% power):", "",
              "| A | B | metric | B - A | p | Holm p | verdict |", "|---|---|---|---|---|---|---|"]
    for t in s["tests"]:
        lines.append(f"| {t['a']} | {t['b']} | {LABELS[t['metric']]} | {t['diff']:+.4f} ± {t['se']:.4f} | "
                     f"{fmt_p(t['p'])} | {fmt_p(t['p_holm'])} | {verdict(t, 'fact set')} |")
    return "\n".join(lines) + "\n"


def plot(s: dict, path: Path) -> None:
    """Specificity (same relation) vs efficacy, and general-text damage vs efficacy: one line per method through
    its budgets (mean ± sd over the test sets)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    colors = {"engram-edit": "tab:blue", "ft": "tab:red", "ft+kl": "tab:green", "lora": "tab:purple"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for m, per in s["table"].items():
        for ax, yk in zip(axes, ("specificity_same", "fluency_change")):
            xs = [per[str(b)]["efficacy"] for b in s["budgets"]]
            ys = [per[str(b)][yk] for b in s["budgets"]]
            ax.errorbar([x["mean"] for x in xs], [y["mean"] for y in ys], xerr=[x["std"] for x in xs],
                        yerr=[y["std"] for y in ys], fmt="o-", color=colors.get(m), capsize=2, label=m)
            ax.annotate(str(s["budgets"][-1]), (xs[-1]["mean"], ys[-1]["mean"]), fontsize=7)
    axes[0].set_ylabel(LABELS["specificity_same"])
    axes[1].set_ylabel(LABELS["fluency_change"])
    for ax in axes:
        ax.set_xlabel("efficacy (greedy produces the new object)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"engram experiment {NAME}: SmolLM2-135M-Instruct + adapter, budgets "
                 f"{', '.join(map(str, s['budgets']))} steps (mean ± sd over the test sets)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


register(Experiment("smollm2-edit", """
    counterfactual edits of capitals SmolLM2-135M-Instruct (+ an Engram adapter) knows: `engram edit`
    vs fine-tuning, fine-tuning + KL and LoRA at fixed step budgets; efficacy, paraphrases,
    specificity on known unedited facts, fluency; read from docs/prereg/smollm2-edit.toml
    (`smollm2_edit.py`; the recorded run took 54 min on 2 cores shared with other work).""",
                    run=lambda o: run(o.out, progress=o.progress, record=o.record,
                                      budgets=[o.max_steps] if o.max_steps else None),
                    table=markdown, plot=plot, plot_file="smollm2-edit.png", section="13"))
