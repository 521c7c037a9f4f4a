"""`verispec serve`: an OpenAI-compatible HTTP server over a SpeculativeGenerator.

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /metrics.
Requests are validated in the handler (400 with an OpenAI-style error object naming the field; 404 for an
unknown model), then run by the engine thread with continuous batching (see `serve.engine`). Logprobs are
the target model's raw log-softmax (temperature 1, nothing truncated) at each returned token — the same
convention as vLLM's default and what RL importance ratios need.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine.generator import Completion, SpeculativeGenerator
from ..sampling import SamplingParams
from .engine import EngineThread, Job, Overloaded
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["create_app"]


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code, self.headers = (status, message, param, kind,
                                                                                     code, headers)


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _param_of(message: str) -> str | None:
    m = re.search(r"SamplingParams\.(\w+)", message)
    return m.group(1) if m else None


def create_app(gen: SpeculativeGenerator, model_name: str, *, max_batch: int = 8, max_queue: int = 64,
               retry_after_s: int = 1) -> FastAPI:
    metrics = Metrics(model_name)
    engine = EngineThread(gen, max_batch=max_batch, max_queue=max_queue, metrics=metrics)
    tok = gen.tokenizer
    context = gen.max_positions

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error(e.status, e.message, e.param, e.kind, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if err.get("type") == "extra_forbidden":
            msg = f"unknown field {param!r}: this server does not support it"
        elif err.get("type") == "json_invalid":
            msg, param = "the request body is not valid JSON", None
        else:
            msg = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        return _error(400, msg, param)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):  # the server never dies from a request
        return _error(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "verispec",
                                            "max_model_len": context}]}

    @app.get("/metrics")
    async def prom():
        metrics.set_queue(engine.num_waiting, engine.num_running)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # --- shared request handling -----------------------------------------------------------------------
    def choices_for(req, ids: list[int], max_tokens: int | None, top_n: int, prompt_field: str) -> list[dict]:
        if req.model != model_name:
            raise APIError(404, f"The model `{req.model}` does not exist (this server serves `{model_name}`)", "model",
                           code="model_not_found")
        if context is not None and len(ids) >= context:
            raise APIError(400, f"the prompt has {len(ids)} tokens; the model's context is {context}", prompt_field)
        if max_tokens is None:
            max_tokens = (context - len(ids)) if context is not None else 256
        elif context is not None and len(ids) + max_tokens > context:
            raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                                f"({context})", "max_tokens")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s == "" for s in stop):
            raise APIError(400, "stop strings must be non-empty", "stop")
        out = []
        for i in range(req.n):
            try:
                params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                                        repetition_penalty=req.repetition_penalty,
                                        presence_penalty=req.presence_penalty,
                                        frequency_penalty=req.frequency_penalty,
                                        seed=None if req.seed is None else req.seed + i)
            except ValueError as e:
                raise APIError(400, str(e), _param_of(str(e))) from None
            out.append({"prompt": ids, "params": params, "max_new_tokens": max_tokens, "stop": stop,
                        "ignore_eos": req.ignore_eos, "gamma": req.num_speculative_tokens, "top_logprobs": top_n})
        return out

    def submit(choices: list[dict]) -> Job:
        job = Job(id=uuid.uuid4().hex, choices=choices, loop=asyncio.get_running_loop())
        try:
            engine.submit(job)
        except Overloaded as e:
            metrics.rejected.inc()
            raise APIError(429, f"server overloaded: {e}; retry later", kind="rate_limit_error",
                           headers={"Retry-After": str(retry_after_s)}) from None
        return job

    def usage(prompt_tokens: int, done: list[Completion]) -> dict:
        drafted = sum(c.stats.drafted for c in done)
        accepted = sum(c.stats.accepted for c in done)
        passes = sum(c.stats.target_passes for c in done)
        completion = sum(len(c.token_ids) for c in done)
        return {"prompt_tokens": prompt_tokens * len(done), "completion_tokens": completion,
                "total_tokens": prompt_tokens * len(done) + completion,
                "speculation": {"draft_tokens": drafted, "accepted_tokens": accepted,
                                "acceptance_rate": accepted / drafted if drafted else None,
                                "target_passes": passes, "tokens_per_pass": completion / passes if passes else None}}

    async def next_item(job: Job, request: Request):
        """The job's next engine event; cancels the job if the client went away while waiting."""
        while True:
            try:
                item = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(job)
                    return None
                continue
            if isinstance(item, Exception):
                engine.cancel(job)
                if isinstance(item, ValueError):
                    raise APIError(400, str(item), _param_of(str(item)))
                raise APIError(500, str(item), kind="server_error")
            return item

    def finished(job: Job, prompt_tokens: int, c: Completion) -> None:
        job.finished += 1
        metrics.observe_request(prompt_tokens, len(c.token_ids), c.finish_reason, time.time() - job.created)

    def piece(t: int) -> str:
        return tok.decode([t])

    # --- /v1/completions -------------------------------------------------------------------------------
    def legacy_logprobs(ids: list[int], lps: list[float], tops, start_offset: int = 0) -> dict:
        toks = [piece(t) for t in ids]
        offsets, pos = [], start_offset
        for s in toks:
            offsets.append(pos)
            pos += len(s)
        top = [{piece(a): b for a, b in alts} for alts in tops] if tops is not None else None
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        try:
            ids = gen.encode(req.prompt)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        top_n = req.logprobs or 0
        job = submit(choices_for(req, ids, req.max_tokens, top_n, "prompt"))
        rid, created = f"cmpl-{job.id}", int(job.created)
        base = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        n = req.n

        if not req.stream:
            done: list[Completion | None] = [None] * n
            while job.finished < n:
                ev = await next_item(job, request)
                if ev is None:
                    return Response(status_code=499)
                if ev.completion is not None:
                    done[ev.index] = ev.completion
                    finished(job, len(ids), ev.completion)
            return base | {"choices": [
                {"index": i, "text": c.text, "finish_reason": c.finish_reason,
                 "logprobs": legacy_logprobs(c.token_ids, c.raw_logprobs, c.top_logprobs if top_n else None)
                 if req.logprobs is not None else None} for i, c in enumerate(done)],
                "usage": usage(len(ids), done)}

        async def sse():
            done: list[Completion] = []
            offsets = [0] * n
            try:
                while job.finished < n:
                    ev = await next_item(job, request)
                    if ev is None:
                        return
                    c = ev.completion
                    lp = None
                    if req.logprobs is not None and ev.token_ids:
                        lp = legacy_logprobs(ev.token_ids, ev.raw_logprobs, ev.top_logprobs if top_n else None,
                                             offsets[ev.index])
                    offsets[ev.index] += len(ev.delta)
                    if ev.delta or lp or c is not None:
                        choice = {"index": ev.index, "text": ev.delta, "logprobs": lp,
                                  "finish_reason": c.finish_reason if c is not None else None}
                        yield f"data: {json.dumps(base | {'choices': [choice]})}\n\n"
                    if c is not None:
                        done.append(c)
                        finished(job, len(ids), c)
                if req.stream_options and req.stream_options.include_usage:
                    yield f"data: {json.dumps(base | {'choices': [], 'usage': usage(len(ids), done)})}\n\n"
                yield "data: [DONE]\n\n"
            except APIError as e:
                yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind, 'param': e.param}})}\n\n"
            finally:
                if job.finished < n:
                    engine.cancel(job)  # client gone or failed: stop spending compute on it

        return StreamingResponse(sse(), media_type="text/event-stream")

    # --- /v1/chat/completions --------------------------------------------------------------------------
    def chat_logprobs(ids: list[int], lps: list[float], tops) -> dict:
        content = []
        for j, (t, v) in enumerate(zip(ids, lps)):
            s = piece(t)
            alts = [] if tops is None else [{"token": piece(a), "logprob": b, "bytes": list(piece(a).encode())}
                                            for a, b in tops[j]]
            content.append({"token": s, "logprob": v, "bytes": list(s.encode()), "top_logprobs": alts})
        return {"content": content}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = gen.encode(messages, chat=True)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = submit(choices_for(req, ids, max_tokens, top_n, "messages"))
        rid, created = f"chatcmpl-{job.id}", int(job.created)
        n = req.n

        if not req.stream:
            done: list[Completion | None] = [None] * n
            while job.finished < n:
                ev = await next_item(job, request)
                if ev is None:
                    return Response(status_code=499)
                if ev.completion is not None:
                    done[ev.index] = ev.completion
                    finished(job, len(ids), ev.completion)
            return {"id": rid, "object": "chat.completion", "created": created, "model": model_name, "choices": [
                {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                 "logprobs": chat_logprobs(c.token_ids, c.raw_logprobs, c.top_logprobs) if req.logprobs else None}
                for i, c in enumerate(done)], "usage": usage(len(ids), done)}

        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name}

        async def sse():
            done: list[Completion] = []
            try:
                for i in range(n):
                    first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}
                    yield f"data: {json.dumps(base | {'choices': [first]})}\n\n"
                while job.finished < n:
                    ev = await next_item(job, request)
                    if ev is None:
                        return
                    c = ev.completion
                    lp = None
                    if req.logprobs and ev.token_ids:
                        lp = chat_logprobs(ev.token_ids, ev.raw_logprobs, ev.top_logprobs)
                    if ev.delta or lp or c is not None:
                        delta = {"content": ev.delta} if ev.delta else {}
                        choice = {"index": ev.index, "delta": delta, "logprobs": lp,
                                  "finish_reason": c.finish_reason if c is not None else None}
                        yield f"data: {json.dumps(base | {'choices': [choice]})}\n\n"
                    if c is not None:
                        done.append(c)
                        finished(job, len(ids), c)
                if req.stream_options and req.stream_options.include_usage:
                    yield f"data: {json.dumps(base | {'choices': [], 'usage': usage(len(ids), done)})}\n\n"
                yield "data: [DONE]\n\n"
            except APIError as e:
                yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind, 'param': e.param}})}\n\n"
            finally:
                if job.finished < n:
                    engine.cancel(job)

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app
