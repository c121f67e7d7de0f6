"""Bounds on what one connection can make `engram serve` do: the API key, the body's size and read time (an ASGI
middleware in front of every route), and the time a connection may take to send a request's head (uvicorn's h11
protocol with a deadline).

Without them a client could hold the server with a 50 MB body (read, parsed and tokenized on the event loop), or
with headers and half a body that never finishes (no route answers it, and shutdown waits for it). On shutdown
(`app.serve` sets `app.state.stop`) a body still arriving is answered 503 at once and its connection closed without
lingering: a request that was never all sent gets no grace period, the requests being decoded keep theirs.

A connection answered before its body was read (413 from the head, 408) is closed by *lingering*, as nginx does:
the answer is sent, the write side shut, and up to `LINGER_BYTES` of the rest of the body read and dropped for up
to `LINGER_SECONDS`. Closing at once with unread bytes makes the kernel send a reset, and a client that writes the
whole body before reading (the OpenAI SDK, urllib, requests) then sees ECONNRESET or EPIPE and never the 413.
"""

from __future__ import annotations

import asyncio
import hmac
import time

import h11
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from .defaults import SERVE_MAX_BODY, SERVE_READ_TIMEOUT
from .schema import openai_error


class BodyError(HTTPException):
    """The body is over the size limit (413) or was not all sent in time (408); FastAPI re-raises HTTPException
    from the body read, so the app's handler answers it in OpenAI's shape."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(status, message)
        self.code = code


class Guard:
    """ASGI middleware: 401 without the API key (compared in constant time), 413 for a Content-Length over
    `max_body` bytes and again while a body without one streams past it, 408 when the body is not all in
    `read_timeout` seconds after its head."""

    def __init__(self, app, api_key: str | None, max_body: int = SERVE_MAX_BODY,
                 read_timeout: float = SERVE_READ_TIMEOUT):
        self.app, self.max_body, self.read_timeout = app, int(max_body), float(read_timeout)
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return await openai_error(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the "
                                      "server's --api-key or ENGRAM_API_KEY)", "invalid_api_key")(scope, receive, send)
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body:  # (h11 has already refused most bad values)
            n = int(length) if length.isdigit() else length.decode("latin-1")
            return await openai_error(413, self.too_large(n), "request_too_large")(
                scope, receive, send)
        return await self.app(scope, self.limited(receive, scope), send)

    def too_large(self, n) -> str:
        n = f"{n:,}" if isinstance(n, int) else n
        return (f"the request body has {n} bytes or more; this server takes at most {self.max_body:,} "
                "(engram serve --max-body-bytes)")

    def limited(self, receive, scope=None):
        """`receive`, counting the body's bytes and keeping its deadline; once the body is in, `receive` itself
        (waiting for a disconnect must not time out)."""
        state = {"n": 0, "done": False, "deadline": time.monotonic() + self.read_timeout}

        app = (scope or {}).get("app")
        stop = getattr(getattr(app, "state", None), "stop", None)  # `app.serve`'s shutdown flag (a threading.Event)

        async def wrapped():
            if state["done"]:
                return await receive()
            while True:  # wait for the next part of the body, looking every STOP_POLL s whether the server stops
                left = state["deadline"] - time.monotonic()
                try:
                    message = await asyncio.wait_for(receive(), timeout=max(min(left, STOP_POLL) if stop else left,
                                                                            0.0))
                    break
                except asyncio.TimeoutError:
                    if stop is not None and stop.is_set():  # shutting down: a request not yet sent gets no grace
                        raise BodyError(503, "the server is shutting down and this request's body had not all "
                                        "arrived; send it again when the server is back", "server_shutting_down") \
                            from None
                    if time.monotonic() >= state["deadline"]:
                        raise BodyError(408, f"the request body did not arrive within {self.read_timeout:g} s "
                                        "(engram serve --read-timeout)", "request_timeout") from None
            if message["type"] != "http.request":
                state["done"] = True
                return message
            state["n"] += len(message.get("body", b""))
            if state["n"] > self.max_body:
                raise BodyError(413, self.too_large(state["n"]), "request_too_large")
            state["done"] = not message.get("more_body", False)
            return message

        return wrapped


STOP_POLL = 0.2  # seconds between looks at the shutdown flag while a request body is still arriving
LINGER_BYTES = 64 << 20  # at most this much of an unread body is read and dropped after answering it
LINGER_SECONDS = 10.0  # ... for at most this long


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: `close()` with a request body still unread lingers
    (`HeadDeadline._linger`) instead of resetting the connection; everything else is the real transport's."""

    def __init__(self, transport, protocol: HeadDeadline):
        self._transport, self._protocol = transport, protocol

    def close(self) -> None:
        stop = getattr(self._protocol.config, "engram_stop", None)
        if self._protocol.body_unread() and not self._transport.is_closing() and not (stop and stop.is_set()):
            self._protocol._linger()
        else:
            self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head within
    `config.engram_read_timeout` seconds of connecting or of its previous response (uvicorn itself waits forever
    for a first request, and for the rest of a body it did not read after answering 413), and lingering on a
    close that leaves a body unread (the module doc)."""

    _lingering: int | None = None  # bytes still to drop while lingering; None: not lingering
    _linger_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(_LingeringTransport(transport, self))
        self._arm()

    def body_unread(self) -> bool:
        """The client is still sending a request body that no one will read."""
        return self.conn.their_state is h11.SEND_BODY

    def _linger(self) -> None:
        real = self.transport._transport
        self._lingering = LINGER_BYTES
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, real.close)
        try:
            real.write_eof()  # (after the answer still buffered: the client reads it, then EOF)
            real.resume_reading()
        except (OSError, RuntimeError, NotImplementedError):
            real.close()

    def data_received(self, data: bytes) -> None:
        if self._lingering is None:
            return super().data_received(data)
        self._lingering -= len(data)  # dropped: the request was answered already
        if self._lingering <= 0:
            self.transport._transport.close()

    def eof_received(self):
        if self._lingering is not None:  # the client sent all it had and closed its side
            self.transport._transport.close()
        return super().eof_received()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        for timer in (getattr(self, "_head_deadline", None), self._linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(getattr(self.config, "engram_read_timeout", SERVE_READ_TIMEOUT),
                                                   self._expired)

    def _expired(self) -> None:
        waiting = self.cycle is None or self.cycle.response_complete  # (not inside a request: no head yet)
        if waiting and not self.transport.is_closing():
            self.transport.close()
