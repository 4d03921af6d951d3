"""Anthropic's Messages API on ``mlxcc serve``: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Contract
--------
A request (:mod:`.messages_protocol`; a query string such as ``?beta=true`` is accepted)
runs as a chat job (:mod:`.jobs`): the same batch, store, pins and counts as chat
completions. The reply is a ``message`` (``id`` ``msg_...``, ``content`` blocks
``thinking`` / ``text`` / ``tool_use`` with ``toolu_...`` ids and the call's ``input``,
``stop_reason`` ``end_turn`` / ``max_tokens`` / ``stop_sequence`` (with ``stop_sequence``)
/ ``tool_use``), or with ``"stream": true`` the events Anthropic documents:
``message_start`` (sent once the prompt's cached prefix is known, with the input
usage), ``ping``, per block ``content_block_start`` / ``content_block_delta``
(``text_delta``, ``thinking_delta``, ``input_json_delta``) / ``content_block_stop`` with
its index, ``message_delta`` (stop reason, usage) and ``message_stop``.

``usage`` is Anthropic's: ``cache_read_input_tokens`` are the prompt tokens served by
the store, the computed ones are split at the request's last ``cache_control``
breakpoint: ``cache_creation_input_tokens`` before it (written for reuse), ``input_tokens``
after it; the three add up to the prompt's tokens; ``output_tokens`` were generated.
A breakpoint is kept as an exact prefix in the store and pins the request's cache
under :func:`~.messages_protocol.pin_name` (see :mod:`~mlx_chatcache.store.tiers`:
the last entries a name put outlive unpinned ones in this server's memory and disk
tiers, for as long as the process runs; ``ttl`` is accepted, pins do not expire by time).

Errors are Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}`` with
``invalid_request_error`` (400), ``not_found_error`` (404), ``overloaded_error`` (503,
``Retry-After``) or ``api_error`` (500); mid-stream, an ``error`` event.
"""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .gate import refusal
from .jobs import ClientGone, Started, job_events, read_body, start_job
from .messages_protocol import MessagesCall, error_body, parse_messages, pin_name
from .reply_parts import ReplyParts
from .service import Service

def messages_routes(service: Service) -> list[Route]:
    async def create(request: HTTPRequest):  # errors: the app's handlers, in this dialect (.gate.refusal)
        try:
            return await _create(service, request)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it

    async def count(request: HTTPRequest):
        try:
            req, _ = parse_messages(await read_body(request))
        except ClientGone:
            return Response(status_code=499)
        service.check_model(req.model)
        return JSONResponse({"input_tokens": await service.count_tokens(req)})

    return [Route("/v1/messages", create, methods=["POST"]),
            Route("/v1/messages/count_tokens", count, methods=["POST"])]  # fmt: skip


