"""A base + adapter pair for vLLM, without vLLM (`engram.integrations.vllm.pair`, `engram.adapters.files`): what the
workers compute from the files equals what `load_adapter` computes on the loaded pair; the pair folder links the
base (no weight copied); every refusal is one line. The served tokens: tests/test_vllm_adapter.py (marker vllm)."""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from pairs import base_and_adapter, save_adapter_for, save_base  # noqa: E402

from engram.adapters import AdapterError, adapter_of, base_fingerprint, compressed_tokenizer  # noqa: E402
from engram.adapters.files import (  # noqa: E402
    adapted_digest,
    adapter_mapping,
    base_fingerprint_from_files,
    check_base,
)
from engram.adapters.saving import read_adapter_config  # noqa: E402
from engram.integrations.vllm.pair import KEY, check_pair, read_pair, write_pair  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return base_and_adapter(tmp_path_factory.mktemp("pair"), "llama")


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "qwen2"])
def test_files_give_what_the_loaded_pair_gives(kind, tmp_path):
    """Fingerprint, hashing and overlay digest read from the folders equal those of the transformers-loaded pair."""
    from engram.editing import model_digest
    from engram.inference import load_base, load_with_adapter

    base, adapter = base_and_adapter(tmp_path, kind)
    meta = read_adapter_config(adapter)
    ct = compressed_tokenizer(adapter / "tokenizer.json")
    assert base_fingerprint_from_files(base, ct) == base_fingerprint(load_base(base)[0], ct) == meta["base"]
    model, _ = load_with_adapter(base, adapter)
    assert adapted_digest(base, adapter, meta) == model_digest(model)
    cfg, mapping = adapter_mapping(adapter, meta)
    assert mapping.spec_digest() == adapter_of(model).mapping.spec_digest()
    assert cfg.to_dict() == adapter_of(model).config.to_dict()
    check_base(base, adapter, meta)  # the right base passes


def test_pair_folder_links_the_base_and_names_vllms_model(llama, tmp_path):
    base, adapter = llama
    d = write_pair(base, adapter, tmp_path / "pair")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["EngramAdapterLlamaForCausalLM"]
    assert cfg[KEY]["base"] == str(base.resolve()) and cfg[KEY]["adapter"] == str(adapter.resolve())
    assert cfg[KEY]["base_fingerprint"] == read_adapter_config(adapter)["base"]
    base_cfg = json.loads((base / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k not in ("architectures", KEY)} == \
        {k: v for k, v in base_cfg.items() if k != "architectures"}
    weights = sorted(d.glob("*.safetensors"))
    assert weights and all(w.is_symlink() and w.resolve().parent == base.resolve() for w in weights)  # no copy
    assert (d / "tokenizer.json").is_symlink() and (d / "tokenizer_config.json").is_symlink()
    assert write_pair(base, adapter, d) == d  # written again in place
    info = read_pair(SimpleNamespace(**{KEY: cfg[KEY]}))
    assert info["architecture"] == "LlamaForCausalLM" and info["adapter"] == adapter.resolve()


def test_wrong_base_is_refused_in_engrams_words(llama, tmp_path):
    base, adapter = llama
    other = save_base(tmp_path / "other", "llama", seed=7)
    with pytest.raises(AdapterError) as e:
        write_pair(other, adapter, tmp_path / "pair")
    assert one_line(e).endswith("was saved for another base model: its embedding weights differ (another checkpoint "
                                "of this architecture)")
    assert not (tmp_path / "pair").exists()
    d = write_pair(base, adapter, tmp_path / "pair2")  # a pair whose base was swapped after it was written
    cfg = json.loads((d / "config.json").read_text())
    with pytest.raises(AdapterError, match="saved for another base model"):
        read_pair(SimpleNamespace(**{KEY: {**cfg[KEY], "base": str(other)}}))
    with pytest.raises(AdapterError) as e:
        read_pair(SimpleNamespace(**{KEY: {**cfg[KEY], "base": str(tmp_path / "gone")}}))
    assert "not a folder any more" in one_line(e)
    with pytest.raises(AdapterError) as e:
        read_pair(SimpleNamespace())
    assert "python -m engram.integrations.vllm.pair" in one_line(e)


def test_lora_and_engram_adapter_pair_names_its_lora_for_vllm(llama, tmp_path, monkeypatch):
    """An adapter with LoRA beside Engram: the pair records its PEFT folder and rank (`pair.lora_info`); `engram serve
    --engine vllm` serves the LoRA as the served name and the pair's base as NAME-no-lora (no vLLM needed); a LoRA
    on a module vLLM's model takes none on, and overlays with a LoRA, are refused in one line."""
    pytest.importorskip("peft")
    import engram
    from engram.adapters import add_lora, save_adapter
    from engram.cli import build_parser
    from engram.inference import load_base
    from engram.integrations.vllm.launcher import VllmLaunchError, vllm_command

    base, _ = llama
    adapter = save_adapter_for(base, tmp_path / "lora-adapter", lora=True)
    lora = check_pair(base, adapter)["lora"]
    assert lora == {"path": str((adapter / "lora").resolve()), "rank": 2}
    d = write_pair(base, adapter, tmp_path / "pair")
    assert json.loads((d / "config.json").read_text())[KEY]["lora"] == lora
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path / "cache"))
    parse = build_parser().parse_args
    argv = vllm_command(parse(["serve", "--base", str(base), "--adapter", str(adapter), "--engine", "vllm",
                               "--served-model-name", "m"]))[0]
    assert argv[argv.index("--served-model-name") + 1] == "m-no-lora"
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "8"
    assert json.loads(argv[argv.index("--lora-modules") + 1]) == {"name": "m", "path": lora["path"],
                                                                  "base_model_name": "m-no-lora"}
    with pytest.raises(VllmLaunchError, match="overlays on an adapter with LoRA"):
        vllm_command(parse(["serve", "--base", str(base), "--adapter", str(adapter), "--engine", "vllm", "--overlay",
                            str(tmp_path / "ov")]))
    model, tok = load_base(base)  # a LoRA also on lm_head, where vLLM's model takes none
    engram.attach(model, [1], tokenizer=tok, verbose=False)
    model = add_lora(model, rank=2, target_modules=["q_proj", "lm_head"])
    save_adapter(model, tmp_path / "head-lora")
    with pytest.raises(AdapterError) as e:
        check_pair(base, tmp_path / "head-lora")
    assert "takes LoRA only on the blocks'" in one_line(e) and "lm_head" in one_line(e)


