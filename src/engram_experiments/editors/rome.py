"""ROME (Meng et al. 2022, "Locating and Editing Factual Associations in GPT"): one fact written as a rank-one
update of one MLP's output projection, implemented from the paper.

The MLP at `layer` is read as a linear memory `v = W k + b` (`covariance.py`). For a fact (subject s, prompt p,
new target o*):

1. k* (d_in): the key at the subject's last token, averaged over the prompt read after a few short random
   prefixes x_j (sampled from the model, or given), so that it stands for the subject in any context (eq. 3).
2. v* (d_out): a value that makes the model say o*. A vector delta (d_out) is added to the MLP output at the
   subject's last token of every prefixed prompt and optimized with Adam to minimize the target's NLL after
   x_j + p, plus `kl_factor` times KL(P_edited || P) of the next token after "{s} is a" (the paper's "essence
   drift" term, so the subject keeps what it is), plus `weight_decay * (|delta| / |m|)^2`, with |delta| clamped
   to `clamp_norm * |m|` (m: the MLP output at that token of the bare prompt). v* = W k* + b + delta: the update
   below then adds delta to the MLP output wherever the key is k*, and about (u . k) delta where it is near it.
3. The rank-one update that maps k* to v* while disturbing the keys of ordinary text least, in the metric of their
   second moment C = E[k k^T] (eq. 2): W <- W + (v* - W k* - b) u^T with u = C^{-1} k* / (k*^T C^{-1} k*),
   applied to the weight in its stored orientation (nn.Linear (d_out, d_in); GPT-2's Conv1D (d_in, d_out)).

Defaults are the paper's GPT-2 XL settings where they apply: 20 Adam steps at lr 0.5, weight decay 0.5, clamp 4,
KL factor 1/16; stopping early once the target's mean per-token NLL is under 0.05. Keys are read with the prompt's
own words before the subject kept after each prefix (the same texts as for v*); for a prompt that starts with its
subject this is the paper's x_j + s.

    cov = key_covariance(model, 5, windows)
    ed = rome(model, tok, Fact("The Eiffel Tower is in", " Rome"), "The Eiffel Tower", 5, cov)
    ...; ed.undo()
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engram.editing import EditError, Fact
from engram.editing import subject_span as find_subject

from .base import Edit, Timer, encode, mlp_out, snapshot
from .covariance import _Stop, add_to_weight, ensure_eval, weight_out_in

# The paper's prefixes: short texts sampled from the model; here 5 of 5 tokens and 5 of 10, plus the bare prompt.
PREFIX_LENGTHS = (5,) * 5 + (10,) * 5


# ------------------------------------------------------------------------------------------ text and positions
def _ids_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids of `text` (no special tokens) and each token's character span, where the tokenizer gives them."""
    if hasattr(tokenizer, "token_to_id"):  # a `tokenizers.Tokenizer`
        e = tokenizer.encode(text, add_special_tokens=False)
        return list(e.ids), list(e.offsets)
    with contextlib.suppress(NotImplementedError, ValueError, TypeError, KeyError):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    return encode(tokenizer, text), None


def subject_span(prompt: str, subject: str) -> tuple[int, int]:
    """Character span of the first `subject` in `prompt` (`engram.editing.subject_span`: capitalized where it opens
    the prompt); a one-line `EditError` if it is not there."""
    if not subject or not subject.strip():
        raise EditError(f"empty subject for the prompt {prompt!r}: give the subject as it appears in the prompt")
    span = find_subject(prompt, subject, last=False)
    if span is None:
        raise EditError(f"subject {subject!r} not found in the prompt {prompt!r}: give it exactly as it appears there")
    return span


def subject_last_token(tokenizer, text: str, end: int) -> tuple[list[int], int]:
    """(ids of `text`, index of the token holding character `end - 1`, the subject's last character)."""
    ids, offsets = _ids_offsets(tokenizer, text)
    if offsets is not None:
        for i, (a, b) in enumerate(offsets):
            if a <= end - 1 < b:
                return ids, i
    return ids, len(encode(tokenizer, text[:end])) - 1  # no offsets: the prefix's length, as the paper's code


