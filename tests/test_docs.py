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
