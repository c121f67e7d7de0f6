import json

import pytest

from engram import BackBoneConfig, ConfigError, EngramConfig, load_config, save_config


def test_defaults_match_tutorial():
    e, b = EngramConfig(), BackBoneConfig()
    assert e.engram_vocab_size == [129280 * 5] * 2
    assert (e.max_ngram_size, e.n_embed_per_ngram, e.n_head_per_ngram, e.layer_ids, e.pad_id, e.seed,
            e.kernel_size) == (3, 512, 8, [1, 15], 2, 0, 4)
    assert e.tokenizer_name_or_path == "deepseek-ai/DeepSeek-V3"
    assert (b.hidden_size, b.hc_mult, b.vocab_size, b.num_layers) == (1024, 4, 129280, 30)


def test_json_round_trip(tmp_path):
    e = EngramConfig(engram_vocab_size=[101, 203, 307], max_ngram_size=4, n_embed_per_ngram=16, n_head_per_ngram=2,
                     layer_ids=[0, 2], conv_zero_init=True)
    b = BackBoneConfig(hidden_size=32, hc_mult=2, vocab_size=500, num_layers=3)
    p = tmp_path / "engram_config.json"
    save_config(p, e, b)
    e2, b2 = load_config(p)
    assert e2 == e and b2 == b
    assert set(json.loads(p.read_text())) == {"engram", "backbone"}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(engram_vocab_size=[100]), "one size per n-gram order"),
        (dict(n_embed_per_ngram=30, n_head_per_ngram=8), "divisible"),
        (dict(max_ngram_size=1, engram_vocab_size=[]), ">= 2"),
        (dict(engram_vocab_size=[0, 10]), "positive"),
        (dict(n_head_per_ngram=0), "positive"),
        (dict(layer_ids=[-1]), "non-negative"),
        (dict(layer_ids=[]), "empty"),
        (dict(table_dtype="int8"), "table_dtype"),
        (dict(table_init_std=0.0), "table_init_std"),
        (dict(table_init_std="small"), "table_init_std"),
    ],
)
def test_engram_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngramConfig(**kwargs)


def test_backbone_errors_and_layer_range(tmp_path):
    with pytest.raises(ConfigError, match="hidden_size"):
        BackBoneConfig(hidden_size=0)
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"engram": {"layer_ids": [1, 40]}, "backbone": {"num_layers": 30}}))
    with pytest.raises(ConfigError, match=r"outside \[0, 30\)"):
        load_config(p)


def test_unknown_keys_and_bad_files(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"engram": {"max_ngram": 3}}))
    with pytest.raises(ConfigError, match="unknown key.*max_ngram"):
        load_config(p)
    p.write_text(json.dumps({"engramm": {}}))
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(p)
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.json")


def test_train_config_moved_to_training_and_the_old_spelling_warns():
    """`TrainConfig` lives in `engram.training.config` (the core holds the model's configs); `engram.TrainConfig` is
    the same class, and `from engram.config import TrainConfig` still works with a DeprecationWarning."""
    import engram
    from engram.training.config import TrainConfig

    assert engram.TrainConfig is TrainConfig
    with pytest.warns(DeprecationWarning, match="engram.training.config"):
        from engram.config import TrainConfig as old
    assert old is TrainConfig
    with pytest.warns(DeprecationWarning, match="TRAIN_TABLE_BACKENDS moved to engram.training.config; use `from "
                                                "engram.training.config import TRAIN_TABLE_MODES`"):
        from engram.config import TRAIN_TABLE_BACKENDS as old_backends
    assert old_backends == ("param", "mmap")  # (its old values: "param" is table_mode "ram" now)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        engram.config.Nope  # noqa: B018
