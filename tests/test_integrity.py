"""Saved models carry a checksum manifest: corrupt or truncated files are one-line errors, never wrong numbers."""

import json
import shutil

import pytest

pytest.importorskip("transformers")

from engram.cli import main  # noqa: E402
from engram.persist import MANIFEST, IntegrityError, verify_manifest  # noqa: E402


@pytest.fixture(scope="module")
def run(tiny_run, tmp_path_factory):
    """A copy of the session's tiny trained run and its corpus (these tests damage files in it)."""
    root = tmp_path_factory.mktemp("integrity")
    shutil.copytree(tiny_run, root / "run")
    shutil.copy(tiny_run.parent / "c.txt", root / "c.txt")
    return root / "run", root / "c.txt"


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_final_model_has_a_manifest_of_every_file(run):
    final = run[0] / "final"
    files = json.loads((final / MANIFEST).read_text())["files"]
    assert {"model.safetensors", "config.json", "tokenizer.json", "engram_hash_spec.json"} <= set(files)
    assert verify_manifest(final)


@pytest.mark.parametrize("damage", ["flip16", "truncate", "missing", "garble_manifest"])
def test_damaged_final_model_is_a_one_line_error(run, tmp_path, capsys, damage):
    import shutil

    d = tmp_path / "final"
    shutil.copytree(run[0] / "final", d)
    f = d / "model.safetensors"
    if damage == "flip16":  # the user's report: loaded silently with a loss of 7.85 instead of 4.06
        b = bytearray(f.read_bytes())
        mid = len(b) // 2
        b[mid:mid + 16] = bytes(x ^ 0xFF for x in b[mid:mid + 16])
        f.write_bytes(bytes(b))
    elif damage == "truncate":  # the user's report: a SafetensorError traceback
        f.write_bytes(f.read_bytes()[:1000])
    elif damage == "missing":
        f.unlink()
    else:
        (d / MANIFEST).write_text("{not json")
    code, out, err = cli(capsys, "eval", "--checkpoint", d, "--data", run[1], "--seq-len", "16", "--max-windows", "2")
    errors = [l for l in err.splitlines() if l.startswith("engram: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err and out == "", err
    assert {"flip16": "corrupt", "truncate": "truncated", "missing": "model.safetensors",
            "garble_manifest": "corrupt"}[damage] in errors[0]


def test_folder_saved_before_manifests_loads_with_one_warning(run, tmp_path, capsys):
    import shutil

    d = tmp_path / "final"
    shutil.copytree(run[0] / "final", d)
    (d / MANIFEST).unlink()
    code, out, err = cli(capsys, "eval", "--checkpoint", d, "--data", run[1], "--seq-len", "16", "--max-windows", "2")
    assert code == 0 and "val loss" in out
    assert sum("engram: warning:" in l and "not verified" in l for l in err.splitlines()) == 1, err
    d2 = tmp_path / "f2"
    shutil.copytree(run[0] / "final", d2)
    (d2 / "tokenizer.json").write_bytes((d2 / "tokenizer.json").read_bytes()[:-1])
    with pytest.raises(IntegrityError, match="tokenizer.json is truncated"):
        verify_manifest(d2)


def test_engram_verify_reports_intact_and_damaged(run, tmp_path, capsys):
    import shutil

    d = tmp_path / "run"
    shutil.copytree(run[0], d)
    code, out, err = cli(capsys, "verify", d)
    assert code == 0 and "BAD" not in out and out.strip().endswith("intact"), out + err
    assert "ok         model" in out and "ok         checkpoint" in out
    ck = sorted((d / "checkpoints").glob("step_*"))[-1]
    (ck / "optim.safetensors").write_bytes(b"x")
    code, out, err = cli(capsys, "verify", d)
    assert code == 1 and f"BAD        checkpoint {ck}" in out and "--resume falls back" in out and "1 damaged" in out
    code, _, err = cli(capsys, "verify", tmp_path / "nothing")
    assert code == 2 and err.startswith("engram: error:")
