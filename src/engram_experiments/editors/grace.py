"""GRACE (Hartvigsen et al. 2023, "Aging with GRACE: Lifelong Model Editing with Discrete Key-Value Adaptors"): a
codebook of (key, value, radius) entries wrapped around one decoder layer, the model's weights left untouched.

At inference, for every position, the layer's input hidden state h (the residual stream entering the layer, (d,))
is compared with the keys by Euclidean distance; if the nearest key K_i has d(h, K_i) <= eps_i (its deferral
radius), the layer's output at that position is replaced by the key's value V_i (d,); every other position keeps the
layer's own output, bit for bit (the model "defers" to itself outside every radius).

An edit (prompt -> target) is a query: h at the prompt's last token. With K_i the nearest key, d its distance and
eps_init the initial radius, the paper's codebook maintenance is:

    no overlap     (codebook empty, or d > eps_i + eps_init): add the entry (h, V, eps_init)
    same target    (d <= eps_i + eps_init, K_i's target is this one): expand, eps_i = max(eps_i, d), so K_i's ball
                   covers the query; no new key (the shared value is then trained on this fact too)
    other target   (d <= eps_i + eps_init, K_i's target differs): split, eps_i = d / 2 and add (h, V, d / 2), so the
                   two balls touch but no longer overlap (d = 0, the same prompt re-edited, where splitting is
                   degenerate: the key takes the new target instead, "replace")

The value covering the query is then trained (Adam, every model weight frozen) until greedy decoding of the prompt
gives the target: loss = mean NLL of the target tokens given the prompt (teacher forcing, `finetune.target_loss`).
A new value starts from the layer's own output at the query position ("warm" init), so training starts from the
unedited model's behaviour.

Sequential (lifelong) editing: pass the codebook of an earlier edit (`edit.codebook`) to add to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engram.editing import Fact

from .base import Edit, Timer, decoder_layer
from .finetune import check_positive, fact_pairs, fit, target_batch, training_only

# the expand rule sets eps_i to the query's distance; pad it by this relative slack so the query itself stays
# inside once its hidden state is recomputed in a longer sequence (a float rounding apart)
_EXPAND_SLACK = 1e-4


class GraceCodebook:
    """GRACE's discrete key-value adaptor on decoder layer `layer` of one model, applied by a forward hook.

    `keys` (n, d) float32: layer inputs at the edited prompts' last tokens; `values` (n, d) float32: what the layer
    outputs instead at a position within a key's radius; `eps` (n,) float32: the deferral radii; `targets`: each
    key's target token ids (the paper's labels, compared by the expand/split rules); `eps_init`: the radius a new
    key starts with, in the units of the hidden state's Euclidean norm (so it must suit the model: compare it with the
    distances between unrelated prompts' hidden states at that layer)."""

    def __init__(self, model, layer: int, eps_init: float):
        self.module = decoder_layer(model, layer)
        self.layer = layer
        self.eps_init = float(eps_init)
        p = next(model.parameters())
        self.keys = torch.empty(0, 0, device=p.device)
        self.values = torch.empty(0, 0, device=p.device)
        self.eps = torch.empty(0, device=p.device)
        self.targets: list[tuple[int, ...]] = []
        self._train: tuple[int, torch.Tensor] | None = None  # (row, its value being optimized)
        self._capture: list | None = None  # collects (layer input, layer output) per forward while set
        self._handle = self.module.register_forward_hook(self._hook, with_kwargs=True)

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def nbytes(self) -> int:
        """The codebook's size: keys, values, radii and targets (int64 token ids)."""
        return (sum(x.numel() * x.element_size() for x in (self.keys, self.values, self.eps))
                + 8 * sum(len(t) for t in self.targets))

    @property
    def attached(self) -> bool:
        return self._handle is not None

    def remove(self) -> None:
        """Remove the hook: the layer computes as if never edited."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def state(self) -> tuple:
        return self.keys.clone(), self.values.clone(), self.eps.clone(), list(self.targets)

    def restore(self, state: tuple) -> None:
        (self.keys, self.values, self.eps), self.targets = (x.clone() for x in state[:3]), list(state[3])

    def _hook(self, module, args, kwargs, output):
        h = args[0] if args else kwargs["hidden_states"]  # (B, T, d): the layer's input
        out = output[0] if isinstance(output, tuple) else output  # (B, T, d): the layer's own output
        if self._capture is not None:
            self._capture.append((h.detach(), out.detach()))
        if not self.targets:
            return None
        B, T, d = out.shape
        dist = torch.cdist(h.detach().reshape(B * T, d).float(), self.keys,
                           compute_mode="donot_use_mm_for_euclid_dist")  # (B*T, n)
        near, idx = dist.min(1)  # (B*T,)
        hit = near <= self.eps[idx]
        if not bool(hit.any()):
            return None  # nothing within a radius: the output object itself, untouched
        values = self.values
        if self._train is not None:  # the row being trained comes from its (differentiable) parameter
            row, param = self._train
            values = values.index_copy(0, torch.tensor([row], device=values.device), param[None])
        new = torch.where(hit.view(B, T, 1), values[idx].view(B, T, d).to(out.dtype), out)  # unhit: `out`'s bits
        return (new,) + tuple(output[1:]) if isinstance(output, tuple) else new

    def _add(self, key: torch.Tensor, value: torch.Tensor, eps: float, target: tuple[int, ...]) -> int:
        if not self.targets:
            d = key.numel()
            self.keys, self.values = key.new_empty(0, d), key.new_empty(0, d)
        self.keys = torch.cat([self.keys, key[None]])
        self.values = torch.cat([self.values, value[None]])
        self.eps = torch.cat([self.eps, self.eps.new_tensor([eps])])
        self.targets.append(target)
        return len(self.targets) - 1

    def update(self, key: torch.Tensor, value: torch.Tensor, target: tuple[int, ...]) -> tuple[int, str]:
        """The paper's codebook maintenance for a query `key` (d,) float32 with target ids `target`; `value` (d,):
        the layer's own output there (a new entry's initial value). Returns (the row whose value the edit trains,
        "add" | "expand" | "split" | "replace"); "replace": a query at distance 0 from a key with another target (the
        same prompt re-edited), where the paper's split is degenerate, relabels that key and retrains its value."""
        if not self.targets:
            return self._add(key, value, self.eps_init, target), "add"
        dist = torch.linalg.vector_norm(self.keys - key[None], dim=1)  # (n,)
        d, i = (float(x) for x in dist.min(0))
        i = int(i)
        if d > float(self.eps[i]) + self.eps_init:
            return self._add(key, value, self.eps_init, target), "add"
        if self.targets[i] == target:
            self.eps[i] = max(float(self.eps[i]), d * (1 + _EXPAND_SLACK))
            return i, "expand"
        if d == 0:  # the very same key with a new target: split would leave two radius-0 balls, the old one winning
            self.targets[i] = target
            return i, "replace"
        self.eps[i] = d / 2
        return self._add(key, value, d / 2, target), "split"


