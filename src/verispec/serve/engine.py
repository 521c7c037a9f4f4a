"""The server's engine thread: one `GenerationSession` (the engine's scheduler, and the only books of which jobs wait
and run) driven step by step on this thread, behind a bounded queue (docs/guides/serving.md, "Load, limits and
lifecycle"). A handler `submit`s a `Call` (one HTTP request's `Job` and its asyncio.Queue of events); submissions,
updates and cuts reach the session through an inbox, and the asyncio side reads the books as this thread last published
them (`_publish`). Past `max_queue` waiting choices or `max_queue_tokens` prompt tokens: `Overloaded` (429); a job
larger than the whole budget: `TooLarge` (400); after `expire_all`: `Closing` (503). Weight updates are the session's
barriers (`between_jobs`): every job is drawn under one weight version. A job ends early by `cancel` (its client left:
nobody is told) or by expiring (deadline, shutdown, /abort_request: unfinished choices end "abort"). A fault fails only
what it touched (a `RowFault` its job; a failed step or admission the jobs that had started; anything else every job),
never the thread; every choice is counted once in the metrics, where it ends. A draft=online head (`online`, an
`OnlineKeeper`) trains here when no job runs, a step at a time, and is saved between steps."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

from ..engine.generator import SpeculativeGenerator, StreamEvent
from ..engine.request import Barrier, Job, Request
from ..engine.session import GenerationSession
from ..sampling import ConstraintError, ParamError
from .limits import DEFAULT_MAX_QUEUE, DEFAULT_MAX_QUEUE_TOKENS
from .logs import note_call

__all__ = ["Call", "Closing", "EngineThread", "Overloaded", "PromptLogprobs", "TooLarge", "kv_cache_usage"]
__all__ += ["prompt_tokens"]

log = logging.getLogger("verispec.serve")


class Overloaded(Exception):
    """The waiting queue is full."""


class TooLarge(ValueError):
    """A request no wait would let in: 400 naming `field` (`n`, `prompt`)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class Closing(Exception):
    """The server is shutting down (`expire_all`): it admits no more."""


@dataclass
class PromptLogprobs:
    """Pushed before a prompt's choices' first event (echo with logprobs): its tokens' raw logprobs and alternatives
    (None for the first token; `top` None without alternatives)."""

    prompt: int  # the prompt's index in the request
    logprobs: list[float | None]
    top: list | None


@dataclass(eq=False)
class Call:
    """One HTTP request: its `Job` (request i is choice i % job.group of prompt i // job.group; keyed by the request
    id), `events` on `loop` (StreamEvents, PromptLogprobs, or an Exception that ends the call), and its metrics' needs."""

    job: Job
    loop: asyncio.AbstractEventLoop
    score_top: int | None = None  # echo with logprobs: score each prompt, with this many alternatives
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.time)  # wall clock (the response's `created`)
    arrived: float = field(default_factory=time.perf_counter)  # for latencies and the deadline
    end: str | None = None  # cut short: "cancel" (its client left), "expire", or "error" (it failed)
    ended: int = 0  # choices counted in the metrics (engine thread)
    finished: int = 0  # choices whose last event the handler has read
    tokens: int = 0  # tokens its choices have been given (engine thread; the access log's output_tokens)
    last: dict[int, float] = field(default_factory=dict)  # choice -> when its last tokens came (engine thread)

    def push(self, item) -> None:
        """From the engine thread: hand an event (StreamEvent, PromptLogprobs) or an Exception to the handler."""
        with contextlib.suppress(RuntimeError):  # the loop is closed (server shutting down)
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


def prompt_tokens(job: Job, start: int = 0) -> int:
    """The prompt tokens of the job's choices from `start` on, each prompt once (its choices share it)."""
    reqs, n = job.requests, job.group
    return sum(len(reqs[i].prompt_token_ids) for i in range(start, len(reqs)) if i == start or i % n == 0)


def _client_error(error: Exception) -> Exception:
    """A failed choice's error for its handler: the request's own parameter error (400) if that caused it, else it."""
    cause = error.__cause__
    return cause if isinstance(cause, (ParamError, ConstraintError)) else error


