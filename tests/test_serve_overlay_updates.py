"""`engram serve`'s overlays loaded and dropped while serving (`POST /v1/load_overlay`, `/v1/unload_overlay`, behind
`--allow-overlay-updates` / `ENGRAM_ALLOW_OVERLAY_UPDATES`), driven in process (FastAPI's TestClient) on
test_dtype_device's tiny random engram model, with overlays made as test_vllm_overlays makes them (every row the
prompt reads changed).

While requests are queued and decoding (the worker held by a job that waits): a load is served as MODEL+NAME, a
foreign, corrupted or missing overlay is refused in one line and changes nothing, and an unload refuses later
requests with the 404 naming the loaded ones while the request admitted before decodes with the overlay to its end.
"""

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("transformers")

from conftest import damaged_copy  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from test_dtype_device import folders  # noqa: E402, F401  (the module fixture: a tiny engram model folder)
from test_vllm_overlays import flipped, made_foreign, make_overlays  # noqa: E402

from engram.serving import Job, load_engine  # noqa: E402
from engram.serving.app import create_app  # noqa: E402

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]  # token ids


@pytest.fixture(scope="module")
def overlays(folders, tmp_path_factory):  # noqa: F811
    """{"a", "b": a valid overlay folder each; "foreign": one made for another checkpoint (its digest); "corrupt": a
    copy of "a" with a flipped byte}."""
    from engram.model import load_model

    root = tmp_path_factory.mktemp("ov")
    made = make_overlays(lambda: load_model(folders / "model")[0], lambda m: m.model.mapping, [PROMPT], root,
                         ("a", "b", "foreign"))
    made_foreign(root / "foreign")
    made["corrupt"] = str(damaged_copy(root / "a", root / "corrupt", flipped))
    return made


@pytest.fixture(scope="module")
def engine(folders):  # noqa: F811
    e = load_engine(folders / "model", name="tiny")
    yield e
    e.close()


def complete(client, model, max_tokens=8):
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                             "temperature": 0})
    assert r.status_code == 200, r.json()
    return r.json()["choices"][0]["text"]


def ids(client):
    return [m["id"] for m in client.get("/v1/models").json()["data"]]


def test_off_by_default_404_naming_the_flag(engine, monkeypatch):
    monkeypatch.delenv("ENGRAM_ALLOW_OVERLAY_UPDATES", raising=False)
    client = TestClient(create_app(engine))
    r = client.post("/v1/load_overlay", json={"overlay_name": "a", "overlay_path": "/nowhere"})
    assert r.status_code == 404 and "--allow-overlay-updates" in r.json()["error"]["message"], r.text
    monkeypatch.setenv("ENGRAM_ALLOW_OVERLAY_UPDATES", "1")  # (the environment's switch, as vLLM's)
    r = TestClient(create_app(engine)).post("/v1/unload_overlay", json={"overlay_name": "zz"})
    assert r.status_code == 404 and "overlay 'zz' is not loaded" in r.json()["error"]["message"], r.text
    r = TestClient(create_app(engine, api_key="k", allow_overlay_updates=True)).post(
        "/v1/load_overlay", json={"overlay_name": "a", "overlay_path": "/nowhere"})
    assert r.status_code == 401  # behind the API key like every route


def test_load_use_unload_and_refusals_while_requests_run(engine, overlays):
    client = TestClient(create_app(engine, allow_overlay_updates=True))
    assert ids(client) == ["tiny"]
    plain = complete(client, "tiny")
    r = client.post("/v1/load_overlay", json={"overlay_name": "a", "overlay_path": overlays["a"]})
    assert r.status_code == 200 and "overlay 'a' loaded" in r.text, r.text
    assert ids(client) == ["tiny", "tiny+a"]
    with_a = complete(client, "tiny+a")
    assert with_a != plain  # the overlay changes this prompt's tokens: a wrong choice would show

    gate, started = threading.Event(), threading.Event()

    def hold(ev):  # the worker waits here: the requests sent meanwhile stay queued behind this job
        started.set()
        gate.wait(30)

    engine.submit(Job(ids=[5, 6], max_tokens=2, temperature=0, top_p=1, stop=[], seed=None, overlay=None, emit=hold))
    assert started.wait(30)
    queued = {}
    t = threading.Thread(target=lambda: queued.setdefault("text", complete(client, "tiny+a")))
    t.start()
    try:
        t0 = time.monotonic()
        while engine.in_use.get("a") != 1 and time.monotonic() - t0 < 30:  # admitted, queued with overlay a
            time.sleep(0.01)
        assert engine.in_use.get("a") == 1
        for name, status in (("foreign", 400), ("corrupt", 400)):  # refused in one line, nothing changed
            r = client.post("/v1/load_overlay", json={"overlay_name": name, "overlay_path": overlays[name]})
            msg = r.json()["error"]["message"]
            assert r.status_code == status and "\n" not in msg and "nothing changed" in msg, (name, r.text)
        assert "another checkpoint" in client.post("/v1/load_overlay", json={
            "overlay_name": "f", "overlay_path": overlays["foreign"]}).json()["error"]["message"]
        r = client.post("/v1/load_overlay", json={"overlay_name": "m", "overlay_path": overlays["a"] + "-missing"})
        assert r.status_code == 404, r.text
        for body in ({"overlay_name": "x+y", "overlay_path": overlays["a"]}, {"overlay_name": "a",
                                                                              "overlay_path": overlays["a"]},
                     {"overlay_name": "q"}):
            assert client.post("/v1/load_overlay", json=body).status_code == 400, body
        assert ids(client) == ["tiny", "tiny+a"]
        r = client.post("/v1/load_overlay", json={"overlay_name": "b", "overlay_path": overlays["b"]})
        assert r.status_code == 200, r.text
        r = client.post("/v1/unload_overlay", json={"overlay_name": "a"})
        assert r.status_code == 200 and "1 queued or running request finish with it" in r.text, r.text
        assert ids(client) == ["tiny", "tiny+b"]
        r = client.post("/v1/completions", json={"model": "tiny+a", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404 and "overlay 'a' is not loaded (loaded: b)" in r.json()["error"]["message"]
    finally:
        gate.set()
        t.join(60)
    assert queued["text"] == with_a  # admitted before the unload: decoded with overlay a to its last token
    assert "a" not in engine.in_use and "a" not in engine.overlays
    assert complete(client, "tiny+b") != plain and complete(client, "tiny") == plain
    r = client.post("/v1/load_overlay", json={"overlay_name": "a", "overlay_path": overlays["a"]})
    assert r.status_code == 200 and complete(client, "tiny+a") == with_a  # loaded again: the same rows
