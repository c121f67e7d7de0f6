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

Imports nothing of vLLM (the vLLM-facing classes are in `routing.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import EngramError

XARG = "engram_overlay"  # the SamplingParams.extra_args / vllm_xargs key a request names its overlays with


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
    overlay's index, from 1) with their values (R, d), in the table's device. `layers`: {layer id:
    MultiHeadEmbedding} (`editing.engram_layers`); `overlays`: {name: Overlay}, already checked against the model
    (`check_overlay`: hash manifest, weights digest, layers)."""

    def __init__(self, layers: dict, overlays: dict):
        from ...editing import EditError

        self.names = tuple(overlays)
        self.index = {n: k for k, n in enumerate(self.names, 1)}
        self.stride: dict[int, int] = {}
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (R,) int64 sorted, on the host (ids are hashed there)
        self.values: dict[int, torch.Tensor] = {}  # layer -> (R, d), the table's device
        for lid, mhe in layers.items():
            keys, values = [], []
            for name, o in overlays.items():
                if lid not in o.rows:
                    continue
                r = o.rows[lid].long().reshape(-1)
                if r.numel() and (int(r.min()) < 0 or int(r.max()) >= mhe.num_rows):
                    raise EditError(f"overlay {name}: layer {lid}'s row ids must lie in [0, {mhe.num_rows})")
                keys.append(r + self.index[name] * mhe.num_rows)
                values.append(o.values[lid].detach().float())
            if keys:
                k = torch.cat(keys)
                order = torch.argsort(k)
                self.stride[lid], self.keys[lid] = mhe.num_rows, k[order]
                self.values[lid] = torch.cat(values)[order].to(mhe.embedding.weight.device)
        self._version, self._table = -1, np.zeros((0, 1), dtype=np.int64)

    @property
    def num_rows(self) -> int:
        return sum(int(k.numel()) for k in self.keys.values())

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
        is None: a profiling / dummy run)."""
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
    errors) into an `OverlayBank` (None without them). `digest`: a callable giving the weights digest read from the
    checkpoint's files (no second model in the worker), called once, only when there are overlays."""
    from ...inference import prepare_inference

    dg = digest() if (o.overlays or o.per_request) else None
    prepare_inference(model, o.tier, o.directory, o.format, {str(d): d for d in o.overlays}, digest=dg)
    if not o.per_request:
        return None
    from ...editing import engram_layers

    loaded = prepare_inference(model, overlays=dict(o.per_request), apply=False, digest=dg)
    REGISTRY.names = tuple(loaded)
    return OverlayBank(engram_layers(model), loaded)
