"""The float tables training writes to (the ram and mmap tiers): in RAM, or memory-mapped from disk with a hot-row
cache, behind one gather interface.

Engram addresses depend only on the token ids, so a table far larger than RAM (or than an
accelerator) can live elsewhere and be gathered ahead of use. Both are `Table`s
(`base.py`: `lookup` for the model, `gather` for plain reads), opened by `rows.open_rows`;
`offload.offload_tables(model, ...)` moves a model's tables into a tier and installs them behind each layer.

File layout: a safetensors file holding one tensor `weight` `[rows, dim]` (little-endian), so
`safetensors.safe_open` reads it too; we memory-map the data section directly.

Hot-row cache: `rowcache.py` (direct-mapped, "lru" or "lfu"). The file format, writing and reading, is
`files.py`; the undo journal of a writable file is `journal.py`.

Training (`trainable=True`): a table also keeps the Adam moments of its rows (for `MmapTable`,
as tensors `exp_avg` and `exp_avg_sq` in the same file), records each training lookup so that
backward leaves the looked-up rows' gradients with it (`take_grads`), and lets
`engram.optim.TableAdam` read and write back only the touched rows (`read_rows`/`write_rows`).
A writable `MmapTable` keeps an undo journal beside its file: before a row is first overwritten
after a checkpoint, its old weight and moments are appended (with a CRC, fsync'd) to
`<file>.journal`; `commit(step)` flushes the file and starts a new journal, and
`recover(step)` rolls the file back to the checkpoint after a kill at any point (a torn journal
tail belongs to a write that never reached the table).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch

from .base import Table, TableError
from .blocks import BlockVerifier, UnverifiedTableWarning, block_crc, write_block_sums, write_sums
from .files import map_tensor
from .header import read_header as _read_header
from .journal import UndoJournal
from .rowcache import RowCache


class InRamTable(Table):
    """A tensor in RAM; gathers with `torch.index_select(..., out=)` into a reused buffer."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach()
        self.num_rows, self.dim = self.weight.shape
        self.dtype = self.weight.dtype

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows (N,) -> (N, dim); pass a preallocated `out` to skip the allocation (~3x faster)."""
        return torch.index_select(self.weight, 0, rows, out=out) if out is not None else \
            torch.index_select(self.weight, 0, rows)

    def tensors(self):
        if not hasattr(self, "exp_avg"):  # moments are created on the first update
            self.exp_avg = torch.zeros(self.weight.shape, dtype=torch.float32, device=self.weight.device)
            self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        return self.weight, self.exp_avg, self.exp_avg_sq


class MmapTable(Table):
    """Table memory-mapped from a safetensors file, with a direct-mapped hot-row cache of `cache_bytes`.

    `writable=True` (training) maps the file read-write; it must hold `exp_avg`/`exp_avg_sq`
    (`write_table_file(..., with_moments=True)`). Writes go through the undo journal
    `<file>.journal`; `durable=True` fsyncs each journal entry before the rows change (power-loss
    safe; a killed process is safe either way, the page cache outlives it).
    """

    def __init__(self, path: str | os.PathLike, cache_bytes: int = 64 << 20, policy: str = "lru",
                 writable: bool = False, durable: bool = True):
        path = Path(path)
        header = _read_header(path)
        meta = header.entries
        self.num_rows, self.dim = meta["weight"]["shape"]
        names = ["weight"] + (["exp_avg", "exp_avg_sq"] if writable else [])
        maps = {}

        for name in names:
            if name not in meta:
                raise TableError(f"{path} has no optimizer moments ('{name}'); training needs a table written with "
                                 f"write_table_file(..., with_moments=True)")
            info = meta[name]
            if info["shape"] != [self.num_rows, self.dim]:
                raise TableError(f"{path}: '{name}' has shape {info['shape']}, 'weight' {[self.num_rows, self.dim]}")
            maps[name] = map_tensor(path, header, name, writable=writable)
        self._arrays = [a for a, _ in maps.values()]
        self.weight = maps["weight"][1]
        if writable:
            self.exp_avg, self.exp_avg_sq = maps["exp_avg"][1], maps["exp_avg_sq"][1]
        self.dtype = self.weight.dtype
        self.path, self.writable, self.durable = path, writable, durable
        row_bytes = self.dim * self.weight.element_size()
        self.row_cache = RowCache(int(max(0, cache_bytes) // row_bytes), self.dim, self.dtype, policy)
        self.journal = UndoJournal(path, self.num_rows, self.dim, self.dtype, durable)
        self.journal_path = self.journal.path
        # per-block checksums, checked on first read (read-only files; training files have their journal)
        self._row_bytes = row_bytes
        self._offsets = [meta[k]["data_offsets"][0] for k in names]  # weight (and moments) in the data section
        with warnings.catch_warnings():
            if writable:  # a training file without sums gets them at its first commit
                warnings.simplefilter("ignore", UnverifiedTableWarning)
            self.blocks = BlockVerifier.open(path)
        self._dirty = None if self.blocks is None else torch.zeros(len(self.blocks.sums), dtype=torch.bool)
        if writable and self.blocks is not None:
            # the rows may have changed since the sums were written (after the last commit): trust none of them
            # until recover() has rolled the file back and checked every block, and re-sum all at the next commit
            self._dirty.fill_(True)
            self.blocks.ok.fill_(True)
            self.blocks.unverified = 0

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = rows.reshape(-1).long()
        if self.blocks is not None:  # cached rows were checked when first read from the file
            self.blocks.check_rows(rows, self._offsets[0], self._row_bytes)
        return self.row_cache.gather(rows, self.weight, out)

    # the hot-row cache's state, under the names benchmarks and tests read (and `slots = 0` turns it off)
    slots = property(lambda self: self.row_cache.slots, lambda self, v: setattr(self.row_cache, "slots", v))
    policy = property(lambda self: self.row_cache.policy)
    cache = property(lambda self: self.row_cache.rows)
    tags = property(lambda self: self.row_cache.tags)
    hits = property(lambda self: self.row_cache.hits)
    misses = property(lambda self: self.row_cache.misses)

    def touch(self, rows: torch.Tensor) -> None:
        """Read rows (distinct ids) and, when training, their moments, discarding them: pages them in (read-ahead)."""
        for t in (self.weight, self.exp_avg, self.exp_avg_sq) if self.writable else (self.weight,):
            t.index_select(0, rows)

    # ---- training: rows and moments written in place, old values journaled first
    def tensors(self):
        self._need_writable()
        return self.weight, self.exp_avg, self.exp_avg_sq

    def begin_write(self, rows):
        self._need_writable()
        if not self.journal.record(rows, self._snapshot):
            raise TableError(f"{self.path}: call commit(step) or recover(step) before the first write "
                             "(it starts the undo journal)")

    def journal_ahead(self, rows: torch.Tensor) -> None:
        """Journal now the rows a coming step will write (its batch's distinct rows, known once the data
        pipeline has hashed it), on the caller's thread, so that the step's `begin_write` finds them journaled
        and, usually, durable: the entry and its fsync overlap the current step instead of delaying the next.

        Safe to run while a step writes other rows: a row's value changes only after `begin_write` has seen it
        journaled (under the journal lock), so a row journaled here still holds its checkpoint value."""
        if self.writable:
            self.journal.record(rows, self._snapshot)

    def _snapshot(self, rows: torch.Tensor) -> tuple:
        """The rows' current weight and moments: what the journal keeps to undo their write."""
        return (self.weight.index_select(0, rows), self.exp_avg.index_select(0, rows),
                self.exp_avg_sq.index_select(0, rows))

    def end_write(self, rows):
        if self._dirty is not None:  # blocks we changed: trusted, and re-summed at the next commit
            for off in self._offsets:
                b = self.blocks.blocks_of(rows, off, self._row_bytes)
                self._dirty[b] = True
                self.blocks.ok[b] = True
        self.row_cache.refresh(rows, self.weight)  # keep cached copies coherent

    def _need_writable(self):
        if not self.writable:
            raise TableError(f"{self.path} is open read-only; open it with MmapTable(..., writable=True) to train")

    def journal_step(self) -> int | None:
        """The checkpoint step the current journal undoes to, or None if there is no valid journal."""
        return self.journal.step()

    def flush(self) -> None:
        """Write every modified page of the table file to disk (msync)."""
        for a in self._arrays:
            a.flush()

    def commit(self, step: int) -> None:
        """The table now is the state of checkpoint `step`: flush it and start an empty journal for `step`.

        Call after the checkpoint that records `step` is durable: until the new journal replaces
        the old one, `recover` can still roll back to the previous checkpoint.
        """
        self._need_writable()
        # (under the journal's locks: no `journal_ahead` append or fsync on the journal being replaced)
        self.journal.restart(step, before=lambda: (self.flush(), self._commit_sums()))

    def _commit_sums(self) -> None:
        """Block sums describing the file as it is now (the checkpoint's state): dirty blocks re-summed."""
        if self.blocks is None:
            write_block_sums(self.path)
            self.blocks = BlockVerifier.open(self.path)
            self.blocks.ok.fill_(True)
            self._dirty = torch.zeros(len(self.blocks.sums), dtype=torch.bool)
            return
        dirty = self._dirty.nonzero().squeeze(1).tolist()
        if dirty:
            sums = np.array(self.blocks.sums, dtype="<u4")  # (a writable copy)
            bb = self.blocks.block_bytes
            for b in dirty:
                sums[b] = block_crc(self.blocks.data[b * bb: (b + 1) * bb])
            self.blocks.sums = sums
            write_sums(self.path, sums, bb)
            self._dirty.zero_()

    def verify_all(self) -> None:
        """Check every block of the file against its sums now (resume does, after rolling back)."""
        if self.blocks is not None:
            self.blocks.ok.zero_()
            self.blocks.unverified = len(self.blocks.sums)
            self.blocks.verify_all()

    def recover(self, step: int) -> int:
        """Roll the table back to checkpoint `step` after a crash; returns the number of rows restored.

        The journal of checkpoint `step` holds the old value of every row written since then.
        A journal of an earlier step means the process stopped between writing checkpoint
        `step` and starting its journal: the table is already at `step`. A later one means the
        table moved past `step` and cannot go back (only the newest checkpoint is restorable).
        """
        self._need_writable()
        base = self.journal.step()
        if base is None:
            raise TableError(f"{self.journal_path} is missing or corrupt: cannot tell whether {self.path.name} "
                             f"matches checkpoint step {step}")
        if base > step:
            raise TableError(f"{self.path.name} has been committed at step {base}; it cannot be rolled back to step "
                             f"{step} (only the newest checkpoint's table state is kept)")
        restored = 0
        if base == step:  # newest entry first, so a row journaled twice ends at its oldest (checkpoint) value
            for rows, w, m, v in reversed(list(self.journal.entries())):
                self._put(rows, w, m, v)  # (not journaled: these are the checkpoint's values)
                restored += rows.numel()
        self.row_cache.clear()  # cached rows may predate the rollback
        self.flush()
        try:  # the file must now be exactly the checkpoint's: its sums were written at that commit
            self.verify_all()
        except TableError as e:
            raise TableError(f"{e} (after rolling back to step {step}: the file or its undo journal was damaged; "
                             "the run cannot resume from this table file)") from None
        if self._dirty is not None:
            self._dirty.zero_()  # checked: the sums describe the file again
        self.commit(step)
        return restored

    def close(self) -> None:
        self.journal.close()

    def stats(self) -> dict:
        return self.row_cache.stats()
