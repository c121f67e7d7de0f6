"""One training run, whatever trains: `engram train` (`train.py`) and `engram adapt` (`adapt.py`) both build a `Run`
and hand it to the same units here.

    open_run    settings -> prepared data, run directory (run.json), an empty `Run`
    (the caller builds the model: a preset's EngramForCausalLM, or a base with an adapter / LoRA)
    finish_build  tables placed (parameters, memory-mapped files, row shards; journals started), optimizers,
                the batcher (hash ids and table read-ahead on its thread), validation windows
    execute     restore or log step 0 -> loop (train_step, evaluate, save, Ctrl-C) -> finish (final folder,
                loss plot, summary.json); every metrics record through `Run.log`: metrics.jsonl and the trackers
                of `report_to` (`tracking.py`: TensorBoard, trackio)

So every table option (`table_mode`, `table_dir`, `table_cache_mb`, `table_init`, `table_readahead`)
means the same in both commands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import ConfigError
from ..distributed.parallel import DistContext
from ..memory import defer_table_allocation
from ..model import EngramForCausalLM, update_expert_bias
from ..persist import (
    append_jsonl,
    atomic_file,
    read_json,
    read_jsonl,
    write_json,
    write_jsonl,
)
from ..tables import TableError, offload_tables, readahead_for, table_file
from ..tables.base import find_tables
from ..utils import environment, peak_rss_mib
from .checkpoint import (
    CheckpointError,
    checkpoints,
    durable_tables,
    load_checkpoint,
    save_checkpoint,
)
from .config import TrainConfig, current_settings
from .data import Batcher, eval_windows, load_manifest, load_split, prepare
from .optim import build_optimizers, split_params, warmup_cosine
from .tracking import Trackers, resumed_report_to


@dataclass
class Run:
    """Everything one run holds between its units (build, restore, step, evaluate, checkpoint, finish)."""

    tcfg: TrainConfig
    run_dir: Path
    manifest: dict  # the prepared data's description (`data.load_manifest`)
    data_dir: Path
    ddp: DistContext
    progress: bool = True
    model: torch.nn.Module | None = None
    step_model: torch.nn.Module | None = None  # what a training step calls: the model or its DDP wrapper
    write_final: Callable[[torch.nn.Module], Path] | None = None  # the trained model -> its final folder
    feed_hashes: bool = True  # the batcher's hash ids go into the forward (an attached adapter hashes in its own)
    only_trainable: bool = False  # checkpoints hold the trainable parameters only (adapters: the base is frozen)
    mcfg: object = None  # `engram train`: the model config (rebuilds the model to gather a sharded one)
    n_params: int = 0
    n_table: int = 0  # of which in Engram tables (trained rows)
    counts: dict = dataclasses.field(default_factory=dict)  # adapter runs: `engram.adapters.trainable_summary`
    opts: dict = dataclasses.field(default_factory=dict)
    dense_params: list = dataclasses.field(default_factory=list)  # clipped each step
    batcher: Batcher | None = None
    val: np.ndarray | None = None  # (W, seq_len) validation windows
    tables: dict = dataclasses.field(default_factory=dict)  # durable tables: {layer: Table} (files, shards)
    trackers: Trackers = dataclasses.field(default_factory=Trackers)  # --report-to (rank 0; opened by `execute`)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def log(self, rec: dict) -> None:
        if self.ddp.is_main:
            append_jsonl(self.metrics_path, rec)
            self.trackers.log(rec)

    def autocast(self):
        dev = self.ddp.device
        if dev.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)


def read_run_file(run_dir: Path, name: str = "run.json") -> dict:
    """`run_dir/name` of a training run (`run.json`: its settings, `summary.json`: its results), or a one-line
    `CheckpointError` saying to delete the run's folder and train it again."""
    return read_json(Path(run_dir) / name, "run file", f"delete {run_dir} and run the command that wrote it again",
                     CheckpointError)


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, skipping blank, torn (a kill while appending) or damaged lines."""
    return [r for r in read_jsonl(path, "metrics", skip_damaged=True)
            if isinstance(r, dict) and isinstance(r.get("step"), int)]


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


# ------------------------------------------------------------------------------------ building
def setup_run(out, run_json: dict, resume: bool, same: tuple[str, ...]) -> Path:
    """The run directory of a new or resumed run (`engram train` and `engram adapt` alike); writes run.json.

    A new run needs an --out without checkpoints. A resumed one must have been started with the same
    `same` settings of run.json, the same kind ("train" / "adapt") and the same table mode (a run.json written
    before the rename, `"table_backend": "param"`, reads as `"table_mode": "ram"`); a corrupt run.json is one
    line saying how to resume anyway (the checkpoints are verified on their own).
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
        prev_mode = current_settings(prev["train"], warn=False).get("table_mode", "ram")
        if prev_mode != current_settings(run_json["train"], warn=False)["table_mode"]:
            raise ConfigError(f"--resume: {run_dir} was trained with table_mode={prev_mode}; use the same setting")
        empty = {"model_overrides": {}, "engram_options": {}, "unfreeze": []}
        diff = [k for k in same if prev.get(k, empty.get(k)) != run_json.get(k)]
        if diff:
            raise ConfigError(f"--resume: {run_dir} was started with "
                              + " ".join(f"{k}={prev.get(k, empty.get(k))}" for k in diff) + "; use the same flags")
    elif not resume and checkpoints(run_dir):
        raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "run.json", run_json)
    return run_dir


