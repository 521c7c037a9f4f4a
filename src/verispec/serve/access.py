"""Who may reach the server, and how much a request may send: ASGI middleware that `install_access` puts on the app
(docs/guides/serving.md, "Security defaults"): the Host check against DNS rebinding (`HostCheck`, 400), --api-key
(`KeyCheck`, 401 but on `OPEN_ROUTES`) and the body caps (`BodyLimit`, 413). Mutating routes take JSON or
octet-stream bodies only, so a browser cannot send them cross-site without a CORS preflight (--cors-origin)."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence

from fastapi.middleware.cors import CORSMiddleware

from .errors import APIError

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "LOOPBACK_HOSTS", "OPEN_ROUTES", "BodyLimit", "HostCheck", "KeyCheck"]
__all__ += ["allowed_hosts", "install_access", "is_loopback"]

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: ~600k prompt token ids; json.loads of that holds the GIL ~50 ms
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_ROUTES = frozenset({"/health", "/health/", "/version", "/metrics"})


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine (0.0.0.0 and :: do not)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> tuple[str, ...] | None:
    """The Host names a server bound to `bind_host` answers: a loopback server its loopback names and `extra`;
    another server `extra` when given, else any (None)."""
    extra = tuple(extra)
    return LOOPBACK_HOSTS + extra if is_loopback(bind_host) else extra or None


def _hostname(value: str) -> str:
    """A Host header's name, without the port: "localhost:8000" -> "localhost", "[::1]:8000" -> "::1"."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _matches(name: str, pattern: str) -> bool:
    pattern = pattern.lower()
    return pattern == "*" or (name.endswith(pattern[1:]) if pattern.startswith("*.") else name == pattern.strip("[]"))


class HostCheck:
    """ASGI middleware: 400 unless the request's Host names one of `hosts` ("*.example.com": any subdomain)."""

    def __init__(self, app, hosts: Iterable[str]):
        self.app, self.hosts = app, tuple(hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = _hostname(dict(scope["headers"]).get(b"host", b"").decode("latin-1"))
            if not any(_matches(host, p) for p in self.hosts):
                message = f"the Host header {host!r} is not one this server answers (add it with --allowed-host)"
                await APIError(400, message, code="invalid_host").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class KeyCheck:
    """ASGI middleware: `Authorization: Bearer <key>` on every HTTP route but the open ones (and preflights)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send):
        guarded = scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in OPEN_ROUTES
        if guarded and not self._authorized(dict(scope["headers"]).get(b"authorization", b"")):
            message = "Incorrect API key provided: send it as 'Authorization: Bearer <key>'"
            await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _too_large(limit: int, size: int | None = None) -> APIError:
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    why = f"the request body has {got}; this route takes at most {limit} (--max-request-bytes)"
    return APIError(413, why, code="too_large")


class BodyLimit:
    """ASGI middleware: request bodies bounded while they are read (chunked ones too; from Content-Length when it says
    so). `limit` bytes for every route but those in `streamed` (path -> a function giving that route's cap, or None),
    which read their own body through a counting `receive`; every other body is read here, whole, before the route
    runs, so a route never sees an unbounded body."""

    def __init__(self, app, limit: int, streamed: Mapping[str, Callable[[], int | None]] | None = None):
        self.app, self.limit, self.streamed = app, limit, dict(streamed or {})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        cap = self.streamed[scope["path"]]() if scope["path"] in self.streamed else self.limit
        size = _content_length(scope)
        try:
            if cap is not None and size is not None and size > cap:
                raise _too_large(cap, size)
            if scope["path"] in self.streamed:
                await self.app(scope, _counting(receive, cap), send)
                return
            body = await _read_all(receive, cap)
        except APIError as e:
            await e.response()(scope, receive, send)
            return
        if body is None:  # the client went away mid-body
            return
        await self.app(scope, _replay(body, receive), send)


def _content_length(scope) -> int | None:
    value = dict(scope["headers"]).get(b"content-length")
    return int(value) if value is not None and value.isdigit() else None


async def _read_all(receive, cap: int | None) -> bytes | None:
    """The whole body (None if the client disconnected first); APIError 413 past `cap`, counted as it arrives."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if cap is not None and size > cap:
            raise _too_large(cap)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """A `receive` that gives the body already read, then whatever the connection says (a disconnect)."""
    first = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return first.pop() if first else await receive()

    return replay


def _counting(receive, cap: int | None):
    """A `receive` that raises APIError 413 once the body passes `cap` bytes (for routes that stream it)."""
    size = 0

    async def counted():
        nonlocal size
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if cap is not None and size > cap:
                raise _too_large(cap)
        return message

    return counted


def install_access(
    app,
    api_key: str | None,
    cors_origins: Sequence[str] | None,
    hosts: Sequence[str] | None,
    max_request_bytes: int,
    streamed: Mapping[str, Callable[[], int | None]],
) -> None:
    """Outermost first: the Host check, CORS (a browser's preflight carries no key), the key, the body caps (bodies are
    read only for requests that passed the key)."""
    app.add_middleware(BodyLimit, limit=max_request_bytes, streamed=streamed)
    if api_key is not None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        app.add_middleware(KeyCheck, key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"], allow_headers=["*"])
    if hosts is not None:
        app.add_middleware(HostCheck, hosts=hosts)
