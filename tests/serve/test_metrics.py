"""The server's Prometheus metrics: the Metrics object directly, and the engine thread counting every choice
exactly once (finished, aborted while running or waiting, failed by an engine error); the engine thread's queue
limit, deadlines, shutdown cut and fault handling."""

from __future__ import annotations

import asyncio
import time

import pytest

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.engine.request import Job, Request
from verispec.sampling import SamplingParams
from verispec.serve.engine import Call, Closing, EngineThread, Overloaded, TooLarge
from verispec.serve.metrics import Metrics


def value(m: Metrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_step_counters_follow_vllm_spec_decode_names():
    m = Metrics("m")
    m.observe_step([(3, 2), (0, 0), (4, 0), (2, 2)])  # a row that did not draft is no draft
    assert value(m, "verispec:spec_decode_num_drafts_total") == 3
    assert value(m, "verispec:spec_decode_num_draft_tokens_total") == 9
    assert value(m, "verispec:spec_decode_num_accepted_tokens_total") == 4
    per_pos = [value(m, "verispec:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)]
    assert per_pos == [2, 2, None]  # accepted at position 0 by two rows, at 1 by two, never at 2


def test_requests_latency_queue_and_dropped_choices():
    m = Metrics("m")
    for prompt, generated, reason, seconds in ((5, 7, "stop", 0.2), (5, 16, "length", 3.0)):
        m.observe_admitted(prompt, 0.0)
        m.observe_tokens(generated, first=True, seconds=0.1)
        m.observe_end(reason, seconds)
    m.observe_end("abort", 0.1, choices=2)
    m.observe_end("error", 0.5)
    m.set_queue(waiting=4, running=2)
    m.set_kv(0.25, 64)
    m.rejected.inc()
    reasons = {
        r: value(m, "verispec:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")
    }
    assert reasons == {"stop": 1, "length": 1, "abort": 2, "error": 1}
    assert value(m, "verispec:prompt_tokens_total") == 10 and value(m, "verispec:generation_tokens_total") == 23
    assert value(m, "verispec:e2e_request_latency_seconds_count") == 5  # every ended choice, however it ended
    assert abs(value(m, "verispec:e2e_request_latency_seconds_sum") - 3.9) < 1e-9
    assert value(m, "verispec:e2e_request_latency_seconds_bucket", le="0.3") == 3
    assert value(m, "verispec:num_requests_waiting") == 4 and value(m, "verispec:num_requests_running") == 2
    assert value(m, "verispec:kv_cache_usage_perc") == 0.25 and value(m, "verispec:kv_cache_slots") == 64
    assert value(m, "verispec:request_rejected_total") == 1
    text = m.render().decode()
    assert 'verispec:request_success_total{finished_reason="abort",model_name="m"} 2.0' in text
    assert "_created" not in text  # vLLM leaves the _created series out too
    assert "stop 1, length 1, abort 2, error 1" in m.summary()


def test_queue_time_ttft_and_inter_token_latency():
    m = Metrics("m")
    m.observe_admitted(3, 0.002)
    m.observe_tokens(2, first=True, seconds=0.03)
    m.observe_tokens(3, first=False, seconds=0.004)
    m.observe_tokens(1, first=False, seconds=0.006)
    assert value(m, "verispec:request_queue_time_seconds_count") == 1
    assert value(m, "verispec:time_to_first_token_seconds_count") == 1
    assert value(m, "verispec:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert value(m, "verispec:inter_token_latency_seconds_count") == 2  # one per step, as vLLM counts
    assert value(m, "verispec:inter_token_latency_seconds_bucket", le="0.005") == 1
    assert value(m, "verispec:generation_tokens_total") == 6 and value(m, "verispec:prompt_tokens_total") == 3


def test_two_servers_keep_separate_registries():
    a, b = Metrics("m"), Metrics("m")
    a.observe_end("stop", 0.1)
    assert value(a, "verispec:request_success_total", finished_reason="stop") == 1
    assert value(b, "verispec:request_success_total", finished_reason="stop") is None


def _job(loop, n: int, max_new: int, seed: int = 0) -> Call:
    requests = [
        Request((5, 6, 7), SamplingParams(seed=seed + i), max_new_tokens=max_new, ignore_eos=True, index=i)
        for i in range(n)
    ]
    return Call(Job(requests, key=f"job-{seed}-{n}-{max_new}"), loop)


async def _idle(engine: EngineThread, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while engine.num_running or engine.num_waiting or engine.session.num_active:
        assert time.time() < deadline, "the engine did not go idle"
        await asyncio.sleep(0.01)


async def _last_event(job: Call, timeout: float = 60):
    while True:
        item = await asyncio.wait_for(job.events.get(), timeout=timeout)
        if isinstance(item, Exception) or item.completion is not None:
            return item


def test_engine_counts_finished_aborted_and_failed_choices_once(tiny_target):
    async def main():
        loop = asyncio.get_running_loop()
        m = Metrics("m")
        engine = EngineThread(
            SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), max_batch=2, max_queue=4, metrics=m
        )
        engine.start()
        try:
            running, waiting = _job(loop, 2, 200, seed=1), _job(loop, 1, 200, seed=3)
            engine.submit(running)
            engine.submit(waiting)  # both rows are taken: it waits
            await asyncio.wait_for(running.events.get(), timeout=60)  # running now
            engine.cancel(waiting)
            engine.cancel(running)
            await _idle(engine)
            assert value(m, "verispec:request_success_total", finished_reason="abort") == 3
            done = _job(loop, 1, 3, seed=5)
            engine.submit(done)
            assert (await _last_event(done)).completion.finish_reason == "length"
            engine.session.run = _broken
            failed = _job(loop, 2, 5, seed=6)
            engine.submit(failed)
            assert isinstance(await _last_event(failed), RuntimeError)
            await _idle(engine)
        finally:
            engine.stop()
        return m

    m = asyncio.run(main())
    reasons = {
        r: value(m, "verispec:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")
    }
    assert reasons == {"stop": None, "length": 1, "abort": 3, "error": 2}
    assert value(m, "verispec:e2e_request_latency_seconds_count") == 6  # every choice once, however it ended
    # tokens as they are produced (the cancelled rows' too), prompts as their rows join (the failed job's too)
    assert value(m, "verispec:generation_tokens_total") >= 3 + 2 and value(m, "verispec:prompt_tokens_total") == 15
    assert value(m, "verispec:request_queue_time_seconds_count") == 5  # the waiting job never joined
    assert value(m, "verispec:time_to_first_token_seconds_count") == 3  # the failed job never stepped
    assert value(m, "verispec:kv_cache_usage_perc") == 0 and value(m, "verispec:num_requests_running") == 0


def test_expired_jobs_end_with_abort_and_what_they_have_and_big_jobs_run_in_parts(tiny_target):
    """expire(): a running choice's last event carries its tokens so far (finish_reason "abort"), a waiting one an
    empty completion; a job with more choices than the batch holds joins as rows free up."""

    async def main():
        loop = asyncio.get_running_loop()
        m = Metrics("m")
        engine = EngineThread(
            SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), max_batch=2, max_queue=4, metrics=m
        )
        engine.start()
        try:
            big = _job(loop, 3, 4, seed=1)  # 3 choices, 2 rows: the third joins when one leaves
            engine.submit(big)
            ends = [await _last_event(big) for _ in range(3)]
            assert sorted(e.completion.index for e in ends) == [0, 1, 2]
            assert all(len(e.completion.token_ids) == 4 for e in ends)
            running, waiting = _job(loop, 2, 200, seed=2), _job(loop, 1, 200, seed=3)
            engine.submit(running)
            engine.submit(waiting)
            first = await asyncio.wait_for(running.events.get(), timeout=60)
            for _ in range(200):  # the gauge follows the step that sent the event
                if value(m, "verispec:kv_cache_usage_perc"):
                    break
                await asyncio.sleep(0.01)
            usage = value(m, "verispec:kv_cache_usage_perc")
            assert first.token_ids and 0 < usage <= 1 and value(m, "verispec:kv_cache_slots") > 0
            engine.expire(waiting)
            engine.expire(running)
            cut = [await _last_event(running) for _ in range(2)]
            gone = await _last_event(waiting)
            await _idle(engine)
        finally:
            engine.stop()
        return m, cut, gone

    m, cut, gone = asyncio.run(main())
    assert [c.completion.finish_reason for c in cut] == ["abort", "abort"]
    assert all(0 < len(c.completion.token_ids) < 200 for c in cut)
    assert gone.completion.finish_reason == "abort" and gone.completion.token_ids == []
    assert value(m, "verispec:request_success_total", finished_reason="abort") == 3
    assert value(m, "verispec:request_success_total", finished_reason="length") == 3


def _broken():
    raise RuntimeError("injected device error")


def test_max_queue_counts_the_choices_that_cannot_join_the_batch_now(tiny_target):
    """--max-queue 0: a request is admitted if a row is free for it, else 429; N: N choices (not requests) may wait
    for a row; a request with more choices than --max-batch + --max-queue is TooLarge (400). (The engine thread is
    not started: nothing leaves the queue.)"""
    loop = asyncio.new_event_loop()
    try:
        gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none"))
        none_wait = EngineThread(gen, max_batch=2, max_queue=0)
        none_wait.submit(_job(loop, 1, 4, seed=1))  # a row is free: admitted (was refused: 0 >= 0)
        none_wait.submit(_job(loop, 1, 4, seed=2))  # the second row
        with pytest.raises(Overloaded):
            none_wait.submit(_job(loop, 1, 4, seed=3))
        two_wait = EngineThread(gen, max_batch=1, max_queue=2)
        with pytest.raises(TooLarge, match="4 choices"):
            two_wait.submit(_job(loop, 4, 4, seed=9))  # 4 > 1 + 2: no wait would let it in
        two_wait.submit(_job(loop, 2, 4, seed=1))  # joins in part (more choices than rows): one choice waits
        two_wait.submit(_job(loop, 1, 4, seed=2))  # a second waiting choice
        with pytest.raises(Overloaded, match="2 choices are waiting"):
            two_wait.submit(_job(loop, 1, 4, seed=3))  # a third: the queue holds 2
    finally:
        loop.close()


def test_max_queue_tokens_bounds_the_prompt_tokens_waiting(tiny_target):
    """Waiting prompt tokens are bounded too (a job that waits alone is let in: it would never be otherwise)."""
    loop = asyncio.new_event_loop()
    try:
        engine = EngineThread(
            SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")),
            max_batch=1,
            max_queue=8,
            max_queue_tokens=4,
        )
        engine.submit(_job(loop, 1, 4, seed=1))  # runs
        engine.submit(_job(loop, 1, 4, seed=2))  # waits alone: 3 prompt tokens
        with pytest.raises(Overloaded):
            engine.submit(_job(loop, 1, 4, seed=3))  # 6 waiting tokens > 4
    finally:
        loop.close()


def test_after_the_shutdown_cut_nothing_is_admitted(tiny_target):
    loop = asyncio.new_event_loop()
    try:
        engine = EngineThread(
            SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), max_batch=2, max_queue=4
        )
        engine.submit(_job(loop, 1, 4, seed=1))
        assert engine.expire_all() == 1
        with pytest.raises(Closing):  # a request that passed the gate before the drain: 503, never run
            engine.submit(_job(loop, 1, 4, seed=2))
        assert engine.num_waiting == 0
    finally:
        loop.close()


def test_the_engine_expires_a_job_at_its_deadline_though_nobody_reads_its_events(tiny_target):
    """A streaming client that stops reading: its handler pulls no event, yet the compute ends at the deadline."""

    async def main():
        loop = asyncio.get_running_loop()
        m = Metrics("m")
        engine = EngineThread(
            SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), max_batch=2, max_queue=4, metrics=m
        )
        step = engine.session.run

        def slow():  # 200 tokens take more than 4 s
            time.sleep(0.02)
            return step()

        engine.session.run = slow
        engine.start()
        try:
            running, waiting = _job(loop, 2, 200, seed=1), _job(loop, 1, 200, seed=2)
            running.job.deadline = waiting.job.deadline = time.perf_counter() + 0.3
            engine.submit(running)
            engine.submit(waiting)
            await _idle(engine)  # not a single event read; that it ended by the deadline is checked below
        finally:
            engine.stop()
        return m, running

    m, running = asyncio.run(main())
    assert value(m, "verispec:request_success_total", finished_reason="abort") == 3
    events = [running.events.get_nowait() for _ in range(running.events.qsize())]
    ends = [e.completion for e in events if e.completion is not None]
    assert [c.finish_reason for c in ends] == ["abort", "abort"] and all(len(c.token_ids) < 200 for c in ends)


@pytest.mark.parametrize("broken", ["observe_step", "observe_tokens"])
def test_a_fault_outside_the_step_fails_its_jobs_and_the_engine_serves_on(tiny_target, broken):
    async def main():
        loop = asyncio.get_running_loop()
        m = Metrics("m")
        engine = EngineThread(
            SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), max_batch=2, max_queue=4, metrics=m
        )
        engine.start()
        try:
            setattr(m, broken, _raising)
            failed = _job(loop, 2, 5, seed=1)
            engine.submit(failed)
            assert isinstance(await _last_event(failed, timeout=10), RuntimeError)  # was: a dead thread, no answer
            delattr(m, broken)
            done = _job(loop, 1, 3, seed=2)
            engine.submit(done)
            assert (await _last_event(done, timeout=10)).completion.finish_reason == "length"
            await _idle(engine)
        finally:
            engine.stop()
        return m

    m = asyncio.run(main())
    assert value(m, "verispec:request_success_total", finished_reason="error") == 2
    assert value(m, "verispec:num_requests_running") == 0


def _raising(*args, **kwargs):
    raise RuntimeError("injected metrics bug")


def test_the_queue_count_admits_as_the_session_does(tiny_target):
    """4 prompts x n = 3 into an empty batch of 8: the session admits two whole groups (a group joins in parts only
    into an empty batch), so 6 choices wait; the engine's count says the same as the session's own admission."""
    loop = asyncio.new_event_loop()
    try:
        engine = EngineThread(
            SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none")), max_batch=8, max_queue=64
        )
        requests = [Request((5, 6, 7 + i // 3), SamplingParams(seed=i), max_new_tokens=4, index=i) for i in range(12)]
        engine.submit(Call(Job(requests, key="groups", group=3), loop))
        assert engine._waiting_after(None) == (6, 6)  # two prompts of 3 tokens wait
        engine._take_inbox()
        engine.session.schedule()
        assert engine.session.num_running == 6
        engine._publish()  # the session's own books now: the same 6 choices (two prompts of 3 tokens) wait
        assert engine._waiting_after(None) == (6, 6) and engine.num_waiting == 6 and engine.num_running == 6
    finally:
        loop.close()
