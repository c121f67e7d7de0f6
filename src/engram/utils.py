"""Small shared helpers: peak memory, cache location, the run environment (files and digests live in persist.py)."""

from __future__ import annotations

import os
from pathlib import Path


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


def environment() -> dict:
    """What a result depends on besides the code and the seed: library versions, threads, CPU, ENGRAM_FUSED and
    the commit of this checkout (None outside a git checkout). Runs record it in summary.json."""
    import platform
    import subprocess
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:
        threads = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"torch": version("torch"), "numba": version("numba"), "transformers": version("transformers"),
            "tokenizers": version("tokenizers"), "engram": version("engram-torch"), "python": platform.python_version(),
            "threads": threads, "cpu": cpu, "cpus": os.cpu_count(), "ENGRAM_FUSED": os.environ.get("ENGRAM_FUSED", "1"),
            "commit": commit}
