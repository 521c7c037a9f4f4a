"""The engine's one scheduler (`GenerationSession` over an `EngineCore`): typed requests, jobs admitted in order
(whole groups, at most max_batch rows), barriers (weight updates) between jobs, abort by key returning the final
events, the weight version on every completion. Tiny models, greedy or seeded: every assertion is exact."""

from __future__ import annotations

import pytest
import torch

from verispec.engine import EngineCore, GenerationSession, Job, Request, SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.sampling import SamplingParams

from ..helpers.tiny import greedy_reference, loaded

GREEDY = SamplingParams(temperature=0.0)
PROMPT = (3, 7, 7, 12)


def _drive(sess: GenerationSession, trace: list | None = None) -> dict:
    """Step until idle; {request key: Completion}. trace collects ("step", keys in the batch) per step."""
    done = {}
    while not sess.idle:
        events = sess.step()
        if trace is not None and sess.rows + [e for e in events if e.completion is not None]:
            trace.append({e.key for e in events} | {r.key for r in sess.rows})
        for e in events:
            if e.completion is not None:
                done[e.key] = e.completion
    return done


def _reqs(tag: str, n: int, max_new: int = 5, prompt=PROMPT) -> list[Request]:
    return [Request(prompt, GREEDY, max_new_tokens=max_new, ignore_eos=True, key=(tag, i), index=i) for i in range(n)]


@pytest.fixture
def gen():
    """A generator over a target of its own (tests here replace its weights)."""
    return SpeculativeGenerator(loaded(0), config=SpecConfig(draft="ngram", gamma=2))


def test_request_checks_what_needs_no_model():
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request((1, 2), max_new_tokens=0)
    with pytest.raises(ValueError, match="no tokens"):
        Request(())
    with pytest.raises(ValueError, match="top_logprobs"):
        Request((1,), top_logprobs=21)
    with pytest.raises(ValueError, match="SamplingParams"):
        Request((1,), params={"temperature": 1.0})
    assert Request((1,), stop="ab").stop == ("ab",)
    with pytest.raises(ValueError, match="distinct keys"):
        Job([Request((1,), key="a"), Request((2,), key="a")])


def test_the_core_checks_against_the_model(gen):
    core: EngineCore = gen.core
    with pytest.raises(ValueError, match="stop_token_ids"):
        core.request([3, 4], stop_token_ids=[10**6])
    with pytest.raises(ValueError, match=r"prompt token ids must lie in \[0, 32\)"):
        core.request([3, 99])
    sess = GenerationSession(core)
    with pytest.raises(ValueError, match=r"\[0, 32\)"):  # a Request built by hand is checked on submit
        sess.submit(Job([Request((3, 99))]))
    with pytest.raises(ValueError, match="context"):
        sess.submit(Job([Request(tuple([3] * (core.max_positions + 1)))]))
    assert sess.idle


def test_a_barrier_runs_between_jobs_never_inside_one(gen):
    """Job A (4 requests, batch 2) runs whole before the update; job B, submitted after it, runs whole after it."""
    sess = gen.session(max_batch=2)
    order: list[str] = []
    sess.submit(Job(_reqs("A", 4), key="A", on_admit=lambda r: order.append(f"admit {r.key}")))
    barrier = sess.barrier(lambda: order.append("update") or "written")
    sess.submit(Job(_reqs("B", 2), key="B", on_admit=lambda r: order.append(f"admit {r.key}")))
    done = _drive(sess)
    assert order.index("update") == 4  # after all four of A's admissions, before B's
    assert order[5:] == ["admit ('B', 0)", "admit ('B', 1)"]
    assert barrier.done.is_set() and barrier.wait(0) == "written"
    assert len(done) == 6


def test_an_update_between_jobs_gives_each_job_one_version(gen):
    """The mixed-version case: 4 greedy choices on a batch of 2 with an update queued while the first two run. All
    four are drawn under the old weights and say so; the job after the update under the new ones."""
    new = loaded(5).model
    old_ref = greedy_reference(loaded(0).model, list(PROMPT), 5, eos=None)
    new_ref = greedy_reference(new, list(PROMPT), 5, eos=None)
    assert old_ref != new_ref
    sess = gen.session(max_batch=2)
    sess.submit(Job(_reqs("A", 4), key="A"))
    first = sess.step()  # A's first two choices run; its last two wait for rows
    assert {r.key for r in sess.rows} == {("A", 0), ("A", 1)} and len(sess.pending) == 2 and first
    update = sess.barrier(lambda: gen.core.update_weights(new.state_dict().items()))
    sess.submit(Job(_reqs("B", 2), key="B"))
    done = _drive(sess)
    assert update.wait(0).version == 1 == gen.core.weight_version
    for i in range(4):
        assert done[("A", i)].token_ids == old_ref and done[("A", i)].weight_version == 0
    for i in range(2):
        assert done[("B", i)].token_ids == new_ref and done[("B", i)].weight_version == 1


