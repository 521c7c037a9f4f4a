"""Read timeouts for `verispec serve` (--read-timeout, --body-timeout; docs/guides/serving.md, "Security defaults").
Headers: `HeaderDeadlineH11`, uvicorn's h11 protocol with one timer: a request's header block must be complete within
`read_timeout` of the connection opening or the previous response's end (uvicorn's keep-alive timer restarts on every
byte, so dribbled headers were never timed out). Bodies: `BodyTimeout`, ASGI middleware: each `receive` waits at most
`read_timeout` for bytes, and the whole body must come within `body_timeout` of its first read plus a second per MiB
received; past either, 408 with `Connection: close`. Once a shutdown starts, a read that finds no bytes at hand gets 503
(`BodyReads.cut`). Defaults: 10 s (rides out a pause and TCP's retransmission backoff), 30 s (a 4 MiB body: 34 s)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError

__all__ = ["BODY_RATE_BYTES_S", "DEFAULT_BODY_TIMEOUT_S", "DEFAULT_READ_TIMEOUT_S", "BodyReads", "BodyTimeout"]
__all__ += ["HeaderDeadlineH11", "check_read_timeout", "header_deadline_protocol", "install_transport"]

DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
BODY_RATE_BYTES_S = 1 << 20  # each MiB received adds a second to body_timeout
log = logging.getLogger("verispec.serve")
_GIVE_UP = {  # why a body read ends -> (status, what the client is told)
    "cut": (503, "the server is shutting down: the request body was still incomplete; retry later"),
    "stall": (
        408,
        "the request body stalled: no bytes for {read:g} s (the server's --read-timeout); send the whole "
        "body without pauses",
    ),
    "total": (
        408,
        "the request body took too long: {got} bytes in {body:g} s and more (the server's --body-timeout, "
        "plus 1 s per MiB); send the whole body at once",
    ),
}


def check_read_timeout(seconds: float, name: str = "read_timeout") -> float:
    """A timeout in seconds: a number > 0 (ValueError naming it otherwise)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < 1e9:
        raise ValueError(f"{name} must be a number of seconds > 0, got {seconds!r}")
    return float(seconds)


def install_transport(app, read_timeout=DEFAULT_READ_TIMEOUT_S, body_timeout=DEFAULT_BODY_TIMEOUT_S) -> BodyReads:
    """Install `BodyTimeout` on a FastAPI/Starlette app (before it starts) and keep its `BodyReads` as
    `app.state.body_reads` (what the shutdown cuts, and where `serve()` finds the app's read_timeout)."""
    reads = BodyReads(read_timeout, body_timeout)
    app.state.body_reads = reads
    app.add_middleware(BodyTimeout, reads=reads)
    return reads


class BodyReads:
    """The app's read and body timeouts and its body reads now waiting for bytes (`cut()` ends them)."""

    def __init__(self, read_timeout: float = DEFAULT_READ_TIMEOUT_S, body_timeout: float = DEFAULT_BODY_TIMEOUT_S):
        self.read_timeout = check_read_timeout(read_timeout)
        self.body_timeout = check_read_timeout(body_timeout, "body_timeout")
        self.is_cut = False
        self._waiting: set[asyncio.Future] = set()

    def cut(self) -> int:
        """From now on every body read that has to wait for bytes ends at once with 503 (one whose bytes are at hand
        still gets them); how many were waiting. On the server's event loop."""
        self.is_cut = True
        woken = [w for w in self._waiting if not w.done()]
        for w in woken:
            w.set_result(None)
        return len(woken)


class BodyTimeout:
    """ASGI middleware: a body read past its timeouts is answered here (if no response has started) and the app sees
    `http.disconnect` (what it raises on it is logged at debug level). Reads after the body pass through untimed."""

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
            # the app failed on the disconnect it was handed: the client has its answer, so no traceback
            log.debug("after a body timeout the app raised", exc_info=True)


class _Reading:
    """One request's timed `receive`, and the `send` that knows whether the response has started (or was given here:
    then the app's messages are dropped)."""

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
        if self.reads.is_cut:  # a shutdown: bytes at hand are taken (one turn of the loop), none is waited for
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
            status, message = _GIVE_UP[why]
            message = message.format(read=self.reads.read_timeout, body=self.reads.body_timeout, got=self.received)
            kind = {"kind": "server_error"} if status == 503 else {"code": "request_timeout"}
            error = APIError(status, message, headers={"Connection": "close"}, **kind)
            self.started = True
            await error.response()(self.scope, _disconnected, self._send)
        else:
            log.warning("a request body stalled after its response started (%s); the client is treated as gone", why)
        self.answered = True
        return {"type": "http.disconnect"}


async def _disconnected():
    return {"type": "http.disconnect"}


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline: while no request is being answered, the next request's header
    block must be complete within `read_timeout` seconds, bytes or no bytes; else the connection is closed.
    `header_deadline_protocol(t)` gives the class for a timeout (uvicorn builds protocols from a class)."""

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
        """Arm the deadline when the connection starts waiting for headers (a byte does not move it); disarm it once a
        request is being answered."""
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
