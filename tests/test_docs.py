"""The code shown in the docs runs as written."""

import re
import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def test_tables_doc_snippet_runs(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "tables.md").read_text()
    code = re.search(r"## In code\n\n```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "snippet.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(tmp_path / "snippet.py"))
    assert (tmp_path / "train_tables" / "engram_table_L1.safetensors.journal").is_file()


def test_readme_use_it_snippet_runs():
    """The README's first code block: hash, look up the layer's rows, run the math (the tutorial's sizes)."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Use it\n\n```python\n(.*?)```", text, re.S).group(1)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert tuple(ns["rows"].shape) == (1, 4, 16, 64)
    assert tuple(ns["delta"].shape) == (1, 4, 4, 1024) and tuple(ns["gate"].shape) == (1, 4, 4)
