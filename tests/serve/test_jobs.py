"""The server's jobs on the engine's one scheduler: a request never spans two weight versions (and says which it
was drawn under), /generate/ is a job like any other (request timeout, served beside OpenAI requests). Ordering is
by events: the engine's step is gated by the test, and the update is known to be queued before the gate opens."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
import torch

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.engine.request import Job
from verispec.rollout.client import RolloutClient
from verispec.sampling import SamplingParams
from verispec.serve.engine import Call, EngineThread, Overloaded
from verispec.serve.metrics import Metrics

from ..helpers.server import HANG_GUARD_S, MODEL, LiveServer
from ..helpers.tiny import greedy_reference, loaded

PROMPT = [3, 7, 7, 12]


class Gate:
    """Holds the engine thread before each step until `open` is set; `entered` once a step waits. `queued` is set
    once an update has been handed to the engine (it then waits for the jobs submitted before it)."""

    def __init__(self, engine):
        self.entered, self.open, self.queued = threading.Event(), threading.Event(), threading.Event()
        run, between = engine.session.run, engine.between_jobs

        def gated():
            self.entered.set()
            assert self.open.wait(HANG_GUARD_S), "the test never opened the gate"
            return run()

        def queued(*a, **kw):
            barrier = between(*a, **kw)
            self.queued.set()
            return barrier

        engine.session.run, engine.between_jobs = gated, queued


def _new_weights(seed: int = 5) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loaded(seed).model.state_dict().items()}


@pytest.fixture
def served_small_batch():
    """A server with a batch of 2 over a target of its own (its weights are replaced), plain greedy-able decoding
    through the speculative loop (n-gram drafts)."""
    gen = SpeculativeGenerator(loaded(0), config=SpecConfig(draft="ngram", gamma=2))
    with LiveServer(gen, max_batch=2, max_queue=8, enable_weight_updates=True) as s, RolloutClient(s.url) as c:
        yield s, c


def test_a_request_is_drawn_under_one_weight_version_and_says_which(served_small_batch):
    """n = 4 greedy choices on a batch of 2, an update sent while the first two run (the last two still wait): all
    four are the old weights' greedy text, and the reply says weight_version 0; a request after it gets version 1."""
    s, client = served_small_batch
    old_ref = greedy_reference(loaded(0).model, PROMPT, 8, eos=None)
    new_ref = greedy_reference(loaded(5).model, PROMPT, 8, eos=None)
    assert old_ref != new_ref
    gate = Gate(s.engine)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    result = {}
    first = threading.Thread(target=lambda: result.setdefault("a", s.client().completions.create(n=4, **kw)))
    first.start()
    assert gate.entered.wait(HANG_GUARD_S)  # choices 0-1 are in the batch, 2-3 wait for rows
    update = threading.Thread(target=lambda: result.setdefault("u", client.update_weights(_new_weights().items())))
    update.start()
    assert gate.queued.wait(HANG_GUARD_S)
    gate.open.set()
    first.join(HANG_GUARD_S)
    update.join(HANG_GUARD_S)
    a = result["a"]
    texts = {s.app.state.served.decode(old_ref)}
    assert [c.text for c in a.choices] == [*texts] * 4, "a choice was drawn under the new weights"
    assert a.model_extra["weight_version"] == 0 and result["u"]["weight_version"] == 1
    after = s.client().completions.create(n=1, **kw)
    assert after.choices[0].text == s.app.state.served.decode(new_ref)
    assert after.model_extra["weight_version"] == 1


def test_replies_carry_the_weight_version(served_small_batch):
    s, client = served_small_batch
    kw = dict(model=MODEL, max_tokens=3, temperature=0.0)
    chat = s.client().chat.completions.create(messages=[{"role": "user", "content": "a b"}], **kw)
    assert chat.model_extra["weight_version"] == 0
    client.update_weights(_new_weights().items())
    chunks = list(s.client().completions.create(prompt=PROMPT, stream=True, **kw))
    assert chunks and all(ch.model_extra["weight_version"] == 1 for ch in chunks)
    out = client.generate([PROMPT], n=2, max_tokens=3, seed=0)
    assert out["weight_version"] == 1


def test_generate_runs_beside_openai_requests_and_honours_the_request_timeout():
    """/generate/ is an ordinary job: an OpenAI request sent while a long rollout runs is answered in full, and the
    rollout ends "abort" at --request-timeout, given explicitly (the 600 s default holds for the OpenAI routes only;
    the rollout would run for many thousands of steps)."""
    long = 1 << 15
    target = loaded(0, max_positions=long)
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="ngram", gamma=2))
    with LiveServer(gen, max_batch=8, request_timeout=3.0, rollout_timeout=3.0) as s, RolloutClient(s.url) as client:
        gate = Gate(s.engine)
        result = {}
        t = threading.Thread(
            target=lambda: result.setdefault(
                "g", client.generate([PROMPT], n=2, max_tokens=long - 16, seed=0, ignore_eos=True)
            )
        )
        t.start()
        assert gate.entered.wait(HANG_GUARD_S)  # the rollout is in the batch
        box = {}
        c = threading.Thread(
            target=lambda: box.setdefault(
                "c",
                s.client().completions.create(
                    model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True}
                ),
            )
        )
        c.start()
        gate.open.set()
        c.join(HANG_GUARD_S)
        t.join(HANG_GUARD_S)
        assert box["c"].choices[0].finish_reason == "length" and len(box["c"].choices[0].text.split()) == 4
        out = result["g"]
        assert out["finish_reasons"] == ["abort", "abort"]
        assert all(0 < len(ids) < long - 16 for ids in out["completion_ids"])


