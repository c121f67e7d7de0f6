"""`python -m engram_experiments.fact_scale`: issue 56's scale and sequence, Engram edits of real facts on SmolLM2
from one fact to a thousand, at once and one after another, with what each costs (item 3).

The model, the fact set, the known facts and every per-fact measure are `fact_edits`' (`setup`, `probes`, `measure`,
`summarize`, imported, not copied): SmolLM2-135M-Instruct with §13's adapter made edit-ready, the real facts of
`factset.py`, each edit writing a fact's counterfactual (an invented entity's object for an insertion), optimized in
the prompt and, for a `+ctx` method, the selection-split paraphrase templates (`optimized_facts`, the sequences
`fact_edits.engram_method` optimizes), measured on the test-split templates and the chat question.

The facts (`plan`, fixed by `seed` before any edit):
- *Reserved probes* (`reserve`): per relation, `probes` known facts drawn with the seed (at most a third of the
  relation's known facts) name the reserved subjects; every known fact of a reserved subject is a probe, and no fact
  of a reserved subject is ever edited. The same probes are read after every edit of every size, so locality at 1,000
  facts and at 10 is a paired comparison over the same probe facts (`analyse`).
- *The edit order* (`edit_order`): the other real facts, known ones first (each relation's shuffled with the seed,
  the relations taken in turn), then the ones the base does not know (the same way). A batch of n facts is the
  first n (nested: the 10 facts of the batch of 10 are in the batch of 100 and of 1,000), so a larger batch differs
  from a smaller one by what was added, not by which facts were drawn; SmolLM2 knows 413 of the 1,670 real facts,
  so the batch of 1,000 also holds facts it never knew (each record says which: `known`). `--sets R` draws R such
  orders (seed:r), the batches of one order nested, for a mean ± sd over sets.
- *Insertion*: a batch of `--insert` invented-entity facts (`kind` "new"), the relations in turn.
- *Sequential*: the first `--sequential` facts of the order (so the batch of the same size holds the same facts),
  edited one at a time, each overlay applied on top of the ones before (`apply_overlay` stacks them; the last one
  wins on a row both write, exactly what one overlay merged from them reads, so merging would change only how it is
  stored: each step records the stacked bytes and the bytes of the merged overlay, its distinct rows). After every
  `--every` edits: retention (greedy still produces each earlier fact's target), the reserved probes, the
  same-relation share of them.

Units (`units`): one per (method, batch size, set), per insertion batch, per sequential run. Each batch runs in its
own process (`python -m engram_experiments.fact_scale PHASE --unit NAME`, started by `drive`), so its time and its
peak memory are its own: VmHWM (`engram.utils.peak_rss_mib`) is reset after the model is built (`reset_peak_rss`),
so `vmhwm_mib.edit` is the peak while editing (the model included) and `vmhwm_mib.measure` the peak while measuring.
Per batch: edit seconds, sequences, steps run, overlay rows and bytes (per fact), row sharing (`collisions`: rows
written by two or more facts of the batch, from each fact's own rows; and engram's `shared_rows` and `conflicts`),
and per fact fact_edits' measures plus the reserved probes. Each unit is a JSON file under OUT/fact-scale/PHASE/units
(a sequential run: one file per block of `--every` edits, its overlays saved beside them, so a stopped run resumes
from the last finished block); a unit already there is never redone.

Before a unit edits it prints an estimate (one optimization step timed on up to 64 of its sequences, times its
sequences and steps; and the driver's, from the units already run); edits show edit_facts' progress bar and
measuring a bar over facts. On one core, the pilot's timings (docs/results/fact-edits-pilot.json) put a batch of
1,000 facts with subject+trigger+ctx at more than a day (see docs/prereg/fact-scale.toml).

Phases: `pilot` (exploratory: the design from the command line) and `test` (the design from
docs/prereg/fact-scale.toml; nothing is summarized until every unit is in).
"""

from __future__ import annotations

import datetime
import importlib
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from engram.editing import (
    Fact,
    Overlay,
    apply_overlay,
    check_overlay,
    conflicts,
    edit_facts,
    edit_rows,
    model_digest,
    remove_overlays,
    shared_rows,
)
from engram.editing.optimize import POSITIONS
from engram.persist import read_json, write_json
from engram.utils import peak_rss_mib, reset_peak_rss

from . import fact_edits
from .fact_edits import (
    CTX,
    METHODS,
    as_fact,
    greedy,
    measure,
    method_facts,
    overlay_bytes,
    probes,
    reads_any,
    summarize,
)
from .registry import Experiment, register
from .runs import ExperimentError, options_argv, parse_shard, run_cli

NAME = "fact-scale"
SIZES = (1, 10, 100, 1000)
OPTIMIZED, HELD_OUT = "selection", "test"  # paraphrase templates optimized on / measured on (fact-edits' test)
SETUP = "engram_experiments.fact_edits:setup"  # what builds the model: SmolLM2 + the edit-ready adapter
MEASURE_CHUNK = 50  # facts measured per `measure` call (a progress bar over them)
ESTIMATE_SAMPLE = 64  # sequences of the timed step (edit_facts' chunk)
FLUENCY_PROMPTS, FLUENCY_TOKENS = 20, 100  # generation entropy: greedy tokens after the first facts' prompts


def engram_methods() -> list[str]:
    """fact_edits' Engram overlay methods (the ones that write rows): `POSITIONS` (+ "+ctx")."""
    return [m for m in METHODS if m.removesuffix("+ctx") in POSITIONS]


def positions_of(method: str) -> str:
    """Where Engram method `method` writes rows ("subject+trigger+ctx" -> "subject+trigger"); one line naming the
    methods for anything else."""
    if method not in engram_methods():
        raise ExperimentError(f"{method!r} is no Engram overlay method of fact_edits; choose one of "
                              f"{', '.join(engram_methods())}")
    return method.removesuffix("+ctx")


def optimized_facts(f, method: str, opt_templates: str = OPTIMIZED) -> list[Fact]:
    """The sequences `fact_edits.METHODS[method]` optimizes for fact `f` (a `FactRecord`): its prompt and, for a
    "+ctx" method, the contexts `fact_edits.CTX` (`fact_edits.method_facts`, the one builder)."""
    positions_of(method)
    return method_facts(f, CTX if method.endswith("+ctx") else (), opt_templates)


# ------------------------------------------------------------------------------------------ the facts
def _key(subject: str) -> str:
    return subject.casefold()


