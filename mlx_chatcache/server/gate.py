"""The door every HTTP request passes: its id, the drain, the key, the access line.

Contract
--------
:class:`Gate` wraps the server's ASGI app. For each HTTP request, in this order:

1. it gets its id (:func:`.logs.request_id`), current while it is handled, returned
   in the ``X-Request-Id`` response header (and, by :func:`.protocol.error_body`, in
   every error body); ``request.state`` gets ``request_id``, ``arrived``
   (``time.perf_counter()``) and ``tenant`` (:mod:`.auth`; None: entries shared);
2. while the server drains (:mod:`.drain`) every request but ``/health`` and
   ``/metrics`` is a 503 with ``Retry-After``;
3. with API keys, every request but ``/health``, ``HEAD /`` and the page's files
   (``GET /``, ``/store``, ``/static/*``: the same for everyone, no data in them;
   everything they fetch needs the key) without a valid key is a 401 with
   ``WWW-Authenticate: Bearer``;
4. the request runs (counted as running for the drain, but ``/health`` and ``/metrics``);
   an exception it raises after its response started (the app's error handler answered
   and logged it, with the id) ends there;
5. one access line is logged (``METHOD path status seconds``, never a header or the
   query string) and the request counted in the metrics by endpoint and status.

:func:`refusal` is every error response of the server (the gate's, the app's handlers',
the endpoints'), in the dialect of its endpoint: plain text for ``/metrics``, Anthropic's
error shape under ``/v1/messages``, OpenAI's for everything else.
"""

from __future__ import annotations

import logging
import time

from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Match

from ..config import SERVER_DEFAULTS
from .auth import ApiKeys
from .drain import Drain
from .logs import bound, request_id
from .metrics import ServerMetrics
from .messages_protocol import error_body as anthropic_body
from .protocol import error_body, utf8_text

access = logging.getLogger("mlxcc.serve.access")
UNTIMED = ("/health", "/metrics")  # answered while draining, not counted as running


def _public(method: str, path: str) -> bool:
    """Whether a request needs no key (module docstring, 3)."""
    if path == "/health" or (method == "HEAD" and path == "/"):
        return True
    return method in ("GET", "HEAD") and (path in ("/", "/store") or path.startswith("/static/"))


def refusal(path: str, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None,
            param: str | None = None) -> Response:  # fmt: skip
    """An error response in the dialect of the endpoint at ``path`` (see the module doc); text
    that cannot be UTF-8 (a lone surrogate a client sent and the message quotes) shown escaped."""
    if path == "/metrics":
        return PlainTextResponse(utf8_text(message) + "\n", status_code=status, headers=headers)
    if path.startswith("/v1/messages"):
        return JSONResponse(anthropic_body(status, message), status_code=status, headers=headers)
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


class Gate:
    def __init__(self, app, metrics: ServerMetrics, drain: Drain, keys: ApiKeys | None = None):
        self.app, self.metrics, self.drain, self.keys = app, metrics, drain, keys

    def endpoint(self, scope) -> str:
        """The path of the route ``scope`` goes to (``other``: none)."""
        for route in getattr(self.app, "routes", ()):
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return route.path
        return "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        rid = request_id(next((v for k, v in headers if k.lower() == b"x-request-id"), None))
        arrived, status, started = time.perf_counter(), 500, False  # 500: the app failed before it answered
        method, path = scope["method"], scope["path"]

        async def sending(message):
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        with bound(rid):
            try:
                tenant = None
                if self.keys is not None and not _public(method, path):
                    tenant = self.keys.tenant(headers)
                state = scope.setdefault("state", {})
                state.update(request_id=rid, arrived=arrived, tenant=tenant or None)
                if self.drain.draining and path not in UNTIMED:
                    retry = {"Retry-After": str(SERVER_DEFAULTS.retry_after_s)}
                    await refusal(path, 503, "the server is shutting down; retry later (or on another replica)",
                                  "server_shutting_down", retry)(scope, receive, sending)  # fmt: skip
                elif self.keys is not None and tenant is None and not _public(method, path):
                    await refusal(path, 401, self.keys.why(headers), "invalid_api_key",
                                  {"WWW-Authenticate": "Bearer"})(scope, receive, sending)  # fmt: skip
                elif path in UNTIMED:
                    await self.app(scope, receive, sending)
                else:
                    with self.drain.running():
                        await self.app(scope, receive, sending)
            except Exception:
                if not started:  # uvicorn answers 500
                    raise
                # answered and logged, with the request's id, by the app's error handler: not again without it
            finally:
                seconds = time.perf_counter() - arrived
                self.metrics.request(self.endpoint(scope), status, seconds)
                client = scope.get("client")
                access.info("%s %s %d %.3f s", method, path, status, seconds,
                            extra={"method": method, "path": path, "status": status, "duration_s": round(seconds, 4),
                                   "client": client[0] if client else None})  # fmt: skip


__all__ = ["Gate", "refusal"]
