"""Fact editing in the memory: change only the table rows a prompt addresses, ship them as an overlay.

Engram's rows are addressed by token ids alone, so the rows a prompt reads are known before the
model runs, and so is every other n-gram that reads them (the hash spec says so). `edit_facts`
optimizes exactly those rows, everything else frozen, and returns an `Overlay`: row ids, new rows,
and the digests of the hash manifest and of the model it was made for. `apply_overlay` puts it in
front of the tables at gather time (any backend: parameter, RAM, memory-mapped file, shards);
the table is never rewritten, and taking the overlay off is the undo.

    facts = engram.edit.read_facts("facts.jsonl", tokenizer)   # {"prompt": ..., "target": ...} per line
    overlay = engram.edit_facts(model, tokenizer, facts)        # -> Overlay (rows, values, digests)
    overlay.save("out/overlay");  engram.apply_overlay(model, engram.Overlay.load("out/overlay"))

Which rows (`positions`, `orders`):
  * "trigger" (default): the rows read at the positions whose outputs predict the target tokens
    (the prompt's last token and every target token but the last), highest n-gram order only
    (`orders=None`): the n-grams that end the prompt, which carry the prompt's own tokens (an
    entity name) rather than a common pair like " lives in"; the fewest rows shared with other text;
  * "all": the rows read at every prompt and target position (more capacity, more collisions).

The report (`edit_report`) measures efficacy (greedy decoding produces the target), generalization
(paraphrases, the prompt inside a longer passage), the collision set (`collision_set`: every
position of a text whose n-gram reads an edited row, exact from the hash spec) and locality: the
validation logits of every position that neither reads an edited row nor attends to one are
compared bit for bit with and without the overlay (`locality`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .adapter import generation_pad_id
from .hashing import identity_digest, legacy_identity_digest
from .manifest import IntegrityError, verify_manifest, write_manifest
from .persist import recover_dir, replace_dir, temp_dir_for
from .memory import Engram, is_table_key
from .tables.base import find_tables
from .tables.overlay import OverlayTable, overlays_of, push_overlay, remove_overlays, restore_table

__all__ = ["EditError", "Fact", "Overlay", "apply_overlay", "applied", "check_overlay", "collision_set", "conflicts", "shared_rows",
           "edit_facts", "edit_report", "edit_rows", "engram_layers", "fact_report", "hash_mapping", "locality",
           "model_digest", "print_report", "read_facts", "remove_overlays", "score", "spec_digest"]

FORMAT = "engram-overlay/1"
WEIGHTS, META = "overlay.safetensors", "overlay.json"


class EditError(ValueError):
    """A fact, an overlay or the model it is applied to is not usable; the message names the fix."""


# ------------------------------------------------------------------------------------------ facts
@dataclass
class Fact:
    """One fact: `prompt` followed by `target` (may be several tokens). `paraphrases`: other prompts that
    should produce the same target; `passages`: longer texts that end where the target should follow."""

    prompt: str
    target: str
    paraphrases: list[str] = field(default_factory=list)
    passages: list[str] = field(default_factory=list)


_FACT_KEYS = {"prompt", "target", "paraphrases", "passages"}


def parse_fact(obj, where: str, tokenizer=None) -> Fact:
    """A `Fact` from a JSON object; `tokenizer` (optional) also checks that prompt and target tokenize to something."""
    if not isinstance(obj, dict):
        raise EditError(f"{where}: expected a JSON object with 'prompt' and 'target', got {type(obj).__name__}")
    unknown = set(obj) - _FACT_KEYS
    if unknown:
        raise EditError(f"{where}: unknown keys {sorted(unknown)}; a fact has {sorted(_FACT_KEYS)}")
    for key in ("prompt", "target"):
        v = obj.get(key)
        if not isinstance(v, str) or not v.strip():
            raise EditError(f"{where}: '{key}' is missing or empty; every fact needs a non-empty prompt and target")
    for key in ("paraphrases", "passages"):
        v = obj.get(key, [])
        if not isinstance(v, list) or not all(isinstance(s, str) and s.strip() for s in v):
            raise EditError(f"{where}: '{key}' must be a list of non-empty strings")
    fact = Fact(obj["prompt"], obj["target"], list(obj.get("paraphrases", [])), list(obj.get("passages", [])))
    if tokenizer is not None:
        if not _encode(tokenizer, fact.prompt):
            raise EditError(f"{where}: the prompt {fact.prompt!r} tokenizes to nothing")
        if not _encode(tokenizer, fact.target):
            raise EditError(f"{where}: the target {fact.target!r} tokenizes to nothing")
    return fact


def read_facts(path, tokenizer=None) -> list[Fact]:
    """Facts from a JSONL file (one `{"prompt": ..., "target": ...}` per line; blank lines skipped)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--facts {path}: no such file (one JSON object per line: "
                                '{"prompt": "...", "target": "..."})')
    facts = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise EditError(f"{p}:{n}: not JSON ({e.msg})") from None
        facts.append(parse_fact(obj, f"{p}:{n}", tokenizer))
    if not facts:
        raise EditError(f"{p}: no facts (one JSON object per line)")
    return facts


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


