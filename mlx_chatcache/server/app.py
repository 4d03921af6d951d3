"""The HTTP layer of ``mlxcc serve``: a Starlette app served by uvicorn.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON, or
server-sent events with ``"stream": true``, ending with ``data: [DONE]``),
``GET /v1/models``, ``GET /health`` (queue, worker, batch and store statistics,
requests per endpoint); Anthropic's Messages API (:mod:`.messages_api`) and OpenAI's
Responses API (:mod:`.responses_api`); the browser page's routes come from :mod:`.ui`.

Contract: handlers never run MLX work; they parse the request (:mod:`.protocol`),
have the service admit it on the tokenizer thread (:meth:`.service.Service.admit`:
every check, the prompt's tokens, the job's settings), hand a job to the
generation worker and relay its events. Every error is an OpenAI-shaped JSON
body with a 4xx status for bad requests (5xx for our own faults), never a
traceback. A client that disconnects cancels its job, streamed or not (checked
every ``POLL_S`` seconds, however fast the job's events come, and on every write).
A 503 (the queue is full) carries ``Retry-After``. ``GET /v1/models`` lists the
model and its ``--served-model-name`` names. ``X-Session-Id`` is
the same as the ``prompt_cache_key`` body field: it pins the conversation's
cache entries in the store.

``GET /v1/store`` is the store's read-only report (:mod:`.store_report`): tiers
against their budgets, pins as key digests, tokens served and their history,
and the requests each endpoint submitted. ``GET /metrics`` is the Prometheus text
format (:mod:`.metrics`).

Every request passes the :class:`~.gate.Gate` first (its id, the drain, the API
key, the access line); :func:`create_app` returns the app behind it. While the
server drains, ``GET /health`` is a 503 whose ``status`` is ``draining``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..config import SERVER_DEFAULTS
from ..errors import UsageError
from .auth import ApiKeys
from .drain import Drain, DrainingServer
from .gate import Gate, refusal
from .jobs import ClientGone, job_events, read_body, start_job
from .messages_api import messages_routes
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import Request, RequestError, error_body, parse_chat, parse_completion
from .responses import Reply, sse
from .responses_api import responses_routes
from .service import Service
from .store_report import store_report
from .ui import announcement, is_loopback, ui_routes
from .tools import ToolCallStream
from .worker import Job

log = logging.getLogger("mlxcc.serve")


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, for :func:`serve`; an address that
    cannot be used (taken, not this machine's, unknown) is one-line :class:`UsageError`."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]  # fmt: skip
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}; check --host") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait for TIME_WAIT
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = ("another program listens there: stop it or choose another --port" if e.errno == errno.EADDRINUSE
                else "choose another --host or --port")  # fmt: skip
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}; {hint}") from None
    return sock


def serve(service: Service, sock: socket.socket, log_level: str = "info", ui: str = "on", keys: ApiKeys | None = None,
          drain_seconds: float = SERVER_DEFAULTS.drain_seconds) -> None:  # fmt: skip
    """Run the app for ``service`` on ``sock`` (from :func:`listen_socket`) until a signal
    ends its drain (:mod:`.drain`; blocking); ``ui`` is the page's mode (:func:`.ui.ui_mode`).
    Logging is the caller's (:func:`.logs.configure_logging`)."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    drain = Drain(drain_seconds)
    app = create_app(service, ui, host, keys, drain)
    config = uvicorn.Config(app, log_config=None, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=1)  # the drain waited already  # fmt: skip
    say = logging.getLogger("mlxcc.serve")
    say.info("mlxcc serve listening on http://%s:%s (Ctrl-C or SIGTERM drains and stops it)", host, port)
    say.info(announcement(ui, host, port, keys is not None))
    if keys is None and not is_loopback(host):
        say.warning("--host %s is not loopback and no API key is set: anyone who reaches port %s can use this "
                    "server; set --api-key, --api-key-file or MLXCC_API_KEY", host, port)  # fmt: skip
    DrainingServer(config, drain).run(sockets=[sock])


