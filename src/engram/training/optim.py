"""Optimizers: AdamW for dense parameters, lazy row Adam for Engram tables, warmup + cosine schedule.

`LazyRowAdam` updates only the rows a step touched (and only their moments), with the semantics
of `torch.optim.SparseAdam` (the global step count drives bias correction; untouched rows and
their moments do not move): O(touched rows) work instead of O(table) for dense Adam. On CPU with
numba a fused kernel updates the touched rows in place (`_adam_kernels.py`); otherwise the rows of the
weight and both moments are gathered with `index_select`, updated and written back with
`index_copy_`. `TableAdam` does the same for tables that keep their own rows (`engram.tables.Table`).
The paper trains the tables with Adam at 5x the backbone LR and no weight decay.
"""

from __future__ import annotations

import math

import torch

from ..memory import is_table_key
from ..tables.base import installed_tables, row_grads
from . import _adam_kernels


def _step_size(lr: float, b1: float, b2: float, step: float) -> float:
    """Adam's step size with both bias corrections folded in (SparseAdam's form)."""
    return lr * math.sqrt(1 - b2 ** step) / (1 - b1 ** step)


def _fused_ok(*ts: torch.Tensor) -> bool:
    """The numba kernel applies: CPU, float32, contiguous, and numba installed (`engram-torch[fast]`)."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in ts):
        return False
    return _adam_kernels.available()


def _adam_in_place(W: torch.Tensor, M: torch.Tensor, V: torch.Tensor, rows: torch.Tensor, g: torch.Tensor,
                   step: float, lr: float, b1: float, b2: float, eps: float) -> None:
    """The fused kernel: rows `rows` of W, M, V (float32 CPU) get one Adam update with gradients g (R, D)."""
    _adam_kernels.adam_rows(W.detach().numpy(), M.numpy(), V.numpy(), rows.contiguous().numpy(), g.contiguous().numpy(),
                        b1, b2, _step_size(lr, b1, b2, step), eps)


def adam_rows_(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, step: float, lr: float,
               b1: float, b2: float, eps: float, denom: torch.Tensor | None = None, fused: bool = True) -> None:
    """One Adam update of gathered rows, in place (all (R, D) float32): the math every table optimizer shares.

    m <- b1*m + (1-b1)*g;  v <- b2*v + (1-b2)*g^2;  w <- w - lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps)
    (SparseAdam's form: bias correction folded into the step size, eps added after the sqrt).
    On CPU with numba (`fused`) one fused kernel does it (`_adam_kernels`, the same kernel LazyRowAdam
    runs in place on the table, so both give identical rows); else a few torch ops.
    """
    if fused and _fused_ok(w, m, v, g):
        _adam_in_place(w, m, v, torch.arange(w.shape[0]), g, step, lr, b1, b2, eps)
        return
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    w.addcdiv_(m, torch.sqrt(v, out=denom).add_(eps), value=-_step_size(lr, b1, b2, step))


class _RowBuffers:
    """Reused gather buffers per table (fresh ones cost 3x in page faults), for `lazy_row_update`."""

    fused: bool = True
    _bufs: dict

    def _buffers(self, p: torch.Tensor, n: int) -> list[torch.Tensor]:
        bufs = self._bufs.get(id(p))
        if bufs is None or bufs[0].shape[0] < n:
            cap = max(n, int(1.25 * (bufs[0].shape[0] if bufs else 0)))
            bufs = [torch.empty((cap,) + tuple(p.shape[1:]), dtype=torch.float32, device=p.device) for _ in range(4)]
            self._bufs[id(p)] = bufs
        return bufs


class LazyRowAdam(_RowBuffers, torch.optim.Optimizer):
    """Row-lazy Adam for parameters with sparse (COO, row-indexed) or dense gradients.

    `fused=True` (default) updates float32 CPU tables in place with the numba kernel when numba is
    installed (`engram-torch[fast]`); otherwise, and on GPU, touched rows are gathered, updated and
    scattered back with torch ops.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, fused: bool = True):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid LazyRowAdam hyper-parameters lr={lr} betas={betas} eps={eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps))
        self.fused = fused
        self._bufs = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                lazy_row_update(self, p, group)
        return loss


