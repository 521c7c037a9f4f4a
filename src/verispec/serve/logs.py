"""The server's log lines (docs/guides/serving.md, "Logs"), at INFO on the `verispec.serve` loggers:

- `AccessLog`, on `verispec.serve.access`: one line per HTTP request once its response has ended (a stream too), like
  uvicorn's access line plus what the engine did for it: `127.0.0.1:50312 "POST /v1/completions HTTP/1.1" 200
  request_id=cmpl-3f2a... prompt_tokens=5 output_tokens=16 latency=0.412s` (`--disable-log-requests` turns it off).
  The engine's calls reach the line through a context variable that `EngineThread.submit` fills (`note_call`).
- `StatsLogger`, on `verispec.serve.stats`: every `--log-stats-interval` seconds (default 10, vLLM's), when something
  happened since the last line, vLLM's periodic lines: throughput, running and waiting requests, KV-cache use, and
  its speculative-decoding line (mean acceptance length, accepted and drafted throughput and counts, per-position
  acceptance, draft acceptance rate) when a step drafted (`--disable-log-stats` turns them off). The figures are the
  Prometheus counters' (`Metrics.snapshot`), differenced between two lines (`stats_lines`, a pure function)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar

from .metrics import Metrics, Snapshot

__all__ = ["DEFAULT_LOG_STATS_INTERVAL_S", "AccessLog", "StatsLogger", "note_call", "stats_lines"]

DEFAULT_LOG_STATS_INTERVAL_S = 10.0  # vLLM's
access_log = logging.getLogger("verispec.serve.access")
stats_log = logging.getLogger("verispec.serve.stats")
_CALLS: ContextVar[list | None] = ContextVar("verispec_serve_calls", default=None)
_ID_PREFIX = (("/chat/completions", "chatcmpl-"), ("/completions", "cmpl-"))  # as the responses' `id`


def note_call(call) -> None:
    """An engine call made for the HTTP request being answered (its access line counts its tokens); a no-op outside
    one, or when the app has no access log."""
    calls = _CALLS.get()
    if calls is not None:
        calls.append(call)


class AccessLog:
    """ASGI middleware: one INFO line per HTTP request on `verispec.serve.access`, when its response has ended (or
    failed: 500; or its client left before any answer: 499)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began, status, calls = time.perf_counter(), [], []
        token = _CALLS.set(calls)

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            status.append(500)
            raise
        finally:
            _CALLS.reset(token)
            code = status[0] if status else 499
            access_log.info("%s", access_line(scope, code, calls, time.perf_counter() - began))


def access_line(scope, status: int, calls: list, seconds: float) -> str:
    """`client "METHOD /path HTTP/1.1" status [request_id=... prompt_tokens=N output_tokens=N] latency=0.123s`."""
    from .engine import prompt_tokens

    host, port = scope.get("client") or ("-", 0)
    path = scope["path"] + (f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else "")
    line = f'{host}:{port} "{scope["method"]} {path} HTTP/{scope.get("http_version", "1.1")}" {status}'
    if calls:
        prefix = next((p for suffix, p in _ID_PREFIX if scope["path"].rstrip("/").endswith(suffix)), "")
        ids = ",".join(f"{prefix}{c.job.key}" for c in calls)
        tokens = sum(prompt_tokens(c.job) for c in calls), sum(c.tokens for c in calls)
        line += f" request_id={ids} prompt_tokens={tokens[0]} output_tokens={tokens[1]}"
    return f"{line} latency={seconds:.3f}s"


def stats_lines(prev: Snapshot, cur: Snapshot, was_active: bool) -> tuple[list[str], bool]:
    """The periodic lines for the window from `prev` to `cur`, and whether the window was active (tokens went
    through, or requests ran or waited). An idle window after an idle one gives no line; the first idle window after
    activity gives the engine line once (throughput 0: the drop shows); the speculative line needs a draft."""
    span = cur.time - prev.time
    prompt, generated = cur.prompt_tokens - prev.prompt_tokens, cur.generation_tokens - prev.generation_tokens
    active = bool(prompt or generated or cur.running or cur.waiting)
    if not (active or was_active) or span <= 0:
        return [], active
    lines = [
        f"Avg prompt throughput: {prompt / span:.1f} tokens/s, Avg generation throughput: {generated / span:.1f} "
        f"tokens/s, Running: {cur.running} reqs, Waiting: {cur.waiting} reqs, KV cache usage: {100 * cur.kv_usage:.1f}%"
    ]
    drafts = cur.drafts - prev.drafts
    if drafts > 0:
        drafted, accepted = cur.draft_tokens - prev.draft_tokens, cur.accepted_tokens - prev.accepted_tokens
        before = prev.accepted_per_pos + (0.0,) * (len(cur.accepted_per_pos) - len(prev.accepted_per_pos))
        per_pos = ", ".join(f"{(c - b) / drafts:.3f}" for c, b in zip(cur.accepted_per_pos, before))
        lines.append(
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted throughput: "
            f"{accepted / span:.2f} tokens/s, Drafted throughput: {drafted / span:.2f} tokens/s, Accepted: "
            f"{accepted:.0f} tokens, Drafted: {drafted:.0f} tokens, Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {100 * accepted / drafted if drafted else 0.0:.1f}%"
        )
    return lines, active


class StatsLogger:
    """vLLM's periodic stats lines from a server's `Metrics` (see the module docstring): `tick()` logs them once
    `interval` seconds have passed since the last window began; `run()` ticks forever on the event loop.

    Args:
        metrics: The server's metrics.
        interval: Seconds between two lines.
        clock: Monotonic seconds (a test's own clock).
    """

    def __init__(
        self,
        metrics: Metrics,
        interval: float = DEFAULT_LOG_STATS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < 1e9:
            raise ValueError(f"log_stats_interval must be a number of seconds > 0, got {interval!r}")
        self.metrics, self.interval, self.clock = metrics, float(interval), clock
        self.last, self.active = metrics.snapshot(self.clock()), False

    def tick(self) -> list[str]:
        """Log the lines of the window now ending, if `interval` has passed since it began; returns them."""
        now = self.clock()
        if now - self.last.time < self.interval:
            return []
        cur = self.metrics.snapshot(now)
        lines, self.active = stats_lines(self.last, cur, self.active)
        self.last = cur
        for line in lines:
            stats_log.info("%s", line)
        return lines

    async def run(self) -> None:
        """Tick every `interval` seconds until cancelled (a failure is logged, never raised)."""
        while True:
            await asyncio.sleep(max(0.0, self.last.time + self.interval - self.clock()))
            try:
                self.tick()
            except Exception:
                stats_log.exception("the periodic stats line failed")

    @contextlib.asynccontextmanager
    async def running(self):
        """`run()` as a task for the duration of the block (an app's lifespan)."""
        task = asyncio.ensure_future(self.run())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
