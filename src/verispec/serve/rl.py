"""The server's RL routes: TRL's rollout interface and weight updates over HTTP, backed by a `RolloutEngine` on the
server's own generator (one model, shared with the OpenAI routes): a /generate/ call is a job of the engine thread
like any OpenAI request (queued, batched, timed out at --request-timeout, aborted, counted in the metrics), and a
weight update runs on the engine thread between jobs.

TRL (`trl vllm-serve` before TRL 1.0; the shapes its `VLLMClient` and most RL stacks built on it speak):
    GET  /health/, /get_world_size/ (also without the slash)     -> {"status": "ok"}, {"world_size": 1}
    POST /generate/  {prompts: [text] | [[token ids]], n, temperature, top_p, top_k, min_p, repetition_penalty,
                      max_tokens, truncate_prompt_tokens, logprobs, generation_kwargs: {seed, stop, ignore_eos}}
                  -> {prompt_ids: [P][...] (one per prompt), completion_ids: [P*n][...] (prompt-major, EOS
                      included when it ended the sample, as vLLM's token_ids), logprobs: [P*n][...] (the sampled
                      token's log-probability under softmax(logits / temperature): vLLM's processed_logprobs),
                      finish_reasons, weight_version, speculation}
    POST /reset_prefix_cache/   {"success": true}: no cache outlives a call (rollouts of new weights never read
                                KV entries of old ones)
    POST /close_communicator/   {}: nothing to close
    POST /init_communicator/, /update_named_param/, /batch_update_named_params/, /init_weight_transfer_engine,
         /update_weights -> 501: NCCL weight sync is not offered (CPU machines have no NCCL); use:
Weight updates (SGLang's names, which verl and OpenRLHF call):
    POST /update_weights_from_tensor  body: a safetensors file's bytes (`safetensors.torch.save(named tensors)`),
                                      content-type application/octet-stream
    POST /update_weights_from_disk    {"model_path": a *.safetensors file or save_pretrained directory on the server}
         -> {weight_version, tensors, seconds, requantize_seconds}; a bad update is a 400 that changed nothing.
    GET  /get_weight_version          {"weight_version": n}
    POST /abort_request               ends the running and waiting /generate/ calls after their step: unfinished
                                      samples return what they have, finish_reason "abort" (so does a /generate/
                                      whose client goes away)
An update waits for every request submitted before it to finish — all of its samples or choices, not only those
already running — and holds those submitted after it until it is written: every request is drawn under one weight
version, which its reply reports (`weight_version`). Options under which the sampled law is not softmax(logits / T) (top-k, top-p, min-p,
penalties, greedy) are refused (400): the trainer could not recompute its logprobs (`RolloutEngine`).
"""

from __future__ import annotations

import asyncio
import uuid

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from ..model.weights import WeightUpdateError
from ..rollout import RolloutEngine, check_on_policy
from ..sampling import SamplingParams
from .engine import Closing, Job
from .errors import APIError

__all__ = ["router"]

router = APIRouter()
_NCCL_ROUTES = (
    "/init_communicator/",
    "/update_named_param/",
    "/batch_update_named_params/",
    "/init_weight_transfer_engine",
    "/update_weights",
)


class GenerationKwargs(BaseModel):
    """The `generation_kwargs` this server honours; any other key is refused (400 naming it)."""

    model_config = ConfigDict(extra="forbid")
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompts: list[str] | list[list[int]] = Field(min_length=1)
    images: None = None  # text models only
    n: int = Field(1, ge=1)
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off (vLLM's and TRL's default is -1)
    min_p: float = 0.0
    max_tokens: int = Field(16, ge=1)
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # keep the last k prompt tokens (vLLM's rule)
    guided_decoding_regex: None = None  # not offered
    logprobs: int | None = Field(0, ge=0, le=0)  # the sampled token's logprob only
    generation_kwargs: GenerationKwargs = Field(default_factory=GenerationKwargs)


class Speculation(BaseModel):
    draft_tokens: int
    accepted_tokens: int
    target_passes: int


class GenerateResponse(BaseModel):
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    weight_version: int
    speculation: Speculation


class WeightUpdateResponse(BaseModel):
    weight_version: int
    tensors: int
    seconds: float
    requantize_seconds: float


class DiskUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str


def _rollout(request: Request) -> RolloutEngine:
    return request.app.state.rollout


@router.get("/health/")
async def health():
    return {"status": "ok"}


@router.get("/get_world_size/")
@router.get("/get_world_size")
async def world_size():
    return {"world_size": 1}


@router.post("/reset_prefix_cache/")
@router.post("/reset_prefix_cache")
async def reset_prefix_cache():
    return {"success": True}


@router.post("/close_communicator/")
async def close_communicator():
    return {}


async def nccl_refused(request: Request):
    raise APIError(
        501,
        f"{request.url.path}: NCCL weight sync is not offered (CPU machines have no NCCL); send the weights over HTTP: "
        "POST /update_weights_from_tensor with a safetensors body, or POST /update_weights_from_disk "
        '{"model_path": ...} (see the README, "Using verispec for RL rollouts")',
        kind="not_implemented",
    )


for _path in _NCCL_ROUTES:
    router.add_api_route(_path, nccl_refused, methods=["POST"])


def _params(req: GenerateRequest) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
        )
    except ValueError as e:
        raise APIError.bad_value(e) from None


