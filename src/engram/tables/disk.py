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

Checked reads: a file with block sums (`tables/blocks.py`) has each block checked the first time
a row in it is read: the reader fetches the whole block instead of the row and compares its crc32,
so a torn or flipped block is a one-line `TableError`, never a wrong row. The disk tier's files
(`offload_tables(..., "disk")`, `write_safetensors(page_blocks=True)`) have page-aligned 4 KiB
blocks, so a checked cold read costs the same device read as an unchecked one (the page) plus a
~1 us crc32; with 64 KiB blocks (files written for the mmap tier) a first read fetches 16 pages.
A page becomes warm only once every block it touches is checked.

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

# Optional compiled kernels (engram-torch[fast]): `_KERNELS` finds cold rows in one pass instead of five torch
# ops; `_READER` reads without the GIL (without it the Python loop below reads).
from ._diskkernels import KERNELS as _KERNELS
from ._diskkernels import READER as _READER
from .base import Table, TableError
from .blocks import PAGE, BlockVerifier, row_span
from .files import NP_DTYPES, QUANT_NP_DTYPES, map_tensor
from .header import read_header as _read_header

# Coalesced cold reads (`plan_ranges`): rows whose aligned spans lie within RANGE_GAP of each other share one
# read (on this project's VM, reading a hole of up to 16 KiB was cheaper than another random read, for
# bench_peers' sparse and dense tables alike); a range is cut after ~RANGE_MAX bytes so the pool stays busy.
RANGE_GAP = 4 * PAGE
RANGE_MAX = 256 << 10


def plan_ranges(rows: np.ndarray, row_bytes: int, offset: int, align: int, a0: int, gap: int = RANGE_GAP,
                max_bytes: int = RANGE_MAX) -> np.ndarray:
    """Coalesced reads for sorted distinct `rows`: (R, 4) int64 rows (lo, hi, i0, i1), the file bytes [lo, hi)
    that hold rows[i0:i1], aligned to `align` from `a0` (the block sums' blocks, or pages). Spans closer than
    `gap` merge; a range is cut where it passes `max_bytes` (it may exceed it by one row's aligned span).

    A dense gather (a small table, or many rows per page) becomes a few large reads instead of one per row,
    which is what a peer's single sorted reader gets from the kernel's read-ahead (docs/performance.md,
    "Against the peers"); a sparse one (rows pages apart) stays one read per row."""
    n = len(rows)
    s = offset + rows.astype(np.int64) * row_bytes
    lo = a0 + (s - a0) // align * align
    hi = a0 + -(-(s + row_bytes - a0) // align) * align
    new = np.empty(n, dtype=bool)
    new[0] = True
    new[1:] = lo[1:] > hi[:-1] + gap
    seg_start = lo[new][np.cumsum(new) - 1]
    chunk = (lo - seg_start) // max_bytes
    new[1:] |= chunk[1:] != chunk[:-1]  # (two ranges may share a block at the cut: it is read twice, checked once)
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], n)
    return np.stack([lo[starts], hi[ends - 1], starts, ends], axis=1)


SMALL_SPLIT = 2  # shares of a few cold rows outside `_gather_small`: the calling thread and one pool thread


def _aligned(span: int) -> np.ndarray:
    """`span` bytes starting on a page boundary (O_DIRECT reads need it)."""
    raw = np.empty(span + PAGE, dtype=np.uint8)
    return raw[(-raw.ctypes.data) % PAGE:][:span]


