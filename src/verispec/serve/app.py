"""`verispec serve`: an OpenAI-compatible HTTP server over a SpeculativeGenerator (docs/guides/serving.md), its routes
in `serve.ops`, `.completions`, `.chat` and `.rl`. Logprobs are the target's raw log-softmax (temperature 1, nothing
truncated) at each returned token: vLLM's default, and what RL importance ratios need."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from fastapi import FastAPI

from ..engine.generator import SpeculativeGenerator
from ..rollout import RolloutEngine
from . import chat, completions, ops, rl
from .access import DEFAULT_MAX_REQUEST_BYTES, LOOPBACK_HOSTS, install_access
from .chat import check_chat_template
from .engine import EngineThread
from .errors import install_error_handlers
from .jobs import Served
from .limits import DEFAULT_MAX_QUEUE, DEFAULT_MAX_QUEUE_TOKENS, DEFAULT_REQUEST_TIMEOUT_S
from .logs import DEFAULT_LOG_STATS_INTERVAL_S, AccessLog, StatsLogger
from .metrics import Metrics
from .online import SAVE_INTERVAL_S, OnlineKeeper
from .rl import WeightRoutes
from .scoring import PromptScorer
from .shutdown import Gate, GateState
from .transport import DEFAULT_BODY_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S, install_transport

__all__ = ["ServeOptions", "create_app", "served_model_id"]

log = logging.getLogger("verispec.serve")

_MODEL_FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def served_model_id(name: str) -> str:
    """The plain model id the server reports and accepts, from a model's name, path or display string.

    `SmolLM2-135M-Instruct (Q4_1 GGUF)` -> `SmolLM2-135M-Instruct`, `~/models/qwen2.5-0.5b-q4_k_m.gguf` ->
    `qwen2.5-0.5b-q4_k_m`, a local folder -> its name; a hub id (`Qwen/Qwen2.5-0.5B`) stays as it is.
    Parenthesised remarks go, and what is left of spaces and other odd characters becomes `-`.

    Args:
        name: A model's name, path or display string.

    Returns:
        The model id ("model" when nothing is left).
    """
    s = re.sub(r"\([^)]*\)", " ", str(name)).strip().rstrip("/\\")
    model_file = s.lower().endswith(_MODEL_FILE_SUFFIXES)
    if model_file or not _HUB_ID.fullmatch(s) or os.path.exists(os.path.expanduser(s)):
        s = os.path.basename(os.path.expanduser(s))
        if model_file:
            s = os.path.splitext(s)[0]
    return re.sub(r"[^\w.:/-]+", "-", s).strip("-") or "model"


@dataclass(frozen=True)
class ServeOptions:
    """How `create_app` serves: each field is one of its keyword arguments (and a `verispec serve` flag).

    Attributes:
        max_batch: Rows (choices) decoded together.
        max_queue: Choices (prompts x n) that may wait for a batch row; beyond, 429 (more than max_batch +
            max_queue in one request: 400).
        max_queue_tokens: Prompt tokens the waiting choices may hold (a shared prompt once); beyond, 429.
        retry_after_s: The Retry-After of a 429 or 503.
        strict_on_policy: The RL routes refuse options whose logprobs a trainer cannot recompute (`RolloutEngine`).
        api_key: Require `Authorization: Bearer KEY` on every route but /health, /version and /metrics.
        cors_origins: Origins allowed to call from a browser ('*' for any).
        max_model_len: The most tokens a request may hold, prompt and completion (None: the model's context).
        request_timeout: Seconds after a request's arrival at which its unfinished choices end "abort" (None: never).
        rollout_timeout: The same for /generate/ (default None: a rollout cut at a deadline would be trained on).
        chat_template: A Jinja template's text replacing the tokenizer's (set on gen's tokenizer).
        enable_weight_updates: Let the weight routes change the model (off: they answer 403).
        weight_dirs: The directories /update_weights_from_disk may read under.
        allowed_hosts: The Host names answered (default: loopback's; None: any; `serve.access.allowed_hosts`).
        max_request_bytes: Every body's cap but a weight upload's (the model's size).
        read_timeout: The seconds a body may go without bytes (then 408), and headers may take.
        body_timeout: The seconds a whole body may take from its first read, plus one per MiB received (then 408).
        log_requests: One INFO line per HTTP request on `verispec.serve.access` (`serve.logs.AccessLog`).
        log_stats_interval: Seconds between vLLM's periodic stats lines on `verispec.serve.stats`, logged when
            something happened (`serve.logs.StatsLogger`; None: none).
        online_dir: draft=online: the directory the head is kept in, a new version written at most every
            `online_save_interval` seconds and at shutdown (`serve.online`; start the generator from it with
            `online_config`). None: not kept.
        online_save_interval: Seconds between two saves to online_dir at least.
    """

    max_batch: int = 8
    max_queue: int = DEFAULT_MAX_QUEUE
    max_queue_tokens: int = DEFAULT_MAX_QUEUE_TOKENS
    retry_after_s: int = 1
    strict_on_policy: bool = True
    api_key: str | None = None
    cors_origins: list[str] | None = None
    max_model_len: int | None = None
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S
    rollout_timeout: float | None = None
    chat_template: str | None = None
    enable_weight_updates: bool = False
    weight_dirs: Sequence[str | os.PathLike] = ()
    allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    log_requests: bool = True
    log_stats_interval: float | None = DEFAULT_LOG_STATS_INTERVAL_S
    online_dir: str | os.PathLike | None = None
    online_save_interval: float = SAVE_INTERVAL_S

    def __post_init__(self) -> None:
        for name, low in (("max_model_len", 2), ("max_request_bytes", 1)):
            if (value := getattr(self, name)) is not None and (type(value) is not int or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("request_timeout", "rollout_timeout", "log_stats_interval", "online_save_interval"):
            if (value := getattr(self, name)) is not None and not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")


def create_app(gen: SpeculativeGenerator, model_name: str, **options) -> FastAPI:
    """The OpenAI-compatible server over a generator (what `verispec serve` runs), as a FastAPI app.

    Concurrent requests are decoded together by an engine thread (continuous batching); the RL routes run a
    `RolloutEngine` on the same generator. A draft=online head learns from the traffic, trains while no request
    runs, and is kept in `online_dir` (`serve.online`). Run the app with `serve.shutdown.serve` for a graceful
    shutdown.

    Args:
        gen: The generator to serve.
        model_name: A name, path or display string; it becomes the plain id that clients send and /v1/models
            lists (`served_model_id`). A request naming `model_name` itself is accepted too.
        **options (Any): `ServeOptions`' fields (max_batch, max_queue, request_timeout, api_key, ...), by name.

    Returns:
        The app (its engine thread starts with the app's lifespan).

    Raises:
        ValueError: A limit out of range, a chat template that does not compile, or an online_dir without
            draft=online (or one `serve.online.check_online_dir` refuses).
        TypeError: An option that is not a `ServeOptions` field.
    """
    opts = ServeOptions(**options)
    context = gen.core.max_positions
    if opts.max_model_len is not None and context is not None and opts.max_model_len > context:
        raise ValueError(f"max_model_len {opts.max_model_len} exceeds the model's context ({context} tokens)")
    routes = WeightRoutes(opts.enable_weight_updates, _weight_dirs(opts.weight_dirs))
    if opts.chat_template is not None:
        gen.tokenizer.chat_template = check_chat_template(opts.chat_template)
    served = _served(gen, model_name, opts)
    app = FastAPI(title="verispec", lifespan=partial(_lifespan, served, opts.log_stats_interval))
    app.state.served, app.state.engine, app.state.metrics = served, served.engine, served.metrics
    app.state.rl_jobs = set()  # the running and waiting /generate/ calls (/abort_request expires them)
    rollout = RolloutEngine.from_generator(gen, max_batch_size=opts.max_batch, strict_on_policy=opts.strict_on_policy)
    app.state.rollout, app.state.weight_routes = rollout, routes
    app.state.gate = GateState()  # requests in flight; 503 once a shutdown starts (`serve.shutdown`)
    install_error_handlers(app)
    upload = {"/update_weights_from_tensor": lambda: routes.upload_cap(rollout) or opts.max_request_bytes}
    install_access(app, opts.api_key, opts.cors_origins, opts.allowed_hosts, opts.max_request_bytes, upload)
    install_transport(app, opts.read_timeout, opts.body_timeout)  # outside the body cap: a slow body ends 408
    app.add_middleware(Gate, state=app.state.gate, retry_after_s=opts.retry_after_s)
    if opts.log_requests:  # outermost: every answer has its line, the refusals above too
        app.add_middleware(AccessLog)
    for module in (ops, completions, chat, rl):
        app.include_router(module.router)
    return app


@asynccontextmanager
async def _lifespan(served: Served, stats_interval: float | None, app: FastAPI):
    served.engine.start()
    log.info("serving model id %r (context %s tokens)", served.model_id, served.context)
    if stats_interval is None:
        yield
    else:
        async with StatsLogger(served.metrics, stats_interval).running():
            yield
    served.engine.stop()
    log.info("stopped; %s", served.metrics.summary())


def _served(gen, model_name: str, opts: ServeOptions) -> Served:
    """The handlers' shared state: the engine thread, metrics and prompt scorer under the served model id."""
    metrics = Metrics(served_model_id(model_name))
    engine = EngineThread(
        gen,
        max_batch=opts.max_batch,
        max_queue=opts.max_queue,
        max_queue_tokens=opts.max_queue_tokens,
        metrics=metrics,
        scorer=PromptScorer(gen),
        online=_online(gen, opts),
    )
    limits = (opts.retry_after_s, opts.max_model_len, opts.request_timeout, opts.rollout_timeout)
    return Served(gen, engine, metrics, served_model_id(model_name), frozenset({model_name}), *limits)


def _online(gen, opts: ServeOptions) -> OnlineKeeper | None:
    """draft=online: the served head's keeper (idle training, saves to online_dir); None for other drafters."""
    if gen.learner is None:
        if opts.online_dir is not None:
            why = f"online_dir keeps an online head: serve a draft=online generator, not draft={gen.config.draft}"
            raise ValueError(why)
        return None
    return OnlineKeeper(gen.learner, opts.online_dir, gen.core.runner.num_layers, opts.online_save_interval)


def _weight_dirs(dirs: Sequence[str | os.PathLike]) -> tuple[Path, ...]:
    dirs = [dirs] if isinstance(dirs, (str, os.PathLike)) else list(dirs)
    out = tuple(Path(d).expanduser().resolve() for d in dirs)
    if missing := [d for d, p in zip(dirs, out) if not p.is_dir()]:
        raise ValueError(f"--weight-dir {missing[0]}: no such directory")
    return out
