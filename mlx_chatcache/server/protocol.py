"""Request bodies of the OpenAI-compatible API, checked field by field.

Contract
--------
:func:`parse_chat` and :func:`parse_completion` turn a decoded JSON body into
a :class:`Request` or raise :class:`RequestError` (HTTP status, one-line
message, the offending ``param``, an OpenAI-style ``code``). Unknown fields are
ignored (clients send many); every field of the dialect is checked here: the
generation settings (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``repetition_context_size``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``seed``; speculative decoding's ``num_draft_tokens``,
0: no drafts, and ``prompt_lookup``, "off", "prompt" or "store") must be in the ranges of
:data:`~mlx_chatcache.config.RANGES`, and ``n``, ``top_logprobs`` and a completion's
integer ``logprobs`` in those of :data:`~mlx_chatcache.config.REQUEST_RANGES` (a 400
names the field and its range); ``tools``, ``tool_choice`` and ``response_format`` are checked
for shape; what a model cannot honour (tools without a tool-call format, a forced
call in a format without a grammar) is refused by the service, never dropped.
Messages have the roles ``system``, ``developer`` (read as ``system``), ``user``,
``assistant`` and ``tool``; an assistant message may carry ``tool_calls`` and a null
``content``; they reach the chat template as mlx-lm's server passes them (content
text, a call's ``arguments`` decoded to an object). ``model`` may be omitted. Text that is not valid
Unicode (a lone surrogate from a ``\\ud800`` escape) is refused, naming its field. :func:`error_body` is
the JSON every error response carries: ``{"error": {"message", "type",
"param", "code"}, "request_id"}`` (the id while a request is handled, :mod:`.logs`).
Nothing here touches the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..config import SERVER_DEFAULTS, SettingError, check_setting, range_of
from .logs import current_request_id

MAX_TEMPERATURE = 2.0  # OpenAI's API takes temperatures up to 2
MAX_LOGIT_BIAS = 300  # entries
ROLES = ("system", "developer", "user", "assistant", "tool")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class RequestError(Exception):
    """An error response: status, one-line message, ``param``, ``code`` and extra HTTP headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def utf8_text(text: str) -> str:
    """``text`` as valid UTF-8: what cannot be (a lone surrogate a client sent, quoted in a
    message) shown escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The body of an error response; ``request_id`` beside ``error`` while a request is handled."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": utf8_text(message), "type": kind, "param": param and utf8_text(param), "code": code}}
    rid = current_request_id()
    return body if rid is None else {**body, "request_id": rid}


@dataclass
class Request:
    kind: str  # "chat" | "completion"
    model: str | None  # None: the served model
    messages: list[dict] | None = None  # chat
    prompt: str | list[int] | None = None  # completion
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, bias added to its logit), ids ascending
    num_draft_tokens: int | None = None  # speculative decoding: drafts per model call (0: none)
    prompt_lookup: str | None = None  # speculative decoding: "off", "prompt" or "store"
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token (completions: its integer "logprobs")
    n: int = 1
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    response_format: dict | None = None  # {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema"}
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_key: str | None = None  # prompt_cache_key or the X-Session-Id header
    mark_messages: list[dict] | None = None  # the messages up to a cache breakpoint (Messages' cache_control)
    clamp_max_tokens: bool = False  # max_tokens past the context is lowered to fit (the agents' dialects)


# ------------------------------------------------------------------ field checks
def bad_field(param: str, what: str, code: str = "invalid_type") -> RequestError:
    return RequestError(400, f"'{param}' {what}", param, code)


def setting_field(body: dict, field: str, name: str | None = None) -> int | float | None:
    """Request field ``field``, whose range is that of setting ``name`` (default: the
    field's own; :func:`~mlx_chatcache.config.range_of`): of its type and in its range,
    else a 400 naming the field."""
    v = body.get(field)
    if v is None:
        return None
    integer = range_of(name or field).integer
    if type(v) is not int and (integer or type(v) is not float):
        raise bad_field(field, f"must be {'an integer' if integer else 'a number'}, got {json_type(v)}")
    try:
        return check_setting(name or field, v)
    except SettingError as e:
        raise bad_field(field, str(e), "invalid_value") from None


def temperature_field(body: dict) -> float | None:
    t = setting_field(body, "temperature", "temp")
    if t is not None and t > MAX_TEMPERATURE:
        raise bad_field("temperature", f"must be between 0 and {MAX_TEMPERATURE:g}, got {t:g}", "invalid_value")
    return t


def top_p_field(body: dict) -> float | None:
    """``top_p``; 0 (which OpenAI's API takes) keeps only the most likely token."""
    return 0.0 if body.get("top_p") == 0 and type(body["top_p"]) is not bool else setting_field(body, "top_p", "top_p")


def _repetition_penalty(body: dict) -> float | None:
    """``repetition_penalty``; 0 means none, as in mlx-lm's server."""
    v = body.get("repetition_penalty")
    return None if v == 0 and type(v) is not bool else setting_field(body, "repetition_penalty", "repetition_penalty")


def _choice(body: dict, name: str) -> str | None:
    """A request field whose value is one of a setting's names (:data:`~mlx_chatcache.config.RANGES`)."""
    v = optional_str(body, name)
    if v is None:
        return None
    try:
        return check_setting(name, v)
    except SettingError as e:
        raise bad_field(name, str(e), "invalid_value") from None


def _opt_bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if type(v) is not bool:
        raise bad_field(name, f"must be true or false, got {json_type(v)}")
    return v


def optional_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_field(name, f"must be a string, got {json_type(v)}")
    return unicode_text(v, name)


def unicode_text(v: str, param: str) -> str:
    """``v`` if it is valid Unicode text; JSON's ``\\ud800`` escapes can make a lone surrogate."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_field(param, f"is not valid Unicode text (a lone surrogate at character {e.start}); "
                   "send UTF-8 text, with surrogate escapes only in pairs", "invalid_value") from None  # fmt: skip
    return v


def json_type(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)  # fmt: skip


def stop_field(body: dict, name: str = "stop") -> list[str]:
    v = body.get(name)
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_field(name, f"must be a string or an array of strings, got {json_type(v)}")
    if len(stops) > SERVER_DEFAULTS.max_stop_sequences:
        raise bad_field(name, f"takes at most {SERVER_DEFAULTS.max_stop_sequences} sequences, got {len(stops)}", "invalid_value")
    return [unicode_text(s, f"{name}[{i}]" if isinstance(v, list) else name) for i, s in enumerate(stops) if s]


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...] | None:
    """``logit_bias``: an object of at most ``MAX_LOGIT_BIAS`` token ids (decimal keys)
    to biases in the setting's range, as (id, bias) pairs."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_field("logit_bias", f"must be an object mapping token ids to biases, got {json_type(v)}")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad_field("logit_bias", f"takes at most {MAX_LOGIT_BIAS} tokens, got {len(v)}", "invalid_value")
    try:
        return check_setting("logit_bias", v) or None
    except SettingError as e:
        raise bad_field("logit_bias", str(e), "invalid_value") from None


def _logprobs(body: dict, kind: str) -> tuple[bool, int | None]:
    """(logprobs wanted, alternatives per token): chat's ``logprobs`` (a boolean) and
    ``top_logprobs``, or a completion's integer ``logprobs``."""
    if kind == "completion":
        top = None if body.get("logprobs") is False else setting_field(body, "logprobs", "completion_logprobs")
        return top is not None, top
    want, top = _opt_bool(body, "logprobs"), setting_field(body, "top_logprobs")
    if top is not None and not want:
        raise bad_field("top_logprobs", "needs 'logprobs': true", "invalid_value")
    return want, top


def object_field(v: Any, param: str) -> dict:
    if not isinstance(v, dict):
        raise bad_field(param, f"must be an object, got {json_type(v)}")
    return v


def nonempty_name(v: Any, param: str) -> str:
    if not isinstance(v, str) or not v:
        raise bad_field(param, f"must be a non-empty string, got {json_type(v)}")
    return unicode_text(v, param)


def tools_array(body: dict) -> list | None:
    """A request's ``tools``: None when absent, else the array (a 400 when not an array)."""
    v = body.get("tools")
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad_field("tools", f"must be an array of tools, got {json_type(v)}")
    return v


def _tools(body: dict) -> list[dict] | None:
    v = tools_array(body)
    if v is None:
        return None
    for i, tool in enumerate(v):
        param = f"tools[{i}]"
        if object_field(tool, param).get("type") != "function":
            raise bad_field(f"{param}.type", "must be 'function'", "invalid_value")
        function = object_field(tool.get("function"), f"{param}.function")
        nonempty_name(function.get("name"), f"{param}.function.name")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise bad_field(f"{param}.function.description", "must be a string")
        if function.get("parameters") is not None:
            object_field(function["parameters"], f"{param}.function.parameters")
    return v or None


def tool_choice_field(body: dict, tools: list[dict] | None) -> str | dict | None:
    v = body.get("tool_choice")
    if v is None or v in ("none", "auto", "required"):
        if v == "required" and not tools:
            raise bad_field("tool_choice", "'required' needs 'tools'", "invalid_value")
        return v
    if isinstance(v, str):
        raise bad_field("tool_choice", f"must be 'none', 'auto', 'required' or a function, got {v[:40]!r}", "invalid_value")
    if object_field(v, "tool_choice").get("type") != "function":
        raise bad_field("tool_choice.type", "must be 'function'", "invalid_value")
    name = nonempty_name(object_field(v.get("function"), "tool_choice.function").get("name"), "tool_choice.function.name")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise bad_field("tool_choice.function.name", f"names no tool in 'tools': {name[:60]!r}", "invalid_value")
    return v


def response_format_field(body: dict) -> dict | None:
    v = body.get("response_format")
    if v is None:
        return None
    kind = object_field(v, "response_format").get("type")
    if kind not in RESPONSE_FORMATS:
        raise bad_field("response_format.type", f"must be one of {', '.join(RESPONSE_FORMATS)}", "invalid_value")
    if kind == "json_schema":
        spec = object_field(v.get("json_schema"), "response_format.json_schema")
        nonempty_name(spec.get("name", "schema"), "response_format.json_schema.name")
        object_field(spec.get("schema", {}), "response_format.json_schema.schema")
        if spec.get("strict") is not None and type(spec["strict"]) is not bool:
            raise bad_field("response_format.json_schema.strict", "must be true or false")
    return v


def model_field(body: Any) -> str | None:
    """The ``model`` of a request body, which must be a JSON object (a 400 otherwise)."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {json_type(body)}", None, "invalid_json")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_field("model", "must be a non-empty string, or left out for the served model (see GET /v1/models)")
    if model is not None:
        unicode_text(model, "model")
    return model


def _common(body: Any, kind: str) -> Request:
    model = model_field(body)
    max_tokens = setting_field(body, "max_completion_tokens", "max_tokens")
    if max_tokens is None:
        max_tokens = setting_field(body, "max_tokens", "max_tokens")
    stream = _opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_field("stream_options", f"must be an object, got {json_type(options)}")
    include_usage = _opt_bool(options or {}, "include_usage")
    logprobs, top_logprobs = _logprobs(body, kind)
    tools = _tools(body)
    return Request(
        kind=kind, model=model, max_tokens=max_tokens,
        temperature=temperature_field(body), top_p=top_p_field(body), seed=setting_field(body, "seed", "seed"),
        top_k=setting_field(body, "top_k", "top_k"), min_p=setting_field(body, "min_p", "min_p"),
        repetition_penalty=_repetition_penalty(body),
        repetition_context_size=setting_field(body, "repetition_context_size", "repetition_context_size"),
        presence_penalty=setting_field(body, "presence_penalty"), frequency_penalty=setting_field(body, "frequency_penalty"),
        logit_bias=_logit_bias(body), num_draft_tokens=setting_field(body, "num_draft_tokens"),
        prompt_lookup=_choice(body, "prompt_lookup"), logprobs=logprobs, top_logprobs=top_logprobs,
        n=setting_field(body, "n") or 1,
        tools=tools, tool_choice=tool_choice_field(body, tools), response_format=response_format_field(body),
        stop=stop_field(body), stream=stream, include_usage=include_usage,
        cache_key=optional_str(body, "prompt_cache_key"),
    )  # fmt: skip


# ------------------------------------------------------------------ bodies
def parse_chat(body: Any) -> Request:
    req = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "is required and must be a non-empty array of messages")
    req.messages = [_message(m, i) for i, m in enumerate(messages)]
    return req


def _message(m: Any, i: int) -> dict:
    """Message ``i`` as the chat template gets it: role (``developer`` read as
    ``system``), content text, and an assistant's ``tool_calls`` (arguments decoded)
    or a tool result's ``tool_call_id`` and ``name`` when given."""
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_field(param, f"must be an object with 'role' and 'content', got {json_type(m)}")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise bad_field(f"{param}.role", "is required and must be a string")
    if role not in ROLES:
        raise bad_field(f"{param}.role", f"must be one of {', '.join(ROLES)}, got {unicode_text(role, f'{param}.role')[:40]!r}",
                   "invalid_value")  # fmt: skip
    role = "system" if role == "developer" else role
    content = m.get("content")
    tool_calls = m.get("tool_calls") if role == "assistant" else None
    if content is None and role == "assistant":
        content = ""  # a message of tool calls only, or an empty one
    if isinstance(content, list):  # content parts: only text ones
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_field(f"{param}.content[{j}]", "must be a text part ({'type': 'text', 'text': ...}); "
                           "this server takes text only", "invalid_value")  # fmt: skip
            texts.append(unicode_text(part["text"], f"{param}.content[{j}].text"))
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_field(f"{param}.content", f"must be a string or an array of text parts, got {json_type(content)}")
    out = {"role": role, "content": unicode_text(content, f"{param}.content")}
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise bad_field(f"{param}.tool_calls", f"must be an array of tool calls, got {json_type(tool_calls)}")
        out["tool_calls"] = [_tool_call(c, f"{param}.tool_calls[{j}]") for j, c in enumerate(tool_calls)]
    if role == "tool":
        for name in ("tool_call_id", "name"):
            if m.get(name) is not None:
                out[name] = nonempty_name(m[name], f"{param}.{name}")
    return out


def _tool_call(c: Any, param: str) -> dict:
    """A tool call of the history: ``{id, type, function: {name, arguments}}``, its
    arguments (a JSON text or an object) decoded to an object."""
    if object_field(c, param).get("type", "function") != "function":
        raise bad_field(f"{param}.type", "must be 'function'", "invalid_value")
    function = object_field(c.get("function"), f"{param}.function")
    name = nonempty_name(function.get("name"), f"{param}.function.name")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(unicode_text(arguments, f"{param}.function.arguments"))
        except (ValueError, RecursionError):
            raise bad_field(f"{param}.function.arguments", "must be a JSON object (as text or as an object)",
                       "invalid_value") from None  # fmt: skip
    if not isinstance(arguments, dict):
        raise bad_field(f"{param}.function.arguments", f"must be a JSON object, got {json_type(arguments)}", "invalid_value")
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if c.get("id") is not None:
        call["id"] = nonempty_name(c["id"], f"{param}.id")
    return call


def parse_completion(body: Any) -> Request:
    req = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        req.prompt = list(prompt)
    elif isinstance(prompt, str) and prompt:
        req.prompt = unicode_text(prompt, "prompt")
    else:
        raise bad_field("prompt", "is required and must be a non-empty string or array of token ids "
                   "(one prompt per request)")  # fmt: skip
    return req
