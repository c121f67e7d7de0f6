"""Training loop: `engram train` and the library call `train(...)`.

One run directory holds everything:
    DIR/run.json           model + training config of the run
    DIR/metrics.jsonl      one JSON object per step: step, train_loss, lr, tok_s (+ val_loss on eval steps)
    DIR/checkpoints/step_NNNNNN/   model.safetensors, optim.safetensors, state.json (with file hashes)
    DIR/loss.png           loss curves (matplotlib, if installed)
    DIR/final/             save_pretrained output + tokenizer.json (AutoModelForCausalLM-loadable)

Checkpoints (`checkpoint.py`) are written to a temp folder and renamed, with every file's sha256
in `state.json`; `--resume` falls back to the previous one if the newest is corrupt. Ctrl-C
finishes the step and saves a checkpoint. Resuming restores weights, optimizer moments, the MoE
biases, the data position and the RNG, so the loss curve continues exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checkpoint import CheckpointError, _tables, checkpoints, load_checkpoint, save_checkpoint
from .config import ConfigError
from .data import Batcher, eval_windows, load_manifest, load_split, prepare
from .optim import build_optimizers, split_params, warmup_cosine
from .utils import atomic_write_bytes


@dataclass
class TrainConfig:
    tokenizer: str = "bpe:8192"
    seq_len: int = 256
    batch_size: int = 16
    max_steps: int = 1500
    lr: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    table_lr_mult: float = 5.0
    grad_clip: float = 1.0
    eval_every: int = 0  # 0: every 10% of the run
    eval_max_windows: int = 128
    ckpt_every: int = 250
    keep_checkpoints: int = 2
    seed: int = 0
    table_backend: str = "param"  # param: tables are parameters in RAM / on device; mmap: memory-mapped files
    table_cache_mb: float = 0.0  # mmap: hot-row cache size
    table_dir: str = ""  # mmap: where the table files live (default RUN_DIR/tables)
    table_init: str = "model"  # mmap: model (init in RAM, then written: same run as param) | file (streamed, never in RAM)
    dense_parallel: str = "ddp"  # --nproc > 1: ddp (replicated dense weights) or fsdp2 (sharded)

    def validate(self) -> None:
        for f in ("seq_len", "batch_size", "max_steps", "keep_checkpoints"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f} must be positive, got {getattr(self, f)}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if self.table_backend not in ("param", "mmap"):
            raise ConfigError(f"table_backend must be 'param' or 'mmap', got {self.table_backend!r}")
        if self.table_init not in ("model", "file"):
            raise ConfigError(f"table_init must be 'model' or 'file', got {self.table_init!r}")
        if self.table_init == "file" and self.table_backend != "mmap":
            raise ConfigError("table_init=file needs table_backend=mmap (the tables are created as files)")
        if self.dense_parallel not in ("ddp", "fsdp2"):
            raise ConfigError(f"dense_parallel must be 'ddp' or 'fsdp2', got {self.dense_parallel!r}")
        if self.table_cache_mb < 0:
            raise ConfigError(f"table_cache_mb must be >= 0, got {self.table_cache_mb}")


def _step_of(line: str) -> int | None:
    """The step of a metrics.jsonl line, or None for a blank or torn one (a kill while appending)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------------ model building
def build_model_config(preset: str, manifest: dict, use_engram: bool = True, baseline: str | None = None,
                       model_overrides: dict | None = None):
    from . import presets

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


