"""benchmarks/_record.append_run: the one writer of the benchmarks' JSON records."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _record import append_run  # noqa: E402


def test_append_run_creates_then_appends(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--rounds", "2"])
    rec = tmp_path / "bench-x.json"
    append_run(rec, "python benchmarks/bench_x.py", {"ratio": 1.5})
    append_run(rec, "python benchmarks/bench_x.py [ignored once the file exists]", {"ratio": 2.0})
    append_run(rec, "unused", {"steps": 3}, key="profiles")
    data = json.loads(rec.read_text())
    assert data["command"] == "python benchmarks/bench_x.py"
    assert [r["ratio"] for r in data["runs"]] == [1.5, 2.0]
    assert data["profiles"][0]["steps"] == 3
    run = data["runs"][0]
    assert run["argv"] == ["--rounds", "2"] and "date" in run
    assert "python" in json.dumps(run["environment"]).lower()
    assert [p.name for p in tmp_path.iterdir()] == ["bench-x.json"]  # nothing left aside
