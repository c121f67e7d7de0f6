"""Training loop: `engram train` and the library call `train(...)`.

One run directory holds everything:
    DIR/run.json           model + training config of the run
    DIR/metrics.jsonl      one JSON object per step: step, train_loss, lr, tok_s (+ val_loss on eval steps)
    DIR/checkpoints/step_NNNNNN/   model.safetensors, optim.safetensors, state.json (with file hashes)
    DIR/loss.png           loss curves (matplotlib, if installed)
    DIR/final/             save_pretrained output + tokenizer.json (AutoModelForCausalLM-loadable) and
                           engram_manifest.json (size + sha256 of every file, verified on load)

Checkpoints (`checkpoint.py`) are written to a temp folder and renamed, with every file's sha256
in `state.json`; `--resume` falls back to the previous one if the newest is corrupt. Ctrl-C
finishes the step and saves a checkpoint. Resuming restores weights, optimizer moments, the MoE
biases, the data position and the RNG, so the loss curve continues exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import ConfigError, TrainConfig
from ..distributed.parallel import DistContext
from ..persist import write_manifest
from ..memory import defer_table_allocation, is_table_key
from ..model import EngramForCausalLM, update_expert_bias
from ..persist import atomic_write_bytes, read_json, replace_dir, temp_dir_for
from ..tables import (
    TableError,
    installed_tables,
    offload_tables,
    readahead_for,
    table_entries,
    table_file,
    write_safetensors,
)
from ..tables.base import find_tables
from ..utils import environment, peak_rss_mib
from . import presets
from .checkpoint import (
    CheckpointError,
    checkpoints,
    durable_tables,
    load_checkpoint,
    save_checkpoint,
)
from .data import (
    Batcher,
    eval_windows,
    load_manifest,
    load_split,
    prepare,
    text_windows,
)
from .optim import build_optimizers, split_params, warmup_cosine


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, skipping blank, torn (a kill while appending) or damaged lines."""
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


# ------------------------------------------------------------------------------------ model building
def build_model_config(preset: str, manifest: dict, use_engram: bool = True, baseline: str | None = None,
                       model_overrides: dict | None = None):
    return presets.model_for(preset, vocab_size=manifest["vocab_size"], pad_id=manifest["pad_id"],
                             tokenizer_file=manifest["tokenizer_file"], use_engram=use_engram, baseline=baseline,
                             overrides=model_overrides)


