"""A table whose rows are split across ranks in contiguous blocks; lookups and gradients travel by all-to-all.

    table = ShardedTable(num_rows, dim)            # after torch.distributed.init_process_group
    vecs = table(rows)                            # (N,) -> (N, dim), rows owned anywhere
    loss.backward()                               # row gradients are routed to their owners
    LazyRowAdam([table.weight]).step()            # each rank updates only its own rows

Forward: requested rows are bucketed by owner, counts and ids exchanged with `all_to_all_single`,
each owner gathers its rows and sends them back. Backward is the mirror image: the gradient rows go
to their owners and arrive as a sparse COO gradient of the local shard, so `LazyRowAdam` (or
`SparseAdam`) works unchanged. All ranks must call forward and backward together (lockstep, as in
data-parallel training). Checkpoints store each shard with its global row range, so they load at
another world size. `local_table=` keeps this rank's rows in a trainable `engram.tables` table (a
journaled memory-mapped file) instead of a parameter: gradients then go to its `add_grad` and
`engram.training.optim.TableAdam` updates them.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from ..persist import new_dir_shared, read_json, recover_dir, write_json
from ..tables.base import Table, TableError


def _a2a(tensor: torch.Tensor, send: list[int], recv: list[int], group=None) -> torch.Tensor:
    out = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _ShardedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, rows, lo, chunk, world, group, grad_scale, local_table=None):
        owner = torch.div(rows, chunk, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send_rows = rows.index_select(0, order)
        send = torch.bincount(owner, minlength=world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_l, recv_l = send.tolist(), recv.tolist()
        req = _a2a(send_rows, send_l, recv_l, group)  # rows others want from me
        local = req - lo
        # the rows asked of me, (sum(recv), dim)
        vals = local_table.gather(local) if local_table is not None else weight.index_select(0, local)
        back = _a2a(vals, recv_l, send_l, group)  # my rows, in owner-sorted order
        out = torch.empty_like(back)
        out.index_copy_(0, order, back)
        ctx.save_for_backward(order, local)
        ctx.meta = (send_l, recv_l, group, weight.shape, grad_scale, local_table)
        return out

    @staticmethod
    def backward(ctx, grad):
        order, local = ctx.saved_tensors
        send_l, recv_l, group, shape, grad_scale, local_table = ctx.meta
        g = _a2a(grad.index_select(0, order), send_l, recv_l, group)  # gradients of my rows, from everyone
        if grad_scale != 1.0:
            g = g * grad_scale
        if local_table is not None:  # rows in a trainable table: it keeps the gradient for TableAdam
            local_table.add_grad(local, g)
            return None, None, None, None, None, None, None, None
        gw = torch.sparse_coo_tensor(local.unsqueeze(0), g, shape, check_invariants=False)
        return gw, None, None, None, None, None, None, None


def shard_range(num_rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [lo, hi) that `rank` owns: contiguous blocks of ceil(num_rows / world)."""
    chunk = math.ceil(num_rows / world)
    lo = min(num_rows, rank * chunk)
    return lo, min(num_rows, lo + chunk)


