"""One name for each idea (issue 45, item 4): the table tier is a `tier` everywhere (old spellings still work, with
a deprecation message); the raw and the compressed pad id are named apart; the mapping has one name per family
attribute (the others are documented aliases)."""

import inspect
import warnings

import pytest
import torch.nn as nn

from engram.cli import build_parser
from engram.errors import EngramError

OLD_FLAG_WARNING = "engram: warning: --table-backend is deprecated; use --table-tier"


# ------------------------------------------------------------------------------------------ the table tier
@pytest.mark.parametrize("command", [["sample", "--checkpoint", "r", "--prompt", "x"], ["eval", "--checkpoint", "r"],
                                     ["edit", "--checkpoint", "r", "--facts", "f", "--out", "o"],
                                     ["serve", "--checkpoint", "r"]])
def test_table_tier_flag_and_its_deprecated_spelling(command, capsys):
    parse = build_parser().parse_args
    args = parse(command + ["--table-tier", "mmap", "--table-dir", "d"])
    assert args.table_tier == "mmap" and not hasattr(args, "table_backend")
    assert capsys.readouterr().err == ""
    assert parse(command).table_tier == "ram" and capsys.readouterr().err == ""
    # the old flag: the same setting, and one line on stderr (once, however often it is given)
    args = build_parser().parse_args(command + ["--table-backend", "disk", "--table-dir", "d",
                                                "--table-backend", "mmap"])
    assert args.table_tier == "mmap" and not hasattr(args, "table_backend")
    assert capsys.readouterr().err.splitlines() == [OLD_FLAG_WARNING]
    with pytest.raises(SystemExit):  # its choices are checked as the new flag's
        build_parser().parse_args(command + ["--table-backend", "tape"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        build_parser().parse_args([command[0], "--help"])
    shown = capsys.readouterr().out
    assert "--table-tier" in shown and "--table-backend" not in shown  # (the old spelling is hidden from --help)


# ------------------------------------------------------------------------------------------ the training table mode
OLD_MODE_WARNING = "engram: warning: --table-backend is deprecated; use --table-mode"


@pytest.mark.parametrize("command", ["train", "adapt"])
def test_training_table_mode_flag_and_its_deprecated_spelling(command, capsys):
    """`engram train/adapt --table-mode {ram,mmap}` is the training table mode (TrainConfig.table_mode), not the
    inference tier; `--table-backend {param,mmap}` is its old spelling: the same setting ("param" is "ram") and one
    line on stderr."""

    def parse(*flags):
        return build_parser().parse_args([command, *flags] + (["--base", "b", "--out", "o"] if command == "adapt"
                                                              else []))

    assert parse().table_mode is None  # (the preset's setting)
    assert parse("--table-mode", "mmap").table_mode == "mmap" and parse("--table-mode", "ram").table_mode == "ram"
    assert capsys.readouterr().err == ""
    args = parse("--table-backend", "mmap")
    assert args.table_mode == "mmap" and not hasattr(args, "table_backend")
    assert capsys.readouterr().err.splitlines() == [OLD_MODE_WARNING]
    assert parse("--table-backend", "param").table_mode == "ram"
    assert capsys.readouterr().err.splitlines() == [OLD_MODE_WARNING + " ram"]
    with pytest.raises(SystemExit):  # the old value is only the old flag's
        parse("--table-mode", "param")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    shown = capsys.readouterr().out
    assert "--table-mode" in shown and "--table-backend" not in shown  # (the old spelling is hidden from --help)


def test_train_config_table_mode_and_its_old_spelling(tmp_path):
    """`TrainConfig.table_mode` ("ram" | "mmap") was `table_backend` ("param" | "mmap"): the old keyword, key and
    value give the same config, with a DeprecationWarning, wherever settings come in (keywords, `--set`, a job
    file's [train], overrides); an old run's run.json is read silently (`current_settings(..., warn=False)`)."""
    from engram.config import ConfigError
    from engram.training.config import TRAIN_TABLE_MODES, TrainConfig, current_settings
    from engram.training.presets import resolve_job, train_config

    assert TRAIN_TABLE_MODES == ("ram", "mmap")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = TrainConfig(table_mode="ram")
        assert new == TrainConfig() and new.table_mode == "ram"
        assert current_settings({"table_backend": "param", "lr": 1.0}, warn=False) == {"table_mode": "ram", "lr": 1.0}
    with pytest.warns(DeprecationWarning, match="training setting table_backend=param is deprecated; use "
                                                "table_mode=ram"):
        old = TrainConfig(table_backend="param")
    assert old == new and old.table_mode == "ram"
    with pytest.warns(DeprecationWarning, match="training setting table_mode=param is deprecated; use table_mode=ram"):
        assert TrainConfig(table_mode="param") == new
    with pytest.warns(DeprecationWarning, match="training setting table_backend is deprecated; use table_mode"):
        assert TrainConfig(table_backend="mmap") == TrainConfig(table_mode="mmap")
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="disagree; give table_mode only"):
        TrainConfig(table_mode="mmap", table_backend="param")
    with pytest.warns(DeprecationWarning, match=r"TrainConfig.table_backend is deprecated; use \.table_mode"):
        assert new.table_backend == "param"  # (the old attribute, in its old spelling)
    with pytest.warns(DeprecationWarning, match="table_backend=param is deprecated; use table_mode=ram"):
        assert TrainConfig.parse_overrides(["table_backend=param"]) == {"table_mode": "ram"}
    with pytest.warns(DeprecationWarning, match="table_backend"):
        assert TrainConfig.from_dict({"table_backend": "mmap"}) == TrainConfig(table_mode="mmap")
    with pytest.warns(DeprecationWarning, match="table_backend"):
        assert train_config("tiny", {"table_backend": "mmap"}).table_mode == "mmap"
    (tmp_path / "job.toml").write_text('[train]\ntable_backend = "mmap"\n')
    with pytest.warns(DeprecationWarning, match="table_backend"):
        assert resolve_job(tmp_path / "job.toml", preset="tiny").train == {"table_mode": "mmap"}
    with pytest.warns(DeprecationWarning, match="table_backend"):
        assert resolve_job(tmp_path / "job.toml", preset="tiny", sets=["table_backend=param"]).train == \
            {"table_mode": "ram"}
    with pytest.raises(ConfigError, match="table_mode must be 'ram' or 'mmap', got 'tape'"):
        TrainConfig(table_mode="tape").validate()
    with pytest.warns(DeprecationWarning, match="TRAIN_TABLE_BACKENDS was renamed TRAIN_TABLE_MODES"):
        from engram.training.config import TRAIN_TABLE_BACKENDS
    assert TRAIN_TABLE_BACKENDS == ("param", "mmap")


# ------------------------------------------------------------------------------------------ the hash kernel
def test_hash_mapping_takes_kernel_and_the_old_keyword(default_mapping):
    """What hashes on the CPU is the mapping's `kernel` ("auto" | "numba" | "torch"); `backend=` is its deprecated
    spelling (on the constructor, `for_family` and every integration's `hash_mapping`), `.backend` its old name."""
    import pickle

    import numpy as np

    from engram.config import ConfigError
    from engram.hashing import KERNELS, NgramHashMapping
    from engram.integrations import deepseek_v41, longcat, qwen4_exp

    assert KERNELS == ("auto", "numba", "torch")
    args = ([50, 61], 3, 16, 2, [0, 3], None, 2, 7)
    ct = default_mapping.compressed_tokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = NgramHashMapping(*args, compressed_tokenizer=ct, kernel="torch")
    with pytest.warns(DeprecationWarning, match=r"NgramHashMapping\(backend=\.\.\.\) is deprecated; use kernel="):
        old = NgramHashMapping(*args, compressed_tokenizer=ct, backend="torch")
    assert old.kernel == new.kernel == "torch"
    ids = np.random.default_rng(0).integers(0, ct.vocab_size, size=(2, 9))
    got_old, got_new = old.hash(ids), new.hash(ids)
    assert all(np.array_equal(got_old[lid], got_new[lid]) for lid in new.layer_ids)
    assert old.spec(include_lookup_table=False) == new.spec(include_lookup_table=False)
    with pytest.warns(DeprecationWarning, match=r"for_family\(backend=\.\.\.\) is deprecated; use kernel="):
        assert NgramHashMapping.for_family(new.family, backend="torch").kernel == "torch"
    with pytest.raises(TypeError, match="both kernel= and its deprecated spelling backend="):
        NgramHashMapping(*args, compressed_tokenizer=ct, kernel="torch", backend="torch")
    with pytest.raises(ConfigError, match="kernel must be 'auto', 'numba' or 'torch', got 'gpu'"):
        NgramHashMapping.for_family(new.family, "gpu")
    with pytest.warns(DeprecationWarning, match=r"NgramHashMapping.backend is deprecated; use \.kernel"):
        assert new.backend == "torch"
    assert pickle.loads(pickle.dumps(new)).kernel == "torch"
    state = NgramHashMapping.__new__(NgramHashMapping)
    state.__setstate__({"family": new.family, "backend": "torch"})  # pickled under the old name
    assert state.kernel == "torch"
    for fn in (deepseek_v41.hash_mapping, qwen4_exp.hash_mapping, qwen4_exp.gguf_hash_mapping, longcat.hash_mapping):
        params = inspect.signature(fn).parameters
        assert "kernel" in params and "backend" not in params, fn.__qualname__
    with pytest.warns(DeprecationWarning, match=r"hash_mapping\(backend=\.\.\.\) is deprecated; use kernel="):
        with pytest.raises(ConfigError, match="kernel must be 'auto' or 'torch', got 'numba'"):
            longcat.hash_mapping({}, backend="numba")


def test_load_inference_model_takes_table_tier_and_the_old_keyword():
    from engram.inference import load_inference_model
    from engram.serving.engine import load_engine

    for fn in (load_inference_model, load_engine):
        assert "table_tier" in inspect.signature(fn).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="--table-tier mmap needs --table-dir"):
            load_inference_model("nowhere", table_tier="mmap")
    for fn in (load_inference_model, load_engine):
        with pytest.warns(DeprecationWarning, match=r"table_backend=\.\.\.\) is deprecated; use table_tier="):
            with pytest.raises(ValueError, match="--table-tier disk needs --table-dir"):
                fn("nowhere", table_backend="disk")