@torch.no_grad()
def evaluate(model, windows: np.ndarray, batch_size: int, device) -> float:
    """Mean next-token loss over fixed windows (B, T)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        ids = torch.from_numpy(windows[i:i + batch_size]).to(device)
        loss = model(ids, labels=ids).loss
        n = ids.shape[0] * (ids.shape[1] - 1)
        total += loss.item() * n
        count += n
    model.train(was)
    return total / count


def evaluate_text(model, tokenizer, data: list[str] | None = None, split: str = "val", seq_len: int = 256,
                  max_windows: int | None = None, batch_size: int = 16) -> tuple[float, int, int]:
    """Mean next-token loss of `model` on a split of `data` (default: Shakespeare), tokenized with `tokenizer`
    (documents separated by `<|endoftext|>` when the tokenizer has it as id 0, as in training).

    Returns (loss in nats/token, tokens scored, windows of `seq_len`).
    """
    windows = text_windows(tokenizer, data, split, seq_len, max_windows)
    return evaluate(model, windows, batch_size, torch.device("cpu")), windows.size, len(windows)



def _plot(run_dir: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_metrics(run_dir / "metrics.jsonl")
    fig, ax = plt.subplots(figsize=(7, 4))
    tr = [(r["step"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
    va = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if tr:
        s, l = zip(*tr)
        k = max(1, len(l) // 50)
        smooth = np.convolve(l, np.ones(k) / k, mode="valid")
        ax.plot(s[k - 1:], smooth, label="train (smoothed)", alpha=0.8)
    if va:
        ax.plot(*zip(*va), "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run_dir.name)
    ax.legend()
    ax.grid(alpha=0.3)
    out = run_dir / "loss.png"
    tmp = run_dir / ".loss.png.tmp.png"
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, out)
    return out


def save_final(model, run_dir: Path, manifest: dict) -> Path:
    final = run_dir / "final"
    tmp = temp_dir_for(final)
    old = dict(model.config.engram)
    model.config.engram = {**old, "tokenizer_name_or_path": "tokenizer.json"}
    try:
        model.save_pretrained(tmp)
    finally:
        model.config.engram = old
    if installed_tables(model):  # tables in files: stream their rows into model.safetensors, a block at a time
        from safetensors import safe_open

        f = tmp / "model.safetensors"
        with safe_open(str(f), framework="pt") as st:
            meta, small = st.metadata(), {k: st.get_tensor(k) for k in st.keys()}
        write_safetensors(f, table_entries(model, small, where=f"save_final: {f}"), meta)
    shutil.copy(manifest["tokenizer_file"], tmp / "tokenizer.json")
    write_manifest(tmp)  # again: the tables and the tokenizer came after save_pretrained's
    return replace_dir(tmp, final)


# ------------------------------------------------------------------------------------ the run
@dataclass
class Run:
    """Everything one training run holds between its units (build, restore, step, evaluate, checkpoint, finish)."""

    tcfg: TrainConfig
    run_dir: Path
    manifest: dict
    data_dir: Path
    mcfg: object
    ddp: DistContext
    model: torch.nn.Module = None
    step_model: torch.nn.Module = None  # what a training step calls: the model or its DDP wrapper
    opts: dict = None
    dense_params: list = None  # clipped each step
    batcher: Batcher = None
    val: np.ndarray = None
    tables: dict = dataclasses.field(default_factory=dict)  # durable tables: {layer: Table} (files, shards)
    n_params: int = 0
    n_table: int = 0
    progress: bool = True
    only_trainable: bool = False  # checkpoints hold the trainable parameters only (adapters: the base is frozen)
    write_final: object = None  # model -> final folder; None: save_final (an EngramForCausalLM)
    counts: dict = None  # adapter runs: parameter counts (engram.adapters.trainable_summary)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def log(self, rec: dict) -> None:
        if self.ddp.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def autocast(self):
        dev = self.ddp.device
        return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)


def setup_run(out, run_json: dict, resume: bool, same: tuple[str, ...]) -> Path:
    """The run directory of a new or resumed run (`engram train` and `engram adapt` alike); writes run.json.

    A new run needs an --out without checkpoints. A resumed one must have been started with the same
    `same` settings of run.json, the same kind ("train" / "adapt") and the same table backend; a
    corrupt run.json is one line saying how to resume anyway (the checkpoints are verified on their own).
    """
    run_dir = Path(out)
    if resume and (run_dir / "run.json").is_file():
        fix = ("delete it to resume without checking that the flags match the run's (the checkpoints are verified "
               "on their own)")
        prev = read_json(run_dir / "run.json", "--resume: run.json", fix, ConfigError)
        if not isinstance(prev.get("train"), dict):
            raise ConfigError(f"--resume: {run_dir / 'run.json'} is corrupt (no 'train' section); {fix}")
        kind, prev_kind = run_json.get("kind", "train"), prev.get("kind", "train")
        if prev_kind != kind:
            raise ConfigError(f"--resume: {run_dir} holds an `engram {prev_kind}` run, not `engram {kind}`")
        prev_backend = prev["train"].get("table_backend", "param")
        if prev_backend != run_json["train"]["table_backend"]:
            raise ConfigError(f"--resume: {run_dir} was trained with table_backend={prev_backend}; use the same setting")
        empty = {"model_overrides": {}, "engram_options": {}, "unfreeze": []}
        diff = [k for k in same if prev.get(k, empty.get(k)) != run_json.get(k)]
        if diff:
            raise ConfigError(f"--resume: {run_dir} was started with "
                              + " ".join(f"{k}={prev.get(k, empty.get(k))}" for k in diff) + "; use the same flags")
    elif not resume and checkpoints(run_dir):
        raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / "run.json", json.dumps(run_json, indent=1).encode())
    return run_dir


def build(preset: str, data, out, max_steps, use_engram: bool, baseline, resume: bool, device, overrides,
          progress: bool, model_overrides) -> Run:
    """Settings, data, run dir, model (tables placed, parallelized) and optimizers of a run."""
    ddp = DistContext(torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    tcfg = presets.train_config(preset, overrides, max_steps, world=ddp.world)
    data_dir = prepare(data, tcfg.tokenizer, progress=progress)
    manifest = load_manifest(data_dir)
    run_json = {"kind": "train", "preset": preset, "data": data, "use_engram": use_engram, "baseline": baseline,
                "model_overrides": model_overrides or {}, "train": dataclasses.asdict(tcfg), "data_dir": str(data_dir)}
    run_dir = setup_run(out, run_json, resume, ("preset", "use_engram", "baseline", "model_overrides"))
    run = Run(tcfg, run_dir, manifest, data_dir, None, ddp, progress=progress and ddp.is_main)

    torch.manual_seed(tcfg.seed)
    run.mcfg = build_model_config(preset, manifest, use_engram=use_engram, baseline=baseline,
                                  model_overrides=model_overrides)
    file_init = tcfg.table_backend == "mmap" and tcfg.table_init == "file"
    with defer_table_allocation() if file_init else contextlib.nullcontext():
        run.model = EngramForCausalLM(run.mcfg).to(ddp.device).train()
    tables = [m for _, m in find_tables(run.model)]  # counted before the tables move to files or shards
    run.n_table = sum(m.num_rows * m.embedding_dim for m in tables if m.embedding.weight.requires_grad)  # trained rows
    run.n_params = (sum(p.numel() for n, p in run.model.named_parameters() if not is_table_key(n))
                    + sum(m.num_rows * m.embedding_dim for m in tables))
    _place_tables(run, resume, file_init, use_engram)
    run.opts = build_optimizers(run.model, tcfg.lr, tcfg.weight_decay, tcfg.table_lr_mult)
    run.dense_params = [p for _, p in split_params(run.model)[0]]
    run.batcher = Batcher(load_split(data_dir, "train"), tcfg.seq_len, tcfg.batch_size, seed=tcfg.seed,
                          hash_mapping=run.model.model.mapping,
                          readahead=readahead_for(run.model) if tcfg.table_readahead else None)
    run.val = eval_windows(load_split(data_dir, "val"), tcfg.seq_len, tcfg.eval_max_windows)
    return run


def _place_tables(run: Run, resume: bool, file_init: bool, use_engram: bool) -> None:
    """Tables stay parameters, move into memory-mapped files, or are row-sharded over ranks (then DDP/FSDP2)."""
    tcfg, ddp = run.tcfg, run.ddp
    table_dir = Path(tcfg.table_dir) if tcfg.table_dir else run.run_dir / "tables"
    mmap = tcfg.table_backend == "mmap" and use_engram
    table_kw = dict(cache_bytes=int(tcfg.table_cache_mb * 2**20), init_seed=tcfg.seed if file_init else None,
                    overwrite=not resume)
    if mmap and ddp.world == 1:
        if resume:
            layer_ids = run.mcfg.engram["layer_ids"]
            missing = [str(f) for f in (table_file(table_dir, lid) for lid in layer_ids) if not f.is_file()]
            if missing:
                raise CheckpointError(f"--resume: table files missing: {', '.join(missing)}")
        offload_tables(run.model, "mmap", table_dir, trainable=True, **table_kw)
    # with --nproc and mmap tables each rank keeps its shard in its own journaled file
    shard_files = dict(table_dir=table_dir, **table_kw) if mmap and ddp.world > 1 else {}
    run.step_model = ddp.parallelize(run.model, tcfg.dense_parallel, **shard_files)  # the model: 1 process / FSDP2
    run.tables = durable_tables(run.model)
    if not resume:
        for table in run.tables.values():
            table.commit(0)  # start each undo journal at step 0


def restore(run: Run) -> int:
    """Resume from the newest usable checkpoint (falling back past corrupt ones); returns its step."""
    cks = checkpoints(run.run_dir)
    if not cks:
        raise CheckpointError(f"--resume: no checkpoints under {run.run_dir / 'checkpoints'}")
    for i, ck in enumerate(cks):
        try:
            st = load_checkpoint(ck, run.model, run.opts, run.ddp, only_trainable=run.only_trainable)
            break
        except CheckpointError as e:
            if i + 1 == len(cks):
                raise CheckpointError(f"no usable checkpoint in {run.run_dir}: {e}") from None
            print(f"engram: warning: {e}; falling back to {cks[i + 1].name}")
    step = st["step"]
    for table in run.tables.values():  # roll each table file back to the checkpoint (undo journal)
        try:
            n = table.recover(step)
        except TableError as e:
            raise CheckpointError(f"--resume from {ck.name}: {e}") from None
        if n and run.progress:
            print(f"restored {n:,} rows of {table.path.name} to step {step} from its journal")
    run.batcher.load_state_dict(st["batcher"])
    if run.metrics_path.is_file():  # drop metrics past the checkpoint (and damaged lines): the run rewrites them
        keep = [json.dumps(r) for r in read_metrics(run.metrics_path) if r["step"] <= step]
        atomic_write_bytes(run.metrics_path, ("\n".join(keep) + "\n" if keep else "").encode())
    print(f"resumed {run.run_dir} at step {step}")
    return step


def log_start(run: Run) -> None:
    """Step 0 of a new run: the first batch's loss and the validation loss before training."""
    tcfg, dev = run.tcfg, run.ddp.device
    run.metrics_path.unlink(missing_ok=True)
    ids0, _ = Batcher(load_split(run.data_dir, "train"), tcfg.seq_len, tcfg.batch_size, seed=tcfg.seed,
                      prefetch=False).next()
    with torch.no_grad(), run.autocast():
        run.model.eval()
        first = run.model(ids0.to(dev), labels=ids0.to(dev)).loss.item()
        run.model.train()
    run.log({"step": 0, "train_loss": first, "val_loss": evaluate(run.model, run.val, tcfg.batch_size, dev)})