def create_app(service: Service, ui: str = "on", host: str = "127.0.0.1", keys: ApiKeys | None = None,
               drain: Drain | None = None) -> Gate:  # fmt: skip
    """The ASGI app of ``service`` behind its :class:`~.gate.Gate` (``keys``: None, no key needed;
    ``drain``: the one :func:`serve` signals, else one of its own)."""
    drain = drain or Drain(SERVER_DEFAULTS.drain_seconds)
    metrics = ServerMetrics(service.worker, drain)
    service.drain, service.metrics = drain, metrics  # every job is held by the drain and measured (.jobs)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            service.stop()

    async def chat(request: HTTPRequest):
        return await _complete(service, request, parse_chat)

    async def completions(request: HTTPRequest):
        return await _complete(service, request, parse_completion)

    async def models(request: HTTPRequest):
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "mlxcc"}
            for name in (service.model_id, *service.served_names)]})  # fmt: skip

    async def health(request: HTTPRequest):
        w = service.worker
        if drain.draining:
            return JSONResponse({"status": "draining", "model": service.model_id, "running": drain.count},
                                status_code=503, headers={"Retry-After": str(SERVER_DEFAULTS.retry_after_s)})  # fmt: skip
        # plain counters the worker updates; reading them is safe from this thread
        return JSONResponse({"status": "ok", "model": service.model_id, "ui": ui, "queued": w.waiting(), **w.stats,
                             "requests": dict(service.requests), "batch": service.batch.report(),
                             "store": w.store.stats(), "stored_responses": service.responses.stats()})  # fmt: skip

    async def store(request: HTTPRequest):
        return JSONResponse({**store_report(service.worker, request.state.tenant), "requests": dict(service.requests)})

    async def metrics_page(request: HTTPRequest):
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/store", store, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
        *messages_routes(service),  # Anthropic's Messages API (.messages_api)
        *responses_routes(service),  # OpenAI's Responses API (.responses_api)
        *ui_routes(ui, host),  # the browser page (.ui)
    ]
    handlers = {RequestError: _request_error, HTTPException: _http_error, Exception: _internal_error}
    return Gate(Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan), metrics, drain, keys)


# ------------------------------------------------------------------ errors
async def _request_error(request, exc: RequestError):
    return refusal(request.url.path, exc.status, exc.message, exc.code, exc.headers, exc.param)


async def _http_error(request, exc: HTTPException):
    message = {404: f"no route {request.url.path}; see /v1/models, /v1/chat/completions, /v1/completions, "
                    "/v1/messages, /v1/responses",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))  # fmt: skip
    return refusal(request.url.path, exc.status_code, message)


async def _internal_error(request, exc: Exception):
    log.error("internal error on %s", request.url.path, exc_info=exc)
    return refusal(request.url.path, 500, "internal server error; see the server log")


# ------------------------------------------------------------------ completions
async def _complete(service: Service, request: HTTPRequest, parse):
    try:
        req: Request = parse(await read_body(request))
    except ClientGone:  # the client hung up before sending its whole body
        return Response(status_code=499)  # nobody reads it
    started = await start_job(service, request, req, req.kind)
    job, events = started.job, started.events
    reply = Reply(req.kind, service.model_id, logprobs=req.logprobs)
    if req.stream:
        calls = (lambda: ToolCallStream(service.tokenizer, req.tools)) if service.uses_tools(req) else None
        return StreamingResponse(_stream(job, events, request, reply, req.include_usage, req.n, calls),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})  # fmt: skip
    try:
        pieces, done = [], None
        async for kind, value in job_events(events, request):
            if kind == "piece":
                pieces.append(value)
            elif kind == "done":
                done = value
                break
            elif kind == "error":
                return refusal(request.url.path, 500, value)
        return JSONResponse(reply.full(pieces, done))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    finally:
        job.cancel()  # a no-op once done; stops the job when the client went away


async def _stream(job: Job, events, request, reply: Reply, include_usage: bool, n: int,
                  calls: Callable[[], ToolCallStream] | None) -> AsyncIterator[str]:  # fmt: skip
    """The chunks of ``n`` choices: a chat's role chunk per choice, one chunk per piece,
    each choice's finish, then the usage chunk (with ``include_usage``) and ``[DONE]``.
    With ``calls`` (a new splitter per choice) each choice's text is split into content
    and ``delta.tool_calls`` (its pieces then carry no logprobs)."""
    splitters = {}
    try:
        if reply.kind == "chat":
            for index in range(n):
                yield sse(reply.chunk(role=True, with_usage_field=include_usage, index=index))
        async for kind, value in job_events(events, request):
            if kind == "piece" and calls is None:
                yield sse(reply.piece_chunk(value, with_usage_field=include_usage))
            elif kind == "piece":
                text, found = splitters.setdefault(value.index, calls()).feed(value.text)
                if text or found:
                    yield sse(reply.chunk(text or None, with_usage_field=include_usage, index=value.index,
                                          tool_calls=found or None))  # fmt: skip
            elif kind == "error":
                yield sse(error_body(value, 500))
                break
            elif kind == "done":
                for index, splitter in sorted(splitters.items()):  # what each held back
                    text, found = splitter.finish()
                    if text or found:
                        yield sse(reply.chunk(text or None, with_usage_field=include_usage, index=index,
                                              tool_calls=found or None))  # fmt: skip
                for chunk in reply.finish_chunks(value, with_usage_field=include_usage):
                    yield sse(chunk)
                if include_usage:
                    yield sse(reply.usage_chunk(value))
                break
        yield sse("[DONE]")
    except ClientGone:
        pass
    finally:
        job.cancel()
