"""Overlays chosen per request inside vLLM's batches: each token's Engram rows read from its own request's overlays.

engram's own server applies a request's overlay to the whole model (`editing.applied`) and decodes one request at a
time. A vLLM step holds tokens of many requests, so here the overlays are never installed on the tables: every
loaded overlay's rows sit in one `OverlayBank`, and after a step's table gather each token's rows are replaced by
its request's overlay rows where that overlay has them (the table's rows otherwise), in one pass per stack depth.

    bank = OverlayBank(engram_layers(model), {"capitals": Overlay, ...})   # at load, checked (`load_table_options`)
    choice = bank.for_step(view)           # None: no token of this step reads an overlay
    rows = choice.apply(layer_id, rows, ids)   # rows (n, H, d) gathered for table ids (n, H): overlay rows put in

How a step learns each token's request's overlays: a request names them in `SamplingParams.extra_args`
(`vllm_xargs: {"engram_overlay": NAME or [NAME, ...]}`, a stack applied in order, the last one winning on a row
two of them change; `routing.OverlayRouting` turns the model id `MODEL+NAME` into that), and vLLM hands every
request's `SamplingParams` to the logits processors of the worker as it enters a row of the persistent batch
(`routing.OverlaySelector.update_state`, before each forward). The selector keeps `CHOICES.rows` {batch row:
names}; a step's tokens know their row (`state.StepView.req`, from the attention metadata's request starts, in the
same persistent-batch order), so `for_step` is one table lookup per step.

Memory: per Engram layer, one sorted int64 key per overlay row (`overlay index * table rows + row id`) and its
values (d floats): proportional to the overlays' rows, no copy of a table. A stack of S overlays costs S
`searchsorted` calls over the step's n*H ids per Engram layer.

Loaded and dropped while serving (`ENGRAM_ALLOW_OVERLAY_UPDATES`, `engram serve --allow-overlay-updates`): the API
server's `POST /v1/load_overlay` / `/v1/unload_overlay` (`routing.py`) reach each worker's bank through vLLM's
`collective_rpc` (`routing.OverlayWorker`, a worker extension). A load is checked as at startup and swapped in
whole; an unloaded overlay leaves `REGISTRY.names` at once (later requests get the 400 naming the loaded ones) and
leaves the workers once the requests admitted before have finished (counted by the API server, then by each
worker's batch rows: `OverlayBank.unload`, `settle`).

Imports nothing of vLLM (the vLLM-facing classes are in `routing.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import EngramError

XARG = "engram_overlay"  # the SamplingParams.extra_args / vllm_xargs key a request names its overlays with
WORKER = "engram.integrations.vllm.routing.OverlayWorker"  # vLLM's --worker-extension-cls for overlay updates


class OverlayChoiceError(EngramError, ValueError):
    """A request names an overlay this server has not loaded, or names them in the wrong shape (HTTP 400)."""


@dataclass
class Registry:
    """What this process knows of the per-request overlays: their names (API server: from the config hook, to
    validate requests; worker: from the model's load) and the served model names (`MODEL+NAME` routing)."""

    names: tuple[str, ...] = ()
    served: tuple[str, ...] = ()


REGISTRY = Registry()


@dataclass
class RowChoices:
    """The overlays chosen by the request in each persistent-batch row of this worker ({row: names}), kept by
    `routing.OverlaySelector` from vLLM's batch updates; `version` counts the changes (the bank caches per version)."""

    rows: dict[int, tuple[str, ...]] = field(default_factory=dict)
    version: int = 0

    def reset(self) -> None:
        self.rows.clear()
        self.version += 1


CHOICES = RowChoices()


def check_names(names: dict) -> dict[str, str]:
    """{name: folder} of `--overlay NAME=DIR` / the `engram_overlays` key, checked: names without '+', folders as
    strings. Returns it as {str: str}."""
    if not isinstance(names, dict):
        raise OverlayChoiceError(f"engram_overlays must map overlay names to folders ({{\"NAME\": \"DIR\"}}), got "
                                 f"{type(names).__name__}")
    out = {}
    for name, d in names.items():
        if not isinstance(name, str) or not name or "+" in name or not isinstance(d, str) or not d:
            raise OverlayChoiceError(f"overlay {name!r}={d!r}: expected NAME=DIR (a non-empty name without '+')")
        out[name] = d
    return out


def requested(extra_args: dict | None, loaded: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The overlay names a request's `extra_args` asks for, in stacking order (() for none); with `loaded`, each
    must be one of them. One-line `OverlayChoiceError` naming the loaded ones otherwise."""
    v = (extra_args or {}).get(XARG)
    if v is None:
        return ()
    names = [v] if isinstance(v, str) else v
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise OverlayChoiceError(f"vllm_xargs.{XARG} must be an overlay name or a list of names, got {v!r}")
    if loaded is not None:
        for n in names:
            if n not in loaded:
                raise OverlayChoiceError(f"overlay {n!r} is not loaded (loaded: {', '.join(loaded) or 'none'}); "
                                         "start the server with --overlay NAME=DIR")
    return tuple(names)


def route(body: dict, served: tuple[str, ...]) -> dict | None:
    """An OpenAI request body naming model `MODEL+NAME` (MODEL a served name, engram serve's model ids) as vLLM
    takes it: model MODEL, the overlay first in `vllm_xargs.engram_overlay` (before any named there); None when the
    body needs no change. The names are checked later, by the selector's `validate_params` (a 400 naming the
    loaded ones), after vLLM's authentication."""
    model = body.get("model")
    if not isinstance(model, str) or model in served:
        return None
    base, sep, name = model.partition("+")
    xargs = body.get("vllm_xargs")
    if not sep or base not in served or not (xargs is None or isinstance(xargs, dict)):
        return None
    xargs = dict(xargs or {})
    prior = xargs.get(XARG)
    xargs[XARG] = [name, *([] if prior is None else [prior] if isinstance(prior, str) else list(prior))]
    return {**body, "model": base, "vllm_xargs": xargs}


class OverlayBank:
    """Every per-request overlay of one model, per Engram layer: sorted keys `k * table_rows + row` (k = the
    overlay's index, from 1, never reused) with their values (R, d), in the table's device. `layers`: {layer id:
    MultiHeadEmbedding} (`editing.engram_layers`); `overlays`: {name: Overlay}, already checked against the model
    (`check_overlay`: hash manifest, weights digest, layers). `model`, `digest` (a callable giving the weights digest
    the startup check used, or a callable giving it, called once): what `load` checks a folder against while serving.

    Loaded and dropped while serving (`load`, `unload`, from `routing.OverlayWorker` between two steps): a load reads
    and checks the folder as at startup, then swaps in new keys and values; an unload of an overlay that a batch row
    still reads waits (`dropping`) until no row does (`settle`, before each step), so a running request keeps its
    rows to its last token. The bank never holds the `Overlay` objects: its memory is the rows alone."""

    def __init__(self, layers: dict, overlays: dict, model=None, digest=None):
        import weakref

        self.layers = layers
        self.index: dict[str, int] = {}  # name -> k (the key's high part), in loading order
        self.dropping: set[str] = set()  # unloaded, still read by a batch row: dropped by `settle`
        self.stride = {lid: mhe.num_rows for lid, mhe in layers.items()}
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (R,) int64 sorted, on the host (ids are hashed there)
        self.values: dict[int, torch.Tensor] = {}  # layer -> (R, d), the table's device
        self._next, self._version, self._settled = 1, -1, -1
        self._table = np.zeros((0, 1), dtype=np.int64)
        self._model = weakref.ref(model) if model is not None else None
        self._digest = digest if isinstance(digest, str) else None
        self._digest_of = digest if callable(digest) else None
        self.add(overlays)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.index)

    @property
    def num_rows(self) -> int:
        return sum(int(k.numel()) for k in self.keys.values())

    def add(self, overlays: dict) -> None:
        """Put checked overlays {name: Overlay} in: the new keys and values are built whole, then swapped in (an
        error leaves the bank as it was). A name already loaded is refused."""
        from ...editing import EditError

        taken = sorted(set(overlays) & set(self.index))
        if taken:
            raise OverlayChoiceError(f"overlay {taken[0]!r} is already loaded; unload it first")
        index = {n: self._next + j for j, n in enumerate(overlays)}
        keys, values = dict(self.keys), dict(self.values)
        for lid, mhe in self.layers.items():
            parts = [(self.keys[lid], self.values[lid])] if lid in self.keys else []
            for name, o in overlays.items():
                if lid not in o.rows:
                    continue
                r = o.rows[lid].long().reshape(-1)
                if r.numel() and (int(r.min()) < 0 or int(r.max()) >= mhe.num_rows):
                    raise EditError(f"overlay {name}: layer {lid}'s row ids must lie in [0, {mhe.num_rows})")
                parts.append((r + index[name] * mhe.num_rows,
                              o.values[lid].detach().float().to(mhe.embedding.weight.device)))
            if parts:
                k = torch.cat([p[0] for p in parts])
                order = torch.argsort(k)
                keys[lid], values[lid] = k[order], torch.cat([p[1] for p in parts])[order.to(parts[0][1].device)]
        self.keys, self.values = keys, values
        self.index.update(index)
        self._next += len(index)
        self._version = -1  # (the rows table maps names to indices: rebuilt at the next step)

    def digest(self) -> str | None:
        """The weights digest the overlays are checked against (the startup one; computed once, on first use)."""
        if self._digest is None and self._digest_of is not None:
            self._digest = self._digest_of()
        return self._digest

    def load(self, name: str, folder: str) -> int:
        """Read `folder` and check it against the model as at startup (`inference.prepare_inference`: checksums, hash
        manifest, weights digest, layers), then add it as `name`. Returns its rows. Engram's one-line errors
        (`OverlayChoiceError` for a taken name, `EditError`, `IntegrityError`, FileNotFoundError) change nothing."""
        from ...inference import prepare_inference

        check_names({name: folder})
        if name in self.index:
            raise OverlayChoiceError(f"overlay {name!r} is already loaded" + (
                " and still read by running requests: load it again once they finish" if name in self.dropping
                else "; unload it first"))
        model = self._model() if self._model is not None else None
        if model is None:
            raise OverlayChoiceError("this overlay bank has no model to check overlays against")
        o = prepare_inference(model, overlays={name: folder}, apply=False, digest=self.digest())[name]
        self.add({name: o})
        return o.num_rows

    def unload(self, name: str) -> bool:
        """Drop overlay `name`: at once when no batch row reads it (True), else when the last one leaves (`settle`,
        False). `OverlayChoiceError` naming the loaded ones for a name not loaded."""
        if name not in self.index or name in self.dropping:
            loaded = [n for n in self.index if n not in self.dropping]
            raise OverlayChoiceError(f"overlay {name!r} is not loaded (loaded: {', '.join(loaded) or 'none'})")
        if any(name in names for names in CHOICES.rows.values()):
            self.dropping.add(name)
            return False
        self._drop(name)
        return True

    def settle(self) -> None:
        """Drop the unloaded overlays no batch row reads any more (once per change of the batch's choices)."""
        if not self.dropping or CHOICES.version == self._settled:
            return
        self._settled = CHOICES.version
        used = {n for names in CHOICES.rows.values() for n in names}
        for name in [n for n in self.dropping if n not in used]:
            self._drop(name)

    def _drop(self, name: str) -> None:
        k = self.index[name]
        keys, values = {}, {}
        for lid, ks in self.keys.items():
            keep = torch.div(ks, self.stride[lid], rounding_mode="floor") != k
            if bool(keep.any()):
                keys[lid], values[lid] = ks[keep], self.values[lid][keep.to(self.values[lid].device)]
        self.keys, self.values = keys, values
        del self.index[name]
        self.dropping.discard(name)
        self._version = -1

    def _rows_table(self) -> np.ndarray:
        """(rows, S) int64: each persistent-batch row's overlay indices, 0-padded (0: none), cached per version."""
        c = CHOICES
        if c.version != self._version:
            depth = max((len(v) for v in c.rows.values()), default=1)
            t = np.zeros((max(c.rows, default=-1) + 1, depth), dtype=np.int64)
            for row, names in c.rows.items():
                for j, n in enumerate(names):
                    k = self.index.get(n)
                    if k is None:  # (the API server refuses these: a request that got past it is a bug, not wrong rows)
                        raise RuntimeError(f"engram: a request chose overlay {n!r}, not loaded in this worker "
                                           f"(loaded: {', '.join(self.names) or 'none'})")
                    t[row, j] = k
            self._version, self._table = c.version, t
        return self._table

    def for_step(self, view) -> StepChoice | None:
        """This step's per-token overlay indices (`StepChoice`), or None when no token reads an overlay (or `view`
        is None: a profiling / dummy run). Drops the unloaded overlays no row reads any more first (`settle`)."""
        self.settle()
        if view is None or not self.keys:
            return None
        t = self._rows_table()
        if not t.any():
            return None
        req = view.req
        stacks = np.zeros((len(req), t.shape[1]), dtype=np.int64)
        inside = req < len(t)
        stacks[inside] = t[req[inside]]
        if not stacks.any():
            return None
        return StepChoice(self, torch.from_numpy(stacks))


class StepChoice:
    """One step's overlays: `stacks` (n, S) int64 overlay indices per token (0: none), applied in order."""

    def __init__(self, bank: OverlayBank, stacks: torch.Tensor):
        self.bank, self.stacks = bank, stacks

    def apply(self, lid: int, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """rows (n, H, d) gathered for table row ids `ids` (n, H) -> the same tensor with each token's overlay rows
        written in (in place; a later overlay of a token's stack wins). Layers no overlay edits pass through."""
        keys = self.bank.keys.get(lid)
        if keys is None:
            return rows
        stride, last = self.bank.stride[lid], keys.numel() - 1
        ids = torch.as_tensor(ids).to(keys.device, torch.long)
        for s in range(self.stacks.shape[1]):
            k = self.stacks[:, s : s + 1]  # (n, 1)
            if not bool(k.any()):
                continue
            q = k * stride + ids  # (n, H): index 0 gives ids < stride, never a key
            pos = torch.searchsorted(keys, q).clamp_(max=last)
            hit = keys[pos] == q
            if bool(hit.any()):
                rows[hit.to(rows.device)] = self.bank.values[lid][pos[hit].to(rows.device)].to(rows.dtype)
        return rows


def load_table_options(model, o, digest) -> OverlayBank | None:
    """Apply table options `o` (`options.TableOptions`) to a loaded vLLM model: tier, format and the overlays at load
    by engram's one inference path (`inference.prepare_inference`, as `engram sample`), then the per-request
    overlays read and checked the same way (hash manifest, weights digest, layers; `--overlay NAME=DIR` in the
    errors) into an `OverlayBank` (None without them, unless overlays may be loaded while serving:
    `serving.overlay_updates_allowed`, an empty bank then). `digest`: a callable giving the weights digest read
    from the checkpoint's files (no second model in the worker), called once, only when an overlay is checked."""
    from ...inference import prepare_inference
    from ...serving.engine import overlay_updates_allowed

    dg = digest() if (o.overlays or o.per_request) else None
    prepare_inference(model, o.tier, o.directory, o.format, {str(d): d for d in o.overlays}, digest=dg)
    updates = overlay_updates_allowed()
    if not o.per_request and not updates:
        return None
    from ...editing import engram_layers

    loaded = prepare_inference(model, overlays=dict(o.per_request), apply=False, digest=dg) if o.per_request else {}
    REGISTRY.names = tuple(loaded)
    return OverlayBank(engram_layers(model), loaded, model=model, digest=dg or digest)
