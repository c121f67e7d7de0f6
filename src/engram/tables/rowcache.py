"""A direct-mapped hot-row cache in front of a table's rows (n-gram rows are Zipf-distributed, so a few
hot rows absorb most lookups).

Slot = row mod slots keeps lookups fully vectorized: one compare for hits, one gather from the source
for misses. Policy "lru" always installs the most recent row in its slot; "lfu" admits a row only when
its (hashed) lookup count is at least the resident's. `benchmarks/bench_gather.py` measures both.
"""

from __future__ import annotations

import torch

from .base import TableError


class RowCache:
    """`slots` cached rows of `dim` values (`dtype`): `rows[s]` holds table row `tags[s]` (-1: empty)."""

    def __init__(self, slots: int, dim: int, dtype: torch.dtype, policy: str = "lru"):
        if policy not in ("lru", "lfu"):
            raise TableError(f"cache policy must be 'lru' or 'lfu', got {policy!r}")
        self.slots, self.policy = int(slots), policy
        self.rows = torch.empty(self.slots, dim, dtype=dtype)  # (slots, dim)
        self.tags = torch.full((self.slots,), -1, dtype=torch.long)
        self.freq = torch.zeros(max(1, self.slots * 4), dtype=torch.int32)  # hashed lookup counts (lfu)
        self.hits = self.misses = 0

    def gather(self, rows: torch.Tensor, source: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`source[rows]` (rows (R,) int64 -> (R, dim)): hits from the cache, misses read from `source` and
        installed."""
        if self.slots == 0:
            self.misses += rows.numel()
            return (torch.index_select(source, 0, rows, out=out) if out is not None
                    else torch.index_select(source, 0, rows))
        slot = rows % self.slots
        hit = self.tags.index_select(0, slot) == rows
        hit_idx = hit.nonzero().squeeze(1)
        miss_idx = (~hit).nonzero().squeeze(1)
        out = torch.empty(rows.numel(), source.shape[1], dtype=source.dtype) if out is None else out
        self.hits += hit_idx.numel()
        self.misses += miss_idx.numel()
        if hit_idx.numel():
            out.index_copy_(0, hit_idx, self.rows.index_select(0, slot.index_select(0, hit_idx)))
        if miss_idx.numel():
            mrows = rows.index_select(0, miss_idx)
            vals = torch.index_select(source, 0, mrows)
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
            self.rows.index_copy_(0, mslot.index_select(0, pick), vals.index_select(0, pick))
        return out

    def refresh(self, rows: torch.Tensor, source: torch.Tensor) -> None:
        """Rows just written in `source`: cached copies of them are updated (the cache stays coherent)."""
        if self.slots:
            slot = rows % self.slots
            cached = (self.tags.index_select(0, slot) == rows).nonzero().squeeze(1)
            if cached.numel():
                self.rows.index_copy_(0, slot.index_select(0, cached), source.index_select(0, rows[cached]))

    def clear(self) -> None:
        self.tags.fill_(-1)

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hits / total if total else 0.0,
                "cache_rows": self.slots, "policy": self.policy}
