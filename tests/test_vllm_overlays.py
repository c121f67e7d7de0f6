"""Overlays chosen per request inside vLLM's batches (`engram.integrations.vllm.overlays`, `routing`): each request's
greedy tokens equal engram's own with that overlay alone (what `engram serve` decodes for `MODEL+NAME`).

The unit tests (default run, no vLLM): the bank's rows equal `apply_overlay`'s for every token of a mixed step, and
the request plumbing (`route`, `requested`). The server tests (marker `vllm`, `scripts/test_vllm.sh`; one vLLM start
each, minutes on 2 shared cores): `engram serve --engine vllm --overlay NAME=DIR ...` on engram's model and on a base
+ adapter pair, concurrent requests over several overlays, a stack, and none, chosen by model id (`MODEL+NAME`) and
by `vllm_xargs`; an unknown overlay is a 400 naming the loaded ones; `/v1/models` lists them; overlays loaded and
dropped while requests run (`POST /v1/load_overlay`, `/v1/unload_overlay`), a foreign or corrupted one refused.
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


def made_foreign(d) -> None:
    """Overlay folder `d` rewritten as one made for another checkpoint: its recorded weights digest changed, its
    checksums written again (only the digest check can refuse it)."""
    from engram.persist import read_json, write_json, write_manifest

    write_json(d / "overlay.json", {**read_json(d / "overlay.json", "overlay metadata", ""), "base_digest": "0" * 64})
    write_manifest(d)


def flipped(d) -> None:
    """One byte of overlay folder `d`'s weights flipped (its checksums left as they were: a corrupted copy)."""
    w = d / "overlay.safetensors"
    b = bytearray(w.read_bytes())
    b[-5] ^= 0xFF
    w.write_bytes(bytes(b))


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


def post(server, path, body) -> tuple[int, str]:
    """(HTTP status, body text) of a JSON POST to `path`, errors included."""
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


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
                        ("a", "b", "c", "d"))
    hows = [None, ("model", "a"), ("model", "b"), ("model", "c"), ("xargs", ["d"]), ("xargs", ["c", "b"]),
            None, ("model", "d"), ("xargs", "b"), ("model", "c"), ("xargs", ["b", "a"]), ("model", "a")]
    ref_of = lambda ps, stack: engram_reference(folder, ps, stack)  # noqa: E731
    plain = ref_of(prompts, [])
    for n in ("a", "b", "c", "d"):  # each overlay changes most prompts' tokens: a wrong choice would show
        assert sum(x[0] != y[0] for x, y in zip(ref_of(prompts, [ovs[n]]), plain)) >= 8, f"overlay {n}: vacuous"
    argv = [sys.executable, "-m", "engram.cli", "serve", "--checkpoint", str(folder), "--engine", "vllm",
            "--served-model-name", "m", "--port", str(free_port()), *[f"--overlay={n}={d}" for n, d in ovs.items()],
            "--vllm-args", " ".join(SETTINGS)]
    s = Server(argv, tmp_path / "serve.log")
    try:
        mixed_batch(s, prompts, hows, ref_of, ovs, "engram model, 12 requests over 4 overlays, a stack, none")
        ids = [m["id"] for m in json.load(urllib.request.urlopen(s.url + "/v1/models", timeout=60))["data"]]
        assert ids == ["m", "m+a", "m+b", "m+c", "m+d"], ids
        code, text = post_error(s, {"model": "m+zz", "prompt": [5, 6], "max_tokens": 2})
        assert code == 400 and "overlay 'zz' is not loaded (loaded: a, b, c, d)" in text, (code, text)
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
    prompts = prompts_of([rng.choice((3, 8, 30, 70)) for _ in range(12)], 8)
    ovs = make_overlays(lambda: load_with_adapter(base, adapter)[0], lambda m: adapter_of(m).mapping, prompts,
                        tmp_path / "ov", ("a", "b", "c", "d"))
    hows = [("model", "a"), None, ("model", "b"), ("xargs", ["b", "a"]), ("xargs", "c"), None, ("model", "d"),
            ("model", "a"), ("xargs", ["d"]), ("model", "c"), ("model", "b"), None]
    ref_of = lambda ps, stack: pair_reference(base, adapter, ps, stack)  # noqa: E731
    plain = ref_of(prompts, [])
    for n in ("a", "b", "c", "d"):
        assert sum(x[0] != y[0] for x, y in zip(ref_of(prompts, [ovs[n]]), plain)) >= 6, f"overlay {n}: vacuous"
    argv = [sys.executable, "-m", "engram.cli", "serve", "--base", str(base), "--adapter", str(adapter), "--engine",
            "vllm", "--served-model-name", "m", "--port", str(free_port()),
            *[f"--overlay={n}={d}" for n, d in ovs.items()], "--vllm-args", " ".join(SETTINGS)]
    s = Server(argv, tmp_path / "serve.log", env={"ENGRAM_CACHE_DIR": str(tmp_path / "cache")})
    try:
        mixed_batch(s, prompts, hows, ref_of, ovs, "llama + adapter, 12 requests over 4 overlays, a stack, none")
    finally:
        s.close()