def kv_cache_usage(runner, active: bool) -> tuple[float, int]:
    """(fraction of the target cache's allocated slots holding committed tokens, slots allocated): a torch RowKVCache's
    rows x capacity, or llama.cpp's n_ctx cells (`taken` of them written)."""
    cache = getattr(runner, "cache", None)
    if cache is not None:
        slots = cache.batch_size * cache.capacity
        return (sum(cache.lengths) / slots if active and slots else 0.0), slots
    cells, taken = getattr(runner, "n_ctx", 0) or 0, getattr(runner, "taken", 0) or 0
    return (taken / cells if active and cells else 0.0), cells


class EngineThread:
    """The thread that runs the model (see the module docstring)."""

    def __init__(
        self,
        gen: SpeculativeGenerator,
        *,
        max_batch=8,
        max_queue=DEFAULT_MAX_QUEUE,
        max_queue_tokens=DEFAULT_MAX_QUEUE_TOKENS,
        metrics=None,
        scorer=None,
        online=None,
    ):
        if max_batch < 1 or max_queue < 0 or max_queue_tokens < 1:
            raise ValueError("max_batch must be >= 1, max_queue >= 0 and max_queue_tokens >= 1")
        self.gen, self.metrics, self.scorer = gen, metrics, scorer  # scorer: prompt logprobs (`serve.scoring`)
        self.online = online  # draft=online: idle training and saves (`serve.online.OnlineKeeper`)
        self.max_batch, self.max_queue, self.max_queue_tokens = max_batch, max_queue, max_queue_tokens
        self.session = GenerationSession(gen.core, max_batch)
        self._cond = threading.Condition()  # (an RLock inside) guards what both threads touch: the four below
        self._inbox: deque[Call | Barrier] = deque()  # submitted, not yet handed to the session
        self._cuts: list[Call] = []  # cancelled or expired, not yet cut
        self._books: tuple[int, int, list] = (0, 0, [])  # the session's, as `_publish` last saw them
        self._stop = self._closing = False  # stop(); expire_all() (a shutdown's cut): no job is admitted any more
        self._score: list[tuple[Call, int, list[int]]] = []  # prompts to score before the next step (engine thread)
        self._failed: list[object] = []  # keys of jobs failed while the session called out (engine thread)
        self._outbox: list[tuple[Call, object]] = []  # for the handlers once the books are published (`_sync`)
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)

    # --- called from the asyncio side ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        with self._cond:  # updates not started never run now (one running on a thread that outlived the wait ends)
            pending = [b for b in [*self._inbox, *self.session.queue] if isinstance(b, Barrier)]
        for b in pending:
            b.cancel(RuntimeError("the server is shutting down"))
        if self.online is not None and not self._thread.is_alive():  # the head's last version (no step runs now)
            self.online.save(now=True)

    @property
    def num_waiting(self) -> int:
        """Choices not yet in the batch."""
        with self._cond:
            return sum(len(job.requests) - at for job, at in filter(None, self._queue()))

    @property
    def num_running(self) -> int:
        """Choices admitted and not ended (in the batch or being prefilled)."""
        return self._books[0]

    def submit(self, call: Call) -> None:
        """Queue the call's job: TooLarge, Closing, or Overloaded past max_queue waiting choices or max_queue_tokens
        waiting prompt tokens (a job that waits alone is let in on tokens)."""
        job = call.job
        self._check_size(job)
        with self._cond:
            if self._closing or self._stop:
                raise Closing("the server is shutting down")
            (choices, tokens), (ahead, _) = self._waiting_after(job), self._waiting_after(None)
            if choices > self.max_queue or (tokens > self.max_queue_tokens and ahead):
                why = f"{ahead} choices are waiting for a batch row and this request would add {choices - ahead}"
                raise Overloaded(f"{why} (the queue holds {self.max_queue} choices, {self.max_queue_tokens} tokens)")
            job.on_admit, job.on_event = partial(self._admitted, call), partial(self._event, call)
            self._inbox.append(call)
            self._cond.notify_all()
        note_call(call)  # the HTTP request's access line counts its tokens
        self._gauges()

    def between_jobs(self, fn, on_done=None) -> Barrier:
        """Run fn() on the engine thread once every job submitted before it has finished (later ones wait for it); the
        Barrier (`on_done(barrier)` runs on the engine thread after fn)."""
        barrier = Barrier(fn, on_done)
        with self._cond:
            if self._stop:
                raise Closing("the server is shutting down")
            self._inbox.append(barrier)
            self._cond.notify_all()
        return barrier

    async def run_between_jobs(self, fn):
        """`between_jobs` from the asyncio side: awaits fn's result (its exception raised)."""
        done: Future = Future()  # (its callbacks into a closed loop are logged, never raised on the engine thread)
        self.between_jobs(fn, lambda b: done.set_result(b.result) if b.error is None else done.set_exception(b.error))
        return await asyncio.wrap_future(done)

    def cancel(self, call: Call) -> None:
        """The client went away: drop the job (its waiting choices, and its running rows before the next step)."""
        self._cut(call, "cancel")

    def expire(self, call: Call) -> None:
        """End the job: every unfinished choice gets a last event with finish_reason "abort" and what it has."""
        self._cut(call, "expire")

    def expire_all(self) -> int:
        """Expire every job (a shutdown that ran out of time) and admit none after it; how many there were."""
        with self._cond:
            self._closing = True
            waiting = [x for x in self._inbox if isinstance(x, Call) and x.end is None]
            for call in waiting:
                self.expire(call)
            self._cond.notify_all()  # the engine thread cuts the session's jobs
            return self._books[1] + len(waiting)

    # --- admission (under the lock) -------------------------------------------------------------------
    def _cut(self, call: Call, how: str) -> None:
        with self._cond:
            if call.end is None:
                call.end = how
                self._cuts.append(call)
                self._cond.notify_all()
        self._gauges()

    def _check_size(self, job: Job) -> None:
        """TooLarge for a job no wait would let in (more choices than batch and queue hold, or prompt tokens)."""
        n, budget, tokens = len(job.requests), self.max_batch + self.max_queue, prompt_tokens(job)
        if n > budget:
            limits = f"--max-batch {self.max_batch} + --max-queue {self.max_queue}"
            why = f"the request has {n} choices (prompts x n); this server holds at most {budget} at once ({limits})"
            raise TooLarge(f"{why}: send it in parts", "n")
        if n > self.max_batch and tokens > self.max_queue_tokens:
            why = f"the request's prompts hold {tokens} tokens; at most {self.max_queue_tokens} may wait for a batch"
            raise TooLarge(f"{why} row (--max-queue-tokens): send it in parts", "prompt")

    def _queue(self) -> list[tuple[Job, int] | None]:
        """What waits to join the batch, in order (the published queue, then the inbox): each job not cut short with
        its choices admitted so far, None for an update."""
        cut = {c.job for c in self._cuts}
        inbox = [None if isinstance(x, Barrier) else (x.job, 0) for x in self._inbox]
        return [x for x in [*self._books[2], *inbox] if x is None or x[0] not in cut]

    def _waiting_after(self, new: Job | None) -> tuple[int, int]:
        """(choices, distinct prompt tokens) that would wait for a batch row with `new` submitted now, as the session
        admits: in order, a prompt's choices together while any row is held, nothing behind an update."""
        held = self._books[0]
        free, blocked, choices, tokens = self.max_batch - held, False, 0, 0
        for item in [*self._queue(), *([(new, 0)] if new is not None else [])]:
            if item is None:
                blocked = True
                continue
            job, at = item
            while not blocked and at < len(job.requests):
                size = min(job.group - at % job.group, len(job.requests) - at)
                if free <= 0 or (size > free and held):
                    blocked = True
                    break
                take = min(size, free)
                at, free, held = at + take, free - take, held + take
            choices += len(job.requests) - at
            tokens += prompt_tokens(job, at)
        return choices, tokens

    def _publish(self) -> None:
        """Under the lock, on the engine thread: (choices running, jobs unfinished, queue) for the asyncio side."""
        queue = [None if isinstance(x, Barrier) else (x, x.admitted) for x in self.session.queue]
        self._books = (self.session.num_running, len(self.session.jobs), queue)

    def _quietly(self, what: str, record) -> None:
        """record(metrics), if there are metrics; a fault there is logged and never fails a request."""
        if self.metrics is not None:
            try:
                record(self.metrics)
            except Exception:
                log.exception("%s failed", what)

    def _gauges(self) -> None:
        self._quietly("updating the queue gauges", lambda m: m.set_queue(self.num_waiting, self.num_running))

    # --- the session's callbacks (engine thread) ------------------------------------------------------
    def _admitted(self, call: Call, req: Request) -> None:
        """A choice joined the batch: its queue time, its prompt's tokens (once per prompt), the prompt to score."""
        first = req.index % call.job.group == 0  # the prompt's first choice: its tokens count once, whatever n is
        if self.metrics is not None:
            self.metrics.observe_admitted(len(req.prompt_token_ids) if first else 0, time.perf_counter() - call.arrived)
        if call.score_top is not None and first:
            self._score.append((call, req.index // call.job.group, list(req.prompt_token_ids)))

    def _event(self, call: Call, ev: StreamEvent) -> None:
        """One of the job's events: counted, then handed to the handler (unless cancelled); a failed choice, or a
        failure here, fails the job alone."""
        c = ev.completion
        if call.end == "error":
            return
        try:
            if c is not None and c.error is not None:  # this choice failed (alone inside a step, or its job)
                return self._fail(call, _client_error(c.error))
            call.tokens += len(ev.token_ids)
            if c is None or c.finish_reason != "abort":
                self._observe(call, ev)
            if c is not None:
                self._ended(call, c.finish_reason)
            if call.end != "cancel":
                self._outbox.append((call, ev))
        except Exception as e:
            log.exception("handing a step's output to its request failed")
            self._fail(call, RuntimeError(f"handing the step's output to the request failed: {e}"))

    def _observe(self, call: Call, ev: StreamEvent) -> None:
        """A choice's step output: time to first token or inter-token latency, and its tokens."""
        now, last = time.perf_counter(), call.last.get(ev.index)
        if self.metrics is not None and (last is None or ev.token_ids):
            self.metrics.observe_tokens(len(ev.token_ids), last is None, now - (call.arrived if last is None else last))
        call.last[ev.index] = now

    def _ended(self, call: Call, reason: str, choices: int = 1) -> None:
        """`choices` more of the call's choices ended (each counted once)."""
        choices = min(choices, len(call.job.requests) - call.ended)
        call.ended += choices
        if choices:
            seconds = time.perf_counter() - call.arrived
            self._quietly("counting an ended request", lambda m: m.observe_end(reason, seconds, choices))

    def _fail(self, call: Call, error: Exception, drop: bool = True) -> None:
        """The call fails: its uncounted choices count "error", the handler gets `error`, and (`drop`) its requests
        leave the session once the session's call in progress returns (`_sync`)."""
        if call.end != "error":
            call.end = "error"
            self._ended(call, "error", len(call.job.requests))
            self._outbox.append((call, error))
            if drop:
                self._failed.append(call.job.key)

    def _sync(self) -> None:
        """After the session called out: failed calls' requests leave it, the books are published, and only then do
        the handlers get what the callbacks gave them (one that hears its request ended finds its rows free)."""
        while self._failed:
            self.session.abort(self._failed.pop())
        with self._cond:
            self._publish()
        outbox, self._outbox = self._outbox, []
        for call, item in outbox:
            call.push(item)

    # --- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:  # a bug outside the step fails every job (500), and the thread serves on
            if not self._guarded("the engine loop", self._iteration, everything=True):
                with self._cond:  # no busy loop of failures if it recurs (a stop() wakes it)
                    self._cond.wait(0.05)

    def _guarded(self, what: str, fn, everything: bool = False) -> bool:
        """fn(), or after its failure `_reset` (the jobs that had started fail; every job with `everything`): False."""
        try:
            fn()
            return True
        except Exception as e:
            log.exception("%s failed", what)
            self._reset(RuntimeError(f"{what} failed: {e}"), everything)
            return False

    def _iteration(self) -> None:
        """Wait for work, hand it to the session, schedule, score and step (nothing once stopped); with no job, one
        step of the online head's training or its save, when due."""
        with self._cond:
            while not (self._stop or self._busy() or self._online_due()):
                self._cond.wait(None if self.online is None else self.online.due())
            if self._stop:
                return
            busy = self._busy()
            if busy:
                self._take_inbox()
        if not busy:
            return self._online_work()
        self._guarded("admitting the request", self.session.schedule)  # a device error: the started jobs fail
        self._sync()
        self._prompt_logprobs()
        if self.session.rows:
            self._step()
        self._kv()
        if self.online is not None:
            self.online.save()

    def _busy(self) -> bool:
        """Under the lock: submissions or cuts to take, or jobs in the session."""
        return bool(self._inbox or self._cuts or not self.session.idle)

    def _online_due(self) -> bool:
        """Under the lock, with no job: the online head has idle training to do, or a save due."""
        return self.online is not None and (self.online.idle_work() or self.online.due() == 0)

    def _online_work(self) -> None:
        """No job: one idle training step of the online head, or its save (each logs its own failure)."""
        if self.online.idle_work():
            self.online.idle_step()
        self.online.save()

    def _take_inbox(self) -> None:
        """Under the lock: submissions into the session in order, then the cuts (after expire_all: every job) and the
        deadlines."""
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, Barrier):
                self.session.barrier(item)
                continue
            try:
                self.session.submit(item.job)
            except Exception as e:  # checked by the handler already; never let one request kill the loop
                self._fail(item, e, drop=False)
        cuts = [j.key for j in self.session.jobs] if self._closing else [c.job.key for c in self._cuts]
        self._cuts.clear()
        if cuts:
            self.session.abort(*cuts)  # (the cancelled ones' handlers are not told: `_event`)
        self.session.expire()
        self._sync()

    def _prompt_logprobs(self) -> None:
        """Score the prompts of newly admitted echo-with-logprobs jobs (before their rows' first step)."""
        todo, self._score = self._score, []
        for call, prompt, ids in todo:
            if call.end is not None:
                continue
            try:
                lps, top = self.scorer(ids, call.score_top)
            except Exception as e:
                log.exception("prompt scoring failed")
                self._fail(call, RuntimeError(f"prompt scoring failed: {e}"))
                self._sync()
                continue
            call.push(PromptLogprobs(prompt, lps, top))

    def _step(self) -> None:
        """One engine step (its events reach their jobs through `_event`), then its metrics (a failure there fails the
        step's jobs)."""
        keys = {self.session.job(r.key).key for r in self.session.rows}
        if not self._guarded("the engine step", self.session.run):  # a bug or a device error: the running jobs fail
            return
        try:
            if self.metrics is not None:
                self.metrics.observe_step(self.session.last_step)
        except Exception as e:
            log.exception("recording an engine step failed")
            self.session.abort(*keys, error=RuntimeError(f"recording the engine step failed: {e}"))
        self._sync()

    def _reset(self, error: Exception, everything: bool = False) -> None:
        """After a failure: the jobs that had started (every job, with `everything`) fail with `error`, and a fresh
        session takes the rest of the queue (jobs, updates) in order."""
        old, self.session = self.session, GenerationSession(self.gen.core, self.max_batch)
        old.reset(error, everything)
        self._failed.clear()  # (gone with the old session)
        for item in old.queue:
            self.session.barrier(item) if isinstance(item, Barrier) else self.session.submit(item)
        self._sync()

    def _kv(self) -> None:
        """The KV cache's use, and the queue gauges."""
        active = bool(self.session.rows)
        self._quietly("updating the KV-cache gauges", lambda m: m.set_kv(*kv_cache_usage(self.gen.core.runner, active)))
        self._gauges()