# ------------------------------------------------------------------------------------------ the model's memory
def engram_layers(model) -> dict:
    """{layer_id: MultiHeadEmbedding} of every Engram layer in `model` (an engram model or an adapted base)."""
    layers = {mhe.layer_id: mhe for _, mhe in find_tables(model)}
    if not layers:
        raise EditError("this model has no Engram layers: editing writes Engram table rows "
                        "(train with Engram, or attach an adapter)")
    return layers


def hash_mapping(model):
    """The `NgramHashMapping` of `model`'s Engram layers."""
    for m in model.modules():
        if isinstance(m, Engram):
            return m.hash_mapping
    raise EditError("this model has no Engram layers")


def spec_digest(mapping) -> str:
    """sha256 of what decides which row an n-gram reads (`NgramHashMapping.spec_digest`)."""
    return mapping.spec_digest()


def _rows_of(mhe) -> torch.Tensor:
    """Every `step`-th row of a layer's base table (overlays bypassed), float32: the digest's sample."""
    n = mhe.num_rows
    ids = torch.arange(0, n, max(1, n // 4096), dtype=torch.long)
    base = mhe.table
    while isinstance(base, OverlayTable):
        base = base.base
    with torch.no_grad():
        return (mhe if base is None else base).lookup(ids).float()


def model_digest(model) -> str:
    """sha256 of a model's weights as an overlay depends on them: every dense weight in full, and 4,096
    rows spread over each Engram table (read through its table, so any backend gives the same digest)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if is_table_key(name) or not torch.is_floating_point(t):
            continue
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    for lid, mhe in sorted(engram_layers(model).items()):
        h.update(f"table{lid}:{mhe.num_rows}x{mhe.dim}".encode())
        h.update(_rows_of(mhe).numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def frozen(model):
    """Every parameter of `model` without gradient (restored after), eval mode."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was = model.training
    for p, _ in flags:
        p.requires_grad_(False)
    model.eval()
    try:
        yield model
    finally:
        for p, f in flags:
            p.requires_grad_(f)
        model.train(was)


# ------------------------------------------------------------------------------------------ overlays
@dataclass
class Overlay:
    """Edited rows per Engram layer: `rows[layer]` (R,) int64 table row ids, `values[layer]` (R, d) float32;
    `meta`: the digests it was made for (`hash_spec_sha256`, `base_digest`), facts, settings, report."""

    rows: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    meta: dict

    @property
    def num_rows(self) -> int:
        return sum(int(r.numel()) for r in self.rows.values())

    def save(self, directory, extra_files: dict[str, str] | None = None) -> Path:
        """Write DIR/overlay.safetensors, overlay.json (+ `extra_files` {name: text}, e.g. the report) and a
        checksum manifest, atomically: into a temp folder that `persist.replace_dir` moves into place."""
        from safetensors.torch import save_file

        d = Path(directory)
        tmp = temp_dir_for(d)
        tensors = {}
        for lid in sorted(self.rows):
            tensors[f"layer{lid}.rows"] = self.rows[lid].to(torch.long).contiguous()
            tensors[f"layer{lid}.values"] = self.values[lid].detach().float().contiguous()
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": FORMAT})
        (tmp / META).write_text(json.dumps({"format": FORMAT, **self.meta}, indent=1) + "\n", encoding="utf-8")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        write_manifest(tmp)
        return replace_dir(tmp, d)

    @classmethod
    def load(cls, directory) -> "Overlay":
        """Read and verify an overlay folder (checksums, format, shapes); one-line errors."""
        from safetensors.torch import load_file

        d = Path(directory)
        recover_dir(d)
        if not (d / META).is_file() or not (d / WEIGHTS).is_file():
            raise FileNotFoundError(f"--overlay {directory}: no overlay here (expected {META} and {WEIGHTS}, "
                                    "written by engram edit)")
        fix = "re-run engram edit to write it again"
        verify_manifest(d, fix=fix)  # without a manifest (written by hand): one warning, still loads
        try:
            meta = json.loads((d / META).read_text(encoding="utf-8"))
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            tensors = load_file(str(d / WEIGHTS))
        except Exception as e:
            raise IntegrityError(f"{d}: corrupt overlay ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                                 f"{fix}") from None
        rows, values = {}, {}
        for lid in meta.get("layers", []):
            r, v = tensors.get(f"layer{lid}.rows"), tensors.get(f"layer{lid}.values")
            if r is None or v is None or r.dim() != 1 or v.dim() != 2 or v.shape[0] != r.numel():
                raise IntegrityError(f"{d}: layer {lid}'s rows are missing or misshapen; {fix}")
            rows[int(lid)], values[int(lid)] = r, v
        meta.pop("format", None)
        meta["path"] = str(d)
        return cls(rows, values, meta)


def check_overlay(model, overlay: Overlay, where: str = "overlay", digest: str | None = None) -> None:
    """Refuse an overlay made for another hash manifest or another model (one line naming the fix).

    `digest`: `model_digest(model)` when the caller checks several overlays against one model.
    """
    where = overlay.meta.get("path", where)
    mapping = hash_mapping(model)
    spec = mapping.spec(include_lookup_table=False)  # overlays written before 0.2 recorded the legacy digest
    if overlay.meta.get("hash_spec_sha256") not in (identity_digest(spec), legacy_identity_digest(spec)):
        raise EditError(f"{where} was made for another hash manifest (tokenizer or hash constants differ): its "
                        "row ids would address other n-grams; apply it to the model it was made for")
    if overlay.meta.get("base_digest") != (digest or model_digest(model)):
        raise EditError(f"{where} was made for another checkpoint (the model's weights differ from the ones it was "
                        f"optimized on: {overlay.meta.get('base', '?')}); re-run engram edit on this model")
    layers = engram_layers(model)
    missing = sorted(set(overlay.rows) - set(layers))
    if missing:
        raise EditError(f"{where} edits Engram layers {missing}, this model has {sorted(layers)}")


def apply_overlay(model, overlay: Overlay | str | os.PathLike, check: bool = True):
    """Put `overlay` (an `Overlay` or its folder) in front of `model`'s tables; returns the model.

    Applied overlays stack: the last one wins on rows two overlays change. `remove_overlays(model)`
    takes them all off. `check` refuses an overlay made for another model or hash manifest.
    """
    if not isinstance(overlay, Overlay):
        overlay = Overlay.load(overlay)
    if check:
        check_overlay(model, overlay)
    layers = engram_layers(model)
    name = overlay.meta.get("path", "overlay")
    for lid in sorted(overlay.rows):
        push_overlay(layers[lid], overlay.rows[lid], overlay.values[lid], name=name)
    return model


@contextlib.contextmanager
def applied(model, overlay: Overlay, check: bool = False):
    """`overlay` on `model` inside the block, off after it (other overlays untouched)."""
    layers = engram_layers(model)
    before = {lid: mhe.table for lid, mhe in layers.items()}
    apply_overlay(model, overlay, check=check)
    try:
        yield model
    finally:
        _restore_tables(layers, before)


def _restore_tables(layers: dict, before: dict) -> None:
    for lid, mhe in layers.items():
        restore_table(mhe, before[lid])


# ------------------------------------------------------------------------------------------ editing
def _sequences(tokenizer, facts: list[Fact]) -> list[tuple[list[int], list[int]]]:
    out = []
    for i, f in enumerate(facts):
        p, t = _encode(tokenizer, f.prompt), _encode(tokenizer, f.target)
        if not p:
            raise EditError(f"fact {i + 1}: the prompt {f.prompt!r} tokenizes to nothing")
        if not t:
            raise EditError(f"fact {i + 1}: the target {f.target!r} tokenizes to nothing")
        out.append((p, t))
    return out


def _batch(seqs: list[list[int]], pad: int) -> torch.Tensor:
    T = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (T - len(s)) for s in seqs], dtype=torch.long)  # (B, T), right-padded


def _order_columns(mapping, orders) -> list[int]:
    """Hash-id columns (heads) of the chosen n-gram orders; columns run order 2..N, K heads each."""
    N, K = mapping.max_ngram_size, mapping.n_head_per_ngram
    orders = [N] if orders is None else sorted(set(int(o) for o in orders))
    bad = [o for o in orders if not 2 <= o <= N]
    if bad:
        raise EditError(f"orders {bad} do not exist: this model hashes n-grams of orders 2..{N}")
    return [(o - 2) * K + k for o in orders for k in range(K)]


def _fact_rows(model, tokenizer, facts: list[Fact], positions: str = "trigger", orders=None) -> list[dict]:
    """Per fact: {layer: (P, h) table rows} read at its edited positions (P), in the chosen orders' h heads,
    and `next`: the token each of those positions must predict (-1 for prompt positions under "all")."""
    if positions not in ("trigger", "all"):
        raise EditError(f"positions must be 'trigger' or 'all', got {positions!r}")
    mapping = hash_mapping(model)
    layers = engram_layers(model)
    cols = _order_columns(mapping, orders)
    out = []
    for p, t in _sequences(tokenizer, facts):
        seq = p + t
        hashed = mapping.hash(np.asarray([seq], dtype=np.int64))
        where = list(range(len(p) - 1 if positions == "trigger" else 0, len(seq) - 1))
        rec = {"next": [seq[i + 1] if i >= len(p) - 1 else -1 for i in where]}
        for lid, mhe in layers.items():
            flat = mhe.table_rows(hashed[lid][0])  # (T, H) table rows
            rec[lid] = flat[where][:, cols]  # (P, h)
        out.append(rec)
    return out


def edit_rows(model, tokenizer, facts: list[Fact], positions: str = "trigger", orders=None) -> dict[int, torch.Tensor]:
    """{layer: sorted distinct table row ids (R,)} that editing `facts` changes (see the module doc)."""
    recs = _fact_rows(model, tokenizer, facts, positions, orders)
    return {lid: torch.unique(torch.cat([r[lid].reshape(-1) for r in recs])) for lid in engram_layers(model)}


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


def _target_logprobs(model, ids: torch.Tensor, seqs) -> list[torch.Tensor]:
    """Per fact, log p(target token j | prompt, target[:j]) for each target token: list of (len(t),)."""
    logits = model(ids).logits.float()  # (B, T, V)
    logp = F.log_softmax(logits, dim=-1)
    out = []
    for b, (p, t) in enumerate(seqs):
        pos = torch.arange(len(p) - 1, len(p) + len(t) - 1)
        out.append(logp[b, pos, torch.tensor(t)])
    return out


def edit_facts(model, tokenizer, facts: list[Fact], steps: int = 300, lr: float = 0.1, positions: str = "trigger",
               orders=None, target_prob: float = 0.9, progress: bool = True) -> Overlay:
    """Optimize only the rows `facts` address (`edit_rows`) so that each prompt is followed by its target.

    Every fact is one sequence `prompt + target` of a batch; the loss is the mean over facts of the
    mean negative log-probability of the target tokens; Adam on the new rows, the model frozen. Stops
    when every target token has probability >= `target_prob` and is the argmax (greedy decoding
    produces it), or after `steps`. Returns the `Overlay` (not applied).
    """
    if not facts:
        raise EditError("no facts to edit")
    if not 0.5 < target_prob < 1:
        raise EditError(f"target_prob must lie in (0.5, 1), got {target_prob}: above 0.5 a token is the argmax")
    layers = engram_layers(model)
    mapping = hash_mapping(model)
    seqs = _sequences(tokenizer, facts)
    rows = edit_rows(model, tokenizer, facts, positions, orders)
    ids = _batch([p + t for p, t in seqs], generation_pad_id(model))
    t0 = time.perf_counter()
    values, log = {}, []
    with frozen(model):
        before = {lid: mhe.table for lid, mhe in layers.items()}
        try:
            for lid, r in rows.items():
                with torch.no_grad():
                    start = (layers[lid].table or layers[lid]).lookup(r).float().clone()  # (R, d) current rows
                values[lid] = torch.nn.Parameter(start)
                push_overlay(layers[lid], r, values[lid], name="edit")
            opt = torch.optim.Adam(list(values.values()), lr=lr)
            step = 0
            for step in range(1, steps + 1):
                lps = _target_logprobs(model, ids, seqs)
                loss = torch.stack([lp.mean() for lp in lps]).mean().neg()
                done = sum(bool((lp.detach().exp() >= target_prob).all()) for lp in lps)
                log.append({"step": step - 1, "loss": loss.item(), "facts_done": done})
                if progress and (step == 1 or step % 25 == 0):
                    print(f"edit step {step - 1:>4}: target NLL {loss.item():.4f}, facts at target {done}/{len(facts)}",
                          file=sys.stderr, flush=True)
                if done == len(facts):
                    step -= 1
                    break
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        finally:
            _restore_tables(layers, before)
    seconds = time.perf_counter() - t0
    meta = {
        "hash_spec_sha256": spec_digest(mapping), "base_digest": model_digest(model),
        "layers": sorted(rows), "facts": [f.__dict__ for f in facts],
        "settings": {"steps": steps, "lr": lr, "positions": positions,
                     "orders": sorted(set(orders)) if orders else [mapping.max_ngram_size], "target_prob": target_prob},
        "optimization": {"steps_run": step, "seconds": round(seconds, 3), "final_loss": log[-1]["loss"],
                         "facts_at_target": log[-1]["facts_done"]},
        "stacked_on": sorted({o.name for mhe in layers.values() for o in overlays_of(mhe)}),
    }
    return Overlay({lid: r for lid, r in rows.items()}, {lid: v.detach().clone() for lid, v in values.items()}, meta)


# ------------------------------------------------------------------------------------------ measuring an edit
@torch.no_grad()
def score(model, tokenizer, prompt: str, target: str) -> dict:
    """Target probability after `prompt` (first token, whole target) and whether greedy decoding produces it."""
    p, t = _encode(tokenizer, prompt), _encode(tokenizer, target)
    ids = torch.tensor([p + t])
    lp = _target_logprobs(model, ids, [(p, t)])[0]  # (len(t),)
    out = model.generate(torch.tensor([p]), max_new_tokens=len(t), do_sample=False,
                         pad_token_id=generation_pad_id(model))
    produced = out[0, len(p):].tolist()
    return {"p_first": float(lp[0].exp()), "p_target": float(lp.sum().exp()), "greedy": produced == t,
            "generated": tokenizer.decode(produced)}


def fact_report(model, tokenizer, facts: list[Fact], overlay: Overlay) -> list[dict]:
    """Per fact, before and after `overlay`: the prompt, each paraphrase and each passage, scored (`score`)."""
    def all_scores():
        rows = []
        for f in facts:
            rows.append({"prompt": score(model, tokenizer, f.prompt, f.target),
                         "paraphrases": [score(model, tokenizer, q, f.target) for q in f.paraphrases],
                         "passages": [score(model, tokenizer, q, f.target) for q in f.passages]})
        return rows

    before = all_scores()
    with applied(model, overlay):
        after = all_scores()
    return [{"prompt": f.prompt, "target": f.target, "before": b, "after": a} for f, b, a in zip(facts, before, after)]


def table_rows_read(model, windows: np.ndarray, chunk: int = 64) -> dict[int, torch.Tensor]:
    """{layer: (W, T, H) table row ids} the model reads for each position of `windows` (hash + head offsets)."""
    mapping, layers = hash_mapping(model), engram_layers(model)
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
    mapping = hash_mapping(model)
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
def locality(model, overlay: Overlay, windows: np.ndarray, direct: torch.Tensor, batch_size: int = 16) -> dict:
    """Validation loss with and without `overlay`, and the bit-for-bit check outside its reach.

    `direct` (W, T): positions that read an edited row (`collision_set`). A prediction at position t
    depends on rows read at positions <= t (attention, short conv), so the overlay can change it only
    when some position <= t in its window is in `direct` (`affected`); every other position's logits
    must be identical with and without the overlay, and are compared exactly.
    """
    affected = direct.cumsum(dim=1) > 0  # (W, T)
    sums = {k: [0.0, 0.0, 0] for k in ("all", "outside", "affected", "direct")}  # loss before, after, tokens
    changed_outside = 0
    for i in range(0, len(windows), batch_size):
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
                batch_size: int = 16) -> dict:
    """Efficacy, generalization, collision set and locality of `overlay` on `model` (see the module doc)."""
    per_fact = fact_report(model, tokenizer, facts, overlay)
    clash = conflicts(model, tokenizer, facts, overlay.meta.get("settings", {}).get("orders"))
    coll = collision_set(model, overlay, windows, tokenizer)
    loc = locality(model, overlay, windows, coll.pop("mask"), batch_size)

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
    return {"summary": summary, "facts": per_fact, "conflicts": clash, "collisions": coll, "locality": loc,
            "optimization": overlay.meta.get("optimization", {})}


