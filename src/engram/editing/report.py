"""Measuring an edit: efficacy, generalization, the exact collision set, bit-for-bit locality and fluency."""

from __future__ import annotations

import math
import re
import sys
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

from ..adapters.introspect import generation_pad_id
from .digests import engram_layers, mapping_of
from .facts import Fact, _encode
from .optimize import conflicts, shared_rows, target_logprobs
from .overlay import Overlay, applied


def ngram_entropy(text: str, orders: tuple[int, ...] = (2, 3), weights: tuple[float, ...] = (2 / 3, 4 / 3)) -> float:
    """Fluency as the editing literature reports it (ROME, Meng et al. 2022, "generation entropy"): the entropy in bits
    of the frequency distribution of the text's word n-grams of each order, weighted (bigrams 2/3, trigrams 4/3, so
    a text that repeats itself scores low) and averaged over the orders. Words: runs of word characters or single
    punctuation marks. An order the text is too short for counts 0."""
    if len(orders) != len(weights):
        raise ValueError(f"ngram_entropy: {len(orders)} orders but {len(weights)} weights; give one weight per order")
    words = re.findall(r"\w+|[^\w\s]", text.lower())
    out = []
    for n, w in zip(orders, weights):
        counts = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
        total = sum(counts.values())
        out.append(w * -sum(c / total * math.log2(c / total) for c in counts.values()) if total else 0.0)
    return sum(out) / len(out)


@torch.no_grad()
def score(model, tokenizer, prompt: str, target: str) -> dict:
    """Target probability after `prompt` (first token, whole target) and whether greedy decoding produces it."""
    return score_many(model, tokenizer, [(prompt, target)])[0]


def _groups(keys: list, chunk: int) -> list[list[int]]:
    """Indices 0..n-1 grouped by equal `keys[i]` (first seen first, each group in order), cut into chunks."""
    by: dict = {}
    for i, k in enumerate(keys):
        by.setdefault(k, []).append(i)
    return [idx[a:a + chunk] for idx in by.values() for a in range(0, len(idx), chunk)]


def _eos_ids(model) -> set[int]:
    """The token ids that end `generate()` early (the generation config's `eos_token_id`)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set() if eos is None else {int(eos)} if isinstance(eos, int) else {int(x) for x in eos}


@torch.no_grad()
def score_many(model, tokenizer, pairs: list[tuple[str, str]], chunk: int = 64, bar=None) -> list[dict]:
    """`score` of each (prompt, target) in `pairs`, in forwards and `generate()` calls of at most `chunk` sequences.

    A batch holds sequences of one length only (the probabilities: prompt + target; greedy decoding: prompts of one
    length, targets of one length), so nothing is padded and each result is the one `score` gives the pair alone,
    whatever `chunk`: the same greedy tokens, the same probabilities up to float rounding (a batch's shape may
    change their last bits). A sequence that `generate` ends early at EOS is cut there, as alone. `bar`: a tqdm
    bar, advanced by one per sequence run (two per pair: a forward, a generation). Memory: one chunk's logits
    (chunk x T x vocab)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive number of sequences per forward, got {chunk!r}")
    enc = [(_encode(tokenizer, p), _encode(tokenizer, t)) for p, t in pairs]
    out: list[dict] = [{} for _ in enc]
    for idx in _groups([len(p) + len(t) for p, t in enc], chunk):  # teacher-forced prompt + target
        ids = torch.tensor([enc[i][0] + enc[i][1] for i in idx])
        for i, lp in zip(idx, target_logprobs(model, ids, [enc[i] for i in idx])):
            out[i]["p_first"], out[i]["p_target"] = float(lp[0].exp()), float(lp.sum().exp())
        if bar is not None:
            bar.update(len(idx))
    pad, eos = generation_pad_id(model), _eos_ids(model)
    for idx in _groups([(len(p), len(t)) for p, t in enc], chunk):  # greedy decoding, len(target) new tokens
        p_len, t_len = len(enc[idx[0]][0]), len(enc[idx[0]][1])
        gen = model.generate(torch.tensor([enc[i][0] for i in idx]), max_new_tokens=t_len, do_sample=False,
                             pad_token_id=pad)
        for i, row in zip(idx, gen[:, p_len:].tolist()):
            stop = next((k for k, x in enumerate(row) if x in eos), None)  # alone, generate stops there
            produced = row if stop is None else row[:stop + 1]
            out[i]["greedy"], out[i]["generated"] = produced == enc[i][1], tokenizer.decode(produced)
        if bar is not None:
            bar.update(len(idx))
    return [{k: r[k] for k in ("p_first", "p_target", "greedy", "generated")} for r in out]


