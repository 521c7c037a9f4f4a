"""The server's engine thread: one `GenerationSession` driven step by step, requests joining and leaving
between steps (continuous batching), a bounded waiting queue, cancellation and early ends.

HTTP handlers run on the asyncio loop; the model runs on this one thread. A handler `submit`s a `Job`
(one request: its prompts' choices, prompt-major) and reads its events from `job.events` (an asyncio.Queue fed
with `call_soon_threadsafe`). Admission is bounded: at most `max_batch` rows run (a job's choices join as rows free
up, so a request with more choices than that runs in parts), at most `max_queue` jobs wait that cannot join the
batch now (0: none; a job joins if a row is free for it); past that `submit` raises `Overloaded` (the handler
answers 429). After `expire_all` (a shutdown's cut) `submit` raises `Closing` (503).

A job ends early in two ways. `cancel` (its client went away): its rows leave the batch before the next step and
nobody is told. `expire` (its `deadline`, --request-timeout, passed: the engine thread expires it itself, whether
or not its handler reads its events; or a shutdown past --shutdown-timeout): its unfinished choices end at once
with finish_reason "abort", each with the text and tokens it has so far, and the handler answers with them.

A fault on the engine thread never stops it: a failed step fails the running jobs, a failure handing a step's
output to a job (metrics, decoding) fails that job, and anything else fails every job; each gets an Exception
event (the handler answers 500) and the thread serves on.

`exclusive()` gives another thread the model between steps (the RL routes' rollouts and weight updates): admission
stops, the running rows finish under the weights they started with, then the body runs alone; waiting requests
join after it.

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
from dataclasses import dataclass, field

from ..engine.generator import Completion, SpeculativeGenerator, StreamEvent
from ..engine.stats import SpecStats

__all__ = ["Closing", "EngineThread", "Job", "Overloaded", "PromptLogprobs", "kv_cache_usage"]

log = logging.getLogger("verispec.serve")


class Overloaded(Exception):
    """The waiting queue is full."""


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


@dataclass
class Job:
    """One HTTP request: `choices` holds the keyword arguments of GenerationSession.add per choice (plus
    `stop_token_ids`), prompt-major: choice i is choice i % per_prompt of prompt i // per_prompt."""

    id: str
    choices: list[dict]
    loop: asyncio.AbstractEventLoop
    per_prompt: int = 1
    score_top: int | None = None  # echo with logprobs: score each prompt, with this many alternatives
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.time)  # wall clock (the response's `created`)
    arrived: float = field(default_factory=time.perf_counter)  # for latencies and deadlines
    deadline: float | None = None  # time.perf_counter() at which the engine expires the job (--request-timeout)
    cancelled: bool = False
    expired: bool = False
    admitted: int = 0  # choices handed to the session so far (engine thread, under the lock)
    finished: int = 0  # choices whose last event the handler has read

    def push(self, item) -> None:
        """From the engine thread: hand an event (StreamEvent, PromptLogprobs) or an Exception to the handler."""
        with contextlib.suppress(RuntimeError):  # the loop is closed (server shutting down)
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


def kv_cache_usage(runner, active: bool) -> tuple[float, int]:
    """(fraction of the target cache's allocated slots holding committed tokens, slots allocated). A torch runner's
    RowKVCache holds rows x capacity slots; llama.cpp's context n_ctx cells, `taken` of them written."""
    cache = getattr(runner, "cache", None)
    if cache is not None:
        slots = cache.batch_size * cache.capacity
        return (sum(cache.lengths) / slots if active and slots else 0.0), slots
    cells, taken = getattr(runner, "n_ctx", 0) or 0, getattr(runner, "taken", 0) or 0
    return (taken / cells if active and cells else 0.0), cells


def aborted(job: Job, i: int) -> StreamEvent:
    """The last event of choice i of a job that ends before the choice joined the batch."""
    key = (job.id, i)
    c = Completion(
        index=i,
        prompt_token_ids=list(job.choices[i]["prompt"]),
        token_ids=[],
        text="",
        finish_reason="abort",
        stop_reason=None,
        logprobs=[],
        raw_logprobs=[],
        stats=SpecStats(),
        top_logprobs=[] if job.choices[i].get("top_logprobs") else None,
        key=key,
    )
    return StreamEvent(i, "", [], completion=c, key=key)