def test_a_failed_barrier_keeps_its_error_and_the_session_serves_on(gen):
    def bad():
        raise ValueError("no such tensor")

    sess = gen.session()
    b = sess.barrier(bad)
    sess.submit(Job(_reqs("A", 1), key="A"))
    done = _drive(sess)
    with pytest.raises(ValueError, match="no such tensor"):
        b.wait(0)
    assert done[("A", 0)].finish_reason == "length" and done[("A", 0)].weight_version == 0


def test_groups_join_whole_when_they_fit_and_big_ones_in_parts(gen):
    """Groups of 3 on a batch of 4: the second group waits for room rather than split; a group of 6 (more than the
    batch) joins in parts, into an empty batch only."""
    sess = gen.session(max_batch=4)
    sess.submit(Job(_reqs("A", 6, max_new=3), key="A", group=3))
    sess.submit(Job(_reqs("B", 6, max_new=2), key="B", group=6))
    batches: list[set] = []
    done = {}
    while not sess.idle:
        sess.schedule()
        batches.append({r.key for r in sess.rows})
        for e in sess.run():
            if e.completion is not None:
                done[e.key] = e.completion
    assert batches[0] == {("A", 0), ("A", 1), ("A", 2)}  # the second group of A (3 rows) does not fit in 1 free row
    assert all(len(b) <= 4 for b in batches)
    b_parts = [b for b in batches if any(k[0] == "B" for k in b)]
    assert {("B", 0), ("B", 1), ("B", 2), ("B", 3)} in b_parts  # B's group of 6 in parts of at most 4
    assert not any(any(k[0] == "A" for k in b) for b in b_parts)  # into an empty batch only: never beside A
    assert len(done) == 12


def test_abort_by_key_returns_the_final_events(gen):
    sess = gen.session(max_batch=2)
    sess.submit(Job(_reqs("A", 3, max_new=20), key="A"))
    sess.submit(Job(_reqs("B", 1, max_new=4), key="B"))
    for _ in range(3):
        sess.step()
    events = sess.abort(("A", 1))  # one running request
    assert [e.key for e in events] == [("A", 1)]
    c = events[0].completion
    assert c.finish_reason == "abort" and len(c.token_ids) >= 3 and c.weight_version == 0
    events = sess.abort("A")  # the rest of the job: one running, one that never joined
    by_key = {e.key: e.completion for e in events}
    assert set(by_key) == {("A", 0), ("A", 2)}
    assert by_key[("A", 2)].token_ids == [] and by_key[("A", 2)].finish_reason == "abort"
    assert by_key[("A", 0)].finish_reason == "abort" and by_key[("A", 0)].token_ids
    assert sess.abort("A") == [] and sess.abort("nobody") == []
    done = _drive(sess)
    assert list(done) == [("B", 0)] and done[("B", 0)].finish_reason == "length"


def test_aborting_a_waiting_request_keeps_the_rest_of_its_job(gen):
    sess = gen.session(max_batch=1)
    sess.submit(Job(_reqs("A", 3, max_new=3), key="A"))
    sess.step()
    assert sess.abort(("A", 2))[0].completion.token_ids == []
    done = _drive(sess)
    assert set(done) == {("A", 0), ("A", 1)}


def test_keys_are_unique_while_live(gen):
    sess = gen.session()
    sess.submit(Job(_reqs("A", 1), key="A"))
    with pytest.raises(ValueError, match="already"):
        sess.submit(Job(_reqs("A", 1), key="A2"))  # the same request key
    with pytest.raises(ValueError, match="already"):
        sess.submit(Job(_reqs("Z", 1), key="A"))  # the same job key
    _drive(sess)
    sess.submit(Job(_reqs("A", 1), key="A"))  # finished: free again
    assert len(_drive(sess)) == 1


