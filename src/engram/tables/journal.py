"""The undo journal of a writable table file: before a row first changes after a checkpoint, its old weight
and moments are appended to `<file>.journal` (with a CRC, fsync'd when durable), so `MmapTable.recover`
can roll the file back to the checkpoint after a kill at any point (a torn tail belongs to a write that
never reached the table).

    <file>.journal = header (magic, checkpoint step, rows, dim) + entries (k, crc32, rows, w, m, v)
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from pathlib import Path

import torch

from ..persist import atomic_write_bytes

_JMAGIC = b"ENGJRN01"
_JHEAD = struct.Struct("<8sqqq")  # magic, base step, rows, dim
_JENTRY = struct.Struct("<qI")  # rows in the entry, crc32 of its payload


class UndoJournal:
    """`<path>.journal` of a table of `num_rows` x `dim` rows of `dtype` with float32 Adam moments.

    `record(rows, snapshot)` journals the rows not yet journaled since the checkpoint (their current
    values, from `snapshot(rows) -> (w, m, v)`) and makes the journal durable up to them; it may run on
    the training step's thread and on the data pipeline's (`MmapTable.journal_ahead`) at once.
    `restart(step)` starts an empty journal for checkpoint `step`.
    """

    def __init__(self, table_path: Path, num_rows: int, dim: int, dtype: torch.dtype, durable: bool = True):
        self.path = Path(table_path).with_name(Path(table_path).name + ".journal")
        self.num_rows, self.dim, self.dtype, self.durable = num_rows, dim, dtype, durable
        self.file = None  # open for appending once a checkpoint started it
        self.touched = None  # (num_rows,) bool: journaled since the checkpoint
        self.lock = threading.Lock()  # appends (the step and the pipeline thread)
        self.sync_lock = threading.Lock()  # held by an fdatasync in flight; restart/close wait for it
        self.written = self.synced = 0  # journal bytes appended / known durable

    def record(self, rows: torch.Tensor, snapshot) -> bool:
        """Journal the rows not yet journaled since the checkpoint and make the journal durable up to them,
        those another thread journaled included; False when no journal is open (before the first commit)."""
        with self.lock:
            journal = self.file
            if journal is None:
                return False
            fresh = rows[~self.touched.index_select(0, rows)]
            if fresh.numel():
                self.append(fresh, *snapshot(fresh))
                self.touched.index_fill_(0, fresh, True)
            need = self.written
        self.sync(journal, need)
        return True

    def append(self, rows: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """One entry: the rows' ids and old weight and moments (called under `lock`)."""
        payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (rows.long(), w, m, v))
        self.file.write(_JENTRY.pack(rows.numel(), zlib.crc32(payload)) + payload)
        self.file.flush()
        self.written = self.file.tell()

    def sync(self, journal, upto: int) -> None:
        """fdatasync `journal` up to byte `upto` (durable journals), outside the append lock. A journal that a
        restart has replaced meanwhile needs none (the table it undoes is flushed); the sync lock keeps that
        restart from closing the file under an fdatasync."""
        if not self.durable:
            return
        with self.sync_lock:
            if journal is self.file and self.synced < upto:
                os.fdatasync(journal.fileno())
                self.synced = max(self.synced, upto)

    def entries(self):
        """Valid undo entries (rows, w, m, v); stops at a torn or corrupt tail."""
        data = self.path.read_bytes()
        esz = torch.empty((), dtype=self.dtype).element_size()
        pos = _JHEAD.size
        while pos + _JENTRY.size <= len(data):
            k, crc = _JENTRY.unpack_from(data, pos)
            plen = k * (8 + self.dim * (esz + 8))
            if k <= 0 or pos + _JENTRY.size + plen > len(data):
                break
            payload = data[pos + _JENTRY.size: pos + _JENTRY.size + plen]
            if zlib.crc32(payload) != crc:
                break
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            o = [0, 8 * k, 8 * k + k * self.dim * esz, 8 * k + k * self.dim * (esz + 4), plen]
            rows = buf[o[0]:o[1]].view(torch.int64)
            w = buf[o[1]:o[2]].view(self.dtype).view(k, self.dim)
            m = buf[o[2]:o[3]].view(torch.float32).view(k, self.dim)
            v = buf[o[3]:o[4]].view(torch.float32).view(k, self.dim)
            yield rows, w, m, v
            pos += _JENTRY.size + plen

    def step(self) -> int | None:
        """The checkpoint step the journal undoes to, or None if there is no valid journal."""
        try:
            with open(self.path, "rb") as f:
                magic, step, rows, dim = _JHEAD.unpack(f.read(_JHEAD.size))
        except (FileNotFoundError, struct.error):
            return None
        return step if magic == _JMAGIC and (rows, dim) == (self.num_rows, self.dim) else None

    def restart(self, step: int, before=None) -> None:
        """An empty journal for checkpoint `step` replaces the current one (atomically); `before()` runs first,
        under both locks (no append or fsync in flight: the table's flush and block sums go there)."""
        with self.sync_lock, self.lock:
            if before is not None:
                before()
            if self.file is not None:
                self.file.close()
            atomic_write_bytes(self.path, _JHEAD.pack(_JMAGIC, step, self.num_rows, self.dim))
            self.file = open(self.path, "ab")
            self.written = self.synced = self.file.tell()
            self.touched = torch.zeros(self.num_rows, dtype=torch.bool)

    def close(self) -> None:
        with self.sync_lock, self.lock:
            if self.file is not None:
                self.file.close()
                self.file = None
