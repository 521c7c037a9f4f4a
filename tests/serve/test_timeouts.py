"""Read timeouts and a bounded shutdown (`serve.transport`, `serve.shutdown`), over raw sockets against a real
uvicorn server on a free port: headers dribbled past --read-timeout close the connection, a body stalled midway
gets an OpenAI-style 408, and a shutdown with a client stuck mid-body ends within --shutdown-timeout + 2 s with
a JSON 503 for that client (never uvicorn's text/plain 500, no traceback)."""

from __future__ import annotations

import asyncio
import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.serve import create_app
from verispec.serve.shutdown import Gate, GateState, make_server
from verispec.serve.transport import BodyReads, install_transport

from ..helpers.server import HANG_GUARD_S, MODEL, free_port, wait_for_health, wait_until
from ..helpers.tiny import make_model, make_tokenizer


def echo_app() -> FastAPI:
    """POST routes that read their body (as Starlette does: a disconnect raises ClientDisconnect), behind the
    shutdown's Gate, with the state `drain` reads."""
    app = FastAPI()
    app.state.gate = GateState()
    app.state.rollout = SimpleNamespace(abort=lambda: None)
    app.state.engine = SimpleNamespace(expire_all=lambda: 0)

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    @app.post("/drip")
    async def drip(request: Request):  # streams for 3 x 0.4 s after its body, while Starlette watches `receive`
        await request.body()

        async def chunks():
            for i in range(3):
                await asyncio.sleep(0.4)
                yield f"chunk {i};".encode()

        return StreamingResponse(chunks())

    app.add_middleware(Gate, state=app.state.gate)
    return app


class Served:
    """`with Served(app, read_timeout=...) as s:` make_server's GracefulServer (header deadline, BodyTimeout,
    drain) in a thread on a free port; closing the block is the signal (should_exit), then the shutdown."""

    def __init__(self, app, read_timeout: float, shutdown_timeout: float = 1.0):
        self.port = free_port()
        self.server = make_server(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="error",
            shutdown_timeout=shutdown_timeout,
            read_timeout=read_timeout,
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), "uvicorn to start", poll_s=0.01)
        assert self.server.started
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=HANG_GUARD_S)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=HANG_GUARD_S)


def closed(sock: socket.socket) -> bool:
    """Whether the next thing the server sends is its close (EOF, or a reset), not data."""
    try:
        return sock.recv(65536) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset ends it too)."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def parse(raw: bytes) -> tuple[int, dict, bytes]:
    """The final response of `raw` (after any 100 Continue): status, headers (lower-case names), body."""
    while raw.startswith(b"HTTP/1.1 100"):
        raw = raw.split(b"\r\n\r\n", 1)[1]
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def request_head(path: str, length: int, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json", f"content-length: {length}"]
    return ("\r\n".join([*lines, *extra]) + "\r\n\r\n").encode()


def test_headers_dribbled_past_the_read_timeout_close_the_connection():
    """A byte every 50 ms never completes the header block: the connection is closed once read_timeout has passed
    since it opened (the bytes do not move the deadline), with no response."""
    read_timeout = 0.5
    with Served(echo_app(), read_timeout) as s, s.connect() as c:
        opened = time.monotonic()
        c.sendall(b"POST /echo HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ")
        sent = 0
        while True:
            assert time.monotonic() - opened < HANG_GUARD_S, "the dribbling connection was never closed"
            try:
                c.sendall(b"a")  # a header value that never ends
            except (ConnectionResetError, BrokenPipeError):
                break
            sent += 1
            if select.select([c], [], [], 0.05)[0]:
                assert closed(c), "the server answered a request whose headers never ended"
                break
        # The deadline starts when the server accepts the connection, after `opened`: never closed before it.
        assert time.monotonic() - opened >= read_timeout
        assert sent > read_timeout / 0.05 / 2  # the bytes kept coming while the deadline ran


def test_a_slow_client_within_the_read_timeout_is_served_and_the_next_header_block_has_its_deadline():
    """Headers and body sent in pieces with pauses well under read_timeout: answered, on a keep-alive connection.
    After that response, a next request that never completes its headers is closed again."""
    with Served(echo_app(), read_timeout=2.0) as s, s.connect() as c:
        head, body = request_head("/echo", 11), b'{"a": "bc"}'
        for piece in (head[:10], head[10:30], head[30:], body[:4], body[4:]):
            c.sendall(piece)
            time.sleep(0.1)  # a slow client, not an ordering: 0.3 s of header pauses against a 2 s deadline
        raw = b""
        while b'"bytes"' not in raw:
            chunk = c.recv(65536)
            assert chunk, f"closed before the answer: {raw!r}"
            raw += chunk
        status, _, answer = parse(raw)
        assert status == 200 and json.loads(answer) == {"bytes": 11}
        c.sendall(b"POST /echo HTTP/1.1\r\nhost: 127.0.0.1\r\n")  # and never the rest
        assert closed(c)  # within HANG_GUARD_S (the socket's timeout): the deadline since the response's end


def test_a_body_stalled_midway_gets_an_openai_style_408_and_the_connection_closes():
    with Served(echo_app(), read_timeout=0.5) as s, s.connect() as c:
        c.sendall(request_head("/echo", 100) + b'{"prompt": "a b')  # 15 of 100 bytes, then silence
        status, headers, body = parse(read_to_close(c))
    assert status == 408 and headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_timeout"
    assert "0.5 s" in error["message"]


def test_a_response_longer_than_the_read_timeout_is_not_cut():
    """Only the body's reads are timed: a response streaming for 1.2 s after it (Starlette waits on `receive` for
    a disconnect meanwhile) ends whole with read_timeout 0.5 s."""
    with Served(echo_app(), read_timeout=0.5) as s, s.connect() as c:
        c.sendall(request_head("/drip", 2, "connection: close") + b"{}")
        status, _, body = parse(read_to_close(c))
    assert status == 200
    assert b"chunk 0;" in body and b"chunk 2;" in body


def test_the_real_app_answers_a_stalled_body_408(tiny_target):
    """create_app's stack (its body cap reads the body, the Gate counts it): the stall is a 408 and the request
    leaves the gate; a request sent whole is answered as usual."""
    app = create_app(SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), MODEL)
    reads = install_transport(app, read_timeout=0.5)
    assert app.state.body_reads is reads
    with Served(app, read_timeout=0.5) as s:
        with s.connect() as c:
            c.sendall(request_head("/v1/completions", 80) + b'{"model": "tiny", ')
            status, _, body = parse(read_to_close(c))
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        wait_until(lambda: app.state.gate.in_flight == 0, "the stalled request to leave the gate")
        whole = json.dumps({"model": MODEL, "prompt": "a b c", "max_tokens": 4, "temperature": 0}).encode()
        with s.connect() as c:
            c.sendall(request_head("/v1/completions", len(whole), "connection: close") + whole)
            status, _, body = parse(read_to_close(c))
        assert status == 200 and json.loads(body)["choices"][0]["text"] is not None