def test_session_and_generator_agree_token_for_token(gen):
    """The generator's loop is a thin loop over the session: the same requests give the same tokens."""
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    outs = gen.generate([list(PROMPT)] * 3, params, max_new_tokens=6)
    sess = gen.session()
    sess.submit(Job([Request(PROMPT, p, max_new_tokens=6, key=i, index=i) for i, p in enumerate(params)]))
    done = _drive(sess)
    assert [done[i].token_ids for i in range(3)] == [o.token_ids for o in outs]


def test_weight_update_counts_versions_and_a_bad_one_changes_nothing(gen):
    before = {k: v.clone() for k, v in gen.core.model.state_dict().items()}
    with pytest.raises(ValueError):
        gen.core.update_weights([("no.such.weight", torch.zeros(1))])
    assert gen.core.weight_version == 0
    assert all(torch.equal(before[k], v) for k, v in gen.core.model.state_dict().items())
    up = gen.core.update_weights(loaded(5).model.state_dict().items())
    assert up.version == 1 == gen.weight_version and up.tensors > 0


def test_on_event_gets_every_event_of_its_job_and_the_books_say_where_it_is(gen):
    """A job's on_event sees exactly its requests' events (each step's, then the abort's), after the books changed;
    the session answers which jobs are unfinished, by job or request key, and how many requests run."""
    sess = gen.session(max_batch=2)
    seen, admitted = [], []
    a = Job(_reqs("A", 3, max_new=20), key="A", on_admit=admitted.append, on_event=seen.append)
    sess.submit(a)
    sess.submit(Job(_reqs("B", 1, max_new=3), key="B"))
    assert sess.jobs == [a, sess.job("B")] and sess.job(("A", 2)) is a and sess.job("nobody") is None
    returned = [e for _ in range(3) for e in sess.step() if e.key[0] == "A"]
    assert sess.num_running == 2 and a.admitted == 2 and [r.key for r in admitted] == [("A", 0), ("A", 1)]
    returned += sess.abort("A")
    assert seen == returned and {e.key for e in seen if e.completion is not None} == {("A", 0), ("A", 1), ("A", 2)}
    assert sess.job("A") is None and a.open == 0 and [j.key for j in sess.jobs] == ["B"]


def test_a_job_past_its_deadline_ends_abort_at_expire(gen):
    sess = gen.session(max_batch=1)
    job = Job(_reqs("A", 2, max_new=50), key="A", deadline=100.0)
    sess.submit(job)
    sess.step()
    assert sess.expire(now=99.0) == [] and sess.job("A") is job
    ends = {e.key: e.completion for e in sess.expire(now=100.0)}
    assert set(ends) == {("A", 0), ("A", 1)} and {c.finish_reason for c in ends.values()} == {"abort"}
    assert ends[("A", 0)].token_ids and ends[("A", 1)].token_ids == []  # running / never joined
    assert sess.idle


def test_reset_fails_the_started_jobs_and_keeps_the_queue(gen):
    """After a failed step: the started job's requests end "error" (with the error, no tokens), the batch starts
    afresh, and the job not started yet runs as it would have."""
    sess = gen.session(max_batch=2)
    sess.submit(Job(_reqs("A", 3, max_new=20), key="A"))  # two run, one waits: started
    sess.submit(Job(_reqs("B", 1, max_new=4), key="B"))
    sess.step()
    error = RuntimeError("device fault")
    ends = {e.key: e.completion for e in sess.reset(error)}
    assert set(ends) == {("A", 0), ("A", 1), ("A", 2)} and not sess.rows
    assert all(c.finish_reason == "error" and c.error is error and c.token_ids == [] for c in ends.values())
    done = _drive(sess)
    alone = _drive(_solo(gen, _reqs("B", 1, max_new=4)))
    assert list(done) == [("B", 0)] and done[("B", 0)].token_ids == alone[("B", 0)].token_ids


def _solo(gen, reqs) -> GenerationSession:
    sess = gen.session()
    sess.submit(Job(reqs))
    return sess


def test_a_request_is_checked_once(gen, monkeypatch):
    """EngineCore.request checks a request and marks it (a new key keeps the mark); a session checks on submit only
    what its core has not."""
    core = gen.core
    checked = core.request(list(PROMPT), GREEDY, max_new_tokens=2, key="core")
    assert checked.checked is core and checked.keyed("again").checked is core
    assert Request(PROMPT, GREEDY).checked is None
    calls = []
    monkeypatch.setattr(core, "check", lambda req: calls.append(req.key))
    sess = gen.session()
    sess.submit(Job([checked, Request(PROMPT, GREEDY, max_new_tokens=2, key="hand")]))
    assert calls == ["hand"]
