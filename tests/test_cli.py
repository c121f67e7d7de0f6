import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli as run

from engram import BackBoneConfig, EngramConfig, save_config


@pytest.fixture
def tiny_config(tmp_path):
    p = tmp_path / "engram_config.json"
    save_config(p, EngramConfig(engram_vocab_size=[1009, 1013], n_embed_per_ngram=32, n_head_per_ngram=4,
                                layer_ids=[1]),
                BackBoneConfig(hidden_size=32, hc_mult=4, vocab_size=129280, num_layers=3))
    return p


@pytest.mark.integration
@pytest.mark.parametrize("mock", [True, pytest.param(False, marks=pytest.mark.slow)])  # (False: 16 s, -m slow)
def test_demo_with_small_config(tiny_config, mock):
    r = run("demo", "--config", str(tiny_config), "--text", "Only Alexander the Great",
            *(["--mock-blocks"] if mock else []))
    assert r.returncode == 0, r.stderr
    # tokenized as the tutorial's AutoTokenizer does: BOS first, then the 4 text tokens
    assert "Tokens     : ['<｜begin▁of▁sentence｜>', 'Only'" in r.stdout and "BOS" in r.stdout
    assert "Input shape  : [1, 5]" in r.stdout
    assert "Output shape : [1, 5, 129280]" in r.stdout
    assert "Layer  1: hash shape [1, 5, 8]; gate min" in r.stdout
    assert "peak RSS" in r.stdout
    r = run("demo", "--config", str(tiny_config), "--text", "Only Alexander the Great", "--no-bos", "--mock-blocks")
    assert r.returncode == 0, r.stderr
    assert "Input shape  : [1, 4]" in r.stdout and "without a BOS token" in r.stdout


@pytest.mark.integration
def test_hash_prints_tokens_and_rows(tiny_config):
    r = run("hash", "Alexander the Great", "--config", str(tiny_config))
    assert r.returncode == 0, r.stderr
    assert "Alexander" in r.stdout and "layer 1: per-head row ids [T=4, 8]" in r.stdout
    assert "  0  '<｜begin▁of▁sentence｜>'       0" in r.stdout
    r = run("hash", "Alexander the Great", "--config", str(tiny_config), "--no-bos")
    assert r.returncode == 0 and "layer 1: per-head row ids [T=3, 8]" in r.stdout, r.stderr


@pytest.mark.integration
def test_spec_writes_manifest(tmp_path, tiny_config):
    out = tmp_path / "spec.json"
    r = run("spec", "--out", str(out), "--config", str(tiny_config), "--no-table")
    assert r.returncode == 0, r.stderr
    spec = json.loads(out.read_text())
    assert spec["layer_ids"] == [1] and "lookup_table_int32_le_b64" not in spec
    assert len(spec["layers"]["1"]["head_moduli"]) == 2


