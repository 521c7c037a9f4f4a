"""A load test of `verispec serve` as operators run it: a real process (`python -m verispec.cli serve`) over a tiny
random model saved to disk, driven by asyncio clients.

1. many concurrent streaming clients, every stream complete (p50 / p95 time to first token and total printed: -s);
2. a burst beyond --max-queue: 429 with Retry-After, never a 5xx;
3. clients hanging up mid-stream: their requests are dropped (finished_reason "abort");
4. /metrics afterwards: requests sent = finished + aborted + rejected, nothing waiting or running, no KV in use;
5. SIGTERM with streams in flight: new requests get 503, every stream ends with [DONE] (finished, or cut short with
   finish_reason "abort" at --shutdown-timeout), the process exits (by the SIGTERM uvicorn re-raises once it has
   shut down), and its last log line accounts for every request of its life.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import pytest

from ..helpers.server import HANG_GUARD_S, free_port
from ..helpers.tiny import make_model, make_tokenizer

MODEL = "m"
CONTEXT = 4096  # the saved model's context: room for streams far longer than --shutdown-timeout
STREAM_TOKENS = 4000  # per stream in flight at SIGTERM: thousands of steps, where 0.5 s holds some hundred at most


@dataclass(frozen=True)
class Scale:
    clients: int = 64  # concurrent streaming clients
    tokens: int = 16  # per stream
    burst: int = 160  # requests sent at once with the queue at --max-queue
    hangups: int = 16  # clients that disconnect mid-stream
    in_flight: int = 24  # streams running or waiting when SIGTERM comes (of STREAM_TOKENS each, never done in time)
    max_batch: int = 8
    max_queue: int = 64


@dataclass
class Stream:
    status: int = 0
    chunks: list = field(default_factory=list)
    done: bool = False  # ended with [DONE]
    first: float | None = None  # seconds to the first text
    total: float = 0.0
    retry_after: str | None = None

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for ch in self.chunks for c in ch["choices"] if c.get("finish_reason")]

    @property
    def text(self) -> str:
        return "".join(c["text"] for ch in self.chunks for c in ch["choices"])


async def _stream(client: httpx.AsyncClient, body: dict, hang_up_after: int | None = None, started=None) -> Stream:
    """One streamed completion; with hang_up_after, disconnect after that many text chunks."""
    out, t0 = Stream(), time.perf_counter()
    payload = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}} | body
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        out.status, out.retry_after = r.status_code, r.headers.get("retry-after")
        if r.status_code != 200:
            await r.aread()
            return out
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: "):
                out.chunks.append(json.loads(line[6:]))
                if out.first is None and out.text:
                    out.first = time.perf_counter() - t0
                    if started is not None:
                        started.release()
                if hang_up_after is not None and len(out.chunks) >= hang_up_after:
                    break  # leaving the block closes the connection mid-stream
    out.total = time.perf_counter() - t0
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("verispec:"):
            name, value = line.rsplit(" ", 1)
            out[re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "")] = float(value)
    return out


def _reason(m: dict, reason: str) -> float:
    return m.get(f'verispec:request_success_total{{finished_reason="{reason}"}}', 0.0)


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: object

    def stderr(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()


def _start(tmp_path, scale: Scale, shutdown_timeout: float) -> Server:
    make_model(0, max_positions=CONTEXT).save_pretrained(tmp_path / "model")
    make_tokenizer().save_pretrained(tmp_path / "model")
    port = free_port()
    argv = [sys.executable, "-m", "verispec.cli", "serve", "--target", str(tmp_path / "model"), "--port", str(port),
            "--served-model-name", MODEL, "--draft", "ngram", "--gamma", "2", "--max-batch", str(scale.max_batch),
            "--max-queue", str(scale.max_queue), "--shutdown-timeout", str(shutdown_timeout)]  # fmt: skip
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 (closed by the test)
    server = Server(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}", log)
    deadline = time.time() + HANG_GUARD_S  # a hang guard: the loop waits for /health, or for the process to fail
    while time.time() < deadline:
        assert server.proc.poll() is None, server.stderr()
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("the server did not start")


async def _concurrent_streams(url: str, scale: Scale) -> list[Stream]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=None)) as c:
        bodies = [{"prompt": f"a b {chr(97 + i % 26)}", "max_tokens": scale.tokens, "seed": i, "ignore_eos": True}
                  for i in range(scale.clients)]  # fmt: skip
        return await asyncio.gather(*(_stream(c, b) for b in bodies))


async def _burst(url: str, scale: Scale) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=None)) as c:
        body = {"model": MODEL, "prompt": "a b", "max_tokens": 2 * scale.tokens, "ignore_eos": True}
        return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(scale.burst)))


async def _hangups(url: str, scale: Scale) -> tuple[list[Stream], list[Stream]]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=None)) as c:
        long = {"prompt": "c d", "max_tokens": 200, "ignore_eos": True}
        gone = [_stream(c, long | {"seed": i}, hang_up_after=2) for i in range(scale.hangups)]
        stay = [_stream(c, {"prompt": "e f", "max_tokens": scale.tokens, "seed": i}) for i in range(scale.max_batch)]
        out = await asyncio.gather(*gone, *stay)
    return list(out[: scale.hangups]), list(out[scale.hangups :])


async def _until_idle(url: str, seconds: float = HANG_GUARD_S) -> dict[str, float]:
    """The metrics once nothing runs or waits and the KV gauge says so too (it follows the last step); after
    `seconds` (a hang guard) the metrics as they are, for the checks to fail on."""
    deadline = time.time() + seconds
    while True:
        m = _metrics(url)
        idle = not m["verispec:num_requests_running"] and not m["verispec:num_requests_waiting"]
        if (idle and not m["verispec:kv_cache_usage_perc"]) or time.time() > deadline:
            return m
        await asyncio.sleep(0.05)


async def _draining(c: httpx.AsyncClient) -> int:
    """Poll /health until the drain answers 503 (0: the socket closed first)."""
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if (status := (await c.get("/health")).status_code) == 503:
                return status
        except httpx.TransportError:
            return 0
        await asyncio.sleep(0.01)
    raise AssertionError("/health never answered 503 after SIGTERM")


async def _sigterm(server: Server, scale: Scale) -> tuple[list[Stream], list[int]]:
    """Streams in flight, SIGTERM once each has its first text, then new requests (503) while they drain."""
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=None)) as c:
        started = asyncio.Semaphore(0)
        body = {"prompt": "a b", "max_tokens": STREAM_TOKENS, "ignore_eos": True}
        tasks = [asyncio.ensure_future(_stream(c, body | {"seed": i}, started=started)) for i in range(scale.in_flight)]
        for _ in range(min(scale.in_flight, scale.max_batch)):  # the first batch is running
            await asyncio.wait_for(started.acquire(), 60)
        server.proc.send_signal(signal.SIGTERM)
        refused = [await _draining(c)]  # the drain has begun: the probes below come within --shutdown-timeout
        for _ in range(3):
            try:
                r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
                refused.append(r.status_code)
            except httpx.TransportError:  # the socket closed already: the drain finished
                refused.append(0)
        return list(await asyncio.gather(*tasks)), refused


def _report(streams: list[Stream], label: str) -> None:
    ttft = [s.first for s in streams if s.first is not None]
    total = [s.total for s in streams]
    print(
        f"\n[{label}] {len(streams)} streams: time to first token p50 {_pct(ttft, 0.5) * 1e3:.0f} ms, "
        f"p95 {_pct(ttft, 0.95) * 1e3:.0f} ms; total p50 {_pct(total, 0.5) * 1e3:.0f} ms, "
        f"p95 {_pct(total, 0.95) * 1e3:.0f} ms"
    )


def _check_streams(streams: list[Stream], scale: Scale) -> None:
    for s in streams:
        assert s.status == 200 and s.done and s.finish_reasons == ["length"], (s.status, s.chunks[-2:])
        assert s.chunks[-1]["usage"]["completion_tokens"] == scale.tokens


def _check_burst(replies: list[httpx.Response], scale: Scale) -> int:
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 429}, codes  # never a 5xx
    assert codes.count(429) >= 1 and codes.count(200) >= scale.max_batch
    for r in replies:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
    return codes.count(429)


def _check_sigterm(server: Server, streams: list[Stream], refused: list[int], before: dict, sent: int) -> None:
    rc = server.proc.wait(timeout=60)
    log = server.stderr()
    assert rc in (0, -signal.SIGTERM), log  # uvicorn re-raises the signal it handled once it has shut down
    assert refused and set(refused) <= {503, 0} and 503 in refused  # drained, not dropped
    for s in streams:  # every stream in flight ends with [DONE]: finished, or cut short at --shutdown-timeout
        assert s.status == 200 and s.done and s.finish_reasons in (["length"], ["abort"]), s.chunks[-2:]
    assert "abort" in {r for s in streams for r in s.finish_reasons}  # STREAM_TOKENS steps outlast the timeout
    last = re.search(r"choices ended: stop (\d+), length (\d+), abort (\d+), error (\d+); .*: (\d+)", log)
    assert last, log
    stop, length, abort, error, rejected = map(int, last.groups())
    assert error == 0 and rejected == before["verispec:request_rejected_total"]
    assert stop + length + abort + rejected == sent + len(streams)  # nothing lost over the server's life
    assert abort == _reason(before, "abort") + sum(s.finish_reasons == ["abort"] for s in streams)


def _load_test(tmp_path, scale: Scale) -> None:
    server = _start(tmp_path, scale, shutdown_timeout=0.5)
    try:
        streams = asyncio.run(_concurrent_streams(server.url, scale))
        _check_streams(streams, scale)
        _report(streams, f"{scale.clients} concurrent streams of {scale.tokens} tokens")
        rejected = _check_burst(asyncio.run(_burst(server.url, scale)), scale)
        gone, stayed = asyncio.run(_hangups(server.url, scale))
        assert all(s.status == 200 and not s.done for s in gone) and all(s.done for s in stayed)
        m = asyncio.run(_until_idle(server.url))
        sent = scale.clients + scale.burst + scale.hangups + scale.max_batch
        finished = _reason(m, "stop") + _reason(m, "length")
        assert _reason(m, "abort") == scale.hangups and not _reason(m, "error")
        assert finished + _reason(m, "abort") + m["verispec:request_rejected_total"] == sent
        assert m["verispec:request_rejected_total"] == rejected
        assert m["verispec:e2e_request_latency_seconds_count"] == sent - rejected  # every choice ended once
        assert m["verispec:num_requests_running"] == m["verispec:num_requests_waiting"] == 0
        assert m["verispec:kv_cache_usage_perc"] == 0
        assert m["verispec:time_to_first_token_seconds_count"] == sent - rejected
        assert not any(k.endswith("_created") for k in m)
        in_flight, refused = asyncio.run(_sigterm(server, scale))
        _check_sigterm(server, in_flight, refused, m, sent)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)
        server.log.close()


def test_load_streams_burst_hangups_and_sigterm(tmp_path):
    _load_test(tmp_path, Scale())


@pytest.mark.slow
def test_load_at_four_times_the_scale(tmp_path):
    _load_test(tmp_path, Scale(clients=256, tokens=32, burst=512, hangups=64, in_flight=32, max_queue=256))