class EngineThread:
    def __init__(
        self, gen: SpeculativeGenerator, *, max_batch: int = 8, max_queue: int = 64, metrics=None, scorer=None
    ):
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        self.gen = gen
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self.scorer = scorer  # prompt logprobs (serve.scoring.PromptScorer), for jobs with score_top
        self.session = gen.session()
        self._cond = threading.Condition()  # (an RLock inside)
        self._waiting: deque[Job] = deque()
        self._cancel: list[Job] = []
        self._expire: list[Job] = []
        self._score: list[tuple[Job, int, list[int]]] = []  # prompts to score before the next step
        self._jobs: dict[tuple[str, int], Job] = {}  # running row key -> job
        self._last: dict[tuple[str, int], float | None] = {}  # running row key -> when its last tokens came
        self._stop = False
        self._closing = False  # expire_all ran (a shutdown's cut): no job is admitted any more
        self._holds = 0  # exclusive() sections waiting or running: no admission meanwhile
        self._busy = False  # a step is running (outside the lock)
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)

    # --- called from the asyncio side ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    @contextlib.contextmanager
    def exclusive(self):
        """Run the body with the model to itself (from any thread but the engine's): no new request is admitted,
        the running ones finish first, and waiting ones are admitted after the body."""
        with self._cond:
            self._holds += 1
            while (self._busy or self.session.num_active) and not self._stop:
                self._cond.wait()
            if self._stop:
                self._holds -= 1
                raise RuntimeError("the server is shutting down")
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    @property
    def num_waiting(self) -> int:
        """Choices not yet in the batch."""
        return sum(len(j.choices) - j.admitted for j in list(self._waiting))

    @property
    def num_running(self) -> int:
        """Choices in the batch."""
        return len(self._jobs)

    def submit(self, job: Job) -> None:
        """Queue the job: Closing after expire_all, Overloaded when it would wait behind max_queue waiting jobs."""
        with self._cond:
            if self._closing:
                raise Closing("the server is shutting down")
            blocked = self._blocked()
            if blocked is not None and blocked >= self.max_queue:
                raise Overloaded(f"{blocked} requests are waiting for a batch slot (the queue holds {self.max_queue})")
            self._waiting.append(job)
            self._cond.notify_all()
        self._gauges()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job (its waiting choices now, its running rows before the next step)."""
        with self._cond:
            if not job.cancelled:
                job.cancelled = True
                self._unqueue(job, "abort", answer=False)
                if job.admitted:
                    self._cancel.append(job)
                self._cond.notify_all()
        self._gauges()

    def expire(self, job: Job) -> None:
        """End the job now: every unfinished choice gets a last event with finish_reason "abort" and what it has."""
        with self._cond:
            if not (job.cancelled or job.expired):
                job.expired = True
                self._unqueue(job, "abort", answer=True)
                if job.admitted:
                    self._expire.append(job)
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
        """Under the lock: the waiting and running jobs, each once (a Job compares by fields, and is not hashable)."""
        return list({id(j): j for j in [*self._waiting, *self._jobs.values()]}.values())

    def _blocked(self) -> int | None:
        """Under the lock: how many waiting jobs cannot join the batch now (first come, first served: the rows free
        go to the jobs ahead), or None when a job submitted now would join at once (a row is left for it)."""
        free = 0 if self._holds else self.max_batch - len(self._jobs)
        blocked = 0
        for job in self._waiting:
            if free > 0:
                free -= len(job.choices) - job.admitted
            else:
                blocked += 1
        return None if free > 0 else blocked

    def _gauges(self) -> None:
        if self.metrics is not None:
            try:  # a gauge fault must not fail requests
                self.metrics.set_queue(self.num_waiting, self.num_running)
            except Exception:
                log.exception("updating the queue gauges failed")

    def _ended(self, job: Job, reason: str, choices: int = 1) -> None:
        if self.metrics is None or not choices:
            return
        try:  # the choices end whatever the metrics do
            self.metrics.observe_end(reason, time.perf_counter() - job.arrived, choices)
        except Exception:
            log.exception("counting an ended request failed")

    def _unqueue(self, job: Job, reason: str, answer: bool) -> None:
        """Under the lock: take the job out of the queue; its choices not yet admitted end with `reason` (and, with
        `answer`, a last event each)."""
        rest = deque(j for j in self._waiting if j is not job)  # identity: a Job compares by fields
        if len(rest) == len(self._waiting):
            return
        self._waiting = rest
        self._ended(job, reason, len(job.choices) - job.admitted)
        if answer:
            for i in range(job.admitted, len(job.choices)):
                job.push(aborted(job, i))

    def _rows(self, job: Job) -> list[tuple[str, int]]:
        return [(job.id, i) for i in range(job.admitted) if (job.id, i) in self._jobs]

    def _drop(self, key: tuple[str, int], reason: str) -> Job:
        """A running row ends (counted once); its job."""
        job = self._jobs.pop(key)
        self._last.pop(key, None)
        self._ended(job, reason)
        return job

    def _cut(self, job: Job, deliver: bool) -> None:
        """Engine thread, under the lock: the job's running rows leave the session before the next step; with
        `deliver`, each first ends "abort" with what it has and its last event goes to the handler."""
        try:
            by_key = {r.key: r for r in (*self.session.rows, *self.session.pending)} if deliver else {}
            for key in self._rows(job):
                self._drop(key, "abort")
                self.session.abort(key)
                row = by_key.get(key)
                if row is not None:
                    row.finish("abort", None)
                    job.push(row.event(self.gen.tokenizer, len(row.tokens)))
                elif deliver:
                    job.push(aborted(job, key[1]))
        except Exception as e:  # e.g. decoding its text: the job ends with an error rather than never
            log.exception("cutting a request short failed")
            self._fail(job, RuntimeError(f"ending the request failed: {e}"))

    def _fail(self, job: Job, error: Exception) -> None:
        """Under the lock: the job ends with an engine error (its running rows and its waiting choices); the
        handler gets `error` whatever else fails."""
        try:
            for key in self._rows(job):
                self._drop(key, "error")
                self.session.abort(key)
            job.cancelled = True
            self._unqueue(job, "error", answer=False)
        finally:
            job.push(error)

    def _add(self, job: Job, i: int) -> None:
        """Under the lock: choice i of the job joins the session."""
        kwargs = dict(job.choices[i])
        stop_ids = kwargs.pop("stop_token_ids", ())
        key = (job.id, i)
        self.session.add(**kwargs, key=key, index=i)
        if stop_ids:  # GenerationSession.add has no such option: the row it just queued takes them
            self.session.pending[-1].stop_token_ids = frozenset(stop_ids)
        self._jobs[key], self._last[key] = job, None
        job.admitted = i + 1
        first = i % job.per_prompt == 0  # the prompt's first choice: its tokens count once, whatever n is
        if self.metrics is not None:
            self.metrics.observe_admitted(len(kwargs["prompt"]) if first else 0, time.perf_counter() - job.arrived)
        if job.score_top is not None and first:
            self._score.append((job, i // job.per_prompt, list(kwargs["prompt"])))

    def _admit(self) -> None:
        """Under the lock: move waiting choices into the session while rows are free (first come, first served)."""
        free = self.max_batch - self.session.num_active
        while self._waiting and free > 0:
            job = self._waiting[0]
            take = min(free, len(job.choices) - job.admitted)
            try:
                for i in range(job.admitted, job.admitted + take):
                    self._add(job, i)
            except Exception as e:  # validated by the handler already; never let one request kill the loop
                self._fail(job, e)
                continue
            free -= take
            if job.admitted == len(job.choices):
                self._waiting.popleft()

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
        waiting = self._waiting and not self._holds
        return bool(self._stop or waiting or self._cancel or self._expire or self.session.num_active)

    def _run(self) -> None:
        while True:
            try:
                if not self._iteration():
                    return
            except Exception as e:  # a bug outside the step: every job fails (500), the thread serves on
                log.exception("engine loop failed")
                self._fail_all(RuntimeError(f"engine loop failed: {e}"))
                time.sleep(0.05)  # no busy loop of failures if it recurs

    def _iteration(self) -> bool:
        """Wait for work (expiring jobs at their deadlines meanwhile), cut, admit, score and step; False once
        stopped."""
        with self._cond:
            self._await_work()
            if self._stop:
                return False
            for job in self._cancel:
                self._cut(job, deliver=False)
            for job in self._expire:
                self._cut(job, deliver=True)
            self._cancel.clear()
            self._expire.clear()
            if not self._holds:
                self._admit()
            score, self._score = self._score, []
            self._busy = bool(self.session.num_active)
            self._cond.notify_all()  # an exclusive() waiter sees a session emptied by cancellations
        self._gauges()
        self._prompt_logprobs(score)
        if self._busy:
            try:
                self._step()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        self._kv()
        return True

    def _await_work(self) -> None:
        """Under the lock: wait until there is something to do, expiring jobs at their deadlines meanwhile (a job
        waiting behind an exclusive() section too)."""
        while True:
            left = self._expire_due()
            if self._has_work():
                return
            self._cond.wait(left)

    def _fail_all(self, error: Exception) -> None:
        """Every waiting and running job ends with `error`, on a fresh session."""
        with self._cond:
            for job in self._live():
                try:
                    self._fail(job, error)
                except Exception:  # _fail has pushed the error to the job's handler
                    log.exception("failing a request failed")
            self._jobs.clear()
            self._last.clear()
            self._waiting.clear()
            self._cancel.clear()
            self._expire.clear()
            self._score.clear()
            self.session = self.gen.session()
            self._busy = False
            self._cond.notify_all()

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
            events = self.session.step()
        except Exception as e:  # a bug or a device error: fail the running requests, keep serving
            log.exception("engine step failed")
            with self._cond:
                for job in self._live():
                    if self._rows(job):
                        self._fail(job, RuntimeError(f"engine step failed: {e}"))
                self.session = self.gen.session()
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
            for job in self._live():
                if self._rows(job):
                    self._fail(job, RuntimeError(f"recording the engine step failed: {e}"))
            return
        now = time.perf_counter()
        for ev in events:
            job = self._jobs.get(ev.key)
            if job is None:
                continue
            try:
                self._observe(ev, job, now)
                if ev.completion is not None:
                    self._drop(ev.key, ev.completion.finish_reason)
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