def reserve(facts: list, known: set, relations: list[str], per_relation: int, seed: int) -> tuple[list, set]:
    """(probes, reserved subjects): per relation (sorted), `per_relation` known facts drawn with `seed` (at most a
    third of the relation's known facts), their subjects reserved; the probes are every known real fact of the
    `relations` whose subject is reserved, in fact-set order."""
    rng = random.Random(f"fact-scale-probes:{seed}")
    subjects: set[str] = set()
    for r in sorted(relations):
        pool = [f for f in facts if f.relation == r and f.kind == "real" and f.id in known]
        rng.shuffle(pool)
        take = min(per_relation, len(pool) // 3)
        for f in pool:
            if take <= 0:
                break
            if _key(f.subject) not in subjects:
                subjects.add(_key(f.subject))
                take -= 1
    probes_ = [f for f in facts if f.kind == "real" and f.id in known and f.relation in relations
               and _key(f.subject) in subjects]
    return probes_, subjects


def _in_turn(groups: dict[str, list]) -> list:
    """The groups' items taken one per group in turn (groups in sorted order), an exhausted group skipped."""
    out, i = [], 0
    keys = sorted(groups)
    while any(groups[k] for k in keys):
        k = keys[i % len(keys)]
        if groups[k]:
            out.append(groups[k].pop(0))
        i += 1
    return out


def edit_order(facts: list, known: set, relations: list[str], reserved: set, seed: str) -> list:
    """The real facts of `relations` whose subject is not reserved, known ones first, then the rest; within each,
    each relation's facts shuffled with `seed` and the relations taken in turn."""
    out = []
    for is_known in (True, False):
        groups = {}
        for r in relations:
            g = [f for f in facts if f.relation == r and f.kind == "real" and (f.id in known) == is_known
                 and _key(f.subject) not in reserved]
            random.Random(f"fact-scale-order:{seed}:{r}:{is_known}").shuffle(g)
            groups[r] = g
        out += _in_turn(groups)
    return out


def new_facts(facts: list, relations: list[str], seed: int) -> list:
    """The invented-entity facts of `relations`, each relation's shuffled with `seed`, the relations in turn."""
    groups = {}
    for r in relations:
        g = [f for f in facts if f.relation == r and f.kind == "new"]
        random.Random(f"fact-scale-new:{seed}:{r}").shuffle(g)
        groups[r] = g
    return _in_turn(groups)


def relations_of(facts: list, split: str) -> list[str]:
    """The relations of the factset's `split` ("selection", "test") or all ("all"), sorted."""
    return sorted({f.relation for f in facts if split == "all" or f.split == split})


def units(facts: list, known: set, design: dict) -> dict:
    """The design's units in the order they run: per method, the batches (sizes ascending, then sets), the insertion
    batch, the sequential run. Each: kind, method, size, set, its facts' ids in edit order, the reserved probes' ids;
    a size the pool cannot fill is a one-line error."""
    rels = relations_of(facts, design["split"])
    probes_, reserved = reserve(facts, known, rels, design["probes"], design["seed"])
    orders = [edit_order(facts, known, rels, reserved, f"{design['seed']}:{r}") for r in range(design["sets"])]
    pool, new = len(orders[0]), new_facts(facts, rels, design["seed"])
    need = max([*design["sizes"], design["sequential"]], default=0)
    if need > pool:
        raise ExperimentError(f"{need} facts asked for, but the {design['split']} split holds {pool} real facts "
                              f"outside the {len(probes_)} reserved probes; ask for at most {pool}")
    if design["insert"] > len(new):
        raise ExperimentError(f"--insert {design['insert']}: the fact set has {len(new)} invented-entity facts")
    probe_ids = [f.id for f in probes_]
    out = {}
    for m in design["methods"]:
        for n in sorted(design["sizes"]):
            for r, order in enumerate(orders):
                out[f"batch--{m}--{n:04d}--{r}"] = {"kind": "batch", "method": m, "size": n, "set": r,
                                                    "facts": [f.id for f in order[:n]], "probes": probe_ids}
        if design["insert"]:
            out[f"insert--{m}--{design['insert']:04d}"] = {"kind": "insert", "method": m, "size": design["insert"],
                                                          "set": 0, "facts": [f.id for f in new[:design["insert"]]],
                                                          "probes": probe_ids}
        if design["sequential"]:
            out[f"sequential--{m}--{design['sequential']:04d}"] = {
                "kind": "sequential", "method": m, "size": design["sequential"], "set": 0, "every": design["every"],
                "facts": [f.id for f in orders[0][:design["sequential"]]], "probes": probe_ids}
    return out


# ------------------------------------------------------------------------------------------ one edit
def engram_edit(s, edited: list, method: str, settings: dict, progress: bool,
                checkpoint: Path | None = None) -> tuple[Overlay, list[list[Fact]]]:
    """Edit `edited` at once with `method` (not applied): the overlay and each fact's optimized sequences.
    `checkpoint`: where the edit saves its state every 5 minutes and resumes from (a batch of 1,000 runs for hours)."""
    per = [optimized_facts(f, method) for f in edited]
    ov = edit_facts(s.model, s.tok, [x for p in per for x in p], steps=settings["steps"], lr=settings["lr"],
                    positions=positions_of(method), target_prob=settings["target_prob"], progress=progress,
                    checkpoint=checkpoint)
    return ov, per


def fact_rows(s, seqs: list[Fact], method: str) -> set[tuple[int, int]]:
    """{(layer, row)} one fact's edit writes: the rows its optimized sequences `seqs` read at `method`'s positions
    (`edit_rows`, the hash spec only)."""
    return {(lid, x) for lid, r in edit_rows(s.model, s.tok, seqs, positions_of(method)).items() for x in r.tolist()}


def collisions(s, edited: list, per: list[list[Fact]], method: str) -> dict:
    """Rows shared between facts of a batch. `shared_rows`: (layer, row) written by two or more facts, each fact's
    rows being those its own optimized sequences read at the method's positions (`edit_rows`); `shared_rows_other_
    subject`: of those, rows written by facts of two or more subjects (a subject's own rows are shared by its facts
    by design); `facts_sharing`: facts with at least one shared row; `rows_per_fact`. Also engram's own counts on the
    prompts alone: `trigger_shared_rows` (`engram.editing.shared_rows`: trigger rows read where facts predict
    different tokens) and `conflicts` (`engram.editing.conflicts`: pairs of facts reading the very same trigger
    rows for different tokens)."""
    owners: dict[tuple[int, int], set[int]] = {}
    counts = []
    for i, seqs in enumerate(per):
        rows = fact_rows(s, seqs, method)
        counts.append(len(rows))
        for key in rows:
            owners.setdefault(key, set()).add(i)
    shared = [o for o in owners.values() if len(o) > 1]
    plain = [as_fact(f) for f in edited]
    return {"rows": len(owners), "rows_per_fact": counts, "shared_rows": len(shared),
            "shared_rows_other_subject": sum(len({_key(edited[i].subject) for i in o}) > 1 for o in shared),
            "facts_sharing": len(set().union(*shared)) if shared else 0,
            "trigger_shared_rows": shared_rows(s.model, s.tok, plain),
            "conflicts": len(conflicts(s.model, s.tok, plain))}


def estimate(s, seqs: list[Fact], method: str, settings: dict) -> dict:
    """The edit's time, estimated before it runs: one optimization step timed on up to `ESTIMATE_SAMPLE` of its
    sequences (edit_facts' chunk), scaled to all of them and to `settings["steps"]` (an upper bound: an edit stops
    early once every sequence is at its target)."""
    sample = seqs[:ESTIMATE_SAMPLE]
    one = edit_facts(s.model, s.tok, sample, steps=1, lr=settings["lr"], positions=positions_of(method),
                     target_prob=settings["target_prob"], progress=False).meta["optimization"]["seconds"]
    step = one * len(seqs) / len(sample)
    # (4 decimals: on a fast core the tests' tiny model takes milliseconds, and 1 decimal rounded its estimate to 0)
    return {"sequences": len(seqs), "steps": settings["steps"], "step_seconds": round(step, 4),
            "edit_seconds": round(step * settings["steps"], 4)}


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min" if seconds >= 60 \
        else f"{seconds:.1f} s"


# ------------------------------------------------------------------------------------------ measuring
def reserved_kept(s, reserved: list) -> dict[str, bool]:
    """Per reserved probe: does the model still complete it with its true object (greedy)?"""
    return dict(zip([p.id for p in reserved], greedy(s, [(p.prompt, " " + p.object) for p in reserved])))


def measure_batch(s, edited: list, reserved: list, progress: bool, seed: int = 0) -> dict:
    """fact_edits' measures of `edited` with the overlay applied, with the reserved probes as the locality probes:
    `same_relation` those of an edited relation, `shared_ngram` those whose prompt + true object reads a row the
    subject+trigger overlay of the batch would write (fact_edits' definition), `reserved` every one of them; the same
    subject's other known facts per fact and the general-text change as `fact_edits.probes` / `measure` give them.
    Facts are measured `MEASURE_CHUNK` at a time (a progress bar); the set-level measures once."""
    from tqdm.auto import tqdm

    pr = probes(s, edited, 0, seed)  # same_subject, the text positions reading the batch's rows
    rows = edit_rows(s.model, s.tok, [as_fact(f) for f in edited], "subject+trigger")
    rels = {f.relation for f in edited}
    kept = reserved_kept(s, reserved)
    same_rel = [p.id for p in reserved if p.relation in rels]
    shared = [p.id for p in reserved if reads_any(s, p.prompt + " " + p.object, rows)]
    empty = {**pr, "same_relation": [], "shared_ngram": []}
    per_fact = []
    chunks = [edited[i:i + MEASURE_CHUNK] for i in range(0, len(edited), MEASURE_CHUNK)]
    for part in tqdm(chunks, desc=f"measuring {len(edited)} facts", unit="chunk", disable=not progress, leave=False):
        per_fact += measure(s, part, empty, HELD_OUT)["facts"]
    m = measure(s, [], empty, HELD_OUT)  # the general text, once
    m.update(facts=per_fact, same_relation=[kept[i] for i in same_rel], shared_ngram=[kept[i] for i in shared])
    return {"m": m, "reserved": kept, "probes": {"same_relation": same_rel, "shared_ngram": shared,
                                                "same_subject": pr["same_subject"],
                                                "text_positions": pr["text_positions"]}}


def generation_entropy(s, facts: list) -> list[float]:
    """Fluency (`editing.ngram_entropy`, the editing literature's generation entropy) of `FLUENCY_TOKENS` greedy
    tokens after each of the first `FLUENCY_PROMPTS` facts' prompts, with the model as it stands."""
    import torch

    from engram.editing import ngram_entropy

    out = []
    for f in facts[:FLUENCY_PROMPTS]:
        ids = s.tok.encode(f.prompt, add_special_tokens=False).ids
        x = torch.tensor([ids])
        with torch.no_grad():
            y = s.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=FLUENCY_TOKENS, do_sample=False,
                                 pad_token_id=0)
        out.append(ngram_entropy(s.tok.decode(y[0, len(ids):].tolist(), skip_special_tokens=True)))
    return out


