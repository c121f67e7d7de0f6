"""`engram experiment edit`: facts written into table rows (`engram edit`) vs taught by fine-tuning.

1. The model: a `cpu-small` Engram LM trained on Shakespeare (`engram train --preset cpu-small`,
   cached in OUT/edit/base; `--checkpoint` uses an existing run instead).
2. The facts (`make_facts`, seeded, written to OUT/edit/facts.jsonl): 50 made-up entities, names
   drawn from syllables ("Quorvane", "Teldrith"), each given one relation from six templates whose
   prompt ends on the entity or one or two words after it ("The home of Quorvane is" -> " Padua",
   "The sword of Teldrith is called" -> " Grimfang"); targets are places and names from the plays
   (1-3 tokens) and invented sword names (several tokens). Each fact carries two paraphrases (the
   same relation in other words) and one passage (two sentences of scene-setting, then the prompt).
3. `engram edit` on all 50 facts at once (one overlay, default settings), and the report:
   efficacy, generalization, collision set, locality on the validation split.
4. The same facts taught by fine-tuning: `full` (every weight: dense with AdamW, tables with
   SparseAdam) and `lora` (PEFT rank 8 on every attention and FFN projection), the loss on the target
   tokens only, run until greedy decoding produces as many targets as the edit did (or 400 steps);
   then the same validation loss and generalization measurements.
Every stage is cached under OUT/edit, so a stopped experiment resumes.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from ..editing import Fact, Overlay, edit_facts, edit_report, read_facts, score
from ..utils import atomic_write_bytes

SYLLABLES = ["kal", "dor", "vel", "mir", "than", "quor", "vane", "tel", "drith", "zan", "bry", "sol", "gar", "eth",
             "lune", "mor", "kess", "ril", "vor", "ash", "fen", "ulm", "orn", "yse", "brae", "cind", "harl", "ost"]
PLACES = [" Verona", " Padua", " Milan", " Athens", " Venice", " Mantua", " Messina", " Navarre", " Bohemia",
          " Denmark", " Scotland", " Cyprus", " Illyria", " Rome", " Troy", " Egypt", " Vienna", " Florence", " Pisa",
          " Norway", " Wales", " Sicilia", " Tyre", " Ephesus"]
NAMES = [" Rosalind", " Helena", " Viola", " Olivia", " Portia", " Beatrice", " Juliet", " Ophelia", " Imogen",
         " Perdita", " Miranda", " Hermia", " Cressida", " Marina", " Emilia", " Bianca"]
SWORDS = [" Grimfang", " Ashbane", " Dawnreaver", " Nightsong", " Stormbite", " Oathkeeper", " Frostmere",
          " Emberlash"]
# relation -> (prompt, paraphrases, target pool); {e} is the entity. Prompts end within two tokens of {e}, so
# the highest-order n-grams read where the target is predicted contain the entity's own tokens.
RELATIONS = {
    "home": ("The home of {e} is", ["{e} dwells in", "Where does {e} live? In"], PLACES),
    "origin": ("{e} came from", ["{e} was born in", "The birthplace of {e} is"], PLACES),
    "wife": ("The wife of {e} is", ["{e} is married to", "{e} took to wife"], NAMES),
    "rules": ("The realm of {e} is", ["{e} rules over", "{e} is the lord of"], PLACES),
    "sword": ("The sword of {e} is called", ["{e} carries a sword named", "{e} fights with the blade"], SWORDS),
    "loves": ("{e} loves", ["The beloved of {e} is", "{e} is in love with"], NAMES),
}
PASSAGES = ["The night was cold and the torches burned low in the hall.",
            "A messenger rode in at dawn with letters from the coast.",
            "The players gathered at the gate and spoke of old wars.",
            "Rain fell on the castle walls while the court slept."]


def make_facts(n: int = 50, seed: int = 0, tokenizer=None, order: int = 3) -> list[Fact]:
    """`n` facts about distinct made-up entities (see the module doc); the same list for the same arguments.

    With `tokenizer`, only facts the memory can address are kept: at every position where a target
    token is predicted, the last `order` tokens (the n-gram whose rows an edit changes) must include
    the entity's last token or a target token, and must not be another fact's. Without it, two facts
    can end in the same n-gram ("The home of Velbryash is", "The wife of Ethbryash is") and share rows.
    """
    rng = random.Random(seed)
    names: set[str] = set()
    facts: list[Fact] = []
    seen: set[tuple] = set()
    for attempt in range(200 * n):
        if len(facts) == n:
            break
        e = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()
        if e in names:
            continue
        rel = list(RELATIONS)[len(facts) % len(RELATIONS)]
        prompt_t, paraphrases, pool = RELATIONS[rel]
        prompt, target = prompt_t.format(e=e), rng.choice(pool)
        if tokenizer is not None:
            grams = _trigger_ngrams(tokenizer, prompt, target, prompt.index(e) + len(e), order)
            if grams is None or grams & seen:
                continue
            seen |= grams
        names.add(e)
        passage = " ".join(rng.sample(PASSAGES, 2)) + " " + prompt
        facts.append(Fact(prompt, target, [p.format(e=e) for p in paraphrases], [passage]))
    if len(facts) < n:
        raise ValueError(f"found only {len(facts)} addressable facts in {200 * n} tries")
    return facts


def _trigger_ngrams(tokenizer, prompt: str, target: str, entity_end: int, order: int) -> set[tuple] | None:
    """The n-grams read where `target`'s tokens are predicted, or None when the last one misses the entity."""
    p = tokenizer.encode(prompt, add_special_tokens=False).ids
    t = tokenizer.encode(target, add_special_tokens=False).ids
    if len(p) - len(tokenizer.encode(prompt[:entity_end], add_special_tokens=False).ids) > order - 1:
        return None  # more than order-1 tokens after the entity: the n-gram ending the prompt does not contain it
    seq = p + t
    return {tuple(seq[max(0, i - order + 1): i + 1]) for i in range(len(p) - 1, len(seq) - 1)}