def train_step(run: Run, step: int) -> tuple[float, int]:
    """One optimizer step on the next batch: (loss averaged over ranks, tokens in the global batch)."""
    tcfg, dev = run.tcfg, run.ddp.device
    ids, hashes = run.ddp.local_batch(*run.batcher.next())  # hash ids come from the data pipeline
    ids = ids.to(dev)
    hashes = {k: v.to(dev, non_blocking=True) for k, v in hashes.items()} if hashes else None
    mult = warmup_cosine(step, tcfg.max_steps, tcfg.warmup_steps, tcfg.min_lr_ratio)
    for o in run.opts.values():
        for g in o.param_groups:
            g["lr"] = g["base_lr"] * mult
    with run.autocast():  # (no hash ids: the model hashes in its forward, as an attached adapter does)
        loss = run.step_model(ids, labels=ids, **({"hash_ids": hashes} if hashes else {})).loss
    for o in run.opts.values():
        o.zero_grad(set_to_none=True)
    loss.backward()
    if tcfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(run.dense_params, tcfg.grad_clip)
    for o in run.opts.values():
        o.step()
    update_expert_bias(run.model, reduce=run.ddp.sum)  # MoE loss-free balancing from the global expert load
    return run.ddp.mean(loss.item()), ids.numel() * run.ddp.world


