"""`serving/app.py` driven as an ASGI app with a stand-in engine (no model, no server process): how a request's
answer reacts to its connection, whatever the decoding pace."""

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")

from engram.serving.app import create_app


class PacedEngine:
    """The part of `serving.engine.Engine` the app calls; `submit` decodes one token every `pace` seconds (up to
    `max_tokens`) on a thread, as the real engine does, until the job is cancelled."""

    def __init__(self, pace: float):
        self.pace, self.jobs_seen = pace, []
        self.counts = {"done": 0, "cancelled": 0, "tokens": 0}
        self.created = 0

    def resolve(self, model_id):
        return None

    def check_chars(self, n, param="prompt"):
        pass

    def encode(self, text):
        return [1, 2, 3]

    def check(self, ids, max_tokens):
        pass

    def submit(self, job):
        self.jobs_seen.append(job)

        def decode():
            for _ in range(job.max_tokens):
                if job.cancelled.wait(self.pace):
                    self.counts["cancelled"] += 1
                    job.emit({"type": "done", "finish_reason": "cancelled", "completion_tokens": 0})
                    return
                self.counts["tokens"] += 1
                job.emit({"type": "delta", "text": "x"})
            self.counts["done"] += 1
            job.emit({"type": "done", "finish_reason": "length", "completion_tokens": job.max_tokens})

        threading.Thread(target=decode, daemon=True).start()


async def post(app, body: dict, disconnect_after: float):
    """POST /v1/completions with `body`; the client goes away `disconnect_after` s after sending it. Returns the
    status the app answered (or None) and when the client went away."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    sent, status, gone = [False], [None], [None]

    async def receive():  # the body, then (as uvicorn) nothing until the connection is lost
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": data, "more_body": False}
        left = disconnect_after - (time.monotonic() - t0)
        if left > 0:  # (once gone, answered at once, as uvicorn does: a zero-timeout look sees it)
            await asyncio.sleep(left)
        gone[0] = gone[0] or time.monotonic()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            status[0] = message["status"]

    t0 = time.monotonic()
    await asyncio.wait_for(app(scope, receive, send), timeout=60)
    return status[0], gone[0]


@pytest.mark.parametrize("pace", [0.005, 0.3])
def test_a_dropped_non_streaming_request_is_cancelled_whatever_the_pace(pace):
    """Tokens every 5 ms (faster than any periodic look between tokens) or every 0.3 s: the job is cancelled within
    0.5 s of the client going away, long before its 2,000 tokens would have decoded."""
    engine = PacedEngine(pace)
    app = create_app(engine)
    status, _ = asyncio.run(post(app, {"model": "m", "prompt": "the", "max_tokens": 2000}, disconnect_after=0.3))
    job = engine.jobs_seen[0]
    assert job.cancelled.wait(5)
    t0 = time.monotonic()
    while engine.counts["cancelled"] == 0 and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert engine.counts == {**engine.counts, "cancelled": 1, "done": 0}, engine.counts
    assert engine.counts["tokens"] < 0.8 / pace + 2, engine.counts  # decoding stopped soon after the drop
    assert status == 499


def test_a_request_whose_client_stays_gets_its_whole_answer():
    engine = PacedEngine(0.001)
    app = create_app(engine)
    status, _ = asyncio.run(post(app, {"model": "m", "prompt": "the", "max_tokens": 50}, disconnect_after=30))
    assert status == 200 and engine.counts["done"] == 1 and engine.counts["cancelled"] == 0
