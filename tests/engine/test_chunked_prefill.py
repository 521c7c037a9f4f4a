"""Chunked prefill (`GenerationSession(prefill_chunk=...)`): while rows run, a long prompt is prefilled outside the
batch, one chunk per step, and joins once complete. Its tokens and the running rows' are those of unchunked prefill
(greedy and seeded sampling, fast and transformers runners, groups sharing a prompt); the running rows get a step
every step meanwhile; a staged request holds its batch slot, counts as pending, and can be aborted."""

from __future__ import annotations

import random

import pytest
import torch

from verispec.engine import GenerationSession, Job, Request, SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.model import make_runner
from verispec.sampling import SamplingParams

from ..helpers.tiny import loaded

GREEDY = SamplingParams(temperature=0.0)
CHUNK = 8


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 32) for _ in range(n))


@pytest.fixture(scope="module")
def target():
    return loaded(0, max_positions=1024)


@pytest.fixture(scope="module", params=["fast", "hf"])
def gen(request, target):
    return SpeculativeGenerator(target, config=SpecConfig(draft="ngram", gamma=2, runner=request.param))


def _req(prompt, params, key, max_new=12, index=0) -> Request:
    return Request(prompt, params, max_new_tokens=max_new, ignore_eos=True, key=key, index=index)


def _drive(sess: GenerationSession, arrivals: dict[int, list[Job]], after_step=None) -> dict:
    """Step until idle, submitting arrivals[i] before step i (after_step(sess) after each); {key: token ids}."""
    done, step = {}, 0
    while not sess.idle or any(k >= step for k in arrivals):
        for job in arrivals.get(step, []):
            sess.submit(job)
        for e in sess.step():
            if e.completion is not None:
                done[e.key] = e.completion.token_ids
        if after_step is not None:
            after_step(sess)
        step += 1
    return done


def _scenario(params: SamplingParams) -> dict[int, list[Job]]:
    """A short request running; at step 2 a 150-token prompt; at step 4 a group of 3 samples of a 100-token prompt
    and a short request (which joins at once)."""
    seeded = params.seed is not None

    def p(i):
        return SamplingParams(temperature=params.temperature, seed=params.seed + i) if seeded else params

    group = [_req(_prompt(100, 2), p(10 + i), ("group", i), index=i) for i in range(3)]
    return {
        0: [Job([_req(_prompt(5, 0), p(0), "running", max_new=40)])],
        2: [Job([_req(_prompt(150, 1), p(1), "long")])],
        4: [Job(group, group=3), Job([_req(_prompt(6, 3), p(3), "short")])],
    }


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, seed=7)], ids=["greedy", "seeded"])
def test_chunked_prefill_gives_the_tokens_of_unchunked_prefill(gen, params):
    whole = _drive(GenerationSession(gen.core, prefill_chunk=0), _scenario(params))
    staged_seen = []
    done = _drive(
        GenerationSession(gen.core, prefill_chunk=CHUNK),
        _scenario(params),
        lambda s: staged_seen.append(len(s.prefilling)),
    )
    assert max(staged_seen) >= 1  # the long prompts were staged, not prefilled whole
    assert set(done) == set(whole) == {"running", "long", "short", ("group", 0), ("group", 1), ("group", 2)}
    assert done == whole


def test_a_running_row_gets_a_token_every_step_while_a_long_prompt_is_staged(target):
    """Plain decoding (one token per step): a prompt of 10 chunks takes 10 steps to join, and the running row gets
    its token at each of them."""
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="none", runner="fast"))
    sess = GenerationSession(gen.core, prefill_chunk=CHUNK)
    sess.submit(Job([_req(_prompt(4, 0), GREEDY, "running", max_new=40)]))
    sess.step()
    calls = []
    stage = gen.core.runner.stage

    def counted(tokens, capacity):  # count the chunks fed (a step observer on the runner's staging)
        staged = stage(tokens, capacity)
        feed = staged.feed
        staged.feed = lambda n: calls.append(n) or feed(n)
        return staged

    gen.core.runner.stage = counted
    try:
        sess.submit(Job([_req(_prompt(10 * CHUNK + 1, 1), GREEDY, "long", max_new=3)]))  # 10 chunks to prefill
        steps = 0
        while any(r.key == "long" for p in sess.prefilling for r in p.rows) or not sess.rows[1:]:
            events = sess.step()
            steps += 1
            assert [len(e.token_ids) for e in events if e.key == "running"] == [1]
        assert steps == 10 and calls == [CHUNK] * 10
    finally:
        del gen.core.runner.stage


