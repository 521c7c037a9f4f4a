"""The server's RL routes (docs/guides/rl-rollouts.md, "The RL routes"): TRL's rollout interface (`trl vllm-serve`
before TRL 1.0: /generate/ and its housekeeping) and SGLang's weight-update routes (which verl and OpenRLHF call), backed
by a `RolloutEngine` on the server's generator. A /generate/ call is an engine job like any OpenAI request (queued,
batched, timed out, aborted, counted); options under which its logprobs are not the sampled law's are refused (400). A
weight update runs between jobs, only with --enable-weight-updates (403; from disk only under --weight-dir)."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictInt
from starlette.requests import ClientDisconnect

from ..engine.request import Job
from ..model.weights import WeightUpdateError, load_safetensors_files
from ..rollout import RolloutEngine, check_on_policy
from ..sampling import SamplingParams, check_seed
from .bodies import OffLoopRoute
from .engine import Call, Closing
from .errors import APIError
from .jobs import Run
from .protocol import MAX_PROMPTS, MAX_TOKEN_LIST, StopList, Strict, Text

__all__ = ["WeightRoutes", "router"]

router = APIRouter(route_class=OffLoopRoute)  # large bodies (a rollout batch) validated off the event loop
_NCCL_ROUTES = (
    "/init_communicator/",
    "/update_named_param/",
    "/batch_update_named_params/",  # TRL's and vLLM's
    "/init_weight_transfer_engine",
    "/update_weights",
)  # NCCL weight sync: 501


class GenerationKwargs(Strict):
    """The `generation_kwargs` this server honours; any other key is refused (400 naming it)."""

    seed: StrictInt | None = None
    stop: StopList = None
    ignore_eos: bool = False


_Prompts = Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
_TokenPrompts = Annotated[
    list[Annotated[list[StrictInt], Field(max_length=MAX_TOKEN_LIST)]], Field(min_length=1, max_length=MAX_PROMPTS)
]


class GenerateRequest(Strict):
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


class DiskUpdate(Strict):
    model_path: Text


class AbortRequest(Strict):
    """SGLang's body (`{"abort_all": true}`; `{}` says the same): every /generate/ call is aborted."""

    abort_all: Literal[True] = True


def _rollout(request: Request) -> RolloutEngine:
    return request.app.state.rollout


def _answering(answer: dict):
    async def housekeeping():
        return answer

    return housekeeping


for _method, _paths, _answer, _what in (  # TRL's housekeeping routes: each gives one answer
    ("GET", ["/health/"], {"status": "ok"}, "TRL's health check"),
    ("GET", ["/get_world_size/", "/get_world_size"], {"world_size": 1}, "TRL's housekeeping"),
    (
        "POST",
        ["/reset_prefix_cache/", "/reset_prefix_cache"],
        {"success": True},
        "TRL's housekeeping (no KV cache outlives a call, so nothing of old weights is read)",
    ),
    ("POST", ["/close_communicator/"], {}, "TRL's housekeeping (there is no NCCL communicator)"),
):
    for _path in _paths:
        what = {"description": f"{_what}: `{json.dumps(_answer)}`.", "name": _paths[0].strip("/").removeprefix("get_")}
        router.add_api_route(_path, _answering(_answer), methods=[_method], **what)


async def nccl_refused(request: Request):
    """501: NCCL weight sync is not offered; the answer names the HTTP weight routes to use instead."""
    why = f"{request.url.path}: NCCL weight sync is not offered (CPU machines have no NCCL); send the weights over HTTP"
    http = 'POST /update_weights_from_tensor with a safetensors body, or POST /update_weights_from_disk {"model_path": ...}'
    raise APIError(501, f"{why}: {http} (see docs/guides/rl-rollouts.md)", kind="not_implemented")


for _path in _NCCL_ROUTES:
    router.add_api_route(_path, nccl_refused, methods=["POST"])


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
            why = f"prompts[{i}] ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the context ({context})"
            raise APIError(400, why, f"prompts[{i}]")
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
        same = {k: getattr(req, k) for k in ("temperature", "top_p", "min_p", "repetition_penalty")}
        params = SamplingParams(**same, top_k=max(req.top_k, 0))
    except ValueError as e:
        raise APIError.bad_value(e) from None
    ids = await asyncio.to_thread(_prompts, eng, req, served.context)  # tokenizing: off the event loop
    try:  # every check before queueing
        if eng.strict_on_policy:
            check_on_policy(params)
        spec, seed = eng.job(
            ids,
            req.n,
            params,
            max_new_tokens=req.max_tokens,
            seed=kw.seed,
            stop=kw.stop or (),
            ignore_eos=kw.ignore_eos,
        )
    except ValueError as e:
        raise APIError.bad_value(e) from None
    key = uuid.uuid4().hex  # the rollout's requests under keys unique in the server's session: (key, i)
    job = Job([r.keyed((key, i)) for i, r in enumerate(spec.requests)], key=key, group=req.n)
    call = Call(job, asyncio.get_running_loop())  # the queue's limits as /v1; a deadline only if one was given
    run = served.enqueue(Run(served, call, request, [len(p) for p in ids]), "prompts", served.rollout_timeout)
    request.app.state.rl_jobs.add(call)  # /abort_request ends it
    try:
        done = await run.collect()
    finally:
        request.app.state.rl_jobs.discard(call)
    if done is None:  # the client went away: its samples were aborted
        return Response(status_code=499)
    return _generated(eng, spec, seed, ids, done, job)