def print_report(report: dict, file=None) -> None:
    """The per-fact table and the summary lines of `edit_report`'s result (to `file`, default stdout)."""
    file = sys.stdout if file is None else file
    pf = report["facts"]
    w = min(40, max(len(r["prompt"]) for r in pf))
    print(f"{'prompt':<{w}} {'target':<14} {'p before':>9} {'p after':>8} {'greedy':>7} {'paraphr.':>9} {'passage':>8}",
          file=file)
    for r in pf:
        a = r["after"]
        para = f"{sum(s['greedy'] for s in a['paraphrases'])}/{len(a['paraphrases'])}" if a["paraphrases"] else "-"
        pas = f"{sum(s['greedy'] for s in a['passages'])}/{len(a['passages'])}" if a["passages"] else "-"
        prompt = r["prompt"] if len(r["prompt"]) <= w else r["prompt"][: w - 3] + "..."
        print(f"{prompt:<{w}} {r['target'][:14]:<14} {r['before']['prompt']['p_target']:>9.4f} "
              f"{a['prompt']['p_target']:>8.4f} {'yes' if a['prompt']['greedy'] else 'no':>7} {para:>9} {pas:>8}",
              file=file)
    s, c, loc, o = report["summary"], report["collisions"], report["locality"], report["optimization"]

    def pct(x):
        return "n/a" if x is None else f"{x:.0%}"

    print(f"efficacy: greedy produces the target for {pct(s['greedy_after'])} of {s['facts']} facts (before "
          f"{pct(s['greedy_before'])}); mean target probability {s['p_target_before']:.4f} -> {s['p_target_after']:.4f}",
          file=file)
    print(f"generalization: paraphrases {pct(s['paraphrases_greedy_after'])} of {s['paraphrases_count']}, "
          f"in a passage {pct(s['passages_greedy_after'])} of {s['passages_count']}", file=file)
    if report["conflicts"]:
        pairs = "; ".join(f"{pf[a]['prompt']!r} / {pf[b]['prompt']!r}" for a, b in (c["facts"] for c in report["conflicts"][:3]))
        print(f"conflicts: {s['facts_in_conflict']} facts end in the same n-gram as a fact with another target, so they "
              f"share rows and cannot all be served ({pairs}{'; ...' if len(report['conflicts']) > 3 else ''}); put the "
              "entity within the prompt's last n-gram", file=file)
    print(f"rows changed: {s['rows_changed']:,} ({s['rows_per_fact']:.1f} per fact); edit took "
          f"{o.get('seconds', float('nan')):.1f} s, {o.get('steps_run', '?')} steps", file=file)
    print(f"collision set: {c['positions']:,} of {c['tokens']:,} validation positions read an edited row "
          f"({c['distinct_ngrams']:,} distinct n-grams); {loc['affected']['tokens']:,} predictions attend to one",
          file=file)
    la, lo = loc["all"], loc["outside"]
    print(f"validation loss: all tokens {la['loss_before']:.5f} -> {la['loss_after']:.5f} ({la['change']:+.5f}); "
          f"outside the collision set {lo['loss_before']:.5f} -> {lo['loss_after']:.5f}, "
          f"{loc['changed_outside']} logits rows changed (must be 0)", file=file)