def test_offload_tables_takes_tier_and_the_old_keyword(tmp_path):
    from engram.tables import offload_tables

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert offload_tables(nn.Module(), tier="mmap", directory=tmp_path) == {}
        assert offload_tables(nn.Module(), "disk", tmp_path) == {}
    with pytest.warns(DeprecationWarning, match=r"offload_tables\(backend=\.\.\.\) is deprecated; use tier="):
        assert offload_tables(nn.Module(), backend="mmap", directory=tmp_path) == {}
    with pytest.raises(TypeError, match="both tier= and its deprecated spelling backend="):
        offload_tables(nn.Module(), tier="mmap", backend="mmap", directory=tmp_path)
    with pytest.raises(EngramError, match="tier must be 'ram', 'mmap' or 'disk', got 'gpu'"):
        offload_tables(nn.Module(), tier="gpu", directory=tmp_path)
    with pytest.raises(EngramError, match=r"offload_tables\(tier='mmap'\) needs directory="):
        offload_tables(nn.Module(), tier="mmap")


def test_every_tier_opener_takes_tier():
    """The functions that open rows in a tier name the argument `tier` (`backend=` is their deprecated spelling)."""
    from engram.integrations import deepseek_v41, longcat, qwen4_exp
    from engram.tables import gguf, quant

    for fn in (quant.open_quant_file, quant.open_nvfp4_file, gguf.open_table, deepseek_v41.load,
               deepseek_v41.load_gguf, longcat.load, qwen4_exp.serve_tables, qwen4_exp.from_pretrained,
               qwen4_exp.load_folder):
        params = inspect.signature(fn).parameters
        assert "tier" in params and "backend" not in params, fn.__qualname__


