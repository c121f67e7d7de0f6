"""Checkpoints of a training run: written atomically, verified by hash, loadable at any world size.

    RUN/checkpoints/step_NNNNNN/
        model.safetensors   model weights (a sharded run: dense weights only, full tensors)
        optim.safetensors   optimizer moments and the torch RNG state
        state.json          step, data position, optimizer groups
        engram_manifest.json  size and sha256 of every file (written last; older checkpoints list them in state.json)
        tables/<module>/shard_<rank>.safetensors   a sharded run's table rows + moments, with row ranges

A checkpoint is written to a temp folder and moved into place with `persist.replace_dir`; a
truncated or corrupt one is detected by its manifest. Nothing is unpickled: tensors are safetensors, metadata is
JSON. Tables kept in memory-mapped files are not copied: the files are flushed before the checkpoint commits
and their undo journals restart at its step (`engram.tables.MmapTable.commit`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from ..distributed.parallel import DistContext
from ..distributed.sharded import ShardedTable, load_sharded, save_sharded
from ..errors import EngramError
from ..memory import is_table_key
from ..persist import (
    read_json,
    recover_dir,
    remove_tree,
    replace_dir,
    verify_saved,
    write_json,
    write_manifest,
)
from ..tables.base import find_tables, installed_tables
from .optim import TableAdam


class CheckpointError(EngramError, ValueError):
    """A checkpoint is missing, truncated or corrupt; the message names the file."""


def _optim_tensors(sds: dict) -> tuple[dict, dict]:
    """{name: optimizer state_dict} -> (tensors for safetensors, JSON meta)."""
    tensors, meta = {}, {}
    for name, sd in sds.items():
        meta[name] = {"param_groups": sd["param_groups"], "state_keys": {}}
        for idx, st in sd["state"].items():
            meta[name]["state_keys"][str(idx)] = {}
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"{name}.{idx}.{k}"] = v.detach().cpu().contiguous()
                    meta[name]["state_keys"][str(idx)][k] = "tensor"
                else:
                    meta[name]["state_keys"][str(idx)][k] = v
    return tensors, meta


def _optim_state(name: str, tensors: dict, meta: dict) -> dict:
    """The optimizer state_dict `name` saved by `_optim_tensors`."""
    m = meta[name]
    state = {}
    for idx, keys in m["state_keys"].items():
        state[int(idx)] = {k: (tensors[f"{name}.{idx}.{k}"] if v == "tensor" else v) for k, v in keys.items()}
    return {"state": state, "param_groups": m["param_groups"]}


def _load_optim(opts: dict, tensors: dict, meta: dict) -> None:
    for name, opt in opts.items():
        opt.load_state_dict(_optim_state(name, tensors, meta))


def _dedup(sd: dict) -> dict:
    """Drop later names of tensors sharing storage (tied weights), as safetensors requires."""
    seen, out = set(), {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if v.numel() and key in seen:
            continue
        seen.add(key)
        out[k] = v.contiguous()
    return out


def durable_tables(model) -> dict:
    """{layer_id: table} of the tables that keep their own trained rows (files, trainable RAM tables, file-backed
    shards): a checkpoint flushes them and starts their undo journals; resume rolls them back."""
    return {lid: t for lid, t in installed_tables(model).items() if t.trainable}


def save_checkpoint(run_dir: Path, step: int, model, opts: dict, batcher_state: dict, keep: int = 2,
                    ddp=None, only_trainable: bool = False) -> Path:
    """Write checkpoint `step` into a temp folder and rename it into place.

    Tables that keep their own rows (`durable_tables`) are flushed before the checkpoint is
    committed and start their undo journal at `step` after it (`engram.tables.MmapTable.commit`). In a sharded run
    (`ddp` with world > 1, every rank calls this) each rank writes its table rows and their Adam moments
    to `tables/<module>/shard_<rank>.safetensors` with their global row range, rank 0 writes the
    dense weights and optimizer, so the checkpoint loads at any world size. `only_trainable`: the weights
    file holds only the parameters that train (an adapter run: not the frozen base).
    """
    sharded = ddp is not None and ddp.world > 1
    main = ddp is None or ddp.is_main
    ckdir = run_dir / "checkpoints"
    final = ckdir / f"step_{step:06d}"
    tmp = ckdir / (f".tmp_step_{step:06d}" if sharded else f".tmp_step_{step:06d}_{os.getpid()}")
    durable = durable_tables(model)
    for table in durable.values():  # every rank: table files hold the state of `step` on disk
        table.flush()
    if main:
        ckdir.mkdir(parents=True, exist_ok=True)
        remove_tree(tmp)  # a leftover of a crashed save
        tmp.mkdir()
    # shards held as parameters are saved here; file-backed shards are durable tables of their own
    param_shards = [(n, m) for n, m in find_tables(model)
                    if isinstance(m.table, ShardedTable) and m.table.local_table is None]
    if sharded:
        ddp.barrier()
        for name, mhe in param_shards:
            save_sharded(mhe.table, tmp / "tables" / name, opts.get("tables"))
        dense_sd = ddp.dense_state_dict(model)  # full tensors (collective under FSDP2), tables left out
        dense_osd = ddp.optim_state_dict(model, opts["dense"])
        ddp.barrier()
    if main:
        dense = (dense_sd, dense_osd) if sharded else None
        _commit(tmp, final, step, model, opts, batcher_state, dense, param_shards, durable, only_trainable)
        for old in sorted(ckdir.glob("step_*"))[:-keep]:
            with contextlib.suppress(OSError):  # (one left behind is deleted at the next checkpoint)
                remove_tree(old)
    if sharded:
        ddp.barrier()
    for table in durable.values():
        table.commit(step)
    return final


def _trainable_state(model) -> dict:
    return _dedup({n: p.detach() for n, p in model.named_parameters() if p.requires_grad})


def _commit(tmp: Path, final: Path, step: int, model, opts: dict, batcher_state: dict, dense, param_shards: list,
            durable: dict, only_trainable: bool = False) -> None:
    """Rank 0: write weights, optimizer and RNG into `tmp`, hash every file into state.json, rename to `final`.

    `dense` is (dense weights, dense optimizer state) gathered from a sharded run, or None (one process).
    """
    from safetensors.torch import save_file, save_model

    if dense is not None:
        save_file(_dedup(dense[0]), str(tmp / "model.safetensors"))
        osds = {"dense": dense[1]}
        if isinstance(opts.get("tables"), TableAdam):  # file-backed shards: step counts (equal on all ranks)
            osds["tables"] = opts["tables"].state_dict()
        tensors, meta = _optim_tensors(osds)
    elif only_trainable:
        save_file(_trainable_state(model), str(tmp / "model.safetensors"))
        tensors, meta = _optim_tensors({k: o.state_dict() for k, o in opts.items()})
    else:
        save_model(model, str(tmp / "model.safetensors"))
        tensors, meta = _optim_tensors({k: o.state_dict() for k, o in opts.items()})
    tensors["rng.torch"] = torch.get_rng_state()
    save_file(tensors, str(tmp / "optim.safetensors"))
    state = {"step": step, "batcher": batcher_state, "optim": meta}
    if dense is not None:
        state["sharded_tables"] = {name: f"tables/{name}" for name, _ in param_shards}
    table_files = {str(k): str(t.path) for k, t in durable.items() if getattr(t, "path", None) is not None}
    if table_files:
        state["table_store"] = table_files
    write_json(tmp / "state.json", state, indent=None)
    write_manifest(tmp)  # last: a checkpoint without a complete manifest is not one
    replace_dir(tmp, final)


def read_checkpoint(path: Path) -> dict:
    """Verify a checkpoint folder and return its state (raises CheckpointError naming the problem)."""
    path = Path(path)
    recover_dir(path)
    sf = path / "state.json"
    if not sf.is_file():
        raise CheckpointError(f"{sf} is missing (checkpoint incomplete)")
    state = read_json(sf, "checkpoint state", "resume from an earlier checkpoint", CheckpointError)
    # the manifest lists every file (state.json held the digests before 0.2)
    verify_saved(path, state.get("files"), "checkpoint", "resume from an earlier checkpoint", CheckpointError)
    return state


def load_checkpoint(path: Path, model, opts: dict, ddp=None, only_trainable: bool = False) -> dict:
    """Restore model, optimizers and RNG from a verified checkpoint (either layout, any world size)."""
    from safetensors.torch import load_file, load_model

    state = read_checkpoint(path)
    try:
        tensors = load_file(str(path / "optim.safetensors"))
        if only_trainable:  # the trained parameters only: the rest (a frozen base) comes from where it was loaded
            sd, want = load_file(str(path / "model.safetensors")), set(_trainable_state(model))
            if set(sd) != want:
                raise CheckpointError(f"{path / 'model.safetensors'} holds other parameters than this run trains: "
                                      f"missing {sorted(want - set(sd))[:3]}, unexpected {sorted(set(sd) - want)[:3]}")
            model.load_state_dict(sd, strict=False)
            _load_optim(opts, tensors, state["optim"])
        elif ("sharded_tables" not in state
              and not any(isinstance(m.table, ShardedTable) for _, m in find_tables(model))):
            load_model(model, str(path / "model.safetensors"))
            _load_optim(opts, tensors, state["optim"])
        else:
            _load_resharded(path, state, model, opts, tensors, ddp)
    except CheckpointError:
        raise
    except Exception as e:
        if os.environ.get("ENGRAM_DEBUG"):
            raise
        raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: {e}") from None
    torch.set_rng_state(tensors["rng.torch"])
    return state


def _load_resharded(path: Path, state: dict, model, opts: dict, tensors: dict, ddp=None) -> None:
    """Load a checkpoint whose tables are sharded, or into a model whose tables are (any world size)."""
    from safetensors.torch import load_file

    sd = load_file(str(path / "model.safetensors"))
    dense = {k: v for k, v in sd.items() if not is_table_key(k)}
    ddp = ddp or DistContext(torch.device("cpu"))
    missing, unexpected = ddp.load_dense_state_dict(model, dense)
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    tied_loaded = {n for group in names.values() if any(k in dense for k in group) for n in group}
    missing = [k for k in missing if not is_table_key(k) and k not in tied_loaded]
    if missing or unexpected:  # (tied weights are stored once: another name of the same parameter is loaded)
        raise CheckpointError(f"{path / 'model.safetensors'}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    ddp.load_optim_state_dict(model, opts["dense"], _optim_state("dense", tensors, state["optim"]))
    if isinstance(opts.get("tables"), TableAdam):
        if "tables" not in state["optim"]:
            raise CheckpointError(f"{path} has no table optimizer state for memory-mapped table shards")
        opts["tables"].load_state_dict(_optim_state("tables", tensors, state["optim"]))
    topt = opts.get("tables")
    params = topt.param_groups[0]["params"] if topt is not None and not isinstance(topt, TableAdam) else []
    for name, mhe in find_tables(model):
        shard = mhe.table if isinstance(mhe.table, ShardedTable) else None
        if shard is not None and shard.local_table is not None:
            continue  # rows and moments live in this rank's table file (rolled back by its journal)
        p = shard.weight if shard is not None else mhe.embedding.weight
        lo, hi = (shard.lo, shard.hi) if shard is not None else (0, p.shape[0])
        if "sharded_tables" in state:
            d = path / state["sharded_tables"][name]
            rows = load_sharded(d, lo, hi)
            step = read_json(next(iter(sorted(d.glob("shard_*.json")))), "table shard", "resume from an earlier "
                             "checkpoint", CheckpointError)["step"]
            w, m, v = rows["weight"], rows.get("exp_avg"), rows.get("exp_avg_sq")
        else:  # single-process checkpoint: full tables in model.safetensors, moments in optim.safetensors
            w = sd[f"{name}.embedding.weight"][lo:hi]
            idx = next((i for i, q in enumerate(params) if q is p), None)
            key = f"tables.{idx}."
            m = tensors[key + "exp_avg"][lo:hi] if key + "exp_avg" in tensors else None
            v = tensors[key + "exp_avg_sq"][lo:hi] if m is not None else None
            step = float(tensors[key + "step"]) if m is not None else 0
        if w.shape != p.shape:
            raise CheckpointError(f"{path}: table {name} rows [{lo}, {hi}) have shape {list(w.shape)}, "
                                  f"the model needs {list(p.shape)}")
        with torch.no_grad():
            p.copy_(w)
        if topt is not None and m is not None and step:
            topt.state[p] = {"step": torch.tensor(float(step), dtype=torch.float64),
                             "exp_avg": m.clone().to(p.device), "exp_avg_sq": v.clone().to(p.device)}


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders, newest first (an interrupted replacement is resolved first)."""
    ckdir = Path(run_dir) / "checkpoints"
    for aside in ckdir.glob(".step_*.replaced"):
        recover_dir(ckdir / aside.name[1:-len(".replaced")])
    return sorted(ckdir.glob("step_*"), reverse=True)
