"""Engram table storage behind one gather interface: in RAM, or memory-mapped from disk with a hot-row cache.

Engram addresses depend only on the token ids, so a table far larger than RAM (or than an
accelerator) can live elsewhere and be gathered ahead of use. Both backends are `Table`s
(`base.py`: `lookup` for the model, `gather` for plain reads); `offload_tables(model, ...)`
moves a model's tables into a backend and installs it behind each Engram layer.

File layout: a safetensors file holding one tensor `weight` `[rows, dim]` (little-endian), so
`safetensors.safe_open` reads it too; we memory-map the data section directly.

Hot-row cache: n-gram rows are Zipf-distributed, so a small cache of hot rows absorbs most
lookups. The cache is direct-mapped (slot = row mod slots), which keeps lookups fully vectorized:
one compare for hits, one gather from the file for misses. Policy "lru" always installs the most
recent row in its slot; "lfu" admits a row only when its (hashed) lookup count is at least the
resident's. `benchmarks/bench_gather.py` measures both.

Training (`trainable=True`): a backend also keeps the Adam moments of its rows (for `MmapTable`,
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

import json
import math
import os
import struct
import threading
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

from .base import Table, TableError, find_tables, install, uninstall
from .files import map_tensor
from .files import read_header as _read_header
from .blocks import BlockVerifier, UnverifiedTableWarning, write_block_sums, write_sums

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int8: "I8", torch.uint8: "U8",
              torch.int32: "I32", torch.bool: "BOOL", torch.float64: "F64"}


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


def table_file(directory: str | os.PathLike, layer_id: int, rank: int | None = None, world: int | None = None) -> Path:
    """Where layer `layer_id`'s table lives: one file, or with `rank`/`world` one file per rank's shard."""
    shard = f".rank{rank}-of-{world}" if rank is not None else ""
    return Path(directory) / f"engram_table_L{layer_id}{shard}.safetensors"


def write_table_file(path: str | os.PathLike, weight: torch.Tensor, chunk_rows: int = 1 << 20,
                     with_moments: bool = False, page_blocks: bool = False) -> Path:
    """Write `weight` as a safetensors file with one tensor `weight`, streamed in chunks, atomically.

    `with_moments=True` adds zero float32 tensors `exp_avg` and `exp_avg_sq` of the same shape
    (the Adam moments a trainable `MmapTable` keeps beside the rows). `page_blocks`: see `write_safetensors`.
    """
    w = weight.detach().cpu()
    entries = [tensor_entry("weight", w, chunk_rows)]
    return write_safetensors(path, entries + (_zero_moments(*w.shape, chunk_rows) if with_moments else []),
                             block_sums=True, page_blocks=page_blocks)


def new_table_file(path: str | os.PathLike, rows: torch.Tensor, num_rows: int, seed: int | None,
                   with_moments: bool, page_blocks: bool = False) -> Path:
    """A table file of `num_rows` rows: `rows` written out when it holds them, else N(0, 1) drawn from `seed`.

    `rows` gives dim and dtype; it is empty for a model built under `defer_table_allocation()`.
    """
    if rows.shape[0] == num_rows:
        return write_table_file(path, rows, with_moments=with_moments, page_blocks=page_blocks)
    if seed is None:
        raise TableError(f"{path} does not exist and the model has no table rows to write "
                         "(built with defer_table_allocation()): pass init_seed to create it")
    return create_table_file(path, num_rows, rows.shape[1], rows.dtype, seed=seed, with_moments=with_moments,
                             page_blocks=page_blocks)


def create_table_file(path: str | os.PathLike, num_rows: int, dim: int, dtype: torch.dtype = torch.float32,
                      seed: int = 0, with_moments: bool = False, chunk_rows: int = 1 << 18,
                      page_blocks: bool = False) -> Path:
    """A new table file with N(0, 1) rows (nn.Embedding's init) drawn chunk by chunk from `seed`.

    Memory stays at one chunk, so the table can be larger than RAM. Same seed, same file.
    """
    g = torch.Generator().manual_seed(seed)
    chunks = (torch.randn(min(chunk_rows, num_rows - s), dim, generator=g).to(dtype)
              for s in range(0, num_rows, chunk_rows))
    entries = [("weight", dtype, (num_rows, dim), chunks)]
    return write_safetensors(path, entries + (_zero_moments(num_rows, dim, chunk_rows) if with_moments else []),
                             block_sums=True, page_blocks=page_blocks)


def tensor_entry(name: str, t: torch.Tensor, chunk_rows: int = 1 << 18) -> tuple:
    """A `write_safetensors` entry for tensor `t` (e.g. a memory-mapped table), copied one row block at a time."""
    chunks = (t[s:s + chunk_rows] for s in range(0, max(1, t.shape[0]), chunk_rows)) if t.dim() else iter([t])
    return name, t.dtype, tuple(t.shape), chunks


def table_entries(module, tensors: dict, where: str = "") -> list:
    """`write_safetensors` entries for `tensors` (a state dict of `module`, in its order), with every installed
    table's rows (`<name>.embedding.weight`, an empty parameter then) streamed from its backend instead."""
    backed = {f"{name}.embedding.weight": m.table for name, m in find_tables(module) if m.table is not None}
    missing = sorted(set(backed) - set(tensors))
    if missing:
        raise TableError(f"{where or 'the tensors to write'} lack the table entries {missing}")
    return [tensor_entry(k, backed[k].weight if k in backed else v) for k, v in tensors.items()]


def _zero_moments(num_rows: int, dim: int, chunk_rows: int) -> list:
    def zeros():
        for s in range(0, num_rows, chunk_rows):
            yield torch.zeros(min(chunk_rows, num_rows - s), dim)
    return [("exp_avg", torch.float32, (num_rows, dim), zeros()), ("exp_avg_sq", torch.float32, (num_rows, dim), zeros())]


def write_safetensors(path: str | os.PathLike, entries: list, metadata: dict | None = None,
                      progress_bytes: int = 1 << 30, block_sums: bool = False, page_blocks: bool = False) -> Path:
    """Stream tensors into a safetensors file, atomically (temp file, fsync, rename).

    `entries`: `(name, dtype, shape, chunks)` in file order, where `chunks` yields row blocks whose
    concatenation is the tensor, so tensors larger than RAM (memory-mapped, generated) are written
    a block at a time. Files of `progress_bytes` or more show a progress bar. `block_sums=True`
    (table files) also writes the per-block checksums `<file>.blocks` (`tables/blocks.py`),
    computed on the way; the header then carries a fresh nonce, so sums of an older version of the
    file never pass for this one's. `page_blocks=True` (files of the disk tier) pads the header so
    the data starts on a 4 KiB page and sums every page: checking a row read cold costs one page.
    """
    import uuid

    from .blocks import BLOCK_BYTES, PAGE, BlockCrc, write_sums

    path = Path(path)
    if block_sums:
        metadata = {**(metadata or {}), "engram_nonce": uuid.uuid4().hex}
    crc = BlockCrc(PAGE if page_blocks else BLOCK_BYTES) if block_sums else None
    meta, offset = {}, 0
    for name, dtype, shape, _ in entries:
        dt = _ST_DTYPES.get(dtype)
        if dt is None:
            raise TableError(f"{name}: dtype {dtype} is not supported (use float32, bfloat16 or float16)")
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        meta[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        meta["__metadata__"] = metadata
    header = json.dumps(meta).encode()
    align = PAGE if page_blocks else 8  # the data starts at 8 + len(header): pad with spaces (safetensors allows it)
    header += b" " * ((align - (8 + len(header)) % align) % align)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    from tqdm.auto import tqdm

    bar = tqdm(total=offset, unit="B", unit_scale=True, desc=f"writing {path.name}",
               disable=offset < progress_bytes, leave=False)
    with open(tmp, "wb") as f, bar:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for name, dtype, shape, chunks in entries:
            written = 0
            for c in chunks:
                b = c.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if c.numel() else b""
                f.write(b)
                if crc is not None:
                    crc.update(b)
                written += len(b)
                bar.update(len(b))
            a, z = meta[name]["data_offsets"]
            if written != z - a:
                raise TableError(f"{name}: wrote {written} bytes, the header promises {z - a}")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if crc is not None:
        write_sums(path, crc.finish(), crc.block_bytes)
    return path


_JMAGIC = b"ENGJRN01"
_JHEAD = struct.Struct("<8sqqq")  # magic, base step, rows, dim
_JENTRY = struct.Struct("<qI")  # rows in the entry, crc32 of its payload


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
        n, meta, size = _read_header(path)
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
            maps[name] = map_tensor(path, n, size, name, info, writable=writable)
        self._arrays = [a for a, _ in maps.values()]
        self.weight = maps["weight"][1]
        if writable:
            self.exp_avg, self.exp_avg_sq = maps["exp_avg"][1], maps["exp_avg_sq"][1]
        self.dtype = self.weight.dtype
        self.path, self.policy, self.writable, self.durable = path, policy, writable, durable
        if policy not in ("lru", "lfu"):
            raise TableError(f"cache policy must be 'lru' or 'lfu', got {policy!r}")
        row_bytes = self.dim * self.weight.element_size()
        self.slots = int(max(0, cache_bytes) // row_bytes)
        self.cache = torch.empty(self.slots, self.dim, dtype=self.dtype)
        self.tags = torch.full((self.slots,), -1, dtype=torch.long)
        self.freq = torch.zeros(max(1, self.slots * 4), dtype=torch.int32)  # hashed lookup counts (lfu)
        self.hits = self.misses = 0
        self.journal_path = path.with_name(path.name + ".journal")
        self._journal = None
        self._touched = None
        self._jlock = threading.Lock()  # the journal is appended by the step and by `journal_ahead` (pipeline thread)
        self._sync_lock = threading.Lock()  # held by an fdatasync in flight; commit/close wait for it
        self._written = self._synced = 0  # journal bytes appended / known durable
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
        if self.slots == 0:
            self.misses += rows.numel()
            return torch.index_select(self.weight, 0, rows, out=out) if out is not None else \
                torch.index_select(self.weight, 0, rows)
        slot = rows % self.slots
        hit = self.tags.index_select(0, slot) == rows
        hit_idx = hit.nonzero().squeeze(1)
        miss_idx = (~hit).nonzero().squeeze(1)
        out = torch.empty(rows.numel(), self.dim, dtype=self.dtype) if out is None else out
        self.hits += hit_idx.numel()
        self.misses += miss_idx.numel()
        if hit_idx.numel():
            out.index_copy_(0, hit_idx, self.cache.index_select(0, slot.index_select(0, hit_idx)))
        if miss_idx.numel():
            mrows = rows.index_select(0, miss_idx)
            vals = torch.index_select(self.weight, 0, mrows)
            out.index_copy_(0, miss_idx, vals)
            mslot = slot.index_select(0, miss_idx)
            if self.policy == "lfu":
                fi = mrows % self.freq.numel()
                self.freq.index_add_(0, fi, torch.ones_like(fi, dtype=torch.int32))
                resident = self.tags.index_select(0, mslot)
                rfreq = torch.where(resident >= 0, self.freq[resident.clamp_min(0) % self.freq.numel()], -1)
                admit = (self.freq.index_select(0, fi) >= rfreq).nonzero().squeeze(1)
                mslot, mrows, vals = mslot[admit], mrows[admit], vals[admit]
            # several misses may map to one slot: install exactly one per slot (the last), so that
            # tags and cached rows are written from the same element (index_copy_ with duplicates is not)
            order = torch.argsort(mslot, stable=True)
            ms = mslot.index_select(0, order)
            last = torch.ones_like(ms, dtype=torch.bool)
            last[:-1] = ms[1:] != ms[:-1]
            pick = order[last]
            self.tags.index_copy_(0, mslot.index_select(0, pick), mrows.index_select(0, pick))
            self.cache.index_copy_(0, mslot.index_select(0, pick), vals.index_select(0, pick))
        return out

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
        if not self._journal_rows(rows):
            raise TableError(f"{self.path}: call commit(step) or recover(step) before the first write "
                             "(it starts the undo journal)")

    def journal_ahead(self, rows: torch.Tensor) -> None:
        """Journal now the rows a coming step will write (its batch's distinct rows, known once the data
        pipeline has hashed it), on the caller's thread, so that the step's `begin_write` finds them journaled
        and, usually, durable: the entry and its fsync overlap the current step instead of delaying the next.

        Safe to run while a step writes other rows: a row's value changes only after `begin_write` has seen it
        journaled (under the journal lock), so a row journaled here still holds its checkpoint value."""
        if self.writable:
            self._journal_rows(rows)

    def _journal_rows(self, rows: torch.Tensor) -> bool:
        """Journal the rows not yet journaled since the checkpoint and make the journal durable up to them,
        those another thread journaled included; False when no journal is open (before the first commit)."""
        with self._jlock:
            journal = self._journal
            if journal is None:
                return False
            fresh = rows[~self._touched.index_select(0, rows)]
            if fresh.numel():
                self._journal_append(fresh)
                self._touched.index_fill_(0, fresh, True)
            need = self._written
        self._sync(journal, need)
        return True

    def _sync(self, journal, upto: int) -> None:
        """fdatasync `journal` up to byte `upto` (`durable` tables), outside the append lock. A journal that a
        commit has replaced meanwhile needs none (the table it undoes is flushed); the sync lock keeps that
        commit from closing the file under an fdatasync."""
        if not self.durable:
            return
        with self._sync_lock:
            if journal is self._journal and self._synced < upto:
                os.fdatasync(journal.fileno())
                self._synced = max(self._synced, upto)

    def end_write(self, rows):
        if self._dirty is not None:  # blocks we changed: trusted, and re-summed at the next commit
            for off in self._offsets:
                b = self.blocks.blocks_of(rows, off, self._row_bytes)
                self._dirty[b] = True
                self.blocks.ok[b] = True
        if self.slots:  # keep cached copies coherent
            slot = rows % self.slots
            cached = (self.tags.index_select(0, slot) == rows).nonzero().squeeze(1)
            if cached.numel():
                self.cache.index_copy_(0, slot.index_select(0, cached), self.weight.index_select(0, rows[cached]))

    def _need_writable(self):
        if not self.writable:
            raise TableError(f"{self.path} is open read-only; open it with MmapTable(..., writable=True) to train")

    def _journal_append(self, rows: torch.Tensor) -> None:
        payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (
            rows.long(), self.weight.index_select(0, rows), self.exp_avg.index_select(0, rows),
            self.exp_avg_sq.index_select(0, rows)))
        self._journal.write(_JENTRY.pack(rows.numel(), zlib.crc32(payload)) + payload)
        self._journal.flush()
        self._written = self._journal.tell()

    def _journal_entries(self):
        """Valid undo entries (rows, w, m, v) of the journal; stops at a torn or corrupt tail."""
        data = self.journal_path.read_bytes()
        esz = self.weight.element_size()
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

    def journal_step(self) -> int | None:
        """The checkpoint step the current journal undoes to, or None if there is no valid journal."""
        try:
            with open(self.journal_path, "rb") as f:
                magic, step, rows, dim = _JHEAD.unpack(f.read(_JHEAD.size))
        except (FileNotFoundError, struct.error):
            return None
        return step if magic == _JMAGIC and (rows, dim) == (self.num_rows, self.dim) else None

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
        with self._sync_lock, self._jlock:  # (no `journal_ahead` append or fsync on the journal being replaced)
            self.flush()
            self._commit_sums()
            if self._journal is not None:
                self._journal.close()
            tmp = self.journal_path.with_name(f".{self.journal_path.name}.tmp")
            with open(tmp, "wb") as f:
                f.write(_JHEAD.pack(_JMAGIC, step, self.num_rows, self.dim))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.journal_path)
            self._journal = open(self.journal_path, "ab")
            self._written = self._synced = self._journal.tell()
            self._touched = torch.zeros(self.num_rows, dtype=torch.bool)

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
                sums[b] = zlib.crc32(self.blocks.data[b * bb: (b + 1) * bb])
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
        base = self.journal_step()
        if base is None:
            raise TableError(f"{self.journal_path} is missing or corrupt: cannot tell whether {self.path.name} "
                             f"matches checkpoint step {step}")
        if base > step:
            raise TableError(f"{self.path.name} has been committed at step {base}; it cannot be rolled back to step "
                             f"{step} (only the newest checkpoint's table state is kept)")
        restored = 0
        if base == step:  # newest entry first, so a row journaled twice ends at its oldest (checkpoint) value
            for rows, w, m, v in reversed(list(self._journal_entries())):
                self._put(rows, w, m, v)  # (not journaled: these are the checkpoint's values)
                restored += rows.numel()
        self.tags.fill_(-1)  # cached rows may predate the rollback
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
        with self._sync_lock, self._jlock:
            if self._journal is not None:
                self._journal.close()
                self._journal = None

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hits / total if total else 0.0,
                "cache_rows": self.slots, "policy": self.policy}


