"""Graceful shutdown for `verispec serve` (`serve(app, ...)`; docs/guides/serving.md, "Shutdown"). On SIGTERM or Ctrl-C
every route but /metrics answers 503 (`Gate`), bodies still arriving get 503 (`BodyReads.cut`), requests in flight run
until answered or --shutdown-timeout, then the rest are cut short (`abort_everything`), and the process exits within
--shutdown-timeout + 2 s whatever the clients do: the cut requests get `_STRAGGLERS_S` to answer, and uvicorn's own
shutdown the rest of `_AFTER_CUT_S` (at least `_CLOSE_MIN_S`). A second Ctrl-C exits at once."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from .errors import APIError
from .transport import DEFAULT_READ_TIMEOUT_S, check_read_timeout, header_deadline_protocol, install_transport

__all__ = ["Gate", "GateState", "GracefulServer", "abort_everything", "drain", "make_server", "serve"]

log = logging.getLogger("verispec.serve")
_ALWAYS_OPEN = frozenset({"/metrics"})
_STRAGGLERS_S = 1.0  # after the cut: how long the cut requests get to send their last answers
_AFTER_CUT_S = 1.5  # after --shutdown-timeout: the stragglers, then uvicorn closing the connections
_CLOSE_MIN_S = 0.25  # uvicorn's wait for the connections to close, at least (then it cancels what is left)
_UVICORN_PAUSE_S = 0.1  # uvicorn's shutdown sleeps this long before it waits for the connections


@dataclass
class GateState:
    draining: bool = False
    in_flight: int = 0  # HTTP requests being answered (every route but /metrics)


class Gate:
    """ASGI middleware: counts the HTTP requests in flight and, while the server drains, refuses new ones (503)."""

    def __init__(self, app, state: GateState, retry_after_s: int = 1):
        self.app, self.state, self.retry_after_s = app, state, retry_after_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in _ALWAYS_OPEN:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            headers = {"Retry-After": str(self.retry_after_s), "Connection": "close"}
            refusal = APIError(503, "the server is shutting down; retry later", kind="server_error", headers=headers)
            await refusal.response()(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


def abort_everything(app) -> int:
    """Cut every request short: every job (OpenAI routes and /generate/) ends "abort" with what it has. Returns how
    many requests there were."""
    app.state.rollout.abort()
    return app.state.engine.expire_all()


async def _settled(gate: GateState, seconds: float, forced: Callable[[], bool]) -> bool:
    """Wait until no request is in flight (True), or `seconds` have passed or a forced exit came (False)."""
    deadline = time.monotonic() + seconds
    while gate.in_flight and not forced():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return not gate.in_flight


async def drain(app, timeout: float, forced: Callable[[], bool] = lambda: False) -> None:
    """Refuse new requests and bodies still arriving (503), let the requests in flight finish for up to `timeout`
    seconds, then cut the rest short."""
    gate: GateState = app.state.gate
    gate.draining = True
    reads = getattr(app.state, "body_reads", None)
    bodies = reads.cut() if reads is not None else 0  # a body still arriving would hold the drain: no waiting for it
    if gate.in_flight:
        why = "shutting down: %d request(s) in flight get up to %gs, but %d still sending a body (503) end now"
        log.warning(why + "; new ones get 503", gate.in_flight, timeout, bodies)
    if await _settled(gate, timeout, forced) or forced():
        return
    jobs = abort_everything(app)
    log.warning("--shutdown-timeout %gs passed: cut %d request(s) short (finish_reason abort)", timeout, jobs)
    if not await _settled(gate, _STRAGGLERS_S, forced):
        log.error("%d request(s) still unanswered; closing their connections", gate.in_flight)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with `drain` before its own shutdown, all in at most `shutdown_timeout` + `_AFTER_CUT_S`
    seconds (uvicorn's wait for the connections gets what the drain left)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        deadline = time.monotonic() + self.shutdown_timeout + _AFTER_CUT_S
        await drain(self.config.app, self.shutdown_timeout, lambda: self.force_exit)
        left = deadline - time.monotonic() - _UVICORN_PAUSE_S
        self.config.timeout_graceful_shutdown = max(_CLOSE_MIN_S, left)
        await super().shutdown(sockets)


def make_server(
    app,
    *,
    host: str,
    port: int,
    log_level: str = "warning",
    shutdown_timeout: float = 30.0,
    read_timeout: float | None = None,
    max_connections: int | None = None,
) -> GracefulServer:
    """The server `serve` runs (`.run()`). read_timeout: the seconds headers may take and a body may go without bytes
    (None: the app's own, from `install_transport`, else DEFAULT_READ_TIMEOUT_S). max_connections: uvicorn's
    limit_concurrency (None: no cap)."""
    if max_connections is not None and (type(max_connections) is not int or max_connections < 1):
        raise ValueError(f"max_connections must be an integer >= 1, got {max_connections!r}")
    reads = getattr(app.state, "body_reads", None)
    if reads is None:  # an app without BodyTimeout yet: install it here, before the app starts
        reads = install_transport(app, DEFAULT_READ_TIMEOUT_S if read_timeout is None else read_timeout)
    elif read_timeout is not None:
        reads.read_timeout = check_read_timeout(read_timeout)
    http, close = header_deadline_protocol(reads.read_timeout), _CLOSE_MIN_S  # (GracefulServer.shutdown sets close)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=http,
        limit_concurrency=max_connections,
        timeout_graceful_shutdown=close,
    )
    return GracefulServer(config, shutdown_timeout)


def serve(app, **options) -> None:
    """Run `app` (from `create_app`) until SIGTERM / Ctrl-C, then shut down gracefully; options: `make_server`'s."""
    server = make_server(app, **options)
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn's status for a server that could not start (e.g. the port is taken)
