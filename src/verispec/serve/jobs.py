"""What the completions and chat handlers share: the served model (`Served`: checks a request against the
model and its context, builds its choices, submits them) and one submitted request (`Run`: its engine
events, collected for a plain answer or streamed as server-sent events, cancelled when the client goes away
(watched every 0.5 s, however fast the events come), expired by the engine thread at --request-timeout: its
unfinished choices then end with finish_reason "abort" and what they have)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from ..engine.generator import Completion, SpeculativeGenerator, StreamEvent
from ..engine.request import Request as EngineRequest
from ..sampling import ConstraintError, SamplingParams
from .engine import Closing, EngineThread, Job, Overloaded, PromptLogprobs, TooLarge
from .errors import APIError, internal_error
from .metrics import Metrics
from .protocol import Speculation, Usage
from .scoring import PromptScorer
from .structured import Asked, request_constraint
from .token_options import check_token_options, token_options

__all__ = ["Run", "Served", "usage"]

_REQUEST_TIMEOUT = object()  # `Served.enqueue`'s default deadline: --request-timeout

_POLL_S = 0.5  # how often a request's client is checked for having gone away
_GONE = object()  # put on a job's events once its client has gone away: the handler stops waiting


@dataclass
class Served:
    """The model this server serves, and the engine that runs it."""

    gen: SpeculativeGenerator
    engine: EngineThread
    metrics: Metrics
    model_id: str
    aliases: frozenset[str] = field(default_factory=frozenset)  # other names a request may use for the model
    retry_after_s: int = 1
    max_model_len: int | None = None  # --max-model-len: below the model's own context
    request_timeout: float | None = None  # --request-timeout: seconds from a request's arrival to its end
    rollout_timeout: float | None = None  # the same for /generate/ (only when set: a cut rollout trains on a stub)
    scorer: PromptScorer | None = None  # prompt logprobs (completions' echo with logprobs); None: the engine's

    def __post_init__(self) -> None:
        """One scorer for the handlers' checks and the engine's scoring: the one given, else the engine's, else a
        new one (it loads nothing until it first scores)."""
        if self.scorer is None:
            self.scorer = self.engine.scorer if self.engine.scorer is not None else PromptScorer(self.gen)
        if self.engine.scorer is None:
            self.engine.scorer = self.scorer

    @property
    def context(self) -> int | None:
        """The most tokens a request may hold, prompt and completion together."""
        own = self.gen.max_positions
        if self.max_model_len is None:
            return own
        return self.max_model_len if own is None else min(own, self.max_model_len)

    def decode(self, ids: Sequence[int]) -> str:
        """Text as the engine decodes a completion (special tokens skipped)."""
        return self.gen.tokenizer.decode(list(ids), skip_special_tokens=True)

    def piece(self, token: int) -> str:
        """One token's own text (logprobs' `token` fields)."""
        return self.gen.tokenizer.decode([token])

    def namer(self, as_ids: bool) -> Callable[[int], str]:
        """How logprobs name a token: its text, or "token_id:N" (the request's return_tokens_as_token_ids)."""
        return (lambda t: f"token_id:{t}") if as_ids else self.piece

    def check_model(self, model: str) -> None:
        if model != self.model_id and model not in self.aliases:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{self.model_id}`)",
                "model",
                code="model_not_found",
            )

    def max_new_tokens(self, prompt_tokens: int, max_tokens: int | None, prompt_field: str) -> int:
        """The request's token budget: max_tokens, or the rest of the context; 400 when it does not fit."""
        context = self.context
        limit = f"This model's maximum context length is {context} tokens"
        if context is not None and prompt_tokens >= context:
            raise APIError(400, f"{limit}; the prompt has {prompt_tokens} tokens", prompt_field)
        if max_tokens is None:
            return (context - prompt_tokens) if context is not None else 256
        if context is not None and prompt_tokens + max_tokens > context:
            raise APIError(
                400,
                f"{limit}; the request asks for {prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, "
                f"{max_tokens} in the completion): shorten the prompt or lower max_tokens",
                "max_tokens",
            )
        return max_tokens

    def stop_token_ids(self, req) -> list[int]:
        ids = list(req.stop_token_ids or [])
        bad = [t for t in ids if not 0 <= t < self.gen.vocab_size]
        if bad:
            raise APIError(
                400, f"stop_token_ids must lie in [0, {self.gen.vocab_size}), got {bad[:3]}", "stop_token_ids"
            )
        return ids

    def constraint(self, req, stop: list[str]) -> Asked | None:
        """The request's structured-output constraint (`serve.structured`), compiled for the served tokenizer (in
        the caller's worker thread; compilations are cached): 400 naming the field when it does not compile, and
        naming `stop` / `ignore_eos` beside it (the engine refuses both with a constraint)."""
        asked = request_constraint(req)
        if asked is None:
            return None
        why = "the output ends where the constraint's grammar is complete"
        if stop:
            raise APIError(
                400, f"stop strings cannot be combined with {asked.field}: {why}, and a stop string could cut it short",
                "stop",
            )  # fmt: skip
        if req.ignore_eos:
            raise APIError(400, f"ignore_eos cannot be combined with {asked.field}: {why}", "ignore_eos")
        try:
            self.gen.core.grammars.compile(asked.constraint)
        except ConstraintError as e:
            raise APIError(400, f"{asked.field}: {e}", asked.field) from None
        return asked

    def params(self, req, asked: Asked | None = None) -> SamplingParams:
        """The request's SamplingParams (seed: none; `choices` gives each choice its own), with its constraint."""
        options = token_options(req, self.gen.tokenizer)  # logit_bias, allowed_token_ids, bad_words (tokenized)
        try:
            params = SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                seed=req.seed,
                constraint=None if asked is None else asked.constraint,
                **options,
            )
        except ValueError as e:
            raise APIError.bad_value(e) from None
        check_token_options(params, self.gen.vocab_size)
        return params

    def choices(
        self, req, prompts: list[list[int]], max_tokens: int | None, top_n: int, prompt_field: str
    ) -> list[EngineRequest]:
        """The request's choices as engine Requests, prompt-major: prompt p's choice j is choice p * n + j and uses
        seed + j (a list of prompts samples as the same requests sent one by one)."""
        self.check_model(req.model)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s == "" for s in stop):
            raise APIError(400, "stop strings must be non-empty", "stop")
        stop_ids = self.stop_token_ids(req)
        asked = self.constraint(req, stop)  # compiled once, whatever n is
        base = self.params(req, asked)  # bad words tokenized once, whatever n is
        params = [base if req.seed is None else replace(base, seed=req.seed + j) for j in range(req.n)]
        out = []
        for p, ids in enumerate(prompts):
            field_ = prompt_field if len(prompts) == 1 else f"{prompt_field}[{p}]"
            max_new = self.max_new_tokens(len(ids), max_tokens, field_)
            for j in range(req.n):
                try:
                    out.append(
                        self.gen.core.request(
                            ids,
                            params[j],
                            max_new_tokens=max_new,
                            stop=stop,
                            stop_token_ids=stop_ids,
                            ignore_eos=req.ignore_eos,
                            gamma=req.num_speculative_tokens,
                            top_logprobs=top_n,
                            index=len(out),
                        )
                    )
                except ConstraintError as e:  # (compiled above: cached) named by the field that asked for it
                    field_ = asked.field if asked is not None else None
                    raise APIError(400, f"{field_}: {e}" if field_ else str(e), field_) from None
                except ValueError as e:
                    raise APIError.bad_value(e) from None
        return out

    async def submit(
        self,
        req,
        request: Request,
        prompts: list[list[int]],
        max_tokens: int | None,
        top_n: int,
        prompt_field: str,
        score_top: int | None = None,
    ) -> Run:
        """Validate the request against the model, queue it (429 when the queue is full, 503 once a shutdown has
        cut the requests short) and return its Run. score_top: score the prompts too (echo with logprobs), with
        this many alternatives per token. The checks (bad words are tokenized) run in a worker thread, never on
        the event loop."""
        requests = await asyncio.to_thread(self.choices, req, prompts, max_tokens, top_n, prompt_field)
        job = Job(
            id=uuid.uuid4().hex,
            requests=requests,
            loop=asyncio.get_running_loop(),
            per_prompt=req.n,
            score_top=score_top,
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return self.enqueue(job, request, [len(p) for p in prompts], req.stream, include_usage, prompt_field)

    def enqueue(
        self,
        job: Job,
        request: Request,
        prompt_tokens: list[int],
        stream: bool = False,
        include_usage: bool = False,
        prompt_field: str = "prompt",
        timeout: float | object | None = _REQUEST_TIMEOUT,
    ) -> Run:
        """Queue a job with its deadline (`timeout` seconds, None: none; by default --request-timeout); 400 when it
        exceeds the whole queue (naming `prompt_field` or `n`), 429 when the queue is full, 503 once a shutdown has
        cut the requests short. Its Run."""
        timeout = self.request_timeout if timeout is _REQUEST_TIMEOUT else timeout
        if timeout is not None:
            job.deadline = job.arrived + timeout  # the engine thread expires the job there
        retry = {"Retry-After": str(self.retry_after_s)}
        try:
            self.engine.submit(job)
        except TooLarge as e:
            raise APIError(400, str(e), prompt_field if e.field == "prompt" else e.field) from None
        except Overloaded as e:
            self.metrics.rejected.inc()
            raise APIError(
                429, f"server overloaded: {e}; retry later", kind="rate_limit_error", headers=retry
            ) from None
        except Closing:
            raise APIError(
                503,
                "the server is shutting down; retry later",
                kind="server_error",
                headers=retry | {"Connection": "close"},
            ) from None
        return Run(self, job, request, prompt_tokens, stream, include_usage)


def usage(prompt_tokens: int | Sequence[int], done: Sequence[Completion]) -> Usage:
    """The request's usage: its prompt tokens (an int, or a list with one count per prompt, summed), each prompt
    counted once whatever n is (as OpenAI and vLLM count), and the completion tokens and the speculation summed
    over the choices."""
    drafted = sum(c.stats.drafted for c in done)
    accepted = sum(c.stats.accepted for c in done)
    passes = sum(c.stats.target_passes for c in done)
    emitted = sum(c.stats.emitted for c in done)  # every pass's tokens, EOS included: tau >= 1
    completion = sum(len(c.token_ids) for c in done)
    spec = Speculation(
        draft_tokens=drafted,
        accepted_tokens=accepted,
        acceptance_rate=accepted / drafted if drafted else None,
        target_passes=passes,
        tokens_per_pass=emitted / passes if passes else None,
    )
    prompt = prompt_tokens if isinstance(prompt_tokens, int) else sum(prompt_tokens)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        speculation=spec,
    )


def _sse(data: BaseModel | dict) -> str:
    body = data.model_dump(mode="json") if isinstance(data, BaseModel) else data
    return f"data: {json.dumps(body)}\n\n"


@dataclass
class Run:
    """One submitted request (its choices, prompt-major) as its handler sees it."""

    served: Served
    job: Job
    request: Request
    prompt_tokens: list[int]  # per prompt
    streaming: bool = False
    include_usage: bool = False
    gone: bool = False  # the client went away (the job is cancelled)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # by prompt index (echo + logprobs)
    _watcher: asyncio.Task | None = field(default=None, init=False, repr=False)  # polls the client (_watch)

    @property
    def n(self) -> int:
        return len(self.job.requests)

    async def _watch(self) -> None:
        """Until the handler is done: every 0.5 s, whether the client has gone away; if so the job is cancelled
        (its compute ends at the next step) and the handler stops waiting for its events."""
        while not await self.request.is_disconnected():
            await asyncio.sleep(_POLL_S)
        self.gone = True
        self.served.engine.cancel(self.job)
        self.job.events.put_nowait(_GONE)

    async def _next(self) -> StreamEvent | PromptLogprobs | None:
        """The job's next engine event; None (and the job cancelled) once the client has gone away."""
        item = await self.job.events.get()
        if item is _GONE:
            return None
        if isinstance(item, ValueError):
            raise APIError.bad_value(item)
        if isinstance(item, Exception):
            raise internal_error(item, f"the engine, running request {self.job.id}")
        return item

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The job's events until every choice has finished or the client has gone away (prompt logprobs are
        kept in `prompt_logprobs`, not yielded)."""
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())
        while self.job.finished < self.n:
            ev = await self._next()
            if ev is None:
                return
            if isinstance(ev, PromptLogprobs):
                self.prompt_logprobs[ev.prompt] = ev
                continue
            if ev.completion is not None:
                self.job.finished += 1
            yield ev

    def release(self) -> None:
        """Stop watching the client; cancel the job if it is unfinished (client gone, engine error, a reader that
        stopped early)."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self.job.finished < self.n:
            self.served.engine.cancel(self.job)  # stop spending compute on it

    async def collect(self) -> list[Completion] | None:
        """The n completions in choice order; None if the client went away first."""
        done: list[Completion | None] = [None] * self.n
        try:
            async for ev in self.events():
                if ev.completion is not None:
                    done[ev.index] = ev.completion
        finally:
            self.release()
        return None if self.gone else done

    async def _sse(
        self,
        choice_of: Callable[[StreamEvent], BaseModel | None],
        chunk: Callable[..., BaseModel],
        first: Iterable[BaseModel],
    ) -> AsyncIterator[str]:
        done: list[Completion] = []
        first = list(first)  # sent with the first event: the job has started, its weight version is known
        try:
            async for ev in self.events():
                for c in first:
                    yield _sse(chunk(choices=[c]))
                first = []
                if (c := choice_of(ev)) is not None:
                    yield _sse(chunk(choices=[c]))
                if ev.completion is not None:
                    done.append(ev.completion)
            if self.gone:
                return
            if self.include_usage:
                yield _sse(chunk(choices=[], usage=usage(self.prompt_tokens, done)))
            yield "data: [DONE]\n\n"
        except APIError as e:  # the error as a chunk, then [DONE] (as vLLM ends a failed stream)
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
        finally:
            self.release()

    async def respond(
        self,
        answer: Callable[[list[Completion]], BaseModel],
        choice_of: Callable[[StreamEvent], BaseModel | None],
        chunk: Callable[..., BaseModel],
        first: Iterable[BaseModel] = (),
    ) -> BaseModel | Response:
        """The request's reply. Plain: `answer(completions)` (499 when the client went away). Streamed: a
        `chunk(choices=[...])` per `first` choice, then per event `choice_of(event)` (None: nothing to send),
        then `chunk(choices=[], usage=...)` if the request asked for usage, then [DONE] (after an error too)."""
        if self.streaming:
            return StreamingResponse(self._sse(choice_of, chunk, first), media_type="text/event-stream")
        done = await self.collect()
        return Response(status_code=499) if done is None else await asyncio.to_thread(answer, done)  # decodes
