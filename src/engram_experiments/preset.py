"""The preset experiments: variants of one training preset (`exp` unless `--preset`) trained on the default corpus
for `--seeds` seeds, one run directory per (variant, seed) under `OUT/NAME/`, then `summary.json`, `summary.md`
(mean and spread over seeds) and `plot.png`. Finished runs are skipped and interrupted ones resumed, so an
experiment can be stopped and restarted.

Each experiment here is a `Design` (its variants as `train()` keyword arguments, the record's table of its runs,
the runs it shares with another experiment) registered as an `Experiment` (`registry.py`): iso, placement,
capacity, ablations, sensitivity, design.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from engram.analysis.stats import frequent_ngram_mask
from engram.config import ConfigError
from engram.model import EngramForCausalLM
from engram.persist import atomic_write_bytes, write_json
from engram.training.data import eval_windows, load_split
from engram.training.presets import get_preset
from engram.training.run import read_run_file
from engram.utils import environment

from . import records
from .records import experiment_record, record_experiment, table_markdown
from .registry import Experiment, Options, Runs, find, get, register
from .runs import call_in_subprocess, run_parallel, seed_stats, trained_run


@dataclass(frozen=True)
class Design:
    """A preset experiment's design. `variants(model_config, size)`: {variant: `train()` keyword arguments} (the
    preset's model config, for designs that depend on it). `results(runs, data)`: the record's table of the runs
    ({variant: [run result per seed]}; default: each variant's final val loss over seeds). `curves`: also record
    each run's val curve. `same_run`: {variant: (experiment, variant)} whose training is identical (same preset, same
    keyword arguments): it reuses that run's directory instead of training the same model again."""

    variants: Callable[[object, str], dict[str, dict]]
    results: Callable[[dict, list | None], dict] | None = None
    curves: bool = False
    same_run: dict[str, tuple[str, str]] = field(default_factory=dict)


def variants(name: str, preset: str, size: str = "default") -> dict[str, dict]:
    """Experiment `name`'s variants at `preset`: variant name -> train() keyword arguments."""
    exp = get(name)
    if exp.design is None:
        raise ConfigError(f"experiment {name!r} trains no preset variants (it has its own driver)")
    return exp.design.variants(get_preset(preset).model(), size)


def run_dir_of(out: str | Path, name: str, variant: str, seed: int, preset: str) -> Path:
    """Where (name, variant, seed) trains: its own folder, or the identical run of its design's `same_run`."""
    exp = find(name)
    src = exp.design.same_run.get(variant) if exp is not None and exp.design is not None else None
    if src is not None and variants(name, preset)[variant] == variants(src[0], preset)[src[1]]:
        name, variant = src
    return Path(out) / name / f"{variant}-seed{seed}"


def run_experiment(name: str, out: str | Path = "runs/experiments", seeds: int = 3, preset: str = "exp",
                   data: list[str] | None = None, max_steps: int | None = None, progress: bool = True,
                   size: str = "default", checkpoint: str | None = None, scale: str = "cpu",
                   record: str | Path | None = None, plan_only: bool = False, finished_only: bool = False,
                   variants_only: list[str] | None = None, jobs: int = 1) -> dict:
    """Run experiment `name` (any registered one) with these options: train (or reuse) its runs, summarize them and,
    with `record`, write the per-seed results and each run's environment to `record/NAME.json`, the file
    `engram results` renders. `finished_only`: train nothing; summarize the runs that have finished."""
    return get(name).run(Options(out=out, seeds=seeds, preset=preset, data=data, max_steps=max_steps, size=size,
                                 checkpoint=checkpoint, scale=scale, record=record, plan_only=plan_only,
                                 finished_only=finished_only, variants_only=variants_only, jobs=jobs,
                                 progress=progress))


