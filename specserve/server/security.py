"""Who may talk to the server: API-key checks and the WebSocket Origin allow-list.

- HTTP: `Authorization: Bearer <key>` on every `/v1/*` route (`/`, `/health`, `/version`, `/metrics`
  stay open) when the server has an API key.
- WebSocket: the same header, or (browsers cannot set headers) a first message
  `{"type": "session.auth", "api_key": ...}`.
- Origins: browsers send `Origin` on WebSocket handshakes and any page may open a socket to
  127.0.0.1, so the server accepts its own host always, localhost origins by default, and the
  `--allowed-origins` list instead of localhost when one is given (`*` = any). Clients that send no
  Origin (not browsers) are not restricted by it.
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


def origin_allowed(origin: str | None, host: str | None, allowed: list[str] | None) -> bool:
    """Whether a WebSocket handshake with this Origin (and Host header) may proceed."""
    if origin is None:
        return True
    if allowed and "*" in allowed:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False  # "null" (sandboxed iframes, file://) and anything odd
    if host and parts.netloc.lower() == host.lower():
        return True
    if allowed is None:
        return parts.hostname.lower() in LOCAL_HOSTS
    return origin.rstrip("/").lower() in {a.rstrip("/").lower() for a in allowed}


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ApiKeyMiddleware:
    """Refuses HTTP requests to /v1/* without the right Bearer key (401, OpenAI error body).
    WebSocket scopes pass through: the socket endpoint checks the header or the first message."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.api_key is None or scope["type"] != "http" or not scope["path"].startswith("/v1/")
                or scope["method"] == "OPTIONS"):
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
