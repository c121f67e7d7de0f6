"""One CLI grammar across commands (issue 60 item 6, docs/cli.md): the model named one way (`--checkpoint`, or
`--base [--adapter]`, on every command that loads one), one list syntax (comma lists), one overlay syntax
(`--overlay [NAME=]DIR`), one way to set Engram fields (`--engram`), `--top-p` / `top_k` on both sides,
`--served-model-name`; every old spelling still works and prints exactly one deprecation line."""

import asyncio
import threading

import pytest

pytest.importorskip("transformers")

from test_dtype_device import PROMPT, folders  # noqa: E402,F401  (the tiny model, base and adapter folders)

from engram.cli import build_parser, main, options  # noqa: E402

LOADS_A_MODEL = ["eval", "sample", "serve", "edit", "gates", "crosscheck"]


def parse_quietly(argv, capsys):
    """(namespace, stderr lines) of `engram ARGV` parsed (no command run) by a fresh parser, as `main` builds."""
    args = build_parser().parse_args([str(a) for a in argv])
    return args, capsys.readouterr().err.splitlines()


# ------------------------------------------------------------------------------------------ parsing only
@pytest.mark.parametrize("command", LOADS_A_MODEL)
def test_every_command_that_loads_a_model_names_it_the_same_way(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    shown = capsys.readouterr().out
    for flag in ("--checkpoint", "--base", "--adapter", "--dtype", "--device"):
        assert flag in shown, (command, flag)


# (old argv, the same in the new spelling, the parsed attribute, its value, what the warning says to use)
OLD_AND_NEW = [
    (["serve", "r"], ["serve", "--checkpoint", "r"], "path", "r", "use --checkpoint r"),
    (["serve", "--checkpoint", "r", "--name", "m"], ["serve", "--checkpoint", "r", "--served-model-name", "m"],
     "name", "m", "use --served-model-name"),
    (["edit", "--checkpoint", "r", "--facts", "f", "--out", "o", "--orders", "2", "3"],
     ["edit", "--checkpoint", "r", "--facts", "f", "--out", "o", "--orders", "2,3"], "orders", [2, 3],
     "use one comma list: --orders 2,3"),
    (["edit", "--checkpoint", "r", "--facts", "f", "--out", "o", "--orders", "2", "--orders", "3"],
     ["edit", "--checkpoint", "r", "--facts", "f", "--out", "o", "--orders", "2,3"], "orders", [2, 3],
     "use one comma list: --orders 2,3"),
    (["stats", "--sizes", "101", "1009"], ["stats", "--sizes", "101,1009"], "sizes", [101, 1009],
     "use one comma list: --sizes 101,1009"),
    (["adapt", "--base", "b", "--out", "o", "--unfreeze", "lm_head", "--unfreeze", "embed_tokens"],
     ["adapt", "--base", "b", "--out", "o", "--unfreeze", "lm_head,embed_tokens"], "unfreeze",
     ["lm_head", "embed_tokens"], "use one comma list: --unfreeze lm_head,embed_tokens"),
    (["train", "--report-to", "tensorboard", "--report-to", "trackio"], ["train", "--report-to", "tensorboard,trackio"],
     "report_to", ["tensorboard", "trackio"], "use one comma list: --report-to tensorboard,trackio"),
    (["train", "--table-backend", "param"], ["train", "--table-mode", "ram"], "table_mode", "ram",
     "use --table-mode ram"),
    (["sample", "--checkpoint", "r", "--prompt", "p", "--table-backend", "disk"],
     ["sample", "--checkpoint", "r", "--prompt", "p", "--table-tier", "disk"], "table_tier", "disk",
     "use --table-tier"),
]


@pytest.mark.parametrize("old, new, attr, value, use", OLD_AND_NEW, ids=[" ".join(old) for old, *_ in OLD_AND_NEW])
def test_an_old_spelling_parses_as_the_new_and_warns_once(old, new, attr, value, use, capsys):
    args, err = parse_quietly(new, capsys)
    assert getattr(args, attr) == value and err == []
    args, err = parse_quietly(old, capsys)
    assert getattr(args, attr) == value
    assert len(err) == 1 and err[0].startswith("engram: warning: ") and "is deprecated; " in err[0], err
    assert err[0].endswith(use), err


def test_an_old_spelling_given_again_and_again_still_warns_once(capsys):
    args, err = parse_quietly(["adapt", "--base", "b", "--out", "o", "--unfreeze", "a", "--unfreeze", "b",
                               "--unfreeze", "c,d", "--report-to", "tensorboard", "--report-to", "trackio"], capsys)
    assert args.unfreeze == ["a", "b", "c", "d"] and args.report_to == ["tensorboard", "trackio"]
    assert [line.split(" is deprecated")[0] for line in err] == ["engram: warning: repeating --unfreeze",
                                                                  "engram: warning: repeating --report-to"]


def test_the_old_serve_positional_and_its_new_flag_together_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--checkpoint", "a", "b"])
    assert e.value.code == 2 and "give the model once, as --checkpoint b" in capsys.readouterr().err


def test_lists_are_comma_lists_and_a_bad_item_is_named(capsys):
    args, err = parse_quietly(["adapt", "--base", "b", "--out", "o", "--layers", "1,3"], capsys)
    assert args.layers == [1, 3] and err == []
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["adapt", "--base", "b", "--out", "o", "--layers", "1,x"])
    assert e.value.code == 2
    assert "argument --layers: 'x' in '1,x' is not a valid int (give a comma list, e.g. --layers 1,3)" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):  # (the help shows the one syntax, not the spaced form still parsed)
        main(["edit", "--help"])
    assert "--orders N[,...] " in capsys.readouterr().out