def _run_preset(name: str, o: Options) -> dict:
    """A preset experiment's `run`: every (variant, seed) trained or reused, the summary, `--record`, the plot."""
    design = get(name).design
    root = Path(o.out) / name
    root.mkdir(parents=True, exist_ok=True)
    vs = variants(name, o.preset, o.size)
    results = train_runs(name, o.out, vs, list(range(o.seeds)), o.preset, o.data, o.max_steps, o.progress, o.jobs,
                         o.finished_only)
    if not results:
        raise ConfigError(f"no finished runs of {name!r} under {o.out}")
    table = results_table(name, results, o.data)
    summary = {"experiment": name, "preset": o.preset, "seeds": o.seeds, "variants": table,
               "environment": environment()}
    write_json(root / "summary.json", summary)
    flags = {"--preset": o.preset if o.preset != "exp" else None, "--max-steps": o.max_steps,
             "--size": o.size if o.size != "default" else None,
             "--data": " ".join(Path(d).name for d in o.data) if o.data else None}
    command = " ".join([f"engram experiment {name} --seeds {o.seeds}",
                        *(f"{k} {v}" for k, v in flags.items() if v), "--record docs/results"])
    extra = {"curves": val_curves(results)} if design.curves else {}
    rec = record_experiment(Path(o.record) / f"{name}.json", summary, results, command, extra) \
        if o.record is not None else experiment_record(summary, results, command) | extra
    md = table_markdown(rec) + "\n"
    atomic_write_bytes(root / "summary.md", md.encode())
    get(name).plot(rec, root / "plot.png")
    print(md)
    return summary


def val_curves(results: dict[str, list[dict]]) -> dict:
    """{variant: [[step, val loss] per evaluation] per seed}: what `curves` designs record."""
    return {v: [[[m["step"], m["val_loss"]] for m in r["metrics"] if "val_loss" in m] for r in rs]
            for v, rs in results.items()}


def train_runs(name: str, out: str | Path, vs: dict[str, dict], seed_list: list[int], preset: str, data,
               max_steps: int | None, progress: bool, jobs: int = 1, finished_only: bool = False) -> dict[str, list]:
    """Train (or reuse) every (variant of `vs`, seed of `seed_list`) run of experiment `name` under `out`:
    {variant: [trained_run result per seed]}. `jobs` > 1: the unfinished runs first, `jobs` at once, each in its
    own process. `finished_only`: train nothing; the runs that have finished."""
    if jobs > 1 and not finished_only:
        dirs = {(seed, v): run_dir_of(out, name, v, seed, preset) for seed in seed_list for v in vs}
        todo = [k for k, d in dirs.items() if not (d / "summary.json").is_file()]

        def train_apart(item: tuple[int, str]) -> None:
            seed, v = item
            run_dir = dirs[item]
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            if progress:
                print(f"[{name}] {v} seed {seed} -> {run_dir} (log: {run_dir}.log)", flush=True)
            call_in_subprocess("engram_experiments.runs:trained_run", dict(
                run_dir=str(run_dir), label=f"[{name}] {v}", seed=seed, preset=preset, data=data,
                max_steps=max_steps, progress=progress, **vs[v]), Path(f"{run_dir}.log"), f"[{name}] {v} seed {seed}",
                jobs)

        run_parallel(train_apart, todo, jobs)
    results: dict[str, list[dict]] = {}
    for seed in seed_list:
        for vname, kw in vs.items():
            run_dir = run_dir_of(out, name, vname, seed, preset)
            if finished_only and not (run_dir / "summary.json").is_file():
                continue
            results.setdefault(vname, []).append(trained_run(run_dir, f"[{name}] {vname}", seed, preset, data=data,
                                                             max_steps=max_steps, progress=progress, **kw))
    return results


def results_table(name: str, results: dict[str, list[dict]], data=None) -> dict:
    """The record's table of preset experiment `name`'s runs: its design's own (`Design.results`), or each variant's
    final val loss over seeds."""
    own = get(name).design.results
    if own is not None:
        return own(results, data)
    return loss_table(results)


def loss_table(results: dict[str, list[dict]]) -> dict:
    """Each variant's final val loss over seeds, with its parameter counts."""
    return {v: seed_stats([r["val_loss"] for r in rs])
            | {"params": rs[0]["params"], "table_params": rs[0]["table_params"]} for v, rs in results.items()}