# ------------------------------------------------------------------------------------------ pad ids, family names
@pytest.fixture(scope="module")
def default_mapping():
    from engram import EngramConfig, get_hash_mapping

    return get_hash_mapping(EngramConfig())


def test_raw_and_compressed_pad_ids_are_named_apart(default_mapping):
    """`EngramConfig.pad_id` is a token id; the family and the mapping hold it as `raw_pad_id` and its compressed x
    as `compressed_pad_id`; `pad_id` on them is the reference's name of the compressed one (an alias, no warning)."""
    m = default_mapping
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert m.pad_id == m.compressed_pad_id == m.family.compressed_pad_id == m.family.pad_id
    assert m.raw_pad_id == 2  # the reference's default token id
    assert m.compressed_pad_id == int(m.compressed_tokenizer.lookup_table[m.raw_pad_id])
    spec = m.spec(include_lookup_table=False)
    assert spec["pad_id"] == m.raw_pad_id and spec["compressed_pad_id"] == m.compressed_pad_id


def test_one_name_per_family_attribute(default_mapping):
    """Every attribute the mapping re-exports reads the family attribute of the same name; the second names are
    documented aliases of the kept ones."""
    from engram.hashing import NgramHashMapping

    m, f = default_mapping, default_mapping.family
    kept = ["layer_ids", "max_ngram_size", "n_head_per_ngram", "seed", "compressed_tokenizer", "hash_mode",
            "compressed_pad_id", "raw_pad_id", "reset_id", "index_dtype", "layer_multipliers",
            "vocab_size_across_layers", "raw_vocab_size", "compressed_vocab_size"]
    for name in kept:
        assert getattr(m, name) is getattr(f, name) or getattr(m, name) == getattr(f, name), name
    aliases = {"pad_id": "compressed_pad_id", "tokenizer_vocab_size": "compressed_vocab_size"}  # on the mapping
    for alias, name in aliases.items():
        assert getattr(m, alias) == getattr(m, name) and "alias" in getattr(NgramHashMapping, alias).__doc__
    family_aliases = {"pad_id": "compressed_pad_id", "multipliers": "layer_multipliers",
                      "moduli": "vocab_size_across_layers"}
    for alias, name in family_aliases.items():
        assert getattr(f, alias) is getattr(f, name) and getattr(type(f), alias).__doc__
    with pytest.warns(DeprecationWarning, match="raw_vocab_size"):
        assert m.tokenizer_len == m.raw_vocab_size
