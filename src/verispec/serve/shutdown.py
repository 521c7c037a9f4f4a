"""Graceful shutdown for `verispec serve` (`serve(app, ...)`, what the CLI runs).

On SIGTERM (or Ctrl-C) the server stops admitting requests: every route but /metrics answers 503 with
`Retry-After` and `Connection: close` (an OpenAI-style error; /health too, so a load balancer takes the replica out of
rotation) while the requests in flight go on. Once they have all been answered, or after --shutdown-timeout seconds,
whichever comes first, the rest are cut short: their unfinished choices end with finish_reason "abort" and what
they have so far (streams get their last chunks and [DONE]), the RL routes' rollouts end as /abort_request ends
them, and a request that passed the gate before the drain but reaches the engine after the cut gets 503. Then the listening socket closes and the process exits; the log's last line says how every choice ended. A
second Ctrl-C exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from .errors import APIError

__all__ = ["Gate", "GateState", "GracefulServer", "abort_everything", "drain", "serve"]

log = logging.getLogger("verispec.serve")
_ALWAYS_OPEN = frozenset({"/metrics"})
_STRAGGLERS_S = 10  # after the cut: how long the cut requests get to send their last answers


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
    """Refuse new requests, let those in flight finish for up to `timeout` seconds, then cut the rest short."""
    gate: GateState = app.state.gate
    gate.draining = True
    if gate.in_flight:
        log.warning("shutting down: %d request(s) in flight get up to %gs; new ones get 503", gate.in_flight, timeout)
    if await _settled(gate, timeout, forced) or forced():
        return
    jobs = abort_everything(app)
    log.warning("--shutdown-timeout %gs passed: cut %d request(s) short (finish_reason abort)", timeout, jobs)
    if not await _settled(gate, _STRAGGLERS_S, forced):
        log.error("%d request(s) still unanswered; closing their connections", gate.in_flight)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with `drain` before its own shutdown (which closes the sockets and connections)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        await drain(self.config.app, self.shutdown_timeout, lambda: self.force_exit)
        await super().shutdown(sockets)


def serve(app, *, host: str, port: int, log_level: str = "warning", shutdown_timeout: float = 30.0) -> None:
    """Run `app` (from `create_app`) until SIGTERM / Ctrl-C, then shut down gracefully (see the module docstring)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=_STRAGGLERS_S)
    server = GracefulServer(config, shutdown_timeout)
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn's status for a server that could not start (e.g. the port is taken)