async def _create(service: Service, request: HTTPRequest):
    req, call = parse_messages(await read_body(request))
    session = request.headers.get("x-session-id")
    req.cache_key = None  # the pin is named by pin_name
    started = await start_job(service, request, req, "messages",
                              key_of=lambda p: pin_name(p.prompt, p.marks[0] if p.marks else None, call, session))  # fmt: skip
    reply = MessageReply(service, req, call, started)
    if req.stream:
        return StreamingResponse(reply.events(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip
    try:
        async for kind, value in job_events(started.events, request):
            if kind == "piece":
                reply.take(reply.parts.feed(value.text))
            elif kind == "done":
                reply.finish()
                return JSONResponse(reply.message(value))
            elif kind == "error":
                return refusal(request.url.path, 500, value)
    finally:
        started.job.cancel()


class MessageReply:
    """One reply's blocks, usage and events."""

    def __init__(self, service: Service, req, call: MessagesCall, started: Started):
        self.model, self.call, self.started = service.model_id, call, started
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.parts = ReplyParts(service, req, started.prepared.prompt)
        self.blocks: list[dict] = []
        self.open: str | None = None  # the kind of the last block while it can still grow

    # ------------------------------------------------------------------ whole
    def take(self, parts) -> list[str]:
        """Add ``parts`` to the blocks; the SSE events that say so."""
        out = []
        for kind, value in parts:
            if kind == "call":
                out += self._close()
                block = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24],
                         "name": value["function"]["name"], "input": _input(value["function"]["arguments"])}  # fmt: skip
                self.blocks.append(block)
                i = len(self.blocks) - 1
                out.append(sse("content_block_start", {"type": "content_block_start", "index": i,
                                                       "content_block": {**block, "input": {}}}))  # fmt: skip
                out.append(sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))  # fmt: skip
                out.append(sse("content_block_stop", {"type": "content_block_stop", "index": i}))
                continue
            if self.open != kind:
                out += self._close()
                self.blocks.append({"type": "text", "text": ""} if kind == "text" else
                                   {"type": "thinking", "thinking": "", "signature": ""})  # fmt: skip
                self.open = kind
                out.append(sse("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                       "content_block": dict(self.blocks[-1])}))  # fmt: skip
            field = "text" if kind == "text" else "thinking"
            self.blocks[-1][field] += value
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                   "delta": {"type": f"{field}_delta", field: value}}))  # fmt: skip
        return out

    def finish(self) -> list[str]:
        """The reply's end: what the parts held back, the last item closed; their events."""
        return self.take(self.parts.finish()) + self._close()

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def usage(self, cached: int, output: int) -> dict:
        """Anthropic's usage of this request (module doc)."""
        prepared = self.started.prepared
        mark = prepared.marks[0] if prepared.marks else 0
        creation = max(mark - cached, 0)
        created = {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
        created[f"ephemeral_{self.call.ttl}_input_tokens"] = creation
        return {"input_tokens": len(prepared.prompt) - cached - creation, "cache_creation_input_tokens": creation,
                "cache_read_input_tokens": cached, "cache_creation": created, "output_tokens": output,
                "service_tier": "standard"}  # fmt: skip

    def stop_reason(self, done: dict) -> tuple[str, str | None]:
        end = (done.get("choices") or [{}])[0]
        if any(b["type"] == "tool_use" for b in self.blocks):
            return "tool_use", None
        if done["finish_reason"] == "length":
            return "max_tokens", None
        if end.get("stop_sequence") is not None:
            return "stop_sequence", end["stop_sequence"]
        return "end_turn", None

    def _head(self, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage}  # fmt: skip

    def message(self, done: dict) -> dict:
        """The non-streamed response."""
        reason, sequence = self.stop_reason(done)
        return {**self._head(self.usage(done["cached_tokens"], done["completion_tokens"])), "content": self.blocks,
                "stop_reason": reason, "stop_sequence": sequence}  # fmt: skip

    # ------------------------------------------------------------------ streamed
    async def events(self, request: HTTPRequest) -> AsyncIterator[str]:
        try:
            async for kind, value in job_events(self.started.events, request):
                if kind == "start":
                    yield sse("message_start", {"type": "message_start",
                                                "message": self._head(self.usage(value["cached_tokens"], 0))})  # fmt: skip
                    yield sse("ping", {"type": "ping"})
                elif kind == "piece":
                    for line in self.take(self.parts.feed(value.text)):
                        yield line
                elif kind == "error":
                    yield sse("error", error_body(500, value))
                    break
                elif kind == "done":
                    for line in self.finish():
                        yield line
                    reason, sequence = self.stop_reason(value)
                    yield sse("message_delta", {"type": "message_delta",
                                                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                "usage": self.usage(value["cached_tokens"], value["completion_tokens"])})  # fmt: skip
                    yield sse("message_stop", {"type": "message_stop"})
                    break
        except ClientGone:
            pass
        finally:
            self.started.job.cancel()


def _input(arguments: str) -> dict:
    """A call's arguments (JSON text) as the ``input`` object of a ``tool_use`` block."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


__all__ = ["MessageReply", "messages_routes"]