def unit_summary(m: dict, kept: dict, edited: list, known: set, fluency: dict | None = None) -> dict:
    """`fact_edits.summarize` plus the reserved probes' share kept, efficacy over the facts the base knew and (with
    `fluency`) the generation entropy's change, after minus before, mean over its prompts; for invented entities
    (no old object) the old-object measures are None."""
    out = summarize(m)
    if fluency and fluency["before"]:
        out["entropy_change"] = (sum(fluency["after"]) - sum(fluency["before"])) / len(fluency["before"])
    out["reserved"] = sum(kept.values()) / len(kept) if kept else None
    k = [x["efficacy"] for x, f in zip(m["facts"], edited) if f.id in known and f.kind == "real"]
    out["efficacy_known"] = sum(k) / len(k) if k else None
    if edited and all(f.kind == "new" for f in edited):
        out.update(p_new_gt_old=None, paraphrases_old=None, chat_old=None)
    return out


# ------------------------------------------------------------------------------------------ units
def run_batch(s, path: Path, name: str, spec: dict, settings: dict, progress: bool, show: bool = True) -> dict:
    """One batch unit (cached in `path`): estimate, edit at once, measure, undo. `show`: print its measures when
    done (the test phase shows none before its family is complete)."""
    from engram.utils import environment

    if path.is_file():
        return read_json(path, "fact-scale unit", f"delete {path}", ExperimentError)
    by_id = {f.id: f for f in s.facts}
    edited, reserved = [by_id[i] for i in spec["facts"]], [by_id[i] for i in spec["probes"]]
    hwm = {"setup": round(peak_rss_mib(), 1)}
    reset = reset_peak_rss()
    method = spec["method"]
    per = [optimized_facts(f, method) for f in edited]
    fluency = {"prompts": [f.id for f in edited[:FLUENCY_PROMPTS]], "tokens": FLUENCY_TOKENS,
               "before": generation_entropy(s, edited)}  # the edit-ready model: the base
    est = estimate(s, [x for p in per for x in p], method, settings)
    if progress:
        print(f"[{NAME}] {name}: {len(edited)} facts, {est['sequences']} sequences x {est['steps']} steps; one step "
              f"~{est['step_seconds']:.2f} s -> edit <= {hours(est['edit_seconds'])} (estimate)", file=sys.stderr,
              flush=True)
    col = collisions(s, edited, per, method)
    ov, _ = engram_edit(s, edited, method, settings, progress, path.with_name(path.stem + ".edit.ckpt"))
    secs = ov.meta["optimization"]["seconds"]  # over every process a stopped edit ran in
    hwm["edit"] = round(peak_rss_mib(), 1)
    if col["rows"] != ov.num_rows:
        raise ExperimentError(f"{name}: the facts' own rows ({col['rows']}) are not the overlay's ({ov.num_rows}); "
                              "fact_scale.optimized_facts no longer builds what the edit optimizes")
    reset_peak_rss()
    apply_overlay(s.model, ov, check=False)  # made on this model just now
    t1 = time.perf_counter()
    try:
        got = measure_batch(s, edited, reserved, progress)
        fluency["after"] = generation_entropy(s, edited)
    finally:
        remove_overlays(s.model)
    hwm["measure"] = round(peak_rss_mib(), 1)
    size = overlay_bytes(ov)
    rec = {"unit": name, **{k: spec[k] for k in ("kind", "method", "size", "set", "facts")},
           "known": [f.id in s.known for f in edited], "relations": sorted({f.relation for f in edited}),
           "settings": settings, "optimized_templates": OPTIMIZED, "held_out_templates": HELD_OUT,
           "estimate": est, "edit_seconds": round(secs, 2), "measure_seconds": round(time.perf_counter() - t1, 2),
           "optimization": ov.meta["optimization"], "sequences": est["sequences"],
           "vmhwm_mib": hwm, "peak_reset": reset,
           "overlay": {"rows": ov.num_rows, "bytes": size, "bytes_per_fact": size / len(edited)},
           "collisions": col, "probes": {"reserved": spec["probes"], **got["probes"]}, "reserved": got["reserved"],
           "fluency": fluency, **got["m"], "summary": unit_summary(got["m"], got["reserved"], edited, s.known, fluency),
           "environment": environment()}
    write_json(path, rec)
    if progress:
        sm = rec["summary"]
        shown = ", ".join(f"{k} {sm[k]:.3f}" for k in ("efficacy", "paraphrases", "chat_new", "reserved",
                                                          "same_relation") if sm.get(k) is not None) if show else "done"
        print(f"[{NAME}] {name}: {shown} ({rec['edit_seconds']} s edit, peak {hwm['edit']:.0f} MiB)",
              file=sys.stderr, flush=True)
    return rec


