"""The corruption matrix: every kind of file engram writes x every way it gets damaged.

Each case copies a finished tiny run, damages one file one way, and runs the command that reads
it. The command either recovers where the design says so (resume falls back to the previous
checkpoint, caches are rebuilt, metrics are rewritten) or stops with exactly one
`engram: error:` line and a non-zero exit: never a traceback, never a silently different number.

Damage: truncated to half, zero-length, 16 bytes flipped mid-file, the first 16 bytes (header or
JSON start) flipped, missing. The whole matrix takes seconds on the tiny preset.
"""

import os
import shutil

import pytest

pytest.importorskip("transformers")

from bases import tiny_base  # noqa: E402
from conftest import Crash  # noqa: E402 (the `crash_at` fixture is in conftest: a save killed at its k-th step)

from engram.cli import main  # noqa: E402
from engram.editing import Fact, edit_facts  # noqa: E402
from engram.model import load_model  # noqa: E402
from engram.training.train import train  # noqa: E402

MODES = ["flip16", "truncate", "zero", "garble", "missing"]
TINY = {"ckpt_every": 2, "eval_every": 2}


def damage(path, mode):
    b = path.read_bytes()
    if mode == "truncate":
        path.write_bytes(b[: len(b) // 2])
    elif mode == "zero":
        path.write_bytes(b"")
    elif mode == "missing":
        path.unlink()
    else:
        at = 0 if mode == "garble" else len(b) // 2
        path.write_bytes(b[:at] + bytes(x ^ 0xFF for x in b[at:at + 16]) + b[at + 16:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("corruption")
    corpus = root / "c.txt"
    corpus.write_text("".join(f"Line {i}: the cat sat on the mat, the dog ran to the king.\n" for i in range(400)))
    train("tiny", data=[str(corpus)], out=root / "run", max_steps=4, overrides=TINY, progress=False)
    train("tiny", data=[str(corpus)], out=root / "mmap", max_steps=4, progress=False,
          overrides={**TINY, "table_mode": "mmap"})
    model, tok = load_model(root / "run")
    edit_facts(model, tok, [Fact("the cat sat on", " the dog")], steps=5, progress=False).save(root / "overlay")
    # an Engram adapter on a tiny pretrained Llama that uses the run's tokenizer
    import engram

    base = tiny_base("llama", vocab=tok.get_vocab_size(), seed=None, bos_token_id=1, initializer_range=0.02)
    base.save_pretrained(root / "base")
    shutil.copy(root / "run" / "final" / "tokenizer.json", root / "base" / "tokenizer.json")
    engram.attach(base, [1], tokenizer=root / "base", engram_vocab_size=[211, 223], n_embed_per_ngram=16,
                  n_head_per_ngram=2)
    engram.save_adapter(base, root / "adapter")
    return root, corpus


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code, out, err):
    errors = [line for line in err.splitlines() if line.startswith("engram: error:")]
    return code != 0 and len(errors) == 1 and "Traceback" not in err, errors


# kind -> (run to copy, file in it, how it is read: "eval" | "resume" | "overlay" | "adapter", what must happen)
# what: "error" (one line, non-zero), "recover" (exit 0), or a dict per mode
KINDS = {
    "final weights": ("run", "final/model.safetensors", "eval", "error"),
    "final config": ("run", "final/config.json", "eval", "error"),
    "hash manifest": ("run", "final/engram_hash_spec.json", "eval", "error"),
    "final tokenizer": ("run", "final/tokenizer.json", "eval", "error"),
    "checkpoint weights": ("run", "checkpoints/step_000004/model.safetensors", "resume", "fallback"),
    "checkpoint optimizer": ("run", "checkpoints/step_000004/optim.safetensors", "resume", "fallback"),
    "checkpoint state": ("run", "checkpoints/step_000004/state.json", "resume", "fallback"),
    "metrics.jsonl": ("run", "metrics.jsonl", "resume", "recover"),
    "run.json": ("run", "run.json", "resume", {"missing": "recover"}),
    "table file": ("mmap", "tables/engram_table_L1.safetensors", "resume", "error"),
    "table block sums": ("mmap", "tables/engram_table_L1.safetensors.blocks", "resume", {"missing": "recover"}),
    "undo journal": ("mmap", "tables/engram_table_L1.safetensors.journal", "resume", "error"),
    "overlay rows": ("overlay", "overlay.safetensors", "overlay", "error"),
    "adapter weights": ("adapter", "engram_adapter.safetensors", "adapter", "error"),
    "adapter config": ("adapter", "engram_adapter.json", "adapter", "error"),
    "adapter hash manifest": ("adapter", "engram_hash_spec.json", "adapter", "error"),
    "overlay meta": ("overlay", "overlay.json", "overlay", "error"),
}


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_damaged_file_recovers_or_fails_in_one_line(runs, tmp_path, capsys, kind, mode):
    root, corpus = runs
    src, rel, reader, what = KINDS[kind]
    what = what.get(mode, "error") if isinstance(what, dict) else what
    work = tmp_path / src
    shutil.copytree(root / src, work)
    damage(work / rel, mode)
    evaluate = ("--data", corpus, "--seq-len", 16, "--max-windows", 2)
    if reader != "resume":
        model = {"eval": ("--checkpoint", work), "adapter": ("--base", root / "base", "--adapter", work),
                 "overlay": ("--checkpoint", root / "run", "--overlay", work)}[reader]
        code, out, err = cli(capsys, "eval", *model, *evaluate)
    else:
        args = ["train", "--preset", "tiny", "--data", corpus, "--out", work, "--max-steps", 4, "--resume"]
        for k, v in TINY.items():
            args += ["--set", f"{k}={v}"]
        if src == "mmap":
            args += ["--table-mode", "mmap"]
        code, out, err = cli(capsys, *args)
    if what == "error":
        ok, errors = one_line_error(code, out, err)
        assert ok and "val loss" not in out, (code, out, err)
    else:
        assert code == 0 and "Traceback" not in err, (code, out, err)
        if what == "fallback":
            assert "falling back to step_000002" in out + err, (out, err)


@pytest.mark.parametrize("name", ["train.bin", "val.bin", "engram_manifest.json", "tokenizer.json"])
@pytest.mark.parametrize("mode", MODES)
def test_damaged_prepared_data_is_rebuilt(tmp_path, monkeypatch, name, mode):
    from engram.training.data import check_prepared, load_manifest, load_split, prepare

    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"Verse {i}: the owl and the lark sang at the gate.\n" for i in range(300)))
    d = prepare([str(corpus)], "bpe:300", progress=False)
    clean = {s: load_split(d, s).tolist() for s in load_manifest(d)["splits"]}
    damage(d / name, mode)
    assert check_prepared(d) is not None
    with pytest.warns(UserWarning, match="damaged") if name != "engram_manifest.json" or mode != "missing" else \
            _no_warning():
        d2 = prepare([str(corpus)], "bpe:300", progress=False)
    assert d2 == d and check_prepared(d) is None
    assert {s: load_split(d, s).tolist() for s in load_manifest(d)["splits"]} == clean  # the same tokens again


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_damaged_compression_cache_is_rebuilt(runs, capsys):
    import os
    from pathlib import Path

    root, corpus = runs
    args = ("eval", "--checkpoint", root / "run", "--data", corpus, "--seq-len", 16, "--max-windows", 2)
    code, clean, _ = cli(capsys, *args)
    caches = sorted(Path(os.environ["ENGRAM_CACHE_DIR"]).glob("lookup-*.npz"))
    assert code == 0 and caches
    for mode in MODES:
        for f in caches:
            if f.exists():
                damage(f, mode)
        code, out, err = cli(capsys, *args)
        assert code == 0 and out == clean, (mode, err)  # rebuilt: the same numbers


def _legacy(d):
    """Turn a prepared folder into one written by an older engram: `manifest.json` only (the info, no checksums)."""
    import json

    from engram.training.data import load_manifest

    info = load_manifest(d)
    (d / "engram_manifest.json").unlink()
    (d / "manifest.json").write_text(json.dumps(info))
    return info


def test_prepared_data_of_an_older_engram_is_rebuilt(tmp_path, monkeypatch, capsys):
    from engram.training.data import check_prepared, load_manifest, prepare

    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"Verse {i}: the owl and the lark sang at the gate.\n" for i in range(300)))
    d = prepare([str(corpus)], "bpe:300", progress=False)
    info = _legacy(d)
    assert load_manifest(d) == info  # still readable (an old run's data_dir) ...
    assert "older format" in check_prepared(d)  # ... but a stale cache
    assert prepare([str(corpus)], "bpe:300", progress=False) == d
    assert "older format; tokenizing it again" in capsys.readouterr().err
    assert check_prepared(d) is None and not (d / "manifest.json").exists() and load_manifest(d) == info