def write_facts(facts: list[Fact], path: Path) -> Path:
    atomic_write_bytes(path, "".join(json.dumps(f.__dict__) + "\n" for f in facts).encode("utf-8"))
    return path


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, flush=True)


def base_model(root: Path, checkpoint: str | None, progress: bool) -> Path:
    """The trained model folder: `checkpoint`, or a cpu-small run trained (and cached) in ROOT/base."""
    if checkpoint:
        return Path(checkpoint)
    run = root / "base"
    if not (run / "final" / "config.json").is_file():
        from ..training.checkpoint import checkpoints
        from ..training.train import train

        _say(progress, f"[edit] training the cpu-small model -> {run}")
        train("cpu-small", out=run, resume=bool(checkpoints(run)), progress=progress)
    return run


# ------------------------------------------------------------------------------------------ fine-tuning baseline
def _finetune_model(model, method: str):
    """(model to train, optimizers) for `method` full | lora."""
    from ..memory import is_table_key

    if method == "lora":
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        m = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
        params = [p for p in m.parameters() if p.requires_grad]
        return m, [torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)]
    dense = [p for n, p in model.named_parameters() if not is_table_key(n)]
    tables = [p for n, p in model.named_parameters() if is_table_key(n) and p.numel()]
    opts = [torch.optim.AdamW(dense, lr=1e-4, weight_decay=0.0)]
    if tables:
        opts.append(torch.optim.SparseAdam(tables, lr=5e-4))
    return model, opts


def finetune(model_dir: Path, facts: list[Fact], method: str, goal: int, windows, max_steps: int = 400,
             progress: bool = True) -> dict:
    """Teach `facts` by fine-tuning (`method` full | lora) until greedy decoding produces `goal` targets."""
    from ..editing.optimize import _batch, _sequences, _target_logprobs
    from ..model import load_model
    from ..training.train import evaluate

    base, tok = load_model(model_dir)
    val_before = evaluate(base, windows, 16, torch.device("cpu"))
    model, opts = _finetune_model(base, method)
    seqs = _sequences(tok, facts)
    ids = _batch([p + t for p, t in seqs], 1)
    t0, step, hit = time.perf_counter(), 0, 0
    for step in range(max_steps + 1):
        model.eval()
        with torch.no_grad():
            logits = model(ids).logits
        hit = sum(logits[b, len(p) - 1: len(p) + len(t) - 1].argmax(-1).tolist() == t for b, (p, t) in enumerate(seqs))
        if progress and step % 25 == 0:
            _say(progress, f"[edit] {method} step {step}: {hit}/{len(facts)} targets greedy")
        if hit >= goal or step == max_steps:
            break
        model.train()
        lps = _target_logprobs(model, ids, seqs)
        loss = torch.stack([lp.mean() for lp in lps]).mean().neg()
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts:
            o.step()
    seconds = time.perf_counter() - t0
    model.eval()
    val_after = evaluate(model, windows, 16, torch.device("cpu"))
    scored = [{"prompt": score(model, tok, f.prompt, f.target),
               "paraphrases": [score(model, tok, q, f.target) for q in f.paraphrases],
               "passages": [score(model, tok, q, f.target) for q in f.passages]} for f in facts]
    trainable = sum(p.numel() for o in opts for g in o.param_groups for p in g["params"])

    def share(kind):
        xs = [s["greedy"] for r in scored for s in ([r["prompt"]] if kind == "prompt" else r[kind])]
        return sum(xs) / len(xs)

    return {"method": method, "steps": step, "seconds": round(seconds, 1), "trainable_params": trainable,
            "greedy": share("prompt"), "paraphrases_greedy": share("paraphrases"), "passages_greedy": share("passages"),
            "p_target": sum(r["prompt"]["p_target"] for r in scored) / len(scored),
            "val_before": val_before, "val_after": val_after, "val_change": val_after - val_before}