def run_sequential(s, folder: Path, name: str, spec: dict, settings: dict, progress: bool,
                   show: bool = True) -> dict:
    """One sequential unit in `folder`: the facts edited one at a time, each overlay (saved in folder/overlays/)
    stacked on the ones before; after every `spec["every"]` edits a block record (folder/block-J.json) of the edits
    and of retention and locality then. A finished block is reused (its overlays re-applied from disk), so a stopped
    run resumes at the first missing block; folder/unit.json collects the blocks when all are in. The model is left
    without overlays."""
    from engram.utils import environment

    done_file = folder / "unit.json"
    if done_file.is_file():
        return read_json(done_file, "fact-scale unit", f"delete {done_file}", ExperimentError)
    by_id = {f.id: f for f in s.facts}
    facts, reserved = [by_id[i] for i in spec["facts"]], [by_id[i] for i in spec["probes"]]
    every, method = spec["every"], spec["method"]
    blocks = [facts[i:i + every] for i in range(0, len(facts), every)]
    digest, steps, learned, union, stacked = None, [], [], {}, 0
    remove_overlays(s.model)
    try:
        for j, block in enumerate(blocks):
            first = j * every
            bf = folder / f"block-{j:03d}.json"
            if bf.is_file():
                rec = read_json(bf, "fact-scale block", f"delete {bf} and the blocks after it", ExperimentError)
                digest = digest or model_digest(s.model)
                for i in range(first, first + len(block)):
                    ov = Overlay.load(folder / "overlays" / f"{i:04d}")
                    check_overlay(s.model, ov, digest=digest)
                    apply_overlay(s.model, ov, check=False)
                    stacked += overlay_bytes(ov)
                    for lid, r in ov.rows.items():
                        union.setdefault(lid, set()).update(r.tolist())
                learned += [e["efficacy_now"] for e in rec["per_edit"]]
                steps.append(rec)
                continue
            reset = reset_peak_rss()
            t0 = time.perf_counter()
            per_edit = []
            for i, f in enumerate(block, start=first):
                ov, _ = engram_edit(s, [f], method, settings, False)
                ov.save(folder / "overlays" / f"{i:04d}")
                apply_overlay(s.model, ov, check=False)
                stacked += overlay_bytes(ov)
                for lid, r in ov.rows.items():
                    union.setdefault(lid, set()).update(r.tolist())
                now = greedy(s, [(f.prompt, " " + f.target)])[0]
                per_edit.append({"id": f.id, "seconds": ov.meta["optimization"]["seconds"], "rows": ov.num_rows,
                                 "steps_run": ov.meta["optimization"]["steps_run"], "efficacy_now": now})
                learned.append(now)
            edit_secs = time.perf_counter() - t0
            end = first + len(block)
            retention = greedy(s, [(g.prompt, " " + g.target) for g in facts[:end]])
            kept = reserved_kept(s, reserved)
            rels = {g.relation for g in facts[:end]}
            same = [kept[p.id] for p in reserved if p.relation in rels]
            dim = next(iter(ov.values.values())).shape[1]
            merged = sum(len(u) for u in union.values()) * (dim * 4 + 8)
            ret_learned = [r for r, ok in zip(retention, learned) if ok]
            rec = {"block": j, "edits": end, "facts": [f.id for f in block], "per_edit": per_edit,
                   "edit_seconds": round(edit_secs, 2), "vmhwm_mib": round(peak_rss_mib(), 1), "peak_reset": reset,
                   "retention": retention, "retention_share": sum(retention) / len(retention),
                   "retained_of_learned": sum(ret_learned) / len(ret_learned) if ret_learned else None,
                   "reserved": kept, "reserved_kept": sum(kept.values()) / len(kept) if kept else None,
                   "same_relation": sum(same) / len(same) if same else None,
                   "overlay": {"stacked_bytes": stacked, "merged_bytes": merged, "merged_bytes_per_fact": merged / end,
                               "distinct_rows": sum(len(u) for u in union.values())}}
            write_json(bf, rec)
            steps.append(rec)
            if progress:
                shown = f"retention {rec['retention_share']:.3f}, reserved {rec['reserved_kept']:.3f}" if show \
                    and rec["reserved_kept"] is not None else "done"
                print(f"[{NAME}] {name}: {end}/{len(facts)} edits, {shown} ({rec['edit_seconds']} s)",
                      file=sys.stderr, flush=True)
    finally:
        remove_overlays(s.model)
    out = {"unit": name, **{k: spec[k] for k in ("kind", "method", "size", "set", "every", "facts")},
           "known": [f.id in s.known for f in facts], "settings": settings, "optimized_templates": OPTIMIZED,
           "probes": {"reserved": spec["probes"]}, "steps": steps, "environment": environment()}
    write_json(done_file, out)
    return out


