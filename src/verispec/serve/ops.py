"""What operators need around the model routes: GET /health, /v1/models (and /v1/models/{id}: 404 for another id),
/metrics and /version, and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import Response
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import Field

from .. import __version__
from .bodies import OffLoopRoute, offload
from .errors import APIError
from .jobs import Served
from .protocol import MAX_TOKEN_LIST, Messages, ModelCard, ModelList, Strict, Text

__all__ = ["router"]

router = APIRouter(route_class=OffLoopRoute)  # large bodies validated off the event loop


class TokenizeRequest(Strict):
    model: Text | None = None
    prompt: Text | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: Text | None = None
    tokens: Annotated[list[int], Field(max_length=MAX_TOKEN_LIST)]


def _served(request: Request, model: str | None) -> Served:
    served: Served = request.app.state.served
    if model is not None:
        served.check_model(model)
    return served


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> Response:
    """vLLM's /tokenize: a prompt or chat messages as token ids, with `count` and `max_model_len`. Tokenized and
    answered (its JSON text built) off the event loop (`serve.bodies.offload`)."""
    served = _served(request, req.model)
    size = len(req.prompt) if req.prompt is not None else sum(len(m.text()) for m in req.messages or ())
    return Response(await offload(size, _tokenized, served, req), media_type="application/json")


def _tokenized(served: Served, req: TokenizeRequest) -> bytes:
    """The answer as JSON text, as FastAPI's JSONResponse writes it: built here, not by FastAPI on the event loop (its
    jsonable_encoder walks a list of 2M token ids for seconds)."""
    tok = served.gen.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        ids = list(tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
    else:
        if getattr(tok, "chat_template", None) is None:
            raise APIError(400, "the model's tokenizer has no chat template", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            enc = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, tokenize=True)
        except (TemplateError, ValueError) as e:  # the template's raise_exception(...): the request's fault
            raise APIError(400, str(e), "messages") from None
        ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    answer = {"count": len(ids), "max_model_len": served.context, "tokens": [int(t) for t in ids]}
    return json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    """vLLM's /detokenize: token ids as text."""
    served = _served(request, req.model)
    tokens = served.token_ids(req.tokens, "tokens")
    return {"prompt": await asyncio.to_thread(served.gen.tokenizer.decode, tokens)}


@router.get("/health")
async def health():
    """Liveness: `{"status": "ok"}` (no API key needed; 503 once a shutdown starts)."""
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    """The served model: its id (what clients send as `model`) and `max_model_len`."""
    return ModelList(data=[await model_card(request.app.state.served.model_id, request)])


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    """Prometheus metrics, vLLM's names with a `verispec:` prefix (no API key needed)."""
    served: Served = request.app.state.served
    served.metrics.set_queue(served.engine.num_waiting, served.engine.num_running)
    return Response(served.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version():
    """verispec's version (no API key needed)."""
    return {"version": __version__}


@router.get("/v1/models/{model_id:path}")
async def model_card(model_id: str, request: Request) -> ModelCard:
    """The served model's card, by its id (404 for another id)."""
    served = _served(request, model_id)
    return ModelCard(id=served.model_id, max_model_len=served.context)