def test_one_overlay_syntax(tmp_path):
    odd = tmp_path / "a=b"  # a folder whose name holds '=': a DIR, as it exists
    odd.mkdir()
    assert options.overlay_dirs(["ov1=runs/e1", "runs/e2", str(odd)]) == {"ov1": "runs/e1", "runs/e2": "runs/e2",
                                                                           str(odd): str(odd)}
    assert options.overlay_dirs(["ov1=runs/e1"], need_names=True) == {"ov1": "runs/e1"}
    with pytest.raises(ValueError, match="expected NAME=DIR"):  # engram serve: the name is what clients send
        options.overlay_dirs(["runs/e2"], need_names=True)
    for bad, why in (("a+b=d", "a name without"), ("=d", "expected"), ("x=", "expected")):
        with pytest.raises(ValueError, match=why):
            options.overlay_dirs([bad])
    with pytest.raises(ValueError, match="given twice"):
        options.overlay_dirs(["n=a", "n=b"])


def test_engram_fields_on_train_are_its_models_engram_fields(tmp_path, capsys):
    from engram.cli.train import _train_settings
    from engram.training.presets import resolve_job

    new = build_parser().parse_args(["train", "--preset", "tiny", "--engram", "layer_ids=[0]", "--engram",
                                     "n_head_per_ngram=2", "--set", "lr=1e-3"])
    old = build_parser().parse_args(["train", "--preset", "tiny", "--set", "model.engram.layer_ids=[0]", "--set",
                                     "model.engram.n_head_per_ngram=2", "--set", "lr=1e-3"])
    assert capsys.readouterr().err == ""  # (--set model.engram.K=V is --set's own: no warning)
    jobs = [resolve_job(None, "tiny", _train_settings(a)) for a in (new, old)]
    assert jobs[0].model == jobs[1].model == {"engram": {"layer_ids": [0], "n_head_per_ngram": 2}}
    assert jobs[0].train == jobs[1].train
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "x"), "--engram", "n_head_per_ngrm=2"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "n_head_per_ngrm" in err and "Traceback" not in err, err
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------ running the commands
def test_gates_and_crosscheck_take_base_and_adapter(folders, capsys, monkeypatch):  # noqa: F811
    import engram.cli.client as client

    text = "The quick brown fox jumps over the lazy dog"
    monkeypatch.setattr(client, "ask_entities", lambda text, settings, **kw: ["brown fox"])  # (no hosted model)
    monkeypatch.setenv("ENGRAM_API_KEY", "sk-test")
    for model in (["--checkpoint", folders / "model"], ["--base", folders / "base", "--adapter", folders / "adapter"]):
        assert main(["gates", *map(str, model), "--text", text]) == 0, capsys.readouterr().err
        assert "layer 1: gate min" in capsys.readouterr().out
        assert main(["crosscheck", text, *map(str, model), "--json"]) == 0, capsys.readouterr().err
        assert '"precision"' in capsys.readouterr().out