def design_table(results: dict, data=None) -> dict:
    """Final val loss per design and the V4.1 runs re-evaluated with their tables as FP8 + ue8m0 rows, per seed.
    The comparisons are the results page's (its §11 family: paired by seed, Holm); the table keeps no test of
    its own."""
    from engram.tables.quant import set_table_format
    from engram.training.train import evaluate

    fp8 = []
    for r in results["v41"]:
        run_dir = Path(r["run_dir"])
        info = read_run_file(run_dir)
        windows = eval_windows(load_split(Path(info["data_dir"]), "val"), info["train"]["seq_len"],
                               info["train"]["eval_max_windows"])
        model = EngramForCausalLM.from_pretrained(run_dir / "final").eval()
        set_table_format(model, "fp8_ue8m0")
        with torch.no_grad():
            fp8.append(evaluate(model, windows, info["train"]["batch_size"], torch.device("cpu")))
    table = loss_table(results)
    table["v41, fp8_ue8m0 rows"] = seed_stats(fp8) | {"params": table["v41"]["params"],
                                                      "table_params": table["v41"]["table_params"]}
    results["v41, fp8_ue8m0 rows"] = results["v41"]  # the same runs evaluated with FP8 rows: their seeds pair
    return table


# ------------------------------------------------------------------------------ sensitivity
def sensitivity(results: dict[str, list[dict]], data=None) -> dict:
    """Per-token val losses of the `engram` runs with Engram on and suppressed, split by token category."""
    runs = results["engram"]
    per = {"frequent n-gram completions": {"on": [], "off": [], "n": 0},
           "all other tokens": {"on": [], "off": [], "n": 0}}
    for r in runs:
        run_dir = Path(r["run_dir"])
        info = read_run_file(run_dir)
        data_dir = Path(info["data_dir"])
        windows = eval_windows(load_split(data_dir, "val"), info["train"]["seq_len"], info["train"]["eval_max_windows"])
        mask = frequent_ngram_mask(np.asarray(load_split(data_dir, "train")), windows)[:, 1:]
        model = EngramForCausalLM.from_pretrained(run_dir / "final").eval()
        losses = {}
        for key, scale in (("on", 1.0), ("off", 0.0)):
            out = []
            with torch.no_grad():
                for i in range(0, len(windows), 16):
                    ids = torch.from_numpy(windows[i:i + 16])
                    logits = model(ids, engram_scale=scale).logits[:, :-1]
                    out.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none"))
            losses[key] = torch.cat(out).numpy()
        for cat, m in (("frequent n-gram completions", mask), ("all other tokens", ~mask)):
            per[cat]["on"].append(float(losses["on"][m].mean()))
            per[cat]["off"].append(float(losses["off"][m].mean()))
            per[cat]["n"] = int(m.sum())
    return {cat: {"tokens": v["n"], "on": seed_stats(v["on"]), "off": seed_stats(v["off"]),
                  "increase": seed_stats([b - a for a, b in zip(v["on"], v["off"])])} for cat, v in per.items()}


# ------------------------------------------------------------------------------ the designs
def _iso(proto, size: str) -> dict[str, dict]:
    return {"engram": {}, "no-engram": {"use_engram": False}, "iso-param": {"baseline": "iso-param"}}


def _placement(proto, size: str) -> dict[str, dict]:
    default = list(proto.engram.get("layer_ids", []))  # the preset's own block: no override, so that run is iso's
    return {f"block{i}": {} if [i] == default else {"model_overrides": {"engram": {"layer_ids": [i]}}}
            for i in range(proto.num_hidden_layers)}


def _capacity(proto, size: str) -> dict[str, dict]:
    sizes = [101, 1009, 10007, 100003] if size == "default" else [11, 1009]
    out = {"rows1": {"model_overrides": {"engram": {"hash_mode": "constant", "engram_vocab_size": [2, 2]}}}}
    out.update({f"rows{n}": {"model_overrides": {"engram": {"engram_vocab_size": [n, n]}}} for n in sizes})
    out["no-engram"] = {"use_engram": False}
    return out


def _ablations(proto, size: str) -> dict[str, dict]:
    return {"full": {}, **{k: {"model_overrides": {"engram": v}} for k, v in {
        "shuffled-hash": {"hash_mode": "shuffled"}, "frozen-table": {"freeze_table": True},
        "no-gate": {"use_gate": False}, "no-conv": {"use_short_conv": False},
        "no-compression": {"compress_tokenizer": False}}.items()},  # the no-Engram baseline is in `iso`
        # per-stream vs single-branch gating needs several streams: both arms with hc_mult=4 (mHC)
        "hc4-per-stream": {"model_overrides": {"hc_mult": 4}},
        "hc4-single-branch": {"model_overrides": {"hc_mult": 4, "engram": {"single_branch": True}}}}


