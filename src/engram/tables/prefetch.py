"""Prefetch Engram rows: hash every Engram layer's ids when a batch arrives and gather the rows on a
background thread while earlier blocks compute; a layer waits only if its rows are not ready yet.

    pf = Prefetcher(model)
    rows = pf.submit(input_ids)                       # returns at once: {layer_id: Future}
    logits = model(input_ids, engram_rows=rows).logits

Gathers release the GIL (index_select, page-ins of memory-mapped tables), so they overlap with
the backbone's compute on CPU; on GPU the gathered rows are copied with `non_blocking=True`.
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

    def submit(self, input_ids: torch.Tensor) -> dict[int, Future]:
        """Start hashing and gathering for all Engram layers; one future per layer, in layer order."""
        ids = input_ids.detach().cpu()
        hashed: Future = self.pool.submit(self.mapping.hash, ids)
        futures = {}
        for lid, eng in sorted(self.engrams.items()):
            def work(lid=lid, eng=eng):
                rows = eng.multi_head_embedding(hashed.result()[lid])  # (B, T, H, d)
                if self.device is not None and self.device.type == "cuda":
                    rows = rows.pin_memory().to(self.device, non_blocking=True)
                return rows
            futures[lid] = self.pool.submit(work)
        return futures

    def close(self) -> None:
        self.pool.shutdown(wait=True)