@dataclass
class Rows:
    """A padded batch of texts: `ids`/`mask` (B, T), `subj` (B,) the subject's last token per row, `targets` per row
    a list of (position, token) whose NLL is scored (empty for rows only read, e.g. the KL prompts), `last` (B,)
    the last real position."""

    ids: torch.Tensor
    mask: torch.Tensor
    subj: torch.Tensor
    targets: list[list[tuple[int, int]]]
    last: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]

    def part(self, a: int, b: int) -> Rows:
        """Rows a..b-1."""
        return Rows(self.ids[a:b], self.mask[a:b], self.subj[a:b], self.targets[a:b], self.last[a:b])

    def to(self, device) -> Rows:
        return Rows(self.ids.to(device), self.mask.to(device), self.subj.to(device), self.targets,
                    self.last.to(device))


def build_rows(tokenizer, texts: list[str], subject_ends: list[int], target: list[int] | None = None) -> Rows:
    """Rows for `texts` (each followed by `target[:-1]` when a target is given, teacher forcing) with the subject's
    last token located from `subject_ends` (character offsets in each text)."""
    seqs, subj, targets = [], [], []
    for text, end in zip(texts, subject_ends):
        ids, s = subject_last_token(tokenizer, text, end)
        if not ids:
            raise EditError(f"the text {text!r} tokenizes to nothing")
        t = list(target or [])
        seqs.append(ids + t[:-1])
        subj.append(s)
        targets.append([(len(ids) - 1 + j, tok) for j, tok in enumerate(t)])
    T = max(len(s) for s in seqs)
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    m = torch.zeros(len(seqs), T, dtype=torch.long)
    for r, s in enumerate(seqs):
        x[r, :len(s)] = torch.tensor(s)
        m[r, :len(s)] = 1
    return Rows(x, m, torch.tensor(subj), targets, m.sum(1) - 1)


def cat_rows(a: Rows, b: Rows) -> Rows:
    """Two batches as one (right-padded to the longer)."""
    T = max(a.ids.shape[1], b.ids.shape[1])

    def pad(t):
        return F.pad(t, (0, T - t.shape[1]))

    return Rows(torch.cat([pad(a.ids), pad(b.ids)]), torch.cat([pad(a.mask), pad(b.mask)]),
                torch.cat([a.subj, b.subj]), a.targets + b.targets, torch.cat([a.last, b.last]))


def prompt_rows(tokenizer, prompt: str, subject: str, contexts: list[str], target: list[int] | None = None) -> Rows:
    """`ctx + prompt` for each context (prefix) with the subject's last token in the prompt part located."""
    _, end = subject_span(prompt, subject)
    return build_rows(tokenizer, [c + prompt for c in contexts], [len(c) + end for c in contexts], target)


# ------------------------------------------------------------------------------------------ prefixes
def sample_prefixes(model, tokenizer, lengths=PREFIX_LENGTHS, seed: int = 0, top_k: int = 5) -> list[str]:
    """Short texts sampled from the model itself (top-`top_k` sampling from its BOS, else EOS, token; a private
    generator seeded `seed`, so the global RNG is untouched), one of each length in `lengths` (tokens), decoded."""
    cfg = model.config
    start = cfg.bos_token_id if getattr(cfg, "bos_token_id", None) is not None else getattr(cfg, "eos_token_id", None)
    if isinstance(start, (list, tuple)):
        start = start[0]
    if start is None:
        raise EditError("the model has neither a BOS nor an EOS token to sample prefixes from: pass prefixes=[...]")
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    x = torch.full((len(lengths), 1), int(start), dtype=torch.long)
    with ensure_eval(model), torch.no_grad():
        for _ in range(max(lengths, default=0)):
            logits = model(input_ids=x.to(device), use_cache=False).logits[:, -1].float().cpu()
            top = logits.topk(min(top_k, logits.shape[-1]))
            pick = torch.multinomial(top.values.softmax(-1), 1, generator=g)
            x = torch.cat([x, top.indices.gather(1, pick)], 1)
    return [tokenizer.decode(x[i, 1:1 + n].tolist(), skip_special_tokens=True) for i, n in enumerate(lengths)]


def contexts_of(model, tokenizer, prefixes: list[str] | None, seed: int) -> list[str]:
    """The texts put before a prompt: "" (the bare prompt) and "{prefix}. " for each prefix (sampled when None)."""
    if prefixes is None:
        prefixes = sample_prefixes(model, tokenizer, seed=seed)
    return [""] + [p.strip() + ". " for p in prefixes if p.strip()]


