"""The server's engine thread: one `GenerationSession` — the engine's one scheduler — driven step by step on this
thread, requests joining and leaving between steps (continuous batching), a bounded waiting queue, cancellation,
early ends, and weight updates between jobs.

HTTP handlers run on the asyncio loop; the model runs on this one thread. A handler `submit`s a `Job` (one HTTP
request: its typed `Request`s, prompt-major — an OpenAI request's choices, or a /generate/ rollout batch) and reads
its events from `job.events` (an asyncio.Queue fed with `call_soon_threadsafe`). Admission is the session's: at most
`max_batch` rows run (a job's choices join as rows free up, each prompt's choices together when they fit, so a
request with more choices than that runs in parts), in submission order. Admission counts choices (prompts x n)
and prompt tokens, not requests: at most `max_queue` choices wait that cannot join the batch now (0: none; a
job joins if a row is free for it), holding at most `max_queue_tokens` prompt tokens; past that `submit` raises
`Overloaded` (the handler answers 429), and a job larger than the whole budget raises `TooLarge` (400). After `expire_all` (a shutdown's cut) `submit` raises `Closing` (503).

Weight updates (`between_jobs`) are the session's barriers: an update runs once every job submitted before it has
finished — all its choices, not only those already in the batch — and jobs submitted after it start under the new
weights. No job's choices span two weight versions, and each completion says which version it was drawn under.

A job ends early in two ways. `cancel` (its client went away): its rows leave the batch before the next step and
nobody is told. `expire` (its `deadline`, --request-timeout, passed: the engine thread expires it itself, whether
or not its handler reads its events; or a shutdown past --shutdown-timeout; or /abort_request for rollouts): its
unfinished choices end at once with finish_reason "abort", each with the text and tokens it has so far.

A fault on the engine thread never stops it. A fault of one request inside a step (its distribution, grammar, stop
strings or detokenizer: `engine.rows.RowFault`) fails that request's job alone, and the other rows go on with the
tokens they would have had without it; a failed step (the forward itself) fails the running jobs, a failure handing a step's
output to a job (metrics, decoding) fails that job, and anything else fails every job; each gets an Exception
event (the handler answers 500) and the thread serves on.

Every choice is counted in the metrics exactly once, here where it ends: finished (`stop` / `length`, before
its last event reaches the handler), cut short (`abort`: its client went away, it expired, while running or still
waiting), or failed by an engine error (`error`). See `serve.metrics` for the latency histograms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from ..engine import request as engine_request
from ..engine.generator import SpeculativeGenerator, StreamEvent
from ..engine.request import Barrier, Request
from ..engine.session import GenerationSession
from ..sampling import ConstraintError, ParamError
from .limits import DEFAULT_MAX_QUEUE, DEFAULT_MAX_QUEUE_TOKENS

__all__ = ["Closing", "EngineThread", "Job", "Overloaded", "PromptLogprobs", "TooLarge", "kv_cache_usage"]

log = logging.getLogger("verispec.serve")


class Overloaded(Exception):
    """The waiting queue is full."""


class TooLarge(ValueError):
    """A request larger than the server's whole budget (more choices than --max-batch + --max-queue, or more
    prompt tokens than --max-queue-tokens): waiting would never let it in, so it is refused (the handler: 400).

    Attributes:
        field: The request field to name (`n`, `prompt`)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class Closing(Exception):
    """The server is shutting down: its requests were cut short (`expire_all`) and it admits no more."""


@dataclass
class PromptLogprobs:
    """Pushed before the first event of a prompt's choices when the job asked for them (echo with logprobs):
    each prompt token's raw target logprob given the tokens before it (None for the first token) and its best
    alternatives (None without)."""

    prompt: int  # the prompt's index in the request
    logprobs: list[float | None]
    top: list | None