def test_a_staged_request_holds_its_slot_counts_as_pending_and_can_be_aborted(target):
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="ngram", gamma=2, runner="fast"))
    sess = GenerationSession(gen.core, max_batch=2, prefill_chunk=CHUNK)
    sess.submit(Job([_req(_prompt(4, 0), GREEDY, "running", max_new=30)]))
    sess.step()
    sess.submit(Job([_req(_prompt(60, 1), GREEDY, "long")]))
    sess.submit(Job([_req(_prompt(4, 2), GREEDY, "queued")]))
    order = []
    sess.barrier(lambda: order.append(("barrier", len(sess.rows), len(sess.prefilling))))
    sess.step()
    assert [r.key for r in sess.rows] == ["running"] and [r.key for p in sess.prefilling for r in p.rows] == ["long"]
    assert [r.key for r in sess.pending] == ["long", "queued"]  # "queued" waits: the batch's 2 slots are held
    assert sess.num_active == 3 and not sess.idle
    (event,) = sess.abort("long")
    assert event.completion.finish_reason == "abort" and event.completion.token_ids == []
    assert not sess.prefilling and [r.key for r in sess.pending] == ["queued"]
    assert sess.abort("long") == []
    done = _drive(sess, {})
    assert set(done) == {"running", "queued"} and order == [("barrier", 0, 0)]


def test_with_no_row_running_a_long_prompt_is_prefilled_whole(target):
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="ngram", gamma=2, runner="fast"))
    sess = GenerationSession(gen.core, prefill_chunk=CHUNK)
    sess.submit(Job([_req(_prompt(60, 1), GREEDY, "long", max_new=2)]))
    sess.step()
    assert not sess.prefilling and [r.key for r in sess.rows] == ["long"]


def test_staged_rows_finish_whole_once_the_running_rows_are_gone(target):
    """The running row ends while a prompt is staged: the next step prefills the rest at once (no one to delay)."""
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="none", runner="fast"))
    sess = GenerationSession(gen.core, prefill_chunk=CHUNK)
    sess.submit(Job([_req(_prompt(4, 0), GREEDY, "running", max_new=3)]))
    sess.step()
    sess.submit(Job([_req(_prompt(100, 1), GREEDY, "long", max_new=4)]))
    sess.step()
    sess.step()  # "running" ends here
    assert not sess.rows and sess.prefilling
    sess.step()
    assert not sess.prefilling and [r.key for r in sess.rows] == ["long"]
    done = _drive(sess, {})
    ref = _drive(GenerationSession(gen.core, prefill_chunk=0), {0: [Job([_req(_prompt(100, 1), GREEDY, "long", 4)])]})
    assert done["long"] == ref["long"]


def test_prefill_chunk_is_checked(target):
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="ngram", gamma=2))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefill_chunk"):
            GenerationSession(gen.core, prefill_chunk=bad)
    assert GenerationSession(gen.core).prefill_chunk == gen.core.prefill_chunk > 0


@pytest.mark.parametrize("kind", ["fast", "hf"])
def test_a_staged_row_joins_with_the_cache_add_rows_gives(target, kind):
    """Runner level: stage, feed in chunks, join as 2 copies == add_rows of the same prompt twice (logits after)."""
    prompt, other = list(_prompt(40, 1)), list(_prompt(5, 0))
    a = make_runner(target.model, 32, runner=kind)
    a.fill([other], 64)
    a.add_rows([prompt, prompt], 64)
    b = make_runner(target.model, 32, runner=kind)
    b.fill([other], 64)
    staged = b.stage(prompt, 64)
    assert staged.feed(7) == 7 and staged.remaining == 33 and b.lengths == [5]
    while staged.remaining:
        staged.feed(7)
    with pytest.raises(ValueError, match="completely fed"):
        b.join(b.stage(prompt, 64))
    b.join(staged, copies=2)
    assert b.lengths == a.lengths == [5, 40, 40]
    nxt = [[3], [4], [5]]
    torch.testing.assert_close(b.forward(nxt), a.forward(nxt), rtol=0, atol=1e-5)


def test_serve_checks_its_prefill_chunk_flag(capsys):
    from verispec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--prefill-chunk", "-1"])
    assert e.value.code == 2 and "--prefill-chunk: must be an integer >= 0" in capsys.readouterr().err