def _prompts(eng: RolloutEngine, req: GenerateRequest, context: int | None) -> list[list[int]]:
    """Token ids per prompt (text: the tokenizer, special tokens added as for a completion), truncated as asked;
    400 when one does not fit the served context (--max-model-len, else the model's) with max_tokens."""
    out = []
    for i, p in enumerate(req.prompts):
        try:
            ids = eng.gen.encode(p)
        except ValueError as e:
            raise APIError(400, f"prompts[{i}]: {e}", f"prompts[{i}]") from None
        if req.truncate_prompt_tokens is not None:
            ids = ids[-req.truncate_prompt_tokens :]
        if context is not None and len(ids) + req.max_tokens > context:
            raise APIError(
                400,
                f"prompts[{i}] ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the context ({context})",
                f"prompts[{i}]",
            )
        out.append(ids)
    return out


@router.post("/generate/")
async def generate(req: GenerateRequest, request: Request) -> GenerateResponse:
    eng, served = _rollout(request), request.app.state.served
    if req.n > eng.max_batch_size:
        raise APIError(400, f"n = {req.n} exceeds the server's batch ({eng.max_batch_size}, --max-batch)", "n")
    params, ids, kw = _params(req), _prompts(eng, req, served.context), req.generation_kwargs
    try:  # every check before queueing
        if eng.strict_on_policy:
            check_on_policy(params)
        spec, seed = eng.job(
            ids, req.n, params, max_new_tokens=req.max_tokens, seed=kw.seed, stop=kw.stop or (),
            ignore_eos=kw.ignore_eos,
        )  # fmt: skip
    except ValueError as e:
        raise APIError.bad_value(e) from None
    job = Job(id=uuid.uuid4().hex, requests=spec.requests, loop=asyncio.get_running_loop(), per_prompt=req.n)
    run = served.enqueue(job, request, [len(p) for p in ids])
    jobs: set = request.app.state.rl_jobs
    jobs.add(job)  # /abort_request ends it
    try:
        done = await run.collect()
    finally:
        jobs.discard(job)
    if done is None:  # the client went away: its samples were aborted
        return Response(status_code=499)
    outs = [eng.rollout(c, seed, key=spec.requests[c.index].key) for c in done]
    seqs = [o.with_eos() for o in outs]
    return GenerateResponse(
        prompt_ids=ids,
        completion_ids=[t for t, _ in seqs],
        logprobs=[lp for _, lp in seqs],
        finish_reasons=[o.finish_reason for o in outs],
        weight_version=job.weight_version if job.weight_version is not None else eng.weight_version,
        speculation=Speculation(
            draft_tokens=sum(o.stats.drafted for o in outs),
            accepted_tokens=sum(o.stats.accepted for o in outs),
            target_passes=sum(o.stats.target_passes for o in outs),
        ),
    )


async def _update(request: Request, fn) -> WeightUpdateResponse:
    try:
        up = await request.app.state.engine.run_between_jobs(fn)
    except WeightUpdateError as e:
        raise APIError(400, str(e)) from None
    except Closing:
        raise APIError(503, "the server is shutting down", kind="server_error") from None
    request.app.state.metrics.observe_weight_update(up.version)
    return WeightUpdateResponse(
        weight_version=up.version, tensors=up.tensors, seconds=up.seconds, requantize_seconds=up.requantize_seconds
    )


def _max_update_bytes(eng: RolloutEngine) -> int | None:
    """The largest body an update may be: every tensor of the target once, plus room for the safetensors header
    (None: the target is no torch model, and takes no updates)."""
    model = eng.target.model
    if not isinstance(model, torch.nn.Module):
        return None
    return sum(t.numel() * t.element_size() for t in model.state_dict().values()) + (64 << 20)


def _parse_update(body: bytes) -> list:
    from safetensors.torch import load  # a transformers dependency

    try:
        return list(load(body).items())
    except Exception as e:  # a foreign or truncated body
        raise WeightUpdateError(f"the body is not a safetensors file: {e}") from None


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> WeightUpdateResponse:
    eng = _rollout(request)
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    if kind != "application/octet-stream":
        raise APIError(415, f"send the safetensors bytes as content-type application/octet-stream, not {kind!r}")
    limit, size = _max_update_bytes(eng), request.headers.get("content-length")
    if limit is None:  # say why (a llama.cpp model's weights come from its file) before reading the body
        return await _update(request, lambda: eng.update_weights([]))
    if size is not None and size.isdigit() and int(size) > limit:
        raise APIError(413, f"the update has {int(size)} bytes; the served model's tensors take at most {limit}")
    body = await request.body()
    if not body or len(body) > limit:
        raise APIError(400 if not body else 413, "the body must be a safetensors file's bytes of the model's tensors")
    try:
        tensors = await asyncio.to_thread(_parse_update, body)  # before holding the model
    except WeightUpdateError as e:
        raise APIError(400, str(e)) from None
    return await _update(request, lambda: eng.update_weights(tensors))


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(req: DiskUpdate, request: Request) -> WeightUpdateResponse:
    eng = _rollout(request)
    return await _update(request, lambda: eng.update_weights_from_path(req.model_path))


@router.get("/get_weight_version")
async def weight_version(request: Request):
    return {"weight_version": _rollout(request).weight_version}


@router.post("/abort_request")
async def abort(request: Request):
    for job in list(request.app.state.rl_jobs):  # waiting or running: unfinished samples end "abort"
        request.app.state.engine.expire(job)
    _rollout(request).abort()  # a RolloutEngine.generate called by anyone else
    return {"success": True}
