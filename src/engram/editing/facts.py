"""Facts to write into the memory: `{"prompt": ..., "target": ...}` per JSONL line, checked in one line each."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EngramError


class EditError(EngramError, ValueError):
    """A fact, an overlay or the model it is applied to is not usable; the message names the fix."""


@dataclass
class Fact:
    """One fact: `prompt` followed by `target` (may be several tokens). `paraphrases`: other prompts that
    should produce the same target; `passages`: longer texts that end where the target should follow (both only
    measured). `question`: a user turn whose chat answer starts with `prompt` ("What is the capital of France?"
    for "The capital of France is"); `engram edit --chat` also optimizes the fact inside that chat turn
    (`chat_contexts`), since a chat answer reads the same rows in another context."""

    prompt: str
    target: str
    paraphrases: list[str] = field(default_factory=list)
    passages: list[str] = field(default_factory=list)
    question: str | None = None
    subject: str | None = None  # the entity the fact is about, as it is written in the prompt (`positions="subject"`)


_FACT_KEYS = {"prompt", "target", "paraphrases", "passages", "question", "subject"}


def subject_span(prompt: str, subject: str, last: bool = True) -> tuple[int, int] | None:
    """Character span (start, end) of `subject` as `prompt` writes it: its last (or, `last=False`, first)
    occurrence, or, when it is absent but opens the prompt with its first letter capitalized ("the Bahamas" in "The
    Bahamas is located on"), there. None when the prompt does not name it. One home for finding a subject: the
    edit's subject rows and the experiments' editors (ROME's subject token) both use it."""
    if not subject:
        return None
    at = prompt.rfind(subject) if last else prompt.find(subject)
    if at < 0 and prompt.startswith(subject[:1].upper() + subject[1:]):
        at = 0  # a sentence starts with the subject: its first letter capitalized
    return None if at < 0 else (at, at + len(subject))


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
    q = obj.get("question")
    if q is not None and (not isinstance(q, str) or not q.strip()):
        raise EditError(f"{where}: 'question' must be a non-empty string (a user turn whose answer starts with the "
                        "prompt)")
    subject = obj.get("subject")
    if subject is not None and (not isinstance(subject, str) or not subject.strip()
                                or subject_span(obj["prompt"], subject) is None):
        raise EditError(f"{where}: 'subject' must be a non-empty string that the prompt contains, got {subject!r}")
    fact = Fact(obj["prompt"], obj["target"], list(obj.get("paraphrases", [])), list(obj.get("passages", [])), q,
                subject)
    if tokenizer is not None:
        if not _encode(tokenizer, fact.prompt):
            raise EditError(f"{where}: the prompt {fact.prompt!r} tokenizes to nothing")
        if not _encode(tokenizer, fact.target):
            raise EditError(f"{where}: the target {fact.target!r} tokenizes to nothing")
    return fact


def chat_contexts(facts: list[Fact], render) -> list[Fact]:
    """For each fact with a `question`: the same fact inside a chat turn, `render([user: question]) + prompt`
    (`render`: `inference.chat_renderer` of the model's template). Its prompt ends in the same tokens, so it
    reads the same rows where the target is predicted; optimized together with the bare prompt, the edit holds
    in a chat answer too (the bare prompt alone was not enough on SmolLM2-135M-Instruct: tests/test_smollm2.py)."""
    return [Fact(render([{"role": "user", "content": f.question}]) + f.prompt, f.target, subject=f.subject)
            for f in facts if f.question]


def paraphrase_contexts(facts: list[Fact], prefixes: list[str] = ()) -> list[Fact]:
    """More contexts to optimize each fact in: its `paraphrases` as prompts of their own (those that name the
    subject, when it is given), and its prompt and those after each of `prefixes` (unrelated text before the
    fact). With `positions="subject"` the edit then writes the rows the subject's n-grams read in each of these
    contexts, so that a prompt never optimized on, which names the subject the same way, reads them too."""
    out = []
    for f in facts:
        prompts = [f.prompt] + [p for p in f.paraphrases if f.subject is None or f.subject in p]
        out += [Fact(p, f.target, subject=f.subject) for p in prompts[1:]]
        out += [Fact(x + p, f.target, subject=f.subject) for x in prefixes for p in prompts]
    return out


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
    """Token ids of `text` without special tokens, from a `tokenizers.Tokenizer` or a transformers tokenizer."""
    out = tokenizer.encode(text, add_special_tokens=False)
    return out.ids if hasattr(out, "ids") else list(out)
