"""`python -m engram_experiments.adapt_budget`: when does a memory pay for its size (issue 59). Adaptation of a real
pretrained model to a domain across data budgets (25.6k to 819k domain tokens), for the Engram adapter (default and
parameter-matched), LoRA, LoRA + Engram and full fine-tuning, with forgetting measured along training so that
methods compare at equal domain gain, not at equal steps.

Every choice is read from the preregistration `docs/prereg/adapt-budget.toml` (`prereg.load`); `check_design` refuses
a design this code cannot run, in one line. What is reused, not copied: the methods' `adapt` arguments
(`smollm2_adapt.METHODS`, retrofit's `LORA_ALL`, `matched_engram`), the base import (`smollm2_adapt.smollm2_base`:
any `gguf_bases.KNOWN` name), the shared-n-gram set (`retrofit.shared_windows`), grid extension
(`retrofit.extend_grid`), step times (`retrofit.step_ms`), the 2-D Pareto front (`retrofit.pareto`), the test
(`significance.compare`, `holm`), one process per run (`runs.call_in_subprocess`, `run_parallel`).

The design's axes: `models` (a `gguf_bases.KNOWN` name, imported into OUT/adapt-budget/MODEL/base, or a saved
transformers folder), methods, `budgets` (domain tokens; steps = tokens / (seq_len x batch_size)), learning rates,
seeds. One *unit* (`Unit`) is one run: (model, method, budget, lr, seed), its folder
OUT/adapt-budget/MODEL/METHOD/bBUDGET/lrLR-seedSEED, trained in its own process (`run_unit`) and done when its
`unit.json` exists (reruns skip it; a stopped one resumes from its last path point).

*The path* (`run_unit`): each run is trained in segments that end at its path steps (`path_steps`: every
ceil(steps / evals) steps and the last), each segment `training.adapt.adapt(..., stop_after=...)` resumed from the
checkpoint the one before left; at each path step the checkpoint is loaded (`adapt.build(resume=True)` +
`checkpoint.load_checkpoint`) and evaluated on the general and the shared set, the domain's val loss read from the
run's own metrics.jsonl at that step. Step 0 is the base (every method starts exactly at it: a zero-initialized
adapter, LoRA's B = 0). Why segments and not an evaluation inside the training loop: `training.run.loop` evaluates the
run's own val set only; and keeping every checkpoint to evaluate afterwards keeps a whole model and its optimizer
state per path point on disk (full fine-tuning), where a segment costs one model build more per path point and keeps
two checkpoints.

*Matched gain* (`at_gain`): a run's forgetting at domain gain g is linear in gain between the two path points that
bracket g at the path's first upward crossing of g; a run whose path never reaches g contributes nothing there, and
the record says so (the matched-gain table's `reached` of `of`; a test row's `left_out` seeds and `why`).

Phases: `pilot` (exploratory: the selection seed's grids at `selection.budgets`, extended while an end holds the best
domain loss; the spread seeds of [power] at its budget; the power plan) and `test` (the same selection, reused, then
every budget x test seed x method at the chosen learning rate; nothing is tested until every test unit is done, the
preregistered stop rule). `--jobs`, `--max-units`, `--only` run a slice; `--dry-run` prints the units and the cost
estimate (step times measured by a short timing run per model and method, or `--estimate-from` a smollm2-adapt
record) and runs nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import gc
import io
import math
import statistics
import time
from pathlib import Path

import numpy as np

from engram.persist import atomic_write_bytes, remove_tree, write_json

from .records import fmt_pm
from .registry import Experiment, register
from .retrofit import COLORS, LORA_ALL, extend_grid, pareto, say, step_ms
from .runs import (
    ExperimentError,
    call_in_subprocess,
    detectable,
    index_environments,
    read_result,
    run_cli,
    run_parallel,
    seed_stats,
    verdict,
)
from .smollm2_adapt import METHODS as SMOLLM2_METHODS
from .smollm2_adapt import method_args

NAME = "adapt-budget"
METHODS = {**SMOLLM2_METHODS, "lora+engram": {**LORA_ALL, "method": "lora+engram"}}  # name -> adapt() arguments
MEASURES = ("domain_val", "forgetting_general", "forgetting_shared")
AT_GAIN = {"forgetting_general_at_gain": "forgetting_general", "forgetting_shared_at_gain": "forgetting_shared"}
TIMING_STEPS = 10  # the timing run per (model, method): step_ms is the median of its steps after the fifth
UNIT = "engram_experiments.adapt_budget:run_unit"  # what a unit's process runs (by module name, not __main__)
SETUP = "engram_experiments.adapt_budget:setup_model"


# ------------------------------------------------------------------------------------------ the design
def tokens_per_step(train: dict) -> int:
    return int(train["seq_len"]) * int(train["batch_size"])


def steps_of(budget: int, train: dict) -> int:
    """Optimizer steps of a budget of `budget` domain tokens (a multiple of seq_len x batch_size, else one line)."""
    per = tokens_per_step(train)
    if budget % per or budget <= 0:
        raise ExperimentError(f"budget {budget} tokens is not a positive multiple of seq_len x batch_size = {per}; "
                              f"give budgets in whole steps (e.g. {max(1, round(budget / per)) * per})")
    return budget // per


def path_steps(steps: int, evals: int) -> list[int]:
    """The steps at which a run of `steps` is evaluated along its path: every ceil(steps / evals) and the last."""
    if steps < 1 or evals < 1:
        raise ExperimentError(f"path of {steps} steps with {evals} evaluations: both must be at least 1")
    k = math.ceil(steps / evals)
    return list(range(k, steps, k)) + [steps]


def check_design(d: dict) -> None:
    """One line naming what the code cannot run: unknown methods, budgets not in whole steps or not increasing,
    selection/test budgets outside `budgets`, tested budgets without a selection grid, test seeds that include the
    selection or spread seeds, pairs or metrics it does not know."""
    for key in ("models", "domain", "general", "shared_pool", "budgets", "train", "methods", "selection", "test"):
        if key not in d:
            raise ExperimentError(f"docs/prereg/{NAME}.toml has no {key!r}; see the committed draft for its shape")
    unknown = set(d["methods"]) - set(METHODS)
    if unknown:
        raise ExperimentError(f"methods {sorted(unknown)} are not known to {NAME}; choose from {', '.join(METHODS)}")
    budgets = list(d["budgets"])
    if budgets != sorted(set(budgets)):
        raise ExperimentError(f"budgets {budgets} must be distinct and increasing")
    for b in budgets:
        steps_of(b, d["train"])
    sel, test = d["selection"], d["test"]
    for what, bs in (("selection.budgets", sel["budgets"]), ("test.budgets", test["budgets"])):
        if set(bs) - set(budgets):
            raise ExperimentError(f"{what} {sorted(set(bs) - set(budgets))} are not in budgets {budgets}")
    if set(test["budgets"]) - set(sel["budgets"]):
        raise ExperimentError(f"test.budgets {sorted(set(test['budgets']) - set(sel['budgets']))} have no selection "
                              "grid: a tested budget needs its own selection-seed runs (add it to selection.budgets)")
    spread = list(d.get("power", {}).get("seeds", []))
    clash = set(test["seeds"]) & ({sel["seed"]} | set(spread))
    if clash:
        raise ExperimentError(f"test seeds {sorted(clash)} are also selection or spread seeds (the pilot looks at "
                              "those); give the test other seeds")
    for a, b in test["pairs"]:
        if a not in d["methods"] or b not in d["methods"]:
            raise ExperimentError(f"test pair ({a}, {b}) names a method the design does not train")
    bad = set(test["metrics"]) - {"domain_val", *AT_GAIN}
    if bad:
        raise ExperimentError(f"test metrics {sorted(bad)} unknown; use domain_val, {', '.join(AT_GAIN)}")
    if d.get("power") and d["power"].get("budget") not in sel["budgets"]:
        raise ExperimentError(f"power.budget {d['power'].get('budget')} must be one of selection.budgets")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One run of the design: `lr` None while the selection has not chosen it (a dry run's test units)."""

    model: str
    method: str
    budget: int
    lr: float | None
    seed: int

    @property
    def name(self) -> str:
        lr = "?" if self.lr is None else f"{self.lr:g}"
        return f"{model_key(self.model)}/{self.method}/b{self.budget}/lr{lr}-seed{self.seed}"

    def dir(self, root: Path) -> Path:
        return Path(root) / self.name


