"""`inference.prepare_inference`, the one path from a loaded model to an inference model (tier, overlays checked,
format, overlays applied): every tier x format x overlay combination gives the rows `engram sample` gives, in
`engram serve`, the CLI and (through `checkpoint_digest`) the vLLM model alike."""

import shutil

import pytest
import torch

pytest.importorskip("transformers")

from engram.adapters.introspect import checkpoint_digest, model_digest  # noqa: E402
from engram.cli import main  # noqa: E402
from engram.editing import Fact, edit_facts  # noqa: E402
from engram.inference import load_inference_model, prepare_inference  # noqa: E402
from engram.model import load_model  # noqa: E402
from engram.serving.engine import load_engine  # noqa: E402

FACT = Fact("Line 5: the king", " ran")


@pytest.fixture(scope="module")
def run(tiny_run, tmp_path_factory):
    """A copy of the tiny run and a one-fact overlay made on it (`ROOT/ov`)."""
    root = tmp_path_factory.mktemp("prepare")
    shutil.copytree(tiny_run, root / "run")
    model, tok = load_model(root / "run")
    edit_facts(model, tok, [FACT], steps=30, lr=0.3, progress=False).save(root / "ov")
    return root


def logits(model, tok, text="Line 5: the king sat"):
    ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids])
    with torch.no_grad():
        return model(ids).logits


def test_serve_takes_an_overlay_with_a_converted_table_format(run):
    """`engram serve RUN --table-format int8 --overlay n=OV` loads (the digest was taken through the int8 table,
    so the valid overlay was refused as "made for another checkpoint")."""
    engine = load_engine(run / "run", overlays={"n": run / "ov"}, table_format="int8")
    assert list(engine.overlays) == ["n"]


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "fp8"])
def test_sample_with_mmap_tables_in_another_format(run, capsys, tmp_path, fmt):
    """`engram sample --table-tier mmap --table-format bfloat16` (the conversion read the layer's parameter,
    which offloading had emptied: "table holds [0, 8] rows")."""
    code = main(["sample", "--checkpoint", str(run / "run"), "--table-tier", "mmap", "--table-dir",
                 str(tmp_path / "t"), "--table-format", fmt, "--overlay", str(run / "ov"), "--prompt", FACT.prompt,
                 "--temperature", "0", "--max-new-tokens", "2"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("fmt", [None, "bfloat16", "int8", "fp8"])
def test_every_tier_gives_the_rows_of_ram_for_each_format_with_an_overlay(run, tmp_path, fmt):
    """For each format: RAM, mmap and disk tiers with the overlay applied give RAM's logits exactly, and the overlay
    changes them (it is in front of the converted tables)."""
    want = None
    for tier in ("ram", "mmap", "disk"):
        model, tok = load_inference_model(run / "run", table_tier=tier, table_dir=tmp_path / tier)
        plain = logits(model, tok)
        prepare_inference(model, table_format=fmt, overlays={"ov": run / "ov"})
        got = logits(model, tok)
        if want is None:
            want = got
            assert not torch.equal(got, plain)
        assert torch.equal(got, want), (tier, fmt)


def test_overlays_only_checked_when_chosen_per_request(run):
    model, tok = load_model(run / "run")
    before = logits(model, tok)
    loaded = prepare_inference(model, table_format="int8", overlays={"n": run / "ov"}, apply=False)
    assert list(loaded) == ["n"] and not torch.equal(logits(model, tok), before)  # int8 rows, no overlay
    from engram.tables.overlay import OverlayTable

    assert not any(isinstance(m.table, OverlayTable) for m in model.modules() if hasattr(m, "table"))


def test_checkpoint_digest_is_the_loaded_models(run):
    """The digest vLLM's workers check overlays against, read from the files, equals the loaded model's."""
    model, _ = load_model(run / "run")
    assert checkpoint_digest(run / "run" / "final") == model_digest(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.01)
    assert checkpoint_digest(run / "run" / "final") != model_digest(model)