# ------------------------------------------------------------------------------------------ reading and optimizing
def capture(model, module, rows: Rows, kind: str, chunk: int = 64) -> torch.Tensor:
    """(B, d) float64 on the CPU: `module`'s input (`kind="input"`, e.g. the MLP key) or output (`"output"`; a
    decoder block's hidden state) at each row's subject token, the forward pass stopped right there (`chunk` rows
    at a time)."""
    if len(rows) > chunk:
        return torch.cat([capture(model, module, rows.part(a, a + chunk), kind, chunk)
                          for a in range(0, len(rows), chunk)])
    got = {}

    def pre(_m, args):
        got["x"] = args[0]
        raise _Stop

    def post(_m, _args, out):
        got["x"] = out[0] if isinstance(out, tuple) else out
        raise _Stop

    device = next(model.parameters()).device
    r = rows.to(device)
    h = module.register_forward_pre_hook(pre) if kind == "input" else module.register_forward_hook(post)
    try:
        with torch.no_grad(), contextlib.suppress(_Stop):
            model(input_ids=r.ids, attention_mask=r.mask, use_cache=False)
    finally:
        h.remove()
    x = got["x"]
    return x[torch.arange(x.shape[0], device=x.device), r.subj].double().cpu()


@contextlib.contextmanager
def adding(module, rows: Rows, delta: torch.Tensor):
    """Inside the block `module`'s output gets `delta` (d,) added at each row's subject token (autograd flows to
    `delta`). Added to an MLP's output, it is added to the residual stream after that block too."""
    def hook(_m, _args, out):
        add = torch.zeros_like(out)
        add[torch.arange(out.shape[0], device=out.device), rows.subj] = delta.to(out.dtype)
        return out + add

    h = module.register_forward_hook(hook)
    try:
        yield
    finally:
        h.remove()


