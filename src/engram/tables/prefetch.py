"""Prefetch Engram rows: hash every Engram layer's ids when a batch arrives and gather the rows on a
background thread while earlier blocks compute; a layer waits only if its rows are not ready yet.

    pf = Prefetcher(model)
    rows = pf.submit(input_ids)                       # returns at once: {layer_id: Future}
    logits = model(input_ids, engram_rows=rows).logits
    Prefetcher.attach(model)                          # or: every forward and generate() prefetch

Gathers release the GIL (index_select, page-ins of memory-mapped tables), so they overlap with
the backbone's compute on CPU. On GPU (`device="cuda"`, tables offloaded to host memory) the rows
are gathered straight into page-locked memory and copied on a side CUDA stream; the Engram layer
makes its stream wait for that copy's event (`resolve_rows`), so the copy overlaps the earlier
blocks' kernels and nothing synchronizes the host.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Prefetcher:
    def __init__(self, model, device: torch.device | str | None = None):
        from ..memory import Engram

        self.engrams = {m.layer_id: m for m in model.modules() if isinstance(m, Engram)}
        if not self.engrams:
            raise ValueError("Prefetcher: the model has no Engram layers")
        self.mapping = next(iter(self.engrams.values())).hash_mapping
        self.device = torch.device(device) if device is not None else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-prefetch")
        self.stream = torch.cuda.Stream(self.device) if self.device is not None and self.device.type == "cuda" else None

    @classmethod
    def attach(cls, model, device=None) -> "Prefetcher":
        """Make every forward of `model` (and so `generate()`) prefetch its Engram rows automatically."""
        pf = cls(model, device)
        model.model.prefetcher = pf
        return pf

    def submit(self, input_ids: torch.Tensor, keep_last: int | None = None) -> dict[int, Future]:
        """Start hashing and gathering for all Engram layers; one future per layer, in layer order.

        `keep_last=T` hashes the whole context (e.g. cached history + new tokens) but gathers rows
        for the last T positions only.
        """
        ids = input_ids.detach().cpu()
        grad = torch.is_grad_enabled()  # grad mode is per thread: carry the caller's into the worker
        hashed: Future = self.pool.submit(self.mapping.hash, ids)
        futures = {}
        for lid, eng in sorted(self.engrams.items()):
            def work(lid=lid, eng=eng):
                h = hashed.result()[lid]
                h = h[:, -keep_last:] if keep_last else h
                mhe = eng.multi_head_embedding
                with torch.set_grad_enabled(grad):
                    if self.stream is None or mhe.backend is None:
                        return mhe(h)  # (B, T, H, d)
                    rows = mhe.lookup_host(h, pin=True)  # (B, T, H, d), page-locked
                    with torch.cuda.stream(self.stream):
                        on_dev = rows.to(self.device, non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(self.stream)
                return _OnStream(on_dev, done)
            futures[lid] = self.pool.submit(work)
        return futures

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class _OnStream:
    """Rows copied to the GPU on the prefetcher's side stream, with the event that marks the copy done."""

    def __init__(self, tensor: torch.Tensor, event):
        self.tensor, self.event = tensor, event


def resolve_rows(rows):
    """A prefetched value (tensor, Future, or side-stream copy) -> a tensor safe to use on the current stream."""
    if hasattr(rows, "result"):
        rows = rows.result()
    if isinstance(rows, _OnStream):
        cur = torch.cuda.current_stream(rows.tensor.device)
        cur.wait_event(rows.event)  # the GPU waits for the copy; the host does not
        rows.tensor.record_stream(cur)  # its memory (allocated on the side stream) is in use on this one too
        return rows.tensor
    return rows