def test_prepared_data_save_killed_at_every_step_leaves_old_or_new(tmp_path, monkeypatch, crash_at):
    """The prepared-data save interrupted at its k-th filesystem step (each rename, each tree removal), for every k
    until one save completes: afterwards `check_prepared` and a fresh `prepare` find the old folder or the new one,
    complete, never a mix or nothing."""
    from engram import persist
    from engram.training.data import check_prepared, load_manifest, load_split, prepare

    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"Verse {i}: the owl and the lark sang at the gate.\n" for i in range(300)))
    d = prepare([str(corpus)], "bpe:300", progress=False)
    _legacy(d)  # the old folder: complete, but stale, so the next prepare replaces it
    old = tmp_path / "old"
    shutil.copytree(d, old)
    old_tokens = load_split(old, "train").tolist()
    st = corpus.stat()  # new text of the same size and mtime: the same cache key, so prepare replaces `d` in place
    text = "".join(f"Line {i}: a new text for the new folder.\n" for i in range(400)).encode()[: st.st_size]
    corpus.write_bytes(text)
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    for k in range(1, 100):
        persist.remove_tree(d)
        shutil.copytree(old, d)
        crash_at(k)
        try:
            prepare([str(corpus)], "bpe:300", progress=False)
            crashed = False
        except Crash:
            crashed = True
        crash_at.disarm()
        damage = check_prepared(d)  # what the next open sees
        if damage is None:  # the new folder, complete
            assert load_split(d, "train").tolist() != old_tokens and (d / "engram_manifest.json").is_file()
        else:  # the old folder, complete
            assert "older format" in damage, (k, damage)
            assert load_split(d, "train").tolist() == old_tokens and load_manifest(d)["splits"]
        assert not (d.parent / f".{d.name}.replaced").exists()
        new = prepare([str(corpus)], "bpe:300", progress=False)  # a fresh prepare: the new folder, complete
        assert check_prepared(new) is None and load_split(new, "train").tolist() != old_tokens
        if not crashed:
            break
    assert crashed is False and k > 4  # every step was interrupted once, then a save ran all k - 1 of them
