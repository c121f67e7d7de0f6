"""Small shared helpers: content hashing, peak memory, cache location (atomic writes live in persist.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .persist import atomic_write_bytes  # noqa: F401  (its home is persist.py)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def cache_dir() -> Path:
    """Where derived artifacts (tokenizer lookup tables) are cached.

    `$ENGRAM_CACHE_DIR`, else `$XDG_CACHE_HOME/engram`, else `~/.cache/engram`.
    """
    if os.environ.get("ENGRAM_CACHE_DIR"):
        return Path(os.environ["ENGRAM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "engram"