# --- the engine thread's failure paths (driven directly; every wait is on an event or a job's own events) -----------


def _engine(max_batch: int = 1, max_queue: int = 8):
    gen = SpeculativeGenerator(loaded(0), config=SpecConfig(draft="ngram", gamma=2))
    metrics = Metrics("t")
    return gen, EngineThread(gen, max_batch=max_batch, max_queue=max_queue, metrics=metrics), metrics


def _job(gen, loop, n: int = 1, max_new: int = 8) -> Call:
    reqs = [
        gen.core.request(
            PROMPT, SamplingParams(temperature=1.0, seed=i), max_new_tokens=max_new, ignore_eos=True, index=i
        )
        for i in range(n)
    ]
    return Call(Job(reqs, key=uuid.uuid4().hex, group=n), loop)


async def _answer(job) -> list:
    """The job's events until each choice has its last event (or the job its error)."""
    out, ended = [], 0
    while ended < len(job.job.requests):
        ev = await asyncio.wait_for(job.events.get(), HANG_GUARD_S)
        out.append(ev)
        ended += len(job.job.requests) if isinstance(ev, Exception) else int(ev.completion is not None)
    return out


def _ends(metrics) -> dict:
    return {r: metrics.value("request_success_total", finished_reason=r) for r in ("length", "abort", "error")}


def test_a_job_expired_while_waiting_is_answered_though_the_running_step_fails():
    async def main():
        gen, engine, metrics = _engine(max_batch=1)
        entered, go = threading.Event(), threading.Event()

        def failing():
            entered.set()
            assert go.wait(HANG_GUARD_S)
            raise RuntimeError("device fault")

        engine.session.run = failing
        engine.start()
        loop = asyncio.get_running_loop()
        running, waiting = _job(gen, loop, max_new=50), _job(gen, loop)
        engine.submit(running)
        engine.submit(waiting)  # the batch holds one: it waits
        await asyncio.to_thread(entered.wait, HANG_GUARD_S)
        engine.expire(waiting)  # /abort_request or a shutdown's cut, while the step runs
        go.set()
        a, b = await _answer(running), await _answer(waiting)
        engine.stop()
        return a, b, metrics

    a, b, metrics = asyncio.run(main())
    assert isinstance(a[-1], RuntimeError)
    assert b[-1].completion.finish_reason == "abort" and b[-1].completion.token_ids == []
    assert _ends(metrics) == {"length": 0.0, "abort": 1.0, "error": 1.0}


def test_a_failed_hand_over_leaves_no_ghost_row():
    """A fault handing over a choice's last event fails that job once and frees its row: the next request joins."""

    async def main():
        gen, engine, metrics = _engine(max_batch=1, max_queue=0)
        observe, armed = engine._observe, [True]

        def faulty(call, ev):
            if ev.completion is not None and armed:
                armed.clear()
                raise RuntimeError("metrics backend hiccup")
            return observe(call, ev)

        engine._observe = faulty
        engine.start()
        loop = asyncio.get_running_loop()
        first = _job(gen, loop, max_new=3)
        engine.submit(first)
        failed = await _answer(first)
        second = _job(gen, loop, max_new=3)
        engine.submit(second)  # max_queue 0: accepted only if the row was freed
        done = await _answer(second)
        engine.stop()
        return failed, done, engine, metrics

    failed, done, engine, metrics = asyncio.run(main())
    assert isinstance(failed[-1], RuntimeError) and done[-1].completion.finish_reason == "length"
    assert engine.num_running == 0 and _ends(metrics) == {"length": 1.0, "abort": 0.0, "error": 1.0}


def test_max_queue_zero_refuses_a_group_that_cannot_join_whole():
    async def main():
        gen, engine, _ = _engine(max_batch=2, max_queue=0)
        gate = Gate(engine)
        engine.start()
        loop = asyncio.get_running_loop()
        engine.submit(_job(gen, loop, max_new=5))  # one row busy
        await asyncio.to_thread(gate.entered.wait, HANG_GUARD_S)
        try:
            with pytest.raises(Overloaded):  # two choices of one prompt join together: they would wait
                engine.submit(_job(gen, loop, n=2))
            single = _job(gen, loop)
            engine.submit(single)  # one choice fits the free row
        finally:
            gate.open.set()
        done = await _answer(single)
        engine.stop()
        return done

    assert asyncio.run(main())[-1].completion.finish_reason == "length"


def test_a_client_that_sends_its_next_request_as_the_last_one_ends_is_admitted():
    """max_queue 0 (no waiting) on a batch of 1: a request sent as soon as the previous one's last event arrived is
    admitted, every time; a handler hears its request end only once the engine's books say its row is free."""

    async def main():
        gen, engine, _ = _engine(max_batch=1, max_queue=0)
        engine.start()
        loop = asyncio.get_running_loop()
        try:
            for _ in range(5):
                call = _job(gen, loop, max_new=2)
                engine.submit(call)  # Overloaded if the previous request's row still counted as held
                assert (await _answer(call))[-1].completion.finish_reason == "length"
        finally:
            engine.stop()

    asyncio.run(main())
