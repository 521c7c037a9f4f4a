"""OpenAI-style errors (`{"error": {"message", "type", "param", "code"}}`) for every failure the server answers: a bad
field (400 naming it as the client wrote it: `messages[0].content`), an unknown model or route (404), a fault (500)."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..sampling import ParamError
from .protocol import did_you_mean

__all__ = ["APIError", "install_error_handlers", "internal_error"]

log = logging.getLogger("verispec.serve")


class APIError(Exception):
    """Raised by a handler; answered as an OpenAI-style error object with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.code, self.headers = kind, code, headers

    @classmethod
    def bad_value(cls, e: ValueError, param: str | None = None) -> APIError:
        """A 400 from a ValueError: a ParamError names its field (`temperature must be >= 0 ...`)."""
        if isinstance(e, ParamError):
            return cls(400, f"{e.field} {e.message}", e.field)
        return cls(400, str(e), param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def field_path(loc) -> str | None:
    """A pydantic error location as the request field: ("body", "messages", 0, "content", "str") ->
    "messages[0].content". Drops "body" and the union member tags pydantic adds ("str", "list[int]")."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path or None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict", "TextContent"})


def validation_error(e: RequestValidationError) -> APIError:
    errors = e.errors()
    first = errors[0] if errors else {"loc": ("body",), "type": "missing", "msg": "invalid request"}
    kind, param = first.get("type"), field_path(first.get("loc", ()))
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON")
    if param is None:  # the body itself: absent, empty, or not an object
        what = "empty" if kind == "missing" else "not a JSON object"
        return APIError(400, f"the request body is {what}: send its fields as a JSON object (application/json)")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}: this server does not support it{did_you_mean(param)}", param)
    # A union field fails once per member: name the member that got furthest into the value (a list of parts
    # with a bad part: that part), and where several got as far ("a valid string", "a valid list") say each.
    inside = [x for x in errors if _within(field_path(x.get("loc", ())) or "", param)]
    depth = max(len(x.get("loc", ())) for x in inside)
    param = field_path(next(x for x in inside if len(x.get("loc", ())) == depth)["loc"])
    msgs = dict.fromkeys(str(x.get("msg")) for x in inside if len(x["loc"]) == depth and field_path(x["loc"]) == param)
    return APIError(400, f"{param}: {' or '.join(msgs)}", param)


def _within(path: str, field: str) -> bool:
    return path == field or path.startswith((field + ".", field + "["))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return validation_error(e).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):  # unknown route (404), wrong method (405)
        what = "Invalid URL" if e.status_code == 404 else e.detail
        return APIError(e.status_code, f"{what} ({request.method} {request.url.path})", headers=e.headers).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):  # the server never dies from a request
        return internal_error(e, f"{request.method} {request.url.path}").response()


def internal_error(e: BaseException, where: str) -> APIError:
    """A 500 that says only "internal error" and a request id; the log has the id, where, and the traceback."""
    rid = uuid.uuid4().hex[:16]
    log.error("internal error %s in %s", rid, where, exc_info=(type(e), e, e.__traceback__))
    message = f"internal error (request id {rid}): see the server's log"
    return APIError(500, message, kind="server_error", headers={"X-Request-Id": rid})
