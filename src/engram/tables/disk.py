"""The cold disk tier: table rows read with many positioned reads in flight, not one page fault at a time.

    table = DiskTable("engram_table_L1.safetensors", queue_depth=32)   # a read-only Table
    rows = table.gather(ids)                                            # (N, d), each distinct row read once

A memory-mapped table (`MmapTable`) is as fast as RAM while its pages are in the page cache, but
a cold page is a major fault: one read in flight per thread, so a gather of 30k cold rows waits
for 30k device round trips in sequence. `DiskTable` instead deduplicates the rows of a gather and
reads them with `queue_depth` worker threads issuing `os.preadv` (which releases the GIL), so the
device sees `queue_depth` reads at once. `direct=True` opens the file with O_DIRECT (reads of the
aligned 4 KiB page holding each row into an aligned buffer, bypassing the page cache); where the
filesystem refuses it, the table falls back to buffered reads and says so once.

Warm rows: pages this table has already read through the page cache are gathered from a read-only
mapping of the file instead (RAM speed while the kernel keeps them; an evicted one costs a page
fault, never a wrong row). With O_DIRECT nothing is cached by the kernel, so every row is read.

Read-ahead: `tables.Prefetcher` already gathers the next step's rows on its own thread, so with a
`DiskTable` installed the reads of step t+1 overlap the compute of step t.
"""

from __future__ import annotations

import mmap
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .files import map_tensor, row_span
from .files import read_header as _read_header
from .base import Table, TableError

PAGE = 4096


class DiskTable(Table):
    """Read-only rows of a table file, gathered by `queue_depth` concurrent positioned reads (see module doc)."""

    def __init__(self, path, queue_depth: int = 32, direct: bool = False):
        n, meta, size = _read_header(path)
        info = meta["weight"]
        # the file mapped read-only (checks dtype and size; no page is read until a warm row is gathered from it)
        _, self._mapped = map_tensor(path, n, size, "weight", info)
        self.num_rows, self.dim = info["shape"]
        self.dtype = self._mapped.dtype
        self.row_bytes = self.dim * self._mapped.element_size()
        self.offset = 8 + n + info["data_offsets"][0]
        self.path, self.queue_depth = path, max(1, int(queue_depth))
        self.direct = False
        self.fd = os.open(path, os.O_RDONLY)
        if direct:
            self._open_direct()
        self.pool = ThreadPoolExecutor(self.queue_depth, thread_name_prefix="engram-disk")
        self.reads = self.warm_rows = 0
        # warm path: rows on pages this table has read through the page cache are gathered from the mapping
        # (RAM speed while the kernel keeps them); the others go to the positioned-read pool. O_DIRECT reads
        # leave nothing in the page cache, so then every row is read.
        self._seen = None if self.direct else \
            torch.zeros((self.offset + self.num_rows * self.row_bytes) // PAGE + 2, dtype=torch.bool)

    def _open_direct(self) -> None:
        flag = getattr(os, "O_DIRECT", None)
        try:
            if flag is None:
                raise OSError("this platform has no O_DIRECT")
            fd = os.open(self.path, os.O_RDONLY | flag)
            probe = mmap.mmap(-1, PAGE)
            os.preadv(fd, [probe], 0)  # filesystems without O_DIRECT fail here (EINVAL), not at open
            probe.close()
        except OSError as e:
            warnings.warn(f"{self.path}: O_DIRECT is not available here ({e.strerror or e}); reading through the "
                          "page cache instead", stacklevel=3)
            return
        os.close(self.fd)
        self.fd, self.direct = fd, True

    def _read_buffered(self, rows: np.ndarray, out: np.ndarray, part: np.ndarray) -> None:
        fd, rb, off = self.fd, self.row_bytes, self.offset
        for i in part:
            view = memoryview(out[i])
            if os.preadv(fd, [view], off + int(rows[i]) * rb) != rb:
                raise TableError(f"{self.path}: short read at row {int(rows[i])} (file truncated?)")

    def _read_direct(self, rows: np.ndarray, out: np.ndarray, part: np.ndarray) -> None:
        fd, rb, off = self.fd, self.row_bytes, self.offset
        page = mmap.mmap(-1, 2 * PAGE)  # page-aligned: a row may straddle two pages
        buf = np.frombuffer(page, dtype=np.uint8)
        try:
            for i in part:
                start = off + int(rows[i]) * rb
                base = start - start % PAGE
                span = PAGE if start + rb <= base + PAGE else 2 * PAGE
                if os.preadv(fd, [memoryview(page)[:span]], base) < start - base + rb:
                    raise TableError(f"{self.path}: short read at row {int(rows[i])} (file truncated?)")
                out[i] = buf[start - base: start - base + rb]
        finally:
            del buf
            page.close()

    def _pages(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return row_span(rows, self.row_bytes, self.offset, PAGE)  # first and last page of each row

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        flat = rows.reshape(-1).to(torch.long)
        if self._seen is not None and flat.numel() and 0 <= int(flat.min()) and int(flat.max()) < self.num_rows:
            first, last = self._pages(flat)
            if bool(self._seen.index_select(0, first).all()) and bool(self._seen.index_select(0, last).all()):
                self.warm_rows += flat.numel()  # all warm: one gather from the mapping, as MmapTable does
                vals = self._mapped.index_select(0, flat)
                return out.copy_(vals) if out is not None else vals
        uniq, inv = torch.unique(flat, return_inverse=True)  # each distinct row read once
        if uniq.numel() and (int(uniq[0]) < 0 or int(uniq[-1]) >= self.num_rows):
            raise TableError(f"{self.path}: row ids must lie in [0, {self.num_rows})")
        vals = torch.empty(uniq.numel(), self.dim, dtype=self.dtype)
        cold = torch.arange(uniq.numel())
        if self._seen is not None and uniq.numel():
            first, last = self._pages(uniq)
            warm = self._seen.index_select(0, first) & self._seen.index_select(0, last)
            hot = warm.nonzero().squeeze(1)
            if hot.numel():
                vals.index_copy_(0, hot, self._mapped.index_select(0, uniq.index_select(0, hot)))
                self.warm_rows += hot.numel()
            cold = (~warm).nonzero().squeeze(1)
        if cold.numel():
            u = uniq.index_select(0, cold).numpy()
            raw = np.empty((len(u), self.row_bytes), dtype=np.uint8)
            parts = [p for p in np.array_split(np.arange(len(u)), min(self.queue_depth, len(u))) if len(p)]
            read = self._read_direct if self.direct else self._read_buffered
            for f in [self.pool.submit(read, u, raw, p) for p in parts]:
                f.result()
            self.reads += len(u)
            vals.index_copy_(0, cold, torch.from_numpy(raw).view(self.dtype).view(len(u), self.dim))
            if self._seen is not None:
                first, last = self._pages(torch.from_numpy(u))
                self._seen[first] = True
                self._seen[last] = True
        vals = vals.index_select(0, inv)
        return out.copy_(vals) if out is not None else vals

    def stats(self) -> dict:
        return {"reads": self.reads, "warm_rows": self.warm_rows, "queue_depth": self.queue_depth,
                "direct": self.direct}

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._mapped = self._seen = None
