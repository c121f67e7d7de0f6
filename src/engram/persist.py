"""Persistence, the one home: every file and folder engram writes or reads of its own goes through here.

Writes never leave a reader with neither the old nor the new:

- `atomic_write_bytes(path, data)` / `write_json(path, obj)`: a whole file, atomically.
- `atomic_file(path)`: the same for a file written in pieces (a context manager yielding the open file).
- `new_dir(final)`: a folder written under a temp sibling, its checksum manifest written last, then
  swapped in with `replace_dir`, which never leaves `final` empty: the old folder is moved aside, the
  new one moved in, then the old one deleted. A crash between the steps leaves `.NAME.replaced`
  beside it; `recover_dir(final)` (which every loader calls) puts the old folder back if the new one
  never arrived, or deletes it if it did.
- `remove_tree(path)`: delete a folder engram owns (a stale temp folder, a cache entry).

Reads fail in one line naming the file, the problem and the fix:

- `read_json(path, what, fix)`, `read_jsonl(path)` (append-only logs: a torn last line is skipped).
- `write_manifest(dir)` / `verify_manifest(dir)` / `verify_saved(...)`: the one manifest format,
  `DIR/engram_manifest.json = {"format": "engram-manifest/1", "files": {name: {"bytes", "sha256"}},
  "info": {...}}` (`info`: what the folder is, for folders that describe themselves, e.g. prepared data).
- `sha256_file` / `sha256_bytes`: the one place digests are computed.

Standard library only: the core modules import this first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

from .errors import EngramError

MANIFEST = "engram_manifest.json"
MANIFEST_FORMAT = "engram-manifest/1"


class IntegrityError(EngramError, ValueError):
    """A saved file is missing, truncated or corrupt; the message names it and what to do."""


class UnverifiedWarning(UserWarning):
    """A folder without a checksum manifest was loaded unverified."""


def sha256_file(path) -> str:
    """Hex sha256 of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# The three filesystem steps of `replace_dir`, as names the crash tests can interrupt.