@pytest.mark.parametrize(
    "args, content, match",
    [
        (["demo", "--config", "{cfg}"], {"engram": {"bogus": 1}}, "unknown key(s) in section 'engram': bogus"),
        (["demo", "--config", "{cfg}"], "{oops", "not valid JSON"),
        (["hash", "x", "--config", "{cfg}"], {"engram": {"layer_ids": [99]}}, "outside [0, 30)"),
        (["demo", "--config", "/nonexistent/engram_config.json"], None, "config file not found"),
        (["demo", "--text", "", "--mock-blocks", "--config", "{cfg}"],
         {"backbone": {"hidden_size": 32, "num_layers": 2},
          "engram": {"layer_ids": [1], "engram_vocab_size": [1009, 1013]}}, "--text is empty after tokenization"),
        (["spec", "--out", "x.json", "--config", "{cfg}"], {"engram": {"tokenizer_name_or_path": "/no/such/dir"}},
         "tokenizer not found"),
    ],
)
@pytest.mark.integration
def test_cli_errors_are_one_line(tmp_path, args, content, match):
    cfg = tmp_path / "c.json"
    if content is not None:
        cfg.write_text(content if isinstance(content, str) else json.dumps(content))
    r = run(*[a.replace("{cfg}", str(cfg)) for a in args], cwd=tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("engram: error:")
    assert match in r.stderr


@pytest.mark.slow
def test_demo_default_config_within_budget():
    r = run("demo")
    assert r.returncode == 0, r.stderr
    # the tutorial's printout: 13 text tokens + BOS, vocab 129280, 16 heads per layer
    assert "Input shape  : [1, 14]" in r.stdout
    assert "Output shape : [1, 14, 129280]" in r.stdout
    assert "Layer  1: hash shape [1, 14, 16]" in r.stdout and "Layer 15: hash shape [1, 14, 16]" in r.stdout
    line = [l for l in r.stdout.splitlines() if l.startswith("Wall time")][0]
    total = float(line.split("total ")[1].split(" s")[0])
    rss = float(line.split("peak RSS ")[1].split(" GiB")[0])
    assert total < 60 and rss < 8


def _subparsers(parser):
    """(name, parser) of every command and subcommand, `engram data prepare` as "data prepare"."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from ((f"{name} {n}", p) for n, p in _subparsers(sub))


def test_every_command_has_help():
    from engram.cli import build_parser, main

    names = [n for n, _ in _subparsers(build_parser())]
    assert {"train", "adapt", "eval", "sample", "edit", "serve", "ask", "crosscheck", "data prepare"} <= set(names)
    for name in names:
        with pytest.raises(SystemExit) as e:
            main([*name.split(), "--help"])
        assert e.value.code == 0, name


@pytest.mark.integration
def test_help_imports_no_heavy_module():
    """`engram --help` builds every parser without transformers or matplotlib (they cost seconds)."""
    code = ("import sys; from engram.cli import build_parser; build_parser(); "
            "print([m for m in ('transformers', 'matplotlib') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_shared_options_take_their_choices_from_the_library():
    from engram.cli import build_parser
    from engram.tables.quant import TABLE_FORMATS
    from engram.training.data import SPLITS

    seen = {"--table-format": 0, "--split": 0}
    for name, p in _subparsers(build_parser()):
        for a in p._actions:
            if "--table-format" in a.option_strings:
                assert tuple(a.choices) == TABLE_FORMATS, name
                seen["--table-format"] += 1
            if "--split" in a.option_strings:
                assert tuple(a.choices) == SPLITS, name
                seen["--split"] += 1
    assert seen == {"--table-format": 3, "--split": 2}


def test_any_engram_error_is_one_line(monkeypatch, capsys):
    """Every EngramError (not only the ValueError ones) ends the command with one line and status 2."""
    import engram.cli.model
    from engram.cli import main
    from engram.errors import EngramError

    class Broken(EngramError):
        pass

    def fail(args):
        raise Broken("the spec cannot be written: fix this\nsecond line")

    monkeypatch.delenv("ENGRAM_DEBUG", raising=False)
    monkeypatch.setattr(engram.cli.model, "cmd_spec", fail)
    assert main(["spec", "--out", "x.json"]) == 2
    err = capsys.readouterr().err
    assert err == "engram: error: the spec cannot be written: fix this\n"


def test_serve_engine_vllm_maps_options(tmp_path, monkeypatch, capsys):
    """`engram serve --engine vllm`: engram's options become vLLM's server flags (no vLLM needed to check)."""
    from engram.cli import build_parser
    from engram.integrations.vllm.launcher import VllmLaunchError, vllm_command

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    monkeypatch.delenv("ENGRAM_API_KEY", raising=False)
    parse = build_parser().parse_args
    args = parse(["serve", "--checkpoint", str(run), "--engine", "vllm", "--port", "9001", "--api-key", "k",
                  "--table-tier", "mmap", "--table-dir", str(tmp_path / "t"), "--table-format", "int8", "--overlay",
                  str(tmp_path / "ov"), "--tensor-parallel-size", "1", "--vllm-args", "--max-model-len 512"])
    argv, env = vllm_command(args)
    assert "no tokenizer_config.json" in capsys.readouterr().err  # an older folder: vLLM will know no EOS
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--") and not argv[i + 1].startswith("--")}
    assert "--enforce-eager" in argv and flags["--dtype"] == "float32"
    assert flags["--model"] == str(run / "final") and flags["--served-model-name"] == "run"
    assert flags["--port"] == "9001" and flags["--api-key"] == "k" and flags["--max-model-len"] == "512"
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == {
        "engram_table_tier": "mmap", "engram_table_dir": str(tmp_path / "t"), "engram_table_format": "int8",
        "engram_overlay": [str(tmp_path / "ov")]}
    (run / "final" / "tokenizer_config.json").write_text("{}")
    plain = vllm_command(parse(["serve", "--checkpoint", str(run), "--engine", "vllm", "--chat-template", "plain"]))[0]
    assert "tokenizer_config" not in capsys.readouterr().err
    assert "assistant:" in plain[plain.index("--chat-template") + 1]
    argv = vllm_command(parse(["serve", "--checkpoint", str(run), "--engine", "vllm", "--overlay", "alice=dir"]))[0]
    overrides = json.loads(argv[argv.index("--hf-overrides") + 1])
    assert overrides["engram_overlays"] == {"alice": str(Path("dir").resolve())}
    assert argv[argv.index("--middleware") + 1] == "engram.integrations.vllm.routing.OverlayRouting"
    with pytest.raises(VllmLaunchError, match=r"without '\+'"):
        vllm_command(parse(["serve", "--checkpoint", str(run), "--engine", "vllm", "--overlay", "a+b=dir"]))
    with pytest.raises(VllmLaunchError, match="needs --table-dir"):
        vllm_command(parse(["serve", "--checkpoint", str(run), "--engine", "vllm", "--table-tier", "disk"]))


def test_serve_engine_vllm_without_vllm_is_one_line(monkeypatch, capsys, tmp_path):
    import importlib.util

    from engram.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["serve", "--checkpoint", str(tmp_path), "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs vLLM: pip install vllm" in err


def test_serve_engine_vllm_refuses_a_head_dim_cpu_attention_cannot_run(monkeypatch, capsys, tmp_path):
    """The `tiny` preset's head_dim 8 on vLLM's CPU build: one line at startup naming head_dim and the sizes vLLM
    runs, never a server that starts and then fails every request."""
    import os

    from engram.cli import main
    from engram.integrations.vllm import launcher

    d = tmp_path / "run" / "final"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"hidden_size": 32, "num_attention_heads": 4}))
    monkeypatch.setattr(launcher, "check_installed", lambda: None)
    monkeypatch.setattr(launcher, "on_cpu", lambda: True)
    monkeypatch.setattr(os, "execvpe", lambda *a: pytest.fail("vLLM was started"))
    assert main(["serve", "--checkpoint", str(tmp_path / "run"), "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "head_dim 8" in err and "32, 64" in err and "--engine engram" in err, err
    (d / "config.json").write_text(json.dumps({"hidden_size": 256, "num_attention_heads": 4}))  # head_dim 64: runs
    from engram.cli import build_parser

    with pytest.raises(pytest.fail.Exception, match="vLLM was started"):
        launcher.launch(build_parser().parse_args(["serve", "--checkpoint", str(d), "--engine", "vllm"]))


def test_serve_engine_vllm_sizes_the_kv_cache_on_a_cpu(tmp_path, monkeypatch, capsys):
    """vLLM's CPU build reserves 92% of RAM for its KV cache unless VLLM_CPU_KVCACHE_SPACE says otherwise: engram
    sizes it from the model (layers x KV heads x head_dim), --max-model-len and --max-num-seqs, and says so."""
    from engram.cli import build_parser
    from engram.integrations.vllm import launcher

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                               "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576,
                                               "max_position_embeddings": 8192}))
    (d / "tokenizer_config.json").write_text("{}")
    monkeypatch.setattr(launcher, "on_cpu", lambda: True)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    parse = build_parser().parse_args
    argv, env = launcher.vllm_command(parse(["serve", "--checkpoint", str(d), "--engine", "vllm"]))
    flags = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--max")}
    assert flags == {"--max-model-len": "4096", "--max-num-seqs": "16"}  # the model's 8192 capped
    # 2 x 30 x 3 x 64 x 4 bytes = 46,080 a token; x 4096 x 16 x 1.25 = 3.52 GiB -> 3.75
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3.75"
    assert "KV cache 3.75 GiB (for 16 sequences of 4096 tokens" in capsys.readouterr().err
    argv, env = launcher.vllm_command(parse(["serve", "--checkpoint", str(d), "--engine", "vllm", "--max-num-seqs", "2",
                                             "--vllm-args", "--max-model-len 512"]))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # at least 1 GiB
    assert argv.count("--max-model-len") == 1 and argv[argv.index("--max-model-len") + 1] == "512"
    assert launcher.vllm_command(parse(["serve", "--checkpoint", str(d), "--engine", "vllm", "--kv-cache-gib",
                                        "2.5"]))[1]["VLLM_CPU_KVCACHE_SPACE"] == "2.5"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")  # the user's own setting is kept
    assert launcher.vllm_command(parse(["serve", "--checkpoint", str(d), "--engine", "vllm"]))[1][
        "VLLM_CPU_KVCACHE_SPACE"] == "7"
    with pytest.raises(launcher.VllmLaunchError, match="positive"):
        launcher.vllm_command(parse(["serve", "--checkpoint", str(d), "--engine", "vllm", "--kv-cache-gib", "0"]))
