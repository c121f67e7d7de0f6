"""Engram table storage behind one gather interface: in RAM, or memory-mapped from disk with a hot-row cache.

Engram addresses depend only on the token ids, so a table far larger than RAM (or than an
accelerator) can live elsewhere and be gathered ahead of use. Every backend implements
`gather(rows (N,) int64) -> (N, dim)`; `offload_tables(model, ...)` moves a model's tables into a
backend and routes its Engram lookups through it (inference).

File layout: a safetensors file holding one tensor `weight` `[rows, dim]` (little-endian), so
`safetensors.safe_open` reads it too; we memory-map the data section directly.

Hot-row cache: n-gram rows are Zipf-distributed, so a small cache of hot rows absorbs most
lookups. The cache is direct-mapped (slot = row mod slots), which keeps lookups fully vectorized:
one compare for hits, one gather from the file for misses. Policy "lru" always installs the most
recent row in its slot; "lfu" admits a row only when its (hashed) lookup count is at least the
resident's. `benchmarks/bench_gather.py` measures both.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from ..utils import atomic_write_bytes

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class TableError(ValueError):
    """A table file is missing, short or corrupt; the message names the file."""


class TableBackend:
    num_rows: int
    dim: int
    dtype: torch.dtype

    def gather(self, rows: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, dim)
        raise NotImplementedError

    def stats(self) -> dict:
        return {}


class InRamTable(TableBackend):
    """A tensor in RAM; gathers with `torch.index_select(..., out=)` into a reused buffer."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach()
        self.num_rows, self.dim = self.weight.shape
        self.dtype = self.weight.dtype

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows (N,) -> (N, dim); pass a preallocated `out` to skip the allocation (~3x faster)."""
        return torch.index_select(self.weight, 0, rows, out=out) if out is not None else \
            torch.index_select(self.weight, 0, rows)


def write_table_file(path: str | os.PathLike, weight: torch.Tensor, chunk_rows: int = 1 << 20) -> Path:
    """Write `weight` as a safetensors file with one tensor `weight`, streamed in chunks, atomically."""
    path = Path(path)
    w = weight.detach().cpu().contiguous()
    dt = _ST_DTYPES.get(w.dtype)
    if dt is None:
        raise TableError(f"table dtype {w.dtype} is not supported (use float32, bfloat16 or float16)")
    nbytes = w.numel() * w.element_size()
    header = json.dumps({"weight": {"dtype": dt, "shape": list(w.shape), "data_offsets": [0, nbytes]}}).encode()
    header += b" " * ((8 - len(header) % 8) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        flat = w.view(torch.uint8).view(w.shape[0], -1) if w.dtype != torch.uint8 else w
        for s in range(0, w.shape[0], chunk_rows):
            f.write(flat[s:s + chunk_rows].numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


class MmapTable(TableBackend):
    """Table memory-mapped from a safetensors file, with a direct-mapped hot-row cache of `cache_bytes`."""

    def __init__(self, path: str | os.PathLike, cache_bytes: int = 64 << 20, policy: str = "lru"):
        path = Path(path)
        if not path.is_file():
            raise TableError(f"table file not found: {path}")
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise TableError(f"{path} is too short to be a table file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 1 << 24):
                raise TableError(f"{path}: corrupt header length {n}")
            try:
                meta = json.loads(f.read(n))["weight"]
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
                raise TableError(f"{path}: corrupt header (expected a safetensors file with a 'weight' tensor)") from None
        self.num_rows, self.dim = meta["shape"]
        dt = meta["dtype"]
        if dt not in _NP:
            raise TableError(f"{path}: unsupported dtype {dt}")
        a, b = meta["data_offsets"]
        if 8 + n + b > size:
            raise TableError(f"{path} is truncated: header promises {b} data bytes, file has {size - 8 - n}")
        arr = np.memmap(path, dtype=_NP[dt], mode="r", offset=8 + n + a, shape=(self.num_rows, self.dim))
        import warnings

        with warnings.catch_warnings():  # a read-only mapping is intended: rows are only ever gathered
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
        self.weight = t.view(torch.bfloat16) if dt == "BF16" else t
        self.dtype = self.weight.dtype
        self.path, self.policy = path, policy
        if policy not in ("lru", "lfu"):
            raise TableError(f"cache policy must be 'lru' or 'lfu', got {policy!r}")
        row_bytes = self.dim * self.weight.element_size()
        self.slots = int(max(0, cache_bytes) // row_bytes)
        self.cache = torch.empty(self.slots, self.dim, dtype=self.dtype)
        self.tags = torch.full((self.slots,), -1, dtype=torch.long)
        self.freq = torch.zeros(max(1, self.slots * 4), dtype=torch.int32)  # hashed lookup counts (lfu)
        self.hits = self.misses = 0

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.reshape(-1).long()
        if self.slots == 0:
            self.misses += rows.numel()
            return torch.index_select(self.weight, 0, rows)
        slot = rows % self.slots
        hit = self.tags.index_select(0, slot) == rows
        hit_idx = hit.nonzero().squeeze(1)
        miss_idx = (~hit).nonzero().squeeze(1)
        out = torch.empty(rows.numel(), self.dim, dtype=self.dtype)
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

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hits / total if total else 0.0,
                "cache_rows": self.slots, "policy": self.policy}


def offload_tables(model, backend: str = "mmap", directory: str | os.PathLike | None = None,
                   cache_bytes: int = 64 << 20, policy: str = "lru") -> dict:
    """Move every Engram table of `model` into a backend and route lookups through it (inference).

    backend "mmap" writes each table to `directory/engram_table_L{layer}.safetensors` (once) and
    frees the in-RAM copy; "ram" keeps the tensor. Returns {layer_id: backend}.
    """
    from ..memory import Engram

    tables = {}
    for mod in model.modules():
        if not isinstance(mod, Engram):
            continue
        mhe = mod.multi_head_embedding
        w = mhe.embedding.weight
        if backend == "ram":
            tb = InRamTable(w)
        elif backend == "mmap":
            if directory is None:
                raise TableError("offload_tables(backend='mmap') needs a directory for the table files")
            f = Path(directory) / f"engram_table_L{mod.layer_id}.safetensors"
            if not f.is_file():
                write_table_file(f, w)
            tb = MmapTable(f, cache_bytes=cache_bytes, policy=policy)
            if tb.num_rows != w.shape[0] or tb.dim != w.shape[1]:
                raise TableError(f"{f} holds a [{tb.num_rows}, {tb.dim}] table, the model needs {list(w.shape)}")
            mhe.embedding.weight = torch.nn.Parameter(torch.empty(0, w.shape[1], dtype=w.dtype), requires_grad=False)
        else:
            raise TableError(f"backend must be 'ram' or 'mmap', got {backend!r}")
        mhe.backend = tb
        tables[mod.layer_id] = tb
    return tables
