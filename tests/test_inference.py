"""`engram.inference`'s folder kinds: a kind another package declares in the entry-point group `engram.folder_kinds`
is found and loads its folder; a folder no kind claims is refused in one line naming every kind tried."""

import pytest

from engram.inference import (
    ENTRY_POINTS,
    FolderKind,
    UnknownFolderError,
    find_folder_kind,
    folder_kinds,
    load_inference_model,
)

PLUGIN = '''
from pathlib import Path

from engram.inference import FolderKind

LOADED = []


def load(path, tier, table_dir=None):
    LOADED.append((Path(path).name, tier, table_dir))
    return "model", "tokenizer"


KIND = FolderKind("a made-up folder (made_up.json)", lambda p: (Path(p) / "made_up.json").is_file(), load)
NOT_A_KIND = object()
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """An installed distribution (a .dist-info on sys.path) declaring folder kinds, as a package's pyproject does:
    `made_up` (a module of its own), `zz_broken` (a module that does not exist), `zz_wrong` (not a FolderKind)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "made_up_kinds.py").write_text(PLUGIN)
    info = site / "made_up_kinds-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: made-up-kinds\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINTS}]\nmade_up = made_up_kinds:KIND\n"
                                           "zz_broken = no_such_module_here:KIND\n"
                                           "zz_wrong = made_up_kinds:NOT_A_KIND\n")
    monkeypatch.syspath_prepend(str(site))
    yield __import__("made_up_kinds")


def test_a_kind_declared_by_entry_point_is_found_and_loads_its_folder(plugin, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "made_up.json").write_text("{}")
    name, kind = find_folder_kind(folder)
    assert name == "made_up" and kind is plugin.KIND and isinstance(kind, FolderKind)
    assert load_inference_model(folder, table_tier="disk", table_dir=tmp_path / "t") == ("model", "tokenizer")
    assert plugin.LOADED == [("mine", "disk", tmp_path / "t")]  # the kind opens its tables in the tier asked for


def test_declared_kinds_are_asked_before_engrams_own(plugin):
    kinds, broken = folder_kinds()
    names = list(kinds)
    assert names[-1] == "engram" and "made_up" in names and "qwen4_exp" in names  # (engram-torch's own entry point)
    assert set(broken) == {"zz_broken", "zz_wrong"} and "ModuleNotFoundError" in broken["zz_broken"]


def test_an_unknown_folder_is_one_line_naming_the_kinds_tried(plugin, tmp_path):
    for path in (tmp_path / "empty", tmp_path / "nowhere"):
        if path.name == "empty":
            path.mkdir()
        with pytest.raises(UnknownFolderError) as e:
            load_inference_model(path)
        msg = str(e.value)
        assert isinstance(e.value, FileNotFoundError) and "\n" not in msg and msg.startswith(f"{path}: no model here")
        for name in ("made_up: a made-up folder", "qwen4_exp: a Qwen4Exp model folder", "engram: an engram model",
                     "zz_broken: not loadable (ModuleNotFoundError", "zz_wrong: not loadable"):
            assert name in msg, msg


def test_a_folder_of_engrams_own_kind_is_claimed_by_it(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    assert find_folder_kind(run)[0] == "engram"
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "config.json").write_text('{"model_type": "engram"}')
    assert find_folder_kind(tmp_path / "saved")[0] == "engram"
