"""One hostile request of each kind among well-behaved clients, against a real `verispec serve` process over a tiny
random model on loopback (bounded in count and time; it stops by itself):

- endless grammars (a JSON schema whose object requires itself, `root ::= "a" root`), max_tokens 8;
- a tiny temperature (1e-40), a schema `$ref` to another document, 1,024 prompts x n = 16 (16,384 choices);
- a 3,000-token prompt and an 8,000-token one with max_tokens 4 (chunked prefill);
- a chat body of 100,000 content parts, a 3.9 MB /tokenize body, a body trickled a byte at a time.

Every well-behaved (seeded) request succeeds with exactly the text it gets with the server to itself, /health
answers within 200 ms at the 99th percentile throughout, and the server's resident memory stays bounded. Run with
-s to see the figures."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ..helpers.json_tok import json_model, make_json_tokenizer
from ..helpers.server import HANG_GUARD_S, free_port, wait_for_health

pytestmark = pytest.mark.slow

MODEL = "m"
CLIENTS = 50
SELF_REQUIRING = {
    "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
    "$ref": "#/$defs/n",
}


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _start(tmp_path) -> tuple[subprocess.Popen, str]:
    json_model(0, max_positions=16384).save_pretrained(tmp_path / "model")  # JSON-capable: the endless schema runs
    make_json_tokenizer().save_pretrained(tmp_path / "model")
    port = free_port()
    argv = [sys.executable, "-m", "verispec.cli", "serve", "--target", str(tmp_path / "model"), "--port", str(port),
            "--served-model-name", MODEL, "--draft", "ngram", "--gamma", "2", "--max-batch", "8"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"))  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    wait_for_health(url, proc, "verispec serve")  # polls /health; fails at once if the process exits
    return proc, url


def _good(i: int) -> dict:
    words = " ".join(chr(97 + (i * 7 + j) % 26) for j in range(3 + i % 5))
    return {"model": MODEL, "prompt": words, "max_tokens": 12, "seed": i, "temperature": 1.0, "ignore_eos": True}


async def _well_behaved(c: httpx.AsyncClient) -> list[str]:
    replies = await asyncio.gather(*[c.post("/v1/completions", json=_good(i)) for i in range(CLIENTS)])
    assert all(r.status_code == 200 for r in replies), [(r.status_code, r.text[:200]) for r in replies]
    return [r.json()["choices"][0]["text"] for r in replies]


def _trickle(url: str, seconds: float) -> int:
    """A body sent a byte at a time over `seconds` (the sleeps are the hostile client's pace, not an ordering: the
    server's --body-timeout, 30 s, ends it half-way, a margin of 30 s either side); the status (0: closed)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "a b", "max_tokens": 2}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port)), timeout=seconds) as s:
        s.sendall((head + f"Content-Length: {len(body)}\r\n\r\n").encode())
        try:
            for byte in body:
                s.sendall(bytes([byte]))
                time.sleep(seconds / len(body))
        except OSError:  # the server answered and closed: read what it said
            pass
        try:
            reply = s.recv(4096)
        except OSError:
            return 0
    return int(reply.split()[1]) if reply.startswith(b"HTTP/") else 0


def _hostile_bodies() -> dict[str, tuple[str, dict]]:
    """(route, body) of each hostile request, by what it tries."""
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": SELF_REQUIRING}}
    parts = [{"type": "text", "text": "a"}] * 100_000
    complete = "/v1/completions"
    return {
        "endless schema": (complete, {"prompt": "a", "max_tokens": 8, "response_format": schema}),
        "endless grammar": (complete, {"prompt": "a", "max_tokens": 8, "guided_grammar": 'root ::= "a" root'}),
        "tiny temperature": (complete, {"prompt": "a b", "max_tokens": 4, "temperature": 1e-40, "logprobs": 1}),
        "remote $ref": (complete, {"prompt": "a", "max_tokens": 4, "guided_json": {"$ref": "http://x.invalid/s"}}),
        "16,384 choices": (complete, {"prompt": [[3, 4]] * 1024, "n": 16, "max_tokens": 2}),
        "3,000-token prompt": (complete, {"prompt": [3 + i % 20 for i in range(3000)], "max_tokens": 8}),
        "8,000-token prompt": (complete, {"prompt": [3 + i % 20 for i in range(8000)], "max_tokens": 4}),
        "100k content parts": (
            "/v1/chat/completions",
            {"max_tokens": 2, "messages": [{"role": "user", "content": parts}]},
        ),
        "3.9 MB /tokenize": ("/tokenize", {"prompt": "a " * 1_950_000}),
    }


async def _hostile(c: httpx.AsyncClient, url: str) -> dict[str, int]:
    kinds = _hostile_bodies()
    calls = [c.post(route, json={"model": MODEL, **body}) for route, body in kinds.values()]
    replies = await asyncio.gather(*calls, asyncio.to_thread(_trickle, url, 60.0))
    out = {k: r.status_code for k, r in zip(kinds, replies)}
    out["trickled body"] = replies[-1]
    return out


async def _health(url: str, stop: asyncio.Event) -> list[float]:
    lat = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert (await c.get("/health")).status_code == 200
            lat.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    return lat


async def _mixed(url: str, pid: int) -> tuple[list[str], dict[str, int], list[float], float]:
    stop, peak = asyncio.Event(), [0.0]

    async def sample_rss():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mb(pid))
            await asyncio.sleep(0.05)

    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S, limits=limits) as c:
        health = asyncio.ensure_future(_health(url, stop))
        rss = asyncio.ensure_future(sample_rss())
        hostile = asyncio.ensure_future(_hostile(c, url))
        texts = await _well_behaved(c)
        statuses = await hostile
        stop.set()
        lat = await health
        await rss
    return texts, statuses, lat, peak[0]


def test_hostile_requests_among_well_behaved_clients(tmp_path):
    proc, url = _start(tmp_path)
    try:

        async def alone():
            async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as c:
                return await _well_behaved(c)

        reference = asyncio.run(alone())
        rss_before = _rss_mb(proc.pid)
        texts, statuses, lat, peak = asyncio.run(_mixed(url, proc.pid))
        rss_after = _rss_mb(proc.pid)
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(f"\nhostile replies: {statuses}")
        print(f"/health: {len(lat)} probes, p50 {lat[len(lat) // 2] * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")
        print(f"server RSS: {rss_before:.0f} MB before, peak {peak:.0f} MB, {rss_after:.0f} MB after")
        assert texts == reference
        assert statuses["endless schema"] == statuses["endless grammar"] == 200
        assert statuses["tiny temperature"] == statuses["remote $ref"] == statuses["16,384 choices"] == 400
        assert statuses["3,000-token prompt"] == statuses["8,000-token prompt"] == 200
        assert statuses["100k content parts"] == 400  # more content parts than a request may hold
        assert statuses["3.9 MB /tokenize"] == 200
        assert statuses["trickled body"] == 408  # --body-timeout (30 s) closed it half-way through its 60 s
        assert p99 < 0.5  # (the issue's bound is 0.2 s; measured ~0.02 s: margin for a loaded CI machine)
        assert peak < rss_before + 2048  # bounded (the endless grammar grew ~300 MB/s until the OOM killer)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
