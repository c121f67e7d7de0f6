"""Where a model's tables are and how one is put behind a layer: `find_tables(model)` is the only way the code finds
them, `install(mhe, table)` (used by `tables.offload_tables` and `distributed.DistContext`) the only way a table is
put behind a layer. The interface every table implements, `Table`, is the core's (`engram/table.py`, below
`memory`); implementations:
  * `memory.MultiHeadEmbedding`   the layer's own `nn.Embedding` parameter (the default; its sparse
                                  gradient lands on the parameter, so `take_grads` is None and
                                  `optim.LazyRowAdam` trains it);
  * `tables.InRamTable`           a tensor in RAM (inference offload, or trainable with moments);
  * `tables.MmapTable`            a memory-mapped safetensors file, hot-row cache, undo journal;
  * `distributed.ShardedTable`    rows split over ranks, lookups and gradients by all-to-all.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from ..memory import MultiHeadEmbedding
from ..table import Table, TableError, row_grads  # noqa: F401  (the interface, in the core)


class GgufError(TableError):
    """A GGUF file is missing, damaged or lacks what is asked of it; the message names the file and the fix."""


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