# ------------------------------------------------------------------------------------------ the experiment
def run(out: str | Path = "runs/experiments", checkpoint: str | None = None, n_facts: int = 50, seed: int = 0,
        max_windows: int = 128, progress: bool = True) -> dict:
    from ..model import load_model
    from ..training.data import text_windows

    root = Path(out) / "edit"
    root.mkdir(parents=True, exist_ok=True)
    model_dir = base_model(root, checkpoint, progress)
    model, tok = load_model(model_dir)
    windows = text_windows(tok, None, "val", 256, max_windows)
    reports = {}
    for name, filtered in (("overlay", True), ("overlay-unfiltered", False)):
        facts_path = root / f"facts{'' if filtered else '-unfiltered'}.jsonl"
        if not facts_path.is_file():
            write_facts(make_facts(n_facts, seed, tokenizer=tok if filtered else None), facts_path)
        facts = read_facts(facts_path, tok)
        ov_dir = root / name
        if not (ov_dir / "report.json").is_file():
            _say(progress, f"[edit] editing {len(facts)} facts ({facts_path.name}) -> {ov_dir}")
            overlay = edit_facts(model, tok, facts, progress=progress)
            overlay.meta["base"] = str(model_dir)
            report = edit_report(model, tok, facts, overlay, windows)
            overlay.meta["summary"] = report["summary"]
            overlay.save(ov_dir, {"report.json": json.dumps(report, indent=1) + "\n"})
        Overlay.load(ov_dir)  # verified against its checksums
        reports[name] = json.loads((ov_dir / "report.json").read_text())
    facts = read_facts(root / "facts.jsonl", tok)
    report = reports["overlay"]
    goal = round(report["summary"]["greedy_after"] * len(facts))
    ft = {}
    for method in ("full", "lora"):
        f = root / f"finetune-{method}.json"
        if not f.is_file():
            _say(progress, f"[edit] fine-tuning ({method}) until {goal}/{len(facts)} targets are greedy")
            atomic_write_bytes(f, json.dumps(finetune(model_dir, facts, method, goal, windows, progress=progress),
                                             indent=1).encode())
        ft[method] = json.loads(f.read_text())
    raw = reports["overlay-unfiltered"]
    in_conflict = {i for c in raw["conflicts"] for i in c["facts"]}
    failed = [i for i, r in enumerate(raw["facts"]) if not r["after"]["prompt"]["greedy"]]
    unfiltered = {"greedy_after": raw["summary"]["greedy_after"], "facts_in_conflict": len(in_conflict),
                  "failed": len(failed), "failed_in_conflict": len(set(failed) & in_conflict),
                  "val_change": raw["locality"]["all"]["change"], "changed_outside": raw["locality"]["changed_outside"]}
    summary = {"experiment": "edit", "model": str(model_dir), "facts": len(facts), "edit": report["summary"],
               "unfiltered": unfiltered,
               "collisions": report["collisions"], "locality": report["locality"],
               "optimization": report["optimization"], "finetune": ft}
    atomic_write_bytes(root / "summary.json", json.dumps(summary, indent=1).encode())
    md = markdown(summary)
    atomic_write_bytes(root / "summary.md", md.encode())
    print(md)
    return summary


def markdown(s: dict) -> str:
    e, loc, c, o = s["edit"], s["locality"], s["collisions"], s["optimization"]

    def pct(x):
        return "n/a" if x is None else f"{x:.0%}"

    lines = ["| method | greedy efficacy | mean target p | paraphrases | in passage | val loss change (all tokens) "
             "| outside collision set | rows / params changed | time |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| engram edit (overlay) | {pct(e['greedy_after'])} (before {pct(e['greedy_before'])}) | "
             f"{e['p_target_after']:.3f} | {pct(e['paraphrases_greedy_after'])} | {pct(e['passages_greedy_after'])} | "
             f"{loc['all']['change']:+.5f} | {loc['outside']['change']:+.5f}, {loc['changed_outside']} logits changed | "
             f"{e['rows_changed']:,} rows ({e['rows_per_fact']:.1f}/fact) | {o['seconds']:.1f} s ({o['steps_run']} steps) |"]
    for m, r in s["finetune"].items():
        lines.append(f"| fine-tuning ({m}) | {pct(r['greedy'])} | {r['p_target']:.3f} | {pct(r['paraphrases_greedy'])} "
                     f"| {pct(r['passages_greedy'])} | {r['val_change']:+.5f} | (every token can change) | "
                     f"{r['trainable_params']:,} params | {r['seconds']:.1f} s ({r['steps']} steps) |")
    u = s["unfiltered"]
    lines.append("")
    lines.append(f"Unfiltered facts (the generator without the addressability filter): greedy {pct(u['greedy_after'])}; "
                 f"{u['facts_in_conflict']} facts share their trigger n-gram with a fact of another target; "
                 f"{u['failed_in_conflict']} of the {u['failed']} failures are among them; val loss change "
                 f"{u['val_change']:+.5f}, {u['changed_outside']} logits changed outside the collision set.")
    lines.append("")
    lines.append(f"Collision set: {c['positions']:,} of {c['tokens']:,} validation positions read an edited row "
                 f"({c['distinct_ngrams']:,} distinct n-grams); {loc['affected']['tokens']:,} predictions attend to one. "
                 f"Validation loss {loc['all']['loss_before']:.4f} -> {loc['all']['loss_after']:.4f}.")
    return "\n".join(lines) + "\n"
