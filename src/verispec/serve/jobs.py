"""What the completions and chat handlers share: the served model (`Served`: checks a request against the model and
its context, reads its structured-output fields, builds its choices, queues them) and one queued request (`Run`: its
engine events, collected for a plain answer or streamed as server-sent events; cancelled when its client goes away)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from ..engine.generator import Completion, SpeculativeGenerator, StreamEvent
from ..engine.request import Job
from ..engine.request import Request as EngineRequest
from ..sampling import Constraint, ConstraintError, SamplingParams, bad_words_from_text
from .engine import Call, Closing, EngineThread, Overloaded, PromptLogprobs, TooLarge
from .errors import APIError, internal_error
from .metrics import Metrics
from .protocol import Speculation, Usage
from .scoring import PromptScorer

__all__ = ["Asked", "Run", "Served", "request_constraint", "usage"]

# the request fields that are SamplingParams' own, under the same names
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
# structured_outputs' constraint fields (name, attribute, builder); vLLM's older `guided_<name>` fields, one each
_STRUCTURED = (
    ("json", "json_", Constraint.json_schema),
    ("regex", "regex", Constraint.regex),
    ("choice", "choice", Constraint.choice),
    ("grammar", "grammar", Constraint.grammar),
)

_REQUEST_TIMEOUT = object()  # `Served.enqueue`'s default deadline: --request-timeout
_POLL_S = 0.5  # how often a request's client is checked for having gone away
_GONE = object()  # put on a job's events once its client has gone away: the handler stops waiting


@dataclass(frozen=True)
class Asked:
    """A request's structured-output constraint and the field that asked for it, as the client wrote it (every error
    about it names it: `guided_regex`, `response_format.json_schema.schema`)."""

    constraint: Constraint
    field: str


def _response_format(rf) -> list[tuple[str, Callable[[], Constraint]]]:
    name = "response_format.json_schema"
    if rf.type == "json_schema" and rf.json_schema is not None:
        return [(f"{name}.schema", partial(Constraint.json_schema, rf.json_schema.schema_))]
    if rf.type == "json_schema":
        raise APIError(400, f'{name} is required with "type": "json_schema" (an object with name and schema)', name)
    if rf.json_schema is not None:
        raise APIError(400, f'{name} is read only with "type": "json_schema", not {rf.type!r}', name)
    return [] if rf.type == "text" else [("response_format", Constraint.json_object)]


def request_constraint(req) -> Asked | None:
    """The request's structured-output constraint (None: none asked) from the one field that asks for it (OpenAI's
    `response_format`, vLLM's `structured_outputs` or `guided_*`): 400 naming the fields when two ask, or the field
    when its value is malformed. Compiling it for the tokenizer is `Served.constraint`'s."""
    found = [] if req.response_format is None else _response_format(req.response_format)
    so = req.structured_outputs
    for name, attr, make in _STRUCTURED:
        if so is not None and (value := getattr(so, attr)) is not None:
            found.append((f"structured_outputs.{name}", partial(make, value)))
    if so is not None and so.json_object:
        found.append(("structured_outputs.json_object", Constraint.json_object))
    for name, _, make in _STRUCTURED:
        if (value := getattr(req, f"guided_{name}")) is not None:
            found.append((f"guided_{name}", partial(make, value)))
    names = [name for name, _ in found]
    if len(names) > 1:
        why = f"{' and '.join(names)} each ask for a structured output; a request may send only one constraint"
        raise APIError(400, why, names[1])
    if not names:
        return None
    name, make = found[0]
    try:
        return Asked(make(), name)
    except ConstraintError as e:
        raise APIError(400, f"{name}: {e}", name) from None


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
        """One scorer for the handlers' checks and the engine: the one given, else the engine's, else a new one."""
        self.scorer = self.scorer or self.engine.scorer or PromptScorer(self.gen)
        self.engine.scorer = self.engine.scorer or self.scorer

    @property
    def context(self) -> int | None:
        """The most tokens a request may hold, prompt and completion together."""
        own, cap = self.gen.core.max_positions, self.max_model_len
        return cap if own is None else own if cap is None else min(own, cap)

    def decode(self, ids: Sequence[int]) -> str:
        """Text as the engine decodes a completion (special tokens skipped)."""
        return self.gen.tokenizer.decode(list(ids), skip_special_tokens=True)

    def namer(self, as_ids: bool) -> Callable[[int], str]:
        """How logprobs name a token: its own text, or "token_id:N" (the request's return_tokens_as_token_ids)."""
        return (lambda t: f"token_id:{t}") if as_ids else (lambda t: self.gen.tokenizer.decode([t]))

    def check_model(self, model: str) -> None:
        if model != self.model_id and model not in self.aliases:
            why = f"The model `{model}` does not exist (this server serves `{self.model_id}`)"
            raise APIError(404, why, "model", code="model_not_found")

    def max_new_tokens(self, prompt_tokens: int, max_tokens: int | None, prompt_field: str) -> int:
        """The request's token budget: max_tokens, or the rest of the context; 400 when it does not fit."""
        context = self.context
        limit = f"This model's maximum context length is {context} tokens"
        if context is not None and prompt_tokens >= context:
            raise APIError(400, f"{limit}; the prompt has {prompt_tokens} tokens", prompt_field)
        if max_tokens is None:
            return (context - prompt_tokens) if context is not None else 256
        if context is not None and prompt_tokens + max_tokens > context:
            asks = f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} in the completion)"
            why = f"{limit}; the request asks for {asks}: shorten the prompt or lower max_tokens"
            raise APIError(400, why, "max_tokens")
        return max_tokens

    def token_ids(self, ids: Sequence[int], field: str) -> list[int]:
        """`ids`, once each lies in the vocabulary (400 naming `field` otherwise)."""
        vocab = self.gen.core.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise APIError(400, f"{field} must lie in [0, {vocab}), got {bad[:3]}", field)
        return list(ids)

    def constraint(self, req, stop: list[str]) -> Asked | None:
        """The request's constraint (`request_constraint`), compiled for the served tokenizer (cached): 400 naming the
        field when it does not compile, or `stop` / `ignore_eos` beside it (the engine refuses both with one)."""
        asked = request_constraint(req)
        if asked is None:
            return None
        why = "the output ends where the constraint's grammar is complete"
        if stop:
            why += ", and a stop string could cut it short"
            raise APIError(400, f"stop strings cannot be combined with {asked.field}: {why}", "stop")
        if req.ignore_eos:
            raise APIError(400, f"ignore_eos cannot be combined with {asked.field}: {why}", "ignore_eos")
        try:
            self.gen.core.grammars.compile(asked.constraint)
        except ConstraintError as e:
            raise APIError(400, f"{asked.field}: {e}", asked.field) from None
        return asked

    def params(self, req, asked: Asked | None = None) -> SamplingParams:
        """The request's SamplingParams, with its constraint, `logit_bias` (string keys of token ids),
        `allowed_token_ids` and `bad_words` (tokenized alone and after a space, as vLLM does)."""
        bias = None if not req.logit_bias else {}
        for key, value in (req.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                why = f"logit_bias keys must be token ids (strings of integers), got {key!r}"
                raise APIError(400, why, "logit_bias") from None
        try:
            encode = partial(self.gen.tokenizer.encode, add_special_tokens=False)
            words = bad_words_from_text(req.bad_words, encode) if req.bad_words else ()
            same = {k: getattr(req, k) for k in _SAMPLING}
            return SamplingParams(
                **same,
                seed=req.seed,
                constraint=None if asked is None else asked.constraint,
                logit_bias=bias,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=words,
            )
        except ValueError as e:  # (a ParamError: 400 naming the field)
            raise APIError.bad_value(e) from None

    def choices(self, req, prompts: list[list[int]], max_tokens, top_n: int, field: str, key) -> list[EngineRequest]:
        """The request's choices as checked engine Requests, prompt-major: prompt p's choice j is choice i = p * n + j,
        keyed (key, i), with seed + j. `field`: the prompt's, as the client wrote it."""
        self.check_model(req.model)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s == "" for s in stop):
            raise APIError(400, "stop strings must be non-empty", "stop")
        asked = self.constraint(req, stop)  # compiled once, whatever n is
        base = self.params(req, asked)  # bad words tokenized once, whatever n is
        params = [base if req.seed is None else replace(base, seed=req.seed + j) for j in range(req.n)]
        stop_ids = self.token_ids(req.stop_token_ids or [], "stop_token_ids")
        options = {"stop": stop, "stop_token_ids": stop_ids, "ignore_eos": req.ignore_eos, "top_logprobs": top_n}
        options["gamma"], out = req.num_speculative_tokens, []
        for p, ids in enumerate(prompts):
            where = field if len(prompts) == 1 else f"{field}[{p}]"
            options["max_new_tokens"] = self.max_new_tokens(len(ids), max_tokens, where)
            for j in range(req.n):
                i = len(out)
                try:
                    out.append(self.gen.core.request(ids, params[j], key=(key, i), index=i, **options))
                except ConstraintError as e:  # (compiled above: cached) named by the field that asked for it
                    name = asked.field if asked is not None else None
                    raise APIError(400, f"{name}: {e}" if name else str(e), name) from None
                except ValueError as e:
                    raise APIError.bad_value(e) from None
        return out

    async def submit(self, req, request: Request, prompts, max_tokens, top_n: int, field: str, score_top=None) -> Run:
        """Validate the request (in a worker thread) and queue it; its Run. score_top: score the prompts too (echo
        with logprobs), with this many alternatives."""
        key = uuid.uuid4().hex
        requests = await asyncio.to_thread(self.choices, req, prompts, max_tokens, top_n, field, key)
        call = Call(Job(requests, key=key, group=req.n), asyncio.get_running_loop(), score_top)
        with_usage = bool(req.stream_options and req.stream_options.include_usage)
        return self.enqueue(Run(self, call, request, [len(p) for p in prompts], req.stream, with_usage), field)

    def enqueue(self, run: Run, field: str = "prompt", timeout: float | object | None = _REQUEST_TIMEOUT) -> Run:
        """Queue a run's call with its deadline (`timeout` seconds; by default --request-timeout): 400 (TooLarge,
        naming `field` or `n`), 429 (a full queue) or 503 (a shutdown)."""
        timeout = self.request_timeout if timeout is _REQUEST_TIMEOUT else timeout
        if timeout is not None:
            run.call.job.deadline = run.call.arrived + timeout  # the session expires the job there
        retry = {"Retry-After": str(self.retry_after_s)}
        try:
            self.engine.submit(run.call)
        except TooLarge as e:
            raise APIError(400, str(e), field if e.field == "prompt" else e.field) from None
        except Overloaded as e:
            self.metrics.rejected.inc()
            why = f"server overloaded: {e}; retry later"
            raise APIError(429, why, kind="rate_limit_error", headers=retry) from None
        except Closing:
            why, retry = "the server is shutting down; retry later", retry | {"Connection": "close"}
            raise APIError(503, why, kind="server_error", headers=retry) from None
        return run


