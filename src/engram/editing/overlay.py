"""Overlays: edited rows applied in front of the tables at gather time (any backend); removing one is the undo."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..hashing import check_digest
from ..persist import (
    IntegrityError,
    atomic_file,
    atomic_write_bytes,
    new_dir,
    read_json,
    recover_dir,
    verify_manifest,
)
from ..tables.overlay import push_overlay, restore_table
from .digests import engram_layers, mapping_of, model_digest
from .facts import EditError

FORMAT = "engram-overlay/1"
WEIGHTS, META = "overlay.safetensors", "overlay.json"


@dataclass
class Overlay:
    """Edited rows per Engram layer: `rows[layer]` (R,) int64 table row ids, `values[layer]` (R, d) float32;
    `meta`: the digests it was made for (`hash_spec_sha256`, `base_digest`), facts, settings, report."""

    rows: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    meta: dict

    @property
    def num_rows(self) -> int:
        return sum(int(r.numel()) for r in self.rows.values())

    def save(self, directory, extra_files: dict | None = None) -> Path:
        """Write DIR/overlay.safetensors, overlay.json (+ `extra_files` {name: text, or an object written as JSON},
        e.g. the report), the model card README.md (`adapters.card.overlay_card`: what it was made for, the facts,
        the rows written; left out of the manifest, never read back) and a checksum manifest, atomically: into a temp
        folder that `persist.new_dir` swaps into place. JSON is written piece by piece (`_dump_json`): a report of
        10,000 facts is never held as one text."""
        from safetensors.torch import save_file

        from ..adapters.card import CARD_FILE, overlay_card, write_card

        d = Path(directory)
        tensors = {}
        for lid in sorted(self.rows):
            tensors[f"layer{lid}.rows"] = self.rows[lid].to(torch.long).contiguous()
            tensors[f"layer{lid}.values"] = self.values[lid].detach().float().contiguous()
        with new_dir(d, exclude=(CARD_FILE,)) as tmp:
            save_file(tensors, str(tmp / WEIGHTS), metadata={"format": FORMAT})
            _dump_json(tmp / META, {"format": FORMAT, **self.meta})
            for name, content in (extra_files or {}).items():
                if isinstance(content, str):
                    atomic_write_bytes(tmp / name, content.encode("utf-8"))
                else:
                    _dump_json(tmp / name, content)
            write_card(tmp, overlay_card(self.meta, {lid: int(r.numel()) for lid, r in self.rows.items()}))
        return d

    @classmethod
    def load(cls, directory) -> "Overlay":
        """Read and verify an overlay folder (checksums, format, shapes); one-line errors."""
        from safetensors.torch import load_file

        d = Path(directory)
        recover_dir(d)
        if not (d / META).is_file() or not (d / WEIGHTS).is_file():
            raise FileNotFoundError(f"--overlay {directory}: no overlay here (expected {META} and {WEIGHTS}, "
                                    "written by engram edit)")
        fix = "re-run engram edit to write it again"
        verify_manifest(d, fix=fix)  # without a manifest (written by hand): one warning, still loads
        meta = read_json(d / META, "overlay metadata", fix, IntegrityError)
        try:
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            tensors = load_file(str(d / WEIGHTS))
        except Exception as e:
            raise IntegrityError(f"{d}: corrupt overlay ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                                 f"{fix}") from None
        rows, values = {}, {}
        for lid in meta.get("layers", []):
            r, v = tensors.get(f"layer{lid}.rows"), tensors.get(f"layer{lid}.values")
            if r is None or v is None or r.dim() != 1 or v.dim() != 2 or v.shape[0] != r.numel():
                raise IntegrityError(f"{d}: layer {lid}'s rows are missing or misshapen; {fix}")
            rows[int(lid)], values[int(lid)] = r, v
        meta.pop("format", None)
        meta["path"] = str(d)
        return cls(rows, values, meta)


def _dump_json(path: Path, obj) -> None:
    """`obj` as JSON (indent 1, newline-terminated: `persist.write_json`'s text), atomically, written in pieces of
    64k tokens rather than built as one string (json.dumps with an indent keeps a list of every token first)."""
    with atomic_file(path, "w") as f:  # ensure_ascii: the text is ASCII whatever the locale's encoding
        buf: list[str] = []
        for piece in json.JSONEncoder(indent=1).iterencode(obj):
            buf.append(piece)
            if len(buf) >= 65536:
                f.write("".join(buf))
                buf.clear()
        f.write("".join(buf) + "\n")


def check_overlay(model, overlay: Overlay, where: str = "overlay", digest: str | None = None) -> None:
    """Refuse an overlay made for another hash manifest or another model (one line naming the fix).

    `digest`: `model_digest(model)` when the caller checks several overlays against one model.
    """
    where = overlay.meta.get("path", where)
    mapping = mapping_of(model)
    family = overlay.meta.get("hash_family")  # (overlays written before it was recorded: the digest decides alone)
    if family is not None and family != mapping.family.name:
        raise EditError(f"{where} was made for a model hashing with the {family!r} family, this model hashes with "
                        f"{mapping.family.name!r}: its row ids would address other n-grams; apply it to the model it "
                        "was made for, or re-run engram edit on this model")
    check_digest(mapping.spec(include_lookup_table=False), overlay.meta.get("hash_spec_sha256"), where,
                 "apply it to the model it was made for, or re-run engram edit on this model", EditError)
    if overlay.meta.get("base_digest") != (digest or model_digest(model)):
        raise EditError(f"{where} was made for another checkpoint (the model's weights differ from the ones it was "
                        f"optimized on: {overlay.meta.get('base', '?')}); re-run engram edit on this model")
    layers = engram_layers(model)
    missing = sorted(set(overlay.rows) - set(layers))
    if missing:
        raise EditError(f"{where} edits Engram layers {missing}, this model has {sorted(layers)}")


def apply_overlay(model, overlay: Overlay | str | os.PathLike, check: bool = True):
    """Put `overlay` (an `Overlay` or its folder) in front of `model`'s tables; returns the model.

    Applied overlays stack: the last one wins on rows two overlays change. `remove_overlays(model)`
    takes them all off. `check` refuses an overlay made for another model or hash manifest.
    """
    if not isinstance(overlay, Overlay):
        overlay = Overlay.load(overlay)
    if check:
        check_overlay(model, overlay)
    layers = engram_layers(model)
    name = overlay.meta.get("path", "overlay")
    for lid in sorted(overlay.rows):
        push_overlay(layers[lid], overlay.rows[lid], overlay.values[lid], name=name)
    return model


@contextlib.contextmanager
def applied(model, overlay: Overlay, check: bool = False):
    """`overlay` on `model` inside the block, off after it (other overlays untouched)."""
    layers = engram_layers(model)
    before = {lid: mhe.table for lid, mhe in layers.items()}
    apply_overlay(model, overlay, check=check)
    try:
        yield model
    finally:
        _restore_tables(layers, before)


def _restore_tables(layers: dict, before: dict) -> None:
    for lid, mhe in layers.items():
        restore_table(mhe, before[lid])
