"""The facts `engram experiment edit` writes and tests (`analysis/editing.py` runs the experiment).

- `make_facts`: made-up entities with made-up objects ("The home of Quorvane is" -> " Padua"), whose
  trigger n-grams the model has never seen;
- `world_facts`: (country, relation, object) triples from the PyPI wheel `countryinfo==1.0.1` (MIT), and
  `write_world_corpus`, the corpus that teaches them;
- `fact_sets`: one seeded set of counterfactuals over known facts, their neighbours, and new entities.
"""

from __future__ import annotations

import random
from pathlib import Path

from engram.editing import Fact
from engram.persist import atomic_write_bytes, decode_json_bytes, write_jsonl

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
    for _ in range(200 * n):
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
    write_jsonl(path, [f.__dict__ for f in facts])
    return path


# ------------------------------------------------------------------------------------------ world facts
COUNTRYINFO_WHEEL = "countryinfo==1.0.1"
# relation -> (field, prompt, two paraphrases); {s} is the country, the object follows the prompt
WORLD_RELATIONS = {
    "capital": ("capital", "The capital of {s} is", ["The capital city of {s} is", "{s} has its capital at"]),
    "subregion": ("subregion", "{s} is a country in", ["{s} lies in", "{s} is located in"]),
    "demonym": ("demonym", "The people of {s} are called", ["A person from {s} is called",
                                                             "The citizens of {s} are known as"]),
}


def world_facts() -> list[tuple[str, str, str]]:
    """(subject, relation, object) for every country of `countryinfo` with that field, sorted."""
    import zipfile

    from engram.training.corpora import cache_dir, fetch_package

    wheel = fetch_package(COUNTRYINFO_WHEEL, cache_dir() / "corpora" / "pypi-countryinfo-1.0.1")
    out = set()
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if not (name.startswith("countryinfo/data/") and name.endswith(".json")):
                continue
            d = decode_json_bytes(z.read(name), f"{wheel}: {name}", f"delete {wheel} to fetch it again")
            subj = (d.get("name") or "").strip()
            if not subj or len(subj) > 30:
                continue
            for rel, (key, _, _) in WORLD_RELATIONS.items():
                obj = d.get(key)
                if isinstance(obj, str) and obj.strip() and len(obj) <= 30:
                    out.add((subj, rel, " " + obj.strip()))
    if len(out) < 100:
        raise ValueError(f"{COUNTRYINFO_WHEEL}: only {len(out)} facts found; the wheel is damaged")
    return sorted(out)


def write_world_corpus(facts: list[tuple[str, str, str]], folder: Path, copies: int = 30) -> Path:
    """`copies` documents, each every fact in all three phrasings, one sentence per line, shuffled (seeded)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [t.format(s=s) + o + "." for s, rel, o in facts
             for t in [WORLD_RELATIONS[rel][1], *WORLD_RELATIONS[rel][2]]]
    for k in range(copies):
        rng = random.Random(k)
        shuffled = lines[:]
        rng.shuffle(shuffled)
        atomic_write_bytes(folder / f"world-{k:02d}.txt", ("\n".join(shuffled) + "\n").encode("utf-8"))
    return folder


def fact_sets(known: list[tuple[str, str, str]], all_facts: list[tuple[str, str, str]], n: int, seed: int,
              n_neighbours: int = 3) -> dict:
    """One seeded fact set: `n` counterfactuals over known facts (relations in turn, distinct subjects), each
    with `n_neighbours` known neighbours (same relation, another subject not edited), and `n` new entities."""
    rng = random.Random(seed)
    objects = {rel: sorted({o for _, r, o in all_facts if r == rel}) for rel in WORLD_RELATIONS}
    by_rel = {rel: [f for f in known if f[1] == rel] for rel in WORLD_RELATIONS}
    for lst in by_rel.values():
        rng.shuffle(lst)
    rels = [r for r in WORLD_RELATIONS if len(by_rel[r]) > n_neighbours + 1 and len(objects[r]) > 1]
    picked, used = [], set()
    while len(picked) < n and any(by_rel[r] for r in rels):
        for rel in rels:
            while by_rel[rel] and len(picked) < n:
                f = by_rel[rel].pop()
                if f[0] not in used:
                    picked.append(f)
                    used.add(f[0])
                    break
    cf, neighbours = [], []
    for s, rel, o in picked:
        _, prompt, paras = WORLD_RELATIONS[rel]
        new = rng.choice([x for x in objects[rel] if x != o])
        cf.append(Fact(prompt.format(s=s), new, [q.format(s=s) for q in paras], []))
        pool = [f for f in known if f[1] == rel and f[0] not in used]
        for ns, _, no in rng.sample(pool, min(n_neighbours, len(pool))):
            neighbours.append({"prompt": prompt.format(s=ns), "target": no, "edited": s, "relation": rel})
    return {"counterfactual": cf, "neighbours": neighbours, "new": make_facts(n, seed=seed, tokenizer=None),
            "counterfactual_true": [o for _, _, o in picked], "counterfactual_relation": [r for _, r, _ in picked]}
