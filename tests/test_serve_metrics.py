"""`engram serve`'s GET /metrics (Prometheus's text format, prometheus-client): requests by route and status,
tokens, latency and time-to-first-token histograms, cancellations and overlay use, each app in its own registry.
Driven in process with test_serve_app's stand-in engine (no model)."""

import asyncio
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_serve_app import PacedEngine, post  # noqa: E402

from engram.serving import ServeError  # noqa: E402
from engram.serving.app import create_app  # noqa: E402


class OverlayEngine(PacedEngine):
    """The stand-in engine with one overlay, "fact", served as model "m+fact"."""

    overlays = {"fact": object()}

    def resolve(self, model_id):
        if model_id not in ("m", "m+fact"):
            raise ServeError(f"model {model_id!r} does not exist", 404, "model_not_found", "model")
        return "fact" if model_id == "m+fact" else None


def samples(client, **headers) -> dict:
    """{(sample name, frozenset of its labels): value} of one scrape."""
    r = client.get("/metrics", headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def value(scrape, name, **labels):
    return scrape.get((name, frozenset(labels.items())), 0.0)


def test_a_request_moves_the_counters():
    client = TestClient(create_app(OverlayEngine(0.001)))
    before = samples(client)
    assert value(before, "engram_overlay_requests_total", overlay="fact") == 0  # listed before any use
    r = client.post("/v1/completions", json={"model": "m+fact", "prompt": "the", "max_tokens": 5})
    assert r.status_code == 200
    assert client.post("/v1/completions", json={"model": "other", "prompt": "x"}).status_code == 404
    after = samples(client)
    c = "/v1/completions"
    assert value(after, "engram_requests_total", endpoint=c, status="200") == 1
    assert value(after, "engram_requests_total", endpoint=c, status="404") == 1
    assert value(after, "engram_requests_total", endpoint="/metrics", status="200") == 1  # (the first scrape)
    assert value(after, "engram_prompt_tokens_total") == 3  # (the stand-in's prompt: 3 ids)
    assert value(after, "engram_generation_tokens_total") == 5
    assert value(after, "engram_overlay_requests_total", overlay="fact") == 1
    assert value(after, "engram_request_latency_seconds_count", endpoint=c) == 2
    assert value(after, "engram_time_to_first_token_seconds_count", endpoint=c) == 1


def test_refusals_are_counted_and_apps_count_apart():
    """A 401 from the API key is counted (the counting sits outside the key check); a second app in the process
    has its own counts (its own registry, not prometheus-client's global one)."""
    locked = TestClient(create_app(OverlayEngine(0.001), api_key="k"))
    other = TestClient(create_app(OverlayEngine(0.001)))
    assert locked.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 401
    scrape = samples(locked, authorization="Bearer k")
    assert value(scrape, "engram_requests_total", endpoint="/v1/completions", status="401") == 1
    assert value(samples(other), "engram_requests_total", endpoint="/v1/completions", status="401") == 0
    assert locked.get("/no/such/route", headers={"authorization": "Bearer k"}).status_code == 404
    assert value(samples(locked, authorization="Bearer k"), "engram_requests_total", endpoint="other",
                 status="404") == 1


def test_a_client_that_goes_away_is_counted_as_cancelled():
    engine = OverlayEngine(0.01)
    app = create_app(engine)
    status, _ = asyncio.run(post(app, {"model": "m", "prompt": "the", "max_tokens": 2000}, disconnect_after=0.2))
    assert status == 499
    t0 = time.monotonic()
    while engine.counts["cancelled"] == 0 and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    scrape = samples(TestClient(app))
    assert value(scrape, "engram_requests_cancelled_total", endpoint="/v1/completions") == 1
    assert value(scrape, "engram_requests_total", endpoint="/v1/completions", status="499") == 1
