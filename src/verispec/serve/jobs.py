"""What the completions and chat handlers share: the served model (`Served`: checks a request against the
model and its context, builds its choices, submits them) and one submitted request (`Run`: its engine
events, collected for a plain answer or streamed as server-sent events, cancelled when the client goes away)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from ..engine.generator import Completion, SpeculativeGenerator, StreamEvent
from ..sampling import SamplingParams
from .engine import EngineThread, Job, Overloaded
from .errors import APIError
from .metrics import Metrics
from .protocol import Speculation, Usage

__all__ = ["Run", "Served", "usage"]


@dataclass
class Served:
    """The model this server serves, and the engine that runs it."""

    gen: SpeculativeGenerator
    engine: EngineThread
    metrics: Metrics
    model_id: str
    aliases: frozenset[str] = field(default_factory=frozenset)  # other names a request may use for the model
    retry_after_s: int = 1

    @property
    def context(self) -> int | None:
        return self.gen.max_positions

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
        if context is not None and prompt_tokens >= context:
            raise APIError(
                400, f"the prompt has {prompt_tokens} tokens; the model's context is {context}", prompt_field
            )
        if max_tokens is None:
            return (context - prompt_tokens) if context is not None else 256
        if context is not None and prompt_tokens + max_tokens > context:
            raise APIError(
                400,
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context ({context})",
                "max_tokens",
            )
        return max_tokens

    def choices(self, req, ids: list[int], max_tokens: int | None, top_n: int, prompt_field: str) -> list[dict]:
        """GenerationSession.add's keyword arguments for each of the request's n choices (choice i: seed + i)."""
        self.check_model(req.model)
        max_new = self.max_new_tokens(len(ids), max_tokens, prompt_field)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s == "" for s in stop):
            raise APIError(400, "stop strings must be non-empty", "stop")
        out = []
        for i in range(req.n):
            try:
                params = SamplingParams(
                    temperature=req.temperature,
                    top_p=req.top_p,
                    top_k=req.top_k,
                    min_p=req.min_p,
                    repetition_penalty=req.repetition_penalty,
                    presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty,
                    seed=None if req.seed is None else req.seed + i,
                )
            except ValueError as e:
                raise APIError.bad_value(e) from None
            out.append(
                {
                    "prompt": ids,
                    "params": params,
                    "max_new_tokens": max_new,
                    "stop": stop,
                    "ignore_eos": req.ignore_eos,
                    "gamma": req.num_speculative_tokens,
                    "top_logprobs": top_n,
                }
            )
        return out

    def submit(
        self, req, request: Request, ids: list[int], max_tokens: int | None, top_n: int, prompt_field: str
    ) -> Run:
        """Validate the request against the model, queue it (429 when the queue is full) and return its Run."""
        job = Job(
            id=uuid.uuid4().hex,
            choices=self.choices(req, ids, max_tokens, top_n, prompt_field),
            loop=asyncio.get_running_loop(),
        )
        try:
            self.engine.submit(job)
        except Overloaded as e:
            self.metrics.rejected.inc()
            raise APIError(
                429,
                f"server overloaded: {e}; retry later",
                kind="rate_limit_error",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Run(self, job, request, len(ids), req.stream, include_usage)


def usage(prompt_tokens: int, done: Sequence[Completion]) -> Usage:
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
    return Usage(
        prompt_tokens=prompt_tokens * len(done),
        completion_tokens=completion,
        total_tokens=prompt_tokens * len(done) + completion,
        speculation=spec,
    )


def _sse(data: BaseModel | dict) -> str:
    body = data.model_dump(mode="json") if isinstance(data, BaseModel) else data
    return f"data: {json.dumps(body)}\n\n"


@dataclass
class Run:
    """One submitted request (n choices) as its handler sees it."""

    served: Served
    job: Job
    request: Request
    prompt_tokens: int
    streaming: bool = False
    include_usage: bool = False
    gone: bool = False  # the client went away (the job is cancelled)

    @property
    def n(self) -> int:
        return len(self.job.choices)

    async def _next(self) -> StreamEvent | None:
        """The job's next engine event; None (and the job cancelled) once the client has gone away."""
        while True:
            try:
                item = await asyncio.wait_for(self.job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    self.gone = True
                    return None
                continue
            if isinstance(item, ValueError):
                raise APIError.bad_value(item)
            if isinstance(item, Exception):
                raise APIError(500, str(item), kind="server_error")
            return item

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The job's events until every choice has finished or the client has gone away."""
        while self.job.finished < self.n:
            ev = await self._next()
            if ev is None:
                return
            if ev.completion is not None:
                self.job.finished += 1
            yield ev

    def release(self) -> None:
        """Cancel the job if it is unfinished (client gone, engine error, a reader that stopped early)."""
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
        try:
            for c in first:
                yield _sse(chunk(choices=[c]))
            async for ev in self.events():
                if (c := choice_of(ev)) is not None:
                    yield _sse(chunk(choices=[c]))
                if ev.completion is not None:
                    done.append(ev.completion)
            if self.gone:
                return
            if self.include_usage:
                yield _sse(chunk(choices=[], usage=usage(self.prompt_tokens, done)))
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield _sse(e.body())
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
        then `chunk(choices=[], usage=...)` if the request asked for usage, then [DONE]."""
        if self.streaming:
            return StreamingResponse(self._sse(choice_of, chunk, first), media_type="text/event-stream")
        done = await self.collect()
        return Response(status_code=499) if done is None else answer(done)
