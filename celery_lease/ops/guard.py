"""What every request to ``celery -A proj lease serve`` passes before any route: a
bounded body, and the security headers on every response (API, dashboard, static files
and error answers alike).

An ASGI middleware wrapped around the whole app, so a route added anywhere (the API,
the dashboard, a mounted app) inherits both without saying so.

Bodies are bounded *before* they are read: a declared ``Content-Length`` over
MAX_BODY_BYTES is answered 413 at once, and a body sent without one (chunked) is
counted as it streams in and answered 413 as soon as it passes the bound. Either way
the server holds at most MAX_BODY_BYTES of any request, whoever sends it, signed in or
not. A body within the bound is handed to the route as it arrived.
"""

from __future__ import annotations

import json
from typing import Any

#: The largest request body any route takes: forms carry a token, a CSRF token and a
#: filter (never a list of ids), and API bodies a few fields.
MAX_BODY_BYTES = 16_384
#: Sent with every response. The dashboard's pages load their own script and styles
#: only (no CDN, no inline script), cannot be framed, and post forms to themselves.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
_RAW_HEADERS = [(k.lower().encode(), v.encode()) for k, v in HEADERS.items()]
_TOO_LARGE = json.dumps({"error": "payload_too_large", "detail": f"request bodies are at most {MAX_BODY_BYTES} bytes"})

Scope = dict[str, Any]


class Guard:
    """ASGI middleware: bounded bodies, security headers."""

    def __init__(self, app: Any, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", ())}
                extra = [(k, v) for k, v in _RAW_HEADERS if k not in present]
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _too_large(send_with_headers)
            return
        replay = await self._read_bounded(receive)
        if replay is None:
            await _too_large(send_with_headers)
            return
        await self.app(scope, replay, send_with_headers)

    async def _read_bounded(self, receive: Any) -> Any:
        """A ``receive`` handing the app the whole body as one message, read as it
        arrives until it ends; None as soon as it passes the bound."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                return _replaying([message], receive)
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return _replaying([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def _replaying(first: list[dict[str, Any]], receive: Any) -> Any:
    async def replay() -> dict[str, Any]:
        # The buffered body once; then whatever the server says next (a disconnect).
        return first.pop(0) if first else await receive()

    return replay


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length before we see it
    return None


async def _too_large(send: Any) -> None:
    body = _TOO_LARGE.encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
