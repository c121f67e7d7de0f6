"""`engram train --config FILE`: your own model sizes over a preset (preset < file < --set), checked in one line."""

import json

import pytest
from conftest import TINY_CORPUS, run_cli

pytestmark = pytest.mark.integration  # (trains models or starts servers: tests/conftest.py)

pytest.importorskip("transformers")

TOML = """\
preset = "tiny"            # the starting point

[model]
hidden_size = 48
num_hidden_layers = 3

[model.engram]
layer_ids = [2]
n_head_per_ngram = 4

[train]
max_steps = 2
lr = 2e-3
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "c.txt"
    path.write_text(TINY_CORPUS)
    return path


def _train(*args) -> int:
    from engram.cli import main

    return main(["train", *map(str, args)])


def _saved(run_dir):
    """The run's final model as `engram eval`/`sample` load it, and its run.json."""
    from engram.model import EngramForCausalLM

    return (EngramForCausalLM.from_pretrained(run_dir / "final").config,
            json.loads((run_dir / "run.json").read_text()))


def test_toml_and_json_configs_train_the_files_model(corpus, tmp_path):
    (tmp_path / "mine.toml").write_text(TOML)
    assert _train("--config", tmp_path / "mine.toml", "--data", corpus, "--out", tmp_path / "t") == 0
    cfg, run = _saved(tmp_path / "t")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (48, 3, 64)  # 64: tiny's own
    assert cfg.engram["layer_ids"] == [2] and cfg.engram["n_head_per_ngram"] == 4
    assert run["preset"] == "tiny" and run["model_overrides"]["engram"]["layer_ids"] == [2]
    assert run["train"]["max_steps"] == 2 and run["train"]["lr"] == 2e-3

    (tmp_path / "mine.json").write_text(json.dumps({"preset": "tiny", "model": {
        "hidden_size": 64, "num_attention_heads": 8, "engram": {"n_embed_per_ngram": 32}}, "train": {"max_steps": 1}}))
    assert _train("--config", tmp_path / "mine.json", "--data", corpus, "--out", tmp_path / "j") == 0
    cfg, run = _saved(tmp_path / "j")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.engram["n_embed_per_ngram"]) == (64, 8, 32)
    assert run["train"]["max_steps"] == 1


def test_set_overrides_the_file_and_resume_keeps_its_model(corpus, tmp_path):
    (tmp_path / "mine.toml").write_text(TOML)
    out = tmp_path / "run"
    assert _train("--config", tmp_path / "mine.toml", "--data", corpus, "--out", out,
                  "--set", "model.hidden_size=64", "--set", "model.engram.layer_ids=[0,2]", "--set", "lr=1e-3") == 0
    cfg, run = _saved(out)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.engram["layer_ids"]) == (64, 3, [0, 2])
    assert run["train"]["lr"] == 1e-3
    # a resume must describe the same model (as for presets); training settings may change
    assert _train("--config", tmp_path / "mine.toml", "--data", corpus, "--out", out, "--resume",
                  "--set", "model.hidden_size=64", "--set", "model.engram.layer_ids=[0,2]", "--max-steps", 3) == 0
    assert json.loads((out / "summary.json").read_text())["step"] == 3
    assert _train("--config", tmp_path / "mine.toml", "--data", corpus, "--out", out, "--resume",
                  "--max-steps", 4) == 2


def test_set_model_field_over_a_preset_without_a_file(corpus, tmp_path):
    assert _train("--preset", "tiny", "--data", corpus, "--out", tmp_path / "r", "--max-steps", 1,
                  "--set", "model.hidden_size=64", "--set", "model.engram.use_short_conv=false") == 0
    cfg, run = _saved(tmp_path / "r")
    assert cfg.hidden_size == 64 and cfg.engram["use_short_conv"] is False
    assert run["model_overrides"] == {"hidden_size": 64, "engram": {"use_short_conv": False}}


def test_precedence_preset_then_file_then_set(tmp_path):
    from engram.training.presets import resolve_job

    (tmp_path / "f.toml").write_text('[model]\nhidden_size = 64\n[train]\nlr = 1e-3\nseed = 4\n')
    job = resolve_job(tmp_path / "f.toml", preset="tiny", sets=["lr=5e-3", "model.num_hidden_layers=3"])
    assert job.preset == "tiny"
    assert job.model == {"hidden_size": 64, "num_hidden_layers": 3}
    assert job.train == {"lr": 5e-3, "seed": 4}
    assert resolve_job(tmp_path / "f.toml").preset == "cpu-small"  # no preset anywhere: the default
    (tmp_path / "p.toml").write_text('preset = "exp"\n')
    assert resolve_job(tmp_path / "p.toml").preset == "exp"
    assert resolve_job(tmp_path / "p.toml", preset="exp").preset == "exp"


