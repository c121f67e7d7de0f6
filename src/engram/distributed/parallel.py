"""Data-parallel training with row-sharded Engram tables, applied from outside the model.

Under `torchrun` (WORLD_SIZE > 1) `DistContext.parallelize(model)` replaces every Engram table by a
`ShardedTable` (rows split across ranks, lookups and gradients by all-to-all) and, for the dense
parameters, either wraps the model in DistributedDataParallel (`dense="ddp"`) or applies FSDP2
`fully_shard` to every decoder layer and the root (`dense="fsdp2"`: parameters, gradients and
optimizer state sharded too). The sharded tables are left out of both (their gradients already
travel to their owners). `sum` adds a tensor over ranks: the trainer sums MoE expert loads with it,
so the loss-free balancing bias moves as in one process. Each rank trains on its slice of the global
batch; the reported loss is the mean over ranks, so `--nproc N` and `--nproc 1` follow the same
curve at the same global batch.
The state-dict helpers give full (unsharded) dense weights and optimizer state in the
single-process layout whichever wrapper is used, so checkpoints do not depend on it.
With WORLD_SIZE == 1 every method is a no-op.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..memory import is_table_key
from ..tables.base import find_tables, install, uninstall
from ..tables.files import new_table_file, table_file
from ..tables.trainable import MmapTable
from .sharded import ShardedTable, gather_full, shard_range


class DistContext:
    def __init__(self, device: torch.device):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world > 1 and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))  # one GPU per local rank
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.device = device
        self.fsdp = False
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def parallelize(self, model, dense: str = "ddp", table_dir=None, cache_bytes: int = 0,
                    init_seed: int | None = None, overwrite: bool = True):
        """Shard the Engram tables and parallelize the dense parameters (`dense`: "ddp" or "fsdp2").

        Every Engram layer gets a `ShardedTable` installed (`engram.tables.install`). `table_dir`:
        each rank keeps its shard (rows and Adam moments) in a journaled memory-mapped file
        `engram_table_L{layer}.rank{r}-of-{world}.safetensors` there instead of in RAM (written
        from the model's table, or created from `init_seed` when the model was built without one;
        existing files are used when `overwrite` is False).
        Returns the module to call for training steps (the DDP wrapper, or the model itself).
        """
        if dense not in ("ddp", "fsdp2"):
            raise ValueError(f"dense parallelism must be 'ddp' or 'fsdp2', got {dense!r}")
        if self.world == 1:
            return model
        ignore, ignore_params = [], set()
        for name, mhe in find_tables(model):
            W = mhe.embedding.weight
            if table_dir is None:
                table = ShardedTable(W.shape[0], W.shape[1], init=W.detach(), dtype=W.dtype,
                                     grad_scale=1.0 / self.world)
                ignore.append(f"{name}.table.weight")
                ignore_params.add(table.weight)
            else:
                local = self._shard_file(table_dir, mhe, cache_bytes, init_seed, overwrite)
                table = ShardedTable(mhe.num_rows, W.shape[1], dtype=W.dtype, grad_scale=1.0 / self.world,
                                     local_table=local)
            install(mhe, table)
            ignore_params.add(mhe.embedding.weight)
        if dense == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device.type, (self.world,))
            for layer in model.model.layers:  # one all-gather per block, resharded after its forward
                fully_shard(layer, mesh=mesh, ignored_params=ignore_params)
            fully_shard(model, mesh=mesh, ignored_params=ignore_params)
            self.fsdp = True
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
        return DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def _shard_file(self, table_dir, mhe, cache_bytes: int, init_seed, overwrite: bool) -> MmapTable:
        """This rank's rows of one table in a trainable, journaled MmapTable."""
        W = mhe.embedding.weight
        lo, hi = shard_range(mhe.num_rows, self.rank, self.world)
        f = table_file(table_dir, mhe.layer_id, self.rank, self.world)
        if overwrite:
            rows = W.detach()[lo:hi] if W.shape[0] == mhe.num_rows else W.detach()  # (empty: a deferred table)
            seed = None if init_seed is None else init_seed + 1009 * mhe.layer_id + self.rank
            new_table_file(f, rows, hi - lo, seed, with_moments=True, std=mhe.init_std)
        elif not f.is_file():
            raise FileNotFoundError(f"{f} is missing: a run with memory-mapped table shards resumes with the --nproc "
                                    "it was started with")
        local = MmapTable(f, cache_bytes=cache_bytes, writable=True)
        local.trainable = local.requires_grad = W.requires_grad
        return local

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over ranks (a copy; `t` itself with one process), e.g. MoE expert loads for balancing."""
        if self.world == 1:
            return t
        t = t.clone()
        dist.all_reduce(t)
        return t

    # ---- full (unsharded) dense state in the single-process layout, whatever the wrapper
    def dense_state_dict(self, model) -> dict:
        """Dense weights (no Engram tables) as full CPU tensors. Collective under FSDP2 (call on every rank;
        only rank 0 receives them there)."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            sd = model.state_dict()
        return {k: v for k, v in sd.items() if not is_table_key(k)}

    def load_dense_state_dict(self, model, sd: dict):
        """Load full dense weights; returns (missing, unexpected) keys like `load_state_dict(strict=False)`."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            return set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=False))
        return model.load_state_dict(sd, strict=False)

    def _order(self, model, opt) -> list[str]:
        names = {id(p): n for n, p in model.named_parameters()}
        return [names[id(p)] for g in opt.param_groups for p in g["params"]]

    def optim_state_dict(self, model, opt) -> dict:
        """`opt.state_dict()` in torch's index layout, with full tensors (collective under FSDP2; rank 0 gets it)."""
        if not self.fsdp:
            return opt.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not osd:  # with cpu_offload only rank 0 receives the full state
            return {}
        index = {n: i for i, n in enumerate(self._order(model, opt))}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]
        return {"state": {index[n]: st for n, st in osd["state"].items()}, "param_groups": groups}

    def load_optim_state_dict(self, model, opt, sd: dict) -> None:
        if not self.fsdp:
            opt.load_state_dict(sd)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        order = self._order(model, opt)
        osd = {"state": {order[int(i)]: st for i, st in sd["state"].items()},
               "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]]}
        set_optimizer_state_dict(model, opt, osd, options=StateDictOptions(full_state_dict=True))

    def local_batch(self, ids: torch.Tensor, hashes: dict | None):
        """This rank's rows of the global batch (the batch size must divide by the world size)."""
        if self.world == 1:
            return ids, hashes
        B = ids.shape[0]
        if B % self.world:
            raise ValueError(f"global batch {B} does not divide by --nproc {self.world}")
        b = B // self.world
        sl = slice(self.rank * b, (self.rank + 1) * b)
        return ids[sl], ({k: v[sl] for k, v in hashes.items()} if hashes else hashes)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any (e.g. a stop request seen by one rank)."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t)
        return bool(t.item() > 0)

    def mean(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item() / self.world)

    def unshard(self, model, plain_factory=None):
        """On rank 0: a single-process model with the full tables (and, under FSDP2, full dense weights).

        Only rank 0 receives the gathered tables (and full dense weights), so the other ranks get
        None and never hold a whole table. Under FSDP2 the trained weights are copied into
        `plain_factory()` (a fresh model of the same config), since a fully_shard-ed module keeps
        DTensor parameters. Collective: call on every rank.
        """
        if self.world == 1:
            return model
        dense = self.dense_state_dict(model) if self.fsdp else None
        for _, mhe in find_tables(model):
            if isinstance(mhe.table, ShardedTable):
                full = gather_full(mhe.table, dst=0)
                if self.is_main:
                    uninstall(mhe, full)
        if not self.is_main:
            return None
        if not self.fsdp:
            return model
        plain = plain_factory()
        tables = {n: m.embedding.weight.detach() for n, m in find_tables(model)}
        missing, unexpected = plain.load_state_dict(dense, strict=False)
        with torch.no_grad():
            for n, m in find_tables(plain):
                m.embedding.weight.copy_(tables[n])
        left = [k for k in missing if not is_table_key(k)]
        if left or unexpected:
            raise RuntimeError(f"unshard: missing {left[:5]}, unexpected {unexpected[:5]}")
        return plain

    def close(self) -> None:
        if self.world > 1:
            shutdown()


def shutdown() -> None:
    """Leave the default process group cleanly (every rank calls it): a barrier, then `destroy_process_group`.

    The barrier makes gloo's worker thread finish with every earlier collective before the group can be freed: it
    releases a finished collective's tensors after the caller has moved on, and where the caller has dropped its own
    references that release needs the GIL. A group freed from Python (a DDP reducer's last reference) joins that
    thread while holding the GIL: a deadlock, seen under CPU contention. Free DDP wrappers while the group is alive.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
