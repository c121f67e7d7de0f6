"""MEMIT (Meng et al. 2023, "Mass-Editing Memory in a Transformer"): many facts written at once, spread over the
MLP output projections of several consecutive layers by least squares, implemented from the paper.

For facts i = 1..n (subject s_i, prompt p_i, new target o_i) and chosen layers l_1 < ... < l_m = L (Algorithm 1):

1. Target hidden states z_i = h_i^L + delta_i (d,): h_i^L is the residual stream after block L at the subject's
   last token of the bare prompt; delta_i is found as ROME finds v* (`rome.optimize_delta`): added at that token
   after block L in every prefixed prompt x_j + p_i, Adam on the target's NLL + KL "essence" term + weight decay,
   norm clamped to `clamp_norm * |h_i^L|`.
2. For each chosen layer l in ascending order, with the updates of the layers below already applied:
   K (n, d_in): each fact's key at layer l, averaged over the prefixed prompts (as ROME's k*);
   R (n, d): the residual still missing at L, (z_i - h_i^L) / (number of chosen layers from l up to L),
   so the layers share it;
   Delta = R^T K (lambda C + K^T K)^{-1}  (d_out, d_in)  (the paper's R K^T (C_0 + K K^T)^{-1} with its
   column-per-fact K), the least-squares update that maps the new keys to their share of the residual while
   keeping the keys of ordinary text (second moment C = E[k k^T], `covariance.py`) where they were, with weight
   lambda = `mom2_update_weight`;  W_l <- W_l + Delta.

Defaults are the paper's GPT-J settings where they apply: 25 Adam steps at lr 0.5, weight decay 0.5, clamp 0.75,
KL factor 1/16, lambda = 15,000. lambda is on the scale of E[k k^T]: for one fact the update reaches a fraction
q / (1 + q) of its share, q = k^T C^{-1} k / lambda, and k^T C^{-1} k is about d_in for a typical key (16,384 for
GPT-J), so a model with narrower MLPs needs a proportionally smaller lambda for the same strength.

    covs = key_covariances(model, [3, 4, 5, 6, 7, 8], windows)
    ed = memit(model, tok, facts, subjects, [3, 4, 5, 6, 7, 8], covs)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engram.editing import EditError, Fact

from .base import Edit, Timer, decoder_layer, encode, mlp_out, snapshot
from .covariance import add_to_weight, ensure_eval
from .rome import build_rows, capture, contexts_of, optimize_delta, prompt_rows, subject_span


def _covs_by_layer(covs, layers: list[int]) -> dict[int, torch.Tensor]:
    if isinstance(covs, Mapping):
        missing = [i for i in layers if i not in covs]
        if missing:
            raise EditError(f"no key covariance for layers {missing}: estimate one per edited layer "
                            "(covariance.key_covariances)")
        return {i: covs[i] for i in layers}
    covs = list(covs)
    if len(covs) != len(layers):
        raise EditError(f"{len(covs)} covariances for {len(layers)} layers: give one per layer, in layer order")
    return dict(zip(layers, covs))


def memit(model, tokenizer, facts: Sequence[Fact], subjects: Sequence[str], layers: Sequence[int], covs, *,
          prefixes: list[str] | None = None, seed: int = 0, steps: int = 25, lr: float = 0.5,
          weight_decay: float = 0.5, clamp_norm: float = 0.75, kl_factor: float = 0.0625, nll_stop: float = 0.05,
          mom2_update_weight: float = 15000.0) -> Edit:
    """Write `facts` into `model` in place by updating the MLP output projections of `layers`; returns an `Edit`
    whose `undo()` restores them bit for bit.

    `subjects[i]`: fact i's subject as it appears in its prompt. `layers`: the blocks whose MLP output projections
    change (the last is where the targets z_i are set). `covs`: {layer: C} or a sequence in the order of sorted
    `layers`, C = E[k k^T] (d_in, d_in) of that layer's keys. `prefixes`: texts to read each prompt after (None: 10
    sampled from the model, seeded `seed`). `steps` .. `nll_stop`: the z optimization (`rome.optimize_delta`);
    `mom2_update_weight`: lambda. Defaults: the paper's (module docstring)."""
    facts, subjects = list(facts), list(subjects)
    if len(facts) != len(subjects):
        raise EditError(f"{len(facts)} facts but {len(subjects)} subjects: give one subject per fact")
    if not facts:
        raise EditError("no facts to edit")
    layers = sorted(set(int(i) for i in layers))
    if not layers:
        raise EditError("no layers to edit: give the blocks whose MLPs MEMIT may change")
    with Timer() as t, ensure_eval(model):
        projs = [mlp_out(model, i)[1] for i in layers]
        last = decoder_layer(model, layers[-1])
        c = _covs_by_layer(covs, layers)
        ends, targets = [], []
        for f, s in zip(facts, subjects):
            ends.append(subject_span(f.prompt, s)[1])
            targets.append(encode(tokenizer, f.target))
            if not targets[-1]:
                raise EditError(f"the target {f.target!r} tokenizes to nothing")
        contexts = contexts_of(model, tokenizer, prefixes, seed)
        n, N = len(facts), len(contexts)
        bare = build_rows(tokenizer, [f.prompt for f in facts], ends)  # (n rows) the prompts alone
        in_context = build_rows(tokenizer, [ctx + f.prompt for f in facts for ctx in contexts],
                                [len(ctx) + e for e in ends for ctx in contexts])  # (n * N rows), fact-major
        h0 = capture(model, last, bare, "output")  # (n, d) residual after block L at each subject
        deltas, per_fact = [], []
        for i, (f, s) in enumerate(zip(facts, subjects)):
            rewrite = prompt_rows(tokenizer, f.prompt, s, contexts, targets[i])
            essence = build_rows(tokenizer, [f"{s} is a"], [len(s)])
            d, info = optimize_delta(model, projs[-1], rewrite, essence, float(h0[i].norm()), steps=steps, lr=lr,
                                     weight_decay=weight_decay, clamp_norm=clamp_norm, kl_factor=kl_factor,
                                     nll_stop=nll_stop)
            deltas.append(d.double().cpu())
            per_fact.append(info)
        z = h0 + torch.stack(deltas)  # (n, d)
        weights = [p.weight for p in projs]
        before = [w.detach().clone() for w in weights]
        undo = snapshot(weights)
        per_layer = []
        for j, (layer, proj) in enumerate(zip(layers, projs)):
            k = capture(model, proj, in_context, "input").view(n, N, -1).mean(1)  # (n, d_in)
            h = capture(model, last, bare, "output")  # (n, d), with the lower layers' updates in
            r = (z - h) / (len(layers) - j)  # (n, d_out): this layer's share of what is still missing
            cov = c[layer].to(torch.float64).cpu()
            if cov.shape != (k.shape[1], k.shape[1]):
                raise EditError(f"the covariance for layer {layer} is {tuple(cov.shape)}, its keys need "
                                f"({k.shape[1]}, {k.shape[1]}): estimate it at this layer of this model")
            a = mom2_update_weight * cov + k.T @ k  # (d_in, d_in)
            delta = torch.linalg.solve(a, k.T @ r).T  # (d_out, d_in) = R^T K (lambda C + K^T K)^{-1}
            add_to_weight(proj, delta)
            per_layer.append({"layer": layer, "residual_norm": round(float(r.norm(dim=1).mean()), 4),
                              "update_norm": round(float(delta.norm()), 4)})
        changed = sum(int((b != w.detach()).sum()) for b, w in zip(before, weights))
        left = (z - capture(model, last, bare, "output")).norm(dim=1).mean()
    info = {"layers": layers, "contexts": N, "per_fact": per_fact, "per_layer": per_layer,
            "residual_left_norm": round(float(left), 4),
            "hparams": {"steps": steps, "lr": lr, "weight_decay": weight_decay, "clamp_norm": clamp_norm,
                        "kl_factor": kl_factor, "nll_stop": nll_stop, "mom2_update_weight": mom2_update_weight,
                        "seed": seed}}
    return Edit("memit", n, t.seconds, changed_params=changed, info=info, _undo=undo)
