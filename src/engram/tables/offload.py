"""Moving a model's Engram tables into a tier (`offload_tables`) and back (`restore_tables`)."""

from __future__ import annotations

import os

from ..deprecation import renamed_keywords
from .base import Table, TableError, find_tables, install, uninstall
from .files import new_table_file, table_file
from .rows import TIERS, check_tier, open_rows

BACKENDS = TIERS  # (the old name of `rows.TIERS`: the tiers `offload_tables` puts the tables in)


@renamed_keywords(backend="tier")
def offload_tables(model, tier: str = "mmap", directory: str | os.PathLike | None = None,
                   cache_bytes: int = 64 << 20, policy: str = "lru", trainable: bool = False,
                   overwrite: bool = False, init_seed: int | None = None) -> dict[int, Table]:
    """Move every Engram table of `model` into a tier and install it behind its layer (`backend=` is the
    deprecated spelling of `tier=`).

    tier "mmap" writes each table to `directory/engram_table_L{layer}.safetensors` (unless the
    file exists and `overwrite` is False: then the file's rows are used) and frees the in-RAM
    copy; "disk" does the same and reads rows with many positioned reads in flight (`DiskTable`,
    for files colder than the page cache; read-only); "ram" keeps the tensor. The tables are opened by
    `open_rows`. `trainable=True` keeps
    Adam moments in the tier (in the same file for "mmap", opened writable with its undo journal)
    and lets `engram.optim.TableAdam` train the rows; the model's table parameters become empty. A model built under
    `engram.memory.defer_table_allocation()` has no table rows to write: its files are created
    with N(0, 1) rows from `init_seed + layer` (`create_table_file`), never in RAM.
    Returns {layer_id: table}.
    """
    check_tier(tier, needs_dir=directory is None, where="offload_tables", dir_arg="directory")
    if tier == "disk" and trainable:
        raise TableError("the disk tier is read-only (inference); train with tier='mmap'")
    tables = {}
    for _, mhe in find_tables(model):
        w = mhe.embedding.weight
        if tier == "ram":  # the rows stay where they are
            if w.shape[0] != mhe.num_rows:
                raise TableError("offload_tables(tier='ram') needs the table in the model; it was built "
                                 "with defer_table_allocation()")
            source = w.detach().clone() if trainable else w
        else:
            source = table_file(directory, mhe.layer_id)
            if overwrite or not source.is_file():
                new_table_file(source, w.detach(), mhe.num_rows,
                               None if init_seed is None else init_seed + mhe.layer_id, with_moments=trainable,
                               page_blocks=tier == "disk", std=mhe.init_std)
        table = open_rows(source, tier, cache_bytes=cache_bytes, policy=policy, writable=trainable)
        table.trainable = trainable and w.requires_grad
        install(mhe, table, free_parameter=tier in ("mmap", "disk") or trainable)
        tables[mhe.layer_id] = table
    return tables


def restore_tables(model) -> None:
    """Undo `offload_tables`: copy every table's rows back into the model's table parameters."""
    for _, mhe in find_tables(model):
        if mhe.table is not None:
            uninstall(mhe)
