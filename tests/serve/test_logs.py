"""The server's log lines (serve.logs): one access line per HTTP request with its engine's token counts, on a live
tiny-model app; vLLM's periodic stats lines from the Prometheus counters, as a pure function of two snapshots and on
an injected clock (no wall-clock waits)."""

from __future__ import annotations

import logging
import re

import pytest
from fastapi.testclient import TestClient

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.serve import create_app
from verispec.serve.logs import DEFAULT_LOG_STATS_INTERVAL_S, StatsLogger, stats_lines
from verispec.serve.metrics import Metrics, Snapshot

ACCESS, STATS = "verispec.serve.access", "verispec.serve.stats"


def lines_of(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


@pytest.fixture(scope="module")
def gen(tiny_target, tiny_draft):
    return SpeculativeGenerator(tiny_target, tiny_draft, config=SpecConfig(draft="model", gamma=3))


def test_one_access_line_per_request_with_its_tokens(gen, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS)
    app = create_app(gen, "tiny", log_stats_interval=None)
    with TestClient(app, base_url="http://localhost") as client:
        body = {"model": "tiny", "prompt": "a b c a b", "max_tokens": 7, "temperature": 0, "n": 2}
        r = client.post("/v1/completions", json=body).json()
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 5, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=chat) as s:
            streamed = [line for line in s.iter_lines() if line.startswith("data: {")]
        missing = client.post("/v1/completions", json={**body, "model": "nope"})
        client.get("/health")
    lines = lines_of(caplog, ACCESS)
    assert len(lines) == 4, lines
    completion, chatted, refused, health = lines
    usage = r["usage"]
    assert re.fullmatch(
        rf'testclient:\d+ "POST /v1/completions HTTP/1.1" 200 request_id={r["id"]} '
        rf"prompt_tokens={usage['prompt_tokens']} output_tokens={usage['completion_tokens']} latency=\d+\.\d{{3}}s",
        completion,
    ), completion
    assert usage["completion_tokens"] == 14  # two choices of 7 (a prompt counted once)
    chunk_id = re.search(r'"id": ?"([^"]+)"', streamed[0]).group(1)
    assert f'"POST /v1/chat/completions HTTP/1.1" 200 request_id={chunk_id} ' in chatted
    assert re.search(r"output_tokens=([1-5]) ", chatted), chatted  # counted once the stream has ended
    assert missing.status_code == 404 and '"POST /v1/completions HTTP/1.1" 404 latency=' in refused
    assert '"GET /health HTTP/1.1" 200 latency=' in health


def test_access_lines_off(gen, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS)
    app = create_app(gen, "tiny", log_requests=False, log_stats_interval=None)
    with TestClient(app, base_url="http://localhost") as client:
        assert client.get("/health").status_code == 200
    assert lines_of(caplog, ACCESS) == []


def snap(t, **kw) -> Snapshot:
    return Snapshot(time=t, **kw)


def test_stats_lines_follow_vllms_wording_and_figures():
    prev = snap(
        0.0,
        prompt_tokens=10,
        generation_tokens=20,
        drafts=5,
        draft_tokens=15,
        accepted_tokens=6,
        accepted_per_pos=(4, 2),
    )
    cur = snap(
        10.0,
        prompt_tokens=60,
        generation_tokens=220,
        drafts=25,
        draft_tokens=75,
        accepted_tokens=36,
        accepted_per_pos=(19, 12, 5),
        running=2,
        waiting=1,
        kv_usage=0.125,
    )
    lines, active = stats_lines(prev, cur, was_active=False)
    assert active and lines == [
        "Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, KV cache usage: 12.5%",
        # 20 drafts, 60 drafted, 30 accepted in 10 s; per position (15, 10, 5) / 20
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.00 tokens/s, Drafted "
        "throughput: 6.00 tokens/s, Accepted: 30 tokens, Drafted: 60 tokens, Per-position acceptance rate: "
        "0.750, 0.500, 0.250, Avg Draft acceptance rate: 50.0%",
    ]


def test_stats_lines_only_when_something_happened():
    idle = snap(0.0, prompt_tokens=5, generation_tokens=9)
    later = snap(10.0, prompt_tokens=5, generation_tokens=9)
    assert stats_lines(idle, later, was_active=False) == ([], False)  # idle after idle: nothing
    lines, active = stats_lines(idle, later, was_active=True)  # the first idle window after activity: once
    assert not active and lines == [
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, "
        "Waiting: 0 reqs, KV cache usage: 0.0%"
    ]
    plain = snap(10.0, prompt_tokens=5, generation_tokens=19)  # tokens but no draft: no speculative line
    lines, active = stats_lines(idle, plain, was_active=False)
    assert active and len(lines) == 1 and "generation throughput: 1.0 tokens/s" in lines[0]
    waiting = snap(10.0, prompt_tokens=5, generation_tokens=9, waiting=3)  # a request waits: active
    assert stats_lines(idle, waiting, was_active=False)[1]


def test_stats_logger_reads_the_metrics_on_its_interval(caplog):
    caplog.set_level(logging.INFO, logger=STATS)
    now = [100.0]
    m = Metrics("m")
    stats = StatsLogger(m, interval=10, clock=lambda: now[0])
    m.observe_admitted(4, 0.0)
    m.observe_tokens(8, first=True, seconds=0.1)
    m.observe_step([(3, 2), (3, 0)])
    now[0] = 109.9
    assert stats.tick() == []  # before the interval: nothing
    now[0] = 110.0
    lines = stats.tick()
    assert lines[0].startswith("Avg prompt throughput: 0.4 tokens/s, Avg generation throughput: 0.8 tokens/s")
    assert lines[1] == (
        "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted throughput: 0.20 tokens/s, Drafted throughput: "
        "0.60 tokens/s, Accepted: 2 tokens, Drafted: 6 tokens, Per-position acceptance rate: 0.500, 0.500, 0.000, "
        "Avg Draft acceptance rate: 33.3%"
    )
    now[0] = 120.0
    after = stats.tick()  # the window after activity: the engine line once
    assert after == [
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, "
        "Waiting: 0 reqs, KV cache usage: 0.0%"
    ]
    now[0] = 130.0
    assert stats.tick() == []  # then silence while idle
    assert lines_of(caplog, STATS) == lines + after  # what tick returns is what it logged
    with pytest.raises(ValueError, match="log_stats_interval"):
        StatsLogger(m, interval=0)


def test_the_serve_flags_default_to_the_librarys():
    from verispec.cli import build_parser
    from verispec.serve.app import ServeOptions

    args = build_parser().parse_args(["serve"])
    assert args.log_stats_interval == DEFAULT_LOG_STATS_INTERVAL_S == ServeOptions().log_stats_interval
    assert not args.disable_log_requests and not args.disable_log_stats and ServeOptions().log_requests
    with pytest.raises(ValueError, match="log_stats_interval"):
        ServeOptions(log_stats_interval=0)