BAD_FILES = [
    ("typo.toml", "[model]\nhidden_sise = 64\n", "unknown key model.hidden_sise; did you mean model.hidden_size?"),
    ("misplaced.toml", "hidden_size = 64\n", "unknown key hidden_size; did you mean model.hidden_size?"),
    ("train.toml", "[train]\nlearning_rate = 1e-3\n", "unknown key train.learning_rate"),
    ("type.toml", '[model]\nhidden_size = "big"\n', 'model.hidden_size must be an integer (the preset\'s is 32), '
                                                   'got "big"'),
    ("bool.json", '{"model": {"engram": {"use_gate": 1}}}', "model.engram.use_gate must be true or false"),
    ("date.toml", "[model]\nhidden_size = 2026-01-01\n", "got datetime.date(2026, 1, 1)"),
    ("list.toml", "[model.engram]\nlayer_ids = 1\n", "model.engram.layer_ids must be a list of integers"),
    ("value.toml", "[model]\nnum_attention_heads = 5\n", "num_attention_heads (5) must divide hidden_size (32)"),
    ("layers.toml", "[model]\nnum_hidden_layers = 1\n", "engram layer_ids [1] are outside [0, 1)"),
    ("vocab.toml", "[model]\nvocab_size = 100\n", 'choose its size with train.tokenizer = "bpe:N"'),
    ("syntax.toml", "[model]\nhidden_size = = 64\n", "not valid TOML: Invalid value (at line 2, column 15)"),
    ("syntax.json", '{"model": {\n "hidden_size": 64,\n}}', "not valid JSON: Expecting property name enclosed in "
                                                             "double quotes at line 3, column 1"),
    ("twice.json", '{"model": {"hidden_size": 64, "hidden_size": 48}}', "key 'hidden_size' is given twice"),
    ("top.json", "[1, 2]", "the top level must be an object"),
    ("preset.toml", 'preset = "huge"\n', "unknown preset 'huge'"),
    ("config.yaml", "preset: tiny\n", "name the file *.json or *.toml"),
]


@pytest.mark.parametrize("name,text,msg", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_config_is_one_line(tmp_path, capsys, name, text, msg):
    (tmp_path / name).write_text(text)
    preset = [] if text.startswith("preset") else ["--preset", "tiny"]
    assert _train(*preset, "--config", tmp_path / name, "--out", tmp_path / "x") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and msg in err, err
    assert err.startswith(f"engram: error: {tmp_path / name}") or "unknown preset" in err or "*.toml" in err, err
    assert not (tmp_path / "x").exists()  # refused before anything was written


@pytest.mark.parametrize("sets,msg", [
    (["model.hidden_size=big"], "--set model.hidden_size=big: model.hidden_size must be an integer"),
    (["model.hiden_size=64"], "did you mean model.hidden_size?"),
    (["hidden_size=64"], "--set hidden_size=64: unknown training setting; did you mean model.hidden_size?"),
    (["model.engram.pad_id=0"], "model.engram.pad_id cannot be set: the tokenizer sets it"),
    (["model.use_engram=false"], "pass --no-engram or --baseline instead"),
    (["model.num_attention_heads=0"], "model.num_attention_heads must be positive, got 0"),
])
def test_bad_set_is_one_line(tmp_path, capsys, sets, msg):
    args = [a for s in sets for a in ("--set", s)]
    assert _train("--preset", "tiny", "--out", tmp_path / "x", *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and msg in err, err


def test_conflicting_presets_and_missing_file_are_refused(tmp_path, capsys):
    (tmp_path / "p.toml").write_text('preset = "exp"\n')
    assert _train("--preset", "tiny", "--config", tmp_path / "p.toml") == 2
    assert "--preset tiny disagrees with preset = 'exp'" in capsys.readouterr().err
    assert _train("--config", tmp_path / "none.toml") == 2
    assert f"--config {tmp_path / 'none.toml'}: no such file" in capsys.readouterr().err


@pytest.mark.slow  # moved out of the default run (under 10 min on 2 cores): 9 s
def test_bad_key_through_the_real_command(tmp_path):
    """As a user runs it (a fresh interpreter): one line on stderr, exit status 2, no traceback."""
    (tmp_path / "mine.toml").write_text('preset = "tiny"\n[model]\nnum_layers = 3\n')
    r = run_cli("train", "--config", "mine.toml", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == "engram: error: mine.toml: unknown key model.num_layers; did you mean model.num_hidden_layers?\n"


def test_the_docs_example_files_are_valid(tmp_path):
    """docs/training.md's TOML example and its JSON one-liner resolve (the model config's own checks included)."""
    import re
    from pathlib import Path

    from engram.training.presets import resolve_job

    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    (tmp_path / "mine.toml").write_text(re.search(r"```toml\n(.*?)```", text, re.S).group(1))
    (tmp_path / "mine.json").write_text(re.search(r"JSON: `(\{.*?\})`", text, re.S).group(1))
    toml, js = resolve_job(tmp_path / "mine.toml"), resolve_job(tmp_path / "mine.json")
    assert toml.preset == js.preset == "cpu-small" and toml.model["hidden_size"] == js.model["hidden_size"] == 384
