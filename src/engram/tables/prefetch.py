"""Prefetch Engram rows: the inference pipeline's hashing stage. When a batch arrives, hash every Engram
layer's ids and gather the rows on a background thread while earlier blocks compute; a layer waits
only if its rows are not ready yet.

    pf = Prefetcher(model)
    rows = pf.submit(input_ids)                       # returns at once: {layer_id: PendingRows}
    logits = model(input_ids, engram_rows=rows).logits
    Prefetcher.attach(model)                          # or: every forward and generate() prefetch

Gathers go through each layer's table (`MultiHeadEmbedding` -> `Table.lookup`) and release the
GIL (index_select, page-ins of memory-mapped tables), so they overlap with the backbone's compute
on CPU. On GPU (`device="cuda"`, tables offloaded to host memory) the rows are gathered straight
into page-locked memory and copied on a side CUDA stream; `PendingRows.wait()` makes the
current stream wait for that copy's event, so the copy overlaps the earlier blocks' kernels and
nothing synchronizes the host.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..memory import Engram
from .base import find_tables


class PendingRows:
    """Rows (B, T, H, d) being gathered on the prefetch thread; `wait()` returns them, safe on the current stream."""

    def __init__(self, future: Future):
        self.future = future

    def wait(self) -> torch.Tensor:
        rows = self.future.result()
        if isinstance(rows, _OnStream):
            cur = torch.cuda.current_stream(rows.tensor.device)
            cur.wait_event(rows.event)  # the GPU waits for the copy; the host does not
            rows.tensor.record_stream(cur)  # its memory (allocated on the side stream) is in use on this one too
            return rows.tensor
        return rows


class Prefetcher:
    """See the module doc. On CPU, calls with fewer than `inline_below` tokens (decoding steps) hash and
    gather on the calling thread: with a token or two there is almost no compute to overlap, and the
    thread hand-offs cost more than they hide (`benchmarks/bench_decode_cold.py`)."""

    inline_below = 16

    def __init__(self, model, device: torch.device | str | None = None):
        self.layers = {mhe.layer_id: mhe for _, mhe in find_tables(model)}
        engrams = [m for m in model.modules() if isinstance(m, Engram)]
        if not engrams:
            raise ValueError("Prefetcher: the model has no Engram layers")
        self.mapping = engrams[0].hash_mapping
        self._start(device)

    def _start(self, device) -> None:
        """The worker thread and, for a CUDA `device`, the side stream the copies run on."""
        # the hashing kernel adds head offsets in its own pass when they are the tables' offsets (always, for
        # tables built from this mapping); else each table adds its own
        self.offsets = all(m.offsets.tolist() == self.mapping.head_offsets(lid) for lid, m in self.layers.items())
        self.device = torch.device(device) if device is not None else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-prefetch")
        self.stream = torch.cuda.Stream(self.device) if self.device is not None and self.device.type == "cuda" else None

    @classmethod
    def for_tables(cls, layers: dict, mapping, device=None) -> "Prefetcher":
        """A prefetcher over given tables `{layer_id: MultiHeadEmbedding}` hashed by `mapping` (models whose
        n-gram lookups are not engram's `Engram` layers, e.g. `engram.integrations.qwen4_exp`)."""
        pf = cls.__new__(cls)
        pf.layers, pf.mapping = dict(layers), mapping
        pf._start(device)
        return pf

    @classmethod
    def attach(cls, model, device=None) -> "Prefetcher":
        """Make every forward of `model` (and so `generate()`) prefetch its Engram rows automatically."""
        pf = cls(model, device)
        model.prefetcher = pf
        return pf

    @staticmethod
    def detach(model) -> None:
        """Stop prefetching for `model` (its forwards hash and gather inline again)."""
        pf = getattr(model, "prefetcher", None)
        if pf is not None:
            pf.close()
            model.prefetcher = None

    def submit(self, input_ids: torch.Tensor, history: torch.Tensor | None = None) -> dict[int, PendingRows]:
        """Start hashing and gathering for all Engram layers; one pending value per layer, in layer order.

        `history` (B, <= N-1): the ids before `input_ids` when decoding with a cache; rows are
        gathered for the positions of `input_ids` only.
        """
        ids = input_ids.detach().cpu()
        hist = history.detach().cpu() if history is not None else None
        grad = torch.is_grad_enabled()  # grad mode is per thread: carry the caller's into the worker
        def gather(mhe, h, out=None):  # (B, T, H) ids -> (B, T, H, d)
            return mhe.gather(h, out=out) if self.offsets else mhe(h, out=out)

        if self.stream is None and ids.numel() < self.inline_below:
            h = self.mapping.hash_continuation(ids, hist, offsets=self.offsets)
            return {lid: PendingRows(_done(gather(mhe, h[lid]))) for lid, mhe in sorted(self.layers.items())}
        hashed: Future = self.pool.submit(self.mapping.hash_continuation, ids, hist, self.offsets)
        pending = {}
        for lid, mhe in sorted(self.layers.items()):
            def work(lid=lid, mhe=mhe):
                h = hashed.result()[lid]  # (B, T, H)
                with torch.set_grad_enabled(grad):
                    if self.stream is None or mhe.table is None:
                        return gather(mhe, h)  # (B, T, H, d)
                    out = torch.empty(h.numel(), mhe.dim, dtype=mhe.table.dtype, pin_memory=True)
                    rows = gather(mhe, h, out=out)  # (B, T, H, d), page-locked
                    with torch.cuda.stream(self.stream):
                        on_dev = rows.to(self.device, non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(self.stream)
                return _OnStream(on_dev, done)
            pending[lid] = PendingRows(self.pool.submit(work))
        return pending

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class _OnStream:
    """Rows copied to the GPU on the prefetcher's side stream, with the event that marks the copy done."""

    def __init__(self, tensor: torch.Tensor, event):
        self.tensor, self.event = tensor, event


def readahead_for(model):
    """A `Batcher` read-ahead for `model`'s file-backed tables, or None when it has none.

    Given a batch's hash ids `{layer: (B, T, H)}`, it reads the rows (and their Adam moments) that
    batch will touch, on the data pipeline's thread, so that a table file colder than the page cache
    pages them in while the current step computes. The values read are discarded; the step reads
    them again from the page cache. A training table also journals those rows there
    (`MmapTable.journal_ahead`), so their undo entry and its fsync leave the step's critical path.
    """
    targets = {mhe.layer_id: mhe for _, mhe in find_tables(model) if hasattr(mhe.table, "touch")}
    if not targets:
        return None

    def readahead(hash_ids: dict) -> None:
        for lid, mhe in targets.items():
            if lid in hash_ids:
                rows = torch.unique(mhe.table_rows(hash_ids[lid]))
                mhe.table.touch(rows)
                if getattr(mhe.table, "journal_ahead", None) is not None and mhe.table.trainable:
                    mhe.table.journal_ahead(rows)

    return readahead