class ShardedTable(torch.nn.Module, Table):
    """A `Table` whose rows [rank*chunk, (rank+1)*chunk) of a (num_rows, dim) table live on `rank`.

    This rank's rows are a parameter (`weight`, trained by `LazyRowAdam` from its sparse gradient)
    or, with `local_table=`, a trainable `engram.tables` table (e.g. a journaled memory-mapped
    file) that receives the routed gradients and that `TableAdam`, checkpoints and recovery reach
    through this object (`take_grads`, `tensors`, `commit`, ... are the local table's).
    """

    def __init__(self, num_rows: int, dim: int, group=None, dtype=torch.float32, init: torch.Tensor | None = None,
                 grad_scale: float = 1.0, local_table: Table | None = None, init_std: float = 1.0):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ShardedTable needs torch.distributed.init_process_group(...) first "
                               "(e.g. under torchrun)")
        self.group, self.grad_scale = group, grad_scale  # grad_scale 1/world: rank losses are means, DDP averages
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_rows, self.dim = num_rows, dim
        self.chunk = math.ceil(num_rows / self.world)
        self.lo, self.hi = shard_range(num_rows, self.rank, self.world)
        self.local_table = local_table
        if local_table is not None:
            if (local_table.num_rows, local_table.dim) != (self.hi - self.lo, dim):
                raise ValueError(f"local table holds [{local_table.num_rows}, {local_table.dim}], shard {self.rank} "
                                 f"needs [{self.hi - self.lo}, {dim}]")
            self.weight = None
            self.dtype = local_table.dtype
            return
        if init is not None:  # the full table (tests) or this shard
            w = init[self.lo:self.hi] if init.shape[0] == num_rows else init
        else:
            w = torch.randn(self.hi - self.lo, dim) * init_std
        self.weight = torch.nn.Parameter(w.to(dtype).clone())
        self.dtype = self.weight.dtype

    @property
    def trainable(self) -> bool:  # trained by TableAdam (rows in a local table) rather than through `weight`
        return self.local_table is not None and self.local_table.trainable

    def local_rows(self) -> torch.Tensor:
        """This rank's rows (hi - lo, dim): the parameter, or the local table's storage."""
        return self.local_table.weight if self.local_table is not None else self.weight.detach()

    def lookup(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        vals = self(rows)
        return out.copy_(vals) if out is not None else vals

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        shape = rows.shape
        flat = rows.reshape(-1).long()
        if self.local_table is not None:  # a fresh leaf makes autograd call backward, which feeds the local table
            anchor = torch.empty(0, requires_grad=torch.is_grad_enabled() and self.training)
            out = _ShardedLookup.apply(anchor, flat, self.lo, self.chunk, self.world, self.group, self.grad_scale,
                                       self.local_table)
        else:
            out = _ShardedLookup.apply(self.weight, flat, self.lo, self.chunk, self.world, self.group,
                                       self.grad_scale)
        return out.view(*shape, self.dim)

    # ---- the local table's training and durability hooks (no-ops for a parameter shard)
    def take_grads(self):
        return self.local_table.take_grads() if self.local_table is not None else None

    def clear_grads(self, everything: bool = False) -> None:
        if self.local_table is not None:
            self.local_table.clear_grads(everything)

    def tensors(self):
        return self.local_table.tensors() if self.local_table is not None else Table.tensors(self)

    def begin_write(self, rows):
        self.local_table.begin_write(rows)

    def end_write(self, rows):
        self.local_table.end_write(rows)

    def read_rows(self, rows):
        return self.local_table.read_rows(rows)

    def write_rows(self, rows, w, m, v):
        self.local_table.write_rows(rows, w, m, v)

    def flush(self) -> None:
        if self.local_table is not None:
            self.local_table.flush()

    def commit(self, step: int) -> None:
        if self.local_table is not None:
            self.local_table.commit(step)

    def recover(self, step: int) -> int:
        return self.local_table.recover(step) if self.local_table is not None else 0

    def close(self) -> None:
        if self.local_table is not None:
            self.local_table.close()

    def stats(self) -> dict:
        return self.local_table.stats() if self.local_table is not None else {}

    @property
    def path(self):
        return getattr(self.local_table, "path", None)


def gather_full(table: ShardedTable, dst: int = 0) -> torch.Tensor | None:
    """The whole (num_rows, dim) table on rank `dst` (None on the others, which never hold it)."""
    w = table.local_rows()
    pad = torch.zeros(table.chunk, table.dim, dtype=w.dtype, device=w.device)
    pad[: w.shape[0]] = w
    parts = [torch.empty_like(pad) for _ in range(table.world)] if table.rank == dst else None
    dist.gather(pad, parts, dst=dst, group=table.group)
    return torch.cat(parts)[: table.num_rows] if parts is not None else None


def save_sharded(table: ShardedTable, directory: str | Path, optimizer=None) -> None:
    """Every rank of `table.group` together: the shard set `directory`, each rank's `shard_{rank}.safetensors`
    (weight, Adam moments if any) and `shard_{rank}.json` (its global row range), so it loads at any world size.

    `directory` is the shard set's own folder, replaced whole: the ranks write into a temp sibling, and rank 0
    adds the checksum manifest and swaps it in once every shard is there (`persist.new_dir_shared`), so a crash
    at any step leaves the old shard set or the new one, complete.
    """
    from safetensors.torch import save_file

    tensors = {"weight": table.weight.detach().contiguous()}
    step = 0
    if optimizer is not None and table.weight in optimizer.state:
        st = optimizer.state[table.weight]
        tensors["exp_avg"], tensors["exp_avg_sq"] = st["exp_avg"], st["exp_avg_sq"]
        step = float(st["step"])
    info = {"sharded_table": {"num_rows": table.num_rows, "dim": table.dim, "world": table.world}}
    with new_dir_shared(directory, table.rank == 0, lambda: dist.barrier(group=table.group), info=info) as tmp:
        save_file(tensors, str(tmp / f"shard_{table.rank}.safetensors"))
        write_json(tmp / f"shard_{table.rank}.json", {"lo": table.lo, "hi": table.hi, "num_rows": table.num_rows,
                                                      "dim": table.dim, "step": step}, indent=None)


def read_shard_range(meta_file: Path) -> dict:
    """A shard's `shard_{rank}.json`: {"lo", "hi", "num_rows", "dim", "step"} (its global row range)."""
    m = read_json(meta_file, "shard range", "save the sharded table again (or resume from an older checkpoint)",
                  TableError)
    if not all(isinstance(m.get(k), int) for k in ("lo", "hi")):
        raise TableError(f"shard range {meta_file} is corrupt (no integer 'lo' and 'hi'); save the sharded table again")
    return m


def load_sharded(directory: str | Path, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Rows [lo, hi) of every saved tensor, assembled from whichever shards hold them (any world size)."""
    from safetensors import safe_open

    d = Path(directory)
    try:
        recover_dir(d)  # a save killed between its renames left the old shard set aside
    except OSError:  # another rank put it back first
        pass
    metas = sorted(d.glob("shard_*.json"))
    if not metas:
        raise FileNotFoundError(f"no shard_*.json in {d}")
    out: dict[str, torch.Tensor] = {}
    covered = 0
    for mf in metas:
        m = read_shard_range(mf)
        a, b = max(lo, m["lo"]), min(hi, m["hi"])
        if a >= b:
            continue
        with safe_open(str(mf.with_suffix(".safetensors")), framework="pt") as f:
            for k in f.keys():
                part = f.get_slice(k)[a - m["lo"]:b - m["lo"]]
                if k not in out:
                    out[k] = torch.empty((hi - lo,) + tuple(part.shape[1:]), dtype=part.dtype)
                out[k][a - lo:b - lo] = part
        covered += b - a
    if covered != hi - lo:
        raise ValueError(f"shards in {d} cover {covered} of the {hi - lo} rows [{lo}, {hi}) requested")
    return out
