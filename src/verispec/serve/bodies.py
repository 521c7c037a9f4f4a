"""Heavy request work kept off the event loop, one job at a time, with the memory given back after it.

- `OffLoopRoute`: the route class of the JSON routes (completions, chat, /tokenize, /detokenize). A JSON body of
  `OFF_LOOP_BYTES` or more is parsed (`json.loads`) and validated (the route's pydantic model, exactly as FastAPI
  would) in the body worker, one body at a time; FastAPI then finds the validated model and accepts it as it is.
  On the event loop, 20 concurrent chat bodies of 100k content parts each (~0.7 s of validation apiece) held
  /health for seconds; in the worker, the loop only waits for the GIL between the worker's steps (json.loads of a
  4 MiB body, the longest single step, is some 50 ms). Smaller bodies take FastAPI's own path (a thread hop would
  cost more than they do).
- `run_heavy(fn, ...)`: a job over a large input (tokenizing a long prompt: a 3.9 MB prompt is ~2M tokens, ~0.4 GB
  of the tokenizer's buffers) runs in the heavy worker, one at a time, and `release_memory()` follows it. Run
  concurrently in the default pool's threads, each thread's malloc arena kept what it had freed: RSS rose by GBs
  and stayed there. One thread reuses one arena, and glibc's `malloc_trim` hands the free pages back to the system.
"""

from __future__ import annotations

import asyncio
import ctypes
import email.message
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import params
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request

__all__ = ["HEAVY_CHARS", "OFF_LOOP_BYTES", "OffLoopRoute", "offload", "release_memory", "run_heavy"]

OFF_LOOP_BYTES = 64 << 10  # a JSON body this large or larger is parsed and validated in the body worker
HEAVY_CHARS = 64 << 10  # an input this long or longer (characters or token ids) is a heavy job (`offload`)
log = logging.getLogger("verispec.serve")
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
    """Hand the malloc heap's free pages back to the system (glibc's malloc_trim, every arena; a no-op elsewhere).
    Some milliseconds: call it after a large job, not after every request."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _heavy_job(fn: Callable[..., T], args: tuple) -> T:
    try:
        return fn(*args)
    finally:
        release_memory()  # fn's intermediates are freed by now; what it returns is what the caller keeps


async def run_heavy(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in the heavy worker (one job at a time, queued in order), then `release_memory()`."""
    return await asyncio.get_running_loop().run_in_executor(_HEAVY, _heavy_job, fn, args)


async def offload(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` off the event loop: in the heavy worker when `size` (the input's characters or token ids) is
    `HEAVY_CHARS` or more (`run_heavy`), else in the default pool (`asyncio.to_thread`)."""
    if size >= HEAVY_CHARS:
        return await run_heavy(fn, *args)
    return await asyncio.to_thread(fn, *args)


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this content type as JSON (its rule: application/json or +json; none at
    all is not, with its strict_content_type default)."""
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
    """An APIRoute whose large JSON body (`OFF_LOOP_BYTES` or more) is parsed and validated in the body worker.
    The validated model is left where Starlette caches a request's parsed JSON, so FastAPI's own validation sees an
    instance of the model and passes it through (pydantic does not revalidate instances); a body that fails gets
    the same RequestValidationError FastAPI raises. Routes with no body, or several body parameters, are left as
    FastAPI builds them."""

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