def model_key(model: str) -> str:
    """The folder name of a model axis value: a gguf_bases name as is, a saved folder by its name."""
    return Path(model).name if ("/" in model or Path(model).is_dir()) else model


def interpolated_lr(chosen: dict[int, float], budget: int) -> float:
    """The learning rate of a budget without a selection grid: log-linear in log budget between the chosen rates of
    the neighbouring selection budgets (`chosen` {budget: lr}), 3 significant digits; the nearest one's outside."""
    bs = sorted(chosen)
    if budget in chosen:
        return chosen[budget]
    if budget < bs[0] or budget > bs[-1]:
        return chosen[bs[0] if budget < bs[0] else bs[-1]]
    lo = max(b for b in bs if b < budget)
    hi = min(b for b in bs if b > budget)
    w = (math.log(budget) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return float(f"{math.exp(math.log(chosen[lo]) + w * (math.log(chosen[hi]) - math.log(chosen[lo]))):.3g}")


def test_units(d: dict, chosen: dict | None) -> list[Unit]:
    """Every budget x test seed x method at the chosen learning rate (`chosen[(model, method)]` {selection budget: lr},
    interpolated between; None: lr unknown, a dry run), ordered model, budget, seed, method: a stopped test holds
    whole low budgets first (the stop rule)."""
    return [Unit(m, meth, b, None if chosen is None else interpolated_lr(chosen[(m, meth)], b), s)
            for m in d["models"] for b in d["budgets"] for s in d["test"]["seeds"] for meth in d["methods"]]


def spread_units(d: dict, chosen: dict | None) -> list[Unit]:
    """The pilot's spread seeds ([power]): each method at its chosen lr at the power budget."""
    p = d.get("power") or {}
    if not p.get("seeds"):
        return []
    b = p["budget"]
    return [Unit(m, meth, b, None if chosen is None else chosen[(m, meth)][b], s)
            for m in d["models"] for s in p["seeds"] for meth in d["methods"]]


# ------------------------------------------------------------------------------------------ the path
def at_gain(path: list[dict], level: float, key: str) -> float | None:
    """`key` (e.g. "forgetting_general") of a run's `path` (points with "gain", in step order) at domain gain
    `level`: at the first point whose gain equals it, or linear in gain between the two consecutive points that
    bracket it at the path's first upward crossing; None when the path never reaches it."""
    for i, p in enumerate(path):
        if p["gain"] == level:
            return float(p[key])
        if i + 1 < len(path) and p["gain"] < level < path[i + 1]["gain"]:
            q = path[i + 1]
            w = (level - p["gain"]) / (q["gain"] - p["gain"])
            return float(p[key] + w * (q[key] - p[key]))
    return None


def dominated(points: list[dict], keys=MEASURES) -> list[bool]:
    """For each point: is another point at least as low on every key of `keys` and lower on one (lower is better)?"""
    def beats(q, p):
        return all(q[k] <= p[k] for k in keys) and any(q[k] < p[k] for k in keys)
    return [any(beats(q, p) for q in points if q is not p) for p in points]


def fronts(runs: list[dict], methods, forgetting: str) -> dict[str, list[dict]]:
    """{method: its Pareto front} of domain gain (higher is better) against `forgetting` ("forgetting_general" /
    "forgetting_shared", lower is better) over every path point of its `runs` (every lr, budget and seed given),
    sorted by forgetting; each point names its run (budget, lr, seed) and step. `retrofit.pareto` on (forgetting,
    -gain)."""
    out = {}
    for m in methods:
        pts = {(p["gain"], p[forgetting]): {"forgetting": p[forgetting], "domain_val": -p["gain"], "gain": p["gain"],
                                            "step": p["step"], "budget": r["budget"], "lr": r["lr"], "seed": r["seed"]}
               for r in reversed([r for r in runs if r["method"] == m]) for p in reversed(r["path"])}
        pts = list(pts.values())  # each (gain, forgetting) once, as its first run's (every step 0 is the base)
        out[m] = [{k: pts[i][k] for k in ("gain", "forgetting", "step", "budget", "lr", "seed")} for i in pareto(pts)]
    return out


# ------------------------------------------------------------------------------------------ one model's setup
def base_folder(root: Path, model: str, progress: bool) -> Path:
    """The model's transformers folder: a saved one as given, a gguf_bases name fetched and imported once."""
    if Path(model).is_dir():
        return Path(model)
    from .smollm2_adapt import smollm2_base

    return smollm2_base(root / model_key(model), model, progress, label=NAME)


def train_settings(train: dict) -> dict:
    """The TrainConfig fields every run shares (seq_len, batch, decay, eval windows, min_lr_ratio)."""
    return {k: train[k] for k in ("seq_len", "batch_size", "weight_decay", "eval_max_windows", "min_lr_ratio")}


def setup_model(root: str, model: str, design: dict, progress: bool = True) -> dict:
    """ROOT/MODEL/setup.json (once; its own process in the driver): the base folder and its GGUF source
    (quantization), the domain's train tokens (every budget must fit in one pass), the base's val loss on the domain,
    the general and the shared set (`before`), the shared set's windows (shared.npy) and the methods' arguments."""
    import torch

    from engram.inference import load_base
    from engram.integrations.gguf_bases import base_info
    from engram.training.adapt import evaluate_on
    from engram.training.config import TrainConfig
    from engram.training.data import load_manifest, prepare
    from engram.training.run import evaluate

    from .retrofit import shared_windows

    folder = Path(root) / model_key(model)
    f = folder / "setup.json"
    if f.is_file():
        return read_result(f, f"{NAME} setup")
    base = base_folder(Path(root), model, progress)
    tr = design["train"]
    tcfg = TrainConfig(**{**TrainConfig().to_dict(), **train_settings(tr),
                          "tokenizer": str((base / "tokenizer.json").resolve())})
    train_tokens = load_manifest(prepare(design["domain"], tcfg.tokenizer, progress=False))["splits"]["train"]["tokens"]
    if design["budgets"][-1] > train_tokens:
        raise ExperimentError(f"{model}: the domain {design['domain']} has {train_tokens:,} train tokens with this "
                              f"base's tokenizer, fewer than the largest budget {design['budgets'][-1]:,}: the run "
                              "would see windows twice; lower the budget or add domain text")
    shared, info = shared_windows(tcfg.tokenizer, design["domain"], design["shared_pool"], tcfg.seq_len,
                                  design["shared_windows"])
    buf = io.BytesIO()
    np.save(buf, shared)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / "shared.npy", buf.getvalue())
    say(progress, f"[{NAME}] {model}: the base's val loss on the domain, the general and the shared set")
    m, _ = load_base(base)
    m.eval()
    before = {"domain": evaluate_on(m, design["domain"], tcfg), "general": evaluate_on(m, design["general"], tcfg),
              "shared": evaluate(m, shared, tcfg.batch_size, torch.device("cpu"))}
    del m
    out = {"model": model, "base": str(base.resolve()), "base_info": base_info(base), "train_tokens": train_tokens,
           "before": before, "shared_set": info, "methods": method_args(base, design["methods"], tr["layers"],
                                                                        METHODS)}
    write_json(f, out)
    return out


