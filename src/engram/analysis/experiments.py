"""`engram experiment NAME`: evidence that the memory stores knowledge, as rerunnable commands.

Every experiment trains variants of the `exp` preset (or `--preset`) on the default corpus for
`--seeds` seeds, one run directory per (variant, seed) under `OUT/NAME/`, then writes
`summary.json`, `summary.md` (mean and spread over seeds) and `plot.png`. Finished runs are
skipped and interrupted ones resumed, so an experiment can be stopped and restarted.

Experiments:
  iso          Engram vs the same backbone without Engram (iso-FLOP) vs the Engram parameter
               budget moved into a wider FFN (iso-parameter): val loss curves.
  placement    one Engram layer at each block: final val loss vs block index.
  capacity     rows per head swept over orders of magnitude down to 1 (hash_mode="constant").
  ablations    shuffled hash, frozen random table, no gate, no short conv, no tokenizer compression,
               and single-branch vs per-stream gating (both with 4 mHC streams).
  sensitivity  suppress Engram at inference in the trained iso/engram models; loss increase on
               tokens completing frequent train n-grams vs all other tokens.
  retrofit     a small Llama pretrained on Shakespeare + KJV adapted to WordNet's definitions: full
               fine-tuning vs LoRA vs Engram adapters (one matched to LoRA's trainable parameters); lr grids
               chosen on a selection seed, domain loss vs forgetting on two general sets, forgetting budgets
               (`analysis/retrofit.py`).
  allocation   the paper's U-curve: total and activated parameters fixed, the share of the inactive
               sparse budget kept by routed MoE experts swept from 100% down, the rest as Engram rows;
               plus dense iso-activated and iso-total baselines (`analysis/allocation.py`;
               `--scale gpu` for the larger sweep of `experiments/allocation_gpu.sh`).
  design       the reference's Engram (short conv, the reference's conv init) vs DeepSeek-V4.1's (no conv; its
               tables served as FP8 rows with ue8m0 scales), same table and model otherwise (16-dim -> 32-dim
               rows so FP8 blocks fit); docs/results §11 records it at --max-steps 2000 (--jobs 2: ~40 min on 2 cores).
  edit         counterfactuals and new entities written into the table rows of a model that learned world
               facts (`engram edit`) vs fine-tuning (with and without KL) and LoRA at fixed step budgets:
               efficacy, generalization, specificity, damage (`analysis/editing.py`).
  smollm2-adapt  SmolLM2-135M-Instruct (a real pretrained model, imported from its GGUF file) adapted to the
               corpus it predicts worst: Engram adapters vs LoRA vs full fine-tuning; every choice read from the
               committed preregistration docs/prereg/smollm2-adapt.toml (`--seeds` does not apply; --record
               refuses a dirty tree) (`analysis/smollm2.py`; --jobs 2: about 70 min on 2 cores).
  smollm2-edit counterfactual edits of capitals SmolLM2-135M-Instruct (+ an Engram adapter) knows: `engram edit`
               vs fine-tuning, fine-tuning + KL and LoRA at fixed step budgets; efficacy, paraphrases,
               specificity on known unedited facts, fluency; read from docs/prereg/smollm2-edit.toml
               (`analysis/smollm2_edit.py`; the recorded run took 54 min on 2 cores shared with other work).
  NAME-replication  a claim of experiment NAME (ablations, sensitivity, allocation, retrofit, edit) run again on
               seeds (edit: fact sets) no record used, every choice (variants, seeds, n from the power at the
               original effect, the family, the test) read from the committed preregistration
               docs/prereg/NAME-replication.toml; recorded to docs/results/NAME-replication.json beside the
               original (`analysis/replication.py`; the CLI dispatches it: replication.py imports this module).
  adapter-init the adapter tables' init std (the default of `engram.attach`), chosen on GPT-2 and GPT-NeoX
               bases adapted to Shakespeare and to the King James Bible: settings apart from
               benchmarks/bench_peers.py, which reports it (`analysis/adapter_init.py`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError
from ..model import EngramForCausalLM
from ..persist import atomic_write_bytes, write_json
from ..training.data import eval_windows, load_split
from ..training.presets import get_preset
from ..utils import environment
from .records import experiment_record, plot, record_experiment, table_markdown
from .runs import call_in_subprocess, read_run_file, run_parallel, seed_stats, trained_run

EXPERIMENTS = ("iso", "placement", "capacity", "ablations", "sensitivity", "design", "retrofit", "edit", "allocation",
               "adapter-init", "smollm2-adapt", "smollm2-edit")


def variants(name: str, preset: str, size: str = "default") -> dict[str, dict]:
    """variant name -> train() keyword arguments."""
    proto = get_preset(preset).model()
    if name in ("iso", "sensitivity"):
        return {"engram": {}, "no-engram": {"use_engram": False}, "iso-param": {"baseline": "iso-param"}} \
            if name == "iso" else {"engram": {}}
    if name == "placement":
        default = list(proto.engram.get("layer_ids", []))  # the preset's own block: no override, so that run is iso's
        return {f"block{i}": {} if [i] == default else {"model_overrides": {"engram": {"layer_ids": [i]}}}
                for i in range(proto.num_hidden_layers)}
    if name == "capacity":
        sizes = [101, 1009, 10007, 100003] if size == "default" else [11, 1009]
        out = {"rows1": {"model_overrides": {"engram": {"hash_mode": "constant", "engram_vocab_size": [2, 2]}}}}
        out.update({f"rows{n}": {"model_overrides": {"engram": {"engram_vocab_size": [n, n]}}} for n in sizes})
        out["no-engram"] = {"use_engram": False}
        return out
    if name == "ablations":
        return {"full": {}, **{k: {"model_overrides": {"engram": v}} for k, v in {
            "shuffled-hash": {"hash_mode": "shuffled"}, "frozen-table": {"freeze_table": True},
            "no-gate": {"use_gate": False}, "no-conv": {"use_short_conv": False},
            "no-compression": {"compress_tokenizer": False}}.items()},  # the no-Engram baseline is in `iso`
            # per-stream vs single-branch gating needs several streams: both arms with hc_mult=4 (mHC)
            "hc4-per-stream": {"model_overrides": {"hc_mult": 4}},
            "hc4-single-branch": {"model_overrides": {"hc_mult": 4, "engram": {"single_branch": True}}}}
    if name == "design":  # 32-dim rows (2 x 4 heads x 32 = 256 = n_embed_per_ngram) so ue8m0 blocks of 32 fit a row;
        # the reference keeps nn.Conv1d's init (the exp preset zero-inits the conv, which made removing it neutral)
        return {"reference": {"model_overrides": {"engram": {"n_embed_per_ngram": 128, "conv_zero_init": False}}},
                "v41": {"model_overrides": {"engram": {"n_embed_per_ngram": 128, "use_short_conv": False}}}}
    raise ConfigError(f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)} or all")


# variants whose training is identical to another experiment's (same preset, same keyword arguments): they
# share its run directories instead of training the same model again
SAME_RUN = {("placement", "block1"): ("iso", "engram"), ("ablations", "full"): ("iso", "engram"),
            ("capacity", "no-engram"): ("iso", "no-engram"), ("sensitivity", "engram"): ("iso", "engram")}


def run_dir_of(out: str | Path, name: str, variant: str, seed: int, preset: str) -> Path:
    """Where (name, variant, seed) trains: its own folder, or the identical run of `SAME_RUN`."""
    src = SAME_RUN.get((name, variant))
    if src is not None and variants(name, preset)[variant] == variants(src[0], preset)[src[1]]:
        name, variant = src
    return Path(out) / name / f"{variant}-seed{seed}"


def run_experiment(name: str, out: str | Path = "runs/experiments", seeds: int = 3, preset: str = "exp",
                   data: list[str] | None = None, max_steps: int | None = None, progress: bool = True,
                   size: str = "default", checkpoint: str | None = None, scale: str = "cpu",
                   record: str | Path | None = None, plan_only: bool = False, finished_only: bool = False,
                   variants_only: list[str] | None = None, jobs: int = 1) -> dict:
    """Train (or reuse) every (variant, seed) run of experiment `name` and summarize it. `record`: also write the
    per-seed results and each run's environment to `record/NAME.json`, the file `engram results` renders.
    `finished_only`: train nothing; summarize the runs that have finished (variants may have fewer seeds)."""
    if name == "retrofit":  # a pretrained transformers base, not a preset: its own driver
        from .retrofit import run

        return run(out, seeds, max_steps, progress=progress, record=record, jobs=jobs)
    if name == "smollm2-adapt":  # a real pretrained base; its design is its preregistration
        from .smollm2 import run

        return run(out, progress=progress, record=record, jobs=jobs, max_steps=max_steps)
    if name == "smollm2-edit":  # the same base, edited; its design is its preregistration
        from .smollm2_edit import run

        return run(out, progress=progress, record=record, budgets=[max_steps] if max_steps else None)
    if name == "allocation":  # MoE backbones with fixed totals: its own plan and driver
        from .allocation import run

        return run(out, seeds, max_steps, progress=progress, scale=scale, data=data, plan_only=plan_only,
                   record=record, only=variants_only, finished_only=finished_only)
    if name == "adapter-init":  # transformers bases adapted with each candidate table init: its own driver
        from .adapter_init import run

        return run(out, seeds, max_steps, progress=progress, record=record)
    if name == "edit":  # one trained model, edited and fine-tuned: its own driver
        from .editing import run

        return run(out, checkpoint=checkpoint, seeds=seeds, progress=progress, record=record)
    root = Path(out) / name
    root.mkdir(parents=True, exist_ok=True)
    vs = variants(name, preset, size)
    results = train_runs(name, out, vs, list(range(seeds)), preset, data, max_steps, progress, jobs, finished_only)
    if not results:
        raise ConfigError(f"no finished runs of {name!r} under {out}")
    table = results_table(name, results, data)
    summary = {"experiment": name, "preset": preset, "seeds": seeds, "variants": table, "environment": environment()}
    write_json(root / "summary.json", summary)
    flags = {"--preset": preset if preset != "exp" else None, "--max-steps": max_steps,
             "--size": size if size != "default" else None,
             "--data": " ".join(Path(d).name for d in data) if data else None}
    command = " ".join([f"engram experiment {name} --seeds {seeds}",
                        *(f"{k} {v}" for k, v in flags.items() if v), "--record docs/results"])
    rec = record_experiment(Path(record) / f"{name}.json", summary, results, command) if record is not None \
        else experiment_record(summary, results, command)
    md = table_markdown(rec) + "\n"
    atomic_write_bytes(root / "summary.md", md.encode())
    plot(rec, root / "plot.png")
    print(md)
    return summary


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
            call_in_subprocess("engram.analysis.runs:trained_run", dict(
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
    """The summary's table of a preset experiment's runs: sensitivity's token categories, design's FP8 rows, or
    each variant's final val loss over seeds."""
    if name == "sensitivity":
        return sensitivity(results["engram"], data)
    if name == "design":
        table = design_table(results)
        results["v41, fp8_ue8m0 rows"] = results["v41"]  # the same runs evaluated with FP8 rows: their seeds pair
        return table
    return {v: seed_stats([r["val_loss"] for r in rs])
            | {"params": rs[0]["params"], "table_params": rs[0]["table_params"]} for v, rs in results.items()}