def _last_logprobs(logits: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    return logits[torch.arange(logits.shape[0], device=logits.device), last].float().log_softmax(-1)


def _nll(logits: torch.Tensor, targets: list[list[tuple[int, int]]]) -> torch.Tensor:
    """Mean over the rows with targets of each row's mean per-token NLL."""
    per_row = []
    for r, tg in enumerate(targets):
        if tg:
            pos = torch.tensor([p for p, _ in tg], device=logits.device)
            tok = torch.tensor([t for _, t in tg], device=logits.device)
            lp = logits[r, pos].float().log_softmax(-1).gather(1, tok[:, None])
            per_row.append(-lp.mean())
    return torch.stack(per_row).mean()


def optimize_delta(model, module, rewrite: Rows, essence: Rows, ref_norm: float, *, steps: int, lr: float,
                   weight_decay: float, clamp_norm: float, kl_factor: float,
                   nll_stop: float) -> tuple[torch.Tensor, dict]:
    """The vector delta (d_out,) to add at the subject token of `module`'s output (an MLP output projection: ROME's
    v* - W k* - b; MEMIT's z - h at its last layer, since the MLP output is added to the residual stream)
    so that the `rewrite` rows produce their targets.

    Loss = mean target NLL over the rewrite rows + `kl_factor` * KL(P_edited || P) of the next token after each
    `essence` row ("{subject} is a") + `weight_decay` * (|delta| / `ref_norm`)^2; Adam at `lr` for at most `steps`
    steps, |delta| clamped to `clamp_norm * ref_norm` after each; stops once the NLL is under `nll_stop`. Only
    delta gets gradients (`torch.autograd.grad`): the model's `.grad`s and `requires_grad` flags are untouched."""
    device = next(model.parameters()).device
    rows = cat_rows(rewrite, essence).to(device)
    n_rw = rewrite.ids.shape[0]
    with torch.no_grad():
        base = model(input_ids=rows.ids, attention_mask=rows.mask, use_cache=False).logits
        p0 = _last_logprobs(base[n_rw:], rows.last[n_rw:])  # (E, V) next token after "{s} is a", unedited
        nll0 = float(_nll(base[:n_rw], rows.targets[:n_rw]))
    delta = torch.zeros(weight_out_in(module).shape[0], device=device, dtype=torch.float32, requires_grad=True)
    opt = torch.optim.Adam([delta], lr=lr)
    ref_norm = max(float(ref_norm), 1e-8)  # a zero output would make the penalty and the clamp undefined
    limit = clamp_norm * ref_norm
    for used in range(steps + 1):
        with adding(module, rows, delta):
            logits = model(input_ids=rows.ids, attention_mask=rows.mask, use_cache=False).logits
        nll = _nll(logits[:n_rw], rows.targets[:n_rw])
        kl = F.kl_div(p0, _last_logprobs(logits[n_rw:], rows.last[n_rw:]), log_target=True, reduction="batchmean")
        if float(nll.detach()) < nll_stop or used == steps:
            break
        loss = nll + kl_factor * kl + weight_decay * (delta.norm() / ref_norm) ** 2
        (delta.grad,) = torch.autograd.grad(loss, [delta])
        opt.step()
        with torch.no_grad():
            n = delta.norm()
            if n > limit:
                delta.mul_(limit / n)
    out = delta.detach()
    return out, {"steps": used, "nll_before": round(nll0, 4), "nll_after": round(float(nll.detach()), 4),
                 "kl_after": round(float(kl.detach()), 6), "delta_norm": round(float(out.norm()), 4),
                 "ref_norm": round(float(ref_norm), 4)}


def _changed(before: torch.Tensor, after: torch.Tensor) -> int:
    return int((before != after).sum())


# ------------------------------------------------------------------------------------------ ROME
def rome(model, tokenizer, fact: Fact, subject: str, layer: int, cov: torch.Tensor | None, *,
         prefixes: list[str] | None = None, seed: int = 0, steps: int = 20, lr: float = 0.5,
         weight_decay: float = 0.5, clamp_norm: float = 4.0, kl_factor: float = 0.0625,
         nll_stop: float = 0.05) -> Edit:
    """Write `fact` (prompt -> target) into `model` in place by one rank-one update of block `layer`'s MLP output
    projection; returns an `Edit` whose `undo()` restores that weight bit for bit.

    `subject`: the fact's subject as it appears in `fact.prompt` (its last token is where the MLP is read and
    written). `cov`: C = E[k k^T] (d_in, d_in) of the layer's keys (`covariance.key_covariance`); None uses the
    identity (the paper's ablation without the second-moment statistics). `prefixes`: texts to read the prompt
    after (None: 10 sampled from the model, seeded `seed`). `steps`, `lr`, `weight_decay`, `clamp_norm`,
    `kl_factor`, `nll_stop`: the v* optimization (`optimize_delta`; defaults: the paper's GPT-2 XL settings)."""
    with Timer() as t, ensure_eval(model):
        proj = mlp_out(model, layer)[1]
        subject_span(fact.prompt, subject)
        target = encode(tokenizer, fact.target)
        if not target:
            raise EditError(f"the target {fact.target!r} tokenizes to nothing")
        contexts = contexts_of(model, tokenizer, prefixes, seed)
        rewrite = prompt_rows(tokenizer, fact.prompt, subject, contexts, target)
        essence = build_rows(tokenizer, [f"{subject} is a"], [len(subject)])
        keys = capture(model, proj, rewrite, "input")  # (N, d_in), one per context
        k_star = keys.mean(0)
        m0 = capture(model, proj, rewrite, "output")[0]  # (d_out,) the bare prompt's MLP output at the subject
        delta, opt_info = optimize_delta(model, proj, rewrite, essence, float(m0.norm()), steps=steps, lr=lr,
                                         weight_decay=weight_decay, clamp_norm=clamp_norm, kl_factor=kl_factor,
                                         nll_stop=nll_stop)
        delta = delta.double().cpu()
        c = torch.eye(k_star.numel(), dtype=torch.float64) if cov is None else cov.to(torch.float64).cpu()
        if c.shape != (k_star.numel(), k_star.numel()):
            raise EditError(f"the covariance is {tuple(c.shape)}, layer {layer}'s keys need "
                            f"({k_star.numel()}, {k_star.numel()}): estimate it at this layer of this model")
        c_inv_k = torch.linalg.solve(c, k_star)  # (d_in,)
        u = c_inv_k / (c_inv_k @ k_star)  # u . k* = 1
        update = torch.outer(delta, u)  # (d_out, d_in): maps k* to W k* + b + delta = v*
        w = proj.weight
        before = w.detach().clone()
        undo = snapshot([w])
        add_to_weight(proj, update)
        changed = _changed(before, w.detach())
    info = {"layer": layer, "subject": subject, "contexts": len(contexts),
            "k_star_norm": round(float(k_star.norm()), 4), "cov": cov is not None, **opt_info,
            "hparams": {"steps": steps, "lr": lr, "weight_decay": weight_decay, "clamp_norm": clamp_norm,
                        "kl_factor": kl_factor, "nll_stop": nll_stop, "seed": seed}}
    return Edit("rome", 1, t.seconds, changed_params=changed, info=info, _undo=undo)
