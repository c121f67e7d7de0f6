"""Preregistrations that the code enforces: an experiment's design lives in `docs/prereg/<experiment>.toml`,
committed before its confirmatory runs, and the experiment reads its design from that file.

* `load(name, record=...)` reads the file from the checkout the command runs in (the git work tree of the current
  directory). With `record` (the experiment was asked to write `--record`), it refuses in one line unless the file
  is committed and the whole tree is clean: a record then names exactly the code and the design that made it.
* `Prereg.stamp()` is what the record stores: the file's path, its git blob id, the commit that ran, whether the
  tree was dirty (only exploratory runs can be) and the status (`confirmatory` or `exploratory`: a run without
  `--record`, or from a dirty tree, is labelled exploratory).
* `check_record(record, repo)` is what tests/test_prereg.py runs on every committed record that names a
  preregistration: the prereg's blob exists in git, the commit that added it is an ancestor of the record's
  commit, and the design the record states equals the file at that blob.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from engram.utils import git_state, parse_toml

from .runs import ExperimentError

PREREG_DIR = Path("docs") / "prereg"


def _git(repo: Path, *args: str, check: bool = True) -> str:
    r = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ExperimentError(f"git {' '.join(args)} failed in {repo}: {r.stderr.strip().splitlines()[-1:]}")
    return r.stdout.strip()


def repo_root(start: Path | None = None) -> Path | None:
    """The git work tree holding `start` (default: the current directory), None outside one."""
    r = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=start or Path.cwd(), capture_output=True,
                       text=True)
    return Path(r.stdout.strip()) if r.returncode == 0 else None


@dataclass(frozen=True)
class Prereg:
    """One preregistration as read for a run: `design` (the parsed TOML), where it is and what git says of it."""

    name: str
    path: str  # relative to the repo root
    design: dict
    blob: str | None  # git blob id of the committed file; None when it is not committed
    commit: str | None
    dirty: bool
    confirmatory: bool

    def stamp(self) -> dict:
        return {"file": self.path, "blob": self.blob, "commit": self.commit, "dirty": self.dirty,
                "status": "confirmatory" if self.confirmatory else "exploratory"}


def load(name: str, record: bool, repo: Path | None = None) -> Prereg:
    """The preregistration `docs/prereg/<name>.toml` of the checkout `repo` (default: the one around the current
    directory). `record`: refuse unless it is committed, unchanged and the tree is clean."""
    repo = repo or repo_root()
    if repo is None:
        raise ExperimentError(f"the {name} experiment reads its design from {PREREG_DIR}/{name}.toml: run it from a "
                              "git checkout of engram")
    rel = PREREG_DIR / f"{name}.toml"
    f = repo / rel
    if not f.is_file():
        raise ExperimentError(f"{f}: no preregistration for {name}; write and commit it before the runs")
    design = parse_toml(f.read_text(encoding="utf-8"), str(f), ExperimentError)
    commit, dirty = git_state(repo)
    if commit is None:
        raise ExperimentError(f"{repo}: git cannot read this checkout's HEAD; commit something first")
    blob = _git(repo, "rev-parse", f"HEAD:{rel.as_posix()}", check=False) or None
    if blob and _git(repo, "hash-object", str(f)) != blob:
        blob = None  # the file on disk is not the committed one
    if record and blob is None:
        raise ExperimentError(f"{rel} is not committed as it stands; commit the preregistration before recording")
    if record and dirty:
        raise ExperimentError("the working tree has uncommitted changes; commit them (or stash) before --record: a "
                              "record must name the code that made it")
    if record and design.get("status") != "confirmatory":
        raise ExperimentError(f"{rel} says status = {design.get('status')!r}; only a confirmatory design records")
    return Prereg(name, rel.as_posix(), design, blob, commit, dirty, bool(record and blob and not dirty))


def check_record(rec: dict, repo: Path) -> list[str]:
    """What is wrong with a committed record's preregistration (empty when nothing): the blob must exist, the
    commit that added the prereg file must be an ancestor of (or equal to) the commit that ran, the tree must have
    been clean, and the record's `design` must equal the file at that blob."""
    p = rec.get("prereg")
    if not p:
        return ["the record names no preregistration"]
    problems = []
    if p.get("status") != "confirmatory" or p.get("dirty"):
        problems.append(f"status {p.get('status')}, dirty {p.get('dirty')}")
    text = _git(repo, "cat-file", "-p", p["blob"], check=False) if p.get("blob") else ""
    if not text:
        return problems + [f"blob {p.get('blob')} of {p.get('file')} is not in this repository"]
    added = _git(repo, "log", "--diff-filter=A", "--format=%H", "--", p["file"], check=False).splitlines()
    if not added:
        problems.append(f"{p['file']} was never added in git history")
    elif subprocess.run(["git", "merge-base", "--is-ancestor", added[-1], p["commit"]], cwd=repo).returncode != 0:
        problems.append(f"the prereg's first commit {added[-1][:9]} is not an ancestor of the run's {p['commit'][:9]}")
    if _git(repo, "rev-parse", f"{p['commit']}:{p['file']}", check=False) != p["blob"]:
        problems.append(f"the run's commit {p['commit'][:9]} does not hold that version of {p['file']}")
    if parse_toml(text, p["blob"], ExperimentError) != rec.get("design"):
        problems.append("the record's design differs from the preregistered file")
    return problems
