"""The GRACE, FT-L, LoRA and neighbour-held fine-tuning baselines (engram_experiments.editors.grace / .finetune) on
tiny random Llama and GPT-2 bases: edits take, locality where promised is exact, undo gives the base back bit for bit,
and bad arguments fail in one line."""

import pytest
import torch

pytest.importorskip("transformers")

from bases import tale_tokenizer, tiny_base  # noqa: E402

from engram.editing import Fact  # noqa: E402
from engram_experiments.editors.finetune import encode, ft_l, ft_neighbours, greedy, lora  # noqa: E402
from engram_experiments.editors.grace import GraceCodebook, grace  # noqa: E402

FACT = Fact("The quick brown fox jumps", " king")
OTHER = Fact("line 7 of the tale, said", " fox")
NEIGHBOURS = ["the lazy dog", "said the king."]
FAR = "the lazy dog jumps over the tale"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tale_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")))


def logits(model, tok, text):
    with torch.no_grad():
        return model(input_ids=torch.tensor([encode(tok, text)])).logits


def first(model, tok, fact):
    """Greedy decoding's first token after the prompt, and the target's first token."""
    return greedy(model, encode(tok, fact.prompt), 1)[0], encode(tok, fact.target)[0]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(model, saved):
    now = model.state_dict()
    return set(now) == set(saved) and all(torch.equal(now[k], v) for k, v in saved.items())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_grace_edits_a_fact_and_leaves_a_far_prompt_bit_exact(kind, tok):
    m = tiny_base(kind).eval()
    got, want = first(m, tok, FACT)
    assert got != want  # the edit has something to do
    far, prompt = logits(m, tok, FAR), logits(m, tok, FACT.prompt)
    base = weights(m)
    e = grace(m, tok, [FACT], 1, eps=1.0)
    assert e.method == "GRACE" and e.info["converged"] and e.info["keys"] == 1 and e.changed_params == 0
    assert e.extra_bytes == e.codebook.nbytes > 0
    assert first(m, tok, FACT)[0] == want  # efficacy
    assert torch.equal(logits(m, tok, FAR), far)  # outside every radius: untouched, bit for bit
    # inside the prompt only the last position is replaced: the logits before it keep their bits
    assert torch.equal(logits(m, tok, FACT.prompt)[:, :-1], prompt[:, :-1])
    assert same(m, base)  # no weight moved
    e.undo()
    assert not e.codebook.attached and torch.equal(logits(m, tok, FACT.prompt), prompt)


def test_a_second_grace_edit_adds_a_key_and_keeps_the_first(tok):
    m = tiny_base("llama").eval()
    prompt = logits(m, tok, FACT.prompt)
    e1 = grace(m, tok, [FACT], 1, eps=1.0)
    book = e1.codebook
    e2 = grace(m, tok, [OTHER], None, codebook=book)
    assert e2.codebook is book and len(book) == 2 and e2.info["edits"][0]["action"] == "add"
    assert e2.extra_bytes > e1.extra_bytes
    for f in (FACT, OTHER):
        got, want = first(m, tok, f)
        assert got == want
    e2.undo()  # back to the first edit only
    assert len(book) == 1 and book.attached and first(m, tok, FACT)[0] == encode(tok, FACT.target)[0]
    e1.undo()
    assert torch.equal(logits(m, tok, FACT.prompt), prompt)


def test_grace_expands_on_the_same_target_and_splits_on_another():
    m = tiny_base("gpt2").eval()
    book = GraceCodebook(m, 0, eps_init=1.0)
    k, v = torch.zeros(32), torch.ones(32)
    assert book.update(k, v, (5,)) == (0, "add")
    near = k.clone()
    near[0] = 1.5  # within eps + eps_init = 2 of key 0, outside its radius 1
    assert book.update(near, v, (5,)) == (0, "expand") and len(book) == 1 and 1.5 <= float(book.eps[0]) < 1.501
    assert book.update(near, v, (6,)) == (1, "split")  # a different target at distance 1.5: both radii 0.75
    assert torch.allclose(book.eps, torch.tensor([0.75, 0.75]))
    far = k.clone()
    far[1] = 10.0
    assert book.update(far, v, (6,)) == (2, "add") and float(book.eps[2]) == 1.0
    assert book.update(far, v, (7,)) == (2, "replace") and book.targets[2] == (7,) and len(book) == 3
    book.remove()