def test_unsupported_architecture_and_bad_folders_are_refused(llama, tmp_path):
    import shutil

    base, adapter = llama
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(base, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(AdapterError) as e:
        check_pair(gpt2, adapter)
    assert "architecture 'GPT2LMHeadModel' is not one" in one_line(e) and "--engine engram" in str(e.value)
    with pytest.raises(AdapterError) as e:
        check_pair(tmp_path / "nowhere", adapter)
    assert "no model here" in one_line(e)
    with pytest.raises(AdapterError) as e:
        check_pair(base, tmp_path)
    assert "no Engram adapter here" in one_line(e)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(AdapterError) as e:
        write_pair(base, adapter, busy)
    assert "other files" in one_line(e)


def test_engram_serve_base_adapter_engine_vllm_serves_the_cached_pair(llama, tmp_path, monkeypatch, capsys):
    """`engram serve --base --adapter --engine vllm`: vLLM's server on the pair folder, written under engram's
    cache dir (no vLLM needed to check); a wrong base stops it before vLLM starts."""
    from engram.cli import build_parser, main
    from engram.integrations.vllm.launcher import VllmLaunchError, vllm_command

    base, adapter = llama
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path / "cache"))
    parse = build_parser().parse_args
    argv, _ = vllm_command(parse(["serve", "--base", str(base), "--adapter", str(adapter), "--engine", "vllm",
                                  "--port", "9002", "--table-tier", "disk", "--table-dir", str(tmp_path / "t")]))
    model = argv[argv.index("--model") + 1]
    assert model.startswith(str(tmp_path / "cache" / "vllm-pairs"))
    assert json.loads(open(f"{model}/config.json").read())["architectures"] == ["EngramAdapterLlamaForCausalLM"]
    assert argv[argv.index("--served-model-name") + 1] == adapter.name and "--enforce-eager" in argv
    assert json.loads(argv[argv.index("--hf-overrides") + 1])["engram_table_tier"] == "disk"
    with pytest.raises(VllmLaunchError, match="both --base and --adapter"):
        vllm_command(parse(["serve", "--base", str(base), "--engine", "vllm"]))
    other = save_base(tmp_path / "other", "llama", seed=7)
    monkeypatch.setattr("engram.integrations.vllm.launcher.check_installed", lambda: None)
    capsys.readouterr()
    assert main(["serve", "--base", str(other), "--adapter", str(adapter), "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "was saved for another base model" in err


def test_table_options_take_the_adapters_engram_config():
    from engram.config import ConfigError
    from engram.integrations.vllm.options import table_options

    assert table_options(SimpleNamespace(engram_table_format="int8"), {}).format == "int8"
    with pytest.raises(ConfigError, match="shuffled"):
        table_options(SimpleNamespace(), {"hash_mode": "shuffled"})
    with pytest.raises(ConfigError, match="config.engram must be"):
        table_options(SimpleNamespace())


def test_config_hook_checks_the_pair_forces_eager_and_refuses_what_cannot_run(llama, tmp_path):
    """vLLM's per-architecture config hook for the pair (run in the API server before any worker starts)."""
    from engram.config import ConfigError
    from engram.integrations.vllm.options import EngramAdapterVllmConfig

    base, adapter = llama
    cfg = json.loads((write_pair(base, adapter, tmp_path / "pair") / "config.json").read_text())
    mc = SimpleNamespace(hf_config=SimpleNamespace(**{KEY: cfg[KEY]}), enforce_eager=False, enable_prompt_embeds=False)
    EngramAdapterVllmConfig.verify_and_update_model_config(mc)
    assert mc.enforce_eager

    def vc(pp=1, embeds=False, spec=None):
        return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False, enable_prompt_embeds=embeds),
                               parallel_config=SimpleNamespace(pipeline_parallel_size=pp), speculative_config=spec,
                               kv_transfer_config=None)

    ok = vc()
    EngramAdapterVllmConfig.verify_and_update_config(ok)
    assert ok.model_config.enforce_eager  # decided before vLLM chooses compilation
    for bad, what in ((vc(pp=2), "pipeline parallel"), (vc(embeds=True), "prompt embeddings"),
                      (vc(spec=object()), "speculative decoding")):
        with pytest.raises(ConfigError, match=what):
            EngramAdapterVllmConfig.verify_and_update_config(bad)


def test_a_lora_only_adapter_points_to_vllms_own_lora(llama, tmp_path):
    base, _ = llama
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterError) as e:
        check_pair(base, tmp_path)
    assert "--enable-lora" in one_line(e)


def test_pair_command_line(llama, tmp_path, capsys):
    from engram.integrations.vllm.pair import main

    base, adapter = llama
    assert main(["--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "p")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "p")
    assert main(["--base", str(tmp_path / "none"), "--adapter", str(adapter), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --base") and "\n" not in err
