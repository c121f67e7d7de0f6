"""The model card (README.md, `engram.adapters.card`) beside every saved adapter and overlay: its fields, its place
outside the checksum manifest, and folders that load whatever the card says."""

import pytest
import torch

pytest.importorskip("transformers")

from bases import tale_tokenizer, tiny_base
from test_adapter import OPTS, logits, perturb  # (the adapter tests' Engram options and helpers)

import engram
from engram.adapters import CARD_FILE, adapter_of, read_adapter_config
from engram.persist import read_manifest

TRAINING = {"command": "engram adapt", "data": ["corpus.txt"], "steps": 12, "train_loss": 3.21, "val_loss": 3.4,
            "settings": {"lr": 1e-3, "batch_size": 8}, "train_split_tokens": 12345}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama saved with save_pretrained (loaded back from it, the model knows its path) and a tokenizer."""
    d = tmp_path_factory.mktemp("base")
    tiny_base("llama").save_pretrained(d)
    tale_tokenizer(d / "tokenizer.json")
    return d


def load(base_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir).eval()


def card(folder):
    from huggingface_hub import ModelCard

    return ModelCard.load(folder / CARD_FILE)


def test_an_adapter_save_writes_a_card_with_base_digests_and_training(base_dir, tmp_path):
    m = perturb(engram.attach(load(base_dir), [1], tokenizer=base_dir, verbose=False, **OPTS))
    ids = torch.randint(0, 400, (2, 10))
    want = logits(m, ids)
    engram.save_adapter(m, tmp_path / "a", training=TRAINING)
    c = card(tmp_path / "a")
    assert c.data.library_name == "engram" and c.data.base_model == str(base_dir)
    assert {"engram", "engram-adapter"} <= set(c.data.tags)
    fp = read_adapter_config(tmp_path / "a")["base"]
    for fact in (adapter_of(m).mapping.spec_digest(), fp["embedding"]["sample_sha256"], fp["vocab"]["lookup_sha256"],
                 "layers [1]", "trained by: `engram adapt`", "data: `corpus.txt`", "steps: 12",
                 "train loss 3.2100, val loss 3.4000", "lr 0.001, batch_size 8", "train_split_tokens: 12345"):
        assert fact in c.text, fact
    assert CARD_FILE not in read_manifest(tmp_path / "a")["files"]  # documentation, not a checked file
    (tmp_path / "a" / CARD_FILE).write_text(c.content + "\nEdited by hand.\n")
    assert torch.equal(logits(engram.load_adapter(load(base_dir), tmp_path / "a"), ids), want)  # loading ignores it


def test_a_save_without_a_training_record_says_so_in_both_layouts(base_dir, tmp_path):
    m = engram.attach(load(base_dir), [0], tokenizer=base_dir, verbose=False, **OPTS)
    engram.save_adapter(m, tmp_path / "a")
    assert "Not recorded" in card(tmp_path / "a").text
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "trainer_state.json").write_text("{}")  # a Trainer checkpoint's own file, kept
    m.save_pretrained(tmp_path / "ckpt")  # the attached model's save_pretrained: Trainer's layout
    c = card(tmp_path / "ckpt")
    assert c.data.base_model == str(base_dir) and adapter_of(m).mapping.spec_digest() in c.text
    assert CARD_FILE not in read_manifest(tmp_path / "ckpt")["files"]
    assert (tmp_path / "ckpt" / "trainer_state.json").is_file()
    engram.load_adapter(load(base_dir), tmp_path / "ckpt")


def test_an_overlay_save_writes_a_card_with_its_facts_and_rows(base_dir, tmp_path):
    from tokenizers import Tokenizer

    from engram.editing import Fact, Overlay, edit_facts

    m = perturb(engram.attach(load(base_dir), [0, 1], tokenizer=base_dir, verbose=False, **OPTS))
    facts = [Fact("The quick brown fox", " jumps"), Fact("said the", " king")]
    overlay = edit_facts(m, Tokenizer.from_file(str(base_dir / "tokenizer.json")), facts, steps=3, progress=False)
    overlay.meta["base"] = f"{base_dir} + adapter"  # (what `engram edit` records)
    overlay.save(tmp_path / "o", {"report.json": {"summary": {}}})
    c = card(tmp_path / "o")
    assert c.data.library_name == "engram" and "engram-overlay" in c.data.tags
    per_layer = ", ".join(f"{lid} ({r.numel():,})" for lid, r in sorted(overlay.rows.items()))
    assert overlay.num_rows > 0
    for fact in ("facts: 2", f"rows written: {overlay.num_rows:,} in layers {per_layer}", overlay.meta["base_digest"],
                 overlay.meta["hash_spec_sha256"], "`The quick brown fox` -> ` jumps`",
                 f"{overlay.meta['optimization']['steps_run']} steps, final loss"):
        assert fact in c.text, fact
    assert overlay.meta["hash_spec_sha256"] == adapter_of(m).mapping.spec_digest()  # the adapter card's digest
    assert CARD_FILE not in read_manifest(tmp_path / "o")["files"]
    (tmp_path / "o" / CARD_FILE).write_text("edited\n")
    assert Overlay.load(tmp_path / "o").num_rows == overlay.num_rows
