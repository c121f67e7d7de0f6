"""`engram serve`: the OpenAI API over an `Engine` (FastAPI + uvicorn).

Routes: `GET /v1/models` (the model and `MODEL+OVERLAY` for every loaded overlay), `POST /v1/completions`,
`POST /v1/chat/completions` (where the tokenizer has a chat template), both streaming (SSE) on `stream: true`;
`temperature`, `top_p`, `top_k` (vLLM's extra field), `max_tokens`, `stop`, `seed`; on completions also
`logprobs`, `echo` and token-id prompts
(OpenAI's legacy shape, as vLLM answers it: what lm-eval-harness's `local-completions` sends). `GET /metrics`:
Prometheus's text format (`metrics.py`). vLLM's `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`,
so a client (lm-eval's remote tokenizer) tokenizes as the server does. With `--allow-overlay-updates` (or
`ENGRAM_ALLOW_OVERLAY_UPDATES=1`; off by default, 404 then, as vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`):
`POST /v1/load_overlay {"overlay_name", "overlay_path"}` and `POST /v1/unload_overlay {"overlay_name"}`, vLLM's
dynamic LoRA endpoints' shape (200 and a one-line text; OpenAI's error JSON otherwise). With an API key
(`--api-key` or `ENGRAM_API_KEY`) every request without `Authorization: Bearer KEY` gets 401. Bodies are validated
against the pydantic models of `schema.py`; every refusal (400, 401, 404, 405, 408, 413, 422) is OpenAI's error JSON
(`{"error": {"message", "type", "param", "code"}}`) and the server lives on. `limits.py` bounds the body's size
and read time; a prompt longer than the context could hold is refused before it is tokenized, and tokenizing
runs off the event loop, so `/health` answers while a big request is refused.

transformers' own `transformers serve` loads hub models by name into its own generation loop; it has no
place for engram's table backends or a per-request overlay, so this is a small FastAPI app instead.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request  # (module level: FastAPI reads the handlers' annotations from here)
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from .defaults import SERVE_MAX_BODY, SERVE_READ_TIMEOUT, SERVE_SHUTDOWN_TIMEOUT
from .engine import Engine, Job, ServeError, overlay_updates_allowed
from .limits import BodyError, Guard, HeadDeadline
from .metrics import ARRIVED, Metrics, MetricsMiddleware
from .schema import (
    DEFAULT_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadOverlayRequest,
    TokenizeRequest,
    UnloadOverlayRequest,
    openai_error,
)

OVERLAY_ROUTES = ("/v1/load_overlay", "/v1/unload_overlay")  # with --allow-overlay-updates only


def _validation_error(request: Request, e: RequestValidationError):
    """FastAPI's validation errors as one OpenAI error: the first problem, naming the field (`param`)."""
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ())[1:]]  # (loc[0] is "body")
    if err.get("type") == "json_invalid":
        return openai_error(400, f"the request body is not valid JSON ({err.get('ctx', {}).get('error', '')})",
                            "invalid_json")
    if not loc:
        kind = request.headers.get("content-type", "")
        why = (f"it was sent as {kind!r}: send Content-Type: application/json" if "json" not in kind else
               "it must be a JSON object")
        return openai_error(400, f"the request body is not a JSON object of this route's fields ({why})",
                            "invalid_json")
    got = err.get("input")
    got = repr(got[:40]) + "..." if isinstance(got, str) and len(got) > 40 else repr(got)
    got = got if len(got) <= 60 else got[:60] + "..."
    return openai_error(400, f"{'.'.join(loc)}: {err.get('msg')}" + ("" if err.get("type") == "missing" else
                                                                     f" (got {got})"), err.get("type"), loc[0])


