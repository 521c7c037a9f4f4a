"""The server's jobs on the engine's one scheduler: a request never spans two weight versions (and says which it
was drawn under), /generate/ is a job like any other (request timeout, served beside OpenAI requests). Ordering is
by events: the engine's step is gated by the test, and the update is known to be queued before the gate opens."""

from __future__ import annotations

import threading

import pytest
import torch

from verispec.engine.generator import SpeculativeGenerator
from verispec.rollout.client import RolloutClient

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
    gen = SpeculativeGenerator(loaded(0), "ngram", gamma=2)
    with LiveServer(gen, max_batch=2, max_queue=8) as s, RolloutClient(s.url) as c:
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
    rollout ends "abort" at --request-timeout (it would run for many thousands of steps)."""
    long = 1 << 15
    target = loaded(0, max_positions=long)
    gen = SpeculativeGenerator(target, "ngram", gamma=2)
    with LiveServer(gen, max_batch=8, request_timeout=3.0) as s, RolloutClient(s.url) as client:
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
