"""Overlays chosen per request inside vLLM's batches (`engram.integrations.vllm.overlays`, `routing`): each request's
greedy tokens equal engram's own with that overlay alone (what `engram serve` decodes for `MODEL+NAME`).

The unit tests (default run, no vLLM): the bank's rows equal `apply_overlay`'s for every token of a mixed step, and
the request plumbing (`route`, `requested`). The server tests (marker `vllm`, `scripts/test_vllm.sh`; one vLLM start
each, minutes on 2 shared cores): `engram serve --engine vllm --overlay NAME=DIR ...` on engram's model and on a base
+ adapter pair, concurrent requests over several overlays, a stack, and none, chosen by model id (`MODEL+NAME`) and
by `vllm_xargs`; an unknown overlay is a 400 naming the loaded ones; `/v1/models` lists them.
"""

import importlib.util
import json
import random
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

has_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                              reason="vLLM is not installed (scripts/test_vllm.sh sets one up)")


# ------------------------------------------------------------------------------------------- unit (no vLLM)
class _View:
    def __init__(self, req):
        import numpy as np

        self.req = np.asarray(req, dtype=np.int64)


def test_bank_rows_equal_apply_overlay_per_token():
    """One step of 7 tokens in 5 batch rows (two overlays, a stack of two, none, a row past the chosen ones): each
    token's rows equal the table's with its request's overlays applied (`push_overlay`, what `apply_overlay` does)."""
    from engram.editing import Overlay
    from engram.integrations.vllm.overlays import CHOICES, OverlayBank
    from engram.memory import MultiHeadEmbedding
    from engram.tables.overlay import push_overlay

    torch.manual_seed(0)
    mhe = MultiHeadEmbedding([50, 60], 8)
    ovs = {n: Overlay({1: torch.randperm(110)[:40]}, {1: torch.randn(40, 8)}, {}) for n in ("a", "b", "c")}
    bank = OverlayBank({1: mhe}, ovs)
    assert bank.num_rows == 120  # the overlays' rows, no table copy
    CHOICES.reset()
    CHOICES.rows.update({0: ("a",), 1: ("b", "c"), 3: ("c",)})
    CHOICES.version += 1
    req = [0, 0, 1, 2, 3, 3, 9]
    stacks = {0: ("a",), 1: ("b", "c"), 2: (), 3: ("c",), 9: ()}
    ids = torch.stack([ovs["b"].rows[1][:7], torch.randint(0, 110, (7,))], 1)  # (7, 2): hits and misses
    ids[2, 1] = ovs["c"].rows[1][0]  # a row both b and c change: the later one (c) wins
    got = bank.for_step(_View(req)).apply(1, mhe.gather(ids), ids)
    for i, r in enumerate(req):
        before = mhe.table
        for n in stacks[r]:
            push_overlay(mhe, ovs[n].rows[1], ovs[n].values[1])
        want = mhe.gather(ids[i:i + 1])[0]
        mhe.table = before
        assert torch.equal(got[i], want), f"token {i} (row {r}, overlays {stacks[r]})"
    CHOICES.reset()
    assert bank.for_step(_View(req)) is None  # nobody chose an overlay: the step's gather is left alone


def test_request_routing_and_checks():
    from engram.integrations.vllm.overlays import OverlayChoiceError, check_names, requested, route

    assert route({"model": "m+a", "prompt": "x"}, ("m",)) == {"model": "m", "prompt": "x",
                                                             "vllm_xargs": {"engram_overlay": ["a"]}}
    assert route({"model": "m+a", "vllm_xargs": {"engram_overlay": "b", "k": 1}}, ("m",))["vllm_xargs"] == \
        {"engram_overlay": ["a", "b"], "k": 1}
    assert route({"model": "m"}, ("m",)) is None and route({"model": "other+a"}, ("m",)) is None
    assert requested({"engram_overlay": "a"}, ("a", "b")) == ("a",) and requested(None) == ()
    with pytest.raises(OverlayChoiceError, match=r"overlay 'zz' is not loaded \(loaded: a, b\)"):
        requested({"engram_overlay": ["a", "zz"]}, ("a", "b"))
    with pytest.raises(OverlayChoiceError, match="an overlay name or a list of names"):
        requested({"engram_overlay": 3})
    with pytest.raises(OverlayChoiceError, match="NAME=DIR"):
        check_names({"a+b": "/x"})


# ------------------------------------------------------------------------------------------- servers
def make_overlays(load, mapping_of, prompts, out, names):
    """Overlays named `names`, each changing (by a lot, its own random values) every layer-1 row the prompts read
    plus a few of its own, so that every prompt's tokens depend on which overlay it reads."""
    from engram.editing import Overlay, engram_layers, model_digest

    model = load()
    mapping = mapping_of(model)
    rows = torch.cat([torch.as_tensor(mapping.hash(torch.tensor([p]), offsets=True)[1]).reshape(-1)
                      for p in prompts]).long().unique()
    d = engram_layers(model)[1].embedding_dim
    out.mkdir(parents=True, exist_ok=True)
    made = {}
    for k, name in enumerate(names):
        g = torch.Generator().manual_seed(10 + k)
        meta = {"hash_spec_sha256": mapping.spec_digest(), "base_digest": model_digest(model), "layers": [1]}
        made[name] = str(Overlay({1: rows}, {1: 5 * torch.randn(rows.numel(), d, generator=g)}, meta).save(out / name))
    return made


def request(server, prompt, how):
    """One greedy completion choosing overlays `how`: ("model", NAME), ("xargs", [NAMES]) or None."""
    extra = {}
    if how and how[0] == "model":
        extra["model"] = f"m+{how[1]}"
    elif how:
        extra["vllm_xargs"] = {"engram_overlay": how[1]}
    return server.complete(prompt, **extra)