class DiskTable(Table):
    """Read-only rows of a table file, gathered by `queue_depth` concurrent positioned reads (see module doc).

    `tensor`: the file's tensor holding the rows ("weight"; "codes" for a quantized file, whose
    decoding `tables.open_rows(..., "disk")` adds). Gathers of fewer than
    `inline_below` rows (decoding steps) are read on the calling thread, with numba in one compiled
    call (no dedup by sorting, no pool hand-off; without numba, shared with one pool thread): on a
    low-latency device (this VM: ~50 us per 4 KiB read) handing 8 reads to the pool costs more than
    the reads (`benchmarks/bench_disk.py`: 8 cold rows 0.63 ms here, 1.11 ms through the pool). Set
    it to 0 on a high-latency device.
    """

    inline_below = 16

    def __init__(self, path, queue_depth: int = 32, direct: bool = False, tensor: str = "weight"):
        # the file mapped read-only (checks dtype and size; no page is read until a warm row is gathered from it)
        arr, self._mapped, self.offset = self._map(path, tensor)
        self._mapped_bytes = arr.view(np.uint8).reshape(arr.shape[0], -1)  # (N, row bytes), for the compiled path
        self.num_rows, self.dim = self._mapped.shape
        self.dtype = self._mapped.dtype
        self.row_bytes = self.dim * self._mapped.element_size()
        self.path, self.queue_depth = path, max(1, int(queue_depth))
        self.direct = False
        self.fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):  # rows are read at random: no kernel read-ahead around each one
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        if direct:
            self._open_direct()
        self.pool = ThreadPoolExecutor(self.queue_depth, thread_name_prefix="engram-disk")
        self.reads = self.warm_rows = self.ranges = 0
        self.blocks = BlockVerifier.open(path)  # None (after one warning) for a file without current sums
        if self.blocks is not None and self.blocks.block_bytes > PAGE:
            warnings.warn(f"{path}: its block sums cover {self.blocks.block_bytes // 1024} KiB, so the first read of "
                          f"each block fetches all of it to check it; offload_tables(..., 'disk', overwrite=True) "
                          "writes the file with 4 KiB sums", stacklevel=2)
        # page-aligned sums of whole pages (the disk tier's files): the pages of a row lie in the blocks its read
        # checked, so they are warm at once; otherwise a page is warm when every block it touches is checked
        self._pages_in_blocks = self.blocks is None or (self.blocks.block_bytes % PAGE == 0
                                                        and self.blocks.data_offset % PAGE == 0)
        # warm path: rows on pages this table has read through the page cache are gathered from the mapping
        # (RAM speed while the kernel keeps them); the others go to the positioned-read pool. O_DIRECT reads
        # leave nothing in the page cache, so then every row is read.
        self._seen = None if self.direct else \
            torch.zeros((self.offset + self.num_rows * self.row_bytes) // PAGE + 2, dtype=torch.bool)

    def _map(self, path, tensor: str):
        """(numpy memmap, torch view (N, dim), file offset of row 0) of the rows of `tensor` in table file `path`
        (a safetensors file; `tables.gguf` maps a GGUF tensor instead)."""
        header = _read_header(path, required=(tensor,))
        arr, view = map_tensor(path, header, tensor, dtypes={**NP_DTYPES, **QUANT_NP_DTYPES})
        return arr, view, header.data_start + header.entries[tensor]["data_offsets"][0]

    @property
    def weight(self) -> torch.Tensor:
        """All rows, mapped read-only (N, dim): for saving or copying the table out; pages are read as touched
        and not checked here (`engram verify` checks a whole file)."""
        return self._mapped

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

    def _read_rows(self, rows: np.ndarray, out: np.ndarray, part: np.ndarray) -> None:
        """Read rows `rows[part]` into `out[part]` (one positioned read each; a reader thread's share).

        A row in a block not yet checked is read with its whole block(s), which are checked first."""
        fd, rb, off, blocks, direct = self.fd, self.row_bytes, self.offset, self.blocks, self.direct
        if blocks is not None:  # (locals: this loop runs once per row, holding the GIL between reads)
            ok, bb, d0 = blocks.ok_np, blocks.block_bytes, blocks.data_offset  # ok: sees other threads' checks
            d_end = d0 + blocks.size
        buf = mmap.mmap(-1, 2 * PAGE)  # page-aligned (O_DIRECT needs it); grown for blocks larger than a page
        mv = memoryview(buf)
        try:
            for i in part:
                start = off + int(rows[i]) * rb
                lo, hi, b0 = start, start + rb, -1
                if blocks is not None and blocks.unverified:
                    b0, b1 = (start - d0) // bb, (hi - 1 - d0) // bb
                    if ok[b0] and ok[b1]:
                        b0 = -1
                    else:  # read the whole block(s) and check them first
                        lo, hi = d0 + b0 * bb, min(d0 + (b1 + 1) * bb, d_end)
                base = lo - lo % PAGE if direct else lo
                end = -(-hi // PAGE) * PAGE if direct else hi
                if end - base > len(buf):
                    mv.release()
                    buf.close()
                    buf = mmap.mmap(-1, -(-(end - base) // PAGE) * PAGE)
                    mv = memoryview(buf)
                if os.preadv(fd, [mv[:end - base]], base) < hi - base:
                    raise TableError(f"{self.path}: short read at row {int(rows[i])} (file truncated?)")
                if b0 >= 0:
                    blocks.check_read(b0, b1, mv[lo - base:hi - base], rb, off - d0)
                out[i] = mv[start - base:start - base + rb]
        finally:
            try:
                mv.release()
                buf.close()
            except BufferError:  # an error's traceback still holds a view of the buffer: freed with it
                pass

    def _scratch(self, b) -> np.ndarray:
        """A page-aligned buffer for one read: a row, or its block(s) with their pages."""
        return _aligned(self.row_bytes + 2 * PAGE + (2 * b.block_bytes if b is not None else 0))

    def _sums(self):
        """(verifier or None, ok flags, sums, block bytes, data start, data end) for the compiled loops. They mark
        blocks checked in `ok` without counting them, so `unverified` stays an upper bound (never 0 early; a
        recount per gather would cost a pass over 25M flags for a 100 GB table): they consult `ok` per row."""
        b = self.blocks if self.blocks is not None and self.blocks.unverified else None
        if b is None:
            return None, np.zeros(0, dtype=bool), np.zeros(0, dtype="<u4"), 1, 0, 0
        return b, b.ok_np, b.sums, b.block_bytes, b.data_offset, b.data_offset + b.size

    def _read_rows_fast(self, rows: np.ndarray, out: np.ndarray, part: np.ndarray) -> None:
        """`_read_rows` compiled without the GIL (`_diskkernels.READER`)."""
        b, ok, sums, bb, d0, d_end = self._sums()
        kind, at = _READER.get()[0](self.fd, rows, part.astype(np.int64), self.row_bytes, self.offset, out,
                                    self._scratch(b), self.direct, ok, sums, bb, d0, d_end)
        self._raise(kind, at, rows, b)

    def _read_ranges_fast(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Sorted distinct cold `rows` -> `out` by coalesced reads (`plan_ranges`), shared among the pool."""
        b, ok, sums, bb, d0, d_end = self._sums()
        align, a0 = (bb, d0) if b is not None else (PAGE, 0)
        ranges = plan_ranges(rows, self.row_bytes, self.offset, align, a0, RANGE_GAP, RANGE_MAX)
        span = RANGE_MAX + self.row_bytes + 2 * align + 2 * PAGE
        if int((ranges[:, 1] - ranges[:, 0]).max()) + 2 * PAGE > span:  # (the kernel reads into `span` bytes)
            raise RuntimeError("engram bug: a planned read is larger than its buffer")
        kernel = _READER.get()[2]

        def work(part):
            return kernel(self.fd, rows, ranges, part, self.row_bytes, self.offset, out, _aligned(span), self.direct,
                          ok, sums, bb, d0, d_end)

        parts = [p for p in np.array_split(np.arange(len(ranges), dtype=np.int64), min(self.queue_depth, len(ranges)))
                 if len(p)]
        for f in [self.pool.submit(work, p) for p in parts]:
            kind, at = f.result()
            self._raise(kind, at, rows, b)
        self.ranges += len(ranges)

    def _raise(self, kind: int, at: int, rows, b) -> None:
        """The one-line error for a reader's status `kind` (1 short read at rows[at], 2 block `at` corrupt,
        3 row ids out of range); nothing for 0."""
        if kind == 1:
            raise TableError(f"{self.path}: short read at row {int(rows[at])} (file truncated?)")
        if kind == 2:
            b.fail(at, self.row_bytes, self.offset - b.data_offset)
        if kind == 3:
            raise TableError(f"{self.path}: row ids must lie in [0, {self.num_rows})")

    def _gather_small(self, flat: torch.Tensor) -> torch.Tensor:
        """A decoding step's few rows, in one compiled call on this thread (no unique, no pool hand-off)."""
        b, ok, sums, bb, d0, d_end = self._sums()
        aligned = b is None or self._pages_in_blocks
        seen = self._seen.numpy() if self._seen is not None else np.zeros(0, dtype=bool)
        raw = np.empty((flat.numel(), self.row_bytes), dtype=np.uint8)
        ids = flat.numpy()
        kind, at, reads, warm = _READER.get()[1](self.fd, ids, self.row_bytes, self.offset, self.num_rows, seen,
                                           self._mapped_bytes, raw, self._scratch(b), self.direct, ok, sums, bb,
                                           d0, d_end, aligned)
        self.reads += reads
        self._raise(kind, at, ids, b)
        if self._seen is not None and not aligned:
            self._mark_seen(flat)  # (pages whose every block is now checked)
        self.warm_rows += warm
        return torch.from_numpy(raw).view(self.dtype).view(flat.numel(), self.dim)

    def _mark_seen(self, rows: torch.Tensor) -> None:
        """Mark the pages of rows just read warm: those whose every block is checked (or with no sums)."""
        pages = torch.cat(self._pages(rows))
        b = self.blocks
        if b is not None and b.unverified and not self._pages_in_blocks:
            if b.block_bytes < PAGE:
                return  # a page spans many blocks: pages are warm once the whole file is checked
            first = (pages * PAGE - b.data_offset).clamp_min(0) // b.block_bytes
            last = (((pages + 1) * PAGE - 1 - b.data_offset) // b.block_bytes).clamp(0, len(b.sums) - 1)
            pages = pages[b.ok.index_select(0, first) & b.ok.index_select(0, last)]
        self._seen[pages] = True

    def _pages(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return row_span(rows, self.row_bytes, self.offset, PAGE)  # first and last page of each row

    def _all_warm(self, flat: torch.Tensor) -> bool:
        """Every row id in range and on pages already read (and checked)."""
        kernel = _KERNELS.get()
        if kernel is not None:
            return kernel(flat.numpy(), self.num_rows, self.row_bytes, self.offset, self._seen.numpy()) < 0
        if not (0 <= int(flat.min()) and int(flat.max()) < self.num_rows):
            return False
        first, last = self._pages(flat)
        return bool(self._seen.index_select(0, first).all()) and bool(self._seen.index_select(0, last).all())

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        flat = rows.reshape(-1).to(torch.long)
        if self._seen is not None and flat.numel() and self._all_warm(flat):
            self.warm_rows += flat.numel()  # all warm: one gather from the mapping, as MmapTable does
            vals = self._mapped.index_select(0, flat)
            return out.copy_(vals) if out is not None else vals
        if 0 < flat.numel() < self.inline_below and _READER.get() is not None:
            vals = self._gather_small(flat)
            return out.copy_(vals) if out is not None else vals
        uniq, inv = torch.unique(flat, return_inverse=True)  # each distinct row read once
        if uniq.numel() and (int(uniq[0]) < 0 or int(uniq[-1]) >= self.num_rows):
            self._raise(3, 0, None, None)
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
            read = self._read_rows_fast if _READER.get() is not None else self._read_rows
            if _READER.get() is not None and len(u) >= self.inline_below:
                self._read_ranges_fast(u, raw)
            elif len(u) < self.inline_below:  # a few cold rows: this thread reads a share, one pool thread the rest
                parts = np.array_split(np.arange(len(u)), min(len(u), SMALL_SPLIT))
                others = [self.pool.submit(read, u, raw, p) for p in parts[1:]]
                read(u, raw, parts[0])
                for f in others:
                    f.result()
            else:
                parts = [p for p in np.array_split(np.arange(len(u)), min(self.queue_depth, len(u))) if len(p)]
                for f in [self.pool.submit(read, u, raw, p) for p in parts]:
                    f.result()
            self.reads += len(u)
            vals.index_copy_(0, cold, torch.from_numpy(raw).view(self.dtype).view(len(u), self.dim))
            if self._seen is not None:
                self._mark_seen(torch.from_numpy(u))
        vals = vals.index_select(0, inv)
        return out.copy_(vals) if out is not None else vals

    def stats(self) -> dict:
        return {"reads": self.reads, "ranges": self.ranges, "warm_rows": self.warm_rows,
                "queue_depth": self.queue_depth, "direct": self.direct}

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._mapped = self._seen = self.blocks = None