@dataclass(eq=False)
class Job:
    """One HTTP request: its `requests` (typed, checked by `EngineCore.request`), prompt-major: request i is choice
    i % per_prompt of prompt i // per_prompt; request i's key is (id, i)."""

    id: str
    requests: list[Request]
    loop: asyncio.AbstractEventLoop
    per_prompt: int = 1
    score_top: int | None = None  # echo with logprobs: score each prompt, with this many alternatives
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.time)  # wall clock (the response's `created`)
    arrived: float = field(default_factory=time.perf_counter)  # for latencies and deadlines
    deadline: float | None = None  # time.perf_counter() at which the engine expires the job (--request-timeout)
    cancelled: bool = False
    expired: bool = False
    admitted: int = 0  # choices that joined the batch so far (engine thread, under the lock)
    ended: int = 0  # choices that ended (counted in the metrics) so far (engine thread, under the lock)
    finished: int = 0  # choices whose last event the handler has read
    weight_version: int | None = None  # the weights every choice is drawn under (set when the job starts)

    def __post_init__(self):
        self.requests = [
            r if r.key == (self.id, i) else replace(r, key=(self.id, i), index=i) for i, r in enumerate(self.requests)
        ]

    def push(self, item) -> None:
        """From the engine thread: hand an event (StreamEvent, PromptLogprobs) or an Exception to the handler."""
        with contextlib.suppress(RuntimeError):  # the loop is closed (server shutting down)
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


def _prompt_tokens(job: Job, start: int) -> int:
    """The prompt tokens of the job's choices from `start` on, each prompt once (its choices share it)."""
    reqs, n = job.requests, job.per_prompt
    return sum(len(reqs[i].prompt_token_ids) for i in range(start, len(reqs)) if i == start or i % n == 0)


def _client_error(error: Exception) -> Exception:
    """What the handler gets for a choice that failed inside a step: the cause when the request's own parameters
    raised it (a ParamError or ConstraintError: a 400 naming it), else the RowFault (a 500 with a request id: no
    internal text reaches the client)."""
    cause = error.__cause__
    return cause if isinstance(cause, (ParamError, ConstraintError)) else error


def kv_cache_usage(runner, active: bool) -> tuple[float, int]:
    """(fraction of the target cache's allocated slots holding committed tokens, slots allocated). A torch runner's
    RowKVCache holds rows x capacity slots; llama.cpp's context n_ctx cells, `taken` of them written."""
    cache = getattr(runner, "cache", None)
    if cache is not None:
        slots = cache.batch_size * cache.capacity
        return (sum(cache.lengths) / slots if active and slots else 0.0), slots
    cells, taken = getattr(runner, "n_ctx", 0) or 0, getattr(runner, "taken", 0) or 0
    return (taken / cells if active and cells else 0.0), cells


