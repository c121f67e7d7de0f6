"""Engram adapters in PEFT's shape (`engram.adapters.wrapper`): get_engram_model, EngramAdapterModel, its config."""

import pytest
import torch

pytest.importorskip("transformers")

from bases import tale_tokenizer
from test_adapter import OPTS, fit, logits, make, perturb  # (the adapter tests' tiny bases and helpers)

import engram
from engram.adapters import (
    AdapterError,
    EngramAdapterConfig,
    EngramAdapterModel,
    adapter_of,
    get_engram_model,
    read_adapter_config,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tale_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def wrapped(tok, kind="llama", layers=(1,)):
    base = make(kind)
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    want = logits(base, ids)
    return get_engram_model(base, EngramAdapterConfig(list(layers), options=OPTS, tokenizer=tok)), ids, want


def test_get_engram_model_freezes_the_base_and_trains_only_engram(tok, capsys):
    m, ids, base_logits = wrapped(tok)
    assert isinstance(m, EngramAdapterModel) and isinstance(m, torch.nn.Module)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("base_model.engram_adapter.") for n in trainable)
    assert torch.equal(logits(m, ids), base_logits)  # exact until trained
    assert m.config is m.base_model.config  # attributes read through to the wrapped model
    n_trainable, total = m.get_nb_trainable_parameters()
    assert n_trainable == sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert total == sum(p.numel() for p in m.parameters())
    m.print_trainable_parameters()
    assert f"trainable params: {n_trainable:,d} || all params: {total:,d}" in capsys.readouterr().out
    assert m.adapter_config.layer_ids == [1] and m.adapter_config.options == OPTS


def test_a_training_step_through_the_wrapper_changes_only_adapter_weights(tok):
    m, ids, base_logits = wrapped(tok)
    m.train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    fit(m, ids, 2)  # step 1 moves the zero value rows, step 2 the tables too
    after = m.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("base_model.engram_adapter.") for k in changed)
    assert any("multi_head_embedding" in k for k in changed)  # the table rows trained
    assert not torch.equal(logits(m.eval(), ids), base_logits)


def test_save_pretrained_round_trips_bit_equal_in_the_one_adapter_format(tok, tmp_path):
    m, ids, _ = wrapped(tok)
    perturb(m.base_model)
    want = logits(m, ids)
    m.save_pretrained(tmp_path / "w")
    engram.save_adapter(m.base_model, tmp_path / "a")  # the existing function, on the same model ...
    engram.save_adapter(m, tmp_path / "b")  # ... and given the wrapper
    files = sorted(p.name for p in (tmp_path / "w").iterdir())
    for other in ("a", "b"):
        assert files == sorted(p.name for p in (tmp_path / other).iterdir())
        assert all((tmp_path / "w" / f).read_bytes() == (tmp_path / other / f).read_bytes() for f in files)
    assert read_adapter_config(tmp_path / "w")["format"] == "engram-adapter/1"

    back = EngramAdapterModel.from_pretrained(make("llama"), tmp_path / "w")
    assert torch.equal(logits(back, ids), want)
    assert not back.training and not any(p.requires_grad for p in back.parameters())  # PEFT's inference default
    assert back.adapter_config.layer_ids == [1] and back.adapter_config.layers_path == "model.layers"
    trainable = EngramAdapterModel.from_pretrained(make("llama"), tmp_path / "w", is_trainable=True)
    assert {n for n, p in trainable.named_parameters() if p.requires_grad} == \
        {n for n, p in m.named_parameters() if p.requires_grad}
    assert torch.equal(logits(engram.load_adapter(make("llama"), tmp_path / "w"), ids), want)  # the old loader too
    with pytest.raises(AdapterError, match="saved for another base model"):
        EngramAdapterModel.from_pretrained(make("llama", hidden=64), tmp_path / "w")


def test_disable_adapter_gives_the_base_bit_for_bit_and_restores_after(tok):
    m, ids, base_logits = wrapped(tok, layers=(0, 1))
    perturb(m.base_model)
    adapted = logits(m, ids)
    assert not torch.equal(adapted, base_logits)
    prompt = ids[:, :5]
    gen = m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=1)
    with m.disable_adapter():
        assert torch.equal(logits(m, ids), base_logits)
        base_gen = m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=1)
    assert torch.equal(logits(m, ids), adapted)
    assert torch.equal(m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=1), gen)
    engram.detach(m.base_model)  # (the base's own generation, for comparison)
    assert torch.equal(m.base_model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=1), base_gen)


def test_disable_adapter_restores_after_an_exception(tok):
    m, ids, base_logits = wrapped(tok)
    perturb(m.base_model)
    adapted = logits(m, ids)
    with pytest.raises(RuntimeError, match="boom"), m.disable_adapter():
        raise RuntimeError("boom")
    assert torch.equal(logits(m, ids), adapted)


def test_the_config_saves_loads_and_refuses_bad_input(tok, tmp_path):
    cfg = EngramAdapterConfig(1, options=OPTS, tokenizer=tok, layers_path="model.layers")
    assert cfg.layer_ids == [1]
    cfg.save_pretrained(tmp_path / "c")
    assert EngramAdapterConfig.from_pretrained(tmp_path / "c") == cfg
    assert EngramAdapterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(AdapterError, match=r"unknown Engram option\(s\) \['nope'\]"):
        EngramAdapterConfig([1], options={"nope": 1})
    with pytest.raises(AdapterError, match="layer_ids must be"):
        EngramAdapterConfig("1")
    with pytest.raises(AdapterError, match="no Engram adapter or adapter config here"):
        EngramAdapterConfig.from_pretrained(tmp_path)
    with pytest.raises(AdapterError, match="takes an EngramAdapterConfig"):
        get_engram_model(make("llama"), engram.EngramConfig())
    with pytest.raises(AdapterError, match="wraps a model with an Engram adapter"):
        EngramAdapterModel(make("llama"), cfg)


def test_merge_is_refused_and_unload_gives_the_base_back(tok):
    m, ids, base_logits = wrapped(tok)
    perturb(m.base_model)
    with pytest.raises(AdapterError, match="cannot be merged"):
        m.merge_and_unload()
    base = m.unload()
    assert adapter_of(base) is None and torch.equal(logits(base, ids), base_logits)
    assert all(p.requires_grad for p in base.parameters())  # the flags it had before (a fresh model trains all)


def test_with_lora_the_wrapper_loads_both_and_disables_both(tok, tmp_path):
    pytest.importorskip("peft")
    base = make("llama")
    ids = torch.randint(0, 400, (2, 12))
    base_logits = logits(base, ids)
    pm = engram.adapters.add_lora(engram.attach(base, [1], tokenizer=tok, verbose=False, **OPTS), rank=4)
    fit(pm.train(), ids, 3)  # LoRA's B and Engram's value rows leave zero
    want = logits(pm.eval(), ids)
    engram.save_adapter(pm, tmp_path / "a")
    m = EngramAdapterModel.from_pretrained(make("llama"), tmp_path / "a", is_trainable=True)
    from peft import PeftModel

    assert isinstance(m.base_model, PeftModel) and torch.equal(logits(m.eval(), ids), want)
    assert any("lora_" in n for n, p in m.named_parameters() if p.requires_grad)
    with m.disable_adapter():
        assert torch.equal(logits(m, ids), base_logits)  # neither LoRA nor Engram
    assert torch.equal(logits(m, ids), want)
    assert "lora" in card_tags(tmp_path / "a")


def card_tags(folder):
    from huggingface_hub import ModelCard

    return ModelCard.load(folder / "README.md").data.tags
