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
- Overlays loaded and dropped while serving (`ENGRAM_ALLOW_OVERLAY_UPDATES=1`, `engram serve --engine vllm
  --allow-overlay-updates`; off by default, 404 then, as vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): the middleware
  adds `POST /v1/load_overlay {"overlay_name", "overlay_path"}` and `POST /v1/unload_overlay {"overlay_name"}` (vLLM's
  `/v1/load_lora_adapter` shape, `serving.schema`) to vLLM's own app as it starts, so vLLM's API key guards them.
  They reach every worker through vLLM's `collective_rpc` and `OverlayWorker`, a worker extension
  (`--worker-extension-cls`): a load is checked there as at startup (`OverlayBank.load`; a refusal is a 4xx and
  changes nothing), then the name joins `REGISTRY.names`. An unload takes the name out of `REGISTRY.names` at once
  (later requests: the 400 naming the loaded ones) and drops the rows from the workers once the requests admitted
  before have finished: the middleware counts each name's requests in flight (`IN_FLIGHT`), and each worker's bank
  waits for its batch rows too (a request aborted on disconnect may run a step after its response ended).

Why not LoRA (vLLM's per-request weights, `--enable-lora`): its adapters are low-rank matrices loaded from PEFT
folders into a fixed set of layer classes, it wraps every linear layer of the model with its punica kernels (a
cost on each step for every request), and a batch holds at most `--max-loras` of them; table rows fit none of it.
"""

from __future__ import annotations

import asyncio
import json
import sys

from fastapi import Request  # (module level: FastAPI reads the route handlers' annotations from here)
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from ...errors import EngramError
from ...serving.engine import overlay_updates_allowed
from ...serving.schema import LoadOverlayRequest, UnloadOverlayRequest, openai_error
from .overlays import CHOICES, REGISTRY, WORKER, OverlayChoiceError, check_names, requested, route

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")  # bodies with a `model`
IN_FLIGHT: dict[str, int] = {}  # overlay name -> requests naming it whose answer is not over (this API server)
DRAINING: dict[str, asyncio.Event] = {}  # unloaded names waiting for their requests in flight (set: none left)


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
        self.updates = overlay_updates_allowed()

    async def __call__(self, scope, receive, send):
        if self.updates and scope["type"] in ("lifespan", "http"):
            _attach_updates(scope.get("app"))
        if scope["type"] != "http" or not (REGISTRY.names or DRAINING or self.updates):
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
            names = _chosen(new if new is not None else obj)
        except ValueError:  # not JSON: vLLM answers it
            new, names = None, ()
        if new is not None:
            body = json.dumps(new).encode()
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        for n in names:  # (counted before vLLM checks the names: an unload from now on waits for this request)
            IN_FLIGHT[n] = IN_FLIGHT.get(n, 0) + 1
        try:
            return await self.app(scope, _replay(body, receive), send)
        finally:  # the answer is over (sent whole, refused, or the client went away)
            for n in names:
                IN_FLIGHT[n] -= 1
                if not IN_FLIGHT[n]:
                    del IN_FLIGHT[n]
                    if n in DRAINING:
                        DRAINING[n].set()


def _chosen(obj) -> tuple[str, ...]:
    """The loaded overlays a request body names (after `route`), each once; () for a body that names none or
    names them in a shape vLLM will refuse."""
    xargs = obj.get("vllm_xargs") if isinstance(obj, dict) else None
    try:
        names = requested(xargs if isinstance(xargs, dict) else None)
    except OverlayChoiceError:
        return ()
    return tuple(dict.fromkeys(n for n in names if n in REGISTRY.names))


# ------------------------------------------------------------------------ overlays loaded and dropped while serving
LOAD, UNLOAD = "engram_load_overlay", "engram_unload_overlay"  # OverlayWorker's methods (collective_rpc)
_LOCK: list[asyncio.Lock] = []  # (made in the server's event loop, on first use)
_TASKS: set = set()  # drops waiting for their requests (kept referenced until done)


def _attach_updates(app) -> None:
    """Add the load/unload routes to vLLM's FastAPI `app` (once): inside vLLM's middleware, behind its API key."""
    if app is None or not hasattr(app, "add_api_route") or getattr(app.state, "engram_overlay_updates", False):
        return
    app.state.engram_overlay_updates = True
    app.add_api_route("/v1/load_overlay", load_overlay, methods=["POST"])
    app.add_api_route("/v1/unload_overlay", unload_overlay, methods=["POST"])
    print("engram: overlays may be loaded and unloaded while serving (POST /v1/load_overlay, /v1/unload_overlay)",
          file=sys.stderr, flush=True)


def _lock() -> asyncio.Lock:
    if not _LOCK:
        _LOCK.append(asyncio.Lock())
    return _LOCK[0]


async def _rpc(request: Request, method: str, *args) -> list:
    """`method` of `OverlayWorker` on every worker (vLLM's `collective_rpc`): one answer each."""
    return list(await request.app.state.engine_client.collective_rpc(method, args=args))


async def load_overlay(body: LoadOverlayRequest, raw_request: Request):
    """POST /v1/load_overlay: every worker reads and checks the folder as at startup, then the name is served."""
    from pathlib import Path

    from fastapi.responses import PlainTextResponse

    name = body.overlay_name
    try:
        check_names({name: body.overlay_path})
    except OverlayChoiceError as e:
        return openai_error(400, str(e), "invalid_value", "overlay_name")
    async with _lock():
        if name in REGISTRY.names:
            return openai_error(400, f"overlay {name!r} is already loaded; unload it first (POST "
                                "/v1/unload_overlay)", "overlay_exists", "overlay_name")
        if name in DRAINING:
            return openai_error(409, f"overlay {name!r} was unloaded and is still read by requests admitted before; "
                                "load it again once they finish", "overlay_draining", "overlay_name")
        try:
            got = await _rpc(raw_request, LOAD, name, str(Path(body.overlay_path).resolve()))
        except Exception as e:  # (no OverlayWorker: vLLM was started without the worker extension)
            return openai_error(500, f"the workers could not load overlays ({str(e).splitlines()[0][:300]}); start "
                                f"vLLM with --worker-extension-cls {WORKER} (engram serve --allow-overlay-updates "
                                "does)", "overlay_updates_unavailable")
        bad = [r for r in got if r.get("error")]
        if bad:
            if len(bad) < len(got):  # (a worker took it: take it back, nothing changes)
                await _rpc(raw_request, UNLOAD, name)
            return openai_error(int(bad[0].get("status", 400)), f"overlay {name!r} refused, nothing changed: "
                                f"{bad[0]['error']}", "invalid_overlay", "overlay_path")
        REGISTRY.names = (*REGISTRY.names, name)
    served = REGISTRY.served[0] if REGISTRY.served else "MODEL"
    return PlainTextResponse(f"Success: overlay '{name}' loaded ({got[0].get('rows', 0):,} rows), served as model "
                             f"{served}+{name}.")


async def unload_overlay(body: UnloadOverlayRequest, raw_request: Request):
    """POST /v1/unload_overlay: the name leaves at once; its rows leave the workers once its requests finish."""
    from fastapi.responses import PlainTextResponse

    name = body.overlay_name
    async with _lock():
        if name not in REGISTRY.names:
            return openai_error(404, f"overlay {name!r} is not loaded (loaded: {', '.join(REGISTRY.names) or 'none'})",
                                "overlay_not_found", "overlay_name")
        REGISTRY.names = tuple(n for n in REGISTRY.names if n != name)
        running = IN_FLIGHT.get(name, 0)
        DRAINING[name] = done = asyncio.Event()
        if not running:
            done.set()
            await _drop(raw_request, name, done)
        else:
            task = asyncio.ensure_future(_drop(raw_request, name, done))
            _TASKS.add(task)
            task.add_done_callback(_TASKS.discard)
    after = f"; its {running} running request{'s' if running != 1 else ''} finish with it" if running else ""
    return PlainTextResponse(f"Success: overlay '{name}' unloaded{after}.")


async def _drop(request: Request, name: str, done: asyncio.Event) -> None:
    """Once `done` (no request in flight names `name`), drop its rows from every worker."""
    try:
        await done.wait()
        await _rpc(request, UNLOAD, name)
    except Exception as e:  # (the server lives on; the rows stay until it restarts)
        print(f"engram: overlay {name!r} could not be dropped from the workers: {e}", file=sys.stderr, flush=True)
    finally:
        DRAINING.pop(name, None)


class OverlayWorker:
    """vLLM worker extension (`--worker-extension-cls engram.integrations.vllm.routing.OverlayWorker`): the methods
    the routes `load_overlay` / `unload_overlay` call on every worker through `collective_rpc`, between two steps.
    Each answers a dict (msgpack-safe): {"rows": n} / {"dropped": bool}, or {"error": one line, "status": HTTP
    status}."""

    def engram_load_overlay(self, name: str, folder: str) -> dict:
        bank = _bank_of(self)
        if isinstance(bank, dict):
            return bank
        try:
            return {"rows": bank.load(name, folder)}
        except FileNotFoundError as e:
            return {"error": str(e).splitlines()[0], "status": 404}
        except (EngramError, OSError, ValueError) as e:  # (EditError, IntegrityError, OverlayChoiceError, ...)
            return {"error": str(e).splitlines()[0] if str(e) else type(e).__name__, "status": 400}

    def engram_unload_overlay(self, name: str) -> dict:
        bank = _bank_of(self)
        if isinstance(bank, dict):
            return bank
        try:
            return {"dropped": bank.unload(name)}
        except OverlayChoiceError as e:
            return {"error": str(e), "status": 404}


def _bank_of(worker):
    """The `OverlayBank` of the worker's model, or the error answer when it has none."""
    bank = getattr(worker.get_model(), "overlay_bank", None)
    if bank is None:
        return {"error": "this model was loaded without overlay updates: start the server with "
                         "ENGRAM_ALLOW_OVERLAY_UPDATES=1 (engram serve --allow-overlay-updates)", "status": 400}
    return bank


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
