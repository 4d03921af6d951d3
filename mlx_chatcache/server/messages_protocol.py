"""Request bodies of Anthropic's Messages API (``POST /v1/messages``), read into our :class:`~.protocol.Request`.

Contract
--------
:func:`parse_messages` turns a decoded body into ``(Request, MessagesCall)`` or raises
:class:`~.protocol.RequestError` (a 400 naming the field). Fields we do not use are
accepted and ignored (``metadata``, ``thinking``, ``context_management``,
``output_config``, ``service_tier``, ``container``, ``mcp_servers``, ...), never a 400.

- ``system``: a string or text blocks -> one leading ``system`` message;
- ``messages``: ``user``/``assistant`` turns (and ``system`` ones, which Claude Code sends)
  whose ``content`` is a string or blocks:
  ``text``; ``tool_use`` (an assistant's call: ``{id, name, input}``) -> the message's
  ``tool_calls``; ``tool_result`` (a user's: ``tool_use_id``, ``content`` a string or
  text blocks, ``is_error``) -> a ``tool`` message before the turn's other text;
  ``thinking``/``redacted_thinking`` are accepted and left out of the prompt; ``image``
  and ``document`` are a 400 (this server's models take text only); ``cache_control``
  on any block, on ``system`` blocks and on ``tools`` marks a cache breakpoint;
- ``tools``: ``{name, description, input_schema}`` -> function tools (tools of
  Anthropic's own types, with no ``input_schema``, are left out); ``tool_choice``
  ``auto``/``any``/``tool``/``none`` -> ``auto``/``required``/the function/``none``;
- ``max_tokens`` (lowered to the context's room when past it), ``temperature``, ``top_p``,
  ``top_k`` in the chat endpoint's ranges; ``stop_sequences`` as ``stop``; ``stream``.

:func:`error_body` is an error in Anthropic's shape (``{"type": "error", "error": {type, message}}``).

``MessagesCall.breakpoint`` is the number of leading messages (of the Request's, the
system message counted) that end at the request's last breakpoint (None: no
breakpoint); ``ttl`` its ``cache_control.ttl`` ("5m" or "1h"). Pins are named by
:func:`pin_name`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .protocol import (Request, bad_field, json_type, model_field, nonempty_name, object_field, setting_field,
                       stop_field, temperature_field, tools_array, top_p_field, unicode_text, utf8_text)  # fmt: skip


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": utf8_text(message)}}


@dataclass
class MessagesCall:
    """What the Messages dialect adds to a Request."""

    breakpoint: int | None = None  # leading messages (system counted) up to the last cache_control
    ttl: str = "5m"
    stop_sequences: tuple[str, ...] = ()
    user: str | None = None  # metadata.user_id


def parse_messages(body: Any) -> tuple[Request, MessagesCall]:
    model = model_field(body)
    call = MessagesCall()
    messages: list[dict] = []
    marked = 0  # messages up to the last breakpoint so far
    tools = _tools(body, call)
    system = body.get("system")
    if system is not None:
        text, mark = _text_blocks(system, "system", call)
        if text or mark:
            messages.append({"role": "system", "content": text})
            marked = len(messages) if mark else marked
    if call.breakpoint == 0 and messages:  # a breakpoint on the tools: they render with the system prompt
        marked = len(messages)
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise bad_field("messages", "is required and must be a non-empty array of messages")
    for i, m in enumerate(turns):
        added, mark = _turn(m, i, call)
        messages += added
        if mark:
            marked = len(messages)
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        raise bad_field("stream", f"must be true or false, got {json_type(stream)}")
    stop = stop_field(body, "stop_sequences")
    call.stop_sequences = tuple(stop)
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str) and metadata["user_id"]:
        call.user = unicode_text(metadata["user_id"], "metadata.user_id")
    call.breakpoint = marked or None
    req = Request(
        kind="chat", model=model, messages=messages, max_tokens=setting_field(body, "max_tokens", "max_tokens"),
        temperature=temperature_field(body), top_p=top_p_field(body), top_k=setting_field(body, "top_k", "top_k"),
        tools=tools, tool_choice=tool_choice_field(body, tools), stop=stop, stream=bool(stream),
        mark_messages=messages[:marked] if marked else None, clamp_max_tokens=True,
    )  # fmt: skip
    return req, call


def pin_name(prompt: list[int], mark: int | None, call: MessagesCall, session: str | None) -> str | None:
    """What a request's cache breakpoint pins under: the ``X-Session-Id`` header, else
    ``metadata.user_id``, else the prefix up to the breakpoint (its tokens' digest);
    None without a breakpoint."""
    if not mark:
        return None
    if session or call.user:
        return "messages:" + (session or call.user)
    raw = json.dumps(prompt[:mark], separators=(",", ":")).encode()
    return "messages:" + hashlib.sha256(raw).hexdigest()[:32]


# ------------------------------------------------------------------ blocks
def _marks(block: dict, call: MessagesCall) -> bool:
    """Whether ``block`` carries ``cache_control`` (its ttl noted)."""
    cc = block.get("cache_control")
    if not isinstance(cc, dict):
        return False
    if cc.get("ttl") in ("5m", "1h"):
        call.ttl = cc["ttl"]
    return True


def _text_blocks(v: Any, param: str, call: MessagesCall) -> tuple[str, bool]:
    """A string or text blocks as one text, and whether a block marks a breakpoint."""
    if isinstance(v, str):
        return unicode_text(v, param), False
    if not isinstance(v, list):
        raise bad_field(param, f"must be a string or an array of text blocks, got {json_type(v)}")
    texts, mark = [], False
    for j, block in enumerate(v):
        p = f"{param}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_field(p, "must be a text block ({'type': 'text', 'text': ...})", "invalid_value")
        texts.append(unicode_text(block["text"], f"{p}.text"))
        mark = _marks(block, call) or mark
    return "\n\n".join(texts) if param == "system" else "".join(texts), mark


def _turn(m: Any, i: int, call: MessagesCall) -> tuple[list[dict], bool]:
    """Message ``i`` as chat messages, and whether its last block marks a breakpoint."""
    param = f"messages[{i}]"
    role = object_field(m, param).get("role")
    if role not in ("user", "assistant", "system"):
        shown = unicode_text(role, f"{param}.role")[:40] if isinstance(role, str) else json_type(role)
        raise bad_field(f"{param}.role", f"must be 'user', 'assistant' or 'system', got {shown!r}", "invalid_value")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": unicode_text(content, f"{param}.content")}], False
    if not isinstance(content, list):
        raise bad_field(f"{param}.content", f"must be a string or an array of content blocks, got {json_type(content)}")
    texts, calls, results, mark = [], [], [], False
    for j, block in enumerate(content):
        p = f"{param}.content[{j}]"
        kind = object_field(block, p).get("type")
        mark = _marks(block, call) or mark
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_field(f"{p}.text", f"must be a string, got {json_type(block.get('text'))}")
            texts.append(unicode_text(block["text"], f"{p}.text"))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, p))
        elif kind == "tool_result" and role == "user":
            result, inner = _tool_result(block, p, call)
            results.append(result)
            mark = inner or mark
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # the model's earlier reasoning: not part of the prompt
        elif kind in ("image", "document"):
            raise bad_field(p, f"is a {kind} block; this server's model takes text only: send text blocks",
                       "invalid_value")  # fmt: skip
        else:
            shown = unicode_text(kind, f"{p}.type")[:40] if isinstance(kind, str) else json_type(kind)
            raise bad_field(f"{p}.type", f"{shown!r} is not a content block a {role} message can hold here",
                            "invalid_value")  # fmt: skip
    out = list(results)
    if texts or calls or not results:
        msg = {"role": role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out, mark


def _tool_use(block: dict, p: str) -> dict:
    call_id = nonempty_name(block.get("id"), f"{p}.id")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise bad_field(f"{p}.input", f"must be an object, got {json_type(arguments)}")
    check_text_tree(arguments, f"{p}.input")
    return {"id": call_id, "type": "function", "function": {"name": nonempty_name(block.get("name"), f"{p}.name"),
                                                            "arguments": arguments}}  # fmt: skip


def _tool_result(block: dict, p: str, call: MessagesCall) -> tuple[dict, bool]:
    """The ``tool`` message of a ``tool_result`` block, and whether a block of its content
    marks a breakpoint."""
    content, mark = block.get("content", ""), False
    if isinstance(content, list):
        parts = []
        for j, b in enumerate(content):
            kind = object_field(b, f"{p}.content[{j}]").get("type")
            if kind == "text" and isinstance(b.get("text"), str):
                parts.append(unicode_text(b["text"], f"{p}.content[{j}].text"))
            elif kind in ("image", "document"):
                raise bad_field(f"{p}.content[{j}]", f"is a {kind} block; this server's model takes text only",
                           "invalid_value")  # fmt: skip
            else:
                raise bad_field(f"{p}.content[{j}]", "must be a text block", "invalid_value")
            mark = _marks(b, call) or mark
        content = "".join(parts)
    elif not isinstance(content, str):
        raise bad_field(f"{p}.content", f"must be a string or an array of text blocks, got {json_type(content)}")
    is_error = block.get("is_error")
    if is_error is not None and type(is_error) is not bool:
        raise bad_field(f"{p}.is_error", f"must be true or false, got {json_type(is_error)}")
    text = unicode_text(content, f"{p}.content")
    return {"role": "tool", "tool_call_id": nonempty_name(block.get("tool_use_id"), f"{p}.tool_use_id"),
            "content": f"Error: {text}" if is_error else text}, mark  # fmt: skip


def check_text_tree(v: Any, param: str) -> None:
    """Every string in ``v`` (keys too) is valid Unicode text."""
    if isinstance(v, str):
        unicode_text(v, param)
    elif isinstance(v, dict):
        for k, x in v.items():
            unicode_text(k, param)
            check_text_tree(x, param)
    elif isinstance(v, list):
        for x in v:
            check_text_tree(x, param)


def _tools(body: dict, call: MessagesCall) -> list[dict] | None:
    v = tools_array(body)
    if v is None:
        return None
    out = []
    for i, tool in enumerate(v):
        param = f"tools[{i}]"
        object_field(tool, param)
        if _marks(tool, call):
            call.breakpoint = 0  # before any message: the tools (and the system prompt they render with)
        if tool.get("input_schema") is None and tool.get("type") not in (None, "custom"):
            continue  # one of Anthropic's own tools (web search, ...): nothing here runs it
        name = nonempty_name(tool.get("name"), f"{param}.name")
        schema = object_field(tool.get("input_schema"), f"{param}.input_schema")
        check_text_tree(schema, f"{param}.input_schema")
        function = {"name": name, "parameters": schema}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise bad_field(f"{param}.description", "must be a string")
            function["description"] = unicode_text(tool["description"], f"{param}.description")
        out.append({"type": "function", "function": function})
    return out or None


def tool_choice_field(body: dict, tools: list[dict] | None) -> str | dict | None:
    v = body.get("tool_choice")
    if v is None:
        return None
    kind = object_field(v, "tool_choice").get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        if not tools:
            raise bad_field("tool_choice", "'any' needs 'tools'", "invalid_value")
        return "required"
    if kind != "tool":
        raise bad_field("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'", "invalid_value")
    name = nonempty_name(v.get("name"), "tool_choice.name")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise bad_field("tool_choice.name", f"names no tool in 'tools': {name[:60]!r}", "invalid_value")
    return {"type": "function", "function": {"name": name}}


__all__ = ["error_body", "MessagesCall", "parse_messages", "pin_name"]
