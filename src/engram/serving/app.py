"""`engram serve`: the OpenAI API over an `Engine` (FastAPI + uvicorn).

Routes: `GET /v1/models` (the model and `MODEL+OVERLAY` for every loaded overlay), `POST /v1/completions`,
`POST /v1/chat/completions` (where the tokenizer has a chat template), both streaming (SSE) on `stream: true`;
`temperature`, `top_p`, `max_tokens`, `stop`, `seed`. With an API key (`--api-key` or `ENGRAM_API_KEY`)
every request without `Authorization: Bearer KEY` gets 401. Bad input is a 4xx with OpenAI's error JSON
(`{"error": {"message", "type", "param", "code"}}`) and the server lives on.

transformers' own `transformers serve` loads hub models by name into its own generation loop; it has no
place for engram's table backends or a per-request overlay, so this is a small FastAPI app instead.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request  # (module level: FastAPI reads the handlers' annotations from here)
from fastapi.responses import JSONResponse, StreamingResponse

from .engine import Engine, Job, ServeError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _error(status: int, message: str, code: str, param: str | None = None):
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def _number(body: dict, key: str, default, lo=None, hi=None, kind=float):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise ServeError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {v!r}", 400,
                         "invalid_value", key)
    v = kind(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ServeError(f"{key} must lie in [{lo}, {hi}], got {v}", 400, "invalid_value", key)
    return v


def _stops(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        return [s]
    if isinstance(s, list) and all(isinstance(x, str) for x in s) and len(s) <= 4:
        return [x for x in s if x]
    raise ServeError("stop must be a string or a list of up to 4 strings", 400, "invalid_value", "stop")


def create_app(engine: Engine, api_key: str | None = None):
    app = FastAPI(title="engram", description="OpenAI-compatible server for Engram models")
    app.state.engine = engine

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the server's --api-key "
                          "or ENGRAM_API_KEY)", "invalid_api_key")
        return await call_next(request)

    @app.exception_handler(ServeError)
    async def serve_error(request, e: ServeError):
        return _error(e.status, str(e), e.code, e.param)

    @app.get("/health")
    async def health():
        return {"status": "ok", "queued": engine.jobs.qsize(), "busy": engine.busy.is_set(), **engine.counts}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": m, "object": "model", "created": engine.created, "owned_by": "engram"}
                                           for m in engine.model_ids()]}

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise ServeError(f"the request body is not valid JSON ({e})", 400, "invalid_json") from None
        if not isinstance(body, dict):
            raise ServeError("the request body must be a JSON object", 400, "invalid_json")
        return body

    def job_settings(body: dict) -> dict:
        return dict(max_tokens=_number(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, engine.max_context, int),
                    temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
                    seed=_number(body, "seed", None, kind=int), stop=_stops(body))

    async def run(request: Request, body: dict, prompt: str, chat: bool):
        overlay = engine.resolve(body.get("model"))
        settings = job_settings(body)
        ids = engine.encode(prompt)
        engine.check(ids, settings["max_tokens"])
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(ids=ids, overlay=overlay, emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                  **settings)
        engine.submit(job)
        created, model = int(time.time()), body.get("model")
        kind = "chat.completion" if chat else "text_completion"
        cid = ("chatcmpl-" if chat else "cmpl-") + job.id

        def usage(n):
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if body.get("stream"):
            async def sse():
                try:
                    if chat:
                        yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                    "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
                    while True:
                        ev = await events.get()
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
                            yield "data: [DONE]\n\n"
                            return
                        else:
                            yield _sse({"error": {"message": ev["message"], "type": "server_error", "param": None,
                                                  "code": "generation_failed"}})
                            return
                finally:  # the client went away (or the stream ended): stop decoding, free the worker
                    job.cancelled.set()

            return StreamingResponse(sse(), media_type="text/event-stream")
        text, reason, n = "", None, 0
        try:
            while True:
                get = asyncio.ensure_future(events.get())
                while not get.done():
                    await asyncio.wait([get], timeout=0.25)
                    if not get.done() and await request.is_disconnected():
                        get.cancel()
                        job.cancelled.set()
                        return _error(499, "client closed the request", "client_closed")
                ev = get.result()
                if ev["type"] == "delta":
                    text += ev["text"]
                elif ev["type"] == "done":
                    reason, n = ev["finish_reason"], ev["completion_tokens"]
                    break
                else:
                    return _error(500, ev["message"], "generation_failed")
        finally:
            job.cancelled.set()
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason} if chat
                  else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
        return {"id": cid, "object": kind, "created": created, "model": model, "choices": [choice], "usage": usage(n)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ServeError("prompt must be a string (one prompt per request)", 400, "invalid_value", "prompt")
        return await run(request, body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                for m in msgs):
            raise ServeError("messages must be a non-empty list of {role, content} objects", 400, "invalid_value",
                             "messages")
        return await run(request, body, engine.render_chat(msgs), chat=True)

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "warning") -> None:
    """Run the server until SIGINT/SIGTERM; in-flight requests finish first (uvicorn's graceful shutdown)."""
    import uvicorn

    config = uvicorn.Config(create_app(engine, api_key), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=None)
    server = uvicorn.Server(config)
    print(f"engram serve: {', '.join(engine.model_ids())} on http://{host}:{port}/v1"
          + (" (API key required)" if api_key else ""), flush=True)
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