def grace(model, tokenizer, facts: Sequence[Fact], layer: int | None, eps: float | None = None, steps: int = 100,
          lr: float = 1.0, codebook: GraceCodebook | None = None) -> Edit:
    """Edit `facts` one after another (as a stream, the paper's setting) into a GRACE codebook on decoder layer
    `layer`. `eps`: the initial deferral radius (default 1.0, the paper's); `steps`, `lr`: Adam on each edit's value
    (the paper's 100 steps at lr 1.0), stopping early once greedy decoding gives the target. `codebook`: an earlier
    edit's `edit.codebook` to add to (then `layer` may be None and `eps` must be None or the codebook's).

    Returns an `Edit` with the `GraceCodebook` as `edit.codebook` and, in `info["edits"]`, each fact's action
    ("add" | "expand" | "split" | "replace") and training steps; `extra_bytes` is the whole codebook's size after
    this edit. `undo()` puts the codebook back as it was before this call and, if this call created it, removes the
    hook; undo sequential edits in reverse order."""
    if codebook is None:
        if layer is None:
            raise ValueError("grace needs a layer (or the codebook of an earlier edit)")
        eps = 1.0 if eps is None else eps
        check_positive("eps", eps)
        decoder_layer(model, layer)  # range check before anything else
    else:
        if layer is not None and layer != codebook.layer:
            raise ValueError(f"the codebook is on layer {codebook.layer}, not {layer}")
        if eps is not None and eps != codebook.eps_init:
            raise ValueError(f"the codebook's initial radius is {codebook.eps_init}; eps={eps} would change it")
        if not codebook.attached:
            raise ValueError("the codebook's hook was removed (its creating edit was undone)")
        if codebook.module is not decoder_layer(model, codebook.layer):
            raise ValueError("the codebook belongs to another model")
    check_positive("steps", steps, integer=True, zero=True)
    check_positive("lr", lr)
    pairs = fact_pairs(tokenizer, facts)
    device = next(model.parameters()).device
    created = codebook is None
    with Timer() as t:
        if created:
            codebook = GraceCodebook(model, layer, eps)
        before = codebook.state()
        log = []
        try:
            for p, tgt in pairs:
                codebook._capture = []
                was = model.training
                model.eval()
                with torch.no_grad():
                    model(input_ids=torch.tensor([p], device=device))
                model.train(was)
                h, out = codebook._capture[0]
                codebook._capture = None
                row, action = codebook.update(h[0, -1].float(), out[0, -1].float(), tuple(tgt))
                param = codebook.values[row].clone().requires_grad_(True)
                codebook._train = (row, param)
                with training_only(model, []):
                    info = fit(model, [param], target_batch([(p, tgt)], device=device), steps, lr)
                codebook._train = None
                values = codebook.values.clone()
                values[row] = param.detach()
                codebook.values = values
                log.append(dict(action=action, row=row, steps=info["steps"], converged=info["converged"],
                                loss=info["loss"]))
        except BaseException:
            codebook._capture, codebook._train = None, None
            codebook.restore(before)
            if created:
                codebook.remove()
            raise

    def undo() -> None:
        codebook.restore(before)
        if created:
            codebook.remove()

    info = dict(layer=codebook.layer, eps_init=codebook.eps_init, keys=len(codebook), lr=lr, max_steps=steps,
                edits=log, converged=all(e["converged"] for e in log))
    edit = Edit("GRACE", len(pairs), t.seconds, extra_bytes=codebook.nbytes, info=info, _undo=undo)
    edit.codebook = codebook  # an attribute, not in `info`, so `info` stays plain data (JSON, dataclasses.asdict)
    return edit