def sequential_overwrites(s, unit: dict) -> dict:
    """Why edits made one after another stop holding, read from the rows (descriptive, hash spec only): a later
    overlay replaces an earlier one's value on every row both write (`apply_overlay` stacks them, the last wins), so
    a later fact that writes one of an earlier fact's rows undoes that part of its edit (later rows the earlier
    prompt reads elsewhere can move it too; those are not counted). Per fact of sequential `unit`
    (in edit order): `later_writers`, how many later edits wrote at least one of its rows (each fact's rows are those
    its own optimized sequences read at the method's positions, `edit_rows`, as `collisions` counts them); then
    the facts held at the end (the last block's retention) split by whether any later edit wrote one of their rows,
    over all facts and over those that held right after their own edit (`efficacy_now`)."""
    by_id = {f.id: f for f in s.facts}
    facts = [by_id[i] for i in unit["facts"]]
    rows = [fact_rows(s, optimized_facts(f, unit["method"]), unit["method"]) for f in facts]
    later = [sum(bool(rows[i] & rows[j]) for j in range(i + 1, len(rows))) for i in range(len(rows))]
    held = unit["steps"][-1]["retention"]  # (n,) after the last edit
    learned = [e["efficacy_now"] for st in unit["steps"] for e in st["per_edit"]]

    def split(ids: list[int]) -> dict:
        def cell(sel: list[int]) -> dict:
            return {"facts": len(sel), "held": sum(bool(held[i]) for i in sel)}
        return {"overwritten": cell([i for i in ids if later[i]]), "untouched": cell([i for i in ids if not later[i]])}

    every = list(range(len(facts)))
    return {"later_writers": later, "all": split(every), "learned": split([i for i in every if learned[i]])}


def run_unit(s, root: Path, name: str, spec: dict, settings: dict, progress: bool, show: bool = True) -> dict:
    """The unit `name` of a plan (root: OUT/fact-scale/PHASE)."""
    if spec["kind"] == "sequential":
        return run_sequential(s, root / "units" / name, name, spec, settings, progress, show)
    return run_batch(s, root / "units" / f"{name}.json", name, spec, settings, progress, show)


def unit_done(root: Path, name: str) -> bool:
    return (root / "units" / f"{name}.json").is_file() or (root / "units" / name / "unit.json").is_file()


# ------------------------------------------------------------------------------------------ the driver
def load_setup(ref: str):
    """The function `MODULE:FUNCTION` that builds a `fact_edits.Setup` (called as fn(root, progress=...))."""
    mod, _, fn = ref.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError, ValueError) as e:
        raise ExperimentError(f"--setup {ref!r}: cannot load it ({e}); give MODULE:FUNCTION, e.g. {SETUP}") from None


def write_plan(root: Path, design: dict, plan: dict) -> None:
    """root/plan.json: the design and its units. Units already run under another design are refused in one line."""
    f = root / "plan.json"
    if f.is_file():
        old = read_json(f, "fact-scale plan", f"delete {root}", ExperimentError)
        if old["design"] != design and any(unit_done(root, n) for n in old["units"]):
            raise ExperimentError(f"{root} holds units run with another design ({old['design']}); give another --out "
                                  f"or delete {root}")
    write_json(f, {"design": design, "units": plan})


# a unit's process: `main` imported under the module's own name (not run as __main__, which would register this
# module's experiments a second time once anything imports it by name, e.g. a --setup module)
UNIT_PROCESS = "import sys; from engram_experiments.fact_scale import cli; cli(sys.argv[1:])"


def drive(root: Path, plan: dict, todo: list[str], settings: dict, argv: list[str], progress: bool = True) -> None:
    """Run each unit of `todo` not yet done in its own process (`main(argv + ["--unit", NAME])`), in order. Before
    each, the driver's estimate from the batches already run with the same method: their seconds per sequence-step
    times this unit's sequences (their sequences per fact) and `settings["steps"]`."""
    for name in todo:
        if unit_done(root, name):
            continue
        spec = plan[name]
        if progress:
            past = [read_json(p, "fact-scale unit", f"delete {p}", ExperimentError)
                    for p in sorted((root / "units").glob(f"batch--{spec['method']}--*.json"))]
            work = sum(r["sequences"] * max(1, r["optimization"]["steps_run"]) for r in past)
            guess = ""
            if work:
                per_seq = sum(r["edit_seconds"] for r in past) / work
                seqs = spec["size"] * sum(r["sequences"] for r in past) / sum(r["size"] for r in past)
                guess = f"; the batches run so far say edit <= {hours(per_seq * seqs * settings['steps'])}"
            print(f"[{NAME}] starting {name} ({spec['size']} facts) in its own process{guess}", file=sys.stderr,
                  flush=True)
        rc = subprocess.run([sys.executable, "-c", UNIT_PROCESS, *argv, "--unit", name]).returncode
        if rc != 0:
            raise ExperimentError(f"unit {name} failed (exit {rc}; its output is above); the units done are kept: "
                                  "fix the cause and run the phase again")


# ------------------------------------------------------------------------------------------ summary
MEASURES = ("efficacy", "efficacy_known", "p_new_gt_old", "paraphrases", "chat_new", "reserved", "same_relation",
            "same_subject", "shared_ngram", "text_change", "entropy_change")
LABELS = {**fact_edits.LABELS, "efficacy_known": "efficacy (facts the base knew)",
          "reserved": "locality: reserved probes", "entropy_change": "Δ generation entropy (bits)"}


def read_units(root: Path) -> list[dict]:
    """Every finished unit under root/units (batches, insertions, sequential runs)."""
    files = sorted((root / "units").glob("*.json")) + sorted((root / "units").glob("*/unit.json"))
    return [read_json(f, "fact-scale unit", f"delete {f}", ExperimentError) for f in files]