def design_table(results: dict) -> dict:
    """Final val loss per design and the V4.1 runs re-evaluated with their tables as FP8 + ue8m0 rows, per seed.
    The comparisons are the results page's (its §11 family: paired by seed, Holm); the table keeps no test of
    its own."""
    from ..tables.quant import set_table_format
    from ..training.train import evaluate

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
    table = {v: seed_stats([r["val_loss"] for r in rs])
             | {"params": rs[0]["params"], "table_params": rs[0]["table_params"]}
             for v, rs in results.items()}
    table["v41, fp8_ue8m0 rows"] = seed_stats(fp8) | {"params": table["v41"]["params"],
                                                      "table_params": table["v41"]["table_params"]}
    return table


# ------------------------------------------------------------------------------ sensitivity
def frequent_ngram_mask(train_tokens: np.ndarray, tokens: np.ndarray, min_count: int = 20) -> np.ndarray:
    """True where token t completes a trigram or bigram seen >= min_count times in the train split
    (the static, multi-token patterns: names, set phrases, speaker tags)."""
    tr = train_tokens.astype(np.int64)
    V = int(max(tr.max(), tokens.max())) + 1
    big = tr[:-1] * V + tr[1:]
    tri = (tr[:-2] * V + tr[1:-1]) * V + tr[2:]
    ub, cb = np.unique(big, return_counts=True)
    ut, ctr = np.unique(tri, return_counts=True)
    x = tokens.astype(np.int64)
    mask = np.zeros(x.shape, dtype=bool)
    mask[:, 2:] |= np.isin((x[:, :-2] * V + x[:, 1:-1]) * V + x[:, 2:], ut[ctr >= min_count])
    mask[:, 1:] |= np.isin(x[:, :-1] * V + x[:, 1:], ub[cb >= min_count]) & ~np.isin(x[:, 1:], (0, 1))
    return mask


def sensitivity(runs: list[dict], data=None) -> dict:
    """Per-token val losses with Engram on and suppressed, split by token category."""
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
