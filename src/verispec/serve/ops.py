"""What operators need around the model routes: an API key, CORS, tokenizer routes, the version, one model's card.

--api-key, --allowed-host, --max-request-bytes: `serve.access`. --cors-origin O (repeatable, "*" for any): CORS
headers and preflight answers for those origins (CORS is checked before the key, so preflights need none).

POST /tokenize   {model?, prompt | messages, add_special_tokens = true, add_generation_prompt = true}
                 -> {count, max_model_len, tokens}          (vLLM's shapes)
POST /detokenize {model?, tokens} -> {prompt}
GET  /version    {"version": verispec's}
GET  /v1/models/{id} the model's card, 404 for another id
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field

from .. import __version__
from .access import BodyLimit, HostCheck, KeyCheck
from .bodies import OffLoopRoute, offload
from .errors import APIError
from .jobs import Served
from .protocol import MAX_TOKEN_LIST, Messages, ModelCard, Text

__all__ = ["install_access", "router"]

router = APIRouter(route_class=OffLoopRoute)  # large bodies validated off the event loop


def install_access(
    app: FastAPI,
    api_key: str | None,
    cors_origins: list[str] | None,
    hosts: tuple[str, ...] | None,
    max_request_bytes: int,
    streamed: dict,
) -> None:
    """Outermost first: the Host check, CORS (a browser's preflight carries no key), the key, the body caps
    (`serve.access`; bodies are read only for requests that passed the key)."""
    app.add_middleware(BodyLimit, limit=max_request_bytes, streamed=streamed)
    if api_key is not None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        app.add_middleware(KeyCheck, key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"], allow_headers=["*"])
    if hosts is not None:
        app.add_middleware(HostCheck, hosts=hosts)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    prompt: Text | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
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
    answered (its JSON text built) off the event loop; a long input in the heavy worker, one at a time, with the
    memory handed back after it (`serve.bodies.offload`)."""
    served = _served(request, req.model)
    size = len(req.prompt) if req.prompt is not None else sum(len(m.text()) for m in req.messages or ())
    return Response(await offload(size, _tokenized, served, req), media_type="application/json")


def _tokenized(served: Served, req: TokenizeRequest) -> bytes:
    """`_tokenize`'s answer as JSON text, as FastAPI's JSONResponse writes it. Built here, not by FastAPI on the event
    loop: its jsonable_encoder walks a list of 2M token ids for seconds."""
    answer = _tokenize(served, req)
    return json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _tokenize(served: Served, req: TokenizeRequest) -> dict:
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
    return {"count": len(ids), "max_model_len": served.context, "tokens": [int(t) for t in ids]}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    """vLLM's /detokenize: token ids as text."""
    served = _served(request, req.model)
    vocab = served.gen.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids must lie in [0, {vocab}), got {bad[:3]}", "tokens")
    return {"prompt": await asyncio.to_thread(served.gen.tokenizer.decode, req.tokens)}


@router.get("/version")
async def version():
    """verispec's version (no API key needed)."""
    return {"version": __version__}


@router.get("/v1/models/{model_id:path}")
async def model_card(model_id: str, request: Request) -> ModelCard:
    """The served model's card, by its id (404 for another id)."""
    served = _served(request, model_id)
    return ModelCard(id=served.model_id, max_model_len=served.context)
