"""The server's engine thread: one `GenerationSession` driven step by step, requests joining and leaving
between steps (continuous batching), a bounded waiting queue, and cancellation.

HTTP handlers run on the asyncio loop; the model runs on this one thread. A handler `submit`s a `Job`
(one request, n choices) and reads its events from `job.events` (an asyncio.Queue fed with
`call_soon_threadsafe`). Admission is bounded: at most `max_batch` rows run, at most `max_queue` jobs
wait; past that `submit` raises `Overloaded` (the handler answers 429). A cancelled job (client gone)
leaves the batch before the next step.

`exclusive()` gives another thread the model between steps (the RL routes' rollouts and weight updates): admission
stops, the running rows finish under the weights they started with, then the body runs alone; waiting requests
join after it.

Every choice is counted in the metrics exactly once, here where it ends: finished (`stop` / `length`, before
its last event reaches the handler), dropped because its client went away (`abort`: while running or still
waiting), or failed by an engine error (`error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..engine.generator import SpeculativeGenerator

__all__ = ["EngineThread", "Job", "Overloaded"]

log = logging.getLogger("verispec.serve")


class Overloaded(Exception):
    """The waiting queue is full."""


@dataclass
class Job:
    """One HTTP request: `choices` holds the keyword arguments of GenerationSession.add per choice."""

    id: str
    choices: list[dict]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.time)
    cancelled: bool = False
    finished: int = 0

    def push(self, item) -> None:
        """From the engine thread: hand an event (StreamEvent) or an Exception to the handler."""
        with contextlib.suppress(RuntimeError):  # the loop is closed (server shutting down)
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class EngineThread:
    def __init__(self, gen: SpeculativeGenerator, *, max_batch: int = 8, max_queue: int = 64, metrics=None):
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        self.gen = gen
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self.session = gen.session()
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._cancel: list[Job] = []
        self._jobs: dict[tuple[str, int], Job] = {}  # row key -> job
        self._stop = False
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
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._jobs)

    def submit(self, job: Job) -> None:
        with self._cond:
            if len(self._waiting) >= self.max_queue:
                raise Overloaded(f"{len(self._waiting)} requests are waiting (the queue holds {self.max_queue})")
            self._waiting.append(job)
            self._cond.notify_all()
        self._gauges()

    def cancel(self, job: Job) -> None:
        with self._cond:
            if not job.cancelled:
                job.cancelled = True
                waiting = [j for j in self._waiting if j is not job]  # identity: a Job compares by fields
                if len(waiting) < len(self._waiting):  # not started: leave the queue now (exclusive() may hold it)
                    self._waiting = deque(waiting)
                    self._dropped(len(job.choices), "abort")
                else:
                    self._cancel.append(job)
                self._cond.notify_all()
        self._gauges()

    # --- the engine thread ---------------------------------------------------------------------------
    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(len(self._waiting), len(self._jobs))

    def _dropped(self, rows: int, reason: str) -> None:
        if self.metrics is not None and rows:
            self.metrics.observe_dropped(rows, reason)

    def _finished(self, job: Job, completion) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(
                len(completion.prompt_token_ids),
                len(completion.token_ids),
                completion.finish_reason,
                time.time() - job.created,
            )

    def _abort(self, job: Job) -> int:
        """Under the lock: take the job's running rows out of the session; returns how many there were."""
        n = 0
        for i in range(len(job.choices)):
            if self._jobs.pop((job.id, i), None) is not None:
                self.session.abort((job.id, i))
                n += 1
        return n

    def _admit(self) -> None:
        """Under the lock: move waiting jobs into the session while rows are free."""
        running = self.session.num_active
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled:
                self._waiting.popleft()
                self._dropped(len(job.choices), "abort")
                continue
            if running and running + len(job.choices) > self.max_batch:
                break
            self._waiting.popleft()
            try:
                for i, kwargs in enumerate(job.choices):
                    self.session.add(**kwargs, key=(job.id, i), index=i)
                    self._jobs[(job.id, i)] = job
                running += len(job.choices)
            except Exception as e:  # validated by the handler already; never let one request kill the loop
                self._abort(job)
                job.push(e)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stop or (self._waiting and not self._holds) or self._cancel or self.session.num_active
                ):
                    self._cond.wait()
                if self._stop:
                    break
                for job in self._cancel:
                    self._dropped(self._abort(job), "abort")
                self._cancel.clear()
                if not self._holds:
                    self._admit()
                self._busy = bool(self.session.num_active)
                self._cond.notify_all()  # an exclusive() waiter sees a session emptied by cancellations
            self._gauges()
            if self._busy:
                try:
                    self._step()
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()

    def _step(self) -> None:
        """One engine step; hands each event to its job (a finished choice is counted first)."""
        try:
            events = self.session.step()
        except Exception as e:  # a bug or a device error: fail the running requests, keep serving
            log.exception("engine step failed")
            for job in {job.id: job for job in self._jobs.values()}.values():  # (a Job is not hashable)
                job.push(RuntimeError(f"engine step failed: {e}"))
            self._dropped(len(self._jobs), "error")
            self._jobs.clear()
            self.session = self.gen.session()
            return
        if self.metrics is not None:
            self.metrics.observe_step(self.session.last_step)
        for ev in events:
            job = self._jobs.get(ev.key)
            if job is None:
                continue
            if ev.completion is not None:
                del self._jobs[ev.key]
                self._finished(job, ev.completion)
            job.push(ev)
