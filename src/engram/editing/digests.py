"""The model's memory as an edit sees it: its Engram layers, its hashing, and the digests an overlay records
(which hash manifest and which weights it was made for; the weights' digest, `model_digest`, lives beside the
adapters' base fingerprint in `adapters/introspect.py`: one home for what identifies a model)."""

from __future__ import annotations

import contextlib

from ..adapters.introspect import model_digest  # noqa: F401  (engram.editing.model_digest)
from ..hashing import NgramHashMapping
from ..tables.base import find_tables
from .facts import EditError


def engram_layers(model) -> dict:
    """{layer_id: MultiHeadEmbedding} of every Engram layer in `model` (an engram model or an adapted base)."""
    layers = {mhe.layer_id: mhe for _, mhe in find_tables(model)}
    if not layers:
        raise _no_layers(model)
    return layers


def _no_layers(model) -> EditError:
    """The one-line error for a model without Engram tables (a Qwen4Exp model whose tables transformers holds:
    how to serve them with engram)."""
    if str(getattr(getattr(model, "config", None), "model_type", "")).startswith("qwen4_exp"):
        return EditError("this Qwen4Exp model's n-gram tables are still transformers' own: serve them with engram "
                         "first (engram.integrations.qwen4_exp.serve_tables or from_pretrained), then edit")
    return EditError("this model has no Engram layers: editing writes Engram table rows "
                     "(train with Engram, or attach an adapter)")


def mapping_of(model):
    """The `NgramHashMapping` of `model`'s Engram tables: `hash_mapping` of the first module that hashes for one (an
    `Engram` layer, or a released model's n-gram embedding served by engram, e.g. qwen4_exp's)."""
    for m in model.modules():
        mapping = getattr(m, "hash_mapping", None)
        if isinstance(mapping, NgramHashMapping):
            return mapping
    raise _no_layers(model)


def spec_digest(mapping) -> str:
    """sha256 of what decides which row an n-gram reads (`NgramHashMapping.spec_digest`)."""
    return mapping.spec_digest()


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
