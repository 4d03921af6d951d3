"""Request bodies of OpenAI's Responses API (``POST /v1/responses``), read into our :class:`~.protocol.Request`.

Contract
--------
:func:`parse_responses` turns a decoded body into ``(Request, ResponsesCall)`` or raises
:class:`~.protocol.RequestError` (a 400 naming the field). Fields we do not use are
accepted and ignored (``include``, ``reasoning``, ``parallel_tool_calls``, ``truncation``,
``service_tier``, ``user``, ...).

- ``input``: a string (one user message) or items: messages (``role`` user / assistant /
  system / developer, ``content`` a string or ``input_text`` / ``output_text`` parts;
  ``input_image`` / ``input_file`` are a 400: text only), ``function_call`` (joined to
  the assistant turn they follow), ``function_call_output`` (a ``tool`` message),
  ``reasoning`` (accepted, left out of the prompt);
- ``instructions``: a leading system message (not carried over by ``previous_response_id``);
- ``tools``: ``{"type": "function", name, description, parameters}`` (tools of other
  types are left out: nothing here runs them); ``tool_choice`` ``none`` / ``auto`` /
  ``required`` / ``{"type": "function", "name"}``;
- ``text.format``: ``text``, ``json_object`` or ``json_schema`` (its ``schema`` required)
  through the grammar engine;
- ``max_output_tokens`` (lowered to the context's room when past it), ``temperature``,
  ``top_p`` in the chat endpoint's ranges; ``prompt_cache_key`` pins as in chat;
  ``store`` (default true), ``metadata`` (an object), ``previous_response_id``, ``stream``.

``ResponsesCall.input`` holds the request's own messages (without instructions), which
a stored response keeps as the conversation's history with its reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .messages_protocol import check_text_tree
from .protocol import (Request, RequestError, bad_field, json_type, model_field, nonempty_name, object_field, optional_str,
                       response_format_field, setting_field, temperature_field, tool_choice_field, tools_array,
                       top_p_field, unicode_text)  # fmt: skip

IGNORED_ITEMS = ("reasoning", "item_reference")


@dataclass
class ResponsesCall:
    """What the Responses dialect adds to a Request."""

    input: list[dict] = field(default_factory=list)  # this request's messages (no instructions)
    instructions: str | None = None
    previous: str | None = None  # previous_response_id
    store: bool = True
    metadata: dict = field(default_factory=dict)
    echo: dict = field(default_factory=dict)  # request fields the response object repeats


def parse_responses(body: Any) -> tuple[Request, ResponsesCall]:
    model = model_field(body)
    call = ResponsesCall(instructions=optional_str(body, "instructions"),
                         previous=optional_str(body, "previous_response_id"))
    call.input = _input(body.get("input"))
    for name in ("store", "stream", "parallel_tool_calls"):
        if body.get(name) is not None and type(body[name]) is not bool:
            raise bad_field(name, f"must be true or false, got {json_type(body[name])}")
    call.store = body.get("store") is not False
    metadata = body.get("metadata")
    if metadata is not None:
        check_text_tree(object_field(metadata, "metadata"), "metadata")
        call.metadata = metadata
    tools = _tools(body)
    chat_tools = {"tools": tools, "tool_choice": _choice(body.get("tool_choice"))}
    req = Request(
        kind="chat", model=model, max_tokens=setting_field(body, "max_output_tokens", "max_tokens"),
        temperature=temperature_field(body), top_p=top_p_field(body), tools=tools,
        tool_choice=tool_choice_field(chat_tools, tools), response_format=_text_format(body.get("text")),
        stream=body.get("stream") is True, cache_key=optional_str(body, "prompt_cache_key"), clamp_max_tokens=True,
    )  # fmt: skip
    call.echo = {"instructions": call.instructions, "max_output_tokens": req.max_tokens,
                 "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": call.previous,
                 "store": call.store, "temperature": req.temperature, "top_p": req.top_p,
                 "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                 "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
                 "metadata": call.metadata, "prompt_cache_key": req.cache_key}  # fmt: skip
    return req, call


def _input(v: Any) -> list[dict]:
    if isinstance(v, str):
        return [{"role": "user", "content": unicode_text(v, "input")}]
    if not isinstance(v, list) or not v:
        raise bad_field("input", "is required: a string or a non-empty array of input items")
    out: list[dict] = []
    for i, item in enumerate(v):
        param = f"input[{i}]"
        kind = object_field(item, param).get("type", "message")
        if kind == "message":
            out.append(_message(item, param))
        elif kind == "function_call":
            call = {"id": nonempty_name(item.get("call_id"), f"{param}.call_id"), "type": "function",
                    "function": {"name": nonempty_name(item.get("name"), f"{param}.name"),
                                 "arguments": _arguments(item.get("arguments"), f"{param}.arguments")}}  # fmt: skip
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = _parts(output, f"{param}.output") if isinstance(output, list) else output
            if not isinstance(text, str):
                raise bad_field(f"{param}.output", f"must be a string, got {json_type(output)}")
            out.append({"role": "tool", "tool_call_id": nonempty_name(item.get("call_id"), f"{param}.call_id"),
                        "content": unicode_text(text, f"{param}.output")})  # fmt: skip
        elif kind in IGNORED_ITEMS:
            continue
        else:
            shown = unicode_text(kind, f"{param}.type")[:40] if isinstance(kind, str) else json_type(kind)
            raise bad_field(f"{param}.type", f"{shown!r} is not an input item this server takes (message, function_call, "
                       "function_call_output, reasoning)", "invalid_value")  # fmt: skip
    return out


def _message(item: dict, param: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        shown = unicode_text(role, f"{param}.role")[:40] if isinstance(role, str) else json_type(role)
        raise bad_field(f"{param}.role", f"must be user, assistant, system or developer, got {shown!r}", "invalid_value")
    content = item.get("content")
    text = _parts(content, f"{param}.content") if isinstance(content, list) else content
    if not isinstance(text, str):
        raise bad_field(f"{param}.content", f"must be a string or an array of text parts, got {json_type(content)}")
    return {"role": "system" if role == "developer" else role, "content": unicode_text(text, f"{param}.content")}


def _parts(parts: list, param: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        p = f"{param}[{j}]"
        kind = object_field(part, p).get("type")
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(unicode_text(part["text"], f"{p}.text"))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_field(p, f"is an {kind} part; this server's model takes text only", "invalid_value")
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(unicode_text(part["refusal"], f"{p}.refusal"))
        else:
            raise bad_field(p, "must be a text part ({'type': 'input_text', 'text': ...})", "invalid_value")
    return "".join(texts)


def _arguments(v: Any, param: str) -> dict:
    import json

    if v is None or v == "":
        return {}
    if not isinstance(v, str):
        raise bad_field(param, f"must be a JSON text, got {json_type(v)}")
    try:
        value = json.loads(unicode_text(v, param))
    except (ValueError, RecursionError):
        raise bad_field(param, "must be a JSON object as text", "invalid_value") from None
    if not isinstance(value, dict):
        raise bad_field(param, f"must be a JSON object, got {json_type(value)}", "invalid_value")
    return value


def _tools(body: dict) -> list[dict] | None:
    v = tools_array(body)
    if v is None:
        return None
    out = []
    for i, tool in enumerate(v):
        param = f"tools[{i}]"
        if object_field(tool, param).get("type") != "function":
            continue  # a hosted tool (web search, ...): nothing here runs it
        function = {"name": nonempty_name(tool.get("name"), f"{param}.name")}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise bad_field(f"{param}.description", "must be a string")
            function["description"] = unicode_text(tool["description"], f"{param}.description")
        if tool.get("parameters") is not None:
            check_text_tree(object_field(tool["parameters"], f"{param}.parameters"), f"{param}.parameters")
            function["parameters"] = tool["parameters"]
        out.append({"type": "function", "function": function})
    return out or None


def _choice(v: Any) -> Any:
    """Responses' ``tool_choice`` in chat's shape (checked there)."""
    if isinstance(v, dict) and v.get("type") == "function" and "function" not in v:
        return {"type": "function", "function": {"name": v.get("name")}}
    return v


def _text_format(v: Any) -> dict | None:
    if v is None:
        return None
    fmt = object_field(v, "text").get("format")
    if fmt is None:
        return None
    kind = object_field(fmt, "text.format").get("type")
    if kind == "json_schema":
        if fmt.get("schema") is None:
            raise bad_field("text.format.schema", "is required with 'json_schema': give the JSON schema", "invalid_value")
        spec = {"name": fmt.get("name", "schema"), "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        fmt = {"type": "json_schema", "json_schema": spec}
    try:
        return response_format_field({"response_format": fmt})
    except RequestError as e:
        e.param = (e.param or "").replace("response_format.json_schema", "text.format").replace(
            "response_format", "text.format")  # fmt: skip
        e.message = e.message.replace("'response_format.json_schema", "'text.format").replace(
            "'response_format", "'text.format")  # fmt: skip
        raise


__all__ = ["ResponsesCall", "parse_responses"]
