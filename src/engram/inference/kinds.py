"""Folder kinds: how to recognise a model folder and load it for inference, and the registry that finds them.

A `FolderKind` says what the folder is (`about`, for messages), whether a folder is one (`matches(path)`: cheap,
reads config.json at most, never raises for a folder of another kind) and how to load it
(`load(path, tier, table_dir) -> (model in eval mode, tokenizer)`, the Engram tables already in `tier`). A `load`
that also takes `dtype=` and `device=` (torch objects or None: `engram.placement`) places the model itself;
another one's model is placed after it loads (`load_inference_model`).

Kinds other packages define (a released model's checkpoint: `qwen4_exp`) are declared in the entry-point group
`engram.folder_kinds` (pyproject.toml: `NAME = "package.module:KIND"`, the way the hash families are found,
`engram.hashing.families`), so the loader never names an integration, not even in a string. They are asked
first, in order of name; engram's own folder (`engram`: a run dir or a save_pretrained folder) is asked last,
since its test is the loosest (any config.json). A folder no kind claims is refused in one line naming every
kind tried.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import EngramError

ENTRY_POINTS = "engram.folder_kinds"


@dataclass(frozen=True)
class FolderKind:
    """One kind of model folder: `about` (what it is, for messages), `matches(path) -> bool`,
    `load(path, tier, table_dir) -> (model, tokenizer)` with the tables in `tier` ("ram", "mmap" or "disk")."""

    about: str
    matches: Callable[[Path], bool]
    load: Callable[..., tuple]


class UnknownFolderError(EngramError, FileNotFoundError):
    """No folder kind claims a path; the message names the kinds tried."""


def _load_engram(path: Path, tier: str, table_dir=None, dtype=None, device=None) -> tuple:
    from ..model import load_model
    from ..placement import place

    model, tok = load_model(path, dtype=dtype)  # (on the CPU: the tables go to their tier before the model moves)
    if tier != "ram":
        from ..tables import offload_tables

        offload_tables(model, tier, table_dir)
    return place(model, None, device), tok


def _is_engram(path: Path) -> bool:
    # a save_pretrained folder, or a run dir (run.json; final/, or its old copy set aside by an interrupted save:
    # `load_model` puts it back); what is missing or wrong there, `load_model` says
    return (path / "config.json").is_file() or (path / "run.json").is_file() or (path / "final").is_dir()


ENGRAM = FolderKind("an engram model (a run dir, or a folder with config.json and model.safetensors)", _is_engram,
                    _load_engram)
BUILTIN = {"engram": ENGRAM}


def _entry_points() -> dict:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}


def folder_kinds() -> tuple[dict[str, FolderKind], dict[str, str]]:
    """({name: kind} in the order they are asked: the declared ones by name, then engram's own}, {name: why it
    could not be loaded} of declared kinds whose module failed to import)."""
    kinds, broken = {}, {}
    for name, ep in sorted(_entry_points().items()):
        if name in BUILTIN:
            continue
        try:
            kind = ep.load()
        except Exception as e:  # (one broken plugin must not stop every other folder from loading)
            broken[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        if all(callable(getattr(kind, a, None)) for a in ("matches", "load")):
            kinds[name] = kind
        else:
            broken[name] = f"{ep.value} is not a FolderKind (it needs matches and load)"
    return {**kinds, **BUILTIN}, broken


def find_folder_kind(path) -> tuple[str, FolderKind]:
    """(name, kind) of the first kind that claims the folder `path`, or an `UnknownFolderError` naming them all."""
    p = Path(path)
    kinds, broken = folder_kinds()
    for name, kind in kinds.items():
        if p.is_dir() and kind.matches(p):
            return name, kind
    tried = "; ".join(f"{name}: {getattr(kind, 'about', '?')}" for name, kind in kinds.items())
    unusable = "".join(f"; {name}: not loadable ({why})" for name, why in broken.items())
    raise UnknownFolderError(f"{path}: no model here (not a folder of any kind engram loads; tried {tried}{unusable})")
