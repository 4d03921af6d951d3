"""What every generating endpoint does with a parsed request: one job for the worker, its events.

Contract
--------
- :func:`decode_body` is a request body's JSON value (a 400 ``invalid_json`` otherwise).
- :func:`start_job` ``(service, request, req, endpoint)`` has the service admit ``req``
  (:meth:`.service.Service.admit`: its prompt ids, boundary, system prompt end and
  ``marks``, its settings and hooks), submits a :class:`~.worker.Job` (``X-Session-Id`` is the
  ``prompt_cache_key`` when the body has none; the marks are stored as exact ends and
  pinned under the key; the request's tenant and id go with it), holds it in the
  server's drain, has its first token and gaps measured when it is done, and counts
  it in ``service.requests[endpoint]``; it returns a :class:`Started`. A full queue is
  a 503 ``server_busy`` with ``Retry-After``.
- :func:`job_events` yields the job's events (``start``, ``piece``, ``done``, ``error``)
  and raises :class:`ClientGone` once the client has disconnected (checked every
  ``POLL_S`` seconds, however fast the events come).

Every dialect (chat completions, completions, Messages, Responses) goes through here,
so the batch, the store, pins and counts serve them alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from ..config import SERVER_DEFAULTS
from .protocol import Request, RequestError
from .service import Prepared, Service
from .worker import Job, QueueFull

POLL_S = 0.2


class ClientGone(Exception):
    pass


@dataclass
class Started:
    """A submitted job, its event queue and what its prompt was made of."""

    job: Job
    events: asyncio.Queue
    prepared: Prepared


def decode_body(raw: bytes):
    """The request body's JSON value; a 400 ``invalid_json`` for bytes that are not
    UTF-8 JSON or nest deeper than the decoder's recursion limit."""
    try:
        return json.loads(raw)
    except ValueError:  # UnicodeDecodeError too
        raise RequestError(400, "the request body is not valid JSON; send a JSON object",
                           None, "invalid_json") from None  # fmt: skip
    except RecursionError:
        raise RequestError(400, "the request body nests arrays or objects too deeply; send a flat JSON object",
                           None, "invalid_json") from None  # fmt: skip


async def start_job(service: Service, request: HTTPRequest, req: Request, endpoint: str,
                    key_of: Callable[[Prepared], str | None] | None = None) -> Started:  # fmt: skip
    """Submit ``req``'s job (see the module doc); ``key_of`` names its pin from its
    prepared prompt when neither the body nor the header did."""
    admission = await service.admitted(req, request.headers.get("x-session-id"), key_of)
    prepared = admission.prepared
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def emit(event: tuple) -> None:  # called on the worker thread
        if event[0] == "done" and service.metrics is not None:
            t = event[1]["timing"]
            first = job.submitted - request.state.arrived + t["queued_s"] + t["first_token_s"]
            service.metrics.reply(first if event[1]["completion_tokens"] else None, job.token_gaps)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
            loop.call_soon_threadsafe(events.put_nowait, event)

    job = Job(prepared.prompt, admission.config, emit, req.stop, prepared.boundary, req.cache_key, n=req.n,
              logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0, processors=admission.processors,
              postprocess=admission.postprocess, system_end=prepared.system_end, marks=prepared.marks,
              tenant=request.state.tenant, request_id=request.state.request_id)  # fmt: skip
    try:
        service.worker.submit(job)
    except QueueFull:
        raise RequestError(503, "the server is busy (its request queue is full); retry later", None, "server_busy",
                           {"Retry-After": str(SERVER_DEFAULTS.retry_after_s)}) from None  # fmt: skip
    if service.drain is not None:
        service.drain.hold(job)  # cancelled if the drain's time runs out
    service.requests[endpoint] += 1
    return Started(job, events, prepared)


async def job_events(events: asyncio.Queue, request: HTTPRequest) -> AsyncIterator[tuple]:
    """The job's events; ClientGone once the client has disconnected (checked every
    ``POLL_S`` seconds, also while events keep coming)."""
    checked = asyncio.get_running_loop().time()
    while True:
        try:
            event = await asyncio.wait_for(events.get(), POLL_S)
        except asyncio.TimeoutError:
            event = None
        now = asyncio.get_running_loop().time()
        if event is None or now - checked >= POLL_S:
            checked = now
            if await request.is_disconnected():
                raise ClientGone from None
        if event is not None:
            yield event


async def read_body(request: HTTPRequest):
    """The decoded JSON body; ClientGone when the client hung up before sending all of it."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientGone from None
    return decode_body(raw)


__all__ = ["ClientGone", "POLL_S", "Started", "decode_body", "job_events", "read_body", "start_job"]