def test_an_overlay_named_or_not_applies_the_same_at_load(folders, tmp_path, capsys):  # noqa: F811
    from engram.editing import Fact, edit_facts
    from engram.model import load_model

    model, tok = load_model(folders / "model")
    overlay = edit_facts(model, tok, [Fact(prompt="The quick brown", target=" king")], steps=3, lr=0.5)
    d = overlay.save(tmp_path / "ov")
    argv = ["sample", "--checkpoint", str(folders / "model"), "--prompt", "The quick brown", "--temperature", "0",
            "--max-new-tokens", "4"]
    outs = []
    for spec in (None, str(d), f"fact={d}"):
        assert main(argv + (["--overlay", spec] if spec else [])) == 0
        outs.append(capsys.readouterr().out)
    assert outs[1] == outs[2] != outs[0]


def _spy_generate(model, seen: list):
    """Record the keyword arguments of every `model.generate` call (then generate as usual)."""
    real = model.generate

    def generate(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    model.generate = generate


def test_sample_top_p_is_nucleus_sampling(folders, capsys, monkeypatch):  # noqa: F811
    seen = []
    load = options.load_for_inference

    def spied(args):
        model, tok = load(args)
        _spy_generate(model, seen)
        return model, tok

    monkeypatch.setattr(options, "load_for_inference", spied)
    argv = ["sample", "--checkpoint", str(folders / "model"), "--prompt", PROMPT, "--max-new-tokens", "12"]

    def sample(*flags):
        assert main(argv + list(flags)) == 0, capsys.readouterr().err
        return capsys.readouterr().out

    greedy = sample("--temperature", "0")
    assert seen[-1]["top_p"] is None and seen[-1]["do_sample"] is False
    hot = sample("--temperature", "2", "--top-k", "0")
    assert seen[-1]["top_p"] is None and seen[-1]["top_k"] is None  # (1 and 0: every token)
    assert hot != greedy
    # a mass this small keeps only the likeliest token at each step: the greedy text, however hot
    assert sample("--temperature", "2", "--top-k", "0", "--top-p", "0.001") == greedy
    assert seen[-1]["top_p"] == 0.001 and seen[-1]["do_sample"] is True
    assert main(argv + ["--top-p", "0"]) == 2
    assert "--top-p 0.0: give a probability mass in (0, 1]" in capsys.readouterr().err


def test_the_server_takes_top_k(folders):  # noqa: F811
    from pydantic import ValidationError

    from engram.serving import load_engine
    from engram.serving.engine import Job
    from engram.serving.schema import ChatRequest, CompletionRequest

    assert CompletionRequest(model="m", prompt="x", top_k=5).top_k == 5
    assert ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], top_k=-1).top_k == -1
    for bad in ("5", 2.0, -2, True):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt="x", top_k=bad)
    engine = load_engine(folders / "model")
    seen = []
    _spy_generate(engine.model, seen)
    try:
        for top_k, temperature, passed in ((3, 1.0, 3), (-1, 1.0, None), (0, 1.0, None), (None, 1.0, None),
                                           (3, 0.0, None)):
            done = threading.Event()
            engine.submit(Job(ids=engine.encode(PROMPT), max_tokens=2, temperature=temperature, top_p=1.0, stop=[],
                              seed=0, overlay=None, top_k=top_k,
                              emit=lambda ev: done.set() if ev["type"] in ("done", "error") else None))
            assert done.wait(60)
            assert seen[-1]["top_k"] == passed, (top_k, temperature)
    finally:
        engine.close()


def test_a_request_top_k_reaches_the_engine():
    """Through the HTTP app (a stand-in engine): `top_k` in the body is the job's; a wrong type is refused."""
    pytest.importorskip("fastapi")
    from test_serve_app import PacedEngine, post

    from engram.serving.app import create_app

    engine = PacedEngine(0.001)
    app = create_app(engine)
    status, _ = asyncio.run(post(app, {"model": "m", "prompt": "the", "max_tokens": 2, "top_k": 5},
                                 disconnect_after=30))
    assert status == 200 and engine.jobs_seen[-1].top_k == 5
    status, _ = asyncio.run(post(app, {"model": "m", "prompt": "the", "max_tokens": 2, "top_k": "5"},
                                 disconnect_after=30))
    assert status in (400, 422) and len(engine.jobs_seen) == 1
