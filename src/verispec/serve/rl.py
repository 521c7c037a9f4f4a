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
Weight updates (SGLang's names, which verl and OpenRLHF call) — off unless the server runs with
--enable-weight-updates (403 otherwise; see `WeightRoutes`), from disk only under --weight-dir:
    POST /update_weights_from_tensor  body: a safetensors file's bytes (`safetensors.torch.save(named tensors)`),
                                      content-type application/octet-stream
    POST /update_weights_from_disk    {"model_path": a *.safetensors file or save_pretrained directory on the server}
         -> {weight_version, tensors, seconds, requantize_seconds}; a bad update is a 400 that changed nothing.
    GET  /get_weight_version          {"weight_version": n}
    POST /abort_request               {} or {"abort_all": true} (a JSON body: no cross-site form can send it): ends
                                      the running and waiting /generate/ calls after their step; unfinished samples
                                      return what they have, finish_reason "abort" (so does a /generate/ whose
                                      client goes away)
An update waits for every request submitted before it to finish — all of its samples or choices, not only those
already running — and holds those submitted after it until it is written: every request is drawn under one weight
version, which its reply reports (`weight_version`). Options under which the sampled law is not softmax(logits / T) (top-k, top-p, min-p,
penalties, greedy) are refused (400): the trainer could not recompute its logprobs (`RolloutEngine`).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.requests import ClientDisconnect

from ..model.weights import WeightUpdateError, load_safetensors_files
from ..rollout import RolloutEngine, check_on_policy
from ..sampling import ParamError, SamplingParams, check_seed
from .bodies import OffLoopRoute
from .engine import Closing, Job
from .errors import APIError
from .protocol import MAX_PROMPTS, MAX_TOKEN_LIST, StopList, Text

__all__ = ["WeightRoutes", "router"]

router = APIRouter(route_class=OffLoopRoute)  # large bodies (a rollout batch) validated off the event loop
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
    stop: StopList = None
    ignore_eos: bool = False


_Prompts = Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
_TokenPrompts = Annotated[
    list[Annotated[list[StrictInt], Field(max_length=MAX_TOKEN_LIST)]], Field(min_length=1, max_length=MAX_PROMPTS)
]


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompts: _Prompts | _TokenPrompts
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
    model_path: Text


class AbortRequest(BaseModel):
    """SGLang's body (`{"abort_all": true}`; `{}` says the same): every /generate/ call is aborted."""

    model_config = ConfigDict(extra="forbid")
    abort_all: Literal[True] = True


def _rollout(request: Request) -> RolloutEngine:
    return request.app.state.rollout


@router.get("/health/")
async def health():
    """TRL's health check: `{"status": "ok"}`."""
    return {"status": "ok"}


@router.get("/get_world_size/")
@router.get("/get_world_size")
async def world_size():
    """TRL's housekeeping: `{"world_size": 1}`."""
    return {"world_size": 1}


@router.post("/reset_prefix_cache/")
@router.post("/reset_prefix_cache")
async def reset_prefix_cache():
    """TRL's housekeeping: `{"success": true}` (no KV cache outlives a call, so nothing of old weights is read)."""
    return {"success": True}


@router.post("/close_communicator/")
async def close_communicator():
    """TRL's housekeeping: `{}` (there is no NCCL communicator)."""
    return {}


async def nccl_refused(request: Request):
    """501: NCCL weight sync is not offered; the answer names the HTTP weight routes to use instead."""
    raise APIError(
        501,
        f"{request.url.path}: NCCL weight sync is not offered (CPU machines have no NCCL); send the weights over HTTP: "
        "POST /update_weights_from_tensor with a safetensors body, or POST /update_weights_from_disk "
        '{"model_path": ...} (see docs/guides/rl-rollouts.md)',
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
    """TRL's rollout route: `n` samples of every prompt (text or token ids), with their token ids, logprobs,
    finish reasons and the weight version they were drawn under."""
    eng, served = _rollout(request), request.app.state.served
    if req.n > eng.max_batch_size:
        raise APIError(400, f"n = {req.n} exceeds the server's batch ({eng.max_batch_size}, --max-batch)", "n")
    kw = req.generation_kwargs
    try:
        check_seed(kw.seed, "generation_kwargs.seed")  # /v1's rule
    except ParamError as e:
        raise APIError.bad_value(e) from None
    params = _params(req)
    ids = await asyncio.to_thread(_prompts, eng, req, served.context)  # tokenizing: off the event loop
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
    # the queue's limits, as /v1; a deadline only where --request-timeout was set (a rollout cut at a default deadline
    # would come back "abort" and be trained on)
    run = served.enqueue(job, request, [len(p) for p in ids], prompt_field="prompts", timeout=served.rollout_timeout)
    jobs: set = request.app.state.rl_jobs
    jobs.add(job)  # /abort_request ends it
    try:
        done = await run.collect()
    finally:
        jobs.discard(job)
    if done is None:  # the client went away: its samples were aborted
        return Response(status_code=499)
    return _generated(eng, spec, seed, ids, done, job)


def _generated(eng: RolloutEngine, spec, seed: int, ids: list[list[int]], done: list, job: Job) -> GenerateResponse:
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


@dataclass
class WeightRoutes:
    """Who may replace the served model over HTTP: nobody unless `enabled` (--enable-weight-updates); from disk,
    only files under `dirs` (--weight-dir, resolved: symlinks followed). Uploads are taken one at a time (`lock`),
    each written to a temporary file as it arrives, so memory holds one update and the model."""

    enabled: bool = False
    dirs: tuple[Path, ...] = ()
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _cap: list = field(default_factory=list)  # the upload cap, computed once

    def check(self) -> None:
        if not self.enabled:
            raise APIError(
                403,
                "weight updates are off on this server: start it with --enable-weight-updates (and --api-key)",
                code="weight_updates_disabled",
            )

    def upload_cap(self, eng: RolloutEngine) -> int | None:
        """The largest body an update may be: every tensor of the target once, plus room for the safetensors
        header (None: the target is no torch model, and takes no updates)."""
        if not self._cap:
            model = eng.target.model
            ok = isinstance(model, torch.nn.Module)
            self._cap.append(
                sum(t.numel() * t.element_size() for t in model.state_dict().values()) + (64 << 20) if ok else None
            )
        return self._cap[0]

    def files(self, path: str) -> list[Path]:
        """The safetensors files of `path` (a file, or a directory's *.safetensors), each resolved and under one
        of `dirs`; one 400 for a path outside them, missing or unreadable (nothing said about which)."""
        if not self.dirs:
            raise APIError(400, "this server reads no weights from disk: start it with --weight-dir DIR", "model_path")
        refused = APIError(
            400,
            f"model_path {path!r} is no readable safetensors file or directory under the server's --weight-dir",
            "model_path",
        )
        try:
            p = Path(path).expanduser().resolve(strict=True)
            files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
            files = [f.resolve(strict=True) for f in files]
        except (OSError, RuntimeError, ValueError):
            raise refused from None
        inside = all(any(f.is_relative_to(d) for d in self.dirs) for f in [p, *files])
        if not files or not inside or not all(f.is_file() and os.access(f, os.R_OK) for f in files):
            raise refused
        return files


def _weights(request: Request) -> WeightRoutes:
    return request.app.state.weight_routes


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


async def _receive_to(request: Request, path: Path) -> int:
    """Write the request's body to `path` as it arrives (counted against its cap by `serve.access.BodyLimit`)."""
    size = 0
    with path.open("wb") as f:
        async for chunk in request.stream():
            size += len(chunk)
            f.write(chunk)
    return size


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> WeightUpdateResponse:
    """Replace weights in place from a safetensors body (`application/octet-stream`); needs
    `--enable-weight-updates`. Runs between requests; a bad update is a 400 that changes nothing."""
    eng, routes = _rollout(request), _weights(request)
    routes.check()
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    if kind != "application/octet-stream":
        raise APIError(415, f"send the safetensors bytes as content-type application/octet-stream, not {kind!r}")
    if routes.upload_cap(eng) is None:  # say why (a llama.cpp model's weights come from its file) before reading
        return await _update(request, lambda: eng.update_weights([]))
    async with routes.lock:  # one upload in memory at a time; the others wait unread
        with tempfile.TemporaryDirectory(prefix="verispec-upload-") as tmp:
            path = Path(tmp) / "update.safetensors"
            try:
                size = await _receive_to(request, path)
            except ClientDisconnect:  # the client went away mid-body
                return Response(status_code=499)
            if not size:
                raise APIError(400, "the body must be a safetensors file's bytes of the model's tensors")
            return await _update(request, lambda: eng.update_weights(load_safetensors_files([path], "the body")))


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(req: DiskUpdate, request: Request) -> WeightUpdateResponse:
    """Replace weights in place from a safetensors file or directory under `--weight-dir`; needs
    `--enable-weight-updates`."""
    eng, routes = _rollout(request), _weights(request)
    routes.check()
    files = await asyncio.to_thread(routes.files, req.model_path)
    return await _update(request, lambda: eng.update_weights(load_safetensors_files(files)))


@router.get("/get_weight_version")
async def weight_version(request: Request):
    """The current weight version (it counts updates)."""
    return {"weight_version": _rollout(request).weight_version}


@router.post("/abort_request")
async def abort(body: AbortRequest, request: Request):
    """End the running and waiting /generate/ calls after their current step (unfinished samples end
    "abort")."""
    for job in list(request.app.state.rl_jobs):  # waiting or running: unfinished samples end "abort"
        request.app.state.engine.expire(job)
    _rollout(request).abort()  # a RolloutEngine.generate called by anyone else
    return {"success": True}
