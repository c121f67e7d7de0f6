"""ROME and MEMIT baselines (engram_experiments.editors) on tiny random Llama and GPT-2 bases.

The bases are 4-layer random models, so facts put the subject at the end of the prompt (a random model's attention
barely carries a mid-prompt subject to the last position) and the efficacy tests read the bare prompt only
(`prefixes=[]`): a random model's key for a subject moves a lot with random prefixes, which is a property of the
random model, not of the editor. The sampled-prefix path is covered by its own test.
"""

import pytest
import torch

pytest.importorskip("transformers")

from bases import tale_tokenizer, tiny_base  # noqa: E402

from engram.editing import EditError, Fact  # noqa: E402
from engram_experiments.editors.base import mlp_out  # noqa: E402
from engram_experiments.editors.covariance import key_covariance, key_covariances  # noqa: E402
from engram_experiments.editors.memit import memit  # noqa: E402
from engram_experiments.editors.rome import rome  # noqa: E402

FACT, SUBJECT = Fact("The quick brown fox", " king"), "quick brown fox"
FACTS = [(Fact("The quick brown fox", " dog"), "quick brown fox"), (Fact("over the lazy dog", " king"), "lazy dog"),
         (Fact("said the king", " fox"), "king"), (Fact("line 5", " quick"), "line 5"),
         (Fact("of the tale", " line"), "tale")]


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest: tiny models, one intra-op thread)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tale_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")))


def base(kind):
    layers = {"n_layer": 4} if kind == "gpt2" else {"num_hidden_layers": 4}
    return tiny_base(kind, **layers).eval()


def windows(n=300, T=16):
    """`n` random token windows (n, T): what the key statistics are estimated over here."""
    return torch.randint(2, 400, (n, T), generator=torch.Generator().manual_seed(0))


def next_token(model, tok, prompt):
    """(greedy next token id, next-token probabilities (V,)) after `prompt`."""
    ids = tok.encode(prompt, add_special_tokens=False).ids
    with torch.no_grad():
        p = model(input_ids=torch.tensor([ids])).logits[0, -1].float().softmax(-1)
    return int(p.argmax()), p


def first_id(tok, text):
    return tok.encode(text, add_special_tokens=False).ids[0]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_key_second_moment_masks_padding_and_is_cached(tok, tmp_path):
    m = base("llama")
    texts = ["The quick brown fox jumps over the lazy dog", "said the king", "line 7 of the tale, said the king."]
    keys = []
    h = mlp_out(m, 1)[1].register_forward_pre_hook(lambda _m, a: keys.append(a[0][0].double()))
    with torch.no_grad():
        for t in texts:  # one text at a time: nothing to pad
            m(input_ids=torch.tensor([tok.encode(t, add_special_tokens=False).ids]))
    h.remove()
    k = torch.cat(keys)  # (tokens, d_in)
    c = key_covariance(m, 1, texts, tokenizer=tok, batch_size=3, cache_dir=tmp_path, progress=False)
    assert c.dtype == torch.float64 and c.shape == (64, 64)
    torch.testing.assert_close(c, k.T @ k / len(k), rtol=1e-4, atol=1e-5)  # float32 padded vs not: rounding
    assert len(list(tmp_path.glob("keycov-*-L1-n*.safetensors"))) == 1

    def boom(*a, **kw):
        raise AssertionError("recomputed instead of read from the cache")

    m.forward = boom
    assert torch.equal(key_covariance(m, 1, texts, tokenizer=tok, cache_dir=tmp_path, progress=False), c)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_rome_edits_one_fact_by_a_rank_one_update_that_undoes_exactly(tok, kind):
    m = base(kind)
    cov = key_covariance(m, 1, windows(), progress=False)
    old, _ = next_token(m, tok, FACT.prompt)
    new = first_id(tok, FACT.target)
    assert old != new
    before = weights(m)
    ed = rome(m, tok, FACT, SUBJECT, 1, cov, prefixes=[])
    got, p = next_token(m, tok, FACT.prompt)
    assert got == new and p[new] > p[old]  # efficacy
    name = "transformer.h.1.mlp.c_proj.weight" if kind == "gpt2" else "model.layers.1.mlp.down_proj.weight"
    after = weights(m)
    assert [k for k in before if not torch.equal(before[k], after[k])] == [name]
    s = torch.linalg.svdvals((after[name] - before[name]).double())
    assert s[1] < 1e-4 * s[0]  # rank one
    assert ed.method == "rome" and ed.facts == 1 and ed.changed_params > 0.9 * before[name].numel()
    ed.undo()
    assert all(torch.equal(before[k], v) for k, v in weights(m).items())


def test_rome_reads_the_key_over_sampled_prefixes_without_touching_the_global_rng(tok):
    m = base("llama")
    cov = key_covariance(m, 1, windows(), progress=False)
    state = torch.random.get_rng_state()
    before = weights(m)
    ed = rome(m, tok, FACT, SUBJECT, 1, cov)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert ed.info["contexts"] == 11 and ed.info["nll_after"] < ed.info["nll_before"] - 1
    name = "model.layers.1.mlp.down_proj.weight"
    s = torch.linalg.svdvals((m.state_dict()[name] - before[name]).double())
    assert s[1] < 1e-4 * s[0]
    assert all(p.grad is None for p in m.parameters())  # only the delta vector had gradients
    ed.undo()
    assert all(torch.equal(before[k], v) for k, v in weights(m).items())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_memit_edits_five_facts_in_the_chosen_layers_only(tok, kind):
    m = base(kind)
    layers = [1, 2]
    covs = key_covariances(m, layers, windows(), progress=False)
    before = weights(m)
    # lambda 1: the paper's 15,000 is on GPT-J's scale (k^T C^-1 k ~ d_in = 16,384); these MLPs have d_in = 64
    ed = memit(m, tok, [f for f, _ in FACTS], [s for _, s in FACTS], layers, covs, prefixes=[],
               mom2_update_weight=1.0)
    hits = [next_token(m, tok, f.prompt)[0] == first_id(tok, f.target) for f, _ in FACTS]
    assert sum(hits) / len(hits) >= 0.8
    after = weights(m)
    name = "transformer.h.{}.mlp.c_proj.weight" if kind == "gpt2" else "model.layers.{}.mlp.down_proj.weight"
    assert sorted(k for k in before if not torch.equal(before[k], after[k])) == [name.format(i) for i in layers]
    assert ed.method == "memit" and ed.facts == 5
    ed.undo()
    assert all(torch.equal(before[k], v) for k, v in weights(m).items())


def test_editors_fail_in_one_line(tok):
    m = base("llama")
    cov = torch.eye(64, dtype=torch.float64)
    with pytest.raises(EditError, match="subject 'brown cat' not found in the prompt") as e:
        rome(m, tok, FACT, "brown cat", 1, cov)
    with pytest.raises(EditError, match="not found in the prompt"):
        memit(m, tok, [FACT], ["brown cat"], [1], {1: cov})
    with pytest.raises(EditError, match="unsupported architecture Linear") as e2:
        rome(torch.nn.Linear(2, 2), tok, FACT, SUBJECT, 0, None)
    with pytest.raises(EditError, match="layer 9 is out of range"):
        key_covariance(m, 9, windows(4))
    assert all("\n" not in str(x.value) for x in (e, e2))