class EngineThread:
    def __init__(
        self,
        gen: SpeculativeGenerator,
        *,
        max_batch: int = 8,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_queue_tokens: int = DEFAULT_MAX_QUEUE_TOKENS,
        metrics=None,
        scorer=None,
    ):
        if max_batch < 1 or max_queue < 0 or max_queue_tokens < 1:
            raise ValueError("max_batch must be >= 1, max_queue >= 0 and max_queue_tokens >= 1")
        self.gen = gen
        self.max_batch = max_batch
        self.max_queue = max_queue  # choices that may wait for a batch row
        self.max_queue_tokens = max_queue_tokens  # prompt tokens the waiting choices may hold
        self.metrics = metrics
        self.scorer = scorer  # prompt logprobs (serve.scoring.PromptScorer), for jobs with score_top
        self.session = GenerationSession(gen.core, max_batch)
        self._cond = threading.Condition()  # (an RLock inside)
        self._inbox: deque[Job | Barrier] = deque()  # submitted, not yet handed to the session (engine thread)
        self._waiting: deque[Job] = deque()  # jobs with choices not yet in the batch
        self._open: dict[str, Job] = {}  # every job with a choice not yet ended (counted), by id
        self._barriers = 0  # updates submitted and not yet run: nothing joins the batch before them
        self._cancel: list[Job] = []
        self._expire: list[Job] = []
        self._score: list[tuple[Job, int, list[int]]] = []  # prompts to score before the next step
        self._jobs: dict[tuple[str, int], Job] = {}  # running row key -> job
        self._last: dict[tuple[str, int], float | None] = {}  # running row key -> when its last tokens came
        self._stop = False
        self._closing = False  # expire_all ran (a shutdown's cut): no job is admitted any more
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)

    # --- called from the asyncio side ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self._fail_barriers(RuntimeError("the server is shutting down"))  # those not started: never run now

    @property
    def num_waiting(self) -> int:
        """Choices not yet in the batch."""
        return sum(len(j.requests) - j.admitted for j in list(self._waiting))

    @property
    def num_running(self) -> int:
        """Choices in the batch."""
        return len(self._jobs)

    def submit(self, job: Job) -> None:
        """Queue the job: TooLarge when it exceeds the whole budget, Closing after expire_all, Overloaded when its
        waiting choices would take the waiting choices past max_queue or their prompt tokens past
        max_queue_tokens (a job that waits alone is let in on tokens: it would never be otherwise)."""
        self._check_size(job)
        with self._cond:
            if self._closing or self._stop:
                raise Closing("the server is shutting down")
            (choices, tokens), (ahead, _) = self._waiting_after(job), self._waiting_after(None)
            if choices > self.max_queue or (tokens > self.max_queue_tokens and ahead):
                raise Overloaded(
                    f"{ahead} choices are waiting for a batch row and this request would add {choices - ahead} "
                    f"(the queue holds {self.max_queue} choices and {self.max_queue_tokens} prompt tokens)"
                )
            self._inbox.append(job)
            self._waiting.append(job)
            self._open[job.id] = job
            self._cond.notify_all()
        self._gauges()

    def between_jobs(self, fn, on_done=None) -> Barrier:
        """Run fn() on the engine thread with the model to itself, once every job submitted before it has finished
        (all its choices); jobs submitted after it wait for it. Returns the Barrier (its `done` event, result or
        error; `on_done(barrier)` runs on the engine thread once it ran)."""
        barrier = Barrier(fn, on_done)
        with self._cond:
            if self._stop:
                raise Closing("the server is shutting down")
            self._inbox.append(barrier)
            self._barriers += 1
            self._cond.notify_all()
        return barrier

    async def run_between_jobs(self, fn):
        """`between_jobs` from the asyncio side: awaits fn's result (its exception raised)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def resolve(b: Barrier) -> None:
            def settle():
                if not future.done():
                    future.set_exception(b.error) if b.error is not None else future.set_result(b.result)

            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(settle)

        self.between_jobs(fn, resolve)
        return await future

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job (its waiting choices and its running rows before the next step)."""
        with self._cond:
            if not (job.cancelled or job.expired):
                job.cancelled = True
                self._cancel.append(job)
                self._unwait(job)
                self._cond.notify_all()
        self._gauges()

    def expire(self, job: Job) -> None:
        """End the job: every unfinished choice gets a last event with finish_reason "abort" and what it has."""
        with self._cond:
            if not (job.cancelled or job.expired):
                job.expired = True
                self._expire.append(job)
                self._unwait(job)
                self._cond.notify_all()
        self._gauges()

    def expire_all(self) -> int:
        """Expire every waiting and running job (a shutdown that ran out of time) and admit none after it;
        returns how many there were."""
        with self._cond:
            self._closing = True
            jobs = self._live()
            for job in jobs:
                self.expire(job)
        return len(jobs)

    # --- bookkeeping (under the lock, or on the engine thread) ---------------------------------------
    def _live(self) -> list[Job]:
        """Under the lock: the jobs not yet ended (waiting, running, or cut short and not yet answered)."""
        return list(self._open.values())

    def _check_size(self, job: Job) -> None:
        """TooLarge for a job no wait would let in: more choices than the batch and the queue hold together, or
        more distinct prompt tokens than the queue holds while its choices cannot all join at once."""
        n, budget = len(job.requests), self.max_batch + self.max_queue
        if n > budget:
            raise TooLarge(
                f"the request has {n} choices (prompts x n); this server holds at most {budget} at once "
                f"(--max-batch {self.max_batch} + --max-queue {self.max_queue}): send it in parts",
                "n",
            )
        tokens = _prompt_tokens(job, 0)
        if n > self.max_batch and tokens > self.max_queue_tokens:
            raise TooLarge(
                f"the request's prompts hold {tokens} tokens; at most {self.max_queue_tokens} may wait for a batch "
                "row (--max-queue-tokens): send it in parts",
                "prompt",
            )

    def _waiting_after(self, new: Job | None) -> tuple[int, int]:
        """Under the lock: (choices, distinct prompt tokens) that would wait for a batch row with `new` submitted
        now, as the session admits (`GenerationSession._take`): first come, first served; a prompt's choices
        together while any row is held, in parts only into an empty batch; nothing while an update waits."""
        free = 0 if self._barriers else self.max_batch - len(self._jobs)
        held, blocked, choices, tokens = len(self._jobs), False, 0, 0
        for job in [*self._waiting, *([new] if new is not None else [])]:
            at = job.admitted
            while not blocked and at < len(job.requests):
                size = min(job.per_prompt - at % job.per_prompt, len(job.requests) - at)
                if free <= 0 or (size > free and held):
                    blocked = True
                    break
                take = min(size, free)
                at, free, held = at + take, free - take, held + take
            choices += len(job.requests) - at
            tokens += _prompt_tokens(job, at)
        return choices, tokens

    def _unwait(self, job: Job) -> None:
        """Under the lock: the job's choices no longer wait (it ended, or all of them joined the batch)."""
        self._waiting = deque(j for j in self._waiting if j is not job)

    def _gauges(self) -> None:
        if self.metrics is not None:
            try:  # a gauge fault must not fail requests
                self.metrics.set_queue(self.num_waiting, self.num_running)
            except Exception:
                log.exception("updating the queue gauges failed")

    def _ended(self, job: Job, reason: str, choices: int = 1) -> None:
        """Under the lock: `choices` more of the job's choices ended (counted once each); the job leaves the books with
        its last."""
        choices = min(choices, len(job.requests) - job.ended)
        job.ended += choices
        if job.ended == len(job.requests):
            self._open.pop(job.id, None)
        if self.metrics is None or not choices:
            return
        try:  # the choices end whatever the metrics do
            self.metrics.observe_end(reason, time.perf_counter() - job.arrived, choices)
        except Exception:
            log.exception("counting an ended request failed")

    def _engine_job(self, job: Job) -> engine_request.Job:
        return engine_request.Job(job.requests, key=job.id, group=job.per_prompt, on_admit=self._admitted(job))

    def _admitted(self, job: Job):
        def on_admit(req: Request) -> None:  # engine thread, inside the session's scheduling
            with self._cond:
                i = req.index
                self._jobs[req.key], self._last[req.key] = job, None
                job.admitted += 1
                job.weight_version = self.gen.core.weight_version
                if job.admitted == len(job.requests):
                    self._unwait(job)
                first = i % job.per_prompt == 0  # the prompt's first choice: its tokens count once, whatever n is
                if self.metrics is not None:
                    self.metrics.observe_admitted(
                        len(req.prompt_token_ids) if first else 0, time.perf_counter() - job.arrived
                    )
                if job.score_top is not None and first:
                    self._score.append((job, i // job.per_prompt, list(req.prompt_token_ids)))

        return on_admit

    def _end(self, job: Job, reason: str, deliver: bool) -> None:
        """Engine thread, under the lock: the job's unfinished choices end now (counted with `reason`); with `deliver`,
        each one's last event ("abort", with what it has) goes to the handler."""
        self._unwait(job)
        events = self.session.abort(job.id)
        for ev in events:
            self._jobs.pop(ev.key, None)
            self._last.pop(ev.key, None)
            if deliver:
                job.push(ev)
        self._ended(job, reason, len(events))

    def _cut(self, job: Job, deliver: bool) -> None:
        """Under the lock: a cancelled (deliver=False) or expired job ends "abort"; a failure doing so fails it."""
        try:
            self._end(job, "abort", deliver)
        except Exception as e:  # e.g. decoding its text: the job ends with an error rather than never
            log.exception("cutting a request short failed")
            self._fail(job, RuntimeError(f"ending the request failed: {e}"))

    def _fail(self, job: Job, error: Exception) -> None:
        """Under the lock: the job ends with an engine error — its rows leave the session, every choice not yet
        ended is counted "error" — and the handler gets `error` whatever else fails."""
        job.cancelled = True
        try:
            self._end(job, "error", deliver=False)
        except Exception:
            log.exception("dropping a failed request's rows failed")
        finally:
            for key in [k for k, j in self._jobs.items() if j is job]:
                self._jobs.pop(key)
                self._last.pop(key, None)
            self._inbox = deque(x for x in self._inbox if x is not job)
            self._unwait(job)
            self._ended(job, "error", len(job.requests))
            job.push(error)

    def _expire_due(self) -> float | None:
        """Under the lock: expire the jobs whose deadline has passed (running or waiting, read by their handler or
        not); seconds until the next deadline (None: no job has one)."""
        now, soonest = time.perf_counter(), None
        for job in self._live():
            if job.deadline is None or job.cancelled or job.expired:
                continue
            left = job.deadline - now
            if left <= 0:
                self.expire(job)
            else:
                soonest = left if soonest is None else min(soonest, left)
        return soonest

    # --- the engine thread ---------------------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._stop or self._inbox or self._cancel or self._expire or not self.session.idle)

    def _run(self) -> None:
        while True:
            try:
                if not self._iteration():
                    return
            except Exception as e:  # a bug outside the step: every job fails (500), the thread serves on
                log.exception("engine loop failed")
                self._fail_all(RuntimeError(f"engine loop failed: {e}"))
                with self._cond:  # no busy loop of failures if it recurs (a stop() wakes it)
                    self._cond.wait(0.05)

    def _iteration(self) -> bool:
        """Wait for work (expiring jobs at their deadlines meanwhile), hand new jobs and updates to the session, cut,
        schedule, score and step; False once stopped."""
        with self._cond:
            self._await_work()
            if self._stop:
                return False
            self._take_inbox()
            for job in self._cancel:
                self._cut(job, deliver=False)
            for job in self._expire:
                self._cut(job, deliver=True)
            self._cancel.clear()
            self._expire.clear()
        self._schedule()
        with self._cond:
            score, self._score = self._score, []
        self._gauges()
        self._prompt_logprobs(score)
        if self.session.rows:
            self._step()
        self._kv()
        return True

    def _take_inbox(self) -> None:
        """Under the lock: submitted jobs and updates into the session's queue, in submission order."""
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, Barrier):
                self.session.barrier(self._counted(item))
            else:  # (a job cancelled or expired meanwhile too: its end is delivered from the session)
                try:
                    self.session.submit(self._engine_job(item))
                except Exception as e:  # checked by the handler already; never let one request kill the loop
                    self._fail(item, e)

    def _counted(self, barrier: Barrier) -> Barrier:
        inner = barrier.on_done

        def on_done(b: Barrier) -> None:
            with self._cond:
                self._barriers -= 1
                self._cond.notify_all()
            if inner is not None:
                inner(b)

        barrier.on_done = on_done
        return barrier

    def _schedule(self) -> None:
        """Admit what the session's queue allows (running updates that are due), outside the lock."""
        try:
            self.session.schedule()
        except Exception as e:  # joining rows failed (a device error): the jobs in the batch fail
            log.exception("admitting requests failed")
            self._reset(RuntimeError(f"admitting the request failed: {e}"))

    def _await_work(self) -> None:
        """Under the lock: wait until there is something to do, expiring jobs at their deadlines meanwhile."""
        while True:
            left = self._expire_due()
            if self._has_work():
                return
            self._cond.wait(left)

    def _reset(self, error: Exception, everything: bool = False) -> None:
        """A fresh session after a failure: the jobs that had started fail with `error` (every job, with
        `everything`); jobs that had not started (cut short meanwhile or not) and pending updates carry over to the
        new session in order, so the next iteration ends or runs them."""
        with self._cond:
            old = self.session
            old.close()  # its prompts being prefilled (their jobs fail below or carry over and start anew)
            self.session = GenerationSession(self.gen.core, self.max_batch)
            for job in self._live():
                if everything or job.admitted:
                    self._fail(job, error)
            for item in old.queue:
                if isinstance(item, Barrier):
                    self.session.barrier(item)
                elif item.job.key in self._open:
                    self.session.submit(item.job)
            self._cond.notify_all()

    def _fail_all(self, error: Exception) -> None:
        """Every waiting and running job ends with `error`, on a fresh session."""
        self._reset(error, everything=True)
        with self._cond:
            self._cancel.clear()
            self._expire.clear()
            self._score.clear()

    def _fail_barriers(self, error: Exception) -> None:
        """Updates that have not started (the server stopped): their waiters get `error` (one that is running, on an
        engine thread that outlived stop()'s wait, finishes on its own)."""
        with self._cond:
            pending = [b for b in [*self._inbox, *self.session.queue] if isinstance(b, Barrier)]
        for b in pending:
            b.cancel(error)

    def _prompt_logprobs(self, todo: list[tuple[Job, int, list[int]]]) -> None:
        """Score the prompts of newly admitted echo-with-logprobs jobs (before their rows' first step)."""
        for job, prompt, ids in todo:
            if job.cancelled or job.expired:
                continue
            try:
                lps, top = self.scorer(ids, job.score_top)
            except Exception as e:
                log.exception("prompt scoring failed")
                with self._cond:
                    self._fail(job, RuntimeError(f"prompt scoring failed: {e}"))
                continue
            job.push(PromptLogprobs(prompt, lps, top))

    def _kv(self) -> None:
        """The KV cache's use, and the queue gauges (rows may have left)."""
        if self.metrics is not None:
            try:  # a gauge fault must not fail the step's requests
                self.metrics.set_kv(*kv_cache_usage(self.gen.runner, bool(self.session.rows)))
            except Exception:
                log.exception("updating the KV-cache gauges failed")
            self._gauges()

    def _step(self) -> None:
        """One engine step; hands each event to its job (a finished choice is counted first)."""
        try:
            events = self.session.run()
        except Exception as e:  # a bug or a device error: fail the running requests, keep serving
            log.exception("engine step failed")
            self._reset(RuntimeError(f"engine step failed: {e}"))
            return
        self._kv()  # before the finished rows are dropped: no moment shows nothing running with KV in use
        with self._cond:
            self._deliver(events)

    def _deliver(self, events: list[StreamEvent]) -> None:
        """Under the lock: a step's metrics, and each event to its job. A failure here (metrics, a decode) fails
        the jobs it concerns: all the step's for the step's metrics, the event's own for an event."""
        try:
            if self.metrics is not None:
                self.metrics.observe_step(self.session.last_step)
        except Exception as e:
            log.exception("recording an engine step failed")
            for job in {id(j): j for j in self._jobs.values()}.values():
                self._fail(job, RuntimeError(f"recording the engine step failed: {e}"))
            return
        now = time.perf_counter()
        for ev in events:
            job = self._jobs.get(ev.key)
            if job is None:
                continue
            try:
                if ev.completion is not None and ev.completion.error is not None:  # this choice failed alone
                    self._jobs.pop(ev.key, None)
                    self._last.pop(ev.key, None)
                    self._fail(job, _client_error(ev.completion.error))
                    continue
                self._observe(ev, job, now)
                if ev.completion is not None:
                    self._jobs.pop(ev.key)
                    self._last.pop(ev.key, None)
                    self._ended(job, ev.completion.finish_reason)
                job.push(ev)
            except Exception as e:
                log.exception("handing a step's output to its request failed")
                self._fail(job, RuntimeError(f"handing the step's output to the request failed: {e}"))

    def _observe(self, ev: StreamEvent, job: Job, now: float) -> None:
        """A row's step output: time to first token or inter-token latency, and its tokens."""
        last = self._last[ev.key]
        if self.metrics is not None and (last is None or ev.token_ids):
            self.metrics.observe_tokens(len(ev.token_ids), last is None, now - (job.arrived if last is None else last))
        self._last[ev.key] = now
