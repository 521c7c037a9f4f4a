"""`verispec serve`: an OpenAI-compatible HTTP server over a SpeculativeGenerator.

Endpoints: GET /health, GET /v1/models, POST /v1/completions (`serve.completions`), POST /v1/chat/completions
(`serve.chat`), GET /metrics (`serve.metrics`), the operators' routes (`serve.ops`), and the RL routes (TRL's
/generate/, weight updates over HTTP: `serve.rl`). Requests are validated in the handler (400 with an OpenAI-style
error object naming the field; 404 for an unknown model or route; see `serve.errors`; a large body is parsed and
validated off the event loop, `serve.bodies`), then run by the engine
thread with continuous batching (`serve.engine`); a shutdown drains them (`serve.shutdown`). Logprobs are the target model's raw log-softmax (temperature 1, nothing
truncated) at each returned token — the same convention as vLLM's default and what RL importance ratios need.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine.generator import SpeculativeGenerator
from ..rollout import RolloutEngine
from . import chat, completions, ops, rl
from .access import DEFAULT_MAX_REQUEST_BYTES, LOOPBACK_HOSTS
from .chat import check_chat_template
from .engine import EngineThread
from .errors import install_error_handlers
from .jobs import Served
from .limits import DEFAULT_MAX_QUEUE, DEFAULT_MAX_QUEUE_TOKENS, DEFAULT_REQUEST_TIMEOUT_S
from .metrics import Metrics
from .protocol import ModelCard, ModelList
from .rl import WeightRoutes
from .scoring import PromptScorer
from .shutdown import Gate, GateState
from .transport import DEFAULT_BODY_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S, install_transport

__all__ = ["create_app", "served_model_id"]

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


def create_app(
    gen: SpeculativeGenerator,
    model_name: str,
    *,
    max_batch: int = 8,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_queue_tokens: int = DEFAULT_MAX_QUEUE_TOKENS,
    retry_after_s: int = 1,
    strict_on_policy: bool = True,
    api_key: str | None = None,
    cors_origins: list[str] | None = None,
    max_model_len: int | None = None,
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S,
    rollout_timeout: float | None = None,
    chat_template: str | None = None,
    enable_weight_updates: bool = False,
    weight_dirs: Sequence[str | os.PathLike] = (),
    allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    read_timeout: float = DEFAULT_READ_TIMEOUT_S,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
) -> FastAPI:
    """The OpenAI-compatible server over a generator (what `verispec serve` runs), as a FastAPI app.

    Concurrent requests are decoded together by an engine thread (continuous batching); the RL routes run a
    `RolloutEngine` on the same generator. Run the app with `serve.shutdown.serve` for a graceful shutdown.

    Args:
        gen: The generator to serve.
        model_name: A name, path or display string; it becomes the plain id that clients send and /v1/models
            lists (`served_model_id`). A request naming `model_name` itself is accepted too.
        max_batch: Rows (choices) decoded together.
        max_queue: Choices (prompts x n) that may wait for a batch row; beyond, 429 with Retry-After. A request
            with more choices than max_batch + max_queue is refused (400).
        max_queue_tokens: Prompt tokens the waiting choices may hold (a prompt shared by n choices once); beyond,
            429 (a request that would wait alone is let in; one that could never fit, 400).
        retry_after_s: The Retry-After of a 429 or 503.
        strict_on_policy: The RL routes refuse options whose logprobs a trainer cannot recompute (see
            RolloutEngine).
        api_key: Require `Authorization: Bearer KEY` on every route but /health, /version and /metrics (see
            `serve.ops`).
        cors_origins: Origins allowed to call from a browser ('*' for any).
        max_model_len: The most tokens a request may hold, prompt and completion (at most the model's context;
            None: the model's).
        request_timeout: Seconds from a request's arrival after which its unfinished choices end with
            finish_reason "abort", on the OpenAI routes (default 600; None: no limit).
        rollout_timeout: The same for the RL route /generate/ (default None: no limit; a rollout cut at a deadline
            comes back "abort" and a trainer would train on it).
        chat_template: A Jinja template's text (`serve.chat.load_chat_template` reads --chat-template's file) that
            replaces the tokenizer's, for chat completions and /tokenize (set on gen's tokenizer).
        enable_weight_updates: Let the weight routes change the model (off: they answer 403).
        weight_dirs: The directories /update_weights_from_disk may read under.
        allowed_hosts: The Host names answered (default: loopback's; None: any; `serve.access.allowed_hosts`
            computes them for a bind address).
        max_request_bytes: Every body's cap but a weight upload's (the model's size).
        read_timeout: The seconds a body may go without bytes (then 408), and headers may take
            (`serve.shutdown.serve`).
        body_timeout: The seconds a whole body may take from its first read, plus one per MiB received (then 408;
            `serve.transport`).

    Returns:
        The app (its engine thread starts with the app's lifespan).

    Raises:
        ValueError: A limit out of range, or a chat template that does not compile.
    """
    _check_limits(gen, max_model_len, request_timeout)
    _check_limits(gen, max_model_len, rollout_timeout)
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an integer >= 1, got {max_request_bytes!r}")
    routes = WeightRoutes(enable_weight_updates, _weight_dirs(weight_dirs))
    if chat_template is not None:
        gen.tokenizer.chat_template = check_chat_template(chat_template)
    served = _served(gen, model_name, (max_batch, max_queue, max_queue_tokens), retry_after_s, max_model_len)
    served.request_timeout, served.rollout_timeout = request_timeout, rollout_timeout
    engine, metrics, model_id = served.engine, served.metrics, served.model_id

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info("serving model id %r (context %s tokens)", model_id, served.context)
        yield
        engine.stop()
        log.info("stopped; %s", metrics.summary())

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.served, app.state.engine, app.state.metrics = served, engine, metrics
    app.state.rl_jobs = set()  # the running and waiting /generate/ jobs (/abort_request expires them)
    app.state.rollout = rollout = RolloutEngine.from_generator(
        gen, max_batch_size=max_batch, strict_on_policy=strict_on_policy
    )
    app.state.weight_routes = routes
    app.state.gate = GateState()  # requests in flight; 503 once a shutdown starts (`serve.shutdown`)
    install_error_handlers(app)
    upload = {"/update_weights_from_tensor": lambda: routes.upload_cap(rollout) or max_request_bytes}
    ops.install_access(app, api_key, cors_origins, allowed_hosts, max_request_bytes, upload)
    install_transport(app, read_timeout, body_timeout)  # outside the body cap: a slow body ends 408, a shutdown 503
    app.add_middleware(Gate, state=app.state.gate, retry_after_s=retry_after_s)
    _routes(app)
    return app


def _served(gen, model_name: str, queue: tuple[int, int, int], retry_after_s: int, max_model_len) -> Served:
    """The handlers' shared state: the engine thread (queue: max_batch, max_queue, max_queue_tokens), metrics and
    prompt scorer under the served model id."""
    model_id = served_model_id(model_name)
    metrics, scorer = Metrics(model_id), PromptScorer(gen)
    max_batch, max_queue, max_queue_tokens = queue
    engine = EngineThread(
        gen, max_batch=max_batch, max_queue=max_queue, max_queue_tokens=max_queue_tokens, metrics=metrics, scorer=scorer
    )
    return Served(gen, engine, metrics, model_id, frozenset({model_name}), retry_after_s, max_model_len, scorer=scorer)


def _routes(app: FastAPI) -> None:
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    for module in (completions, chat, rl, ops):
        app.include_router(module.router)


def _weight_dirs(dirs: Sequence[str | os.PathLike]) -> tuple[Path, ...]:
    if isinstance(dirs, (str, os.PathLike)):
        dirs = [dirs]
    out = []
    for d in dirs:
        p = Path(d).expanduser().resolve()
        if not p.is_dir():
            raise ValueError(f"--weight-dir {d}: no such directory")
        out.append(p)
    return tuple(out)


def _check_limits(gen: SpeculativeGenerator, max_model_len: int | None, request_timeout: float | None) -> None:
    if max_model_len is not None:
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if gen.max_positions is not None and max_model_len > gen.max_positions:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context ({gen.max_positions} tokens)")
    if request_timeout is not None and not request_timeout > 0:
        raise ValueError(f"request_timeout must be a number of seconds > 0, got {request_timeout!r}")


async def health():
    """Liveness: `{"status": "ok"}` (no API key needed; 503 once a shutdown starts)."""
    return {"status": "ok"}


async def models(request: Request) -> ModelList:
    """The served model: its id (what clients send as `model`) and `max_model_len`."""
    served: Served = request.app.state.served
    return ModelList(data=[ModelCard(id=served.model_id, max_model_len=served.context)])


async def prometheus(request: Request) -> Response:
    """Prometheus metrics, vLLM's names with a `verispec:` prefix (no API key needed)."""
    served: Served = request.app.state.served
    served.metrics.set_queue(served.engine.num_waiting, served.engine.num_running)
    return Response(served.metrics.render(), media_type=CONTENT_TYPE_LATEST)
