"""Model ids where a base folder is accepted (`engram.inference.hub.resolve_model_dir`, called by `load_base`): an
`org/name[@REVISION]` resolves to its snapshot in a local Hugging Face cache the test builds, offline; a missing id
is one line naming the id, the cache and the fix."""

import hashlib
import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

from bases import TALE, tale_tokenizer, tiny_base  # noqa: E402

from engram.inference import load_base, load_inference_model, load_with_adapter  # noqa: E402
from engram.inference.hub import ModelIdError, resolve_model_dir  # noqa: E402

MAIN, V1 = "a" * 40, "b" * 40  # the commits refs/main and refs/v1 name


def _snapshot(repo, commit, seed, tok):
    """Write a tiny Llama (weights drawn from `seed`) with its tokenizer.json as snapshot `commit` of `repo`, laid
    out as huggingface_hub lays it: the files in blobs/<sha256>, the snapshot's entries links to them."""
    src = repo / "tmp"
    tiny_base("llama", seed=seed).save_pretrained(src)
    shutil.copy(tok, src / "tokenizer.json")
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in src.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.move(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    src.rmdir()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A hub cache holding model `org/tiny`: refs/main -> commit MAIN (seed 0), refs/v1 -> commit V1 (seed 1)."""
    root = tmp_path_factory.mktemp("hf")
    tok = tale_tokenizer(root / "tokenizer.json")
    repo = root / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    for commit, seed, ref in ((MAIN, 0, "main"), (V1, 1, "v1")):
        _snapshot(repo, commit, seed, tok)
        (repo / "refs" / ref).write_text(commit)
    return root


@pytest.fixture
def cache(hub, monkeypatch):
    """The hub cache as $HF_HUB_CACHE (no network either way: HF_HUB_OFFLINE)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub / "hub"


def _embedding(model) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach()


def test_a_model_id_loads_the_snapshot_its_revision_names(cache):
    seed0, seed1 = _embedding(tiny_base("llama", seed=0)), _embedding(tiny_base("llama", seed=1))
    model, tok = load_base("org/tiny")  # refs/main
    assert tok.parent == cache / "models--org--tiny" / "snapshots" / MAIN and torch.equal(_embedding(model), seed0)
    for spec, revision in (("org/tiny@v1", None), (f"org/tiny@{V1}", None), ("org/tiny", "v1"), ("org/tiny", V1)):
        model, _ = load_base(spec, revision=revision)
        assert torch.equal(_embedding(model), seed1), (spec, revision)
    model, tok = load_with_adapter("org/tiny", revision="v1")  # every loader takes the id
    assert torch.equal(_embedding(model), seed1) and tok.encode("the king").ids
    model, _ = load_inference_model(base=f"org/tiny@{MAIN}")
    assert torch.equal(_embedding(model), seed0)


def test_the_cache_follows_hf_home_and_a_local_folder_wins(hub, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hub))  # (its hub/ is the cache)
    assert resolve_model_dir("org/tiny") == hub / "hub" / "models--org--tiny" / "snapshots" / MAIN
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # a folder of the id's name is that folder, not the cached model
    assert resolve_model_dir("org/tiny") == local.relative_to(tmp_path)
    with pytest.raises(ModelIdError, match="local folder"):
        resolve_model_dir("org/tiny", revision="v1")


@pytest.mark.parametrize("spec, revision, fix", [
    ("org/missing", None, "hf download org/missing`"),
    ("org/tiny@nope", None, "hf download org/tiny --revision nope`"),
    ("org/tiny", "nope", "hf download org/tiny --revision nope`"),
])
def test_an_id_missing_from_the_cache_is_one_line_naming_id_cache_and_fix(cache, spec, revision, fix):
    with pytest.raises(ModelIdError) as e:
        load_base(spec, revision=revision)
    msg = str(e.value)
    assert isinstance(e.value, FileNotFoundError) and "\n" not in msg
    assert msg.startswith(f"--base {spec}: ") and str(cache) in msg and fix in msg, msg
    with pytest.raises(ModelIdError, match="another; give one"):
        load_base("org/tiny@v1", revision="main")


@pytest.mark.integration  # (trains an adapter)
def test_adapt_and_eval_take_a_model_id(cache, tmp_path, capsys):
    from engram.cli import main

    corpus = tmp_path / "tale.txt"
    corpus.write_text("\n".join(TALE))
    out = tmp_path / "run"
    code = main(["adapt", "--base", "org/tiny@v1", "--data", str(corpus), "--out", str(out), "--max-steps", "2",
                 "--set", "seq_len=32", "--set", "batch_size=4", "--set", "eval_max_windows=4",
                 "--engram", "engram_vocab_size=[211,223]", "--engram", "n_embed_per_ngram=16"])
    err = capsys.readouterr().err
    assert code == 0, err
    run, summary = (json.loads((out / name).read_text()) for name in ("run.json", "summary.json"))
    assert run["base_id"] == "org/tiny@v1" and run["base"] == str(cache / "models--org--tiny" / "snapshots" / V1)
    code = main(["eval", "--base", "org/tiny@v1", "--adapter", str(out), "--data", str(corpus), "--seq-len", "32",
                 "--max-windows", "4"])
    captured = capsys.readouterr()  # (the same windows: the training run's validation loss)
    assert code == 0 and f"val loss {summary['val_loss']:.4f}" in captured.out, captured.err
    code = main(["eval", "--base", "org/absent", "--data", str(corpus)])  # through the CLI: one line, no traceback
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "org/absent" in err and str(cache) in err, err