@pytest.mark.vllm
@has_vllm
def test_overlays_loaded_and_dropped_while_requests_run(tmp_path):
    """`ENGRAM_ALLOW_OVERLAY_UPDATES=1` and vLLM's worker extension `routing.OverlayWorker` (what `engram serve
    --engine vllm --allow-overlay-updates` passes): an overlay loaded while serving is chosen per request in a mixed
    batch; while a long request with overlay b streams, c loads, a foreign and a corrupted overlay are refused and
    change nothing, b is unloaded (later requests for it: 400 naming the loaded ones; loading it again: 409 until its
    request ends) and the streaming request keeps b's rows to its last token."""
    import shutil

    from test_vllm import SETTINGS, Server, assert_same, build_model, free_port, prompts_of
    from test_vllm import reference as engram_reference

    from engram.integrations.vllm.routing import WORKER
    from engram.model import load_model

    folder = build_model(tmp_path / "conv", "conv")
    prompts = prompts_of([2, 5, 9, 20, 40, 7], 9)
    ovs = make_overlays(lambda: load_model(folder)[0], lambda m: m.model.mapping, prompts, tmp_path / "ov",
                        ("a", "b", "c", "foreign"))
    made_foreign(tmp_path / "ov" / "foreign")
    shutil.copytree(tmp_path / "ov" / "a", tmp_path / "ov" / "corrupt")
    flipped(tmp_path / "ov" / "corrupt")
    ref_of = lambda ps, stack, new=16: engram_reference(folder, ps, stack, new=new)  # noqa: E731
    argv = [sys.executable, "-m", "engram.cli", "serve", "--checkpoint", str(folder), "--engine", "vllm",
            "--served-model-name", "m", "--port", str(free_port()), f"--overlay=a={ovs['a']}",
            "--vllm-args", " ".join([*SETTINGS, "--worker-extension-cls", WORKER])]
    s = Server(argv, tmp_path / "serve.log", env={"ENGRAM_ALLOW_OVERLAY_UPDATES": "1"})
    models = lambda: [m["id"] for m in json.load(urllib.request.urlopen(s.url + "/v1/models", timeout=60))["data"]]  # noqa: E731
    try:
        code, text = post(s, "/v1/load_overlay", {"overlay_name": "b", "overlay_path": ovs["b"]})
        assert code == 200 and "overlay 'b' loaded" in text, (code, text, s.tail())
        assert models() == ["m", "m+a", "m+b"]
        mixed_batch(s, prompts, [None, ("model", "a"), ("model", "b"), ("xargs", ["a", "b"]), ("model", "b"), None],
                    ref_of, ovs, "an overlay loaded while serving, in a mixed batch")
        long = 500  # prompts[1]: 5 tokens; max-model-len 512. As long as the model allows: the steps below need the
        # request still decoding, and on a loaded machine a 300-token answer could end before the client got there
        body = {"model": "m+b", "prompt": prompts[1], "max_tokens": long, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": True}
        stream = urllib.request.urlopen(urllib.request.Request(s.url + "/v1/completions", json.dumps(body).encode(),
                                                               {"Content-Type": "application/json"}), timeout=600)
        chunks = (json.loads(line[6:]) for line in map(bytes.decode, stream)
                  if line.startswith("data: {"))
        # unloaded as soon as the stream's headers came (the request is admitted and counted), not after its first
        # token: on a loaded machine the whole answer could be decoded before the client read that token
        code, text = post(s, "/v1/unload_overlay", {"overlay_name": "b"})
        assert code == 200 and "1 running request finish with it" in text, (code, text, s.tail())
        tokens = list(next(chunks)["choices"][0]["token_ids"] or [])  # the request decodes with b
        code, text = post(s, "/v1/completions", {"model": "m+b", "prompt": [5, 6], "max_tokens": 2})
        assert code == 400 and "overlay 'b' is not loaded (loaded: a)" in text, (code, text)
        code, text = post(s, "/v1/load_overlay", {"overlay_name": "b", "overlay_path": ovs["b"]})
        assert code == 409, (code, text)  # (its running request still reads the old rows under that name)
        for name, why in (("foreign", "another checkpoint"), ("corrupt", "")):
            code, text = post(s, "/v1/load_overlay", {"overlay_name": name,
                                                      "overlay_path": str(tmp_path / "ov" / name)})
            assert code == 400 and "nothing changed" in text and why in text, (name, code, text)
        code, text = post(s, "/v1/load_overlay", {"overlay_name": "c", "overlay_path": ovs["c"]})
        assert code == 200, (code, text)
        assert models() == ["m", "m+a", "m+c"]
        for ch in chunks:
            tokens += [t for c in ch["choices"] for t in (c.get("token_ids") or [])]
        assert_same([tokens], ref_of([prompts[1]], [ovs["b"]], new=long), "a request streaming through b's unload")
        mixed_batch(s, prompts[:4], [("model", "c"), None, ("xargs", ["c", "a"]), ("model", "a")], ref_of, ovs,
                    "after the unload, with an overlay loaded while another request ran")
        code, text = post(s, "/v1/load_overlay", {"overlay_name": "b", "overlay_path": ovs["b"]})
        assert code == 200, (code, text)  # (its request is over: the name is free again)
    finally:
        s.close()
