"""`engram experiment edit`: facts written into table rows (`engram edit`) vs taught by fine-tuning.

Over 450 lines on purpose: one experiment's design, driver and report, which its record is read against.

1. The model: an `exp`-size Engram LM (hidden 128, 4 blocks) trained on Shakespeare plus a world-facts
   corpus (`world_facts`: every country of the PyPI wheel `countryinfo==1.0.1`, MIT, with its capital,
   subregion and demonym, each stated in three phrasings, 30 shuffled copies), so that it *knows* facts
   an edit can contradict. A seeded 10% of the countries (`held_out_subjects`) is left out of that corpus:
   their sentences are the held-out damage text. Cached in OUT/edit/base; `--checkpoint` uses an existing
   Engram run instead.
2. Three fact sets (seeds 0-2), none filtered for addressability by the memory:
   * **counterfactuals**: `n` facts the model gets right (greedy), each given another object of the
     same relation ("The capital of France is" -> " Lima" where it said " Paris"); paraphrases are
     the other two phrasings; **neighbours** are 3 other known facts of the same relation per edit
     (same relation, other subject), which should not change;
   * **new entities**: `n` made-up entities (`make_facts`, unfiltered): "The home of Quorvane is" ->
     " Padua".
3. Methods (`configs`), each on one fact set at once, each run for a **fixed step budget** and measured
   after each of `BUDGETS` steps (no stopping rule: nothing equalizes efficacy): `engram edit` (an overlay
   of table rows, lr 0.1, no early stop); fine-tuning every weight (`ft`) at 3 learning rates; the same
   with a KL penalty to the original model on general text (`ft+kl`) at 3 KL weights; LoRA rank 8 on every
   linear layer (`lora`) at its default learning rate. The fine-tunings use constant learning rates, so the
   measurement after b steps of one run is the run of b steps.
4. Measured per method, budget and fact set: efficacy (greedy produces the new target; counterfactuals and
   new entities apart), generalization (paraphrases), specificity (neighbour prompts still produce their
   true object), per-relation hits with their n, and damage: the loss change on Shakespeare's validation
   split and on the held-out countries' world-facts sentences, and **damage on known facts** (`known_kept`):
   the share of the facts the base knows (greedy) that this fact set neither edits nor uses as neighbours
   which the edited model still completes correctly. The test (`analysis/significance`): each fine-tuning at
   its default setting vs the edit, paired by fact set, Holm over the family `FAMILY_METRICS` (the record
   names it, `family_metrics`). The held-out countries' loss is descriptive: those countries were never in the
   base's training, so every method lowers it by learning the templates (issue 48); edit.json (2026-12-02),
   which predates `known_kept`, was tested on `FAMILY_METRICS_HELD_OUT`, as a record without `family_metrics` is.
Every stage is cached under OUT/NAME (OUT/edit), so a stopped experiment resumes. `replicate` runs the design of
a preregistered replication (`analysis/replication.py`, `docs/prereg/edit-replication.toml`) with this code.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engram.editing import Fact, applied, edit_facts
from engram.persist import sha256_file, write_json
from engram.training.data import text_windows
from engram.training.run import read_run_file
from engram.utils import environment

from .records import fmt_pm
from .registry import Experiment, Runs, register
from .runs import detectable, index_environments, publish, read_result, seed_stats, verdict
from .world import WORLD_RELATIONS, fact_sets, world_facts, write_world_corpus


def say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, flush=True)


def greedy(model, tok, pairs: list[tuple[str, str]], chunk: int = 64) -> list[bool]:
    """For each (prompt, target): does greedy decoding after `prompt` produce `target`'s tokens? One teacher-forced
    forward per chunk: greedy produces the target exactly when every target token is the argmax after the prompt
    and the target tokens before it (right padding leaves a causal model's earlier positions unchanged)."""
    from engram.editing.optimize import pad_batch

    out = []
    for i in range(0, len(pairs), chunk):
        seqs = [(tok.encode(p, add_special_tokens=False).ids, tok.encode(t, add_special_tokens=False).ids)
                for p, t in pairs[i:i + chunk]]
        with torch.no_grad():
            logits = model(pad_batch([p + t for p, t in seqs], 1)).logits
        out += [logits[b, len(p) - 1: len(p) + len(t) - 1].argmax(-1).tolist() == t for b, (p, t) in enumerate(seqs)]
    return out


def fact_share(model, tok, pairs) -> float | None:
    return sum(greedy(model, tok, pairs)) / len(pairs) if pairs else None


def known_facts(model, tok, facts: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The facts whose prompt the model completes greedily with the true object."""
    hits = greedy(model, tok, [(WORLD_RELATIONS[r][1].format(s=s), o) for s, r, o in facts])
    return [f for f, h in zip(facts, hits) if h]


def unedited_known(known: list[tuple[str, str, str]], fs: dict) -> list[tuple[str, str]]:
    """(prompt, true object) of every fact in `known` (facts the base completes greedily) that fact set `fs`
    neither edits nor uses as a neighbour: the known facts an edit should leave alone and that no other measure
    reads, so their share kept after editing (`known_kept`) is damage on what the model knew."""
    used = {f.prompt for f in fs["counterfactual"]} | {x["prompt"] for x in fs["neighbours"]}
    pairs = [(WORLD_RELATIONS[r][1].format(s=s), o) for s, r, o in known]
    return [p for p in pairs if p[0] not in used]


# ------------------------------------------------------------------------------------------ measuring
def measure(model, tok, fs: dict, damage: dict, before: dict) -> dict:
    """Efficacy and generalization (counterfactuals and new entities apart), specificity, per-relation hits
    with their n, the loss change on each damage set (`damage` {name: windows}, `before` {name: loss}) and, where
    `fs` holds `known_other` (`unedited_known`), the share of those known facts kept (`known_kept`)."""
    from engram.training.train import evaluate

    model.eval()
    out = {}
    for kind in ("counterfactual", "new"):
        facts = fs[kind]
        out[f"efficacy_{kind}"] = fact_share(model, tok, [(f.prompt, f.target) for f in facts])
        out[f"generalization_{kind}"] = fact_share(model, tok, [(q, f.target) for f in facts for q in f.paraphrases])
    n_cf, n_new = len(fs["counterfactual"]), len(fs["new"])
    out["efficacy_all"] = (out["efficacy_counterfactual"] * n_cf + out["efficacy_new"] * n_new) / (n_cf + n_new)
    out["specificity"] = fact_share(model, tok, [(x["prompt"], x["target"]) for x in fs["neighbours"]])
    out["counterfactual_old_kept"] = fact_share(model, tok, list(zip([f.prompt for f in fs["counterfactual"]],
                                                                 fs["counterfactual_true"])))
    rels = fs.get("counterfactual_relation") or []
    by_rel = {}
    for rel in dict.fromkeys(rels):
        eff = greedy(model, tok, [(f.prompt, f.target) for f, r in zip(fs["counterfactual"], rels) if r == rel])
        spec = greedy(model, tok, [(x["prompt"], x["target"]) for x in fs["neighbours"] if x.get("relation") == rel])
        by_rel[rel] = {"efficacy_hits": sum(eff), "efficacy_n": len(eff), "specificity_hits": sum(spec),
                       "specificity_n": len(spec)}
    out["by_relation"] = by_rel
    if fs.get("known_other") is not None:
        out["known_kept"] = fact_share(model, tok, fs["known_other"])
    for name, windows in damage.items():
        out[f"{name}_change"] = evaluate(model, windows, 16, torch.device("cpu")) - before[name]
    return out


# ------------------------------------------------------------------------------------------ fine-tuning baselines
TABLE_LR_MULT = 5  # ft: the Engram tables (SparseAdam) at this multiple of the dense learning rate


def finetune_model(model, method: str, lr: float):
    """(model to train, optimizers) for `method` ft | ft+kl | lora at learning rate `lr`."""
    from engram.memory import is_table_key

    if method == "lora":
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        m = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
        params = [p for p in m.parameters() if p.requires_grad]
        return m, [torch.optim.AdamW(params, lr=lr, weight_decay=0.0)]
    for p in model.parameters():  # every weight: a base with an adapter arrives frozen (as PEFT freezes it)
        p.requires_grad_(True)
    dense = [p for n, p in model.named_parameters() if not is_table_key(n)]
    tables = [p for n, p in model.named_parameters() if is_table_key(n) and p.numel()]
    opts = [torch.optim.AdamW(dense, lr=lr, weight_decay=0.0)]
    if tables:
        opts.append(torch.optim.SparseAdam(tables, lr=lr * TABLE_LR_MULT))
    return model, opts


def finetune(load, facts: list[Fact], method: str, budgets, on_budget, lr: float, kl_weight: float = 0.0,
             anchor=None, seed: int = 0, progress: bool = True, kl_windows: int = 8) -> dict:
    """Teach `facts` by fine-tuning (`method` ft | ft+kl | lora) at a constant `lr` for max(`budgets`) steps,
    calling `on_budget(step, model)` after each budget (the model as a run of that many steps leaves it). `load()`
    returns a fresh (model, tokenizer) of the model the edit starts from (engram's own, or a base with its adapter).
    `ft+kl` adds `kl_weight` x KL(original || tuned) of next-token distributions on `kl_windows` windows of
    `anchor` (general text, (W, T)) per step. Returns {steps, seconds, trainable_params}."""
    from engram.editing.optimize import fact_sequences, pad_batch, target_logprobs

    torch.manual_seed(seed)
    model, tok = load()
    ref = load()[0].eval() if method == "ft+kl" else None
    model, opts = finetune_model(model, method, lr)
    seqs = fact_sequences(tok, facts)
    ids = pad_batch([p + t for p, t in seqs], 1)
    gen = torch.Generator().manual_seed(seed)
    todo, t0 = sorted(set(budgets)), time.perf_counter()
    for step in range(1, todo[-1] + 1):
        model.train()
        lps = target_logprobs(model, ids, seqs)
        loss = torch.stack([lp.mean() for lp in lps]).mean().neg()
        if ref is not None:
            x = torch.from_numpy(anchor[torch.randint(len(anchor), (kl_windows,), generator=gen).numpy()]).long()
            with torch.no_grad():
                p0 = F.log_softmax(ref(x).logits, -1)
            kl = F.kl_div(F.log_softmax(model(x).logits, -1), p0, log_target=True, reduction="batchmean") / x.shape[1]
            loss = loss + kl_weight * kl
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts:
            o.step()
        if step in todo:
            say(progress, f"[edit] {method} lr {lr:g} kl {kl_weight:g}: step {step}, target NLL {loss.item():.3f}")
            model.eval()
            on_budget(step, model)
    trainable = sum(p.numel() for o in opts for g in o.param_groups for p in g["params"] if p.requires_grad)
    return {"steps": todo[-1], "seconds": round(time.perf_counter() - t0, 1), "trainable_params": trainable}


# ------------------------------------------------------------------------------------------ the experiment
BUDGETS = (10, 50, 300)  # steps: every method is measured after each (fixed budgets, no stopping rule); 300 is
# `engram edit`'s default
EDIT_LR = 0.1  # `engram edit`'s default
EDIT_TARGET_PROB = 0.9999  # the edit's early stop (every target at this probability) effectively off: a fixed budget
FT_LRS = (3e-5, 1e-4, 3e-4)  # ft: dense learning rates swept (tables at TABLE_LR_MULT x)
LORA_LRS = (1e-3,)  # LoRA at its one default lr (the issue sweeps fine-tuning's lr and the KL weight; a LoRA sweep
# would cost 6 more fine-tunings of 300 steps, more than a 2-core session had beside the other experiments)
KL_WEIGHTS = (0.3, 1.0, 3.0)  # ft+kl at the default ft learning rate
DEFAULTS = {"ft": "ft-lr0.0001", "ft+kl": "ft+kl-w1", "lora": "lora-lr0.001"}  # each method's tested setting
METRICS = ("efficacy_counterfactual", "efficacy_new", "generalization_counterfactual", "generalization_new",
           "specificity", "known_kept", "val_change", "world_change")
# the family of comparisons: each fine-tuning's default setting vs the edit, paired by fact set, on these metrics
# at every budget; Holm over all of them. Damage on known facts replaces the held-out countries' loss (issue 48:
# those countries were never trained on, so every method lowers their loss), which stays descriptive
FAMILY_METRICS = ("efficacy_counterfactual", "efficacy_new", "specificity", "val_change", "known_kept")
# the family edit.json (2026-12-02) was tested on, fixed before its runs: a record without `family_metrics`
FAMILY_METRICS_HELD_OUT = ("efficacy_counterfactual", "efficacy_new", "specificity", "val_change", "world_change")
BASE_STEPS = 1000  # x 2,048 tokens: the base that knew most world facts on 2026-12-02 (a 300-step base trained on
# 120 copies knew too few demonyms for 3 neighbours per edit)
WORLD_COPIES = 30


def configs(ft_lrs=FT_LRS, lora_lrs=LORA_LRS, kl_weights=KL_WEIGHTS) -> dict[str, dict]:
    """name -> {method, lr, kl}: the edit, ft at each lr, ft+kl at each KL weight (default ft lr), lora at each lr."""
    out = {"engram-edit": {"method": "engram-edit", "lr": EDIT_LR, "kl": 0.0}}
    out |= {f"ft-lr{lr:g}": {"method": "ft", "lr": lr, "kl": 0.0} for lr in ft_lrs}
    ft_default = 1e-4 if 1e-4 in ft_lrs else ft_lrs[len(ft_lrs) // 2]
    out |= {f"ft+kl-w{w:g}": {"method": "ft+kl", "lr": ft_default, "kl": w} for w in kl_weights}
    out |= {f"lora-lr{lr:g}": {"method": "lora", "lr": lr, "kl": 0.0} for lr in lora_lrs}
    return out


HELD_OUT = 0.1  # share of countries whose facts the base model never sees: the held-out damage text
HELD_OUT_SEED = 12345


def held_out_subjects(all_facts: list[tuple[str, str, str]]) -> set[str]:
    """The countries (a seeded `HELD_OUT` share, at least one) left out of the base model's world corpus: their
    sentences are text the model never trained on that shares the edited prompts' n-grams ("The capital of")."""
    import random

    subjects = sorted({f[0] for f in all_facts})
    return set(random.Random(HELD_OUT_SEED).sample(subjects, max(1, round(len(subjects) * HELD_OUT))))


def trained_facts(all_facts: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The facts of the base model's world corpus: all but the held-out countries'."""
    held = held_out_subjects(all_facts)
    return [f for f in all_facts if f[0] not in held]


def base_model(root: Path, checkpoint: str | None, progress: bool, max_steps: int | None = None,
               preset: str = "exp", copies: int = WORLD_COPIES) -> Path:
    """The trained model folder: `checkpoint`, or an Engram model trained (and cached) in ROOT/base on Shakespeare
    plus the world-facts corpus."""
    if checkpoint:
        return Path(checkpoint)
    run = root / "base"
    if not (run / "final" / "config.json").is_file():
        from engram.training.checkpoint import checkpoints
        from engram.training.train import train

        # prepared data is cached by the sources' path: a folder named by its content and resolved keeps another
        # corpus (other copies, another worktree's runs/) from being read in its place
        folder = (root / f"world-{copies}x-held{HELD_OUT_SEED}").resolve()
        world = write_world_corpus(trained_facts(world_facts()), folder, copies)
        say(progress, f"[edit] training the {preset} model on Shakespeare + world facts -> {run}")
        train(preset, data=["shakespeare", str(world)], out=run, max_steps=max_steps or BASE_STEPS,
              resume=bool(checkpoints(run)), progress=progress,
              overrides={"batch_size": 16, "eval_max_windows": 64, "ckpt_every": 250})
    return run


def world_text(facts: list[tuple[str, str, str]], subjects: set[str]) -> str:
    """Every phrasing of every fact about `subjects`, as the world corpus states them, one sentence per line."""
    return "".join(t.format(s=s) + o + ".\n" for s, rel, o in facts if s in subjects
                   for t in [WORLD_RELATIONS[rel][1], *WORLD_RELATIONS[rel][2]])


def _windows_of(tok, text: str, seq_len: int):
    """(W, seq_len) evaluation windows of `text` (the last partial window dropped)."""
    from engram.training.data import eval_windows

    return eval_windows(np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32), seq_len)


def run(out: str | Path = "runs/experiments", checkpoint: str | None = None, n_facts: int = 20,
        seeds: int | list[int] = 3, max_windows: int = 64, progress: bool = True, record: str | Path | None = None,
        base_steps: int | None = None, preset: str = "exp", budgets=BUDGETS, general: list[str] | None = None,
        grid: dict | None = None, name: str = "edit", family_metrics=FAMILY_METRICS,
        command: str | None = None) -> dict:
    """The experiment (see the module doc); `seeds`: a number of fact sets (seeds 0..n-1) or the fact-set seeds;
    `general`: the corpus of the validation loss and the KL anchor (default Shakespeare); `grid`: `configs(...)`
    (default: every sweep); `name`: the experiment's name (its folder OUT/NAME and record NAME.json; a
    replication's); `family_metrics`: the tested metrics (stored in the record); `command`: the command the record
    names (default: this experiment's with its seeds). Writes OUT/NAME/summary.{json,md},
    plot.png; `record`: also `record/NAME.json`."""
    from engram.model import load_model
    from engram.training.train import evaluate

    grid = grid or configs()
    budgets = tuple(sorted(set(budgets)))
    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(x) for x in seeds]
    root = Path(out) / name
    root.mkdir(parents=True, exist_ok=True)
    model_dir = base_model(root, checkpoint, progress, base_steps, preset)
    model_path = model_dir / "final" if (model_dir / "final").is_dir() else model_dir
    model, tok = load_model(model_path)
    all_facts = world_facts()
    held = held_out_subjects(all_facts)
    damage = {"val": text_windows(tok, general, "val", 256, max_windows),  # (W, 256) general text
              "world": _windows_of(tok, world_text(all_facts, held), 64)}  # held-out countries' sentences
    before = {k: evaluate(model, w, 16, torch.device("cpu")) for k, w in damage.items()}
    info = read_run_file(model_dir) if (model_dir / "run.json").is_file() else {}
    anchor = text_windows(tok, general, "train", 128, 256)  # general text for the KL penalty
    known_file = root / "known.json"
    if not known_file.is_file():
        say(progress, f"[edit] scoring {len(all_facts)} world facts")
        write_json(known_file, known_facts(model, tok, all_facts), indent=None)
    known = [tuple(f) for f in read_result(known_file, "known facts", expect=list) if f[0] not in held]
    if len(known) < n_facts:
        raise ValueError(f"the model knows only {len(known)} of {len(all_facts)} world facts, fewer than the {n_facts} "
                         "counterfactuals per set; train the base longer (base_steps) or lower n_facts")
    runs: list[dict] = []
    known_other = {}  # per fact set: how many known facts it leaves alone, and the share the base itself gets right
    for seed in seed_list:
        fs = fact_sets(known, all_facts, n_facts, seed)
        fs["known_other"] = unedited_known(known, fs)
        facts = fs["counterfactual"] + fs["new"]
        sizes = {k: len(fs[k]) for k in ("counterfactual", "new", "neighbours", "known_other")}
        known_other[str(seed)] = {"n": len(fs["known_other"]), "kept_before": fact_share(model, tok, fs["known_other"])}
        for cname, c in grid.items():
            f = root / f"seed{seed}-{cname}.json"
            if not f.is_file():
                at: dict[int, dict] = {}
                t0 = time.perf_counter()
                if c["method"] == "engram-edit":
                    for b in budgets:
                        say(progress, f"[edit] seed {seed}: engram edit of {len(facts)} facts, {b} steps")
                        overlay = edit_facts(model, tok, facts, steps=b, lr=c["lr"], target_prob=EDIT_TARGET_PROB,
                                             progress=False)
                        with applied(model, overlay):
                            at[b] = measure(model, tok, fs, damage, before)
                        at[b] |= {"rows_changed": overlay.num_rows,
                                  "steps_run": overlay.meta["optimization"]["steps_run"]}
                    extra = {"seconds": round(time.perf_counter() - t0, 1)}
                else:
                    say(progress, f"[edit] seed {seed}: {cname} for {budgets[-1]} steps")
                    extra = finetune(lambda: load_model(model_path), facts, c["method"], budgets,
                                     lambda step, m: at.__setitem__(step, measure(m, tok, fs, damage, before)),
                                     c["lr"], c["kl"], anchor, seed=seed, progress=progress)
                write_json(f, {"seed": seed, "config": cname, **c, "facts": sizes,
                               "budgets": {str(b): r for b, r in at.items()}, **extra, "environment": environment()})
            rec = read_result(f, "edit result")
            for b in budgets:
                runs.append({"seed": seed, "config": cname, "method": c["method"], "lr": c["lr"], "kl": c["kl"],
                             "budget": b, **rec["budgets"][str(b)], "facts": rec["facts"],
                             "environment": rec.get("environment")})
    envs = index_environments(runs)
    summary = {"experiment": name, "date": datetime.date.today().isoformat(),
               "command": command or f"engram experiment {name} --seeds {len(seed_list)} --record docs/results",
               # where the model came from, without this machine's paths, and which weights exactly
               "model": ("--checkpoint " + Path(checkpoint).name) if checkpoint else f"OUT/{name}/base (trained here)",
               "model_sha256": sha256_file(model_path / "model.safetensors"),
               "model_train": info.get("train", {}), "before": before,
               "damage_sets": {"val": f"{len(damage['val'])} windows x 256 tokens of the general val split",
                               "world": f"{len(damage['world'])} windows x 64 tokens: every sentence about the "
                                        f"{len(held)} held-out countries"},
               "held_out_subjects": sorted(held), "world_facts": len(all_facts), "known_facts": len(known),
               "known_by_relation": {r: sum(f[1] == r for f in known) for r in WORLD_RELATIONS},
               "n_facts": n_facts, "seeds": len(seed_list), "fact_set_seeds": seed_list, "budgets": list(budgets),
               "configs": grid, "defaults": DEFAULTS, "family_metrics": list(family_metrics),
               "known_other": known_other, "edit_target_prob": EDIT_TARGET_PROB, "table_lr_mult": TABLE_LR_MULT,
               "runs": runs, "environments": envs or [environment()]}
    summary |= analyse(summary)
    return publish(summary, root, record, f"{name}.json", markdown, plot)


def replicate(original: dict, design: dict, out: str | Path = "runs/experiments",
              progress: bool = True) -> tuple[dict, dict]:
    """A preregistered replication's runs (`analysis/replication.py` records them with the stamp and tests its
    claim): `run` at the design's fact-set `seeds` on its `variants` (the edit and each method's default setting,
    as the original record ran them; the sweeps left out), with the original's fact-set size, budgets, base
    training steps and damage windows, which the design must state as the original record has them. The base is
    trained afresh in OUT/NAME/base by the original's recipe (`base_model`, seed 0): no base was kept. The editing
    family is the design's `[known]` metrics (each default vs the edit at every budget), kept as `known_tests`.
    Returns ({"CONFIG at BUDGET": that cell's runs in seed order}, what the record adds: this experiment's own
    summary, `run`'s, less what `records.experiment_record` writes)."""
    from .runs import ExperimentError

    where = f"docs/prereg/{design['experiment']}.toml"
    grid = configs()
    same = {"n_facts": original["n_facts"], "budgets": original["budgets"],
            "base_steps": original["model_train"]["max_steps"],
            "max_windows": int(original["damage_sets"]["val"].split()[0])}
    differ = [k for k, v in same.items() if design.get(k) != v]
    differ += [v for v in design["variants"] if grid.get(v) != original["configs"].get(v)]
    if differ:
        raise ExperimentError(f"{where}: {', '.join(map(str, differ))} differ from docs/results/edit.json's "
                              f"({same}, its configs); a replication runs the original's design")
    if sorted(design["variants"]) != sorted({"engram-edit", *DEFAULTS.values()}):
        raise ExperimentError(f"{where}: variants must be engram-edit and each method's default setting "
                              f"({', '.join(DEFAULTS.values())}), the family's sides")
    s = run(out, n_facts=design["n_facts"], seeds=design["seeds"], max_windows=design["max_windows"],
            progress=progress, base_steps=design["base_steps"], preset=design["preset"], budgets=design["budgets"],
            grid={v: grid[v] for v in design["variants"]}, name=design["experiment"],
            command=f"engram experiment {design['experiment']} --record docs/results",
            family_metrics=design["known"]["metrics"])
    envs = s["environments"]
    results = {}
    for r in s["runs"]:
        env = r.pop("environment", None)
        results.setdefault(replication_point(r["config"], r["budget"]), []).append(
            {**r, "environment": envs[env] if isinstance(env, int) else env})
    for rs in results.values():
        rs.sort(key=lambda r: r["seed"])
    extra = {k: v for k, v in s.items() if k not in ("experiment", "date", "command", "seeds", "environments", "tests")}
    return results, extra | {"known_tests": s["tests"], "overlap": overlap(
        Path(out) / design["experiment"], sorted({r["seed"] for r in original["runs"]}), design["seeds"], s["n_facts"])}


def overlap(root: Path, old_seeds: list[int], new_seeds: list[int], n_facts: int) -> dict:
    """How new each new fact set's draw is: per new seed, how many of its edited counterfactual prompts and new
    entities the fact sets of `old_seeds` (the original's) would also edit, drawn on the same base's known facts
    (ROOT/known.json, as `run` reads them). The seeds draw independently from one pool, so a few can recur."""
    all_facts = world_facts()
    held = held_out_subjects(all_facts)
    known = [tuple(f) for f in read_result(root / "known.json", "known facts", expect=list) if f[0] not in held]

    def drawn(seed: int) -> tuple[set, set]:
        fs = fact_sets(known, all_facts, n_facts, seed)
        return {f.prompt for f in fs["counterfactual"]}, {f.prompt for f in fs["new"]}

    old = [drawn(x) for x in old_seeds]
    out = {}
    for x in new_seeds:
        cf, new = drawn(x)
        out[str(x)] = {"counterfactual": len(cf & set().union(*(o[0] for o in old))),
                       "new": len(new & set().union(*(o[1] for o in old))), "of": n_facts}
    return out


def replication_point(config: str, budget: int) -> str:
    """A cell's name in a replication record: the name `report.record_family` gives the original's tested rows
    (`CONFIG at BUDGET`, the budget in steps)."""
    return f"{config} at {budget}"


def replication_table(results: dict[str, list[dict]]) -> dict:
    """A replication record's variants: per cell (`CONFIG at BUDGET`) its config, method and budget, and over the
    fact sets (in seed order) each metric `METRICS` holds that every run measured."""
    return {n: {"config": rs[0]["config"], "method": rs[0]["method"], "budget": rs[0]["budget"]} |
            {k: seed_stats([r[k] for r in rs]) for k in METRICS if all(k in r for r in rs)}
            for n, rs in results.items()}


def _cell(runs: list[dict], config: str, budget: int, key: str) -> dict:
    rs = sorted((r for r in runs if r["config"] == config and r["budget"] == budget), key=lambda r: r["seed"])
    return {"seeds": [r["seed"] for r in rs], "values": [r[key] for r in rs]}


def analyse(s: dict) -> dict:
    """The per-cell statistics (mean ± sd over fact sets), the family of tests (each default fine-tuning vs the
    edit on the record's `family_metrics`, `FAMILY_METRICS_HELD_OUT` where it names none, paired by fact set,
    Holm-adjusted), and the per-relation hits pooled over fact sets with their n."""
    from .significance import compare, holm, is_finding

    runs, budgets = s["runs"], s["budgets"]
    family_metrics = s.get("family_metrics", FAMILY_METRICS_HELD_OUT)
    table = {c: {str(b): {k: seed_stats(_cell(runs, c, b, k)["values"]) for k in METRICS if
                          all(k in r for r in runs if r["config"] == c)}
                 for b in budgets} for c in s["configs"]}
    tests = []
    for b in budgets:
        for c in s["defaults"].values():
            if c not in s["configs"] or "engram-edit" not in s["configs"]:
                continue
            for k in family_metrics:
                a, x = _cell(runs, "engram-edit", b, k), _cell(runs, c, b, k)
                t = compare(a["values"], x["values"], a["seeds"], x["seeds"])
                tests.append({"budget": b, "a": "engram-edit", "b": c, "metric": k, "kind": t.kind, "diff": t.diff,
                              "se": t.se, "df": t.df, "p": t.p, "n": t.n_a,
                              "min_detectable": detectable(t)})
    for t, adj in zip(tests, holm([t["p"] for t in tests])):
        t["p_holm"], t["finding"] = adj, is_finding(adj)
    by_rel = {}
    for c in s["configs"]:
        for b in budgets:
            cell: dict[str, dict] = {}
            for r in (r for r in runs if r["config"] == c and r["budget"] == b):
                for rel, h in r["by_relation"].items():
                    x = cell.setdefault(rel, {k: 0 for k in h})
                    for k, v in h.items():
                        x[k] += v
            by_rel.setdefault(c, {})[str(b)] = cell
    return {"table": table, "tests": tests, "by_relation": by_rel}


LABELS = {"efficacy_counterfactual": "efficacy (cf.)", "efficacy_new": "efficacy (new)",
          "generalization_counterfactual": "paraphrases (cf.)", "generalization_new": "paraphrases (new)",
          "specificity": "specificity", "known_kept": "known facts kept", "val_change": "Δ val loss",
          "world_change": "Δ held-out facts loss"}


def family_tests(s: dict) -> list[dict]:
    """The editing family's tested rows of record `s`: its `tests`, or a replication's `known_tests` (a replication
    record's `tests` is its preregistered claim's family, `analysis/replication.py`)."""
    return (s.get("known_tests") if "replicates" in s else s.get("tests")) or []


def markdown(s: dict) -> str:
    """Every config at every budget (mean ± sd over fact sets), the family of tests, and per-relation hits/n; only
    the metrics the record measured (edit.json, 2026-12-02, predates `known_kept`)."""
    from .significance import fmt_p

    metrics = [k for k in METRICS if any(k in t for per in s["table"].values() for t in per.values())]
    head = "| method | steps | " + " | ".join(LABELS[k] for k in metrics) + " |"
    other = s.get("known_other") or {}
    known_line = (" Known facts neither edited nor neighbours, per fact set (seed: n, share the base gets right): "
                  + ", ".join(f"{k}: {v['n']}, {v['kept_before']:.3f}" for k, v in other.items()) + "."
                  if other else "")
    lines = [f"Model: {s['known_facts']} of {s['world_facts']} world facts known (greedy; held-out countries "
             f"excluded) ({', '.join(f'{r} {n}' for r, n in s['known_by_relation'].items())}); before: val loss "
             f"{s['before']['val']:.4f}, held-out facts loss {s['before']['world']:.4f}. {s['n_facts']} "
             f"counterfactuals + {s['n_facts']} new entities per fact set; every cell mean ± sample sd over "
             f"n={_n_sets(s)} fact sets; every method run for a fixed number of steps.{known_line}", "",
             head, "|---" * (len(metrics) + 2) + "|"]
    for c, per in s["table"].items():
        for b, t in per.items():
            cells = []
            for k in metrics:
                if k not in t:
                    cells.append("")
                    continue
                x = t[k]
                cells.append(fmt_pm(x["mean"], x["std"], sign=True) if k.endswith("_change")
                             else fmt_pm(x["mean"], x["std"], places=2))
            lines.append(f"| {c} | {b} | " + " | ".join(cells) + " |")
    tests = family_tests(s)
    if tests:
        lines += ["", f"Tests (the family fixed in advance: each fine-tuning at its default setting vs the edit, "
                      f"{len(tests)} comparisons; difference = method - edit ± se, paired t over fact sets, "
                      "Holm-adjusted p; a finding when Holm p < 0.05; otherwise the difference the test could have "
                      "detected at 80% power):", "",
                  "| steps | method | metric | difference | p | Holm p | verdict |", "|---|---|---|---|---|---|---|"]
        for t in tests:
            v = verdict(t, "fact set")
            d = fmt_pm(t["diff"], t["se"], sign=True)
            lines.append(f"| {t['budget']} | {t['b']} | {LABELS[t['metric']]} | {d} | "
                         f"{fmt_p(t['p'])} | {fmt_p(t['p_holm'])} | {v} |")
    if s.get("by_relation"):
        rels = list(s["known_by_relation"])
        lines += ["", f"Counterfactuals by relation, pooled over the {_n_sets(s)} fact sets: efficacy hits/n, "
                      "specificity hits/n (each method's default setting).", "",
                  "| method | steps | " + " | ".join(rels) + " |", "|---" * (len(rels) + 2) + "|"]
        for c in ["engram-edit", *s["defaults"].values()]:
            for b, cell in s["by_relation"].get(c, {}).items():
                lines.append(f"| {c} | {b} | " + " | ".join(
                    f"{cell[r]['efficacy_hits']}/{cell[r]['efficacy_n']}, "
                    f"{cell[r]['specificity_hits']}/{cell[r]['specificity_n']}" if r in cell else "" for r in rels)
                    + " |")
    return "\n".join(lines) + "\n"


def _n_sets(s: dict) -> int:
    """The number of fact sets of record `s` (`seeds`: a count, or a replication's seeds per config)."""
    seeds = s["seeds"]
    return seeds if isinstance(seeds, int) else len(next(iter(seeds.values())))


def plot(s: dict, path: Path) -> None:
    """Two panels from every fact set: specificity vs counterfactual efficacy, and damage vs overall efficacy (known
    facts kept where the record measured them, else the held-out facts' loss); one line per config through its
    budgets (mean ± sd over fact sets), small dots per fact set."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = {"engram-edit": "tab:blue", "ft": "tab:red", "ft+kl": "tab:green", "lora": "tab:purple"}
    styles = ["-", "--", ":"]
    seen: dict[str, int] = {}
    damage = "known_kept" if all("known_kept" in r for r in s["runs"]) else "world_change"
    for c, cfg in s["configs"].items():
        k = seen[cfg["method"]] = seen.get(cfg["method"], -1) + 1
        for ax, (xk, yk) in zip(axes, [("efficacy_counterfactual", "specificity"), ("efficacy_all", damage)]):
            xs, ys, xe, ye = [], [], [], []
            for b in s["budgets"]:
                rs = [r for r in s["runs"] if r["config"] == c and r["budget"] == b]
                x, y = seed_stats([r[xk] for r in rs]), seed_stats([r[yk] for r in rs])
                xs.append(x["mean"]), ys.append(y["mean"]), xe.append(x["std"]), ye.append(y["std"])
                ax.scatter([r[xk] for r in rs], [r[yk] for r in rs], s=6, color=colors[cfg["method"]], alpha=0.3)
            ax.errorbar(xs, ys, xerr=xe, yerr=ye, fmt="o" + styles[k % 3], color=colors[cfg["method"]], capsize=2,
                        ms=4, lw=1, label=c)
            ax.annotate(f"{s['budgets'][-1]}", (xs[-1], ys[-1]), fontsize=6, xytext=(2, 2), textcoords="offset points")
    axes[0].set_xlabel("efficacy on counterfactuals (greedy)")
    axes[0].set_ylabel("specificity (neighbours kept)")
    axes[1].set_xlabel("efficacy on all edited facts (greedy)")
    axes[1].set_ylabel("known facts kept (neither edited nor neighbours)" if damage == "known_kept"
                       else "Δ loss on held-out countries' sentences")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(f"engram experiment edit: budgets {', '.join(map(str, s['budgets']))} steps "
                 f"(mean ± sd over {_n_sets(s)} fact sets; dots: each fact set)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _runs(design: dict, recs: dict):
    """`edit-replication`'s runs: the original's settings (`configs`) on new fact sets, edited on a base of the
    original's recipe by `replicate`."""
    from .records import original_record
    from .runs import ExperimentError

    rec = original_record(design, recs)

    def trainer(d, out, progress, jobs, max_steps):
        if max_steps is not None:
            raise ExperimentError(f"{d['experiment']}: --max-steps does not apply; the design fixes the step budgets")
        return replicate(rec, d, out, progress)

    return Runs(configs(), replication_table, trainer)


register(Experiment("edit", """
    counterfactuals and new entities written into the table rows of a model that learned world
    facts (`engram edit`) vs fine-tuning (with and without KL) and LoRA at fixed step budgets:
    efficacy, generalization, specificity, damage (`edit.py`).""",
                    run=lambda o: run(o.out, checkpoint=o.checkpoint, seeds=o.seeds, progress=o.progress,
                                      record=o.record),
                    table=markdown, plot=plot, plot_file="edit.png", replication=_runs, section="9"))