def open_run(tcfg: TrainConfig, data, out, run_json: dict, same: tuple[str, ...], resume: bool, ddp: DistContext,
             progress: bool) -> Run:
    """Prepare the data (tokenized with `tcfg.tokenizer`), set up the run directory (`run_json`: the kind's own
    settings; `same`: those a --resume must match) and return the run, still without a model."""
    tcfg = resumed_report_to(tcfg, out) if resume else tcfg  # (naming no trackers: those the run was started with)
    data_dir = prepare(data, tcfg.tokenizer, progress=progress)
    run_json = {**run_json, "data": data, "train": dataclasses.asdict(tcfg), "data_dir": str(data_dir)}
    run_dir = setup_run(out, run_json, resume, same)
    return Run(tcfg, run_dir, load_manifest(data_dir), data_dir, ddp, progress=progress and ddp.is_main)


def tables_as_files(tcfg: TrainConfig) -> bool:
    """`table_init=file`: the model is built without table rows (`defer_table_allocation`); its table files are
    created from the seed, so a table larger than RAM is never materialized."""
    return tcfg.table_mode == "mmap" and tcfg.table_init == "file"


def building(tcfg: TrainConfig):
    """The context to build the model (or attach the adapter) in: `defer_table_allocation` under `table_init=file`."""
    return defer_table_allocation() if tables_as_files(tcfg) else contextlib.nullcontext()


def finish_build(run: Run, resume: bool, mapping=None) -> Run:
    """What every run does once its model exists: place the tables, start their journals, build the optimizers,
    the batcher and the validation windows.

    `mapping`: the `NgramHashMapping` the model hashes with (None: no Engram). The batcher hashes the next batch
    with it on its thread, for the forward (`run.feed_hashes`) and for the table read-ahead (`table_readahead`).
    """
    tcfg = run.tcfg
    place_tables(run, resume)
    run.opts = build_optimizers(run.model, tcfg.lr, tcfg.weight_decay, tcfg.table_lr_mult)
    run.dense_params = [p for _, p in split_params(run.model)[0]]
    readahead = readahead_for(run.model) if tcfg.table_readahead else None
    run.batcher = Batcher(load_split(run.data_dir, "train"), tcfg.seq_len, tcfg.batch_size, seed=tcfg.seed,
                          hash_mapping=mapping if run.feed_hashes or readahead is not None else None,
                          readahead=readahead)
    run.val = eval_windows(load_split(run.data_dir, "val"), tcfg.seq_len, tcfg.eval_max_windows)
    return run


def place_tables(run: Run, resume: bool) -> None:
    """Tables stay parameters, move into memory-mapped files, or are row-sharded over ranks (then DDP/FSDP2)."""
    tcfg, ddp = run.tcfg, run.ddp
    table_dir = Path(tcfg.table_dir) if tcfg.table_dir else run.run_dir / "tables"
    layers = [m.layer_id for _, m in find_tables(run.model)]
    mmap = tcfg.table_mode == "mmap" and bool(layers)
    table_kw = dict(cache_bytes=int(tcfg.table_cache_mb * 2**20), overwrite=not resume,
                    init_seed=tcfg.seed if tables_as_files(tcfg) else None)
    if mmap and ddp.world == 1:
        if resume:
            missing = [str(f) for f in (table_file(table_dir, lid) for lid in layers) if not f.is_file()]
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


# ------------------------------------------------------------------------------------ running
def execute(run: Run, resume: bool, stop_after: int | None, describe: Callable[[Run], str]) -> dict:
    """Restore (or log step 0), train to max_steps, finish; returns the summary. `describe(run)`: the line printed
    before training (what trains, on what)."""
    step = restore(run) if resume else 0
    run.trackers = Trackers(run.tcfg.report_to if run.ddp.is_main else "", run.run_dir, step,
                            dataclasses.asdict(run.tcfg))
    with run.trackers:  # (closed however the run ends)
        if run.progress:
            print(describe(run))
        if step == 0:
            log_start(run)
        return finish(run, *loop(run, step, stop_after))


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
        write_jsonl(run.metrics_path, [r for r in read_metrics(run.metrics_path) if r["step"] <= step])
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
    hashes = {k: v.to(dev, non_blocking=True) for k, v in hashes.items()} if hashes and run.feed_hashes else None
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

    `stop_after` simulates an interruption (tests): stop and checkpoint after that many steps.
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
    final = run.write_final(model)
    summary = {"step": step, "train_loss": last_loss, "val_loss": last_val, "run_dir": str(run.run_dir),
               "final": str(final), "plot": str(plot) if plot else None, "params": run.n_params,
               "table_params": run.n_table, "world_size": run.ddp.world, "peak_rss_mib": peak_rss_mib()}
    if run.ddp.device.type == "cuda":
        summary["cuda_peak_mib"] = torch.cuda.max_memory_allocated(run.ddp.device) / 2**20
    if table_stats:
        summary["table_cache"] = table_stats
    summary["environment"] = environment()  # versions, threads, CPU, commit: what "reproduces" depends on
    write_json(run.run_dir / "summary.json", summary)
    return summary


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
    with atomic_file(out) as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


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