def fact_report(model, tokenizer, facts: list[Fact], overlay: Overlay, chunk: int = 64,
                progress: bool = False) -> list[dict]:
    """Per fact, before and after `overlay`: the prompt, each paraphrase and each passage, scored (`score`), and
    whether each paraphrase and passage reads an edited row at all (`reads_edit`: one that does not keeps the base's
    answer exactly, whatever the edit), in batches of `chunk` sequences (`score_many`: the results of one at a time,
    up to float rounding). `progress`: a bar on stderr."""
    from tqdm.auto import tqdm

    pairs = [(q, f.target) for f in facts for q in (f.prompt, *f.paraphrases, *f.passages)]
    bar = tqdm(total=4 * len(pairs), desc=f"scoring {len(facts)} facts before and after", unit="seq",
               disable=not progress, leave=False)
    try:
        before = score_many(model, tokenizer, pairs, chunk, bar)
        with applied(model, overlay):
            after = score_many(model, tokenizer, pairs, chunk, bar)
    finally:
        bar.close()

    def split(scores):
        rows, at = [], 0
        for f in facts:
            n, m = len(f.paraphrases), len(f.passages)
            rows.append({"prompt": scores[at], "paraphrases": scores[at + 1:at + 1 + n],
                         "passages": scores[at + 1 + n:at + 1 + n + m]})
            at += 1 + n + m
        return rows

    out = [{"prompt": f.prompt, "target": f.target, "before": b, "after": a}
           for f, b, a in zip(facts, split(before), split(after))]
    for f, r in zip(facts, out):  # a text that reads no edited row gives exactly the base's output
        r["reads_edit"] = {kind: [reads_rows(model, tokenizer, text, overlay.rows) for text in texts]
                           for kind, texts in (("paraphrases", f.paraphrases), ("passages", f.passages))}
    return out