def _http_error(request: Request, e: HTTPException):
    """Starlette's own errors (404 no such route, 405 wrong method, body errors) in OpenAI's shape."""
    if isinstance(e, BodyError):
        return openai_error(e.status_code, e.detail, e.code, headers={"connection": "close"} if e.status_code == 408
                            else None)
    if e.status_code == 400 and e.__cause__ is not None:  # FastAPI could not read the body as JSON
        cause = e.__cause__
        why = ("it is not valid UTF-8" if isinstance(cause, UnicodeDecodeError) else
               f"{type(cause).__name__}: {str(cause)[:200]}")
        return openai_error(400, f"the request body is not valid JSON ({why})", "invalid_json")
    if e.status_code == 404 and request.url.path in OVERLAY_ROUTES:
        return openai_error(404, f"{request.url.path} is off: start engram serve with --allow-overlay-updates (or "
                            "ENGRAM_ALLOW_OVERLAY_UPDATES=1) to load and unload overlays while serving", "not_found")
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request")
    detail = {404: f"no route {request.method} {request.url.path}; this server has GET /v1/models, "
                   "POST /v1/completions, POST /v1/chat/completions, GET /health, GET /metrics, POST /tokenize, "
                   "POST /detokenize, GET /tokenizer_info",
              405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
    return openai_error(e.status_code, detail, code, headers=getattr(e, "headers", None))


def create_app(engine: Engine, api_key: str | None = None, max_body: int = SERVE_MAX_BODY,
               read_timeout: float = SERVE_READ_TIMEOUT, allow_overlay_updates: bool | None = None):
    """The FastAPI app over `engine`, behind `Guard` (API key, body size and read time), counted by `Metrics`
    (`app.state.metrics`, its own registry). `allow_overlay_updates`: add the overlay load/unload routes (None: as
    `ENGRAM_ALLOW_OVERLAY_UPDATES` says, `engine.overlay_updates_allowed`)."""
    app = FastAPI(title="engram", description="OpenAI-compatible server for Engram models")
    app.state.engine = engine
    app.state.metrics = metrics = Metrics(engine, getattr(engine, "overlays", {}))
    app.add_middleware(Guard, api_key=api_key, max_body=max_body, read_timeout=read_timeout)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # (added last: outermost, it counts what Guard refuses)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)

    @app.exception_handler(ServeError)
    async def serve_error(request, e: ServeError):
        return openai_error(e.status, str(e), e.code, e.param)

    @app.get("/health")
    async def health():
        return {"status": "ok", "queued": engine.jobs.qsize(), "busy": engine.busy.is_set(), **engine.counts}

    @app.get("/metrics")
    async def prometheus():
        from fastapi.responses import Response

        body, kind = metrics.render()
        return Response(body, media_type=kind)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return engine.tokenizer_info()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            engine.resolve(body.model)
        engine.check_chars(len(body.prompt))
        ids = await run_in_threadpool(engine.encode, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            engine.resolve(body.model)
        engine.check_ids(body.tokens, "tokens")
        return {"prompt": await run_in_threadpool(engine.text_of, body.tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": m, "object": "model", "created": engine.created, "owned_by": "engram"}
                                           for m in engine.model_ids()]}

    if overlay_updates_allowed(allow_overlay_updates):
        from fastapi.responses import PlainTextResponse

        @app.post("/v1/load_overlay")
        async def load_overlay(body: LoadOverlayRequest):
            """Check the folder off the event loop (decoding goes on), then serve it as MODEL+NAME."""
            rows = await run_in_threadpool(engine.load_overlay, body.overlay_name, body.overlay_path)
            metrics.overlay_requests.labels(body.overlay_name)  # (listed at zero, as a startup overlay)
            return PlainTextResponse(f"Success: overlay '{body.overlay_name}' loaded ({rows:,} rows), served as model "
                                     f"{engine.name}+{body.overlay_name}.")

        @app.post("/v1/unload_overlay")
        async def unload_overlay(body: UnloadOverlayRequest):
            running = engine.unload_overlay(body.overlay_name)
            after = (f"; its {running} queued or running request{'s' if running != 1 else ''} finish with it"
                     if running else "")
            return PlainTextResponse(f"Success: overlay '{body.overlay_name}' unloaded{after}.")

    def job_settings(body: CompletionRequest | ChatRequest) -> dict:
        bad = body.unimplemented()
        if bad:
            raise ServeError(f"{', '.join(bad)}: not implemented by engram serve (one greedy or sampled choice, "
                             "no penalties or tools; logprobs and echo on /v1/completions only); leave them out", 400,
                             "unsupported_parameter", bad[0])
        logprobs, echo = getattr(body, "logprobs", None), bool(getattr(body, "echo", None))
        if logprobs is not None and body.stream:
            raise ServeError("logprobs with stream: true is not implemented by engram serve; send stream: false (the "
                             "answer comes whole, with every token's logprobs)", 400, "unsupported_parameter",
                             "logprobs")
        max_tokens = body.max_tokens
        if max_tokens == 0 and not echo:
            raise ServeError("max_tokens 0 asks for no completion: send echo: true (and logprobs) to score the "
                             "prompt, or at least 1", 400, "invalid_value", "max_tokens")
        if max_tokens is None:
            max_tokens = getattr(body, "max_completion_tokens", None) or DEFAULT_MAX_TOKENS
        return dict(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, seed=body.seed,
                    stop=body.stop or [], logprobs=logprobs, echo=echo)

    async def run(request: Request, body: CompletionRequest | ChatRequest, prompt: str | list[dict] | list[int],
                  chat: bool):
        """Check, tokenize (off the event loop), queue the job, and answer it: streamed, or whole once done.
        `prompt`: chat messages, a text, or token ids."""
        arrived = request.scope.get(ARRIVED, time.monotonic())
        endpoint = request.url.path
        overlay = engine.resolve(body.model)
        held = None if overlay is None else engine.overlays[overlay]  # (taken now: an unload from here on leaves it)
        settings = job_settings(body)
        if chat:
            engine.check_chars(sum(len(m["content"]) for m in prompt), "messages")  # (before rendering)
            prompt = await run_in_threadpool(engine.render_chat, prompt)
        if isinstance(prompt, list):  # token ids
            ids = prompt
            engine.check_ids(ids)
            echoed = engine.text_of(ids) if settings["echo"] else ""
        else:
            engine.check_chars(len(prompt), "messages" if chat else "prompt")
            ids = await run_in_threadpool(engine.encode, prompt)
            echoed = prompt if settings["echo"] else ""
        engine.check(ids, settings["max_tokens"])
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(ids=ids, overlay=overlay, emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                  rows=held, **settings)
        engine.submit(job)
        metrics.prompt_tokens.inc(len(ids))
        if overlay is not None:
            metrics.overlay_requests.labels(overlay).inc()
        created, model = int(time.time()), body.model
        kind = "chat.completion" if chat else "text_completion"
        cid = ("chatcmpl-" if chat else "cmpl-") + job.id
        first = [True]

        def seen(ev):
            """Count a worker event into the metrics: the first token's time, the tokens decoded."""
            if ev["type"] == "delta" and first[0]:
                first[0] = False
                metrics.ttft.labels(endpoint).observe(time.monotonic() - arrived)
            elif ev["type"] == "done":
                metrics.generation_tokens.inc(ev["completion_tokens"])
            return ev

        def usage(n):
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if body.stream:
            async def sse():
                finished = False
                try:
                    if chat:
                        yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                    "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
                    if echoed:
                        yield _sse({"id": cid, "object": kind, "created": created, "model": model,
                                    "choices": [{"index": 0, "text": echoed, "finish_reason": None}]})
                    while True:
                        ev = seen(await events.get())
                        if ev["type"] == "delta":
                            piece = ({"delta": {"content": ev["text"]}} if chat else {"text": ev["text"]})
                            yield _sse({"id": cid, "object": kind + (".chunk" if chat else ""), "created": created,
                                        "model": model, "choices": [{"index": 0, **piece, "finish_reason": None}]})
                        elif ev["type"] == "done":
                            end = {"delta": {}} if chat else {"text": ""}
                            yield _sse({"id": cid, "object": kind + (".chunk" if chat else ""), "created": created,
                                        "model": model, "choices": [{"index": 0, **end,
                                                                     "finish_reason": ev["finish_reason"]}],
                                        "usage": usage(ev["completion_tokens"])})
                            finished = True
                            yield "data: [DONE]\n\n"
                            return
                        else:
                            finished = True
                            yield _sse({"error": {"message": ev["message"], "type": "server_error", "param": None,
                                                  "code": "generation_failed"}})
                            return
                finally:  # the client went away (or the stream ended): stop decoding, free the worker
                    job.cancelled.set()
                    if not finished:
                        metrics.cancelled.labels(endpoint).inc()

            return StreamingResponse(sse(), media_type="text/event-stream")
        text, reason, n, done = "", None, 0, {}
        gone = asyncio.ensure_future(_disconnect(request))  # (the client going away cancels its job at once)
        try:
            while True:
                get = asyncio.ensure_future(events.get())
                await asyncio.wait([get, gone], return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the client closed its connection: queued or decoding, the job stops
                    get.cancel()
                    metrics.cancelled.labels(endpoint).inc()
                    return openai_error(499, "client closed the request", "client_closed")
                ev = seen(get.result())
                if ev["type"] == "delta":
                    text += ev["text"]
                elif ev["type"] == "done":
                    reason, n, done = ev["finish_reason"], ev["completion_tokens"], ev
                    break
                else:
                    return openai_error(500, ev["message"], "generation_failed")
        except asyncio.CancelledError:  # SIGTERM, and --shutdown-timeout has passed: say so, in OpenAI's shape
            return openai_error(503, "the server is shutting down and stopped this request (engram serve "
                                "--shutdown-timeout); send it again when it is back", "server_shutting_down")
        finally:  # (also when the task is cancelled: shutdown's timeout)
            gone.cancel()
            job.cancelled.set()
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason} if chat
                  else {"index": 0, "text": echoed + text, "logprobs": _logprobs(done, echoed),
                        "finish_reason": reason})
        return {"id": cid, "object": kind, "created": created, "model": model, "choices": [choice], "usage": usage(n)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await run(request, body, body.prompt[0], chat=False)  # (one prompt: text, or token ids)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await run(request, body, [{"role": m.role, "content": m.content} for m in body.messages], chat=True)

    @app.exception_handler(Exception)
    async def failed(request, e: Exception):  # (a bug: still OpenAI's shape, and the server lives on)
        return openai_error(500, f"internal error: {type(e).__name__}: {str(e)[:200]}", "internal_error")

    return app


async def _disconnect(request: Request) -> None:
    """Return when the client has closed the connection of `request`, whose body has been read: from then on the
    server's `receive` yields only `http.disconnect` (a look every few tokens would miss a client of a model that
    decodes faster than it looks)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # (uvicorn waits inside receive; a server that does not must not spin here)


def _logprobs(done: dict, echoed: str) -> dict | None:
    """A completion choice's `logprobs` (OpenAI's legacy shape, as vLLM fills it) from the worker's "done" event:
    the prompt's tokens first when echoed (the first with None), then the completion's; `text_offset`: where each
    token's text starts in the choice's text, counting each token's own text (vLLM's way: the completion's from
    the end of the echoed prompt). None when the request asked for no logprobs."""
    parts = [(p, at) for p, at in ((done.get("prompt_logprobs"), 0), (done.get("logprobs"), len(echoed)))
             if p is not None]
    if not parts:
        return None
    out = {key: [v for p, _ in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs")}
    out["text_offset"] = offsets = []
    for part, at in parts:
        for t in part["tokens"]:
            offsets.append(at)
            at += len(t)
    return out


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "warning", max_body: int = SERVE_MAX_BODY, read_timeout: float = SERVE_READ_TIMEOUT,
          shutdown_timeout: float = SERVE_SHUTDOWN_TIMEOUT, allow_overlay_updates: bool | None = None) -> None:
    """Run the server until SIGINT/SIGTERM. Then it stops accepting, closes idle connections, answers a request
    whose body is still arriving with 503 at once, lets the requests in flight finish for up to `shutdown_timeout`
    s, cancels what is left (their decodes stop) and exits 0. `allow_overlay_updates`: as `create_app`'s."""
    import threading

    import uvicorn

    app = create_app(engine, api_key, max_body, read_timeout, allow_overlay_updates)
    app.state.stop = stop = threading.Event()  # set on SIGINT/SIGTERM: bodies still arriving are refused at once

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            stop.set()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port,
                            log_level=log_level, http=HeadDeadline, timeout_keep_alive=5,
                            timeout_graceful_shutdown=shutdown_timeout)
    config.engram_read_timeout = read_timeout  # (HeadDeadline's deadline for a request's head)
    config.engram_stop = stop  # (HeadDeadline: no lingering once stopping)
    server = _Server(config)
    print(f"engram serve: {', '.join(engine.model_ids())} on http://{host}:{port}/v1"
          + (" (API key required)" if api_key else "")
          + ("; overlays may be loaded and unloaded (POST /v1/load_overlay, /v1/unload_overlay)"
             if overlay_updates_allowed(allow_overlay_updates) else ""), flush=True)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal with the handler found before it ran:
    # that handler ends the process with status 0 (a requested stop, not a crash)
    import signal

    def stopped(signum, frame):
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        server.run()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()