# ------------------------------------------------------------------------------------------ one unit
def _checkpoint_steps(run_dir: Path) -> dict[int, Path]:
    from engram.training.checkpoint import checkpoints

    return {int(p.name.removeprefix("step_")): p for p in checkpoints(run_dir)}


def _overrides(train: dict, steps: int, lr: float, seed: int) -> dict:
    k = path_steps(steps, train["evals"])[0]
    return {**train_settings(train), "warmup_steps": max(1, round(train["warmup_fraction"] * steps)), "lr": lr,
            "seed": seed, "eval_every": k, "ckpt_every": k, "keep_checkpoints": 2}


def _point(run_dir: Path, kw: dict, step: int, ck: Path, general: list[str], shared: np.ndarray, before: dict) -> dict:
    """The path point at `step`: the checkpoint `ck` loaded into the run's model and evaluated on the general and
    the shared set; the domain's val loss from metrics.jsonl (the loop evaluated it at this step)."""
    import torch

    from engram.training.adapt import build, evaluate_on
    from engram.training.checkpoint import load_checkpoint
    from engram.training.run import evaluate, read_metrics

    dom = [r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] == step and "val_loss" in r]
    if not dom:
        raise ExperimentError(f"{run_dir}/metrics.jsonl has no val_loss at step {step}; delete {run_dir} and run again")
    run = build(**kw, resume=True)
    load_checkpoint(ck, run.model, run.opts, run.ddp, only_trainable=run.only_trainable)
    model = run.model.eval()
    general_val = evaluate_on(model, general, run.tcfg)
    shared_val = evaluate(model, shared, run.tcfg.batch_size, torch.device("cpu"))
    del model, run
    gc.collect()  # (a run holds itself through its write_final closure: free the model before the next segment's)
    return {"step": step, "domain_val": dom[-1], "general_val": general_val, "shared_val": shared_val,
            "gain": before["domain"] - dom[-1], "forgetting_general": general_val - before["general"],
            "forgetting_shared": shared_val - before["shared"]}


def run_unit(root: str, model: str, method: str, budget: int, lr: float, seed: int, design: dict,
             progress: bool = False, under: str = "") -> dict:
    """Train and measure one unit (resumable), writing UNIT_DIR/unit.json: its path from step 0 (the base) through
    every path step, the run's step time, peak RSS, trainable counts and environment, and how long it took. A run whose
    loss turns non-finite is recorded as diverged (its path up to there); `train.keep_models` false: its checkpoints
    and final model are deleted once the record is written (the experiment reads the path only). `under`: a subfolder
    of ROOT for the unit's folder (the timing runs')."""
    from engram.training.adapt import adapt
    from engram.training.run import read_metrics, read_run_file

    u = Unit(model, method, int(budget), float(lr), int(seed))
    root = Path(root)
    run_dir = u.dir(root / under)
    done = run_dir / "unit.json"
    if done.is_file():
        return read_result(done, f"{NAME} unit")
    setup = read_result(root / model_key(model) / "setup.json", f"{NAME} setup")
    shared = np.load(root / model_key(model) / "shared.npy")
    tr, before = design["train"], setup["before"]
    steps = steps_of(u.budget, tr)
    kw = dict(base=setup["base"], data=design["domain"], out=str(run_dir), max_steps=steps,
              overrides=_overrides(tr, steps, u.lr, u.seed), progress=False, **setup["methods"][method])
    path_file = run_dir / "path.json"
    path = read_result(path_file, f"{NAME} path", run_dir, list) if path_file.is_file() else []
    diverged = None
    try:
        for target in path_steps(steps, tr["evals"]):
            if any(p["step"] == target for p in path):
                continue
            t0 = time.perf_counter()
            have = _checkpoint_steps(run_dir)
            if target not in have:
                if have and max(have) > target:
                    raise ExperimentError(f"{run_dir} holds a checkpoint past step {target} without its path point; "
                                          f"delete {run_dir} and run again")
                say(progress, f"[{NAME}] {u.name}: training to step {target} of {steps}")
                out = adapt(**kw, resume=bool(have), stop_after=None if target == steps else target)
                gc.collect()  # the segment's model, before the point's own is built
                if out.get("step") != target:  # Ctrl-C: the run checkpointed; the same command resumes it
                    raise KeyboardInterrupt
                have = _checkpoint_steps(run_dir)
            point = _point(run_dir, kw, target, have[target], design["general"], shared, before)
            path.append({**point, "seconds": time.perf_counter() - t0})  # training to it, then measuring it
            write_json(path_file, path)
    except FloatingPointError as e:
        diverged = str(e)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    start = next((r["val_loss"] for r in metrics if r["step"] == 0 and "val_loss" in r), before["domain"])
    zero = {"step": 0, "domain_val": start, "gain": 0.0, "forgetting_general": 0.0, "forgetting_shared": 0.0,
            "measured": "domain only (the model at step 0 is the base)"}
    summary = read_run_file(run_dir, "summary.json") if diverged is None else {}
    end = path[-1] if path and diverged is None else {}
    rec = {**dataclasses.asdict(u), "steps": steps, "tokens": u.budget, "path": [zero, *path],
           **{k: end.get(k) for k in ("domain_val", "gain", "forgetting_general", "forgetting_shared")},
           "diverged": diverged,
           "step_ms": step_ms(run_dir, tokens_per_step(tr)) if any(r.get("tok_s") for r in metrics) else None,
           "seconds": sum(p["seconds"] for p in path), "peak_rss_mib": summary.get("peak_rss_mib"),
           "trainable": summary.get("trainable"), "environment": summary.get("environment")}
    write_json(done, rec)
    if not design["train"].get("keep_models", False):
        remove_tree(run_dir / "checkpoints")
        remove_tree(run_dir / "final")
    return rec


