"""One careless client never hurts the others (issue 43, "event loop and memory"), on live servers on loopback:

(a) a large body is parsed and validated off the event loop (/health is answered meanwhile), and a chat request
    with too many content parts is refused naming the limit;
(b) /tokenize of long prompts hands its memory back (RSS stays near where it was);
(c) a body trickled a byte at a time, never silent for --read-timeout, ends with 408 at --body-timeout;
(d) a shutdown answers a body still arriving 503 at once instead of waiting --shutdown-timeout for it.
"""

from __future__ import annotations

import gc
import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.serve import create_app
from verispec.serve import protocol as protocol_module
from verispec.serve.protocol import MAX_CONTENT_PARTS
from verispec.serve.shutdown import make_server

from ..helpers.server import HANG_GUARD_S, MODEL, LiveServer, wait_until
from .test_timeouts import Served, parse, read_to_close, request_head

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_target):
    with LiveServer(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none"))) as s:
        yield s


class _BlockingJson:
    """Stands in for `protocol.json` (its only use: a constraint's schema, json.dumps'd while the request is
    validated): the first dumps says so and waits until the test has had its /health answered (or gives up)."""

    def __init__(self):
        self.validating, self.health_answered = threading.Event(), threading.Event()
        self.waited: bool | None = None

    def dumps(self, value, **kw):
        if self.waited is None:
            self.validating.set()
            self.waited = self.health_answered.wait(timeout=15)
        return json.dumps(value, **kw)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_large_body_is_validated_while_health_is_answered(server, monkeypatch, route):
    """A body of ~100 KB (over OFF_LOOP_BYTES) whose validation waits until /health has been answered: validated on
    the event loop (before), /health never comes (timeout); off it, /health is answered while it waits."""
    blocking = _BlockingJson()
    monkeypatch.setattr(protocol_module, "json", blocking)
    text = "a " * 50_000
    body = {"model": MODEL, "max_tokens": 1, "guided_json": {"type": "object"}}
    body |= {"prompt": text} if route == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, server.url + route, json=body, timeout=60)
        assert blocking.validating.wait(timeout=HANG_GUARD_S), "the request was never validated"
        try:
            health = httpx.get(server.url + "/health", timeout=5)  # a bound for the failure: the loop is blocked
        finally:
            blocking.health_answered.set()
        assert health.status_code == 200
        assert answer.result().status_code < 500  # the request itself goes on (400 here: longer than the context)
        assert blocking.waited is True  # its validation saw /health answered