def summary(root: Path, phase: str, design: dict) -> dict:
    """Every finished unit of `phase` and, per (kind, method, size), each measure's mean ± sd over its sets (sd 0 for
    one set), time, peak memory, overlay bytes and row sharing; per sequential run its steps. `design` is what the
    record states: a test's whole preregistration (what ran is its [run] table, `run_design`), a pilot's flags."""
    from .runs import index_environments, seed_stats

    units_ = read_units(root)
    if not units_:
        raise ExperimentError(f"no units in {root / 'units'}: run `python -m engram_experiments.fact_scale {phase}` "
                              "first")
    table: dict = {}
    for u in (u for u in units_ if u["kind"] != "sequential"):
        table.setdefault(u["kind"], {}).setdefault(u["method"], {}).setdefault(str(u["size"]), []).append(u)
    for by_m in table.values():
        for by_n in by_m.values():
            for n, us in by_n.items():
                us.sort(key=lambda u: u["set"])
                cell = {k: seed_stats([u["summary"][k] for u in us]) for k in MEASURES
                        if all(u["summary"].get(k) is not None for u in us)}
                cell.update({
                    "sets": [u["set"] for u in us], "known": sum(us[0]["known"]),
                    "edit_seconds": seed_stats([u["edit_seconds"] for u in us]),
                    "vmhwm_edit_mib": seed_stats([u["vmhwm_mib"]["edit"] for u in us]),
                    "bytes_per_fact": seed_stats([u["overlay"]["bytes_per_fact"] for u in us]),
                    "rows": seed_stats([u["overlay"]["rows"] for u in us]),
                    "shared_rows": seed_stats([u["collisions"]["shared_rows"] for u in us]),
                    "facts_sharing": seed_stats([u["collisions"]["facts_sharing"] for u in us])})
                by_n[n] = cell
    seq = {u["method"]: [{k: st[k] for k in ("edits", "retention_share", "retained_of_learned", "reserved_kept",
                                            "same_relation", "edit_seconds", "vmhwm_mib")}
                         | {"merged_bytes_per_fact": st["overlay"]["merged_bytes_per_fact"]} for st in u["steps"]]
           for u in units_ if u["kind"] == "sequential"}
    out = {"experiment": NAME if phase == "test" else f"{NAME}-{phase}", "phase": phase,
           "date": datetime.date.today().isoformat(), "design": design,
           "command": f"python -m engram_experiments.fact_scale {phase}", "table": table, "sequential": seq,
           "runs": units_}
    out["environments"] = index_environments(out["runs"])
    return out


def run_design(s: dict) -> dict:
    """What a summary ran: the test's record holds its whole preregistration as `design` (so `prereg.check_record`
    can compare it with the committed file) and what ran is its [run] table; a pilot's `design` is what ran."""
    return s["design"].get("run", s["design"])


def analyse(s: dict, margin: float = 0.05, small: int = 10) -> list[dict]:
    """The test's family (docs/prereg/fact-scale.toml): per method, locality at the largest batch size vs at `small`
    as non-inferiority at `margin`, paired over the reserved probes (each probe's kept share over the sets of a
    size; one-sided paired t of large - small + margin > 0); Holm over the methods; each row also carries the
    difference's two-sided 95% interval (`ci95`). A method without both sizes is listed untested (p None)."""
    from scipy import stats

    from .significance import holm, is_finding, paired

    rows = []
    for m in run_design(s)["methods"]:
        batches = [u for u in s["runs"] if u["kind"] == "batch" and u["method"] == m]
        sizes = sorted({u["size"] for u in batches})
        large = sizes[-1] if sizes else None
        r = {"method": m, "metric": "reserved", "small": small, "large": large,
             "kind": f"non-inferiority, margin {margin}"}
        per = {n: [u["reserved"] for u in batches if u["size"] == n] for n in (small, large)}
        if large is None or large == small or not per[small] or not per[large]:
            r.update(n=0, diff=None, se=None, p=None)
            rows.append(r)
            continue
        ids = sorted(per[small][0])
        a = [statistics.fmean(x[i] for x in per[small]) for i in ids]
        b = [statistics.fmean(x[i] for x in per[large]) for i in ids]
        t = paired(a, b)
        h = float(stats.t.ppf(0.975, t.df)) * t.se  # the two-sided 95% interval: the issue's target is read from it
        r.update(n=len(ids), diff=t.diff, se=t.se, ci95=[t.diff - h, t.diff + h])
        r["p"] = float(stats.t.sf((t.diff + margin) / t.se, t.df)) if t.se > 0 else \
            (0.0 if t.diff + margin > 0 else 1.0)
        rows.append(r)
    tested = [r for r in rows if r["p"] is not None]
    for r, adj in zip(tested, holm([r["p"] for r in tested])):
        r["p_holm"], r["finding"] = adj, is_finding(adj)
    return rows


def probes_needed(s: dict, method: str, margin: float = 0.05, small: int = 10, power: float = 0.8,
                  alpha: float = 0.05) -> int | None:
    """Reserved probes for `power` in the one-sided non-inferiority test at `margin` (true difference 0), from a
    pilot summary: ceil(((z_{1-alpha} + z_power) sd / margin)^2), sd that of the per-probe differences between the
    pilot's largest batch and `small`; None when the pilot has no such pair."""
    from scipy import stats

    rows = [r for r in analyse({**s, "design": {**s["design"], "methods": [method]}}, margin, small)
            if r["p"] is not None]
    if not rows:
        return None
    sd = rows[0]["se"] * math.sqrt(rows[0]["n"])
    return max(2, math.ceil(((stats.norm.ppf(1 - alpha) + stats.norm.ppf(power)) * sd / margin) ** 2))


def pilot_power(s: dict, method: str, margin: float = 0.05, small: int = 10) -> dict | None:
    """What the pilot says for the test's power rule: the sd of the per-probe differences kept(largest) - kept(small)
    of `method`, their mean, the probes it ran, and `probes_needed`; None without both sizes."""
    rows = [r for r in analyse({**s, "design": {**s["design"], "methods": [method]}}, margin, small)
            if r["p"] is not None]
    if not rows:
        return None
    r = rows[0]
    return {"small": small, "large": r["large"], "probes": r["n"], "diff": r["diff"],
            "sd": r["se"] * math.sqrt(r["n"]), "probes_needed": probes_needed(s, method, margin, small)}


