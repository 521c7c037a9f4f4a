"""Heavy request work kept off the event loop, one job at a time, with the memory given back after it.
`OffLoopRoute`: a JSON body of `OFF_LOOP_BYTES` or more is parsed and validated in the body worker (on the loop, 20
chat bodies of 100k content parts held /health for seconds; smaller bodies take FastAPI's own path). `offload`: a job
over a large input (a 3.9 MB prompt is ~2M tokens, ~0.4 GB of tokenizer buffers) runs in the heavy worker, then
`release_memory()` (glibc's `malloc_trim`: run concurrently in the default pool, RSS rose by GBs and stayed there)."""

from __future__ import annotations

import asyncio
import ctypes
import email.message
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import params
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request

__all__ = ["HEAVY_CHARS", "OFF_LOOP_BYTES", "OffLoopRoute", "offload", "release_memory"]

OFF_LOOP_BYTES = 64 << 10  # a JSON body this large or larger is parsed and validated in the body worker
HEAVY_CHARS = 64 << 10  # an input this long or longer (characters or token ids) is a heavy job (`offload`)
T = TypeVar("T")

# One worker each: a second thread would not run Python any faster (the GIL), only add another claimant the event
# loop waits behind, and another malloc arena.
_BODIES = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verispec-body")
_HEAVY = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verispec-heavy")


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


def release_memory() -> None:
    """Hand the malloc heap's free pages back to the system (glibc's malloc_trim; a no-op elsewhere): some ms."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _heavy_job(fn: Callable[..., T], args: tuple) -> T:
    try:
        return fn(*args)
    finally:
        release_memory()  # fn's intermediates are freed by now; what it returns is what the caller keeps


async def offload(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` off the event loop: when `size` (the input's characters or token ids) is `HEAVY_CHARS` or more in
    the heavy worker (one job at a time, in order) and then `release_memory()`, else in the default pool."""
    if size >= HEAVY_CHARS:
        return await asyncio.get_running_loop().run_in_executor(_HEAVY, _heavy_job, fn, args)
    return await asyncio.to_thread(fn, *args)


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this content type as JSON (application/json or +json; not none at all)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _parse_and_validate(field, body: bytes) -> Any:
    """What FastAPI does with a JSON body for a route with one body model (its errors too), in this thread."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([error | {"ctx": {"error": e.msg}}], body=e.doc) from None
    model, errors = field.validate(value, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=value)
    return model


class OffLoopRoute(APIRoute):
    """An APIRoute whose large JSON body is parsed and validated in the body worker, the model left where Starlette
    caches a request's parsed JSON (FastAPI passes the instance through; a bad body gets FastAPI's own error). Routes
    with no body, or several body parameters, are left as FastAPI builds them."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        field = self.body_field
        one_model = len(self.dependant.body_params) == 1 and not getattr(self, "_embed_body_fields", True)
        if field is None or not one_model or isinstance(field.field_info, params.Form):
            return handler

        async def off_loop(request: Request):
            body = await request.body()  # already read whole by `serve.access.BodyLimit`
            if len(body) >= OFF_LOOP_BYTES and _is_json(request.headers.get("content-type")):
                loop = asyncio.get_running_loop()
                request._json = await loop.run_in_executor(_BODIES, _parse_and_validate, field, body)
            return await handler(request)

        return off_loop
