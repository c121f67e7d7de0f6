"""Fact editing in the memory: change only the table rows a prompt addresses, ship them as an overlay.

Engram's rows are addressed by token ids alone, so the rows a prompt reads are known before the
model runs, and so is every other n-gram that reads them (the hash spec says so). `edit_facts`
optimizes exactly those rows, everything else frozen, and returns an `Overlay`: row ids, new rows,
and the digests of the hash manifest and of the model it was made for. `apply_overlay` puts it in
front of the tables at gather time (any backend: parameter, RAM, memory-mapped file, shards);
the table is never rewritten, and taking the overlay off is the undo.

    facts = engram.editing.read_facts("facts.jsonl", tokenizer)   # {"prompt": ..., "target": ...} per line
    overlay = engram.edit_facts(model, tokenizer, facts)        # -> Overlay (rows, values, digests)
    overlay.save("out/overlay");  engram.apply_overlay(model, engram.Overlay.load("out/overlay"))

Which rows (`positions`, `orders`):
  * "trigger" (default): the rows read at the positions whose outputs predict the target tokens
    (the prompt's last token and every target token but the last), highest n-gram order only
    (`orders=None`): the n-grams that end the prompt, which carry the prompt's own tokens (an
    entity name) rather than a common pair like " lives in"; the fewest rows shared with other text;
  * "all": the rows read at every prompt and target position (more capacity, more collisions);
  * "subject": the rows read at the subject's tokens (`Fact.subject`), in every order: where a prompt names the
    entity rather than where it asks for the answer, so a prompt worded otherwise that names the subject the same
    way reads the same rows; the answer reaches the last position through attention, as the base's own recall
    does. Optimize it over many contexts (`paraphrase_contexts`, `chat_contexts`) so the rows serve them all;
  * "subject+trigger": both sets of rows, every order: the prompt's own ending answers it directly, the
    subject's rows carry the fact to prompts worded otherwise.
  A wording reads a subject's rows only where the words before the subject match (there are no order-1 rows):
  `orders=[2]` keeps the edit in the rows that need one word to match, and `tie=[...]` (`tied_rows`) also writes a
  one-token subject's order-2 rows after each listed context. `edit_report` marks every paraphrase that reads no
  edited row (`reads_edit`): the edit cannot change its answer.

The report (`edit_report`) measures efficacy (greedy decoding produces the target), generalization
(paraphrases, the prompt inside a longer passage), the collision set (`collision_set`: every
position of a text whose n-gram reads an edited row, exact from the hash spec) and locality: the
validation logits of every position that neither reads an edited row nor attends to one are
compared bit for bit with and without the overlay (`locality`).

Files: `facts.py` (reading facts), `digests.py` (the model's layers, hashing and digests), `overlay.py`
(`Overlay`, apply/remove), `optimize.py` (`edit_facts`), `checkpoint.py` (an edit's resumable state), `report.py`
(efficacy, collision set, locality).
"""

from ..tables.overlay import remove_overlays
from .digests import engram_layers, frozen, mapping_of, model_digest, spec_digest
from .facts import EditError, Fact, chat_contexts, paraphrase_contexts, parse_fact, read_facts, subject_span
from .optimize import conflicts, edit_facts, edit_rows, shared_rows
from .overlay import FORMAT, META, WEIGHTS, Overlay, applied, apply_overlay, check_overlay
from .report import (
    collision_set,
    edit_report,
    fact_report,
    locality,
    ngram_entropy,
    print_report,
    reads_rows,
    score,
    table_rows_read,
)

__all__ = ["EditError", "Fact", "Overlay", "apply_overlay", "applied", "chat_contexts", "check_overlay", "subject_span",
           "paraphrase_contexts", "collision_set", "conflicts",
           "shared_rows", "edit_facts", "edit_report", "edit_rows", "engram_layers", "fact_report", "frozen",
           "mapping_of", "locality", "model_digest", "parse_fact", "print_report", "read_facts", "reads_rows",
           "remove_overlays", "ngram_entropy", "score", "spec_digest", "table_rows_read", "FORMAT", "META", "WEIGHTS"]