def _plot(run_dir: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
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
    tmp = run_dir / ".final.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    old = dict(model.config.engram)
    model.config.engram = {**old, "tokenizer_name_or_path": "tokenizer.json"}
    try:
        model.save_pretrained(tmp)
    finally:
        model.config.engram = old
    backed = {f"{name}.embedding.weight": m.backend for name, m in _tables(model) if m.backend is not None}
    if backed:  # tables in files: stream their rows into model.safetensors, a block at a time
        from safetensors import safe_open

        from .tables.backends import tensor_entry, write_safetensors

        f = tmp / "model.safetensors"
        with safe_open(str(f), framework="pt") as st:
            meta, small = st.metadata(), {k: st.get_tensor(k) for k in st.keys()}
        missing = set(backed) - set(small)
        if missing:
            raise CheckpointError(f"save_final: {f} lacks the table entries {sorted(missing)}")
        write_safetensors(f, [tensor_entry(k, backed[k].weight if k in backed else v) for k, v in small.items()], meta)
    shutil.copy(manifest["tokenizer_file"], tmp / "tokenizer.json")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


# ------------------------------------------------------------------------------------ the loop
def train_config(preset: str, overrides: dict | None = None, max_steps: int | None = None,
                 world: int = 1) -> TrainConfig:
    """The validated training settings of a run: the preset's, then `overrides`, then `max_steps`.

    `world` > 1 also checks what data-parallel runs need (batch divisible, tables shardable).
    """
    from . import presets

    base = presets.train_config(preset)
    unknown = set(overrides or {}) - {f.name for f in dataclasses.fields(TrainConfig)}
    if unknown:
        raise ConfigError(f"unknown training settings {sorted(unknown)}")
    tcfg = dataclasses.replace(base, **(overrides or {}))
    if max_steps is not None:
        tcfg = dataclasses.replace(tcfg, max_steps=max_steps)
    tcfg.validate()
    if world > 1:
        if tcfg.batch_size % world:
            raise ConfigError(f"batch_size {tcfg.batch_size} does not divide by --nproc {world}; "
                              f"use --set batch_size=N with N a multiple of {world}")
    return tcfg


def train(preset: str = "cpu-small", data: list[str] | None = None, out: str | os.PathLike = "runs/cpu-small",
          max_steps: int | None = None, use_engram: bool = True, baseline: str | None = None, resume: bool = False,
          device: str | None = None, overrides: dict | None = None, progress: bool = True,
          stop_after: int | None = None, model_overrides: dict | None = None) -> dict:
    """Train a preset on `data` (default: Shakespeare) into run dir `out`; returns a summary dict.

    `stop_after` simulates an interruption (tests): stop and checkpoint after that many steps.
    """
    from tqdm.auto import tqdm

    from .model import EngramForCausalLM

    from .distributed.parallel import DistContext

    ddp = DistContext(torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    dev = ddp.device  # under torchrun on GPUs: cuda:LOCAL_RANK
    tcfg = train_config(preset, overrides, max_steps, world=ddp.world)
    run_dir = Path(out)
    data_dir = prepare(data, tcfg.tokenizer, progress=progress)
    manifest = load_manifest(data_dir)
    run_json = {"preset": preset, "data": data, "use_engram": use_engram, "baseline": baseline,
                "model_overrides": model_overrides or {}, "train": dataclasses.asdict(tcfg), "data_dir": str(data_dir)}
    if resume and (run_dir / "run.json").is_file():
        prev = json.loads((run_dir / "run.json").read_text())
        keys = ("preset", "use_engram", "baseline", "model_overrides")
        same_backend = prev.get("train", {}).get("table_backend", "param") == tcfg.table_backend
        if not same_backend:
            raise ConfigError(f"--resume: {run_dir} was trained with table_backend="
                              f"{prev['train'].get('table_backend', 'param')}; use the same setting")
        if {k: prev.get(k, {} if k == "model_overrides" else None) for k in keys} != {k: run_json[k] for k in keys}:
            raise ConfigError(f"--resume: {run_dir} was started with preset={prev.get('preset')} "
                              f"use_engram={prev.get('use_engram')} baseline={prev.get('baseline')}; use the same flags")
    elif not resume and checkpoints(run_dir):
        raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / "run.json", json.dumps(run_json, indent=1).encode())

    torch.manual_seed(tcfg.seed)
    mcfg = build_model_config(preset, manifest, use_engram=use_engram, baseline=baseline,
                              model_overrides=model_overrides)
    from .memory import MultiHeadEmbedding, defer_table_allocation, is_table_key

    file_init = tcfg.table_backend == "mmap" and tcfg.table_init == "file"
    with defer_table_allocation() if file_init else contextlib.nullcontext():
        model = EngramForCausalLM(mcfg).to(dev).train()
    # counted before the tables move to files or shards
    tables = [m for m in model.modules() if isinstance(m, MultiHeadEmbedding)]
    n_table = sum(m.num_rows * m.embedding_dim for m in tables if m.embedding.weight.requires_grad)  # trained rows
    n_params = (sum(p.numel() for n, p in model.named_parameters() if not is_table_key(n))
                + sum(m.num_rows * m.embedding_dim for m in tables))
    table_dir = Path(tcfg.table_dir) if tcfg.table_dir else run_dir / "tables"
    mmap = tcfg.table_backend == "mmap" and use_engram
    table_kw = dict(cache_bytes=int(tcfg.table_cache_mb * 2**20), init_seed=tcfg.seed if file_init else None,
                    overwrite=not resume)
    stores = {}
    if mmap and ddp.world == 1:
        from .tables import offload_tables, table_file

        if resume:
            missing = [str(f) for f in (table_file(table_dir, l) for l in mcfg.engram["layer_ids"]) if not f.is_file()]
            if missing:
                raise CheckpointError(f"--resume: table files missing: {', '.join(missing)}")
        stores = offload_tables(model, "mmap", table_dir, trainable=True, **table_kw)
    # with --nproc and mmap tables each rank keeps its shard in its own journaled file (ddp.stores)
    shard_files = dict(table_dir=table_dir, **table_kw) if mmap and ddp.world > 1 else {}
    step_model = ddp.parallelize(model, tcfg.dense_parallel, **shard_files)  # the model itself: 1 process / FSDP2
    stores = stores or ddp.stores
    if not resume:
        for tb in stores.values():
            tb.commit(0)  # start each undo journal at step 0
    opts = build_optimizers(model, tcfg.lr, tcfg.weight_decay, tcfg.table_lr_mult)
    progress = progress and ddp.is_main
    batcher = Batcher(load_split(data_dir, "train"), tcfg.seq_len, tcfg.batch_size, seed=tcfg.seed,
                      hash_mapping=model.model.mapping)
    val = eval_windows(load_split(data_dir, "val"), tcfg.seq_len, tcfg.eval_max_windows)
    eval_every = tcfg.eval_every or max(1, tcfg.max_steps // 10)

    step, saved_at = 0, None  # saved_at: the step the newest checkpoint on disk holds
    metrics_path = run_dir / "metrics.jsonl"
    if resume:
        cks = checkpoints(run_dir)
        if not cks:
            raise CheckpointError(f"--resume: no checkpoints under {run_dir / 'checkpoints'}")
        for i, ck in enumerate(cks):
            try:
                st = load_checkpoint(ck, model, opts, ddp)
                break
            except CheckpointError as e:
                if i + 1 == len(cks):
                    raise CheckpointError(f"no usable checkpoint in {run_dir}: {e}") from None
                print(f"engram: warning: {e}; falling back to {cks[i + 1].name}")
        step = saved_at = st["step"]
        from .tables.backends import TableError

        for tb in stores.values():  # roll each table file back to the checkpoint (undo journal)
            try:
                n = tb.recover(step)
            except TableError as e:
                raise CheckpointError(f"--resume from {ck.name}: {e}") from None
            if n and progress:
                print(f"restored {n:,} rows of {tb.path.name} to step {step} from its journal")
        batcher.load_state_dict(st["batcher"])
        if metrics_path.is_file():  # drop metrics past the checkpoint: the resumed run rewrites them
            keep = [l for l in metrics_path.read_text().splitlines()
                    if (n := _step_of(l)) is not None and n <= step]
            atomic_write_bytes(metrics_path, ("\n".join(keep) + "\n" if keep else "").encode())
        print(f"resumed {run_dir} at step {step}")
    elif metrics_path.exists():
        metrics_path.unlink(missing_ok=True)

    if progress:
        print(f"model: {n_params / 1e6:.2f}M parameters ({n_table / 1e6:.2f}M in Engram tables), "
              f"train {manifest['splits']['train']['tokens']:,} tokens, val windows {len(val)}, device {dev}")

    def log(rec):
        if ddp.is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    dense_params = [p for _, p in split_params(model)[0]]
    if step == 0:
        ids0, _ = Batcher(load_split(data_dir, "train"), tcfg.seq_len, tcfg.batch_size, seed=tcfg.seed,
                          prefetch=False).next()
        with torch.no_grad(), autocast:
            model.eval()
            first = model(ids0.to(dev), labels=ids0.to(dev)).loss.item()
            model.train()
        log({"step": 0, "train_loss": first, "val_loss": evaluate(model, val, tcfg.batch_size, dev)})
    bar = tqdm(total=tcfg.max_steps, initial=step, disable=not progress, desc="train", dynamic_ncols=True)
    t_last, last_loss, last_val = time.perf_counter(), float("nan"), None
    interrupted = aborted = in_step = False
    stop = _StopRequest()
    try:
        while step < tcfg.max_steps:
            if ddp.any(stop.requested or (stop_after is not None and step >= stop_after)):
                raise KeyboardInterrupt
            in_step = True
            ids, hashes = ddp.local_batch(*batcher.next())
            ids = ids.to(dev)
            hashes = {k: v.to(dev, non_blocking=True) for k, v in hashes.items()} if hashes else None
            mult = warmup_cosine(step, tcfg.max_steps, tcfg.warmup_steps, tcfg.min_lr_ratio)
            for o in opts.values():
                for g in o.param_groups:
                    g["lr"] = g["base_lr"] * mult
            with autocast:
                loss = step_model(ids, labels=ids, hash_ids=hashes).loss
            for o in opts.values():
                o.zero_grad(set_to_none=True)
            loss.backward()
            if tcfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(dense_params, tcfg.grad_clip)
            for o in opts.values():
                o.step()
            step += 1
            in_step = False
            last_loss = ddp.mean(loss.item())
            if not math.isfinite(last_loss):
                raise FloatingPointError(f"loss became {last_loss} at step {step}; lower --lr or check the data")
            now = time.perf_counter()
            rec = {"step": step, "train_loss": last_loss, "lr": opts["dense"].param_groups[0]["lr"],
                   "tok_s": ids.numel() * ddp.world / max(now - t_last, 1e-9)}
            t_last = now
            if step % eval_every == 0 or step == tcfg.max_steps:
                last_val = rec["val_loss"] = evaluate(model, val, tcfg.batch_size, dev)
                t_last = time.perf_counter()
            log(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{last_loss:.3f}", val=f"{last_val:.3f}" if last_val else "-",
                            tok_s=f"{rec['tok_s']:.0f}")
            if step % tcfg.ckpt_every == 0 and step < tcfg.max_steps:
                save_checkpoint(run_dir, step, model, opts, batcher.consumed_state(), tcfg.keep_checkpoints,
                                stores=stores, ddp=ddp)
                saved_at = step
    except KeyboardInterrupt:
        interrupted, aborted = True, in_step
    finally:
        stop.close()
        bar.close()
    if aborted:  # a second Ctrl-C inside a step: the weights are half-updated, do not checkpoint them
        for tb in stores.values():
            tb.close()
        print(f"aborted during step {step + 1}; no checkpoint written; --resume continues from the last one")
        return {"interrupted": True, "step": step, "run_dir": str(run_dir)}
    if step != saved_at:  # (never replace a checkpoint by an identical one: the old one is gone meanwhile)
        save_checkpoint(run_dir, step, model, opts, batcher.consumed_state(), tcfg.keep_checkpoints,
                        stores=stores, ddp=ddp)
    table_stats = {str(k): tb.stats() for k, tb in stores.items()}
    if ddp.world > 1:
        model = ddp.unshard(model, lambda: EngramForCausalLM(mcfg))
        del step_model  # free the DDP reducer while its process group is alive: its destructor can hang after
        import gc

        gc.collect()
        ddp.close()  # before saving: transformers' save_pretrained must not see a process group others left
        if not ddp.is_main:
            return {"step": step, "train_loss": last_loss, "run_dir": str(run_dir), "world_size": ddp.world,
                    **({"interrupted": True} if interrupted else {})}
    if interrupted:
        print(f"interrupted at step {step}; checkpoint saved in {run_dir / 'checkpoints'}; continue with --resume")
        return {"interrupted": True, "step": step, "run_dir": str(run_dir)}
    plot = _plot(run_dir)
    final = save_final(model, run_dir, manifest)
    summary = {"step": step, "train_loss": last_loss, "val_loss": last_val, "run_dir": str(run_dir),
               "final": str(final), "plot": str(plot) if plot else None, "params": n_params, "table_params": n_table,
               "world_size": ddp.world}
    if table_stats:
        summary["table_cache"] = table_stats
    atomic_write_bytes(run_dir / "summary.json", json.dumps(summary, indent=1).encode())
    return summary


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