def _design(proto, size: str) -> dict[str, dict]:
    # 32-dim rows (2 x 4 heads x 32 = 256 = n_embed_per_ngram) so ue8m0 blocks of 32 fit a row; the reference keeps
    # nn.Conv1d's init (the exp preset zero-inits the conv, which made removing it neutral)
    return {"reference": {"model_overrides": {"engram": {"n_embed_per_ngram": 128, "conv_zero_init": False}}},
            "v41": {"model_overrides": {"engram": {"n_embed_per_ngram": 128, "use_short_conv": False}}}}


def preset_trainer(name: str, all_variants: dict[str, dict], data: list[str] | None = None,
                   steps: int | None = None):
    """A `Runs.trainer` for runs of preset experiment `name` (its runs under OUT/NAME): the design's variants (each
    with its `all_variants` keyword arguments) on its seeds at its preset, with `data` and `steps` (unless
    `--max-steps`)."""
    def trainer(d: dict, out, progress: bool, jobs: int, max_steps: int | None) -> tuple[dict, dict]:
        vs = {v: all_variants[v] for v in d["variants"]}
        return train_runs(name, out, vs, list(d["seeds"]), d["preset"], data, max_steps or steps, progress, jobs), {}

    return trainer


def _replication(name: str, design: dict, recs: dict) -> Runs:
    """A preset experiment's runs for `NAME-replication`: its variants at the design's preset, its own table."""
    vs = variants(name, design.get("preset"))
    return Runs(vs, lambda results: results_table(name, results), preset_trainer(name, vs))


def _preset(name: str, help: str, design: Design, plot, baseline: str | None, section: str,
            replicable: bool = False, plot_file: str | None = "exp-{name}.png", table=None) -> Experiment:
    return register(Experiment(
        name, help, run=partial(_run_preset, name), design=design, table=table, plot=plot,
        plot_file=plot_file and plot_file.format(name=name), baseline=baseline,
        replication=partial(_replication, name) if replicable else None, section=section))


def sensitivity_markdown(rec: dict) -> str:
    """Sensitivity's table: per token category, the loss with Engram and suppressed, and the increase."""
    lines = ["| token category | tokens | loss with Engram | Engram suppressed | increase (mean ± sd, n) |",
             "|---|---|---|---|---|"]
    for cat, r in rec["variants"].items():
        lines.append(f"| {cat} | {r['tokens']:,} | {r['on']['mean']:.3f} | {r['off']['mean']:.3f} | "
                     f"{r['increase']['mean']:+.3f} ± {r['increase']['std']:.3f} (n={r['increase']['n']}) |")
    return "\n".join(lines)


_preset("iso", """
    Engram vs the same backbone without Engram (iso-FLOP) vs the Engram parameter
    budget moved into a wider FFN (iso-parameter): val loss curves.""",
        Design(_iso, curves=True), records.plot_curves, "no-engram", "1")
_preset("placement", "one Engram layer at each block: final val loss vs block index.",
        Design(_placement, same_run={"block1": ("iso", "engram")}), records.plot_placement, "block1", "2")
_preset("capacity", 'rows per head swept over orders of magnitude down to 1 (hash_mode="constant").',
        Design(_capacity, same_run={"no-engram": ("iso", "no-engram")}), records.plot_capacity, "no-engram", "3")
_preset("ablations", """
    shuffled hash, frozen random table, no gate, no short conv, no tokenizer compression,
    and single-branch vs per-stream gating (both with 4 mHC streams).""",
        Design(_ablations, same_run={"full": ("iso", "engram")}), records.plot_bars, "full", "4", replicable=True)
_preset("sensitivity", """
    suppress Engram at inference in the trained iso/engram models; loss increase on
    tokens completing frequent train n-grams vs all other tokens.""",
        Design(lambda proto, size: {"engram": {}}, results=sensitivity, same_run={"engram": ("iso", "engram")}),
        records.plot_sensitivity, None, "5", replicable=True, table=sensitivity_markdown)
_preset("design", """
    the reference's Engram (short conv, the reference's conv init) vs DeepSeek-V4.1's (no conv; its
    tables served as FP8 rows with ue8m0 scales), same table and model otherwise (16-dim -> 32-dim
    rows so FP8 blocks fit); docs/results §11 records it at --max-steps 2000 (--jobs 2: ~40 min on 2 cores).""",
        Design(_design, results=design_table), records.plot_bars, "reference", "11", plot_file=None)