_rename = os.replace
_remove_tree = shutil.rmtree


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so readers see either the old file or the whole new one (see `atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data)


def write_json(path, obj, indent: int | None = 1) -> None:
    """`obj` as JSON (newline-terminated), atomically."""
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=indent) + "\n").encode("utf-8"))


def write_jsonl(path, records) -> None:
    """Records as JSON lines, atomically (a whole file; logs that grow use `append_jsonl`)."""
    atomic_write_bytes(Path(path), "".join(json.dumps(r) + "\n" for r in records).encode("utf-8"))


def append_jsonl(path, record: dict) -> None:
    """Append one record to a JSON-lines log, flushed and fsynced (a crash can tear only the last line,
    which `read_jsonl` skips)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_file(path, mode: str = "wb") -> Iterator:
    """Write a file in pieces so readers see the old file or the whole new one.

    Yields a file open on a temp sibling; on a clean exit it is flushed, fsynced and renamed over
    `path`; on an exception the temp file is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: give it the mode open() would (the umask's)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask, read without changing it (os.umask sets it to read it; another thread could create a
    file in between), from /proc where there is one."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


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


def _temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp")


def temp_dir_for(final) -> Path:
    """A fresh, empty sibling folder to write `final`'s new contents into (a leftover one is removed)."""
    tmp = _temp_path(Path(final))
    if tmp.exists():
        _remove_tree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def remove_tree(path, missing_ok: bool = True) -> None:
    """Delete a folder engram owns (a stale temp folder, a cache entry, an old checkpoint)."""
    path = Path(path)
    if path.exists() or not missing_ok:
        _remove_tree(path)


@contextlib.contextmanager
def new_dir(final, manifest: bool = True, info: dict | None = None, exclude=()) -> Iterator[Path]:
    """Write a folder aside and swap it in: `with new_dir(out) as tmp: ...write files into tmp...`.

    On a clean exit the checksum manifest is written last (unless `manifest=False`; `info` is stored
    in it) and the folder replaces `final` with `replace_dir`; on an exception the temp folder is
    removed and `final` is untouched. `exclude`: file names the manifest leaves out.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_for(final)
    try:
        yield tmp
        if manifest:
            write_manifest(tmp, exclude=exclude, info=info)
        replace_dir(tmp, final)
    except BaseException:
        _remove_tree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def new_dir_shared(final, lead: bool, barrier, manifest: bool = True, info: dict | None = None) -> Iterator[Path]:
    """`new_dir` written by several processes at once (the ranks of a sharded save); every one of them enters it.

    Each process gets the same temp folder and writes its own files into it; `lead` (exactly one process)
    makes it, and once `barrier()` says every process's files are in, writes the manifest and swaps the
    folder in (`replace_dir`), so a crash at any step leaves `final` old or new, complete. On return the
    new folder is in place for every process.
    """
    final = Path(final)
    if lead:
        with new_dir(final, manifest=manifest, info=info) as tmp:
            barrier()  # the temp folder exists
            yield tmp
            barrier()  # every process's files are in
    else:
        barrier()
        yield _temp_path(final)  # the folder `temp_dir_for(final)` made on the lead
        barrier()
    barrier()  # swapped in


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
    return decode_json_bytes(p.read_bytes(), f"{what} {p}", fix, error, expect)


def decode_json_bytes(raw: bytes, what: str, fix: str, error: type[Exception] = ValueError, expect: type = dict):
    """The JSON value in `raw`, a header inside one of engram's binary files (a safetensors header, the block
    sums' header), or `error` in one line: "`what` is corrupt (not valid JSON: ...); `fix`"."""
    try:
        obj = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise error(f"{what} is corrupt (not valid JSON: {str(e).splitlines()[0]}); {fix}") from None
    if expect is not None and not isinstance(obj, expect):
        raise error(f"{what} is corrupt (a JSON {expect.__name__} was expected, found {type(obj).__name__}); {fix}")
    return obj


def read_jsonl(path, what: str = "log", fix: str = "", error: type[Exception] = ValueError,
               skip_damaged: bool = False) -> list:
    """Every record of a JSON-lines file; a torn last line (a crash mid-append) is skipped, a bad line
    elsewhere raises `error`. A missing file is an empty log. `skip_damaged`: skip every unreadable line
    (bad bytes included) instead, for a log its writer rebuilds (a run's metrics.jsonl)."""
    p = Path(path)
    if not p.is_file():
        return []
    lines = p.read_bytes().decode("utf-8", errors="replace" if skip_damaged else "strict").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if skip_damaged or i == len(lines) - 1:
                continue
            raise error(f"{what} {p} line {i + 1} is corrupt (not valid JSON); {fix}".rstrip("; ")) from None
    return out


# ------------------------------------------------------------------------------------------ manifests


def write_manifest(directory, exclude=(), info: dict | None = None, files=None) -> Path:
    """List every file under `directory` (size, sha256) in its manifest, atomically; call it after the last file.

    `info`: what the folder is (stored as the manifest's `"info"`), for folders that describe themselves.
    `files`: list only these (names relative to `directory`), for a folder shared with files of others.
    """
    d = Path(directory)
    if files is not None:
        files = sorted(d / f for f in files)
    else:
        files = sorted(f for f in d.rglob("*") if f.is_file() and f.name != MANIFEST and f.name not in exclude
                       and not f.name.startswith("."))
    entries = {str(f.relative_to(d)): {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in files}
    meta: dict = {"format": MANIFEST_FORMAT, "files": entries}
    if info is not None:
        meta["info"] = info
    out = d / MANIFEST
    write_json(out, meta)
    return out


def read_manifest(directory, fix: str = "re-download it or save it again") -> dict | None:
    """The manifest of `directory` (None when it has none), or `IntegrityError` when it is corrupt."""
    f = Path(directory) / MANIFEST
    if not f.is_file():
        return None
    meta = read_json(f, "manifest", fix, IntegrityError)
    if meta.get("format") != MANIFEST_FORMAT or not isinstance(meta.get("files"), dict):
        raise IntegrityError(f"{f} is corrupt (not an engram manifest); {fix}")
    return meta


def verify_manifest(directory, fix: str = "re-download it or save it again") -> bool:
    """Check every file listed in `directory`'s manifest; False (and one warning) when it has none."""
    d = Path(directory)
    meta = read_manifest(d, fix)
    if meta is None:
        warnings.warn(f"{d} has no {MANIFEST} (saved by an older engram): its files are not verified",
                      UnverifiedWarning, stacklevel=2)
        return False
    for name, e in meta["files"].items():
        p = d / name
        if not p.is_file():
            raise IntegrityError(f"{p} is missing; {fix}")
        size = p.stat().st_size
        if size != e["bytes"]:
            raise IntegrityError(f"{p} is truncated or padded ({size:,} bytes, the manifest says "
                                 f"{e['bytes']:,}); {fix}")
        if sha256_file(p) != e["sha256"]:
            raise IntegrityError(f"{p} is corrupt (sha256 differs from the manifest); {fix}")
    return True


def verify_saved(directory, legacy: dict | None, what: str, fix: str, error: type[Exception]) -> None:
    """Check a saved folder (a checkpoint, an adapter): against its manifest, or, for a folder saved before 0.2,
    against the sha256 digests its own JSON lists (`legacy`, {file: digest}). Raises `error` in one line."""
    d = Path(directory)
    if legacy is not None:
        for name, digest in legacy.items():
            if not (d / name).is_file():
                raise error(f"{d / name} is missing ({what} incomplete)")
            if sha256_file(d / name) != digest:
                raise error(f"{d / name} is truncated or corrupt (sha256 mismatch)")
        return
    if not (d / MANIFEST).is_file():
        raise error(f"{d / MANIFEST} is missing ({what} incomplete); {fix}")
    try:
        verify_manifest(d, fix)
    except IntegrityError as e:
        raise error(f"{what} truncated or corrupt: {e}") from None
