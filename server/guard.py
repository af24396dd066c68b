"""Which requests reach the routes at all: the name the client was pointed at (Host), the web page that sent
the request (Origin), a body's Content-Type, and the API key.

Without an API key any web page the user opens could drive a local server: a `text/plain` POST needs no
CORS preflight, and DNS rebinding points an attacker's own name at 127.0.0.1, making the page
same-origin with the server. So a request from a page whose Origin is not allowed (`--allowed-origins`)
is a 403, every POST needs `Content-Type: application/json` (which a page can send cross-site only after
a preflight that the Origin check answers), and, without an API key, a Host naming neither an IP
address, `localhost`, `--host` nor an `--allowed-hosts` name is a 421 (as the MCP SDKs answer): a
rebound request always carries the attacker's name, and a browser sends an address as the Host only for
a page at that address. With a key a page cannot authenticate, so the Host check is left off.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.responses import Response

from server.errors import APIError, short

# Besides /v1, what tells of others' requests (prefix-cache counts) or of the served model's files.
GUARDED = ("/metrics", "/tokenize", "/detokenize", "/tokenizer_info")
PREFLIGHT_MAX_AGE_S = 600


def host_name(host: str) -> str:
    """A Host header's name, without port: `[::1]:8000` -> `::1`, `Kiln.LAN.:80` -> `kiln.lan`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class RequestGuard:
    """Host, Origin and Content-Type checks, and CORS for the allowed origins (see the module's doc).

    `allowed_hosts` None: no Host check (an app that serve() did not bind: tests, embedding);
    `"*"` in either list allows any."""

    def __init__(self, app, allowed_origins: Iterable[str] = (), allowed_hosts: Iterable[str] | None = None):
        self.app = app
        self.origins = {o.strip().lower().rstrip("/") for o in allowed_origins if o.strip()}
        self.hosts = None if allowed_hosts is None else {host_name(h) for h in allowed_hosts if h.strip()}
        if self.hosts is not None and "*" in self.hosts:
            self.hosts = None

    def host_allowed(self, host: str | None) -> bool:
        if self.hosts is None or host is None:  # no Host: HTTP/1.0, never a browser
            return True
        name = host_name(host)
        return _is_ip(name) or name == "localhost" or name in self.hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not self.host_allowed(headers.get("host")):
            error = APIError(
                421,
                "this server does not answer to that Host name: kiln serve --allowed-hosts NAME adds one",
                code="host_not_allowed",
            )
            await error.response()(scope, receive, send)
            return
        origin, method = headers.get("origin"), scope.get("method")
        if origin is not None and "*" not in self.origins and origin.lower().rstrip("/") not in self.origins:
            error = APIError(
                403,
                f"requests from web pages at {short(origin)} are refused: kiln serve --allowed-origins "
                "ORIGIN accepts them",
                code="origin_not_allowed",
            )
            await error.response()(scope, receive, send)
            return
        if origin is not None and method == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(origin, headers)(scope, receive, send)
            return
        if origin is not None:  # an allowed page reads every answer, refusals included
            send = _with_cors(send, origin)
        if method == "POST":
            media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media_type != "application/json":
                error = APIError(
                    415,
                    "the request body must be JSON: send 'Content-Type: application/json'",
                    code="unsupported_media_type",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _preflight(origin: str, headers: Headers) -> Response:
        return Response(
            status_code=204,
            headers={
                "Access-Control-Allow-Origin": origin,
                "Access-Control-Allow-Methods": "GET, POST",
                "Access-Control-Allow-Headers": headers.get(
                    "access-control-request-headers", "authorization, content-type"
                ),
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                "Vary": "Origin",
            },
        )


def _with_cors(send, origin: str):
    """`send` that lets the page at `origin` read the response."""
    extra = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    async def wrapped(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every /v1 route and on GUARDED; /health and /version stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and (path == "/v1" or path.startswith("/v1/") or path in GUARDED)
        ):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                error = APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
