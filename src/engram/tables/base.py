"""The one table interface: every place an Engram layer's rows can live implements `Table`.

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

import contextlib
import contextvars

import torch

from ..config import ConfigError
from ..memory import MultiHeadEmbedding


class TableError(ConfigError):
    """A table file is missing, short or corrupt, rows are asked of a tier that does not exist, or a table does not
    fit its layer; the message names it and the fix. The one error of opening rows (`tables.open_rows`), in every
    tier and format; a `ConfigError` (a file or setting that is not valid), so callers checking a configuration's
    files catch it with the rest."""


class GgufError(TableError):
    """A GGUF file is missing, damaged or lacks what is asked of it; the message names the file and the fix."""


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


# ------------------------------------------------------------------------------ finding and installing tables
def find_tables(model: torch.nn.Module) -> list[tuple[str, MultiHeadEmbedding]]:
    """Every Engram layer's table holder in `model`: `[(module name, MultiHeadEmbedding)]`, in model order.

    `mhe.layer_id` is the layer, `mhe.table` the installed `Table` (None: the rows are `mhe`'s own
    parameter). Offloading, sharding, checkpoints and the optimizer builder all find tables here.
    """
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MultiHeadEmbedding)]


def installed_tables(model: torch.nn.Module) -> dict[int, Table]:
    """{layer_id: table} of the layers whose rows live in an installed table (not their own parameter)."""
    return {m.layer_id: m.table for _, m in find_tables(model) if m.table is not None}


def install(mhe: MultiHeadEmbedding, table, free_parameter: bool = True) -> None:
    """Put `table` behind layer `mhe`: its lookups go to the table from now on.

    `free_parameter` replaces the layer's own (now unused) table parameter by an empty one, so
    its memory is released and optimizers and state dicts skip it.
    """
    if (table.num_rows, table.dim) != (mhe.num_rows, mhe.embedding_dim):
        raise TableError(f"table holds [{table.num_rows}, {table.dim}] rows, layer {mhe.layer_id} needs "
                         f"[{mhe.num_rows}, {mhe.embedding_dim}]")
    w = mhe.embedding.weight
    table.requires_grad = w.requires_grad  # a frozen table (freeze_table) stays frozen wherever it lives
    table.training = mhe.training
    if free_parameter:
        mhe.embedding.weight = torch.nn.Parameter(w.new_empty(0, w.shape[1]), requires_grad=False)
    mhe.table = table


def uninstall(mhe: MultiHeadEmbedding, weight: torch.Tensor | None = None) -> None:
    """Route layer `mhe`'s lookups back to its own parameter, filled with `weight` (default: the table's rows)."""
    table = mhe.table
    if weight is None:
        weight = table.weight.clone()
    mhe.embedding.weight = torch.nn.Parameter(weight, requires_grad=getattr(table, "requires_grad", True))
    table.close()
    del mhe.table  # (a module table is registered as a submodule: drop it there too)
    mhe.table = None


_ROWS_BY_REFERENCE = contextvars.ContextVar("engram_rows_by_reference", default=False)


@contextlib.contextmanager
def rows_by_reference():
    """Within it, `state_dict()` leaves out the rows of tables that engram serves for another framework's module
    (e.g. Qwen4Exp's n-gram table, which its state-dict hook otherwise rebuilds in RAM in transformers' layout):
    what a weights digest reads, which samples those rows through the table instead (`model_digest`)."""
    token = _ROWS_BY_REFERENCE.set(True)
    try:
        yield
    finally:
        _ROWS_BY_REFERENCE.reset(token)


def rows_by_reference_active() -> bool:
    """True inside `rows_by_reference()`: state-dict hooks of served tables skip their rows."""
    return _ROWS_BY_REFERENCE.get()
