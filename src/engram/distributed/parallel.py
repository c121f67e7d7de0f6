"""Data-parallel training with row-sharded Engram tables, applied from outside the model.

Under `torchrun` (WORLD_SIZE > 1) `DistContext.parallelize(model)` replaces every Engram table by a
`ShardedTable` (rows split across ranks, lookups and gradients by all-to-all) and wraps the model
in DistributedDataParallel for the dense parameters (the sharded tables are excluded from DDP's
all-reduce: their gradients already travel to their owners). Each rank trains on its slice of the
global batch; the reported loss is the mean over ranks, so `--nproc N` and `--nproc 1` follow the
same curve at the same global batch. With WORLD_SIZE == 1 every method is a no-op.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class DistContext:
    def __init__(self, device: torch.device):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = device
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def parallelize(self, model):
        """Shard the Engram tables and wrap in DDP; returns the module to call for training steps."""
        if self.world == 1:
            return model
        from ..memory import MultiHeadEmbedding
        from .sharded import ShardedTable

        ignore = []
        for name, mod in model.named_modules():
            if isinstance(mod, MultiHeadEmbedding):
                W = mod.embedding.weight
                mod.sharded = ShardedTable(W.shape[0], W.shape[1], init=W.detach(), dtype=W.dtype,
                                           grad_scale=1.0 / self.world)
                mod.embedding.weight = torch.nn.Parameter(W.new_empty(0, W.shape[1]), requires_grad=False)
                ignore.append(f"{name}.sharded.weight")
        from torch.nn.parallel import DistributedDataParallel as DDP

        DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
        return DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

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

    def unshard(self, model) -> None:
        """Put full tables back into the model (every rank) so it saves like a single-process model."""
        if self.world == 1:
            return
        from ..memory import MultiHeadEmbedding
        from .sharded import gather_full

        for mod in model.modules():
            if isinstance(mod, MultiHeadEmbedding) and getattr(mod, "sharded", None) is not None:
                full = gather_full(mod.sharded)
                mod.embedding.weight = torch.nn.Parameter(full.clone())
                del mod.sharded
                mod.sharded = None

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