class EngramAdamW(_RowBuffers, torch.optim.AdamW):
    """One torch optimizer for a model with Engram tables: `torch.optim.AdamW` on the dense parameter groups, the
    lazy row update of `LazyRowAdam` on the groups marked `rows=True` (tables with sparse row gradients).

    The form `transformers.Trainer`, accelerate and LR schedulers take (one optimizer, one `param_groups` list,
    one `state_dict`): a scheduler scales every group's LR, `state_dict` holds the tables' moments with the rest,
    so a resumed run continues exactly. Row groups take no weight decay (the paper's). Dense groups come first
    (`param_groups[0]["lr"]` is the dense LR that Trainer logs).

        opt = EngramAdamW([{"params": dense, "weight_decay": 0.1}, {"params": tables, "rows": True, "lr": 5e-3}],
                          lr=1e-3)
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 fused: bool = True):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        for g in self.param_groups:
            if g.get("rows"):
                g["weight_decay"] = 0.0
        self.fused = fused  # the rows' numba kernel (see LazyRowAdam); AdamW picks its own implementation
        self._bufs = {}

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g.get("rows")]  # AdamW refuses sparse gradients: hide them
        try:
            super().step()
        finally:
            self.param_groups = groups
        with torch.no_grad():
            for group in groups:
                if group.get("rows"):
                    for p in group["params"]:
                        lazy_row_update(self, p, group)
        return loss


def lazy_row_update(opt: torch.optim.Optimizer, p: torch.Tensor, group: dict) -> None:
    """One lazy Adam step of parameter `p` (a table; sparse or dense gradient) in `opt`'s state: only the rows
    its gradient touches move, with their moments (the update `LazyRowAdam` and `EngramAdamW` share).

    `opt` provides `state`, `fused` and `_buffers` (reused gather buffers); `group` the lr, betas and eps.
    """
    if p.grad is None:
        return
    g = p.grad
    b1, b2 = group["betas"]
    state = opt.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float64)
        state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    state["step"] += 1
    step = float(state["step"])
    if (opt.fused and g.is_sparse and not g.is_coalesced() and g._values().dtype == torch.float32
            and _fused_ok(p, state["exp_avg"], state["exp_avg_sq"])):
        # sum repeated rows and update them in one pass, in place
        step_size = _step_size(group["lr"], b1, b2, step)
        n = g._nnz()
        _adam_kernels.sparse_adam_rows(p.detach().numpy(), state["exp_avg"].numpy(), state["exp_avg_sq"].numpy(),
                                   g._indices()[0].contiguous().numpy(), g._values().contiguous().numpy(),
                                   b1, b2, step_size, group["eps"], gsum=opt._buffers(p, n)[0].numpy())
        return
    rows, gv = row_grads(g)
    if rows.numel() == 0:
        return
    n, m, v = rows.numel(), state["exp_avg"], state["exp_avg_sq"]
    if opt.fused and _fused_ok(p, m, v, gv):  # in place on the table: no gather, no scatter
        _adam_in_place(p, m, v, rows, gv, step, group["lr"], b1, b2, group["eps"])
        return
    bufs = opt._buffers(p, n)  # reused gather buffers: fresh ones cost 3x in page faults
    m_rows = torch.index_select(m, 0, rows, out=bufs[0][:n])
    v_rows = torch.index_select(v, 0, rows, out=bufs[1][:n])
    if p.dtype == torch.float32:
        w_rows = torch.index_select(p, 0, rows, out=bufs[2][:n])
    else:
        w_rows = p.index_select(0, rows).float()
    adam_rows_(w_rows, m_rows, v_rows, gv, step, group["lr"], b1, b2, group["eps"], denom=bufs[3][:n],
               fused=opt.fused)
    m.index_copy_(0, rows, m_rows)
    v.index_copy_(0, rows, v_rows)
    p.index_copy_(0, rows, w_rows.to(p.dtype))


class TableAdam:
    """Lazy row Adam for Engram tables that keep their own rows and moments (trainable `engram.tables.Table`s).

    Same update as `LazyRowAdam` (the same fused kernel, in place in the table's storage after
    `begin_write` journals the rows; without numba `adam_rows_` on rows read from and written back
    to the table), so neither the table nor its optimizer state has to fit in RAM. Duck-types the
    torch optimizer surface the trainer uses: `param_groups`, `zero_grad`, `step`, `state_dict`,
    `load_state_dict`.
    """

    def __init__(self, tables: list, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, fused: bool = True):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid TableAdam hyper-parameters lr={lr} betas={betas} eps={eps}")
        self.tables = list(tables)
        self.fused = fused
        self.param_groups = [dict(lr=lr, betas=tuple(betas), eps=eps)]
        self.steps = [0] * len(self.tables)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in self.tables:
            t.clear_grads()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        group = self.param_groups[0]
        b1, b2 = group["betas"]
        for i, b in enumerate(self.tables):
            got = b.take_grads()
            if got is None:
                continue
            self.steps[i] += 1
            rows, gv = got
            step = float(self.steps[i])
            if rows.numel() and self.fused and _fused_ok(*b.tensors(), gv):  # in place in the table's storage
                b.begin_write(rows)
                _adam_in_place(*b.tensors(), rows, gv, step, group["lr"], b1, b2, group["eps"])
                b.end_write(rows)
            elif rows.numel():
                w, m, v = b.read_rows(rows)  # (R, D) float32 each
                adam_rows_(w, m, v, gv, step, group["lr"], b1, b2, group["eps"], fused=self.fused)
                b.write_rows(rows, w, m, v)
            b.clear_grads(everything=True)
        return loss

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": [{**self.param_groups[0], "steps": list(self.steps)}]}

    def load_state_dict(self, sd: dict) -> None:
        g = dict(sd["param_groups"][0])
        steps = g.pop("steps")
        if len(steps) != len(self.tables):
            raise ValueError(f"TableAdam state has {len(steps)} tables, this optimizer {len(self.tables)}")
        g["betas"] = tuple(g["betas"])
        self.param_groups = [g]
        self.steps = [int(s) for s in steps]


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear warmup to 1 over `warmup` steps, cosine decay to `min_ratio` at `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def split_params(model: torch.nn.Module):
    """(dense named params, table params): Engram tables are the `multi_head_embedding` weights."""
    dense, tables = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (tables if is_table_key(name) else dense).append((name, p))
    return dense, tables


def dense_groups(dense: list, weight_decay: float) -> list[dict]:
    """AdamW parameter groups of the dense `(name, param)`s: weight decay on matrices, none on vectors (norms,
    biases) or the token embedding."""
    decay, no_decay = [], []
    for n, p in dense:
        (decay if p.dim() >= 2 and "embed_tokens" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizers(model, lr: float, weight_decay: float = 0.1, table_lr_mult: float = 5.0,
                     betas=(0.9, 0.95), fused: bool = True) -> dict[str, torch.optim.Optimizer]:
    """AdamW (decay on matrices only) for the backbone; lazy row Adam at `table_lr_mult` x LR, no decay, for tables.

    Tables that are parameters get `LazyRowAdam`; tables that keep their own rows and moments
    (trainable `engram.tables.Table`s) get `TableAdam` (`fused`: their numba kernel on CPU, see `LazyRowAdam`).
    """
    dense, table_params = split_params(model)
    opts = {"dense": torch.optim.AdamW(dense_groups(dense, weight_decay), lr=lr, betas=betas)}
    own_rows = [t for _, t in sorted(installed_tables(model).items()) if t.trainable]
    if table_params and own_rows:
        raise ValueError("some Engram tables are parameters and some keep their own rows; offload all or none")
    if table_params:
        opts["tables"] = LazyRowAdam([p for _, p in table_params], lr=lr * table_lr_mult, betas=betas, fused=fused)
    elif own_rows:  # tables offloaded with engram.tables.offload_tables(..., trainable=True) or file-backed shards
        opts["tables"] = TableAdam(own_rows, lr=lr * table_lr_mult, betas=betas, fused=fused)
    for o in opts.values():
        for g in o.param_groups:
            g["base_lr"] = g["lr"]
    return opts
