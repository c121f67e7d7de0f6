"""Checksum manifests: a folder engram saves lists every file's size and sha256, written last; loaders verify.

    DIR/engram_manifest.json   {"format": "engram-manifest/1", "files": {"model.safetensors": {"bytes": N,
                                "sha256": "..."}, ...}}

A flipped byte or a truncated download is then a one-line `IntegrityError` naming the file and the fix,
never a silently different number or a parser traceback. Folders saved before manifests existed
still load, with one warning.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from .utils import atomic_write_bytes, sha256_file

MANIFEST = "engram_manifest.json"
FORMAT = "engram-manifest/1"


class IntegrityError(ValueError):
    """A saved file is missing, truncated or corrupt; the message names it and what to do."""


class UnverifiedWarning(UserWarning):
    """A folder without a checksum manifest was loaded unverified."""


def write_manifest(directory, exclude=()) -> Path:
    """List every file under `directory` (size, sha256) in its manifest, atomically; call it after the last file."""
    d = Path(directory)
    files = sorted(f for f in d.rglob("*") if f.is_file() and f.name != MANIFEST and f.name not in exclude
                   and not f.name.startswith("."))
    entries = {str(f.relative_to(d)): {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in files}
    out = d / MANIFEST
    atomic_write_bytes(out, (json.dumps({"format": FORMAT, "files": entries}, indent=1) + "\n").encode())
    return out


def verify_manifest(directory, fix: str = "re-download it or save it again") -> bool:
    """Check every file listed in `directory`'s manifest; False (and one warning) when it has none."""
    d = Path(directory)
    f = d / MANIFEST
    if not f.is_file():
        warnings.warn(f"{d} has no {MANIFEST} (saved by an older engram): its files are not verified",
                      UnverifiedWarning, stacklevel=2)
        return False
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
        entries = meta["files"]
        if meta.get("format") != FORMAT or not isinstance(entries, dict):
            raise ValueError("not an engram manifest")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{f} is corrupt ({str(e).splitlines()[0]}); {fix}") from None
    for name, e in entries.items():
        p = d / name
        if not p.is_file():
            raise IntegrityError(f"{p} is missing; {fix}")
        size = p.stat().st_size
        if size != e["bytes"]:
            raise IntegrityError(f"{p} is truncated or padded ({size:,} bytes, the manifest says {e['bytes']:,}); {fix}")
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
