"""A live `verispec serve` app for the tests: uvicorn on 127.0.0.1 in a thread, over any generator; waiting on
what the server reports (its /metrics counters, a process's /health) instead of on wall-clock time."""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable

import httpx
import openai
import uvicorn

from verispec.serve import create_app

MODEL = "tiny"

# How long a wait for something that must happen may take before the test fails instead of hanging. Never what
# orders events (each wait polls for its condition): only a bound for a broken server, generous on a loaded machine.
HANG_GUARD_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], object], what: str, guard_s: float = HANG_GUARD_S, poll_s: float = 0.02):
    """Poll `condition` until it returns something truthy, and return that; AssertionError(`what`) after
    `guard_s` seconds (a hang guard, not a deadline the test's outcome depends on)."""
    stop = time.monotonic() + guard_s
    while not (result := condition()):
        if time.monotonic() > stop:
            raise AssertionError(f"still waiting after {guard_s:.0f} s: {what}")
        time.sleep(poll_s)
    return result


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples `name{labels}` in a Prometheus text page (0.0 when there are none): every sample
    whose labels include `labels` (others, such as model_name, may be present), e.g. all of a counter's reasons."""
    total = 0.0
    for line in text.splitlines():
        m = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        if m is None or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def wait_for_metric(url: str, name: str, at_least: float, **labels: str) -> str:
    """Wait until the server's /metrics has `name{labels}` (summed) >= at_least, and return that page: a wait on a
    counter (e.g. choices ended, whatever their reason), after which the test checks what the page says."""

    def page():
        text = httpx.get(url + "/metrics", timeout=60).text
        return text if metric(text, name, **labels) >= at_least else None

    return wait_until(page, f"{name}{labels} >= {at_least} at {url}/metrics")


def wait_for_health(url: str, proc: subprocess.Popen | None = None, what: str = "the server") -> None:
    """Wait until `url`/health answers 200; with `proc`, fail at once if the process exits first."""

    def up():
        if proc is not None and proc.poll() is not None:
            out = proc.stderr.read() if proc.stderr is not None else ""
            raise AssertionError(f"{what} exited with {proc.returncode} before answering /health: {out}")
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, f"{what} to answer {url}/health", poll_s=0.1)


class LiveServer:
    """`with LiveServer(generator, **create_app_kwargs) as s:` a server on a free port, started when the block
    opens (uvicorn has bound its socket) and stopped when it closes; s.url, s.client(), s.engine."""

    def __init__(self, gen, **kw):
        self.app = create_app(gen, MODEL, **kw)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()

        def started():
            if not self.thread.is_alive():
                raise RuntimeError("the server's thread ended before it started")
            return self.server.started

        wait_until(started, "uvicorn to start", poll_s=0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=HANG_GUARD_S)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    @property
    def engine(self):
        return self.app.state.engine
