"""How a request's overlay choice reaches vLLM's steps, through two public vLLM extension points (no patching).

- `OverlaySelector`, a vLLM (V1) logits processor (`model_config.logits_processors`, which the config hook fills
  when `engram_overlays` is set; `--logits-processors` by hand). vLLM builds one in each worker and calls its
  `update_state` with every request entering, leaving or moving within the persistent batch, before each forward:
  it keeps `overlays.CHOICES` {batch row: overlay names}, which the model's step reads (`OverlayBank.for_step`).
  It never changes logits. In the API server vLLM calls its `validate_params` on every request: an unknown overlay
  name, or a malformed `vllm_xargs.engram_overlay`, is an HTTP 400 naming the loaded overlays.
- `OverlayRouting`, an ASGI middleware (`--middleware engram.integrations.vllm.routing.OverlayRouting`; `engram
  serve --engine vllm --overlay NAME=DIR` passes it): a request for model `MODEL+NAME` (engram serve's model ids)
  becomes model `MODEL` with `vllm_xargs: {"engram_overlay": ["NAME", ...]}` (`overlays.route`), and `GET
  /v1/models` lists `MODEL+NAME` for every loaded overlay beside `MODEL`. It runs before vLLM's authentication and
  only rewrites: the checks stay behind the key.

Why not LoRA (vLLM's per-request weights, `--enable-lora`): its adapters are low-rank matrices loaded from PEFT
folders into a fixed set of layer classes, it wraps every linear layer of the model with its punica kernels (a
cost on each step for every request), and a batch holds at most `--max-loras` of them; table rows fit none of it.
"""

from __future__ import annotations

import json

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from .overlays import CHOICES, REGISTRY, requested, route

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")  # request bodies with a `model`


class OverlaySelector(LogitsProcessor):
    """Tracks each persistent-batch row's overlay names (`overlays.CHOICES`) for this worker's steps; checks a
    request's names in the API server. Leaves logits as they are (argmax invariant)."""

    def __init__(self, vllm_config, device, is_pin_memory: bool):
        CHOICES.reset()  # (one selector per worker process; a new one starts from an empty batch)

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        requested(sampling_params.extra_args, REGISTRY.names)

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits):
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(CHOICES.rows, batch_update, lambda p, _prompt, _out: requested(p.extra_args) or None):
            CHOICES.version += 1


class OverlayRouting:
    """ASGI middleware: `MODEL+NAME` request bodies routed to MODEL with the overlay in `vllm_xargs`; overlay model
    ids added to `GET /v1/models`. Everything else passes through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not REGISTRY.names:
            return await self.app(scope, receive, send)
        method, path = scope["method"], scope["path"]
        if method == "POST" and path in ROUTES:
            return await self._request(scope, receive, send)
        if method == "GET" and path == "/v1/models":
            return await self.app(scope, receive, _ModelsList(send))
        return await self.app(scope, receive, send)

    async def _request(self, scope, receive, send):
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # (a disconnect before the body: vLLM's own handling)
                return await self.app(scope, _replay(b"".join(chunks), receive, msg), send)
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        try:
            obj = json.loads(body)
            new = route(obj, REGISTRY.served) if isinstance(obj, dict) else None
        except ValueError:  # not JSON: vLLM answers it
            new = None
        if new is not None:
            body = json.dumps(new).encode()
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        return await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive, first=None):
    """An ASGI `receive` giving `body` whole (then `first`, a message read past it, if any), then the client's own."""
    pending = [{"type": "http.request", "body": body, "more_body": False}] + ([first] if first else [])

    async def again():
        return pending.pop(0) if pending else await receive()

    return again


class _ModelsList:
    """An ASGI `send` that adds `MODEL+NAME` entries to a 200 JSON answer of `GET /v1/models`."""

    def __init__(self, send):
        self.send, self.start, self.chunks = send, None, []

    async def __call__(self, msg):
        if msg["type"] == "http.response.start":
            self.start = msg
            if msg["status"] != 200:
                self.start = None
                await self.send(msg)
            return
        if self.start is None:
            return await self.send(msg)
        self.chunks.append(msg.get("body", b""))
        if msg.get("more_body", False):
            return
        body = b"".join(self.chunks)
        try:
            obj = json.loads(body)
            entries = obj["data"]
            extra = [{**e, "id": f"{e['id']}+{n}"} for e in entries if e.get("id") in REGISTRY.served
                     for n in REGISTRY.names]
            body = json.dumps({**obj, "data": [*entries, *extra]}).encode()
        except (ValueError, KeyError, TypeError):
            pass  # (not the shape we know: passed on as it came)
        headers = [(k, v) for k, v in self.start["headers"] if k.lower() != b"content-length"]
        await self.send({**self.start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
