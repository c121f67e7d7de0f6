"""The one table interface: every place an Engram layer's rows can live implements `Table` (and `TableError`, the
one error of opening rows). In the core, below `memory`, whose `MultiHeadEmbedding` is its default implementation;
the storage package `tables/` implements the others and installs them (`tables.base.install`).

    rows = table.lookup(flat_ids)          # (N,) int64 global row ids -> (N, dim)
    grads = table.take_grads()             # after backward: (rows [R], summed grads [R, dim]) or None

Implementations:
  * `memory.MultiHeadEmbedding`   the layer's own `nn.Embedding` parameter (the default; its sparse
                                  gradient lands on the parameter, so `take_grads` is None and
                                  `optim.LazyRowAdam` trains it);
  * `tables.InRamTable`           a tensor in RAM (inference offload, or trainable with moments);
  * `tables.MmapTable`            a memory-mapped safetensors file, hot-row cache, undo journal;
  * `distributed.ShardedTable`    rows split over ranks, lookups and gradients by all-to-all.

A layer's `MultiHeadEmbedding` turns per-head hash ids into flat row ids and asks its table;
`install(mhe, table)` (used by `tables.offload_tables` and `distributed.DistContext`) is the only
way a table is put behind a layer, and `find_tables(model)` the only way the code finds them.
Trainable tables keep their rows' Adam moments (`tensors()`), collect the gradients of the rows
they handed out (`record` in forward, `take_grads` after backward) and journal in-place writes
(`begin_write`/`end_write`, `commit`/`recover`), which is all `optim.TableAdam` and `checkpoint`
need.
"""

from __future__ import annotations

import torch

from .config import ConfigError


class TableError(ConfigError):
    """A table file is missing, short or corrupt, rows are asked of a tier that does not exist, or a table does not
    fit its layer; the message names it and the fix. The one error of opening rows (`tables.open_rows`), in every
    tier and format; a `ConfigError` (a file or setting that is not valid), so callers checking a configuration's
    files catch it with the rest."""


def row_grads(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct rows [R], summed row gradients [R, D] float32) of a sparse COO or dense gradient."""
    if g.is_sparse:
        if g.is_coalesced():
            return g.indices()[0], g.values().float()
        # unique + index_add is ~3x faster than Tensor.coalesce() for row-sparse embedding gradients
        rows, inv = torch.unique(g._indices()[0], sorted=True, return_inverse=True)
        vals = torch.zeros((rows.numel(),) + tuple(g.shape[1:]), dtype=torch.float32, device=g.device)
        return rows, vals.index_add_(0, inv, g._values().float())
    rows = g.abs().sum(dim=tuple(range(1, g.dim()))).nonzero().squeeze(1)  # dense: rows with any non-zero
    return rows, g.index_select(0, rows).float()


class Table:
    """Rows `(num_rows, dim)` of one Engram layer, wherever they live.

    `lookup(rows (N,) int64, out=None) -> (N, dim)`: the rows, written into `out` when given (a reused
    or page-locked buffer). While `training` and grad mode are on, a `trainable` table hands out a
    leaf and keeps it (`record`) so that backward leaves the rows' gradients with the table;
    `take_grads()` then returns them summed per distinct row, as `nn.Embedding(sparse=True)` does.
    """

    num_rows: int
    dim: int
    dtype: torch.dtype
    trainable: bool = False  # its rows are trained by optim.TableAdam (set by offload_tables / DistContext)
    training: bool = True  # follows the layer's train()/eval() (MultiHeadEmbedding.train)

    def lookup(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        flat = rows.reshape(-1).to("cpu", torch.long)
        vals = self.gather(flat, out=out)  # (N, dim)
        if self.trainable and self.training and torch.is_grad_enabled():
            vals.requires_grad_(True)  # a leaf: backward leaves the rows' gradients for TableAdam
            self.record(flat, vals)
        return vals

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Plain row read: rows (N,) int64 on the table's device -> (N, dim), no gradient bookkeeping."""
        raise NotImplementedError

    def stats(self) -> dict:
        return {}

    # ---- training: lookups recorded in forward, their gradients collected after backward
    def record(self, rows: torch.Tensor, vals: torch.Tensor) -> None:
        """Remember a training lookup: rows (N,) and the leaf `vals` (N, dim) whose .grad backward fills."""
        self.__dict__.setdefault("_pending", []).append((rows, vals))

    def add_grad(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Gradients computed elsewhere (e.g. routed to this rank by a sharded lookup): rows (N,), grads (N, dim)."""
        self.__dict__.setdefault("_pending", []).append((rows, _Arrived(grads)))

    def take_grads(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(distinct rows [R], summed gradients [R, dim] float32) of the recorded lookups, or None."""
        pending = [(r, v.grad) for r, v in self.__dict__.get("_pending", []) if v.grad is not None]
        if not pending:
            return None
        rows = torch.cat([r for r, _ in pending])
        grads = torch.cat([g for _, g in pending])
        # the same uncoalesced COO gradient nn.Embedding(sparse=True) produces: same sums, same order
        sparse = torch.sparse_coo_tensor(rows[None], grads, (self.num_rows, self.dim), check_invariants=False)
        return row_grads(sparse)

    def clear_grads(self, everything: bool = False) -> None:
        """Forget recorded lookups whose gradients arrived (zero_grad); `everything=True` also those awaiting backward.

        zero_grad may run between forward and backward, so a lookup without a gradient yet is kept.
        """
        self.__dict__["_pending"] = [] if everything else [(r, v) for r, v in self.__dict__.get("_pending", [])
                                                           if v.grad is None]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole (weight, exp_avg, exp_avg_sq), for optimizers that update rows in place.

        Bracket in-place writes with `begin_write(rows)` / `end_write(rows)`.
        """
        raise TableError(f"{type(self).__name__} is not trainable")

    def read_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight, exp_avg, exp_avg_sq) of `rows`, each (R, dim) float32, fresh tensors."""
        w, m, v = self.tensors()
        return w.index_select(0, rows).float(), m.index_select(0, rows), v.index_select(0, rows)

    def write_rows(self, rows: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """Store updated rows (distinct ids) and their moments."""
        self.begin_write(rows)
        self._put(rows, w, m, v)
        self.end_write(rows)

    def _put(self, rows: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        W, M, V = self.tensors()
        W.index_copy_(0, rows, w.to(W.dtype))
        M.index_copy_(0, rows, m)
        V.index_copy_(0, rows, v)

    def begin_write(self, rows: torch.Tensor) -> None:
        """Rows (distinct) are about to change in place (a journaled table saves their old values)."""

    def end_write(self, rows: torch.Tensor) -> None:
        """Rows changed in place (a cached table refreshes its copies)."""

    # ---- durability (checkpoints): no-ops for tables that live only in memory
    def flush(self) -> None:
        """Make the rows written so far durable (a file-backed table msyncs)."""

    def commit(self, step: int) -> None:
        """The rows now are the state of checkpoint `step` (a journaled table starts a new undo journal)."""

    def recover(self, step: int) -> int:
        """Roll the rows back to checkpoint `step` after a crash; returns the number of rows restored."""
        return 0

    def close(self) -> None:
        """Release files and mappings."""


class _Arrived:
    """A recorded lookup whose gradient is already known (has `.grad` like a leaf after backward)."""

    def __init__(self, grad: torch.Tensor):
        self.grad = grad


