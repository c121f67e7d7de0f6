"""Row overlays: a few replacement rows substituted at gather time, in front of any table.

    table = OverlayTable(base, rows (R,) int64, values (R, dim))   # base: a Table or the layer itself
    table.lookup(ids)   # base rows, except ids listed in `rows`, which read `values`

An overlay never writes the table: the base file, parameter or shard stays as it was, and removing
the overlay (`remove_overlays`) is the undo. Overlays stack: each wraps the previous table, so the
last one applied wins on a row both change. `engram.editing` builds overlays (`edit_facts`) and checks
that one fits a model (`apply_overlay`); this module only puts them behind layers.

With `values` a trainable tensor, the substitution is differentiable in `values` and nothing else:
that is how `edit_facts` optimizes exactly the edited rows with the model frozen. `index` ties rows: row
`rows[i]` reads `values[index[i]]`, so several rows share one trainable value (`edit_facts(tie=...)`).
"""

from __future__ import annotations

import torch

from .base import Table, TableError, find_tables, install


class OverlayTable(Table):
    """`base`'s rows with `rows` (R,) replaced by `values` (R, dim); `rows` need not be sorted (kept sorted).
    With `index` (R,): row `rows[i]` reads `values[index[i]]` of `values` (G, dim), G <= R (tied rows)."""

    def __init__(self, base, rows: torch.Tensor, values: torch.Tensor, name: str = "overlay",
                 index: torch.Tensor | None = None):
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if values.dim() != 2 or (index is None and values.shape[0] != rows.numel()):
            raise TableError(f"{name}: {rows.numel()} row ids but values of shape {tuple(values.shape)}")
        if index is not None:
            index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
            if index.numel() != rows.numel() or (index.numel() and (int(index.min()) < 0
                                                                    or int(index.max()) >= values.shape[0])):
                raise TableError(f"{name}: index must give each of the {rows.numel()} rows a value in "
                                 f"[0, {values.shape[0]})")
        num_rows, dim = (base.num_rows, base.dim)
        if values.shape[1] != dim:
            raise TableError(f"{name}: rows of width {values.shape[1]}, the table's are {dim}")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
            raise TableError(f"{name}: row ids must lie in [0, {num_rows}), got [{int(rows.min())}, {int(rows.max())}]")
        if torch.unique(rows).numel() != rows.numel():
            raise TableError(f"{name}: row ids repeat; an overlay holds one value per row")
        order = torch.argsort(rows)
        self.base, self.name = base, name
        self.rows = rows[order]  # (R,) sorted: lookups find them with searchsorted
        pick = order if index is None else index[order]  # sorted row -> its value's index in `values`
        self.values = values[pick] if not values.requires_grad else values
        self._order = None if not values.requires_grad else pick  # trainable: keep the caller's tensor, index it
        self.num_rows, self.dim = num_rows, dim
        self.dtype = base.dtype
        self.trainable = False  # the base's own rows are not trained through an overlay

    def _values(self) -> torch.Tensor:
        return self.values if self._order is None else self.values.index_select(0, self._order)

    def lookup(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        flat = rows.reshape(-1)
        vals = self.base.lookup(flat, out=out)  # (N, dim)
        if self.rows.numel() == 0:
            return vals
        ids = flat.to(self.rows.device)
        pos = torch.searchsorted(self.rows, ids).clamp_(max=self.rows.numel() - 1)  # (N,)
        hit = self.rows[pos] == ids  # (N,) which lookups read an overlaid row
        if not bool(hit.any()):
            return vals
        where = hit.nonzero().squeeze(1).to(vals.device)
        new = self._values().index_select(0, pos[hit]).to(vals.device, vals.dtype)  # (n_hit, dim)
        if vals.requires_grad or new.requires_grad:
            return vals.index_put((where,), new)  # out of place: gradients reach `values`
        vals[where] = new
        return vals

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            return self.lookup(rows, out=out)

    def stats(self) -> dict:
        return {"overlay_rows": int(self.rows.numel()), **self.base.stats()}

    def close(self) -> None:
        pass  # the base stays open: it is still the layer's table once the overlay is removed


def overlays_of(mhe) -> list[OverlayTable]:
    """The overlays in front of layer `mhe`'s table, first applied first."""
    out, t = [], mhe.table
    while isinstance(t, OverlayTable):
        out.append(t)
        t = t.base
    return out[::-1]


def push_overlay(mhe, rows: torch.Tensor, values: torch.Tensor, name: str = "overlay",
                 index: torch.Tensor | None = None) -> OverlayTable:
    """Put an overlay in front of layer `mhe`'s current table (its parameter, a backend, earlier overlays);
    `index`: tied rows, as `OverlayTable`."""
    base = mhe.table if mhe.table is not None else mhe
    table = OverlayTable(base, rows, values, name=name, index=index)
    install(mhe, table, free_parameter=False)
    return table


def remove_overlays(model: torch.nn.Module) -> int:
    """Take every overlay off `model`'s layers (the undo); returns how many were removed."""
    n = 0
    for _, mhe in find_tables(model):
        while isinstance(mhe.table, OverlayTable):
            base = mhe.table.base
            mhe.table = None if base is mhe else base
            n += 1
    return n


def restore_table(mhe, table) -> None:
    """Put back the table (or None: the layer's parameter) that layer `mhe` had before overlays were pushed."""
    mhe.table = table
