"""Fine-tuning baselines for fact edits (issue 56): FT-L, LoRA, and fine-tuning with the neighbours held as data.

All three minimize the same loss, the mean over facts of the mean NLL of a fact's target tokens given its prompt
(teacher forcing: the sequence is prompt + target, the loss reads the target positions only), with Adam, and stop as
soon as every target token is the argmax at its position (greedy decoding then gives the whole target). They differ
in what they train and what else they hold:

    ft_l          one layer's MLP output weights, clamped after each step to [W0 - eps, W0 + eps] elementwise: the
                  L-infinity-constrained fine-tuning of Zhu et al. 2020 ("Modifying memories in transformer models"),
                  the FT-L baseline of ROME (Meng et al. 2022)
    lora          a low-rank adapter (Hu et al. 2021) on the chosen modules through `peft`, merged into the weights
                  or kept as an adapter
    ft_neighbours one layer's MLP output weights (optionally L-infinity-bounded too), with the neighbour prompts and
                  their current greedy continuations added to the data: a locality-preserving data term

Each returns an `Edit` whose `undo()` restores every weight bit-exactly. The model is edited in eval mode (no
dropout) with every other parameter frozen; its train/eval mode and `requires_grad` flags are restored afterwards.

The helpers here (`fact_pairs`, `target_batch`, `target_loss`, `greedy`, `fit`) are shared with `grace.py`; where a
layer and its MLP projection are: `base.py`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence

import torch

from engram.adapters import find_layers
from engram.editing import Fact

from .base import Edit, Timer, encode, mlp_out, snapshot

# where a decoder layer keeps its MLP, and what the MLP's output projection is called (Llama/Qwen, GPT-2, OPT,
# GPT-NeoX, Mixtral-style w2, GPT-J)


# ------------------------------------------------------------------------------------------ shared helpers
def fact_pairs(tokenizer, facts: Sequence[Fact]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) of each fact; a one-line ValueError for no facts or a side that tokenizes to
    nothing."""
    if not facts:
        raise ValueError("no facts to edit: pass a non-empty list of engram.editing.Fact")
    pairs = []
    for i, f in enumerate(facts):
        p, t = encode(tokenizer, f.prompt), encode(tokenizer, f.target)
        if not p or not t:
            side = "prompt" if not p else "target"
            raise ValueError(f"fact {i}: the {side} {getattr(f, side)!r} tokenizes to nothing")
        pairs.append((p, t))
    return pairs


def target_batch(pairs: Sequence[tuple[list[int], list[int]]], weights: Sequence[float] | None = None,
                 device=None) -> dict:
    """A right-padded teacher-forcing batch of prompt + target sequences. Returns `input_ids`, `attention_mask`
    (B, T) long; `labels` (B, T) long, the target ids at the target positions and -100 elsewhere; `weights` (B,) float,
    each row's weight in the loss (default 1/B each)."""
    seqs = [p + t for p, t in pairs]
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, T, dtype=torch.long)  # pad id 0: masked out and never a label, so any id would do
    mask = torch.zeros(B, T, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    for b, (p, t) in enumerate(pairs):
        ids[b, :len(p) + len(t)] = torch.tensor(p + t)
        mask[b, :len(p) + len(t)] = 1
        labels[b, len(p):len(p) + len(t)] = torch.tensor(t)
    w = torch.full((B,), 1.0 / B) if weights is None else torch.tensor([float(x) for x in weights])
    return {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, labels=labels, weights=w).items()}


