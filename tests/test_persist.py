"""Saving over a good folder never loses it: a save killed at any filesystem step (every rename and tree removal
persist makes, atomic files included) leaves the old folder or the new one complete, for models, adapters,
overlays and checkpoints alike (prepared data and sharded tables: tests/test_corruption.py, test_distributed.py)."""

import json
import os
import shutil

import pytest
import torch
from bases import tiny_base
from conftest import Crash

from engram import persist
from engram.persist import read_json, recover_dir, replace_dir

STEPS = [1, 2, 3]  # (1) final -> aside, (2) tmp -> final, (3) delete aside


def folder(path, text):
    path.mkdir(parents=True)
    (path / "a.txt").write_text(text)
    (path / "b.txt").write_text(text * 2)
    return path


def contents(path):
    return {f.name: f.read_text() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("k", STEPS)
def test_replace_dir_interrupted_leaves_old_or_new(tmp_path, crash_at, k):
    final = folder(tmp_path / "model", "old")
    new = folder(tmp_path / ".model.tmp", "new")
    crash_at(k)
    with pytest.raises(Crash):
        replace_dir(new, final)
    crash_at.disarm()
    recover_dir(final)  # what the next open does
    assert contents(final) == ({"a.txt": "old", "b.txt": "oldold"} if k < 3 else {"a.txt": "new", "b.txt": "newnew"})
    assert not (tmp_path / ".model.replaced").exists()


@pytest.mark.parametrize("k", STEPS)
def test_replace_dir_killed_in_a_child_process(tmp_path, k):
    """A real kill (os._exit in a forked child, no cleanup of any kind) at each step."""
    final = folder(tmp_path / "model", "old")
    new = folder(tmp_path / ".model.tmp", "new")
    pid = os.fork()
    if pid == 0:  # child: die at step k
        count = [0]

        def step(real):
            def run(*a, **kw):
                count[0] += 1
                if count[0] == k:
                    os._exit(9)
                return real(*a, **kw)
            return run
        persist._rename, persist._remove_tree = step(os.replace), step(shutil.rmtree)
        replace_dir(new, final)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 9
    recover_dir(final)
    assert contents(final)["a.txt"] == ("old" if k < 3 else "new")


def test_replace_dir_into_a_new_path_and_read_json_errors(tmp_path):
    replace_dir(folder(tmp_path / ".x.tmp", "v"), tmp_path / "x")
    assert contents(tmp_path / "x")["a.txt"] == "v"
    with pytest.raises(ValueError, match=r"spec not found: .*missing.json \(write it\)"):
        read_json(tmp_path / "missing.json", "spec", "write it")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(KeyError, match="corrupt .not valid JSON"):
        read_json(tmp_path / "bad.json", "spec", "write it", KeyError)
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="a JSON dict was expected, found list"):
        read_json(tmp_path / "list.json", "spec", "write it")


# ------------------------------------------------------------------------------------------ every saved kind
pytest.importorskip("transformers")


def bumped(model, by):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)
    return model


def first_weight(model):
    return next(model.parameters()).detach().clone()


def every_crash(crash_at, reset, save, state) -> list[str]:
    """Kill `save` at its k-th filesystem step (every rename and tree removal persist makes), k = 1, 2, ...
    until it completes. Before each try `reset()` restores the old saved state; after each kill `state()`
    (which loads as a user would, recovering an interrupted swap) must say "old" or "new", never anything else.
    Returns what each try left: the first kill leaves "old", the completed save "new"."""
    seen = []
    for k in range(1, 200):
        reset()
        crash_at(k)
        try:
            save()
            done = True
        except Crash:
            done = False
        crash_at.disarm()
        got = state()
        assert got in ("old", "new"), f"killed at step {k}: {got}"
        seen.append(got)
        if done:
            assert got == "new" and seen[0] == "old", seen
            return seen
    raise AssertionError("the save never completed")


def test_model_resave_killed_at_every_step(tiny_run, tmp_path, crash_at):
    from engram.model import load_model
    from engram.training.train import save_final

    run = tmp_path / "run"
    shutil.copy(tiny_run / "final" / "tokenizer.json", tmp_path / "tokenizer.json")
    manifest = {"tokenizer_file": str(tmp_path / "tokenizer.json")}
    old = first_weight(load_model(tiny_run)[0])

    def reset():
        if run.exists():
            shutil.rmtree(run)
        shutil.copytree(tiny_run, run)

    def state():
        w = first_weight(load_model(run)[0])  # verifies the manifest of whatever folder is there
        return "old" if torch.equal(w, old) else "new" if torch.equal(w, old + 1.0) else "garbage"

    every_crash(crash_at, reset, lambda: save_final(bumped(load_model(run)[0], 1.0), run, manifest), state)