def read_unit(root: Path, u: Unit, under: str = "") -> dict | None:
    """The finished unit's record, None when it has not finished."""
    f = u.dir(Path(root) / under) / "unit.json"
    return read_result(f, f"{NAME} unit", u.dir(Path(root) / under)) if f.is_file() else None


def _loss(r: dict) -> float:
    """A unit's final domain val loss for the selection (a diverged run: +inf, never chosen)."""
    return math.inf if r["domain_val"] is None else r["domain_val"]


# ------------------------------------------------------------------------------------------ cost
TIMING = "timing"  # ROOT/timing/...: one short run per (model, method), its step time and cost per path point


def timing_unit(d: dict, model: str, method: str) -> Unit:
    """The timing run of (model, method): TIMING_STEPS steps at the grid's middle learning rate, 2 path points."""
    lrs = sorted(d["methods"][method])
    return Unit(model, method, TIMING_STEPS * tokens_per_step(d["train"]), lrs[len(lrs) // 2], d["selection"]["seed"])


def measured_costs(root: Path, d: dict) -> dict[tuple[str, str], dict]:
    """{(model, method): {"step_s", "point_s", "source"}} from the finished timing runs: seconds per step (median after
    the fifth) and per path point beyond its steps (the segment's restart, the model build, the evaluation)."""
    out = {}
    for m in d["models"]:
        for meth in d["methods"]:
            r = read_unit(root, timing_unit(d, m, meth), TIMING)
            if r and r["step_ms"]:
                s = r["step_ms"] / 1e3
                pts = r["path"][1:]
                over = (r["seconds"] - r["steps"] * s) / len(pts)
                out[(model_key(m), meth)] = {"step_s": s, "point_s": max(0.0, over), "source": "timing run"}
    return out


def record_costs(record: Path, d: dict, scale: dict[str, float]) -> dict[tuple[str, str], dict]:
    """Costs from a smollm2-adapt record (its test seeds' mean step time per method; a method it did not run: its
    slowest method's, an upper bound) for its base, and for each model of `scale` times `scale[model]`. A path point
    costs its forward passes: 3 sets x eval_max_windows windows, one window's forward taken as a third of a step's
    per window (restarts not counted)."""
    rec = read_result(Path(record), "smollm2-adapt record")
    steps = {m: c["step_ms"]["mean"] / 1e3 for m, c in rec["chosen"].items()}
    tr = d["train"]
    per_point = 3 * tr["eval_max_windows"] / (3 * tr["batch_size"])  # steps' worth of forward passes
    out = {}
    for model, k in [(rec["design"]["base"], 1.0), *scale.items()]:
        for meth in d["methods"]:
            s = steps.get(meth, max(steps.values())) * k
            src = f"{Path(record).name}" + (f" x {k:g}" if k != 1 else "") + ("" if meth in steps else " (slowest)")
            out[(model_key(model), meth)] = {"step_s": s, "point_s": per_point * s, "source": src}
    return out


def estimate(units: list[Unit], train: dict, costs: dict) -> dict:
    """Seconds of one core for `units` ({"seconds", "steps", "units", "unmeasured": units without a cost})."""
    out = {"seconds": 0.0, "steps": 0, "units": len(units), "unmeasured": 0}
    for u in units:
        steps = steps_of(u.budget, train)
        c = costs.get((model_key(u.model), u.method))
        out["steps"] += steps
        if c is None:
            out["unmeasured"] += 1
        else:
            out["seconds"] += steps * c["step_s"] + len(path_steps(steps, train["evals"])) * c["point_s"]
    return out


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def estimate_line(what: str, units: list[Unit], train: dict, costs: dict, jobs: int) -> str:
    """"selection: 24 units, 31,000 steps, 30.2 h of one core (15.1 h at --jobs 2)" (+ unmeasured ones)."""
    e = estimate(units, train, costs)
    line = (f"{what}: {e['units']} units, {e['steps']:,} steps, {hours(e['seconds'])} of one core "
            f"({hours(e['seconds'] / max(1, jobs))} at --jobs {jobs})")
    return line + (f"; {e['unmeasured']} units without a measured step time" if e["unmeasured"] else "")


# ------------------------------------------------------------------------------------------ the driver
class Driver:
    """Runs units, each in its own process (`run_unit` through `runs.call_in_subprocess`), `jobs` at once, skipping
    finished ones; `only` (glob patterns on unit names) and `max_units` (per command) run a slice; `dry_run` runs
    nothing. Prints the cost estimate of what it is about to run first."""

    def __init__(self, root: Path, d: dict, jobs: int = 1, only: list[str] | None = None,
                 max_units: int | None = None, dry_run: bool = False, costs: dict | None = None,
                 progress: bool = True):
        self.root, self.d, self.jobs, self.only, self.max_units = root, d, max(1, jobs), only, max_units
        self.dry_run, self.costs, self.progress, self.started = dry_run, costs or {}, progress, 0

    def done(self, u: Unit, under: str = "") -> bool:
        return (u.dir(self.root / under) / "unit.json").is_file()

    def _one(self, job: tuple[Unit, str]) -> None:
        u, under = job
        run_dir = u.dir(self.root / under)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        call_in_subprocess(UNIT, {"root": str(self.root), **dataclasses.asdict(u), "design": self.d,
                                  "under": under}, run_dir.with_name(run_dir.name + ".log"),
                           f"{NAME} unit {u.name}", self.jobs)

    def run(self, units: list[Unit], what: str, under: str = "", sliced: bool = True) -> bool:
        """Run `units` not done yet (`sliced`: through --only / --max-units); True when all of them are done."""
        todo = [u for u in units if not self.done(u, under)]
        if sliced and self.only:
            todo = [u for u in todo if any(fnmatch.fnmatch(u.name, p) for p in self.only)]
        if sliced and self.max_units is not None:
            todo = todo[:max(0, self.max_units - self.started)]
        if todo:
            say(self.progress, f"[{NAME}] {estimate_line(what, todo, self.d['train'], self.costs, self.jobs)}")
            if self.dry_run:
                for u in todo:
                    say(self.progress, f"  {u.name} ({steps_of(u.budget, self.d['train'])} steps)")
                return False
            run_parallel(self._one, [(u, under) for u in todo], self.jobs)
            self.started += len(todo) if sliced else 0
        return all(self.done(u, under) for u in units)


def select(driver: Driver, d: dict) -> tuple[dict, dict, dict, bool]:
    """The selection seed's grids at each selection budget, extended by `retrofit.extend_grid` while the lowest final
    domain loss sits at an end (at most `selection.extend` times per end): (chosen {(model, method): {budget: lr}},
    grids {(model, method, budget): lrs}, extended {cell: {"up"/"down": k}}, complete)."""
    sel = d["selection"]
    grids = {(m, meth, b): sorted(d["methods"][meth]) for m in d["models"] for meth in d["methods"]
             for b in sel["budgets"]}
    extended: dict = {c: {} for c in grids}
    pending = list(grids)
    while pending:
        units = [Unit(m, meth, b, lr, sel["seed"]) for (m, meth, b) in pending for lr in grids[(m, meth, b)]]
        if not driver.run(units, "selection seed"):
            return {}, grids, extended, False
        nxt = {}
        for c in pending:
            losses = {lr: _loss(read_unit(driver.root, Unit(*c, lr, sel["seed"]))) for lr in grids[c]}
            nxt[c] = extend_grid(grids[c], losses, extended[c], limit=sel["extend"])
        pending = [c for c in pending if nxt[c] is not None]
        for c in pending:
            grids[c] = sorted(grids[c] + [nxt[c]])
    chosen: dict = {}
    for (m, meth, b), lrs in grids.items():
        losses = {lr: _loss(read_unit(driver.root, Unit(m, meth, b, lr, sel["seed"]))) for lr in lrs}
        chosen.setdefault((m, meth), {})[b] = min(lrs, key=losses.get)
    return chosen, grids, extended, True


# ------------------------------------------------------------------------------------------ the analysis
def matched_levels(d: dict, selection: list[dict], chosen: dict, budgets) -> dict:
    """{(model, budget, a, b): the largest of selection.gain_levels that both methods' selection-seed runs at their
    chosen lr reach along their paths (None: not one)}: the gain at which a pair's forgetting is tested, chosen on the
    selection seed."""
    out = {}
    levels = sorted(d["selection"]["gain_levels"])
    for m in d["models"]:
        for b in budgets:
            for a, c in d["test"]["pairs"]:
                reach = []
                for meth in (a, c):
                    r = next(r for r in selection if (r["model"], r["method"], r["budget"], r["lr"])
                             == (m, meth, b, chosen[(m, meth)][b]))
                    reach.append(max(p["gain"] for p in r["path"]))
                ok = [g for g in levels if g <= min(reach)]
                out[(m, b, a, c)] = ok[-1] if ok else None
    return out


def _values(runs: list[dict], metric: str, level: float | None) -> dict[int, float]:
    """{seed: value} of `metric` over `runs`: final domain val loss, or forgetting at gain `level` (runs that never
    reach it, or diverged, are left out)."""
    out = {}
    for r in runs:
        if metric == "domain_val":
            v = r["domain_val"]
        else:
            v = None if level is None or r["diverged"] else at_gain(r["path"], level, AT_GAIN[metric])
        if v is not None:
            out[r["seed"]] = v
    return out


def family(d: dict, runs: list[dict], chosen: dict, levels: dict) -> list[dict]:
    """The preregistered family: per model, tested budget, pair (a, b) and metric, b - a paired by test seed
    (`significance.compare`); forgetting at the pair's matched gain level. A comparison with fewer than 2 values a
    side (runs that never reach the level, diverged ones) is kept in the family with p = 1 and says why. Holm over
    the whole family; a finding at adjusted p < alpha."""
    from .significance import compare, holm, is_finding

    seeds = set(d["test"]["seeds"])
    out = []
    for m in d["models"]:
        for b in d["test"]["budgets"]:
            for a, c in d["test"]["pairs"]:
                side = {meth: sorted((r for r in runs if (r["model"], r["method"], r["budget"]) == (m, meth, b)
                                      and r["seed"] in seeds), key=lambda r: r["seed"]) for meth in (a, c)}
                for metric in d["test"]["metrics"]:
                    level = None if metric == "domain_val" else levels[(m, b, a, c)]
                    va, vc = _values(side[a], metric, level), _values(side[c], metric, level)
                    row = {"model": m, "budget": b, "a": a, "b": c, "lr_a": interpolated_lr(chosen[(m, a)], b),
                           "lr_b": interpolated_lr(chosen[(m, c)], b), "metric": metric, "level": level,
                           "seeds_a": sorted(va), "seeds_b": sorted(vc),
                           "left_out": sorted({r["seed"] for r in side[a] + side[c]} - (set(va) & set(vc)))}
                    if len(va) >= 2 and len(vc) >= 2:
                        t = compare([va[s] for s in sorted(va)], [vc[s] for s in sorted(vc)], sorted(va), sorted(vc))
                        row.update(kind=t.kind, diff=t.diff, se=t.se, df=t.df, p=t.p, n=t.n_a,
                                   min_detectable=detectable(t))
                    else:
                        why = "no matched gain level" if metric != "domain_val" and level is None else \
                            "fewer than 2 test seeds reach the level on a side"
                        row.update(kind="not testable", diff=None, se=0.0, p=1.0, n=min(len(va), len(vc)),
                                   min_detectable=None, why=why)
                    out.append(row)
    for t, adj in zip(out, holm([t["p"] for t in out])):
        t["p_holm"], t["finding"] = adj, is_finding(adj, d["test"].get("alpha", 0.05))
    return out


def power_plan(d: dict, runs: list[dict], chosen: dict, levels: dict) -> list[dict]:
    """Per model, pair and tested metric at the power budget: the sd of b - a over the selection seed and the spread
    seeds (each method at its chosen lr), the test seeds a paired t needs for 80% power at the smallest effect of
    interest (`significance.n_for_power`), and the power of the preregistered number of test seeds."""
    from .significance import SignificanceError, n_for_power, paired_power

    p, eff = d["power"], d["test"]["smallest_effect_of_interest"]
    b, n_test = p["budget"], len(d["test"]["seeds"])
    seeds = [d["selection"]["seed"], *p["seeds"]]
    out = []
    for m in d["models"]:
        for a, c in d["test"]["pairs"]:
            side = {meth: [r for r in runs if (r["model"], r["method"], r["budget"], r["lr"])
                           == (m, meth, b, chosen[(m, meth)][b]) and r["seed"] in seeds] for meth in (a, c)}
            for metric in d["test"]["metrics"]:
                va = _values(side[a], metric, levels.get((m, b, a, c)))
                vc = _values(side[c], metric, levels.get((m, b, a, c)))
                both = sorted(set(va) & set(vc))
                row = {"model": m, "budget": b, "a": a, "b": c, "metric": metric, "seeds": both, "sd": None,
                       "n_needed": None, "power_at_n": None}
                if len(both) >= 2:
                    row["sd"] = statistics.stdev([vc[s] - va[s] for s in both])
                    if row["sd"] > 0:
                        try:
                            row["n_needed"] = n_for_power(eff, row["sd"])
                        except SignificanceError:
                            row["n_needed"] = "> 1000"
                        row["power_at_n"] = paired_power(eff, row["sd"], n_test)
                out.append(row)
    return out


def curve(d: dict, runs: list[dict], seeds) -> list[dict]:
    """The budget curve: per model, method and budget, the final domain val loss, gain and forgetting of the runs of
    `seeds` at the chosen lr (mean ± sd over seeds; diverged runs left out and counted)."""
    out = []
    for m in d["models"]:
        for meth in d["methods"]:
            for b in d["budgets"]:
                rs = sorted((r for r in runs if (r["model"], r["method"], r["budget"]) == (m, meth, b)
                             and r["seed"] in seeds), key=lambda r: r["seed"])
                ok = [r for r in rs if r["diverged"] is None]
                if not ok:
                    continue
                out.append({"model": m, "method": meth, "budget": b, "lr": sorted({r["lr"] for r in rs}),
                            "seeds": [r["seed"] for r in ok], "diverged": len(rs) - len(ok),
                            **{k: seed_stats([r[k] for r in ok]) for k in ("gain", *MEASURES)}})
    return out


def gain_table(d: dict, runs: list[dict], seeds) -> list[dict]:
    """Forgetting at each of selection.gain_levels: per model, budget and method (runs of `seeds` at the chosen lr),
    mean ± sd over the runs that reach the level and how many do."""
    out = []
    for c in curve(d, runs, seeds):
        rs = [r for r in runs if (r["model"], r["method"], r["budget"]) == (c["model"], c["method"], c["budget"])
              and r["seed"] in c["seeds"]]
        for g in d["selection"]["gain_levels"]:
            row = {"model": c["model"], "budget": c["budget"], "method": c["method"], "level": g,
                   "reached": 0, "of": len(rs)}
            for k in ("forgetting_general", "forgetting_shared"):
                vs = [v for v in (at_gain(r["path"], g, k) for r in rs) if v is not None]
                row["reached"] = len(vs)
                row[k] = seed_stats(vs) if vs else None
            out.append(row)
    return out


def summarize(root: Path, d: dict, phase: str, chosen: dict, grids: dict, extended: dict) -> dict:
    """Everything the record holds: the setups (bases, quantization, before), every selection run with its three
    measures and whether another point of its cell dominates it, the chosen lrs (interpolated between selection
    budgets), the matched gain levels, the budget curve, forgetting at the gain levels, the Pareto fronts per method,
    and per phase the power plan (pilot) or the family of tests (test)."""
    sel = d["selection"]
    setups = {model_key(m): read_result(root / model_key(m) / "setup.json", f"{NAME} setup") for m in d["models"]}
    selection = [read_unit(root, Unit(m, meth, b, lr, sel["seed"])) for (m, meth, b), lrs in grids.items()
                 for lr in lrs]
    for (m, b) in {(r["model"], r["budget"]) for r in selection}:
        cell = [r for r in selection if (r["model"], r["budget"]) == (m, b) and r["diverged"] is None]
        for r, dom in zip(cell, dominated(cell)):
            r["dominated"] = dom
    lrs = {f"{model_key(m)}/{meth}": {str(b): interpolated_lr(by_b, b) for b in d["budgets"]}
           for (m, meth), by_b in chosen.items()}
    levels = matched_levels(d, selection, chosen, sel["budgets"])
    out = {"experiment": NAME if phase == "test" else f"{NAME}-pilot", "date": datetime.date.today().isoformat(),
           "phase": phase, "design": d, "tokens_per_step": tokens_per_step(d["train"]), "setups": setups,
           "grids": {"/".join(map(str, c)): {"lrs": v, "extended": extended[c]} for c, v in grids.items()},
           "chosen_lr": lrs, "matched_gain": [{"model": k[0], "budget": k[1], "a": k[2], "b": k[3], "level": v}
                                              for k, v in levels.items()],
           "selection": selection}
    if phase == "pilot":
        spread = [read_unit(root, u) for u in spread_units(d, chosen)]
        runs = selection + spread
        out["spread"] = spread
        out["power"] = power_plan(d, runs, chosen, levels) if d.get("power") else []
        seeds = {sel["seed"]}
        runs = [r for r in selection if r["lr"] == chosen[(r["model"], r["method"])][r["budget"]]]
    else:
        runs = [read_unit(root, u) for u in test_units(d, chosen)]
        out["runs"] = runs
        out["tests"] = family(d, runs, chosen, levels)
        seeds = set(d["test"]["seeds"])
    out["curve"] = curve(d, runs, seeds)
    out["at_gain"] = gain_table(d, runs, seeds)
    pool = runs if phase == "test" else selection  # the pilot's fronts: every lr of the grids
    out["fronts"] = {model_key(m): {k: fronts([r for r in pool if r["model"] == m], d["methods"], k)
                                    for k in ("forgetting_general", "forgetting_shared")} for m in d["models"]}
    every = selection + out.get("spread", []) + out.get("runs", [])
    out["environments"] = index_environments(every)
    return out


# ------------------------------------------------------------------------------------------ the page
def fmt(s: dict | None, sign: bool = False) -> str:
    """A `seed_stats` as mean ± sd (n) with the digits its spread needs (`records.fmt_pm`); one value: 4 decimals;
    "-" for none."""
    if not s:
        return "-"
    if s["n"] < 2:
        return f"{s['mean']:{'+' if sign else ''}.4f}"
    return f"{fmt_pm(s['mean'], s['std'], sign=sign)} (n={s['n']})"


METRIC = {"domain_val": "domain val loss", "forgetting_general_at_gain": "forgetting (general) at matched gain",
          "forgetting_shared_at_gain": "forgetting (shared) at matched gain"}


def markdown(s: dict) -> str:
    """Per model: the base (its GGUF source and quantization), the selection (all three measures per lr, dominated
    points marked), the chosen lrs, the budget curve, forgetting at matched gain; the power plan or the tests."""
    from .significance import fmt_p

    d = s["design"]
    lines = [f"{s['experiment']} ({s['phase']}): {', '.join(d['methods'])} on {' + '.join(d['domain'])}; "
             f"{s['tokens_per_step']:,} tokens per step."]
    if s.get("prereg"):
        p = s["prereg"]
        lines.insert(0, f"Preregistration `{p['file']}` (blob {str(p['blob'])[:10]}, {p['status']}; "
                        f"run at commit {str(p['commit'])[:10]}).\n")
    for m in d["models"]:
        k = model_key(m)
        st = s["setups"][k]
        src = (st.get("base_info") or {}).get("source", "a saved folder")
        b = st["before"]
        lines += ["", f"### {k}", "", f"Base: {src}; domain train tokens {st['train_tokens']:,}; before: domain "
                  f"{b['domain']:.4f}, general {b['general']:.4f}, shared {b['shared']:.4f}.", "",
                  "Selection seed (final values; * dominated on all three measures within its budget):", "",
                  "| budget | method | lr | domain val | gain | forgetting (general) | forgetting (shared) |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted((r for r in s["selection"] if r["model"] == m),
                        key=lambda r: (r["budget"], list(d["methods"]).index(r["method"]), r["lr"])):
            if r["diverged"]:
                lines.append(f"| {r['budget']:,} | {r['method']} | {r['lr']:g} | diverged | | | |")
                continue
            mark = " *" if r.get("dominated") else ""
            lines.append(f"| {r['budget']:,} | {r['method']} | {r['lr']:g}{mark} | {r['domain_val']:.4f} | "
                         f"{r['gain']:+.4f} | {r['forgetting_general']:+.4f} | {r['forgetting_shared']:+.4f} |")
        lines += ["", "Budget curve (final values at the chosen lr):", "",
                  "| method | budget | lr | domain val | gain | forgetting (general) | forgetting (shared) |",
                  "|---|---|---|---|---|---|---|"]
        for c in (c for c in s["curve"] if c["model"] == m):
            lines.append(f"| {c['method']} | {c['budget']:,} | {', '.join(f'{x:g}' for x in c['lr'])} | "
                         f"{fmt(c['domain_val'])} | {fmt(c['gain'], True)} | {fmt(c['forgetting_general'], True)} | "
                         f"{fmt(c['forgetting_shared'], True)} |" + (f" ({c['diverged']} diverged)" if c['diverged']
                                                                      else ""))
        lines += ["", "Forgetting at matched domain gain (linear in gain on each run's path; reached: runs whose "
                      "path gets there):", "",
                  "| budget | method | gain | forgetting (general) | forgetting (shared) | reached |",
                  "|---|---|---|---|---|---|"]
        for g in (g for g in s["at_gain"] if g["model"] == m and g["reached"]):
            lines.append(f"| {g['budget']:,} | {g['method']} | {g['level']:g} | {fmt(g['forgetting_general'], True)} "
                         f"| {fmt(g['forgetting_shared'], True)} | {g['reached']}/{g['of']} |")
    if s.get("power"):
        lines += ["", f"Power plan (sd of b - a over seeds {s['power'][0]['seeds'] if s['power'] else ''} at the "
                      f"power budget; smallest effect {d['test']['smallest_effect_of_interest']} nats):", "",
                  "| model | A | B | metric | sd | seeds for 80% power | power at the test's seeds |",
                  "|---|---|---|---|---|---|---|"]
        for p in s["power"]:
            sd = "-" if p["sd"] is None else f"{p['sd']:.4f}"
            pw = "-" if p["power_at_n"] is None else f"{p['power_at_n']:.2f}"
            lines.append(f"| {model_key(p['model'])} | {p['a']} | {p['b']} | {METRIC[p['metric']]} | {sd} | "
                         f"{p['n_needed'] or '-'} | {pw} |")
    if s.get("tests"):
        lines += ["", f"Tests (family of {len(s['tests'])}: B - A paired by test seed, Holm; forgetting at the pair's "
                      "matched gain level, chosen on the selection seed):", "",
                  "| model | budget | A | B | metric | level | B - A | p | Holm p | verdict |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for t in s["tests"]:
            diff = "-" if t["diff"] is None else fmt_pm(t["diff"], t["se"], sign=True)
            v = t.get("why") or verdict(t)
            lvl = "-" if t["level"] is None else f"{t['level']:g}"
            lines.append(f"| {model_key(t['model'])} | {t['budget']:,} | {t['a']} | {t['b']} | {METRIC[t['metric']]} "
                         f"| {lvl} | {diff} | {fmt_p(t['p'])} | {fmt_p(t['p_holm'])} | {v} |")
    return "\n".join(lines) + "\n"


def plot(s: dict, path: Path) -> None:
    """Per model (rows): the budget curve (final domain val loss against domain tokens, log axis) and each method's
    Pareto front of domain gain against forgetting on the general and on the shared set."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    d = s["design"]
    fig, axes = plt.subplots(len(d["models"]), 3, figsize=(15, 4.2 * len(d["models"])), squeeze=False)
    for row, m in zip(axes, d["models"]):
        k = model_key(m)
        for meth in d["methods"]:
            cs = [c for c in s["curve"] if c["model"] == m and c["method"] == meth]
            if cs:
                row[0].errorbar([c["budget"] for c in cs], [c["domain_val"]["mean"] for c in cs],
                                yerr=[c["domain_val"]["std"] for c in cs], fmt="o-", capsize=3, color=COLORS.get(meth),
                                label=meth)
            for ax, key in ((row[1], "forgetting_general"), (row[2], "forgetting_shared")):
                f = s["fronts"][k][key][meth]
                if f:
                    ax.plot([p["gain"] for p in f], [p["forgetting"] for p in f], "o-", ms=3, color=COLORS.get(meth),
                            label=meth)
        row[0].set_xscale("log")
        row[0].set_xlabel("domain tokens")
        row[0].set_ylabel(f"{k}: domain val loss (final)")
        for ax, key in ((row[1], "general"), (row[2], "shared-n-gram")):
            ax.set_xlabel("domain gain (nats): val loss before - along training")
            ax.set_ylabel(f"forgetting on the {key} set (nats)")
        for ax in row:
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.suptitle(f"{s['experiment']}: budget curve and Pareto fronts per method (every path point)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------------ the command
def _scales(items: list[str], ap) -> dict[str, float]:
    out = {}
    for it in items:
        name, _, x = it.partition("=")
        try:
            out[name] = float(x)
        except ValueError:
            ap.error(f"--estimate-scale {it!r}: give MODEL=FACTOR, e.g. gemma-3-270m=2")
    return out


def main(argv: list[str] | None = None) -> dict:
    """Run a phase (its units not yet done, each in its own process), then publish its summary; the test phase
    summarizes nothing until every test unit is done (the stop rule)."""
    import argparse

    from . import prereg
    from .runs import publish

    ap = argparse.ArgumentParser(prog="python -m engram_experiments.adapt_budget",
                                 description="adaptation across data budgets, forgetting at equal gain (issue 59)")
    ap.add_argument("phase", choices=["pilot", "test"], help="pilot: the selection seed and the spread seeds "
                    "(exploratory); test: the selection (reused) then every budget on the test seeds")
    ap.add_argument("--out", default="runs/experiments", help="units go under OUT/adapt-budget/MODEL/...")
    ap.add_argument("--jobs", type=int, default=1, help="units trained at once (one process each)")
    ap.add_argument("--only", nargs="+", metavar="GLOB", help="run only units whose name matches, e.g. "
                    "'smollm2-135m-instruct/engram/*'")
    ap.add_argument("--max-units", type=int, help="run at most this many units in this command")
    ap.add_argument("--dry-run", action="store_true", help="print the units and the cost estimate; run nothing")
    ap.add_argument("--estimate-from", metavar="RECORD", help="step times from a smollm2-adapt record instead of "
                    "timing runs (e.g. docs/results/smollm2-adapt.json)")
    ap.add_argument("--estimate-scale", nargs="*", default=[], metavar="MODEL=FACTOR",
                    help="with --estimate-from: a model the record did not run, at FACTOR x its step times")
    ap.add_argument("--summary-only", action="store_true", help="summarize the finished units, run nothing")
    ap.add_argument("--record", help="also write the summary to RECORD/adapt-budget[-pilot].json")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.max_units is not None and a.max_units < 0:
        ap.error(f"--max-units {a.max_units}: give 0 or more")
    progress = not a.quiet
    pre = prereg.load(NAME, record=a.record is not None and a.phase == "test")
    d = pre.design
    check_design(d)
    root = Path(a.out) / NAME
    costs = record_costs(Path(a.estimate_from), d, _scales(a.estimate_scale, ap)) if a.estimate_from else {}
    run_nothing = a.dry_run or a.summary_only
    drv = Driver(root, d, a.jobs, a.only, 0 if a.summary_only else a.max_units, a.dry_run, costs, progress)
    if not run_nothing:
        for m in d["models"]:  # the bases, their sets and losses: once, each in its own process
            f = root / model_key(m) / "setup.json"
            if not f.is_file():
                f.parent.mkdir(parents=True, exist_ok=True)
                call_in_subprocess(SETUP, {"root": str(root), "model": m, "design": d},
                                   f.with_name("setup.log"), f"{NAME} setup of {m}")
        drv.run([timing_unit(d, m, meth) for m in d["models"] for meth in d["methods"]], "timing runs", TIMING,
                sliced=False)
        if not a.estimate_from:
            drv.costs = measured_costs(root, d)
    chosen, grids, extended, complete = select(drv, d)
    later = spread_units(d, chosen if complete else None) if a.phase == "pilot" else \
        test_units(d, chosen if complete else None)
    if not complete:
        say(progress, f"[{NAME}] then {estimate_line(f'the {a.phase} units', later, d['train'], drv.costs, a.jobs)}")
        say(progress, f"[{NAME}] the selection is not complete; run the same command again to continue")
        return {"complete": False}
    if not drv.run(later, f"{a.phase} units"):
        n = sum(drv.done(u) for u in later)
        say(progress, f"[{NAME}] {n} of {len(later)} {a.phase} units done; nothing is summarized until every unit is "
                      "(the preregistered stop rule)")
        return {"complete": False, "done": n, "of": len(later)}
    s = summarize(root, d, a.phase, chosen, grids, extended)
    s["prereg"] = pre.stamp()
    s["command"] = f"python -m engram_experiments.adapt_budget {a.phase} --jobs {a.jobs}" + \
        (f" --record {a.record}" if a.record else "")
    return publish(s, root / a.phase, a.record, f"{s['experiment']}.json", markdown, plot)


def _argv(o) -> list[str]:
    return ["--out", str(o.out), "--jobs", str(o.jobs)] + (["--record", str(o.record)] if o.record else []) + \
        ([] if o.progress else ["--quiet"])


register(Experiment("adapt-budget-pilot", """
    issue 59's pilot (exploratory): the selection seed's learning-rate grids for the Engram adapter (default and
    parameter-matched), LoRA, LoRA + Engram and full fine-tuning at the selection budgets of
    docs/prereg/adapt-budget.toml, on each model, each run's path (domain gain, forgetting on the general and the
    shared-n-gram set) measured along training; the spread seeds and the power plan (`adapt_budget.py`; days of
    2 cores: each unit is cached and resumed).""",
                    run=lambda o: main(["pilot", *_argv(o)]), table=markdown, plot=plot,
                    plot_file="adapt-budget-pilot.png", section="15", in_all=False))
register(Experiment("adapt-budget", """
    issue 59's test, its design read from docs/prereg/adapt-budget.toml: every budget x test seed x method at the
    lr the selection seed chose; forgetting compared at matched domain gain, paired by seed, Holm
    (`adapt_budget.py`; days of 2 cores; nothing is summarized until every unit is in).""",
                    run=lambda o: main(["test", *_argv(o)]), table=markdown, plot=plot,
                    plot_file="adapt-budget.png", section="15", in_all=False))


def cli(argv: list[str] | None = None) -> None:
    """`main` as a command (runs.run_cli: an `ExperimentError` is one line and exit status 2)."""
    run_cli(main, argv)


if __name__ == "__main__":
    cli()