def offload_tables(model, backend: str = "mmap", directory: str | os.PathLike | None = None,
                   cache_bytes: int = 64 << 20, policy: str = "lru", trainable: bool = False,
                   overwrite: bool = False, init_seed: int | None = None) -> dict[int, Table]:
    """Move every Engram table of `model` into a backend and install it behind its layer.

    backend "mmap" writes each table to `directory/engram_table_L{layer}.safetensors` (unless the
    file exists and `overwrite` is False: then the file's rows are used) and frees the in-RAM
    copy; "disk" does the same and reads rows with many positioned reads in flight (`DiskTable`,
    for files colder than the page cache; read-only); "ram" keeps the tensor. `trainable=True` keeps
    Adam moments in the backend (in the same file for "mmap", opened writable with its undo journal)
    and lets `engram.optim.TableAdam` train the rows; the model's table parameters become empty. A model built under
    `engram.memory.defer_table_allocation()` has no table rows to write: its files are created
    with N(0, 1) rows from `init_seed + layer` (`create_table_file`), never in RAM.
    Returns {layer_id: table}.
    """
    if backend not in ("ram", "mmap", "disk"):
        raise TableError(f"backend must be 'ram', 'mmap' or 'disk', got {backend!r}")
    if backend in ("mmap", "disk") and directory is None:
        raise TableError(f"offload_tables(backend={backend!r}) needs a directory for the table files")
    if backend == "disk" and trainable:
        raise TableError("the disk backend is read-only (inference); train with backend='mmap'")
    tables = {}
    for _, mhe in find_tables(model):
        w = mhe.embedding.weight
        if backend == "ram":
            if w.shape[0] != mhe.num_rows:
                raise TableError("offload_tables(backend='ram') needs the table in the model; it was built "
                                 "with defer_table_allocation()")
            table = InRamTable(w.detach().clone() if trainable else w)
        else:
            f = table_file(directory, mhe.layer_id)
            if overwrite or not f.is_file():
                new_table_file(f, w.detach(), mhe.num_rows, None if init_seed is None else init_seed + mhe.layer_id,
                               with_moments=trainable, page_blocks=backend == "disk")
            if backend == "disk":  # cold tier: positioned reads, many in flight (tables/disk.py)
                from .disk import DiskTable

                table = DiskTable(f)
            else:
                table = MmapTable(f, cache_bytes=cache_bytes, policy=policy, writable=trainable)
        table.trainable = trainable and w.requires_grad
        install(mhe, table, free_parameter=backend in ("mmap", "disk") or trainable)
        tables[mhe.layer_id] = table
    return tables


def restore_tables(model) -> None:
    """Undo `offload_tables`: copy every table's rows back into the model's table parameters."""
    for _, mhe in find_tables(model):
        if mhe.table is not None:
            uninstall(mhe)
