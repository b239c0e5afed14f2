"""The API key: one ASGI middleware in front of every route.

A middleware rather than a per-route dependency, so a route added later, an unknown path and
the OpenAPI pages are guarded too (an unauthenticated caller learns nothing, not even which
paths exist). Exempt: ``/metrics`` when the operator opens it (``--metrics-public``), and the
dashboard's static shell (``/dashboard``), which holds no data: its script reads the key from
the page's URL fragment (never sent to a server, never logged) and fetches the guarded
``/dashboard/data`` with it.
"""

from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from deltaserve.server.errors import error_body

DASHBOARD_SHELL = "/dashboard"
METRICS = "/metrics"


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, metrics_public: bool):
        self.app = app
        self._key = api_key.encode()
        self._open = {DASHBOARD_SHELL} | ({METRICS} if metrics_public else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope.get("headers", []))
        if token is not None and secrets.compare_digest(token.encode(), self._key):
            await self.app(scope, receive, send)
            return
        await _refuse(send, "Incorrect API key provided" if token else
                      "You didn't provide an API key: send it as 'Authorization: Bearer KEY'")


async def _refuse(send: Send, message: str) -> None:
    body = json.dumps(error_body(401, message, None, "invalid_api_key")).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