def test_checkpoint_resave_killed_at_every_step(tiny_run, tmp_path, crash_at):
    from safetensors.torch import load_file

    from engram.model import load_model
    from engram.training.checkpoint import checkpoints, read_checkpoint, save_checkpoint

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    model, _ = load_model(run)
    opts = {"dense": torch.optim.AdamW(model.parameters())}

    def state():
        latest = checkpoints(run)[0]  # resolves an interrupted replacement
        assert latest.name == "step_000011" and load_file(str(latest / "model.safetensors"))
        return {1: "old", 2: "new"}.get(read_checkpoint(latest)["batcher"]["pos"], "garbage")

    every_crash(crash_at, lambda: save_checkpoint(run, 11, model, opts, {"pos": 1}),
                lambda: save_checkpoint(run, 11, model, opts, {"pos": 2}), state)


def llama(vocab):
    """The tiny Llama these tests attach adapters to (transformers' BOS id and init range, 64 positions)."""
    return tiny_base("llama", vocab=vocab, max_position_embeddings=64, bos_token_id=1, initializer_range=0.02)


def test_adapter_resave_killed_at_every_step(tiny_run, tmp_path, crash_at):
    import engram
    from engram.adapters import adapter_of

    tok = tiny_run / "final" / "tokenizer.json"
    vocab = len(json.loads(tok.read_text())["model"]["vocab"])
    opts = dict(engram_vocab_size=[211, 223], n_embed_per_ngram=16, n_head_per_ngram=2)
    base = llama(vocab)
    engram.attach(base, [1], tokenizer=tok, **opts)
    adapter = adapter_of(base)
    old = {k_: v.clone() for k_, v in adapter.state_dict().items() if torch.is_floating_point(v)}

    def set_to(by):
        with torch.no_grad():
            for k_, v in adapter.state_dict().items():
                if k_ in old:
                    v.copy_(old[k_] + by)

    def reset():
        set_to(0.0)
        engram.save_adapter(base, tmp_path / "adapter")
        set_to(0.5)

    def state():
        got = adapter_of(engram.load_adapter(llama(vocab), tmp_path / "adapter")).state_dict()
        for name, by in (("old", 0.0), ("new", 0.5)):
            if all(torch.equal(got[n], old[n] + by) for n in old):
                return name
        return "garbage"

    every_crash(crash_at, reset, lambda: engram.save_adapter(base, tmp_path / "adapter"), state)


def test_overlay_resave_killed_at_every_step(tmp_path, crash_at):
    from engram.editing import Overlay

    def overlay(v):
        return Overlay({1: torch.tensor([3, 5])}, {1: torch.full((2, 4), v)}, {"layers": [1], "note": v})

    def state():
        return {1.0: "old", 2.0: "new"}.get(float(Overlay.load(tmp_path / "ov").values[1][0, 0]), "garbage")

    every_crash(crash_at, lambda: overlay(1.0).save(tmp_path / "ov"), lambda: overlay(2.0).save(tmp_path / "ov"), state)


def test_folders_saved_before_the_one_manifest_format_still_load(tiny_run, tmp_path):
    """Checkpoints and adapters listed their digests in state.json / engram_adapter.json before 0.2."""
    import engram
    from engram.adapters import read_adapter_config
    from engram.persist import sha256_file
    from engram.training.checkpoint import CheckpointError, read_checkpoint

    def to_legacy(d, meta_name):
        (d / "engram_manifest.json").unlink()
        files = sorted(str(f.relative_to(d)) for f in d.rglob("*") if f.is_file() and f.name != meta_name)
        meta = json.loads((d / meta_name).read_text())
        meta["files"] = {f: sha256_file(d / f) for f in files}
        (d / meta_name).write_text(json.dumps(meta))

    ck = tmp_path / "ck"
    shutil.copytree(sorted((tiny_run / "checkpoints").glob("step_*"))[-1], ck)
    to_legacy(ck, "state.json")
    assert read_checkpoint(ck)["step"] == 10
    (ck / "optim.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_checkpoint(ck)

    tok = tiny_run / "final" / "tokenizer.json"
    vocab = len(json.loads(tok.read_text())["model"]["vocab"])
    base = llama(vocab)
    engram.attach(base, [1], tokenizer=tok, engram_vocab_size=[211, 223], n_embed_per_ngram=16, n_head_per_ngram=2)
    engram.save_adapter(base, tmp_path / "a")
    to_legacy(tmp_path / "a", "engram_adapter.json")
    assert read_adapter_config(tmp_path / "a")["format"]
    engram.load_adapter(llama(vocab), tmp_path / "a")


def test_atomic_files_get_the_mode_of_a_plain_open(tmp_path):
    """Written aside with mkstemp (0600) and renamed: the file still gets 0666 & ~umask, as open() gives."""
    old = os.umask(0o022)
    try:
        persist.write_json(tmp_path / "a.json", {"a": 1})
        os.umask(0o077)
        persist.write_json(tmp_path / "b.json", {"b": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o600
