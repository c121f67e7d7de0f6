"""Preregistrations the code enforces (prereg.py): --record refuses an uncommitted design or a dirty tree,
the stamp names the committed blob, and every committed record that names a preregistration checks out against
git (the prereg precedes the run, the design is the file's)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from engram_experiments import prereg
from engram_experiments.runs import ExperimentError

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]
DESIGN = 'experiment = "x"\nstatus = "confirmatory"\n[test]\nseeds = [1, 2, 3]\n'


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git(tmp_path, "add", "code.py")
    git(tmp_path, "commit", "-qm", "code")
    return tmp_path


def write_prereg(repo: Path, text: str = DESIGN) -> Path:
    f = repo / "docs" / "prereg" / "x.toml"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    return f


def test_record_refuses_an_uncommitted_prereg_and_a_dirty_tree(repo):
    with pytest.raises(ExperimentError, match="no preregistration"):
        prereg.load("x", record=True, repo=repo)
    write_prereg(repo)
    with pytest.raises(ExperimentError, match="not committed"):
        prereg.load("x", record=True, repo=repo)
    assert prereg.load("x", record=False, repo=repo).stamp()["status"] == "exploratory"  # exploratory runs go on
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "prereg")
    (repo / "code.py").write_text("x = 2\n")
    with pytest.raises(ExperimentError, match="uncommitted changes"):
        prereg.load("x", record=True, repo=repo)
    git(repo, "checkout", "code.py")
    p = prereg.load("x", record=True, repo=repo)
    stamp = p.stamp()
    assert stamp["status"] == "confirmatory" and not stamp["dirty"]
    assert stamp["blob"] == git(repo, "rev-parse", "HEAD:docs/prereg/x.toml")
    assert stamp["commit"] == git(repo, "rev-parse", "HEAD")
    assert p.design["test"]["seeds"] == [1, 2, 3]
    # an edit after the commit is not the preregistered design any more
    write_prereg(repo, DESIGN.replace("[1, 2, 3]", "[1, 2]"))
    with pytest.raises(ExperimentError, match="not committed as it stands"):
        prereg.load("x", record=True, repo=repo)


def test_record_refuses_an_exploratory_design(repo):
    write_prereg(repo, DESIGN.replace("confirmatory", "exploratory"))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "prereg")
    with pytest.raises(ExperimentError, match="only a confirmatory design records"):
        prereg.load("x", record=True, repo=repo)


def test_check_record_catches_a_changed_design_and_a_prereg_written_after_the_run(repo):
    write_prereg(repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "prereg")
    p = prereg.load("x", record=True, repo=repo)
    good = {"prereg": p.stamp(), "design": p.design}
    assert prereg.check_record(good, repo) == []
    assert any("design differs" in x for x in prereg.check_record({**good, "design": {"test": {"seeds": [1]}}}, repo))
    first = git(repo, "rev-list", "--max-parents=0", "HEAD")  # the commit before the prereg existed
    late = {**good, "prereg": {**good["prereg"], "commit": first}}
    problems = prereg.check_record(late, repo)
    assert any("not an ancestor" in x for x in problems) and any("does not hold" in x for x in problems)
    assert prereg.check_record({"design": {}}, repo) == ["the record names no preregistration"]


def committed_records() -> list[Path]:
    return sorted(f for f in (REPO / "docs" / "results").glob("*.json") if '"prereg"' in f.read_text())


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs this repository's git history")
@pytest.mark.parametrize("path", committed_records() or [None], ids=lambda p: p.name if p else "none-yet")
def test_every_committed_record_checks_out_against_its_prereg(path):
    if path is None:
        pytest.skip("no committed record names a preregistration yet")
    assert prereg.check_record(json.loads(path.read_text()), REPO) == []
