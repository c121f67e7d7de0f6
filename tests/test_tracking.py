"""`--report-to tensorboard|trackio` (`engram.training.tracking`): every metrics.jsonl record reaches the trackers,
read back from their own files (TensorBoard's event files, trackio's local SQLite store); a resumed run's trackers
hold each step once; bad names and missing packages are one line."""

import importlib.util
import json
import sys

import pytest

pytest.importorskip("transformers")

from conftest import TINY_CORPUS  # noqa: E402

from engram.config import ConfigError  # noqa: E402
from engram.persist import remove_tree  # noqa: E402
from engram.training.checkpoint import checkpoints  # noqa: E402
from engram.training.tracking import check_report_to, parse_report_to  # noqa: E402

TINY = {"ckpt_every": 5, "eval_every": 5}


@pytest.fixture
def corpus(tmp_path):
    c = tmp_path / "c.txt"
    c.write_text(TINY_CORPUS)
    return c


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _series(records, key):
    return [(r["step"], r[key]) for r in records if key in r]


def test_report_to_names_parse_and_bad_ones_are_one_line(tmp_path, corpus, monkeypatch, capsys):
    assert parse_report_to("tensorboard, trackio") == ("tensorboard", "trackio")
    assert parse_report_to(["tensorboard", "trackio,tensorboard"]) == ("tensorboard", "trackio")
    assert parse_report_to("") == parse_report_to("none") == parse_report_to(None) == ()
    with pytest.raises(ConfigError, match="'none' with trackers"):
        parse_report_to("none,tensorboard")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install -e '\.\[track\]'"):
        check_report_to("tensorboard,trackio")
    from engram.cli import main

    for flags, msg in ((["--report-to", "wandb"], "unknown tracker 'wandb'"),
                       (["--report-to", "tensorboard,trackio"], "needs the trackio package"),
                       (["--set", "report_to=trackio"], "needs the trackio package")):
        code = main(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(tmp_path / "x"), *flags])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and msg in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()  # refused before any data was read or folder made


@pytest.mark.integration  # (trains)
def test_tensorboard_scalars_equal_the_metrics_and_a_resume_keeps_one_point_per_step(tmp_path, corpus, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from engram.cli import main
    from engram.training.train import train

    run = tmp_path / "run"
    train("tiny", data=[str(corpus)], out=run, max_steps=10, overrides={**TINY, "report_to": "tensorboard"},
          progress=False, stop_after=8)
    assert [c.name for c in checkpoints(run)] == ["step_000008", "step_000005"]
    remove_tree(checkpoints(run)[0])  # killed after step 8 before its checkpoint: steps 6-8 are run again
    code = main(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(run), "--max-steps", "10",
                 "--set", "ckpt_every=5", "--set", "eval_every=5", "--resume"])  # (no --report-to: the run's own)
    assert code == 0, capsys.readouterr().err
    assert json.loads((run / "run.json").read_text())["train"]["report_to"] == "tensorboard"
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    records = _metrics(run)
    assert [r["step"] for r in records] == list(range(11))
    for key in ("train_loss", "val_loss", "lr"):
        steps, values = zip(*_series(records, key))
        assert [e.step for e in events.Scalars(key)] == list(steps), key  # each step once (purge_step)
        assert [e.value for e in events.Scalars(key)] == pytest.approx(values, rel=1e-6), key  # (stored as float32)


@pytest.fixture
def trackio_dir(tmp_path, monkeypatch):
    """trackio's local store in tmp_path, and nothing that could send it elsewhere: TRACKIO_DIR is read when trackio
    is imported, so the modules already imported get the folder too."""
    d = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(d))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for v in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID", "TRACKIO_DATASET_ID"):
        monkeypatch.delenv(v, raising=False)
    pytest.importorskip("trackio")
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] == "trackio" and hasattr(mod, "TRACKIO_DIR"):
            monkeypatch.setattr(mod, "TRACKIO_DIR", d)
    return d


@pytest.mark.integration  # (trains)
def test_trackio_logs_every_record_locally(tmp_path, corpus, trackio_dir):
    from trackio.sqlite_storage import SQLiteStorage

    from engram.training.train import train

    run = tmp_path / "trk"
    train("tiny", data=[str(corpus)], out=run, max_steps=6, overrides={**TINY, "report_to": "trackio"},
          progress=False)
    assert (trackio_dir / "engram.db").is_file()
    logged = SQLiteStorage.get_logs("engram", "trk")
    records = _metrics(run)
    for key in ("train_loss", "val_loss", "lr", "tok_s"):
        assert _series(logged, key) == _series(records, key), key