def _generated(eng: RolloutEngine, spec, seed: int, ids: list[list[int]], done: list, job: Job) -> GenerateResponse:
    outs = [eng.rollout(c, seed, key=spec.requests[c.index].key) for c in done]
    seqs, version = [o.with_eos() for o in outs], job.weight_version
    figures = {"draft_tokens": "drafted", "accepted_tokens": "accepted", "target_passes": "target_passes"}
    spec = Speculation(**{k: sum(getattr(o.stats, v) for o in outs) for k, v in figures.items()})
    return GenerateResponse(
        prompt_ids=ids,
        completion_ids=[t for t, _ in seqs],
        logprobs=[lp for _, lp in seqs],
        finish_reasons=[o.finish_reason for o in outs],
        speculation=spec,
        weight_version=eng.weight_version if version is None else version,
    )


@dataclass
class WeightRoutes:
    """Who may replace the served model over HTTP: nobody unless `enabled`; from disk, only files under `dirs`
    (resolved). Uploads are taken one at a time (`lock`), each written to a temporary file as it arrives."""

    enabled: bool = False
    dirs: tuple[Path, ...] = ()
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _cap: list = field(default_factory=list)  # the upload cap, computed once

    def check(self) -> None:
        if not self.enabled:
            why = "weight updates are off on this server: start it with --enable-weight-updates (and --api-key)"
            raise APIError(403, why, code="weight_updates_disabled")

    def upload_cap(self, eng: RolloutEngine) -> int | None:
        """The largest body an update may be: every tensor of the target once, plus 64 MiB for the safetensors
        header (None: the target is no torch model, and takes no updates)."""
        if not self._cap:
            model = eng.target.model
            tensors = model.state_dict().values() if isinstance(model, torch.nn.Module) else None
            size = None if tensors is None else sum(t.numel() * t.element_size() for t in tensors)
            self._cap.append(None if size is None else size + (64 << 20))
        return self._cap[0]

    def files(self, path: str) -> list[Path]:
        """The safetensors files of `path` (a file, or a directory's *.safetensors), each resolved and under one
        of `dirs`; one 400 for a path outside them, missing or unreadable (nothing said about which)."""
        if not self.dirs:
            raise APIError(400, "this server reads no weights from disk: start it with --weight-dir DIR", "model_path")
        why = f"model_path {path!r} is no readable safetensors file or directory under the server's --weight-dir"
        refused = APIError(400, why, "model_path")
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


async def _update(request: Request, fn) -> WeightUpdateResponse:
    try:
        up = await request.app.state.engine.run_between_jobs(fn)
    except WeightUpdateError as e:
        raise APIError(400, str(e)) from None
    except Closing:
        raise APIError(503, "the server is shutting down", kind="server_error") from None
    request.app.state.metrics.observe_weight_update(up.version)
    figures = {k: getattr(up, k) for k in ("tensors", "seconds", "requantize_seconds")}
    return WeightUpdateResponse(weight_version=up.version, **figures)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> WeightUpdateResponse:
    """Replace weights in place from a safetensors body (`application/octet-stream`); needs
    `--enable-weight-updates`. Runs between requests; a bad update is a 400 that changes nothing."""
    eng, routes = _rollout(request), request.app.state.weight_routes
    routes.check()
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    if kind != "application/octet-stream":
        raise APIError(415, f"send the safetensors bytes as content-type application/octet-stream, not {kind!r}")
    if routes.upload_cap(eng) is None:  # say why (a llama.cpp model's weights come from its file) before reading
        return await _update(request, lambda: eng.update_weights([]))
    async with routes.lock:  # one upload in memory at a time; the others wait unread
        with tempfile.TemporaryDirectory(prefix="verispec-upload-") as tmp:
            path = Path(tmp) / "update.safetensors"
            try:  # written as it arrives (counted against its cap by `serve.access.BodyLimit`)
                with path.open("wb") as f:
                    size = sum([f.write(chunk) async for chunk in request.stream()])
            except ClientDisconnect:  # the client went away mid-body
                return Response(status_code=499)
            if not size:
                raise APIError(400, "the body must be a safetensors file's bytes of the model's tensors")
            return await _update(request, lambda: eng.update_weights(load_safetensors_files([path], "the body")))


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(req: DiskUpdate, request: Request) -> WeightUpdateResponse:
    """Replace weights in place from a safetensors file or directory under `--weight-dir`; needs
    `--enable-weight-updates`."""
    eng, routes = _rollout(request), request.app.state.weight_routes
    routes.check()
    files = await asyncio.to_thread(routes.files, req.model_path)
    return await _update(request, lambda: eng.update_weights(load_safetensors_files(files)))


@router.get("/get_weight_version")
async def weight_version(request: Request):
    """The current weight version (it counts updates)."""
    return {"weight_version": _rollout(request).weight_version}


@router.post("/abort_request")
async def abort(body: AbortRequest, request: Request):
    """End the running and waiting /generate/ calls after their current step (unfinished samples end "abort")."""
    for call in list(request.app.state.rl_jobs):
        request.app.state.engine.expire(call)
    _rollout(request).abort()  # a RolloutEngine.generate called by anyone else
    return {"success": True}