def target_loss(model, batch: dict) -> tuple[torch.Tensor, bool]:
    """(loss, done): loss = sum over rows of weight * mean NLL of the row's target tokens given everything before
    them; done = every target token of a row with weight > 0 is the argmax of the logits at the position before it."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]  # (B, T-1): position i predicts token i+1
    on = labels != -100
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")  # (B, T-1)
    per_row = (nll * on).sum(1) / on.sum(1).clamp(min=1)
    w = batch["weights"].to(per_row.device)
    done = bool((logits.argmax(-1) == labels)[on & (w > 0)[:, None]].all())  # rows weighted 0 do not count
    return (per_row * w).sum(), done


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """The `n` tokens greedy decoding appends to `ids` (full forward passes, no cache: exact and model-agnostic)."""
    device = next(model.parameters()).device
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq], device=device)).logits[0, -1].argmax()))
    return seq[len(ids):]


def check_positive(name: str, value, integer: bool = False, zero: bool = False) -> None:
    """A one-line ValueError unless `value` is a finite number > 0 (>= 0 with `zero`; an int with `integer`)."""
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind} {'>=' if zero else '>'} 0, got {value!r}")


@contextlib.contextmanager
def training_only(model, params: Iterable[torch.nn.Parameter]):
    """Within: the model in eval mode (no dropout), gradients on, only `params` requiring grad. On exit the model's
    mode and every parameter's `requires_grad` are restored and the trained parameters' `.grad` cleared."""
    params = list(params)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    model.eval()
    for p, _ in flags:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    try:
        with torch.enable_grad():
            yield
    finally:
        for p in params:
            p.grad = None
        for p, f in flags:
            p.requires_grad_(f)
        model.train(was_training)


def fit(model, params: list[torch.Tensor], batch: dict, steps: int, lr: float, project=None) -> dict:
    """Adam on `params` for at most `steps` steps of `target_loss(model, batch)`, stopping once every target token is
    the argmax; `project()` (if given) runs after each step (FT-L's clamp). Returns the steps taken, the last loss,
    and whether it converged (every target token the argmax)."""
    opt = torch.optim.Adam(params, lr=lr)
    step = 0
    while True:
        loss, done = target_loss(model, batch)
        if done or step == steps:
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if project is not None:
            project()
        step += 1
    return dict(steps=step, loss=float(loss.detach()), converged=done)


# ------------------------------------------------------------------------------------------ FT-L / neighbours
def _finetune(model, tokenizer, facts, layer, eps, neighbours, neighbour_tokens, neighbour_weight, steps, lr,
              method) -> Edit:
    check_positive("steps", steps, integer=True, zero=True)
    check_positive("lr", lr)
    if eps is not None:
        check_positive("eps", eps)
    pairs = fact_pairs(tokenizer, facts)
    name, mod = mlp_out(model, layer)
    W = mod.weight
    device = W.device
    with Timer() as t:
        held = []
        if neighbours:
            check_positive("neighbour_tokens", neighbour_tokens, integer=True)
            check_positive("neighbour_weight", neighbour_weight, zero=True)
            was = model.training
            model.eval()
            for i, s in enumerate(neighbours):
                p = encode(tokenizer, s)
                if not p:
                    raise ValueError(f"neighbour {i}: {s!r} tokenizes to nothing")
                held.append((p, greedy(model, p, neighbour_tokens)))  # what the model answers now
            model.train(was)
        w = [1.0 / len(pairs)] * len(pairs) + [neighbour_weight / max(len(held), 1)] * len(held)
        batch = target_batch(pairs + held, w, device)
        undo = snapshot([W])
        W0 = W.detach().clone()
        lo, hi = (W0 - eps, W0 + eps) if eps is not None else (None, None)

        def clamp():
            with torch.no_grad():
                W.copy_(torch.clamp(W, lo, hi))

        with training_only(model, [W]):
            info = fit(model, [W], batch, steps, lr, clamp if eps is not None else None)
        with torch.no_grad():
            changed = int((W != W0).sum())
            info["max_abs_change"] = float((W - W0).abs().max())
    info.update(layer=layer, module=name, eps=eps, lr=lr, max_steps=steps, neighbours=len(held),
                neighbour_tokens=neighbour_tokens if held else 0)
    return Edit(method, len(pairs), t.seconds, changed_params=changed, info=info, _undo=undo)


def ft_l(model, tokenizer, facts: Sequence[Fact], layer: int, eps: float = 5e-4, steps: int = 25,
         lr: float = 5e-4) -> Edit:
    """FT-L: fine-tune decoder layer `layer`'s MLP output weights W (Llama `down_proj`, GPT-2 `c_proj`) on the facts,
    clamping W to [W0 - eps, W0 + eps] elementwise after every Adam step, so no entry moves by more than eps.

    Defaults are ROME's FT-L settings for GPT-2 XL (eps 5e-4, lr 5e-4, 25 steps); with Adam a step moves each entry
    by about lr, so the bound binds after a step or two. `changed_params` counts the entries of W that moved."""
    return _finetune(model, tokenizer, facts, layer, eps, None, 0, 0.0, steps, lr, "FT-L")


def ft_neighbours(model, tokenizer, facts: Sequence[Fact], neighbours: Sequence[str], layer: int,
                  eps: float | None = None, neighbour_tokens: int = 4, neighbour_weight: float = 1.0,
                  steps: int = 100, lr: float = 5e-4) -> Edit:
    """Fine-tune decoder layer `layer`'s MLP output weights on the facts (prompt -> new target) together with the
    `neighbours` (prompt strings) -> the `neighbour_tokens` tokens the unedited model greedily continues them with,
    so the edit is pulled towards leaving those answers alone (a locality term held as data, not as a constraint).

    loss = mean over facts of target NLL + neighbour_weight * mean over neighbours of continuation NLL; training stops
    once every target token of both is the argmax. `eps` (optional): also clamp W to [W0 - eps, W0 + eps]. Defaults:
    ROME's FT learning rate (5e-4) with 4x its 25 steps, since the neighbour term pulls against the edit; no bound."""
    if not neighbours:
        raise ValueError("ft_neighbours needs neighbour prompts to hold (use ft_l for fine-tuning without them)")
    return _finetune(model, tokenizer, facts, layer, eps, list(neighbours), neighbour_tokens, neighbour_weight,
                     steps, lr, "FT+neighbours")


# ------------------------------------------------------------------------------------------ LoRA
def lora(model, tokenizer, facts: Sequence[Fact], rank: int = 8, alpha: float = 32.0,
         target_modules: Sequence[str] | str | None = None, merge: bool = True, steps: int = 70,
         lr: float = 5e-3, dropout: float = 0.0) -> Edit:
    """LoRA through `peft`: trains a rank-`rank` update B A (scaled by alpha / rank; B starts at zero, so training
    starts from the base) on `target_modules` (peft's names: suffixes like "down_proj", full dotted names, or one
    regex string; default: every decoder layer's MLP output projection).

    `merge=True`: the update is merged into the weights and the adapter unloaded, so the model has its own modules
    again; `undo()` copies the saved base weights back. `merge=False`: the adapter stays in the model (its target
    modules wrapped by peft's LoRA layers, base weights untouched); `undo()` unloads it. Either way the base comes
    back bit-exactly. Defaults (rank 8, alpha 32, lr 5e-3, 70 steps, no dropout) follow the usual LoRA editing
    baseline; dropout is off because the edit trains in eval mode."""
    import peft
    from transformers.pytorch_utils import Conv1D

    check_positive("rank", rank, integer=True)
    check_positive("alpha", alpha)
    check_positive("steps", steps, integer=True, zero=True)
    check_positive("lr", lr)
    if getattr(model, "peft_config", None):
        raise ValueError("the model already holds a peft adapter: undo that edit (or unload it) before a LoRA edit")
    pairs = fact_pairs(tokenizer, facts)
    if target_modules is None:
        target_modules = [mlp_out(model, i)[0] for i in range(len(find_layers(model)[1]))]
    elif not isinstance(target_modules, str):  # a single string is a regex over the full module names
        target_modules = list(target_modules)
    mods = dict(model.named_modules())
    targets = [n for n in mods if _peft_matches(n, target_modules)]
    if not targets:
        raise ValueError(f"target_modules {target_modules!r} match no module of {type(model).__name__}")
    device = next(model.parameters()).device
    flags = [(p, p.requires_grad) for p in model.parameters()]
    with Timer() as t:
        saved = snapshot([mods[n].weight for n in targets])  # taken before peft wraps anything
        cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                              fan_in_fan_out=isinstance(mods[targets[0]], Conv1D), bias="none")
        wrapped = peft.get_peft_model(model, cfg)
        params = [p for n, p in model.named_parameters() if "lora_" in n]
        try:
            with training_only(model, params):
                info = fit(model, params, target_batch(pairs, device=device), steps, lr)
        except BaseException:
            wrapped.unload()
            for p, f in flags:
                p.requires_grad_(f)
            raise
        extra = sum(p.numel() * p.element_size() for p in params)
        n_lora = sum(p.numel() for p in params)
        if merge:
            weights = [mods[n].weight for n in targets]
            before = [w.detach().clone() for w in weights]
            wrapped.merge_and_unload()
            with torch.no_grad():
                changed = sum(int((w != b).sum()) for w, b in zip(weights, before))
            del before
            extra = 0
        else:
            changed = 0
    for p, f in flags:  # peft froze the base; give every parameter its flag back
        p.requires_grad_(f)

    def undo() -> None:
        if not merge:
            wrapped.unload()
        saved()  # merged: the base weights back; unmerged: they never changed, a no-op copy
        for p, f in flags:
            p.requires_grad_(f)

    info.update(rank=rank, alpha=alpha, lr=lr, max_steps=steps, merged=merge, targets=targets, lora_params=n_lora)
    return Edit("LoRA", len(pairs), t.seconds, changed_params=changed, extra_bytes=extra, info=info, _undo=undo)


def _peft_matches(name: str, target_modules) -> bool:
    """Whether peft's rule picks module `name`: a string is a full-match regex; a list matches a name equal to an
    entry or ending in "." + entry."""
    import re

    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == k or name.endswith("." + k) for k in target_modules)