def test_body_reads_cut_answer_503_at_once():
    """What the shutdown's cut does to a body read: the one waiting ends with a JSON 503 (not the read timeout)."""
    app = echo_app()
    reads: BodyReads = install_transport(app, read_timeout=HANG_GUARD_S)
    with Served(app, read_timeout=HANG_GUARD_S) as s, s.connect() as c:
        c.sendall(request_head("/echo", 100, "expect: 100-continue"))
        assert c.recv(65536).startswith(b"HTTP/1.1 100 ")  # the route is reading the body
        c.sendall(b'{"a": ')
        wait_until(lambda: reads._waiting, "the body read to wait for bytes")
        s.server.servers[0].get_loop().call_soon_threadsafe(reads.cut)  # on the server's loop, as drain does
        status, headers, body = parse(read_to_close(c))
    assert status == 503 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["type"] == "server_error"


def test_sigterm_with_a_client_stuck_mid_body_exits_within_the_shutdown_timeout_plus_2s(tmp_path):
    """`verispec serve` (the CLI: create_app, serve) with a client that sent its headers and part of its body,
    then stopped: SIGTERM -> exit within --shutdown-timeout + 2 s (it was ~+20 s: 10 s for stragglers, 10 s of
    uvicorn's graceful timeout); the client gets an OpenAI-style 503, and the log has no traceback and no 500."""
    shutdown_timeout = 1.0
    make_model(0).save_pretrained(tmp_path / "model")
    make_tokenizer().save_pretrained(tmp_path / "model")
    port = free_port()
    argv = [sys.executable, "-m", "verispec.cli", "serve", "--target", str(tmp_path / "model"), "--port", str(port),
            "--served-model-name", MODEL, "--draft", "ngram", "--shutdown-timeout", str(shutdown_timeout),
            "--log-level", "info"]  # fmt: skip
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_health(url, proc)
            with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S) as c:
                c.sendall(request_head("/v1/completions", 200, "expect: 100-continue"))
                assert c.recv(65536).startswith(b"HTTP/1.1 100 ")  # past the gate, reading the body
                c.sendall(b'{"model": "tiny", "prompt": ')
                signalled = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=HANG_GUARD_S)
                took = time.monotonic() - signalled
                raw = read_to_close(c)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = (tmp_path / "server.log").read_text()
    assert proc.returncode in (0, -signal.SIGTERM), text
    assert took <= shutdown_timeout + 2.0, (took, text)
    status, headers, body = parse(raw)
    assert status == 503 and headers["content-type"] == "application/json", raw
    assert json.loads(body)["error"]["type"] == "server_error"
    assert "Traceback" not in text and " 500 " not in text, text
    assert "1 still sending a body (503)" in text, text
