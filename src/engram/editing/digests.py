"""The model's memory as an edit sees it: its Engram layers, its hashing, and the digests an overlay records
(which hash manifest and which weights it was made for)."""

from __future__ import annotations

import contextlib
import hashlib

import torch

from ..memory import Engram, is_table_key
from ..tables.base import find_tables
from ..tables.overlay import OverlayTable
from .facts import EditError


def engram_layers(model) -> dict:
    """{layer_id: MultiHeadEmbedding} of every Engram layer in `model` (an engram model or an adapted base)."""
    layers = {mhe.layer_id: mhe for _, mhe in find_tables(model)}
    if not layers:
        raise EditError("this model has no Engram layers: editing writes Engram table rows "
                        "(train with Engram, or attach an adapter)")
    return layers


def mapping_of(model):
    """The `NgramHashMapping` of `model`'s Engram layers (`layer.hash_mapping` of its first one)."""
    for m in model.modules():
        if isinstance(m, Engram):
            return m.hash_mapping
    raise EditError("this model has no Engram layers")


def spec_digest(mapping) -> str:
    """sha256 of what decides which row an n-gram reads (`NgramHashMapping.spec_digest`)."""
    return mapping.spec_digest()


def _rows_of(mhe) -> torch.Tensor:
    """Every `step`-th row of a layer's base table (overlays bypassed), float32: the digest's sample."""
    n = mhe.num_rows
    ids = torch.arange(0, n, max(1, n // 4096), dtype=torch.long)
    base = mhe.table
    while isinstance(base, OverlayTable):
        base = base.base
    with torch.no_grad():
        return (mhe if base is None else base).lookup(ids).float()


def model_digest(model) -> str:
    """sha256 of a model's weights as an overlay depends on them: every dense weight in full, and 4,096
    rows spread over each Engram table (read through its table, so any backend gives the same digest)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if is_table_key(name) or not torch.is_floating_point(t):
            continue
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    for lid, mhe in sorted(engram_layers(model).items()):
        h.update(f"table{lid}:{mhe.num_rows}x{mhe.dim}".encode())
        h.update(_rows_of(mhe).numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def frozen(model):
    """Every parameter of `model` without gradient (restored after), eval mode."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was = model.training
    for p, _ in flags:
        p.requires_grad_(False)
    model.eval()
    try:
        yield model
    finally:
        for p, f in flags:
            p.requires_grad_(f)
        model.train(was)
