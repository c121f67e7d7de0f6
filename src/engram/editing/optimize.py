"""`edit_facts`: optimize only the rows a fact's prompt addresses, everything else frozen -> an `Overlay`."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..adapters.introspect import generation_pad_id
from ..tables.overlay import overlays_of, push_overlay
from .checkpoint import edit_key, resume, save_checkpoint
from .digests import engram_layers, frozen, mapping_of, model_digest, spec_digest
from .facts import EditError, Fact, _encode, subject_span
from .overlay import Overlay, _restore_tables


def fact_sequences(tokenizer, facts: list[Fact]) -> list[tuple[list[int], list[int]]]:
    """Each fact as (prompt ids, target ids), tokenized as `engram edit` writes it; a prompt or target that
    tokenizes to nothing is an `EditError` naming the fact."""
    out = []
    for i, f in enumerate(facts):
        p, t = _encode(tokenizer, f.prompt), _encode(tokenizer, f.target)
        if not p:
            raise EditError(f"fact {i + 1}: the prompt {f.prompt!r} tokenizes to nothing")
        if not t:
            raise EditError(f"fact {i + 1}: the target {f.target!r} tokenizes to nothing")
        out.append((p, t))
    return out


def pad_batch(seqs: list[list[int]], pad: int) -> torch.Tensor:
    """Token sequences of different lengths as one (B, T) batch, right-padded with `pad`."""
    T = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (T - len(s)) for s in seqs], dtype=torch.long)  # (B, T), right-padded


def edited_orders(mapping, positions: str, orders=None) -> list[int]:
    """The n-gram orders whose rows an edit changes: `orders`, else the highest ("trigger", "all") or every order
    ("subject", "subject+trigger": the subject's short n-grams hold only its own tokens; the longer ones hold its
    context too)."""
    N = mapping.max_ngram_size
    if orders is None:
        return list(range(2, N + 1)) if positions in ("subject", "subject+trigger") else [N]
    return sorted(set(int(o) for o in orders))


def _order_columns(mapping, orders) -> list[int]:
    """Hash-id columns (heads) of the chosen n-gram orders; columns run order 2..N, K heads each."""
    N, K = mapping.max_ngram_size, mapping.n_head_per_ngram
    orders = [N] if orders is None else sorted(set(int(o) for o in orders))
    bad = [o for o in orders if not 2 <= o <= N]
    if bad:
        raise EditError(f"orders {bad} do not exist: this model hashes n-grams of orders 2..{N}")
    return [(o - 2) * K + k for o in orders for k in range(K)]


POSITIONS = ("trigger", "all", "subject", "subject+trigger")  # where a fact's rows are edited: the package docstring


def subject_positions(tokenizer, fact: Fact) -> list[int]:
    """Token positions of `fact.subject` in `fact.prompt` (its last occurrence, `subject_span`; with the space before
    it when one precedes it, so "France" names the same tokens after "of " as at a prompt's start): the tokens up
    to the subject's end that the prefix before it does not already hold. A subject whose ends fall inside a token (the
    prompt's tokenization differs from its prefixes') is an `EditError`: name it on token boundaries."""
    span = subject_span(fact.prompt, fact.subject or "")
    if span is None:
        raise EditError(f"positions='subject' needs each fact's subject, written in its prompt: {fact.prompt!r} has "
                        f"subject {fact.subject!r}")
    start, end = span
    if start > 0 and fact.prompt[start - 1] == " " and not fact.subject.startswith(" "):
        start -= 1  # "France" in "The capital of France is": the word's token carries the space before it
    full, head, upto = (_encode(tokenizer, x) for x in (fact.prompt, fact.prompt[:start],
                                                        fact.prompt[:end]))
    if full[:len(upto)] != upto or upto[:len(head)] != head or len(upto) == len(head):
        raise EditError(f"the subject {fact.subject!r} does not start and end on token boundaries of {fact.prompt!r}; "
                        "include the space before it (' France') or edit with positions='trigger'")
    return list(range(len(head), len(upto)))


def _fact_rows(model, tokenizer, facts: list[Fact], positions: str = "trigger", orders=None) -> list[dict]:
    """Per fact: {layer: (P, h) table rows} read at its edited positions (P), in the chosen orders' h heads,
    and `next`: the token each of those positions must predict (-1 for prompt positions under "all")."""
    if positions not in POSITIONS:
        raise EditError(f"positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
    mapping = mapping_of(model)
    layers = engram_layers(model)
    cols = _order_columns(mapping, edited_orders(mapping, positions, orders))
    out = []
    for f, (p, t) in zip(facts, fact_sequences(tokenizer, facts)):
        seq = p + t
        hashed = mapping.hash(np.asarray([seq], dtype=np.int64))
        trigger = list(range(len(p) - 1 if positions != "all" else 0, len(seq) - 1))
        where = trigger if positions in ("trigger", "all") else subject_positions(tokenizer, f)
        if positions == "subject+trigger":
            where = sorted(set(where) | set(trigger))
        rec = {"next": [seq[i + 1] if i >= len(p) - 1 else -1 for i in where]}  # -1: a position before the answer
        for lid, mhe in layers.items():
            flat = mhe.table_rows(hashed[lid][0])  # (T, H) table rows
            rec[lid] = flat[where][:, cols]  # (P, h)
        out.append(rec)
    return out


def edit_rows(model, tokenizer, facts: list[Fact], positions: str = "trigger", orders=None,
              tie=None) -> dict[int, torch.Tensor]:
    """{layer: sorted distinct table row ids (R,)} that editing `facts` changes (see the module doc), with the
    rows `tie` adds (`tied_rows`)."""
    return _rows_and_groups(model, tokenizer, facts, positions, orders, tie)[0]


def _rows_and_groups(model, tokenizer, facts: list[Fact], positions: str, orders, tie) -> tuple[dict, dict]:
    """(`edit_rows`, the `tied_rows` groups or {} without `tie`): both from one pass over the facts."""
    recs = _fact_rows(model, tokenizer, facts, positions, orders)
    rows = {lid: torch.unique(torch.cat([r[lid].reshape(-1) for r in recs])) for lid in engram_layers(model)}
    if tie is None:
        return rows, {}
    groups = tied_rows(model, tokenizer, facts, tie, positions, orders)
    return {lid: torch.unique(torch.cat([r, torch.tensor(sorted(groups[lid]), dtype=torch.long)]))
            for lid, r in rows.items()}, groups


def tied_rows(model, tokenizer, facts: list[Fact], contexts, positions: str = "subject",
              orders=None) -> dict[int, dict[int, str]]:
    """{layer: {row id: group}}: the order-2 rows a subject's first token reads, in each fact's own prompt and after
    each of `contexts` (texts that may stand right before a subject: "" for a prompt's start, "of ", "in ", "("),
    grouped by (head, the token's text), so that `edit_facts(tie=contexts)` writes one value to all of a group.

    Why: Engram has no rows of order 1, so every row a one-token subject reads holds the token before it too: "of
    France" and "in France" are different rows, and an edit written after "of" is not read after "in". A tied edit
    learns one value per head for a one-token subject and writes it under every listed context, so a wording the
    edit never saw still reads it when the word before its subject is one of `contexts`. Only one-token subjects
    are tied: a longer subject's order-2 rows from its second token on hold its own tokens alone, the same after any
    context, and its first token is often a common word ("the", "New", "South") whose rows every context shares
    with other names. A row two groups claim (a hash collision) stays with the first fact that reads it. Needs the
    subject's positions and order 2."""
    if positions not in ("subject", "subject+trigger"):
        raise EditError(f"tie needs the subject's rows (positions 'subject' or 'subject+trigger'), got {positions!r}")
    mapping = mapping_of(model)
    if 2 not in edited_orders(mapping, positions, orders):
        raise EditError("tie writes order-2 rows: include 2 in orders (e.g. orders=[2])")
    contexts = list(contexts)
    if any(not isinstance(c, str) for c in contexts):
        raise EditError(f"tie must be a list of texts that stand before a subject (e.g. ['', 'of ']), got {contexts!r}")
    layers = engram_layers(model)
    cols = _order_columns(mapping, [2])  # (K,) the order-2 heads
    claims: dict[int, dict[int, str]] = {lid: {} for lid in layers}
    for f in facts:
        if len(subject_positions(tokenizer, f)) != 1:
            continue  # not a one-token subject: nothing to tie
        subject = f.subject.strip()
        wordings = [f] + [Fact(c + subject, f.target, subject=subject) for c in contexts]
        for w in wordings:
            where = subject_positions(tokenizer, w)
            if len(where) != 1:
                continue  # the subject spans two tokens after this context (e.g. no space before it)
            pos = where[0]
            ids = _encode(tokenizer, w.prompt)
            word = tokenizer.decode([ids[pos]]).strip().casefold()
            hashed = mapping.hash(np.asarray([ids], dtype=np.int64))
            for lid, mhe in layers.items():
                row = mhe.table_rows(hashed[lid][0])[pos][cols]  # (K,)
                for k, r in enumerate(row.tolist()):
                    claims[lid].setdefault(r, f"{k}:{word}")
    return claims


def conflicts(model, tokenizer, facts: list[Fact], orders=None) -> list[dict]:
    """Pairs of facts that read exactly the same edited rows where they must predict different tokens.

    Such facts end in the same n-gram (e.g. two prompts ending "... rules over"), so one set of rows
    has to serve two targets and an edit can serve only one. (Facts sharing one head's row by a hash
    collision while their other heads differ are not conflicts: `shared_rows` counts those.)
    Each entry: `facts` (0-based indices), `tokens` (the two predicted tokens), `ngram` (its text).
    """
    recs = _fact_rows(model, tokenizer, facts, "trigger", orders)
    layers = sorted(engram_layers(model))
    seen: dict[tuple, tuple[int, int]] = {}
    found: dict[tuple, dict] = {}
    for i, rec in enumerate(recs):
        for pos, nxt in enumerate(rec["next"]):
            key = tuple(r for lid in layers for r in rec[lid][pos].tolist())  # every edited row read there
            j, other = seen.setdefault(key, (i, nxt))
            if j != i and other != nxt and (j, i) not in found:
                found[(j, i)] = {"facts": [j, i], "tokens": [tokenizer.decode([other]), tokenizer.decode([nxt])]}
    return list(found.values())


def shared_rows(model, tokenizer, facts: list[Fact], orders=None) -> int:
    """Edited rows read by two or more facts where they predict different tokens (conflicts or hash collisions)."""
    recs = _fact_rows(model, tokenizer, facts, "trigger", orders)
    owner: dict[tuple, set] = {}
    for rec in recs:
        for lid in engram_layers(model):
            for pos, nxt in enumerate(rec["next"]):
                for r in rec[lid][pos].tolist():
                    owner.setdefault((lid, r), set()).add(nxt)
    return sum(len(v) > 1 for v in owner.values())


def target_logprobs(model, ids: torch.Tensor, seqs, full_logits: bool = False) -> list[torch.Tensor]:
    """Per fact, log p(target token j | prompt, target[:j]) for each target token: list of (len(t),).

    Only the positions that predict a target token are projected onto the vocabulary (`logits_to_keep`, the
    transformers convention, which engram's own models follow too): an edit's sequences are mostly prompt, and the
    (B, T, V) logits and their log-softmax were the largest tensors of an edit step. `full_logits` (or a model whose
    forward lacks `logits_to_keep`) projects every position, the same numbers by another route
    (benchmarks/bench_edit_step.py compares the two)."""
    where = [torch.arange(len(p) - 1, len(p) + len(t) - 1) for p, t in seqs]  # per row, positions predicting t
    keep = torch.unique(torch.cat(where))  # (K,) sorted positions any row needs
    if full_logits or not _keeps_logits(model):
        keep = torch.arange(ids.shape[1])
        logits = model(ids).logits.float()  # (B, T, V)
    else:
        logits = model(ids, logits_to_keep=keep).logits.float()  # (B, K, V)
    logp = F.log_softmax(logits, dim=-1)
    col = torch.full((ids.shape[1],), -1, dtype=torch.long)
    col[keep] = torch.arange(len(keep))  # position -> its column in the kept logits
    return [logp[b, col[pos], torch.tensor(t)] for b, (pos, (p, t)) in enumerate(zip(where, seqs))]


def _keeps_logits(model) -> bool:
    """Whether `model`'s forward takes `logits_to_keep` (transformers' causal LMs and engram's own do)."""
    import inspect

    return "logits_to_keep" in inspect.signature(model.forward).parameters


def edit_facts(model, tokenizer, facts: list[Fact], steps: int = 300, lr: float = 0.1, positions: str = "trigger",
               orders=None, target_prob: float = 0.9, progress: bool = True, chunk: int = 64,
               full_logits: bool = False, checkpoint=None, checkpoint_every: float = 300.0,
               patience: int | None = None, keep: list[Fact] | None = None, keep_weight: float = 1.0,
               tie=None) -> Overlay:
    """Optimize only the rows `facts` address (`edit_rows`) so that each prompt is followed by its target.

    Every fact is one sequence `prompt + target`; the loss is the mean over facts of the mean negative
    log-probability of the target tokens; Adam on the new rows, the model frozen. Each step runs the facts in
    forwards of `chunk` sequences (similar lengths together) and sums their gradients, so one step is the
    full-batch step while memory holds one chunk's activations and logits (chunk x T x vocab): 10,000 facts
    cost time, not memory. Only positions that predict a target token are projected onto the vocabulary
    (`target_logprobs`; `full_logits` projects all, the reference route benchmarks/bench_edit_step.py times).
    Stops when every target token has probability >= `target_prob` and is the argmax (greedy decoding produces it),
    or after `steps`, or (`patience`) once `patience` steps in a row have neither raised the most sequences at
    target so far nor lowered the loss `PATIENCE_REL` (1%) below its value at the last step that did: facts that
    conflict (two targets for the same rows) can never all be met, and without it such an edit runs every step.
    The overlay's meta says why it stopped (`optimization.stopped`: "at_target", "patience" or "steps").
    `progress`: a bar over steps (loss, facts at target).

    `keep` (optional): facts the edit should leave as they are, each prompt -> the answer it should keep giving
    (for example other subjects of an edited relation -> their true objects, as the model answers them now). Their
    rows are not written; their sequences are read through the edited rows, and `keep_weight` times the mean
    negative log-probability of their targets is added to the loss, so rows that the edited facts share with them
    (a relation's common n-grams) are pulled towards leaving their answers alone: locality held as data, as
    fine-tuning with neighbours does. They do not enter the stopping rule (an answer the model gives at probability
    0.3 is still its greedy answer); the meta counts those still at target_prob. Without `keep` the edit is the
    same edit as before, bit for bit.

    `tie` (optional, a list of texts such as ["", "of ", "in "]): the subject's first-token rows of order 2 learn
    one value per head and subject word, written under the fact's own wordings and after each listed context
    (`tied_rows`), so a wording the edit never saw reads the edit when the word before its subject is listed.
    Without it the edit is the same edit as before, bit for bit.

    `checkpoint` (a file path): an edit of thousands of facts runs for hours, so its state (rows, Adam's moments,
    step, loss log) is written there atomically at most every `checkpoint_every` seconds, and an edit started again
    with the same model, facts and settings resumes from it and ends with the same overlay as an uninterrupted one
    (same threads: float sums are order-dependent). A checkpoint of another edit is an `EditError`; it is removed
    when the edit completes. Returns the `Overlay` (not applied).
    """
    if not facts:
        raise EditError("no facts to edit")
    if not 0.5 < target_prob < 1:
        raise EditError(f"target_prob must lie in (0.5, 1), got {target_prob}: above 0.5 a token is the argmax")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise EditError(f"chunk must be a positive number of sequences per forward, got {chunk!r}")
    if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
        raise EditError(f"patience must be a positive number of steps (or None: run up to steps), got {patience!r}")
    from tqdm.auto import tqdm

    layers = engram_layers(model)
    mapping = mapping_of(model)
    if keep is not None and not (isinstance(keep_weight, (int, float)) and not isinstance(keep_weight, bool)
                                 and keep_weight > 0):
        raise EditError(f"keep_weight must be a positive number, got {keep_weight!r}")
    seqs = fact_sequences(tokenizer, facts)
    rows, groups = _rows_and_groups(model, tokenizer, facts, positions, orders, tie)
    index = _tie_index(rows, groups) if tie is not None else {}
    pad = generation_pad_id(model)

    def batched(sq):
        order = sorted(range(len(sq)), key=lambda i: len(sq[i][0]) + len(sq[i][1]))  # similar lengths together
        out = []
        for a in range(0, len(order), chunk):
            part = [sq[i] for i in order[a:a + chunk]]
            out.append((pad_batch([p + t for p, t in part], pad), part))  # ((b, T), its (prompt, target) ids)
        return out

    batches = batched(seqs)
    kept = fact_sequences(tokenizer, keep) if keep else []
    keep_batches = batched(kept)
    t0 = time.perf_counter()
    digest = model_digest(model)  # before any row is pushed: the base the overlay belongs to
    values, log = {}, []
    bar = tqdm(total=steps, desc=f"editing {len(facts)} sequences", unit="step", disable=not progress, leave=False)
    with frozen(model):
        before = {lid: mhe.table for lid, mhe in layers.items()}
        try:
            for lid, r in rows.items():
                with torch.no_grad():
                    start = (layers[lid].table or layers[lid]).lookup(r).float().clone()  # (R, d) current rows
                    if lid in index:  # tied rows: one value per group, the mean of its rows now
                        g = index[lid]
                        start = torch.zeros(int(g.max()) + 1, start.shape[1]).index_add_(0, g, start) \
                            / torch.bincount(g).unsqueeze(1).float()  # (G, d)
                values[lid] = torch.nn.Parameter(start)
                push_overlay(layers[lid], r, values[lid], name="edit", index=index.get(lid))
            opt = torch.optim.Adam(list(values.values()), lr=lr)
            key = edit_key(digest, facts, rows, dict(steps=steps, lr=lr, positions=positions, orders=orders,
                                                      target_prob=target_prob, chunk=chunk,
                                                      **({"patience": patience} if patience else {}),
                                                      **({"tie": list(tie)} if tie is not None else {}),
                                                      **({"keep": [f.__dict__ for f in keep],
                                                          "keep_weight": keep_weight} if keep else {})))
            first, log, earlier = resume(checkpoint, key, values, opt)
            saved_at = time.monotonic()
            bar.update(first - 1)
            step, stopped = first - 1, "steps"
            best = [-1, float("inf"), 0]  # most sequences at target, loss and step at the last progress
            for e in log:  # a resumed edit: its patience counts from where the earlier run left it
                _progress(best, e["facts_done"], e["loss"], e["step"] + 1)
            for step in range(first, steps + 1):
                opt.zero_grad(set_to_none=True)
                total, done = 0.0, 0
                for ids, part in batches:
                    lps = target_logprobs(model, ids, part, full_logits)
                    loss = torch.stack([lp.mean() for lp in lps]).sum().neg() / len(seqs)  # its share of the mean
                    done += sum(bool((lp.detach().exp() >= target_prob).all()) for lp in lps)
                    loss.backward()
                    total += loss.item()
                kept_done = 0
                for ids, part in keep_batches:  # the facts to leave alone: read through the rows, not written
                    lps = target_logprobs(model, ids, part, full_logits)
                    loss = torch.stack([lp.mean() for lp in lps]).sum().neg() * (keep_weight / len(kept))
                    kept_done += sum(bool((lp.detach().exp() >= target_prob).all()) for lp in lps)
                    if loss.requires_grad:  # a chunk that reads no edited row has nothing to pull on
                        loss.backward()
                    total += loss.item()
                log.append({"step": step - 1, "loss": total, "facts_done": done,
                            **({"keep_at_target": kept_done} if kept else {})})
                bar.set_postfix(nll=f"{total:.4f}", at_target=f"{done}/{len(seqs)}", refresh=False)
                if done == len(seqs):
                    step, stopped = step - 1, "at_target"
                    break
                if not _progress(best, done, total, step) and patience is not None and step - best[2] >= patience:
                    step, stopped = step - 1, "patience"
                    break
                if step == 1 and all(v.grad is None or not v.grad.any() for v in values.values()):
                    # e.g. a freshly attached adapter: its value projection starts at zero, so no row moves the output
                    raise EditError("the edited rows get no gradient: the Engram layers' output does not depend on "
                                    "their rows yet (a freshly attached adapter starts with a zero value projection); "
                                    "train the adapter first (engram adapt), then edit")
                opt.step()
                bar.update(1)
                if checkpoint is not None and time.monotonic() - saved_at >= checkpoint_every:
                    save_checkpoint(checkpoint, key, step, values, opt, log,
                                     earlier + time.perf_counter() - t0)
                    saved_at = time.monotonic()
        finally:
            bar.close()
            _restore_tables(layers, before)
    seconds = earlier + time.perf_counter() - t0  # a resumed edit: with the time of the runs before
    if checkpoint is not None:
        Path(checkpoint).unlink(missing_ok=True)
    meta = {
        "hash_spec_sha256": spec_digest(mapping), "hash_family": mapping.family.name,
        "base_digest": digest,
        "layers": sorted(rows), "facts": [f.__dict__ for f in facts],
        "settings": {"steps": steps, "lr": lr, "positions": positions,
                     "orders": edited_orders(mapping, positions, orders), "target_prob": target_prob,
                     **({"patience": patience} if patience is not None else {}),
                     **({"keep_weight": keep_weight} if keep else {}),
                     **({"tie": list(tie), "tied_groups": {lid: int(g.max()) + 1 for lid, g in index.items()}}
                        if tie is not None else {})},
        **({"keep": [f.__dict__ for f in keep]} if keep else {}),
        "optimization": {"steps_run": step, "stopped": stopped, "seconds": round(seconds, 3),
                         "final_loss": log[-1]["loss"],
                         "facts_at_target": log[-1]["facts_done"],
                         **({"keep_at_target": log[-1]["keep_at_target"]} if kept else {}),
                         **({"resumed_after_step": first - 1} if first > 1 else {})},
        "stacked_on": sorted({o.name for mhe in layers.values() for o in overlays_of(mhe)}),
    }
    return Overlay({lid: r for lid, r in rows.items()},
                   {lid: (v.detach()[index[lid]] if lid in index else v.detach()).clone() for lid, v in values.items()},
                   meta)


def _tie_index(rows: dict, groups: dict) -> dict[int, torch.Tensor]:
    """{layer: (R,) value index of each of `rows[layer]`}: the rows of one `tied_rows` group share an index, every
    other row has its own."""
    out = {}
    for lid, r in rows.items():
        ids, idx = {}, []
        for x in r.tolist():
            idx.append(ids.setdefault(groups[lid].get(x, x), len(ids)))  # untied rows: keyed by their own id
        out[lid] = torch.tensor(idx, dtype=torch.long)
    return out


PATIENCE_REL = 0.01  # `patience`: a loss this far below the loss at the last progress counts as progress


def _progress(best: list, done: int, loss: float, step: int) -> bool:
    """Whether a step made progress: more sequences at target than ever, or a loss PATIENCE_REL below the loss at
    the last progress (so a loss still falling 1% per `patience` steps keeps an edit going). Updates `best` = [most
    at target, loss at the last progress, step of the last progress] in place."""
    better = done > best[0] or loss < best[1] * (1 - PATIENCE_REL)
    best[0] = max(best[0], done)
    if better:
        best[1], best[2] = loss, step
    return better