def test_too_many_content_parts_are_refused_naming_the_limit(server):
    """100k text parts (2.7 MB, within --max-request-bytes) cost ~1 s of validation each: refused before that,
    400 naming `messages` and the limit; for /tokenize too."""
    parts = [{"type": "text", "text": "a"}] * 100_000
    messages = [{"role": "user", "content": parts}]
    for path, body in (("/v1/chat/completions", {"model": MODEL, "max_tokens": 1}), ("/tokenize", {})):
        r = httpx.post(server.url + path, json=body | {"messages": messages}, timeout=60)
        assert r.status_code == 400, (path, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == "messages" and f"at most {MAX_CONTENT_PARTS}" in error["message"]
        assert "100000 content parts" in error["message"]
    ok = [{"role": "user", "content": parts[:100]}]  # a few parts pass
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": ok})
    assert r.status_code == 200, r.text[:300]


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def test_tokenize_gives_its_memory_back(server):
    """4 concurrent /tokenize calls of a 512 KB prompt (256k tokens each), twice: the tokenizer's buffers (~100 MB a
    call) were kept by the malloc arenas of the threads that ran them (RSS +150 MB and more, never returned);
    run one at a time in one worker and trimmed after, RSS ends within 60 MB of where it started."""
    body = json.dumps({"prompt": "a b " * (128 << 10)}).encode()
    httpx.post(server.url + "/tokenize", json={"prompt": "a b"}).raise_for_status()  # warm
    gc.collect()
    before = _rss_mib()

    def call(_):
        r = httpx.post(server.url + "/tokenize", content=body, headers=JSON, timeout=120)
        assert r.status_code == 200 and r.content.endswith(b"]}")
        return len(r.content)

    with ThreadPoolExecutor(4) as pool:
        for _ in range(2):
            assert all(n > len(body) for n in pool.map(call, range(4)))
    gc.collect()
    grew = _rss_mib() - before
    assert grew < 60, f"RSS grew by {grew:.0f} MiB"


def test_a_trickled_body_ends_408_at_the_body_timeout(tiny_target):
    """A byte every 20 ms (never 5 s without bytes: the read timeout never fires) into a body of 400 bytes: with
    body_timeout 0.5 s it ends with an OpenAI-style 408 naming --body-timeout and the connection closes, well before
    the body could have been complete (8 s); the request leaves the gate."""
    app = create_app(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), MODEL, read_timeout=5.0)
    app.state.body_reads.body_timeout = 0.5  # as make_server pins read_timeout (create_app's body_timeout: below)
    with Served(app, read_timeout=5.0) as s, s.connect() as c:
        c.sendall(request_head("/v1/completions", 400))
        opened, sent = time.monotonic(), 0
        while sent < 400 and not select.select([c], [], [], 0.02)[0]:
            c.sendall(b" ")  # JSON whitespace: a valid start of a body that never ends in time
            sent += 1
        status, headers, body = parse(read_to_close(c))
        took = time.monotonic() - opened
        assert status == 408, (status, body)
        assert headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "--body-timeout" in error["message"]
        assert 0.5 <= took < 4.0 and sent < 200, (took, sent)
        wait_until(lambda: app.state.gate.in_flight == 0, "the trickled request to leave the gate")


def test_a_shutdown_answers_a_body_still_arriving_503_at_once(tiny_target):
    """A client trickling its body (a byte every 50 ms) when the shutdown starts: answered 503 (JSON) within a few
    seconds, not after --shutdown-timeout (20 s); the server then exits."""
    app = create_app(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), MODEL, read_timeout=5.0)
    reads = app.state.body_reads
    stop = threading.Event()
    with Served(app, read_timeout=5.0, shutdown_timeout=20.0) as s, s.connect() as c:
        c.sendall(request_head("/v1/completions", 2000, "expect: 100-continue"))
        assert c.recv(65536).startswith(b"HTTP/1.1 100 ")  # past the gate, reading the body

        def trickle():
            for _ in range(1000):  # bounded: 50 s at most, and it stops once the test has its answer
                if stop.wait(0.05):
                    return
                try:
                    c.sendall(b" ")
                except OSError:
                    return

        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        try:
            wait_until(lambda: reads._waiting, "the body read to wait for the next byte")
            s.server.should_exit = True  # the signal
            signalled = time.monotonic()
            status, headers, body = parse(read_to_close(c))
            took = time.monotonic() - signalled
        finally:
            stop.set()
            trickler.join(timeout=HANG_GUARD_S)
        assert status == 503 and headers["content-type"] == "application/json", (status, body)
        assert json.loads(body)["error"]["type"] == "server_error"
        assert took < 5.0, f"the 503 came {took:.1f} s after the signal (--shutdown-timeout 20 s)"
        s.thread.join(timeout=HANG_GUARD_S)
        assert not s.thread.is_alive()
        assert time.monotonic() - signalled < 10.0


def test_body_timeout_and_max_connections_are_checked_and_reach_the_server(tiny_target):
    gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none"))
    assert create_app(gen, MODEL, body_timeout=7.5).state.body_reads.body_timeout == 7.5
    for bad in (0, -1, float("nan"), True):
        with pytest.raises(ValueError, match="body_timeout"):
            create_app(gen, MODEL, body_timeout=bad)
    app = create_app(gen, MODEL)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert make_server(app, host="127.0.0.1", port=port, max_connections=3).config.limit_concurrency == 3
    assert make_server(app, host="127.0.0.1", port=port).config.limit_concurrency is None
    with pytest.raises(ValueError, match="max_connections"):
        make_server(app, host="127.0.0.1", port=port, max_connections=0)
