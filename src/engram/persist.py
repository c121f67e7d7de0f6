"""Persistence helpers, the only ones: atomic files, folders replaced without a gap, JSON read or one-line error.

Everything engram saves (models, checkpoints, adapters, overlays, caches, configs) goes through these:

- `atomic_write_bytes(path, data)`: readers see the old file or the whole new one.
- `replace_dir(tmp, final)`: a folder written completely under `tmp` takes the place of `final`, and
  `final` is never left empty: the old folder is moved aside, the new one moved in, then the old one
  deleted. A crash between the steps leaves `.NAME.replaced` beside it; `recover_dir(final)` (which
  every loader calls) puts the old folder back if the new one never arrived, or deletes it if it did.
- `read_json(path, what, fix)`: the parsed object, or one error naming the file, the problem and the fix.

Standard library only: the core modules import this first.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# The three filesystem steps of `replace_dir`, as names the crash tests can interrupt.
_rename = os.replace
_remove_tree = shutil.rmtree


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so readers see either the old file or the whole new one.

    Writes a temp file in the same directory, fsyncs it and renames it over `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_json(path, obj, indent: int | None = 1) -> None:
    """`obj` as JSON (newline-terminated), atomically."""
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=indent) + "\n").encode("utf-8"))


def _aside(final: Path) -> Path:
    return final.with_name(f".{final.name}.replaced")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_dir_for(final) -> Path:
    """A fresh, empty sibling folder to write `final`'s new contents into (a leftover one is removed)."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def recover_dir(final) -> None:
    """Finish or undo an interrupted `replace_dir(…, final)`: afterwards `final` is the old or the new folder.

    The new folder arrives with one rename, so if `final` exists it is complete and the aside copy is
    stale; if it does not, the aside copy is the old folder and goes back.
    """
    final = Path(final)
    old = _aside(final)
    if not old.exists():
        return
    if final.exists():
        _remove_tree(old, ignore_errors=True)
    else:
        _rename(old, final)
        _fsync_dir(final.parent)


def replace_dir(tmp, final) -> Path:
    """Move the complete folder `tmp` to `final`, replacing what was there without ever leaving `final` empty.

    Steps: (1) `final` -> `.final.replaced`, (2) `tmp` -> `final`, (3) delete `.final.replaced`.
    A crash after (1) leaves the old folder aside (`recover_dir` puts it back); after (2) the new one
    is in place (`recover_dir` deletes the old). `tmp` and `final` must be on one filesystem.
    """
    tmp, final = Path(tmp), Path(final)
    recover_dir(final)
    old = _aside(final)
    if final.exists():
        _rename(final, old)
    _rename(tmp, final)
    _fsync_dir(final.parent)
    if old.exists():
        _remove_tree(old)
    return final


def read_json(path, what: str, fix: str, error: type[Exception] = ValueError, expect: type = dict):
    """The JSON object in `path`, or `error` with one line naming the file, what is wrong and `fix`.

    `what` names the file for a reader ("hash spec", "adapter config"); `expect` is the top-level type.
    """
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} not found: {p} ({fix})")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{what} {p} is corrupt (not valid JSON: {e}); {fix}") from None
    if expect is not None and not isinstance(obj, expect):
        raise error(f"{what} {p} is corrupt (a JSON {expect.__name__} was expected, found {type(obj).__name__}); {fix}")
    return obj
