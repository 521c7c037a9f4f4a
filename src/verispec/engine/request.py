"""What the engine is asked to do: a `Request` (one sequence to generate: token ids in, typed options) and a `Job`
(the requests of one call — an HTTP request's choices, a rollout batch — that run under one weight version), and
`Barrier`, work that needs the model to itself between jobs (a weight update).

A Request checks what needs no model itself; `EngineCore.check` the rest, once (`EngineCore.request` builds checked
ones; a session checks on submit only those its core has not)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..sampling import SamplingParams
from .rows import StreamEvent

__all__ = ["Barrier", "Job", "Request", "check_limits"]


def check_limits(max_new_tokens, stop) -> tuple[int, tuple[str, ...]]:
    """Validate a request's budget and stop strings (a single string is one stop string; None: none)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, Sequence):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if any(not isinstance(s, str) or s == "" for s in stop):
        raise ValueError("stop strings must be non-empty strings")
    return max_new_tokens, tuple(stop)


@dataclass(frozen=True)
class Request:
    """One sequence to generate. `key` is the caller's handle (events and completions carry it; `abort` takes it),
    unique among a session's live requests; `index` is its position in its job (`Completion.index`)."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    stop_token_ids: frozenset[int] = frozenset()  # end the request like EOS (even with ignore_eos), not returned
    ignore_eos: bool = False
    gamma: int | None = None  # this request's draft length (0: no speculation); None: the engine's choice
    top_logprobs: int = 0  # best alternatives (raw target logprobs) to return per position, 0..20
    key: object = field(default_factory=object)
    index: int = 0
    checked: object = field(default=None, init=False, repr=False, compare=False)  # the EngineCore that checked it

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError("a request's prompt has no tokens")
        _, stop = check_limits(self.max_new_tokens, self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        k = self.top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20:
            raise ValueError(f"top_logprobs must be an integer in [0, 20], got {k!r}")
        if self.params.constraint is not None and (self.stop or self.ignore_eos):
            raise ValueError(
                f"a structured-output constraint ends the output where its grammar does: "
                f"{'stop strings' if self.stop else 'ignore_eos'} cannot be combined with it (a stop string could "
                "cut the structure short, ignore_eos would run past its end)"
            )

    def keyed(self, key: object) -> Request:
        """The same request under another key (checked still, by the core that checked it)."""
        out = replace(self, key=key)
        object.__setattr__(out, "checked", self.checked)
        return out


@dataclass(eq=False)
class Job:
    """Requests that run under one weight version: the session starts no weight update (no `Barrier`) while any of
    them is unfinished, and starts none of them before an update submitted ahead of the job. `group`: consecutive
    runs of this many requests share a prompt (n samples of it) and join the batch together, so the prompt is
    prefilled once (a group larger than the batch joins in parts). On the session's thread and never calling into it,
    `on_admit(request)` runs as each request joins the batch, `on_event(event)` for every event of its requests (a
    step's, an abort's) once the session's books are up to date. `deadline`: a time.perf_counter() time from which
    `GenerationSession.expire` aborts it. The session's books on it: `weight_version` (set when it starts),
    `admitted` (requests that joined the batch), `open` (requests not ended)."""

    requests: list[Request]
    key: object = field(default_factory=object)
    group: int = 1
    on_admit: Callable[[Request], None] | None = None
    on_event: Callable[[StreamEvent], None] | None = None
    deadline: float | None = None
    weight_version: int | None = field(default=None, init=False)
    admitted: int = field(default=0, init=False)
    open: int = field(default=0, init=False)

    def __post_init__(self):
        if not self.requests:
            raise ValueError("a job has at least one request")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"group must be an integer >= 1, got {self.group!r}")
        if len({r.key for r in self.requests}) != len(self.requests):
            raise ValueError("the requests of a job need distinct keys")


@dataclass(eq=False)
class Barrier:
    """Work that runs with the model to itself, between jobs: after every job submitted before it has finished, and
    before any job submitted after it starts (`GenerationSession.barrier`). `run()` happens on the session's
    thread; its return value or exception is kept, `done` is set, then `on_done(barrier)` is called."""

    fn: Callable[[], object]
    on_done: Callable[[Barrier], None] | None = None
    result: object = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _claim: threading.Lock = field(default_factory=threading.Lock)  # held by the first run() or cancel(), for good

    def run(self) -> None:
        """Run fn (once: a barrier run or cancelled before does nothing)."""
        if not self._claim.acquire(blocking=False):
            return
        try:
            self.result = self.fn()
        except Exception as e:  # handed to whoever waits for it; the session serves on
            self.error = e
        self._finish()

    def cancel(self, error: BaseException) -> None:
        """End it with `error` unless it has started (its fn then never runs)."""
        if self._claim.acquire(blocking=False):
            self.error = error
            self._finish()

    def _finish(self) -> None:
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)

    def wait(self, timeout: float | None = None) -> object:
        """Block until it ran (from another thread than the session's); its result, or its exception raised."""
        if not self.done.wait(timeout):
            raise TimeoutError("the barrier has not run yet")
        if self.error is not None:
            raise self.error
        return self.result
