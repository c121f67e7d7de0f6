"""Simple world facts a small pretrained model may know, for editing what it knows (issue 46, item 3).

`RELATIONS` lists (subject, object) pairs of four relations (capitals, official languages, currencies,
continents), each with its prompt, a chat question whose answer starts with the prompt, and a paraphrase.
`known_facts(model, tokenizer)` keeps the facts the model answers correctly by greedy decoding (it produces the
object's tokens after the prompt), which is what an edit of *known* knowledge starts from; `counterfactuals`
pairs each kept fact with another object of the same relation (seeded), the edit's target.

The pairs are common knowledge, written here by hand (no download); objects are single words or short names
without accents, so that one spelling of each is the answer the greedy check looks for.
"""

from __future__ import annotations

import random

from engram.editing import Fact

# relation -> (prompt, question, paraphrase, [(subject, object)]); {s} is the subject
RELATIONS = {
    "capital": ("The capital of {s} is", "What is the capital of {s}?", "{s}'s capital city is", [
        ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
        ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Greece", "Athens"),
        ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Argentina", "Buenos Aires"), ("Poland", "Warsaw"),
        ("Austria", "Vienna"), ("Sweden", "Stockholm"), ("Norway", "Oslo"), ("Denmark", "Copenhagen"),
        ("Finland", "Helsinki"), ("Ireland", "Dublin"), ("the Netherlands", "Amsterdam"), ("Belgium", "Brussels"),
        ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Kenya", "Nairobi"), ("Nigeria", "Abuja"),
        ("South Korea", "Seoul"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"),
        ("Peru", "Lima"), ("Chile", "Santiago"), ("Cuba", "Havana"), ("Hungary", "Budapest"),
        ("the Czech Republic", "Prague"), ("the Philippines", "Manila"), ("Pakistan", "Islamabad"),
        ("Saudi Arabia", "Riyadh"), ("England", "London"), ("Scotland", "Edinburgh"), ("Romania", "Bucharest"),
    ]),
    "language": ("The official language of {s} is", "What is the official language of {s}?",
                 "In {s}, people speak", [
        ("France", "French"), ("Germany", "German"), ("Italy", "Italian"), ("Spain", "Spanish"),
        ("Portugal", "Portuguese"), ("Japan", "Japanese"), ("Russia", "Russian"), ("Greece", "Greek"),
        ("Poland", "Polish"), ("Sweden", "Swedish"), ("Norway", "Norwegian"), ("Finland", "Finnish"),
        ("the Netherlands", "Dutch"), ("Turkey", "Turkish"), ("Brazil", "Portuguese"), ("Mexico", "Spanish"),
        ("Argentina", "Spanish"), ("Hungary", "Hungarian"), ("Denmark", "Danish"), ("Thailand", "Thai"),
        ("Vietnam", "Vietnamese"), ("Iran", "Persian"), ("Egypt", "Arabic"), ("South Korea", "Korean"),
        ("Israel", "Hebrew"), ("Ukraine", "Ukrainian"), ("Romania", "Romanian"),
    ]),
    "currency": ("The currency of {s} is the", "What is the currency of {s}?", "In {s}, people pay with the", [
        ("Japan", "yen"), ("the United Kingdom", "pound"), ("India", "rupee"), ("Russia", "ruble"),
        ("Mexico", "peso"), ("Switzerland", "franc"), ("Sweden", "krona"), ("South Africa", "rand"),
        ("Brazil", "real"), ("the United States", "dollar"), ("Turkey", "lira"), ("South Korea", "won"),
        ("Thailand", "baht"), ("Israel", "shekel"), ("Germany", "euro"), ("Italy", "euro"), ("France", "euro"),
        ("Spain", "euro"), ("Canada", "dollar"), ("Australia", "dollar"), ("Argentina", "peso"),
        ("Egypt", "pound"), ("Norway", "krone"), ("Denmark", "krone"),
    ]),
    "continent": ("{s} is a country in", "Which continent is {s} in?", "{s} is located in", [
        ("France", "Europe"), ("Germany", "Europe"), ("Italy", "Europe"), ("Poland", "Europe"), ("Sweden", "Europe"),
        ("Japan", "Asia"), ("China", "Asia"), ("India", "Asia"), ("Thailand", "Asia"), ("Vietnam", "Asia"),
        ("Kenya", "Africa"), ("Nigeria", "Africa"), ("Egypt", "Africa"), ("Ghana", "Africa"), ("Morocco", "Africa"),
        ("Brazil", "South America"), ("Argentina", "South America"), ("Peru", "South America"),
        ("Chile", "South America"), ("Colombia", "South America"), ("Canada", "North America"),
        ("Mexico", "North America"),
    ]),
}


def all_facts() -> list[tuple[str, Fact]]:
    """(relation, Fact) for every pair: target " OBJECT", the relation's question and paraphrase filled in."""
    out = []
    for rel, (prompt, question, para, pairs) in RELATIONS.items():
        for s, o in pairs:
            out.append((rel, Fact(prompt.format(s=s), f" {o}", [para.format(s=s[0].upper() + s[1:])], [],
                                  question.format(s=s))))
    return out


def known_facts(model, tokenizer, relations=None) -> list[tuple[str, Fact]]:
    """(relation, fact) of `relations` (default all) that `model` completes with its true object: greedy decoding
    after the prompt produces the target's tokens (`editing.greedy`, engram's one test of what a model knows)."""
    from .edit import greedy

    facts = [(r, f) for r, f in all_facts() if relations is None or r in relations]
    hits = greedy(model.eval(), tokenizer, [(f.prompt, f.target) for _, f in facts])
    return [rf for rf, h in zip(facts, hits) if h]


def counterfactuals(facts: list[tuple[str, Fact]], seed: int = 0) -> list[tuple[str, Fact, str]]:
    """(relation, the fact with a new target, the true target): each fact's object replaced by another object of
    the same relation, drawn with `seed` (never the true one)."""
    rng = random.Random(seed)
    objects = {r: sorted({f" {o}" for _, o in pairs}) for r, (_, _, _, pairs) in RELATIONS.items()}
    out = []
    for rel, f in facts:
        new = rng.choice([o for o in objects[rel] if o != f.target])
        out.append((rel, Fact(f.prompt, new, list(f.paraphrases), list(f.passages), f.question), f.target))
    return out
