"""Read timeouts for `verispec serve` (--read-timeout): a client that sends its request slowly, or stops halfway,
holds a connection (and, mid-body, a request in flight) for at most `read_timeout` seconds of silence.

- Headers: `HeaderDeadlineH11`, uvicorn's h11 protocol with one timer. A request's header block must be complete
  within `read_timeout` seconds of the connection opening, or of the previous response's end on a keep-alive
  connection; else the connection is closed. uvicorn's own keep-alive timer restarts on every byte, so headers
  dribbled a byte at a time were never timed out (slowloris); this deadline does not move. `serve()` pins it
  (h11; httptools, were it installed, would need a subclass of its own).
- Bodies: `BodyTimeout`, ASGI middleware. While a request's body is being read, each `receive` waits at most
  `read_timeout` seconds for bytes, and the whole body must have come within `body_timeout` seconds of the first
  read (--body-timeout), plus a second per MiB received (`BODY_RATE_BYTES_S`: an upload faster than 1 MiB/s is
  never cut, however large). Past either, the client gets an OpenAI-style 408 with `Connection: close` (if no
  response has started) and the app sees the client leave (`http.disconnect`). A body trickled a byte at a time
  never goes `read_timeout` without bytes: the total bound is what lets it go. When a shutdown starts
  (`serve.shutdown.drain`), the body reads still waiting for bytes end the same way with 503 (`BodyReads.cut`),
  and so does every later read that finds no bytes at hand, instead of keeping the drain (and then uvicorn's
  cancellation: a text/plain 500 and a traceback) waiting for a body that may never end.

The defaults: read 10 s: a healthy client's gaps are milliseconds; 10 s rides out a client that pauses (a GC, a busy
host) and TCP's retransmission backoff (1 + 2 + 4 s for three lost segments) while a slow-loris connection is let
go within 10 s. Body 30 s: a 4 MiB body (--max-request-bytes) gets 34 s, the time of a 1 Mbit/s link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError

__all__ = [
    "BODY_RATE_BYTES_S",
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_READ_TIMEOUT_S",
    "BodyReads",
    "BodyTimeout",
    "HeaderDeadlineH11",
    "check_body_timeout",
    "check_read_timeout",
    "header_deadline_protocol",
    "install_transport",
]

DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
BODY_RATE_BYTES_S = 1 << 20  # each MiB received adds a second to body_timeout
log = logging.getLogger("verispec.serve")


def check_read_timeout(read_timeout: float) -> float:
    if isinstance(read_timeout, bool) or not isinstance(read_timeout, (int, float)) or not 0 < read_timeout < 1e9:
        raise ValueError(f"read_timeout must be a number of seconds > 0, got {read_timeout!r}")
    return float(read_timeout)


def check_body_timeout(body_timeout: float) -> float:
    if isinstance(body_timeout, bool) or not isinstance(body_timeout, (int, float)) or not 0 < body_timeout < 1e9:
        raise ValueError(f"body_timeout must be a number of seconds > 0, got {body_timeout!r}")
    return float(body_timeout)


def install_transport(
    app, read_timeout: float = DEFAULT_READ_TIMEOUT_S, body_timeout: float = DEFAULT_BODY_TIMEOUT_S
) -> BodyReads:
    """Install `BodyTimeout` on a FastAPI/Starlette app (before it starts) and keep its `BodyReads` as
    `app.state.body_reads` (what the shutdown cuts, and where `serve()` finds the app's read_timeout)."""
    reads = BodyReads(check_read_timeout(read_timeout), check_body_timeout(body_timeout))
    app.state.body_reads = reads
    app.add_middleware(BodyTimeout, reads=reads)
    return reads


class BodyReads:
    """The app's read and body timeouts and its body reads now waiting for bytes; `cut()` ends them (a shutdown's
    cut)."""

    def __init__(self, read_timeout: float = DEFAULT_READ_TIMEOUT_S, body_timeout: float = DEFAULT_BODY_TIMEOUT_S):
        self.read_timeout = check_read_timeout(read_timeout)
        self.body_timeout = check_body_timeout(body_timeout)
        self.is_cut = False
        self._waiting: set[asyncio.Future] = set()

    def cut(self) -> int:
        """From now on every body read that has to wait for bytes ends at once with 503: those waiting now, and any
        begun later (a read whose bytes are already at hand still gets them). Returns how many were waiting. Call it
        on the server's event loop."""
        self.is_cut = True
        woken = [w for w in self._waiting if not w.done()]
        for w in woken:
            w.set_result(None)
        return len(woken)


class BodyTimeout:
    """ASGI middleware: a request body that goes `reads.read_timeout` seconds without bytes, or is not complete
    `reads.body_timeout` seconds (plus a second per MiB received) after its first read, ends with 408 (503 once
    `reads.cut()`, when no bytes are at hand), answered here if no response has started; the app then sees
    `http.disconnect`. Reads after the body is complete (a route watching for the client to leave) pass through
    untimed. What the app raises on that disconnect (Starlette's ClientDisconnect) ends here, logged at debug
    level."""

    def __init__(self, app, reads: BodyReads):
        self.app, self.reads = app, reads

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        reading = _Reading(scope, receive, send, self.reads)
        try:
            await self.app(scope, reading.receive, reading.send)
        except Exception:
            if not reading.answered:
                raise
            # The app failed on the disconnect it was handed (Starlette's request.body() raises ClientDisconnect):
            # the client has its answer already, so no traceback for what was the client's stall.
            log.debug("after a body timeout the app raised", exc_info=True)


class _Reading:
    """One request's timed `receive` and the `send` that knows whether the response has started (or been given
    here, after which the app's messages are dropped)."""

    def __init__(self, scope, receive, send, reads: BodyReads):
        self.scope, self._receive, self._send, self.reads = scope, receive, send, reads
        self.body_done = False  # the last body message (or a disconnect) has been handed to the app
        self.started = False  # a response has started (the app's or ours)
        self.answered = False  # the request ended here (our error, or a stall past the start): drop the app's sends
        self.began: float | None = None  # the loop's time at the body's first read
        self.received = 0  # body bytes so far

    async def send(self, message):
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    def _left(self, now: float) -> float:
        """Seconds left for the whole body: body_timeout from the first read, plus a second per MiB received."""
        return self.began + self.reads.body_timeout + self.received / BODY_RATE_BYTES_S - now

    async def receive(self):
        if self.answered:
            return {"type": "http.disconnect"}
        if self.body_done:
            return await self._receive()
        loop = asyncio.get_running_loop()
        if self.began is None:
            self.began = loop.time()
        if self.reads.is_cut:
            # A shutdown: bytes at hand are taken (one turn of the loop runs the read, which returns at once when
            # uvicorn holds a message), none is waited for.
            message = loop.create_task(self._receive())
            await asyncio.sleep(0)
            if not message.done():
                message.cancel()
                return await self._give_up("cut")
            return self._got(message.result())
        left = self._left(loop.time())
        if left <= 0:
            return await self._give_up("total")
        message, woken = loop.create_task(self._receive()), loop.create_future()
        self.reads._waiting.add(woken)
        try:
            await asyncio.wait(
                (message, woken), timeout=min(self.reads.read_timeout, left), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self.reads._waiting.discard(woken)
            if not message.done():
                message.cancel()
        if message.done() and not message.cancelled():
            return self._got(message.result())
        if woken.done():
            return await self._give_up("cut")
        return await self._give_up("total" if left < self.reads.read_timeout else "stall")  # the wait that ran out

    def _got(self, message):
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_done = True
        return message

    async def _give_up(self, why: str):
        """End the body: why is "cut" (a shutdown: 503), "stall" (read_timeout without bytes: 408) or "total"
        (not complete within body_timeout: 408)."""
        self.body_done = True
        if not self.started:
            if why == "cut":
                error = APIError(
                    503,
                    "the server is shutting down: the request body was still incomplete; retry later",
                    kind="server_error",
                    headers={"Connection": "close"},
                )
            elif why == "stall":
                error = APIError(
                    408,
                    f"the request body stalled: no bytes for {self.reads.read_timeout:g} s (the server's "
                    "--read-timeout); send the whole body without pauses",
                    code="request_timeout",
                    headers={"Connection": "close"},
                )
            else:
                error = APIError(
                    408,
                    f"the request body took too long: {self.received} bytes in {self.reads.body_timeout:g} s and "
                    "more (the server's --body-timeout, plus 1 s per MiB); send the whole body at once",
                    code="request_timeout",
                    headers={"Connection": "close"},
                )
            self.started = True
            await error.response()(self.scope, _disconnected, self._send)
        else:
            log.warning("a request body stalled after its response started (%s); the client is treated as gone", why)
        self.answered = True
        return {"type": "http.disconnect"}


async def _disconnected():
    return {"type": "http.disconnect"}


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline: while no request is being answered (the connection is new,
    or its last response has ended), the next request's header block must be complete within `read_timeout`
    seconds of that moment, bytes or no bytes; else the connection is closed. `header_deadline_protocol(t)` gives
    the class for a timeout (uvicorn builds protocols from a class)."""

    read_timeout: float = DEFAULT_READ_TIMEOUT_S

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport):
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc):
        self._stop_header_deadline()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Arm the deadline when the connection starts waiting for a request's headers; disarm it once a request
        is being answered. A byte that arrives meanwhile does not move it."""
        waiting = self.cycle is None or self.cycle.response_complete
        if not waiting:
            self._stop_header_deadline()
        elif self._header_deadline is None and not self.transport.is_closing():
            self._header_deadline = self.loop.call_later(self.read_timeout, self._headers_too_slow)

    def _stop_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.transport.get_protocol() is not self:  # closed, or upgraded
            return
        self.logger.debug("closing a connection: no complete request header within %g s", self.read_timeout)
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()


def header_deadline_protocol(read_timeout: float = DEFAULT_READ_TIMEOUT_S) -> type[HeaderDeadlineH11]:
    """The `HeaderDeadlineH11` class for this timeout, for `uvicorn.Config(http=...)`."""
    read_timeout = check_read_timeout(read_timeout)
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"read_timeout": read_timeout})