def markdown(s: dict) -> str:
    """Per kind (batch, insert) and method, per number of facts: measures (mean ± sd over sets), time, peak memory,
    bytes per fact, row sharing; then each sequential run's steps."""
    lines = [f"{s['experiment']} ({s['phase']}): " + ", ".join(f"{k} {v}" for k, v in run_design(s).items()
                                                                if k not in ("settings",)), ""]
    cols = list(MEASURES)
    for kind, by_m in s["table"].items():
        lines += [f"**{kind}**", "",
                  "| method | facts (known) | sets | " + " | ".join(LABELS[k] for k in cols) +
                  " | edit s | peak MiB | bytes/fact | rows | shared rows (facts) |",
                  "|---" * (len(cols) + 8) + "|"]
        for m, by_n in by_m.items():
            for n, c in sorted(by_n.items(), key=lambda kv: int(kv[0])):
                cells = [fact_edits.cell(c, k) for k in cols]
                lines.append(f"| {m} | {n} ({c['known']}) | {len(c['sets'])} | " + " | ".join(cells) +
                             f" | {c['edit_seconds']['mean']:.1f} | {c['vmhwm_edit_mib']['mean']:.0f} | "
                             f"{c['bytes_per_fact']['mean']:.0f} | {c['rows']['mean']:.0f} | "
                             f"{c['shared_rows']['mean']:.0f} ({c['facts_sharing']['mean']:.0f}) |")
        lines.append("")

    def f2(x):
        return "—" if x is None else f"{x:.2f}"

    for m, steps in s["sequential"].items():
        lines += [f"**sequential: {m}**", "", "| edits | retention | retained of learned | reserved probes kept | "
                  "same relation | block edit s | peak MiB | merged bytes/fact |", "|---" * 8 + "|"]
        for st in steps:
            lines.append(f"| {st['edits']} | {f2(st['retention_share'])} | {f2(st['retained_of_learned'])} | "
                         f"{f2(st['reserved_kept'])} | {f2(st['same_relation'])} | {st['edit_seconds']:.1f} | "
                         f"{st['vmhwm_mib']:.0f} | {st['merged_bytes_per_fact']:.0f} |")
        lines.append("")
    for m, pw in (s.get("power") or {}).items():
        if pw is not None:
            lines.append(f"- {m}, for the test's power: reserved probes kept at {pw['large']} - at {pw['small']} "
                         f"facts = {pw['diff']:+.3f} over {pw['probes']} probes (sd {pw['sd']:.3f}); 80% power at "
                         f"margin 0.05 needs {pw['probes_needed']} probes")
    for m, w in (s.get("overwrites") or {}).items():
        a, b = w["all"]["overwritten"], w["all"]["untouched"]
        lines.append(f"- {m}, sequential: at the end, {a['held']} of the {a['facts']} facts whose rows a later edit "
                     f"wrote still held, {b['held']} of the {b['facts']} whose rows no later edit wrote")
    for t in s.get("tests", []):
        if t["p"] is not None:
            lines.append(f"- {t['method']}: reserved-probe locality at {t['large']} - at {t['small']} = "
                         f"{t['diff']:+.3f} (se {t['se']:.3f}, 95% interval {t['ci95'][0]:+.3f} to "
                         f"{t['ci95'][1]:+.3f}, {t['n']} probes), {t['kind']}: Holm p "
                         f"{t['p_holm']:.3g}{' (**finding**)' if t['finding'] else ''}")
    return "\n".join(lines).rstrip("\n") + "\n"