def reads_rows(model, tokenizer, text: str, rows: dict) -> bool:
    """Does any n-gram of `text` read one of `rows` ({layer: row ids})? If not, an overlay of those rows leaves the
    model's output on `text` exactly as it was."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        return False
    read = table_rows_read(model, np.asarray([ids]))  # {layer: (1, T, H)}
    return any(bool(torch.isin(read[lid], r).any()) for lid, r in rows.items() if lid in read)


def table_rows_read(model, windows: np.ndarray, chunk: int = 64) -> dict[int, torch.Tensor]:
    """{layer: (W, T, H) table row ids} the model reads for each position of `windows` (hash + head offsets)."""
    mapping, layers = mapping_of(model), engram_layers(model)
    out: dict[int, list] = {lid: [] for lid in layers}
    for i in range(0, len(windows), chunk):
        hashed = mapping.hash(np.asarray(windows[i:i + chunk], dtype=np.int64))
        for lid, mhe in layers.items():
            out[lid].append(mhe.table_rows(hashed[lid]))
    return {lid: torch.cat(v) for lid, v in out.items()}


def collision_set(model, overlay: Overlay, windows: np.ndarray, tokenizer=None, top: int = 10) -> dict:
    """Every position of `windows` (W, T) whose n-gram reads a row `overlay` changes, exact from the hash spec.

    Returns `mask` (W, T) bool, the count, and the most frequent colliding n-grams (layer, order, text).
    """
    mapping = mapping_of(model)
    K = mapping.n_head_per_ngram
    read = table_rows_read(model, windows)
    mask = torch.zeros(windows.shape, dtype=torch.bool)
    ngrams: dict[tuple, int] = {}
    for lid, rows in overlay.rows.items():
        hit = torch.isin(read[lid], rows)  # (W, T, H)
        mask |= hit.any(-1)
        for w, t, col in hit.nonzero().tolist():
            n = col // K + 2
            key = (lid, n, tuple(int(x) for x in windows[w, max(0, t - n + 1): t + 1]))
            ngrams[key] = ngrams.get(key, 0) + 1
    common = sorted(ngrams.items(), key=lambda kv: -kv[1])[:top]
    return {"mask": mask, "positions": int(mask.sum()), "tokens": int(mask.numel()),
            "distinct_ngrams": len(ngrams),
            "top_ngrams": [{"layer": l, "order": n, "count": c,
                            "text": tokenizer.decode(list(ids)) if tokenizer is not None else list(ids)}
                           for (l, n, ids), c in common]}


@torch.no_grad()
def locality(model, overlay: Overlay, windows: np.ndarray, direct: torch.Tensor, batch_size: int = 16,
             progress: bool = False) -> dict:
    """Validation loss with and without `overlay`, and the bit-for-bit check outside its reach.

    `direct` (W, T): positions that read an edited row (`collision_set`). A prediction at position t
    depends on rows read at positions <= t (attention, short conv), so the overlay can change it only
    when some position <= t in its window is in `direct` (`affected`); every other position's logits
    must be identical with and without the overlay, and are compared exactly. `progress`: a bar on stderr.
    """
    from tqdm.auto import tqdm

    affected = direct.cumsum(dim=1) > 0  # (W, T)
    sums = {k: [0.0, 0.0, 0] for k in ("all", "outside", "affected", "direct")}  # loss before, after, tokens
    changed_outside = 0
    for i in tqdm(range(0, len(windows), batch_size), desc="locality", unit="batch", disable=not progress,
                  leave=False):
        ids = torch.from_numpy(np.asarray(windows[i:i + batch_size], dtype=np.int64))
        lb = model(ids).logits.float()
        with applied(model, overlay):
            la = model(ids).logits.float()
        aff, dr = affected[i:i + batch_size, :-1], direct[i:i + batch_size, :-1]  # predictions at 0..T-2
        diff = (lb[:, :-1] != la[:, :-1]).any(-1)  # (b, T-1)
        changed_outside += int((diff & ~aff).sum())
        tgt = ids[:, 1:]
        nb = F.cross_entropy(lb[:, :-1].transpose(1, 2), tgt, reduction="none")  # (b, T-1)
        na = F.cross_entropy(la[:, :-1].transpose(1, 2), tgt, reduction="none")
        for key, m in (("all", torch.ones_like(aff)), ("outside", ~aff), ("affected", aff), ("direct", dr)):
            sums[key][0] += float(nb[m].double().sum())
            sums[key][1] += float(na[m].double().sum())
            sums[key][2] += int(m.sum())
    out = {"changed_outside": changed_outside}
    for key, (b, a, n) in sums.items():
        out[key] = {"tokens": n, "loss_before": b / n if n else None, "loss_after": a / n if n else None,
                    "change": (a - b) / n if n else 0.0}
    return out


def edit_report(model, tokenizer, facts: list[Fact], overlay: Overlay, windows: np.ndarray,
                batch_size: int = 16, chunk: int = 64, progress: bool = False) -> dict:
    """Efficacy, generalization, collision set and locality of `overlay` on `model` (see the module doc).

    The facts are scored `chunk` sequences at a time (`fact_report`; the results do not depend on it beyond float
    rounding), the
    windows `batch_size` at a time (`locality`): memory is bounded by one batch, whatever the number of facts.
    `progress`: bars on stderr."""
    per_fact = fact_report(model, tokenizer, facts, overlay, chunk, progress)
    clash = conflicts(model, tokenizer, facts, overlay.meta.get("settings", {}).get("orders"))
    coll = collision_set(model, overlay, windows, tokenizer)
    loc = locality(model, overlay, windows, coll.pop("mask"), batch_size, progress)

    summary = {"facts": len(facts), "rows_changed": overlay.num_rows,
               "rows_per_fact": overlay.num_rows / len(facts),
               "facts_in_conflict": len({i for c in clash for i in c["facts"]}),
               "rows_shared_across_targets": shared_rows(model, tokenizer, facts, overlay.meta.get("settings", {})
                                                         .get("orders"))}
    for when in ("before", "after"):
        xs = [r[when]["prompt"]["greedy"] for r in per_fact]
        summary[f"greedy_{when}"] = sum(xs) / len(xs)
        summary[f"p_target_{when}"] = sum(r[when]["prompt"]["p_target"] for r in per_fact) / len(per_fact)
        for kind in ("paraphrases", "passages"):
            ys = [s for r in per_fact for s in r[when][kind]]
            summary[f"{kind}_greedy_{when}"] = sum(s["greedy"] for s in ys) / len(ys) if ys else None
            summary[f"{kind}_p_target_{when}"] = sum(s["p_target"] for s in ys) / len(ys) if ys else None
            summary[f"{kind}_count"] = len(ys)
    summary["paraphrases_reading_no_edited_row"] = sum(not x for r in per_fact
                                                       for x in r["reads_edit"]["paraphrases"])
    return {"summary": summary, "facts": per_fact, "conflicts": clash, "collisions": coll, "locality": loc,
            "optimization": overlay.meta.get("optimization", {}), "settings": overlay.meta.get("settings", {})}


def print_report(report: dict, file=None, max_facts: int | None = 20) -> None:
    """The per-fact table (the first `max_facts` facts; a line says how many more report.json holds; None: all)
    and the summary lines of `edit_report`'s result (to `file`, default stdout)."""
    file = sys.stdout if file is None else file
    pf = report["facts"]
    shown = pf if max_facts is None else pf[:max_facts]
    w = min(40, max((len(r["prompt"]) for r in shown), default=6))
    print(f"{'prompt':<{w}} {'target':<14} {'p before':>9} {'p after':>8} {'greedy':>7} {'paraphr.':>9} {'passage':>8}",
          file=file)
    for r in shown:
        a = r["after"]
        para = f"{sum(s['greedy'] for s in a['paraphrases'])}/{len(a['paraphrases'])}" if a["paraphrases"] else "-"
        pas = f"{sum(s['greedy'] for s in a['passages'])}/{len(a['passages'])}" if a["passages"] else "-"
        prompt = r["prompt"] if len(r["prompt"]) <= w else r["prompt"][: w - 3] + "..."
        print(f"{prompt:<{w}} {r['target'][:14]:<14} {r['before']['prompt']['p_target']:>9.4f} "
              f"{a['prompt']['p_target']:>8.4f} {'yes' if a['prompt']['greedy'] else 'no':>7} {para:>9} {pas:>8}",
              file=file)
    if len(shown) < len(pf):
        left = len(pf) - len(shown)
        print(f"... {left:,} more fact{'s' if left != 1 else ''} not shown (every fact is in report.json)", file=file)
    s, c, loc, o = report["summary"], report["collisions"], report["locality"], report["optimization"]

    def pct(x):
        return "n/a" if x is None else f"{x:.0%}"

    print(f"efficacy: greedy produces the target for {pct(s['greedy_after'])} of {s['facts']} facts (before "
          f"{pct(s['greedy_before'])}); mean target probability {s['p_target_before']:.4f} -> "
          f"{s['p_target_after']:.4f}",
          file=file)
    print(f"generalization: paraphrases {pct(s['paraphrases_greedy_after'])} of {s['paraphrases_count']}, "
          f"in a passage {pct(s['passages_greedy_after'])} of {s['passages_count']}", file=file)
    if s.get("paraphrases_reading_no_edited_row"):
        print(f"unreachable: {s['paraphrases_reading_no_edited_row']} of {s['paraphrases_count']} paraphrases read "
              "none of the edited rows, so the edit cannot change their answers; optimize them too (--paraphrases), or "
              "write rows their subject reads (--positions subject --orders 2 reaches a wording with the same word "
              "before the subject)", file=file)
    if report["conflicts"]:
        pairs = "; ".join(f"{pf[a]['prompt']!r} / {pf[b]['prompt']!r}"
                          for a, b in (c["facts"] for c in report["conflicts"][:3]))
        print(f"conflicts: {s['facts_in_conflict']} facts end in the same n-gram as a fact with another target, "
              f"so they share rows and cannot all be served "
              f"({pairs}{'; ...' if len(report['conflicts']) > 3 else ''}); "
              "put the entity within the prompt's last n-gram"
              + (", or write the subject's rows too (--positions subject+trigger)"
                 if report.get("settings", {}).get("positions", "trigger") == "trigger" else "")
              + ("; --patience N ends an edit once N steps meet no more facts (conflicting ones never all are)"
                 if o.get("stopped") == "steps" else ""), file=file)
    why = {"at_target": "every target met", "patience": "no more facts met for --patience steps",
           "steps": "the step limit"}.get(o.get("stopped"))
    print(f"rows changed: {s['rows_changed']:,} ({s['rows_per_fact']:.1f} per fact); edit took "
          f"{o.get('seconds', float('nan')):.1f} s, {o.get('steps_run', '?')} steps"
          + (f" (stopped: {why})" if why else ""), file=file)
    print(f"collision set: {c['positions']:,} of {c['tokens']:,} validation positions read an edited row "
          f"({c['distinct_ngrams']:,} distinct n-grams); {loc['affected']['tokens']:,} predictions attend to one",
          file=file)
    la, lo = loc["all"], loc["outside"]

    def loss(x):  # None: no token there (an edit whose collision set covers every position leaves none outside)
        return "n/a" if x is None else f"{x:.5f}"

    print(f"validation loss: all tokens {loss(la['loss_before'])} -> {loss(la['loss_after'])} ({la['change']:+.5f}); "
          f"outside the collision set ({lo['tokens']:,} tokens) {loss(lo['loss_before'])} -> {loss(lo['loss_after'])}, "
          f"{loc['changed_outside']} logits rows changed (must be 0)", file=file)
