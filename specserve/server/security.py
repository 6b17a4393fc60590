"""Who may talk to the server: the Host allow-list, API-key checks and the WebSocket Origin allow-list.

- Host (HTTP and WebSocket): DNS rebinding lets a web page whose name now resolves to 127.0.0.1 talk
  to a local server with the page's own name in `Host` (and, for the socket, in `Origin`), so the
  server answers only Host names it knows: the loopback names and the address it is bound to, plus
  `--allowed-hosts` (`*` = any). Anything else gets 400 before any route runs.

- HTTP: `Authorization: Bearer <key>` on every `/v1/*` route and on `/tokenize`, `/detokenize` (`/`,
  `/health`, `/version`, `/metrics` stay open) when the server has an API key.
- WebSocket: the same header, or (browsers cannot set headers) a first message
  `{"type": "session.auth", "api_key": ...}`.
- Origins: browsers send `Origin` on WebSocket handshakes and any page may open a socket to
  127.0.0.1, so the server accepts its own pages (an Origin whose host is on the Host allow-list and
  whose port is the one the server listens on), localhost origins by default, and the
  `--allowed-origins` list instead of localhost when one is given (`*` = any). The Origin is compared
  with those lists, never with the request's own Host header, which a rebinding page controls.
  Clients that send no Origin (not browsers) are not restricted by it.
"""
from __future__ import annotations

import hmac
import json
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def api_key_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison (a timing side channel must not leak the key)."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def allowed_host_names(bind_host: str, extra: list[str] | None = None) -> frozenset[str]:
    """Host names the server answers: loopback names, the bound address, and `extra` (`*` = any)."""
    names = set(LOCAL_HOSTS)
    if bind_host not in ("0.0.0.0", "::", ""):
        names.add(bind_host.lower().strip("[]"))
    names.update(h.strip().lower().strip("[]") for h in extra or [] if h.strip())
    return frozenset(names)


def host_name(host_header: str | None) -> str | None:
    """The name part of a Host header (`example.com:8000` -> `example.com`, `[::1]:80` -> `::1`)."""
    if not host_header:
        return None
    host = host_header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host_header: str | None, names: frozenset[str]) -> bool:
    """Whether a request with this Host header may be served (a missing Host is HTTP/1.0: allowed,
    a rebinding page always sends one)."""
    if "*" in names or host_header is None:
        return True
    return host_name(host_header) in names


def origin_allowed(origin: str | None, host_names: frozenset[str], allowed: list[str] | None,
                   server_port: int | None = None) -> bool:
    """Whether a WebSocket handshake with this Origin may proceed (rules in the module docstring);
    `server_port` is the port the server listens on (its own pages' origin)."""
    if origin is None:
        return True
    if allowed and "*" in allowed:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False  # "null" (sandboxed iframes, file://) and anything odd
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    name = parts.hostname.lower()
    if port == server_port and "*" not in host_names and name in host_names:
        return True  # a page this server served
    if allowed is None:
        return name in LOCAL_HOSTS
    return origin.rstrip("/").lower() in {a.rstrip("/").lower() for a in allowed}


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class TrustedHostMiddleware:
    """Refuses HTTP requests and WebSocket handshakes whose Host is not on the allow-list (400 with
    an OpenAI error body; the socket handshake gets the same answer as an HTTP denial)."""

    def __init__(self, app: ASGIApp, host_names: frozenset[str]) -> None:
        self.app = app
        self.host_names = host_names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"host"), None)
        if host_allowed(host, self.host_names):
            await self.app(scope, receive, send)
            return
        message = (f"this server does not answer for host {host!r} (see --allowed-hosts); "
                   "a page whose name points at this machine is refused so it cannot use the server")
        body = json.dumps(error_body(message, "invalid_request_error", "host_not_allowed")).encode()
        prefix = "websocket.http.response" if scope["type"] == "websocket" else "http.response"
        if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": f"{prefix}.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": f"{prefix}.body", "body": body})


# HTTP paths outside /v1/ that need the key too (vLLM leaves these open; they read the model's tokenizer)
KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})


class ApiKeyMiddleware:
    """Refuses HTTP requests to /v1/* and KEYED_PATHS without the right Bearer key (401, OpenAI error
    body). WebSocket scopes pass through: the socket endpoint checks the header or the first message."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keyed = scope.get("path", "").startswith("/v1/") or scope.get("path") in KEYED_PATHS
        if self.api_key is None or scope["type"] != "http" or not keyed or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        token = bearer_token(headers.get("authorization"))
        if api_key_matches(token, self.api_key):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer <key>'" if token is None
                   else "incorrect API key")
        body = json.dumps(error_body(message, "authentication_error", "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