def stack_of(how):
    return () if how is None else (how[1],) if how[0] == "model" else tuple(how[1])


def mixed_batch(server, prompts, hows, reference, overlays, what):
    """Send every (prompt, how) at once; each equal to engram's own tokens with its overlays alone."""
    from test_vllm import assert_same

    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda a: request(server, *a), zip(prompts, hows)))
    refs = {}
    for st in sorted({stack_of(h) for h in hows}):
        idx = [i for i, h in enumerate(hows) if stack_of(h) == st]
        refs.update(zip(idx, reference([prompts[i] for i in idx], [overlays[n] for n in st])))
    ref = [refs[i] for i in range(len(prompts))]
    assert_same(got, ref, what)
    return ref


def post_error(server, body) -> tuple[int, str]:
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=120)
    return e.value.code, e.value.read().decode()


@pytest.mark.vllm
@has_vllm
def test_engram_model_mixed_overlays_in_one_batch(tmp_path):
    from test_vllm import SETTINGS, Server, build_model, free_port, prompts_of
    from test_vllm import reference as engram_reference

    from engram.model import load_model

    folder = build_model(tmp_path / "conv", "conv")
    rng = random.Random(7)
    prompts = prompts_of([rng.choice((2, 5, 9, 20, 40, 90)) for _ in range(12)], 7)
    ovs = make_overlays(lambda: load_model(folder)[0], lambda m: m.model.mapping, prompts, tmp_path / "ov",
                        ("a", "b", "c"))
    hows = [None, ("model", "a"), ("model", "b"), ("model", "c"), ("xargs", ["a"]), ("xargs", ["c", "b"]),
            None, ("model", "a"), ("xargs", "b"), ("model", "c"), ("xargs", ["b", "a"]), None]
    ref_of = lambda ps, stack: engram_reference(folder, ps, stack)  # noqa: E731
    plain = ref_of(prompts, [])
    for n in ("a", "b", "c"):  # each overlay changes most prompts' tokens: a wrong choice would show
        assert sum(x[0] != y[0] for x, y in zip(ref_of(prompts, [ovs[n]]), plain)) >= 8, f"overlay {n}: vacuous"
    argv = [sys.executable, "-m", "engram.cli", "serve", "--checkpoint", str(folder), "--engine", "vllm",
            "--served-model-name", "m", "--port", str(free_port()), *[f"--overlay={n}={d}" for n, d in ovs.items()],
            "--vllm-args", " ".join(SETTINGS)]
    s = Server(argv, tmp_path / "serve.log")
    try:
        mixed_batch(s, prompts, hows, ref_of, ovs, "engram model, 12 requests over 3 overlays, a stack, none")
        ids = [m["id"] for m in json.load(urllib.request.urlopen(s.url + "/v1/models", timeout=60))["data"]]
        assert ids == ["m", "m+a", "m+b", "m+c"], ids
        code, text = post_error(s, {"model": "m+zz", "prompt": [5, 6], "max_tokens": 2})
        assert code == 400 and "overlay 'zz' is not loaded (loaded: a, b, c)" in text, (code, text)
        code, text = post_error(s, {"model": "m", "prompt": [5, 6], "max_tokens": 2,
                                    "vllm_xargs": {"engram_overlay": ["a", "nope"]}})
        assert code == 400 and "overlay 'nope' is not loaded" in text, (code, text)
        mixed_batch(s, prompts[:4], [("model", "b"), None, ("xargs", ["a"]), ("model", "c")], ref_of, ovs,
                    "engram model, after refused requests")  # the refusals left the server serving
    finally:
        s.close()


@pytest.mark.vllm
@has_vllm
def test_base_adapter_mixed_overlays_in_one_batch(tmp_path):
    from pairs import base_and_adapter
    from test_vllm import SETTINGS, Server, free_port
    from test_vllm_adapter import prompts_of
    from test_vllm_adapter import reference as pair_reference

    from engram.adapters import adapter_of
    from engram.inference import load_with_adapter

    base, adapter = base_and_adapter(tmp_path, "llama")
    rng = random.Random(8)
    prompts = prompts_of([rng.choice((3, 8, 30, 70)) for _ in range(8)], 8)
    ovs = make_overlays(lambda: load_with_adapter(base, adapter)[0], lambda m: adapter_of(m).mapping, prompts,
                        tmp_path / "ov", ("a", "b"))
    hows = [("model", "a"), None, ("model", "b"), ("xargs", ["b", "a"]), ("xargs", "a"), None, ("model", "b"),
            ("model", "a")]
    ref_of = lambda ps, stack: pair_reference(base, adapter, ps, stack)  # noqa: E731
    plain = ref_of(prompts, [])
    for n in ("a", "b"):
        assert sum(x[0] != y[0] for x, y in zip(ref_of(prompts, [ovs[n]]), plain)) >= 4, f"overlay {n}: vacuous"
    argv = [sys.executable, "-m", "engram.cli", "serve", "--base", str(base), "--adapter", str(adapter), "--engine",
            "vllm", "--served-model-name", "m", "--port", str(free_port()),
            *[f"--overlay={n}={d}" for n, d in ovs.items()], "--vllm-args", " ".join(SETTINGS)]
    s = Server(argv, tmp_path / "serve.log", env={"ENGRAM_CACHE_DIR": str(tmp_path / "cache")})
    try:
        mixed_batch(s, prompts, hows, ref_of, ovs, "llama + adapter, 8 requests over 2 overlays, a stack, none")
    finally:
        s.close()