def save(run: Run, step: int) -> None:
    save_checkpoint(run.run_dir, step, run.model, run.opts, run.batcher.consumed_state(), run.tcfg.keep_checkpoints,
                    ddp=run.ddp, only_trainable=run.only_trainable)


def loop(run: Run, step: int, stop_after: int | None) -> tuple[int, str, float, float | None]:
    """Train from `step` to max_steps with evaluation, checkpoints and Ctrl-C handling.

    Returns (step, how it ended: "done" | "interrupted" | "aborted", last train loss, last val loss).
    """
    tcfg = run.tcfg
    eval_every = tcfg.eval_every or max(1, tcfg.max_steps // 10)
    saved_at = step  # the step the newest checkpoint on disk holds (a new run: none, but step 0 needs none)
    bar = tqdm(total=tcfg.max_steps, initial=step, disable=not run.progress, desc="train", dynamic_ncols=True)
    t_last, last_loss, last_val, ended, in_step = time.perf_counter(), float("nan"), None, "done", False
    stop = _StopRequest()
    try:
        while step < tcfg.max_steps:
            if run.ddp.any(stop.requested or (stop_after is not None and step >= stop_after)):
                raise KeyboardInterrupt
            in_step = True
            last_loss, tokens = train_step(run, step)
            step, in_step = step + 1, False
            if not math.isfinite(last_loss):
                raise FloatingPointError(f"loss became {last_loss} at step {step}; lower --lr or check the data")
            now = time.perf_counter()
            rec = {"step": step, "train_loss": last_loss, "lr": run.opts["dense"].param_groups[0]["lr"],
                   "tok_s": tokens / max(now - t_last, 1e-9)}
            t_last = now
            if step % eval_every == 0 or step == tcfg.max_steps:
                last_val = rec["val_loss"] = evaluate(run.model, run.val, tcfg.batch_size, run.ddp.device)
                t_last = time.perf_counter()
            run.log(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{last_loss:.3f}", val=f"{last_val:.3f}" if last_val else "-",
                            tok_s=f"{rec['tok_s']:.0f}")
            if step % tcfg.ckpt_every == 0 and step < tcfg.max_steps:
                save(run, step)
                saved_at = step
    except KeyboardInterrupt:
        ended = "aborted" if in_step else "interrupted"
    finally:
        stop.close()
        bar.close()
    if ended != "aborted" and (step != saved_at or not checkpoints(run.run_dir)):
        save(run, step)  # (never replace a checkpoint by an identical one: the old one is gone meanwhile)
    return step, ended, last_loss, last_val


def finish(run: Run, step: int, ended: str, last_loss: float, last_val: float | None) -> dict:
    """Gather sharded tables, write the final model, plot and summary (rank 0); report an interruption."""
    if ended == "aborted":  # a second Ctrl-C inside a step: the weights are half-updated, do not checkpoint them
        for table in run.tables.values():
            table.close()
        print(f"aborted during step {step + 1}; no checkpoint written; --resume continues from the last one")
        return {"interrupted": True, "step": step, "run_dir": str(run.run_dir)}
    table_stats = {str(k): t.stats() for k, t in run.tables.items()}
    model = run.model
    if run.ddp.world > 1:
        model = run.ddp.unshard(model, lambda: EngramForCausalLM(run.mcfg))
        run.step_model = None  # free the DDP reducer while its process group is alive: its destructor can hang after
        gc.collect()
        run.ddp.close()  # before saving: transformers' save_pretrained must not see a process group others left
        if not run.ddp.is_main:
            return {"step": step, "train_loss": last_loss, "run_dir": str(run.run_dir), "world_size": run.ddp.world,
                    **({"interrupted": True} if ended == "interrupted" else {})}
    if ended == "interrupted":
        print(f"interrupted at step {step}; checkpoint saved in {run.run_dir / 'checkpoints'}; continue with --resume")
        return {"interrupted": True, "step": step, "run_dir": str(run.run_dir)}
    if last_val is None:  # no step ran in this session (e.g. --resume of a finished run): measure it now
        last_val = evaluate(model, run.val, run.tcfg.batch_size, run.ddp.device)
    plot = _plot(run.run_dir)
    final = run.write_final(model) if run.write_final else save_final(model, run.run_dir, run.manifest)
    summary = {"step": step, "train_loss": last_loss, "val_loss": last_val, "run_dir": str(run.run_dir),
               "final": str(final), "plot": str(plot) if plot else None, "params": run.n_params,
               "table_params": run.n_table, "world_size": run.ddp.world, "peak_rss_mib": peak_rss_mib()}
    if run.ddp.device.type == "cuda":
        summary["cuda_peak_mib"] = torch.cuda.max_memory_allocated(run.ddp.device) / 2**20
    if table_stats:
        summary["table_cache"] = table_stats
    summary["environment"] = environment()  # versions, threads, CPU, commit: what "reproduces" depends on
    atomic_write_bytes(run.run_dir / "summary.json", json.dumps(summary, indent=1).encode())
    return summary


def train(preset: str = "cpu-small", data: list[str] | None = None, out: str | os.PathLike = "runs/cpu-small",
          max_steps: int | None = None, use_engram: bool = True, baseline: str | None = None, resume: bool = False,
          device: str | None = None, overrides: dict | None = None, progress: bool = True,
          stop_after: int | None = None, model_overrides: dict | None = None) -> dict:
    """Train a preset on `data` (default: Shakespeare) into run dir `out`; returns a summary dict.

    `stop_after` simulates an interruption (tests): stop and checkpoint after that many steps.
    """
    run = build(preset, data, out, max_steps, use_engram, baseline, resume, device, overrides, progress,
                model_overrides)
    step = restore(run) if resume else 0
    if run.progress:
        print(f"model: {run.n_params / 1e6:.2f}M parameters ({run.n_table / 1e6:.2f}M in Engram tables), "
              f"train {run.manifest['splits']['train']['tokens']:,} tokens, val windows {len(run.val)}, "
              f"device {run.ddp.device}")
    if step == 0:
        log_start(run)
    return finish(run, *loop(run, step, stop_after))


class _StopRequest:
    """Ctrl-C during training: finish the current step, checkpoint, stop. A second Ctrl-C aborts at once."""

    def __init__(self):
        import signal
        import threading

        self.requested = False
        self._prev = None
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nengram: stopping after this step to save a checkpoint (Ctrl-C again to abort without one)", flush=True)

    def close(self) -> None:
        if self._prev is not None:
            import signal

            signal.signal(signal.SIGINT, self._prev)
            self._prev = None
