"""--dtype and --device (`engram.placement`): every loader and every command that loads a model takes them.

Left out, nothing changes (float32 as saved, bit for bit); bfloat16 puts the dense weights in bfloat16 and leaves the
Engram tables in their rows' dtype; a device torch cannot use here is one line, exit status 2, no traceback.
"""

import shutil

import pytest
import torch

pytest.importorskip("transformers")

from bases import tale_tokenizer, tiny_base  # noqa: E402

import engram  # noqa: E402
from engram.cli import main  # noqa: E402
from engram.inference import load_inference_model, load_with_adapter  # noqa: E402
from engram.memory import is_table_key  # noqa: E402
from engram.model import EngramForCausalLM, load_model  # noqa: E402
from engram.placement import check_placement, dense_dtype, place, torch_device, torch_dtype  # noqa: E402

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA message needs a machine without CUDA")
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny engram model folder (random weights, a BPE tokenizer of 400 ids), a tiny Llama base folder and an
    Engram adapter trained for it (its weights moved off their init), and a small text file."""
    from bases import TALE

    from engram.training import presets

    root = tmp_path_factory.mktemp("dtype")
    tok = tale_tokenizer(root / "tokenizer.json")
    torch.manual_seed(0)
    cfg = presets.tiny(vocab_size=400, engram=dict(engram_vocab_size=[1009, 1013], n_embed_per_ngram=16,
                                                   n_head_per_ngram=2, layer_ids=[1], pad_id=1,
                                                   tokenizer_name_or_path=str(tok)))
    EngramForCausalLM(cfg).save_pretrained(root / "model")
    shutil.copy(tok, root / "model" / "tokenizer.json")
    base = tiny_base("llama").eval()
    base.save_pretrained(root / "base")
    shutil.copy(tok, root / "base" / "tokenizer.json")
    m = engram.attach(base, [1], tokenizer=tok, verbose=False, engram_vocab_size=[211, 223], n_embed_per_ngram=16,
                      n_head_per_ngram=2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in engram.adapters.adapter_of(m).parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    engram.save_adapter(m, root / "adapter")
    (root / "text.txt").write_text("\n".join(TALE[:40]))
    return root


def ids():
    return torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def dtypes(model) -> tuple[set, set]:
    """({dtypes of the dense floating-point parameters}, {dtypes of the Engram tables})."""
    dense, tables = set(), set()
    for name, p in model.named_parameters():
        if p.is_floating_point():
            (tables if is_table_key(name) else dense).add(p.dtype)
    return dense, tables


# ------------------------------------------------------------------------------------------ defaults unchanged
def test_left_out_nothing_changes_float32_bit_for_bit(folders):
    before = EngramForCausalLM.from_pretrained(folders / "model").eval()  # what load_model did before the options
    want = logits(before, ids())
    for kw in ({}, {"dtype": None, "device": None}, {"dtype": "float32", "device": "cpu"}):
        model, _ = load_inference_model(folders / "model", **kw)
        assert dtypes(model) == ({torch.float32}, {torch.float32})
        assert torch.equal(logits(model, ids()), want), kw
        assert not hasattr(model, "engram_cast_to")


def test_base_and_adapter_left_out_are_bit_for_bit_the_plain_load(folders):
    from transformers import AutoModelForCausalLM

    plain = engram.load_adapter(AutoModelForCausalLM.from_pretrained(folders / "base"), folders / "adapter").eval()
    model, _ = load_inference_model(base=folders / "base", adapter=folders / "adapter")
    assert torch.equal(logits(model, ids()), logits(plain, ids()))
    assert dense_dtype(model) == torch.float32


# ------------------------------------------------------------------------------------------ bfloat16 / float16
def test_bfloat16_casts_the_dense_weights_and_leaves_the_tables(folders):
    want = logits(load_model(folders / "model")[0], ids())
    model, _ = load_model(folders / "model", dtype="bfloat16")
    assert dtypes(model) == ({torch.bfloat16}, {torch.float32})  # rows as saved (--table-format converts them)
    assert model.engram_cast_to == "bfloat16"
    got = logits(model, ids())
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() < 0.05 * want.abs().max()  # bfloat16's rounding, not another model
    assert (got.float().argmax(-1) == want.argmax(-1)).float().mean() > 0.8


def test_load_model_and_load_adapter_take_dtype_and_device(folders):
    model, _ = load_model(folders / "model", dtype=torch.float16, device="cpu")
    assert dtypes(model) == ({torch.float16}, {torch.float32})
    base = tiny_base("llama").eval()
    m = engram.load_adapter(base, folders / "adapter", dtype="bfloat16", device=torch.device("cpu"))
    dense, tables = dtypes(m)
    assert dense == {torch.bfloat16} and tables == {torch.float32}
    assert logits(m, ids()).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_base_and_adapter_load_in_half_precision_and_the_adapter_still_knows_its_base(folders, dtype):
    """float16 is loaded as saved and cast after the adapter's check (a float16 embedding rounds to bfloat16
    otherwise than the float32 one the adapter recorded); bfloat16 loads straight."""
    want = logits(load_with_adapter(folders / "base", folders / "adapter")[0], ids())
    model, _ = load_inference_model(base=folders / "base", adapter=folders / "adapter", dtype=dtype)
    assert dtypes(model) == ({getattr(torch, dtype)}, {torch.float32})
    got = logits(model, ids()).float()
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_tied_weights_stay_tied():
    from engram.training import presets

    m = EngramForCausalLM(presets.tiny(tie_word_embeddings=True))
    place(m, "bfloat16")
    assert m.lm_head.weight is m.model.embed_tokens.weight and m.lm_head.weight.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ the commands
def test_sample_and_eval_run_in_bfloat16(folders, capsys):
    args = ["sample", "--checkpoint", folders / "model", "--prompt", PROMPT, "--max-new-tokens", "6",
            "--temperature", "0"]
    assert main([*map(str, args)]) == 0
    f32 = capsys.readouterr().out
    assert main([*map(str, args), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT) and f32.startswith(PROMPT)
    ev = ["eval", "--checkpoint", folders / "model", "--data", folders / "text.txt", "--seq-len", "32"]
    losses = []
    for extra in ([], ["--dtype", "bfloat16", "--device", "cpu"]):
        assert main([*map(str, ev), *extra]) == 0
        losses.append(float(capsys.readouterr().out.split("loss ")[1].split()[0]))
    assert abs(losses[0] - losses[1]) < 0.02 * losses[0]


def test_gates_and_a_base_with_its_adapter_take_the_options_too(folders, capsys):
    assert main(["gates", "--checkpoint", str(folders / "model"), "--text", PROMPT, "--dtype", "bfloat16"]) == 0
    assert "layer 1: gate" in capsys.readouterr().out
    assert main(["sample", "--base", str(folders / "base"), "--adapter", str(folders / "adapter"), "--prompt", PROMPT,
                 "--max-new-tokens", "4", "--temperature", "0", "--dtype", "float16"]) == 0
    assert capsys.readouterr().out.startswith(PROMPT)


def test_serve_engine_decodes_in_bfloat16_with_the_tables_in_a_file_tier(folders, tmp_path):
    pytest.importorskip("fastapi")
    from engram.serving import Job, load_engine

    engine = load_engine(folders / "model", table_tier="mmap", table_dir=tmp_path / "t", dtype="bfloat16",
                         device="cpu")
    try:
        assert dense_dtype(engine.model) == torch.bfloat16 and engine.device == torch.device("cpu")
        events = []
        ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False).ids
        engine._decode(Job(ids, 4, 0.0, 1.0, [], None, None, events.append))
        assert events[-1]["type"] == "done" and events[-1]["completion_tokens"] == 4, events
    finally:
        engine.close()


def _one_line_error(capsys, argv) -> str:
    assert main([*map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("engram: error:") == 1, err
    return err.strip().splitlines()[-1]


@NO_CUDA
def test_a_device_torch_cannot_use_is_one_line_and_exit_2(folders, capsys):
    sample = ["sample", "--checkpoint", folders / "model", "--prompt", PROMPT]
    err = _one_line_error(capsys, [*sample, "--device", "cuda"])
    assert err.startswith("engram: error: --device cuda: torch sees no CUDA device here")
    assert "--device cuda:1: torch sees no CUDA device" in _one_line_error(capsys, [*sample, "--device", "cuda:1"])
    assert "not a device torch knows" in _one_line_error(capsys, [*sample, "--device", "gpu0"])
    assert "meta device" in _one_line_error(capsys, [*sample, "--device", "meta"])
    ev = ["eval", "--base", folders / "base", "--adapter", folders / "adapter", "--data", folders / "text.txt"]
    assert "torch sees no CUDA device" in _one_line_error(capsys, [*ev, "--device", "cuda"])
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        load_model(folders / "model", device="cuda")
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        engram.load_adapter(tiny_base("llama"), folders / "adapter", device="cuda")


def test_a_dtype_not_offered_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["sample", "--checkpoint", "x", "--prompt", "p", "--dtype", "float64"])
    assert e.value.code == 2 and "invalid choice: 'float64'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="float8.*choose from float32, bfloat16, float16"):
        torch_dtype("float8")


def test_commands_that_cannot_place_refuse_the_device_in_one_line(folders, tmp_path, capsys):
    facts = tmp_path / "facts.jsonl"
    facts.write_text('{"prompt": "The quick brown", "target": " fox"}\n')
    err = _one_line_error(capsys, ["edit", "--checkpoint", folders / "model", "--facts", facts, "--out",
                                   tmp_path / "o", "--device", "cuda"])
    assert "engram edit optimizes its rows on the CPU" in err
    err = _one_line_error(capsys, ["serve", "--checkpoint", folders / "model", "--engine", "vllm", "--dtype",
                                   "bfloat16"])
    assert "--vllm-args '--dtype bfloat16'" in err


def test_an_overlay_made_in_float32_names_the_cast_when_refused_in_bfloat16(folders, tmp_path, capsys):
    from engram.editing import Fact, edit_facts

    model, tok = load_model(folders / "model")
    edit_facts(model, tok, [Fact("The quick brown", " fox")], steps=2, progress=False).save(tmp_path / "o")
    sample = ["sample", "--checkpoint", folders / "model", "--prompt", PROMPT, "--max-new-tokens", "2",
              "--overlay", tmp_path / "o"]
    assert main([*map(str, sample)]) == 0
    capsys.readouterr()
    err = _one_line_error(capsys, [*sample, "--dtype", "bfloat16"])
    assert "cast to bfloat16 at load, --dtype bfloat16" in err
    facts = tmp_path / "facts.jsonl"  # an overlay made in bfloat16 is one for the bfloat16 model
    facts.write_text('{"prompt": "The quick brown", "target": " fox"}\n')
    assert main([*map(str, ["edit", "--checkpoint", folders / "model", "--facts", facts, "--out", tmp_path / "o16",
                            "--steps", "2", "--data", folders / "text.txt", "--seq-len", "32", "--max-windows", "2",
                            "--dtype", "bfloat16"])]) == 0
    sample16 = [*sample[:-1], tmp_path / "o16", "--dtype", "bfloat16"]
    assert main([*map(str, sample16)]) == 0


# ------------------------------------------------------------------------------------------ placement itself
def test_check_placement():
    assert check_placement() == (None, None)
    assert check_placement("float32", "cpu") == (torch.float32, torch.device("cpu"))
    assert torch_dtype("torch.bfloat16") is torch.bfloat16 and torch_device(None) is None
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^--device cuda:0: torch sees no CUDA device here"):
            check_placement("bfloat16", "cuda:0")