def plot(s: dict, path: Path) -> None:
    """Three panels: locality (reserved probes, same relation) and efficacy vs the number of facts edited at once, per
    method (log x); retention and locality vs edits one after another; edit seconds and peak memory vs facts."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    mem = c.twinx()
    for m, by_n in s["table"].get("batch", {}).items():
        ns = sorted(by_n, key=int)
        x = [int(n) for n in ns]
        for k, style in (("reserved", "o-"), ("same_relation", "s--"), ("efficacy", "^:")):
            pts = [(xi, by_n[n][k]) for xi, n in zip(x, ns) if k in by_n[n]]
            if pts:
                a.errorbar([p for p, _ in pts], [v["mean"] for _, v in pts], yerr=[v["std"] for _, v in pts],
                           fmt=style, capsize=2, label=f"{m}: {LABELS[k]}")
        c.plot(x, [by_n[n]["edit_seconds"]["mean"] for n in ns], "o-", label=f"{m}: edit s")
        mem.plot(x, [by_n[n]["vmhwm_edit_mib"]["mean"] for n in ns], "s--", label=f"{m}: peak MiB")
    for m, steps in s["sequential"].items():
        e = [st["edits"] for st in steps]
        b.plot(e, [st["retention_share"] for st in steps], "o-", label=f"{m}: retention")
        b.plot(e, [st["reserved_kept"] for st in steps], "s--", label=f"{m}: reserved probes kept")
    a.set_xscale("log")
    a.set_xlabel("facts edited at once")
    a.set_ylabel("share")
    a.legend(fontsize=6)
    b.set_xlabel("facts edited one after another")
    b.set_ylabel("share")
    if s["sequential"]:
        b.legend(fontsize=6)
    c.set_xscale("log")
    c.set_yscale("log")
    c.set_xlabel("facts edited at once")
    c.set_ylabel("edit seconds")
    c.legend(fontsize=6, loc="upper left")
    mem.set_ylabel("peak resident memory while editing (MiB, dashed)")
    mem.legend(fontsize=6, loc="lower right")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for ax in (a, c):
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 1, 10, 100 (not 1.0, 10.0)
        ax.xaxis.set_minor_formatter(NullFormatter())
    for ax in (a, b):
        ax.set_ylim(-0.03, 1.03)
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.subplots_adjust(wspace=0.35)
    fig.suptitle(f"{s['experiment']}: SmolLM2-135M-Instruct (Q4_1 GGUF) + edit-ready adapter; mean ± sd over sets")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------------ the command
def main(argv: list[str] | None = None) -> dict:
    """Run a phase's units not yet done (each in its own process), then publish its summary (and `--record` it).
    With `--unit NAME`: run that one unit in this process (what the driver starts)."""
    import argparse

    from .runs import publish

    ap = argparse.ArgumentParser(prog="python -m engram_experiments.fact_scale",
                                 description="Engram edits of real facts at 1 to 1,000 facts at once and one after "
                                             "another (issue 56 item 3)")
    ap.add_argument("phase", choices=["pilot", "test"], help="pilot: exploratory, the design from the flags below; "
                    "test: the design of docs/prereg/fact-scale.toml (the design flags are ignored)")
    ap.add_argument("--out", default="runs/experiments", help="units go under OUT/fact-scale/PHASE; the model, facts "
                    "and known facts are fact-edits' (OUT/fact-edits)")
    ap.add_argument("--sizes", nargs="*", type=int, default=list(SIZES), help="facts per batch (default 1 10 100 1000)")
    ap.add_argument("--method", nargs="+", help="Engram method(s) of fact_edits (default: the one "
                    "docs/prereg/fact-edits.toml chose); 'trigger' is the cheap one")
    ap.add_argument("--sequential", type=int, default=100, metavar="N", help="facts edited one after another (0: none)")
    ap.add_argument("--every", type=int, default=10, metavar="K", help="measure retention after every K edits")
    ap.add_argument("--insert", type=int, default=100, metavar="N", help="invented-entity facts in one batch (0: none)")
    ap.add_argument("--sets", type=int, default=1, help="edit orders (seed:r), each's batches nested")
    ap.add_argument("--probes", type=int, default=20, help="reserved probe subjects per relation")
    ap.add_argument("--split", choices=["all", "selection", "test"], default="all",
                    help="the factset split whose relations are edited")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per unit process")
    ap.add_argument("--shard", default="0/1", metavar="K/N",
                    help="run only every N-th unit, from the K-th (0-based): N drivers on N cores share a phase")
    ap.add_argument("--setup", default=SETUP, metavar="MODULE:FUNCTION",
                    help="what builds the model (default: fact_edits.setup, SmolLM2; the tests pass a tiny one)")
    ap.add_argument("--unit", help="run this one unit of the phase's plan in this process (the driver starts these)")
    ap.add_argument("--summary-only", action="store_true", help="summarize the finished units, run nothing")
    ap.add_argument("--record", help="also write the summary to RECORD/fact-scale-pilot.json or RECORD/fact-scale.json")
    a = ap.parse_args(argv)
    shard = parse_shard(a.shard, ap)
    top = Path(a.out)
    setup_root, root = top / fact_edits.NAME, top / NAME / a.phase
    pre = None
    if a.unit:  # a unit process: the plan the driver wrote
        torch.set_num_threads(a.threads)
        torch.manual_seed(0)
        plan = read_json(root / "plan.json", "fact-scale plan", "run the phase without --unit", ExperimentError)
        if a.unit not in plan["units"]:
            raise ExperimentError(f"no unit {a.unit!r} in {root / 'plan.json'}")
        s = load_setup(a.setup)(setup_root, progress=True)
        run_unit(s, root, a.unit, plan["units"][a.unit], plan["design"]["settings"], True, a.phase != "test")
        return {"unit": a.unit}
    from . import prereg

    if a.phase == "test":  # the design from the preregistration
        pre = prereg.load(NAME, record=a.record is not None)
        design = pre.design["run"]
    else:
        fe = prereg.load(fact_edits.NAME, record=False).design
        for m in a.method or []:
            positions_of(m)
        for n in a.sizes:
            if n < 1:
                ap.error(f"--sizes: {n} facts; give sizes of at least 1")
        for flag, v, low in (("--sequential", a.sequential, 0), ("--insert", a.insert, 0), ("--every", a.every, 1),
                             ("--sets", a.sets, 1), ("--probes", a.probes, 0)):
            if v < low:
                ap.error(f"{flag} {v}: give at least {low}")
        design = {"methods": a.method or [fe["chosen"]], "sizes": sorted(set(a.sizes)), "sequential": a.sequential,
                  "every": a.every, "insert": a.insert, "sets": a.sets, "probes": a.probes, "split": a.split,
                  "seed": a.seed, "settings": dict(fe["methods"]["engram"])}
    if not a.summary_only:
        facts_file, known_file = setup_root / "facts.jsonl", setup_root / "known.json"
        if not (facts_file.is_file() and known_file.is_file()):  # build the model once (and its facts), then plan
            load_setup(a.setup)(setup_root, progress=True)
        from . import factset

        facts = factset.read(facts_file)
        known = set(read_json(known_file, "known facts", f"delete {known_file}", ExperimentError)["known"])
        plan = units(facts, known, design)
        root.mkdir(parents=True, exist_ok=True)
        write_plan(root, design, plan)
        names = list(plan)[shard[0]::shard[1]]
        drive(root, plan, names, design["settings"], [a.phase, "--out", a.out, "--setup", a.setup, "--threads",
                                                      str(a.threads)])
    out = summary(root, a.phase, pre.design if pre is not None else design)  # a test records its whole prereg
    if pre is not None:
        out["prereg"] = pre.stamp()
        want = read_json(root / "plan.json", "fact-scale plan", f"delete {root}", ExperimentError)["units"]
        done = [n for n in want if unit_done(root, n)]
        if len(done) < len(want):  # the stop rule: nothing is tested until every unit is in
            print(f"[{NAME}] {len(done)} of {len(want)} test units done; nothing is summarized until every unit is "
                  "(the preregistered stop rule)", file=sys.stderr)
            return {"done": len(done), "of": len(want)}
        out["tests"] = analyse(out, margin=pre.design["test"]["margin"])
    else:  # the pilot sizes the test's probes ([power] of docs/prereg/fact-scale.toml)
        out["power"] = {m: pilot_power(out, m) for m in design["methods"]}
    seq = [u for u in out["runs"] if u["kind"] == "sequential"]
    if seq:  # why stacked edits stop holding (descriptive): the model's hash spec and tokenizer give each fact's rows
        s = load_setup(a.setup)(setup_root, progress=False)
        out["overwrites"] = {u["method"]: sequential_overwrites(s, u) for u in seq}
    return publish(out, root, a.record, f"{out['experiment']}.json", markdown, plot)


PILOT = ["pilot", "--split", "selection", "--sizes", "1", "10", "100", "--sequential", "20", "--insert", "10"]


register(Experiment("fact-scale-pilot", """
    the pilot of issue 56's scale and sequence (exploratory, the selection split's relations): the Engram edit
    docs/prereg/fact-edits.toml chose, on 1, 10 and 100 facts at once (each batch in its own process: time, peak
    memory, overlay bytes, row sharing, per-fact measures), 10 invented-entity facts, 20 facts one after another
    with retention (`fact_scale.py`; several hours of one core).""",
                    run=lambda o: main(PILOT + options_argv(o)), table=markdown, plot=plot,
                    plot_file="fact-scale-pilot.png", section="14", in_all=False))
register(Experiment("fact-scale", """
    issue 56's scale and sequence test, its design read from docs/prereg/fact-scale.toml: 1 to 1,000 facts edited
    at once and 100 one after another; locality at 1,000 vs at 10 on the same reserved probes (`fact_scale.py`;
    days of one core: each unit is cached and resumed).""",
                    run=lambda o: main(["test"] + options_argv(o)), table=markdown, plot=plot,
                    plot_file="fact-scale.png", section="14", in_all=False))


def cli(argv: list[str] | None = None) -> None:
    """`main` as a command (runs.run_cli: an `ExperimentError` is one line and exit status 2)."""
    run_cli(main, argv)


if __name__ == "__main__":
    cli()
