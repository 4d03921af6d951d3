"""OpenAI's Responses API on ``mlxcc serve``: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

Contract
--------
A request (:mod:`.responses_protocol`) runs as a chat job (:mod:`.jobs`): the same batch,
store, pins and counts as chat completions. With ``previous_response_id`` its messages
are the stored conversation (:mod:`.stored_responses`: that response's history and
reply) followed by this request's input, after this request's ``instructions``: the
conversation's cache is found in the store, so only the new input is computed. An
unknown id is a 404 ``previous_response_not_found``.

The reply is a ``response`` object (``id`` ``resp_...``, ``status`` ``completed``, or
``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens``; ``output`` items:
``reasoning`` (the model's reasoning, where its template has a format), ``message``
(``msg_...``, one ``output_text`` part) and ``function_call`` (``fc_...``, ``call_...``,
``arguments`` as JSON text); ``usage`` with ``input_tokens_details.cached_tokens``, the
prompt tokens the store served), or with ``"stream": true`` the events OpenAI documents,
each with its ``sequence_number``: ``response.created``, ``response.in_progress``, per item
``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta`` / ``.done``, ``response.content_part.done``, for a call
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``; then
``response.completed`` (``response.incomplete`` when cut at ``max_output_tokens``).

With ``store`` (default true) the response and its conversation are kept before the
client has its last event; ``GET /v1/responses/{id}`` returns it, ``DELETE`` removes it
(``{"id", "object": "response", "deleted": true}``); an unknown or deleted id is a 404
in OpenAI's error shape. Errors are OpenAI's shape, as for chat completions.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .jobs import ClientGone, Started, job_events, read_body, start_job
from .protocol import RequestError, error_body, utf8_text
from .reply_parts import ReplyParts
from .responses_protocol import ResponsesCall, parse_responses
from .service import Service
from .stored_responses import new_response_id


def _not_found(response_id: str, param: str | None = None, code: str | None = None) -> RequestError:
    shown = utf8_text(response_id)[:80]
    what = "Previous response" if param else "Response"
    return RequestError(404, f"{what} with id '{shown}' not found.", param, code)


def responses_routes(service: Service) -> list[Route]:
    async def create(request: HTTPRequest):
        try:
            return await _create(service, request)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it

    async def get(request: HTTPRequest):
        response_id = request.path_params["response_id"]
        doc = await service.responses.get(response_id)
        if doc is None:
            raise _not_found(response_id)
        return JSONResponse(doc["response"])

    async def delete(request: HTTPRequest):
        response_id = request.path_params["response_id"]
        if not await service.responses.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{response_id}", get, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete, methods=["DELETE"])]  # fmt: skip


async def _create(service: Service, request: HTTPRequest):
    req, call = parse_responses(await read_body(request))
    history: list[dict] = []
    if call.previous is not None:
        doc = await service.responses.get(call.previous)
        if doc is None or not isinstance(doc.get("history"), list):
            raise _not_found(call.previous, "previous_response_id", "previous_response_not_found")
        history = doc["history"]
    system = [{"role": "system", "content": call.instructions}] if call.instructions else []
    req.messages = system + history + call.input
    started = await start_job(service, request, req, "responses")
    reply = ResponseReply(service, req, call, started, history)
    if req.stream:
        return StreamingResponse(reply.events(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip
    try:
        async for kind, value in job_events(started.events, request):
            if kind == "piece":
                reply.take(reply.parts.feed(value.text))
            elif kind == "done":
                reply.finish()
                obj = reply.response(value)
                await reply.keep(obj)
                return JSONResponse(obj)
            elif kind == "error":
                return JSONResponse(error_body(value, 500), status_code=500)
    finally:
        started.job.cancel()


class ResponseReply:
    """One response's output items, usage and events."""

    def __init__(self, service: Service, req, call: ResponsesCall, started: Started, history: list[dict]):
        self.service, self.model, self.call, self.started, self.history = service, service.model_id, call, started, history
        self.id, self.created = new_response_id(), int(time.time())
        self.parts = ReplyParts(service, req, started.prepared.prompt)
        self.items: list[dict] = []
        self.open: str | None = None  # the kind of the last item while it can still grow
        self.seq = 0

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    # ------------------------------------------------------------------ items
    def take(self, parts) -> list[str]:
        """Add ``parts`` to the output items; the SSE events that say so."""
        out = []
        for kind, value in parts:
            if kind == "call":
                out += self._close()
                f = value["function"]
                item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24],
                        "call_id": "call_" + uuid.uuid4().hex[:24], "name": f["name"], "arguments": f["arguments"],
                        "status": "completed"}  # fmt: skip
                self.items.append(item)
                i = len(self.items) - 1
                out.append(self._event("response.output_item.added", output_index=i,
                                       item={**item, "arguments": "", "status": "in_progress"}))  # fmt: skip
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                       delta=item["arguments"]))  # fmt: skip
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                       arguments=item["arguments"]))  # fmt: skip
                out.append(self._event("response.output_item.done", output_index=i, item=item))
                continue
            if self.open != kind:
                out += self._close()
                out += self._open(kind)
            item, i = self.items[-1], len(self.items) - 1
            item["content"][0]["text"] += value
            delta = "response.output_text.delta" if kind == "text" else "response.reasoning_text.delta"
            out.append(self._event(delta, item_id=item["id"], output_index=i, content_index=0, delta=value))
        return out

    def _open(self, kind: str) -> list[str]:
        self.open = kind
        if kind == "text":
            item = {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": "in_progress",
                    "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": []}]}  # fmt: skip
        else:
            item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
        self.items.append(item)
        i = len(self.items) - 1
        out = [self._event("response.output_item.added", output_index=i, item={**item, "content": []})]
        if kind == "text":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=i,
                                   content_index=0, part={**item["content"][0], "text": ""}))  # fmt: skip
        return out

    def finish(self) -> list[str]:
        """The reply's end: what the parts held back, the last item closed; their events."""
        return self.take(self.parts.finish()) + self._close()

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        item, i = self.items[-1], len(self.items) - 1
        part = item["content"][0]
        if kind == "text":
            item["status"] = "completed"
            out = [self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=part["text"]),
                   self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                               part=part)]  # fmt: skip
        else:
            out = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=part["text"])]  # fmt: skip
        return out + [self._event("response.output_item.done", output_index=i, item=item)]

    # ------------------------------------------------------------------ the response
    def response(self, done: dict | None = None) -> dict:
        """The response object: in progress (``done`` None) or finished."""
        status, incomplete, usage = "in_progress", None, None
        if done is not None:
            cut = done["finish_reason"] == "length" and not any(i["type"] == "function_call" for i in self.items)
            status = "incomplete" if cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut else None
            p, c = done["prompt_tokens"], done["completion_tokens"]
            usage = {"input_tokens": p, "input_tokens_details": {"cached_tokens": done["cached_tokens"]},
                     "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}  # fmt: skip
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.items if done is not None else [], "error": None,
                "incomplete_details": incomplete, "usage": usage, "user": None, "truncation": "disabled",
                "reasoning": {"effort": None, "summary": None}, **self.call.echo}  # fmt: skip

    async def keep(self, obj: dict) -> None:
        """Store the finished response and its conversation (with ``store``)."""
        if not self.call.store:
            return
        reply = {"role": "assistant", "content": "".join(i["content"][0]["text"] for i in self.items
                                                         if i["type"] == "message")}  # fmt: skip
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": _arguments(i["arguments"])}}
                 for i in self.items if i["type"] == "function_call"]  # fmt: skip
        if calls:
            reply["tool_calls"] = calls
        await self.service.responses.put(self.id, {"response": obj, "history": self.history + self.call.input + [reply]})

    async def events(self, request: HTTPRequest) -> AsyncIterator[str]:
        try:
            yield self._event("response.created", response=self.response())
            yield self._event("response.in_progress", response=self.response())
            async for kind, value in job_events(self.started.events, request):
                if kind == "piece":
                    for line in self.take(self.parts.feed(value.text)):
                        yield line
                elif kind == "error":
                    yield self._event("error", code="server_error", message=value, param=None)
                    break
                elif kind == "done":
                    for line in self.finish():
                        yield line
                    obj = self.response(value)
                    await self.keep(obj)
                    yield self._event(f"response.{obj['status']}", response=obj)
                    break
        except ClientGone:
            pass
        finally:
            self.started.job.cancel()


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


__all__ = ["ResponseReply", "responses_routes"]