def usage(prompt_tokens: int | Sequence[int], done: Sequence[Completion]) -> Usage:
    """The request's usage: its prompt tokens (an int, or one count per prompt, summed: each prompt once whatever n is,
    as OpenAI and vLLM count), and the completion tokens and the speculation summed over the choices."""
    drafted, accepted = sum(c.stats.drafted for c in done), sum(c.stats.accepted for c in done)
    passes, emitted = sum(c.stats.target_passes for c in done), sum(c.stats.emitted for c in done)  # EOS too: tau >= 1
    spec = Speculation(
        draft_tokens=drafted,
        accepted_tokens=accepted,
        target_passes=passes,
        acceptance_rate=accepted / drafted if drafted else None,
        tokens_per_pass=emitted / passes if passes else None,
    )
    prompt = prompt_tokens if isinstance(prompt_tokens, int) else sum(prompt_tokens)
    completion = sum(len(c.token_ids) for c in done)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion, speculation=spec)


def _sse(data: BaseModel | dict) -> str:
    body = data.model_dump(mode="json") if isinstance(data, BaseModel) else data
    return f"data: {json.dumps(body)}\n\n"


@dataclass
class Run:
    """One submitted request (its choices, prompt-major) as its handler sees it."""

    served: Served
    call: Call
    request: Request
    prompt_tokens: list[int]  # per prompt
    streaming: bool = False
    include_usage: bool = False
    gone: bool = False  # the client went away (the call is cancelled)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # by prompt index (echo + logprobs)
    _watcher: asyncio.Task | None = field(default=None, init=False, repr=False)  # polls the client (_watch)

    @property
    def n(self) -> int:
        return len(self.call.job.requests)

    def envelope(self, cls: type[BaseModel], prefix: str, **fields) -> BaseModel:
        """A reply or stream chunk (`cls`) of this request, with the weight version its choices are drawn under (known
        once its job has started)."""
        call, model = self.call, self.served.model_id
        return cls(
            id=f"{prefix}-{call.job.key}",
            created=int(call.created),
            model=model,
            **fields,
            weight_version=call.job.weight_version,
        )

    async def _watch(self) -> None:
        """Every 0.5 s, whether the client has gone away: then the call is cancelled and the handler stops waiting."""
        while not await self.request.is_disconnected():
            await asyncio.sleep(_POLL_S)
        self.gone = True
        self.served.engine.cancel(self.call)
        self.call.events.put_nowait(_GONE)

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The job's events until every choice has finished or the client has gone away (prompt logprobs are kept in
        `prompt_logprobs`, not yielded); its error raised as an APIError."""
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())
        while self.call.finished < self.n:
            ev = await self.call.events.get()
            if ev is _GONE:
                return
            if isinstance(ev, ValueError):
                raise APIError.bad_value(ev)
            if isinstance(ev, Exception):
                raise internal_error(ev, f"the engine, running request {self.call.job.key}")
            if isinstance(ev, PromptLogprobs):
                self.prompt_logprobs[ev.prompt] = ev
                continue
            if ev.completion is not None:
                self.call.finished += 1
            yield ev

    def release(self) -> None:
        """Stop watching the client; cancel the job if it is unfinished (client gone, error, a reader that stopped)."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self.call.finished < self.n:
            self.served.engine.cancel(self.call)  # stop spending compute on it

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

    async def _sse(self, reply) -> AsyncIterator[str]:
        chunk, done = partial(self.envelope, reply.chunk, reply.prefix), []
        first = list(reply.first)  # sent with the first event: the job has started, its weight version is known
        try:
            async for ev in self.events():
                for c in [*first, reply.choice(ev)]:
                    if c is not None:
                        yield _sse(chunk(choices=[c]))
                first = []
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

    def _answer(self, reply, done: list[Completion]) -> BaseModel:
        choices = [reply.final(i, c) for i, c in enumerate(done)]
        return self.envelope(reply.response, reply.prefix, choices=choices, usage=usage(self.prompt_tokens, done))

    async def respond(self, reply) -> BaseModel | Response:
        """The request's reply, as its handler's `reply` builds it: plain, a `reply.response` of `reply.final(i,
        completion)` choices (499 when the client went away); streamed, `reply.chunk`s of the `reply.first` choices, then
        of `reply.choice(event)` per event (None: nothing), then of the usage if asked, then [DONE] (after an error too)."""
        if self.streaming:
            return StreamingResponse(self._sse(reply), media_type="text/event-stream")
        done = await self.collect()
        return Response(status_code=499) if done is None else await asyncio.to_thread(self._answer, reply, done)