def test_ft_l_stays_within_eps_and_touches_only_its_layer(tok):
    m = tiny_base("llama").eval()
    base = weights(m)
    eps = 0.05
    e = ft_l(m, tok, [FACT], 0, eps=eps, steps=50, lr=0.05)
    name = "model.layers.0.mlp.down_proj.weight"
    now = m.state_dict()
    moved = [k for k in base if not torch.equal(now[k], base[k])]
    assert moved == [name] and e.info["module"] + ".weight" == name
    delta = (now[name] - base[name]).abs()
    assert 0 < delta.max() <= eps + 1e-6  # the L-infinity bound (up to float32 rounding of W0 + eps)
    assert e.changed_params == int((delta > 0).sum()) and e.info["converged"]
    assert first(m, tok, FACT)[0] == encode(tok, FACT.target)[0]
    e.undo()
    assert same(m, base)


@pytest.mark.parametrize("kind,merge", [("llama", True), ("llama", False), ("gpt2", True)])
def test_lora_edits_a_fact_and_undo_restores_the_base_bit_exactly(kind, merge, tok):
    m = tiny_base(kind).eval()
    base, types = weights(m), {n: type(x) for n, x in m.named_modules()}
    flags = {n: p.requires_grad for n, p in m.named_parameters()}
    e = lora(m, tok, [FACT], rank=4, alpha=8, merge=merge)
    assert e.info["converged"] and first(m, tok, FACT)[0] == encode(tok, FACT.target)[0]
    assert (e.changed_params > 0) == merge and (e.extra_bytes > 0) == (not merge)
    e.undo()
    assert same(m, base) and {n: type(x) for n, x in m.named_modules()} == types
    assert {n: p.requires_grad for n, p in m.named_parameters()} == flags
    assert not getattr(m, "peft_config", None)


def test_fine_tuning_with_neighbours_held_keeps_their_answers(tok):
    m = tiny_base("gpt2").eval()
    held = [greedy(m, encode(tok, s), 2) for s in NEIGHBOURS]
    base = weights(m)
    free = ft_neighbours(m, tok, [FACT], NEIGHBOURS, 0, neighbour_tokens=2, lr=5e-3, neighbour_weight=0.0)
    assert [greedy(m, encode(tok, s), 2) for s in NEIGHBOURS] != held  # the same edit, not held, moves one
    free.undo()
    assert same(m, base)
    e = ft_neighbours(m, tok, [FACT], NEIGHBOURS, 0, neighbour_tokens=2, lr=5e-3)
    assert e.info["converged"] and e.info["neighbours"] == 2
    assert first(m, tok, FACT)[0] == encode(tok, FACT.target)[0]
    assert [greedy(m, encode(tok, s), 2) for s in NEIGHBOURS] == held
    e.undo()
    assert same(m, base)


def test_bad_arguments_fail_in_one_line(tok):
    m = tiny_base("llama").eval()
    calls = [(lambda: grace(m, tok, [FACT], 2), "out of range"), (lambda: grace(m, tok, [FACT], -1), "out of range"),
             (lambda: grace(m, tok, [FACT], 0, eps=0), "eps must be"),
             (lambda: grace(m, tok, [FACT], 0, eps=-1.0), "eps must be"),
             (lambda: ft_l(m, tok, [FACT], 5), "out of range"),
             (lambda: ft_l(m, tok, [FACT], 0, eps=0.0), "eps must be"),
             (lambda: ft_neighbours(m, tok, [FACT], [], 0), "needs neighbour"),
             (lambda: lora(m, tok, [FACT], target_modules=["nope"]), "match no module"),
             (lambda: ft_l(m, tok, [], 0), "no facts")]
    for call, msg in calls:
        with pytest.raises(ValueError, match=msg) as err:
            call()
        assert "\n" not in str(err.value)
    assert not m._forward_hooks and not any(x._forward_hooks for x in m.modules())  # no codebook left behind
