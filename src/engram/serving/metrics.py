"""`engram serve`'s `GET /metrics`: Prometheus's text format, through prometheus-client.

Every app has its own `CollectorRegistry` (never the process-wide default), so two apps in one process (tests, a
program serving two models) count apart. What is counted:

    engram_requests_total{endpoint, status}          every HTTP request answered, by route and status code
    engram_request_latency_seconds{endpoint}         request to last byte, completions routes (histogram)
    engram_time_to_first_token_seconds{endpoint}     request to the first decoded token (histogram)
    engram_prompt_tokens_total, engram_generation_tokens_total
    engram_requests_cancelled_total{endpoint}        requests whose client went away before the answer was whole
    engram_overlay_requests_total{overlay}           requests decoded with each loaded overlay (MODEL+NAME)
    engram_requests_waiting, engram_requests_running the queue and the worker, read at each scrape

The names follow vLLM's (`vllm:prompt_tokens_total`, `vllm:time_to_first_token_seconds`, ...) with engram's
prefix. Routes outside the server's own are counted as endpoint "other", so a scan of random paths cannot grow the
label set.
"""

from __future__ import annotations

import time

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
          "/detokenize", "/tokenizer_info")
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
# seconds: a token on a busy CPU takes tens of ms, a long answer a minute
ARRIVED = "engram.arrived"  # the ASGI scope key holding a request's arrival (time.monotonic())
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """The server's Prometheus metrics (module doc) in a registry of their own; `MetricsMiddleware` counts every
    request.
    `engine`: read at scrape time for the queue gauges (anything with `jobs.qsize()` and `busy.is_set()`);
    `overlays`: the loaded overlays' names, listed at zero before any use."""

    def __init__(self, engine=None, overlays=()):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("engram_requests", "HTTP requests answered, by route and status code",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("engram_request_latency_seconds", "Time from a completion request's arrival to "
                                 "its answer's last byte", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("engram_time_to_first_token_seconds", "Time from a completion request's arrival to "
                              "its first decoded token", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("engram_prompt_tokens", "Prompt tokens of the requests decoded", registry=r)
        self.generation_tokens = Counter("engram_generation_tokens", "Tokens decoded", registry=r)
        self.cancelled = Counter("engram_requests_cancelled", "Requests whose client went away before the answer "
                                 "was whole", ["endpoint"], registry=r)
        self.overlay_requests = Counter("engram_overlay_requests", "Requests decoded with a fact overlay, by its "
                                        "name", ["overlay"], registry=r)
        for name in overlays:
            self.overlay_requests.labels(name)
        waiting = Gauge("engram_requests_waiting", "Requests queued for the worker", registry=r)
        running = Gauge("engram_requests_running", "Requests being decoded (0 or 1: one worker)", registry=r)
        jobs, busy = getattr(engine, "jobs", None), getattr(engine, "busy", None)
        if jobs is not None and busy is not None:
            waiting.set_function(lambda: jobs.qsize())
            running.set_function(lambda: int(busy.is_set()))

    def render(self) -> tuple[bytes, str]:
        """(the text exposition of every metric, its content type)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """ASGI middleware counting each HTTP request by route and status into `metrics` (and timing the completions
    routes); added last, so it sits outside `limits.Guard` and a request the API key or body limits refuse is
    counted too. It leaves the request's arrival time in the scope (`ARRIVED`) for the time to first token."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ROUTES else "other"
        scope[ARRIVED] = t0 = time.monotonic()
        status = [500]  # (an exception escaping the app is answered 500 by the server-error middleware outside)

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            if endpoint in COMPLETIONS:
                self.metrics.latency.labels(endpoint).observe(time.monotonic() - t0)
