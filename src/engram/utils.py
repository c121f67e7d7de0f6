"""Small shared helpers: peak memory, cache location, the run environment (files and digests live in persist.py)."""

from __future__ import annotations

import os
from pathlib import Path


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB.

    Linux: the high-water mark of this process's own memory map (`VmHWM` in /proc/self/status), which starts
    afresh at exec. Not `ru_maxrss`: Linux carries it across fork and exec, so a run started by a driver that
    had grown to 5.8 GiB reported 5.8 GiB whatever it used itself (every test-seed run of the first
    smollm2-adapt record; issue 48 saw the same in §8's). Elsewhere `ru_maxrss` (KiB on Linux, bytes on macOS).
    """
    import resource
    import sys

    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024



def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current resident size (Linux: "5" into /proc/self/clear_refs), so that
    `peak_rss_mib` then reads the peak of what runs after; False where the system does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def parse_toml(text: str, where: str, error: type[Exception]) -> dict:
    """`text` parsed as TOML (tomllib; `tomli` on Python 3.10), or `error` in one line naming `where` and why."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise error(f"{where}: reading TOML needs Python 3.11+ or the tomli package (pip install tomli)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{where}: not valid TOML: {str(e).splitlines()[0]}") from None


def cache_dir() -> Path:
    """Where derived artifacts (tokenizer lookup tables) are cached.

    `$ENGRAM_CACHE_DIR`, else `$XDG_CACHE_HOME/engram`, else `~/.cache/engram`.
    """
    if os.environ.get("ENGRAM_CACHE_DIR"):
        return Path(os.environ["ENGRAM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "engram"


def git_state(where: Path) -> tuple[str | None, bool | None]:
    """(HEAD commit, dirty) of the git checkout holding `where`; dirty: a tracked file differs from that commit
    (untracked files do not count), so the commit alone does not name the code. (None, None) outside a checkout."""
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
        if commit is None:
            return None, None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                    capture_output=True, text=True, timeout=5).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, dirty


def environment() -> dict:
    """What a result depends on besides the code and the seed: library versions, threads, CPU, ENGRAM_FUSED, the
    commit of this checkout and `dirty` (its tracked files differ from it; both None outside a git checkout). Runs
    record it in summary.json."""
    import platform
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
    commit, dirty = git_state(Path(__file__).parent)
    return {"torch": version("torch"), "numba": version("numba"), "transformers": version("transformers"),
            "tokenizers": version("tokenizers"), "engram": version("engram-torch"), "python": platform.python_version(),
            "threads": threads, "cpu": cpu, "cpus": os.cpu_count(), "ENGRAM_FUSED": os.environ.get("ENGRAM_FUSED", "1"),
            "commit": commit, "dirty": dirty}
