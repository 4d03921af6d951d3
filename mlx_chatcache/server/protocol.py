"""Request bodies of the OpenAI-compatible API, checked field by field.

Contract
--------
:func:`parse_chat` and :func:`parse_completion` turn a decoded JSON body into
a :class:`Request` or raise :class:`RequestError` (HTTP status, one-line
message, the offending ``param``, an OpenAI-style ``code``). Unknown fields are
ignored (clients send many); the generation settings (``max_tokens``, ``temperature``,
``top_p``, ``seed``) must be in the ranges of :data:`~mlx_chatcache.config.RANGES`
(a 400 names the field and its range); fields we cannot honour (``n`` > 1, ``logprobs``,
``tools``) are refused rather than silently dropped; text that is not valid
Unicode (a lone surrogate from a ``\\ud800`` escape) is refused, naming its field. :func:`error_body` is
the JSON every error response carries: ``{"error": {"message", "type",
"param", "code"}}``. Nothing here touches the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import RANGES, SERVER_DEFAULTS, SettingError, check_setting

MAX_TEMPERATURE = 2.0  # OpenAI's API takes temperatures up to 2


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Request:
    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict] | None = None  # chat
    prompt: str | list[int] | None = None  # completion
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_key: str | None = None  # prompt_cache_key or the X-Session-Id header


# ------------------------------------------------------------------ field checks
def _bad(param: str, what: str, code: str = "invalid_type") -> RequestError:
    return RequestError(400, f"'{param}' {what}", param, code)


def _opt_int(body: dict, name: str, low: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if type(v) is not int:
        raise _bad(name, f"must be an integer, got {_json_type(v)}")
    if low is not None and v < low:
        raise _bad(name, f"must be >= {low}, got {v}", "invalid_value")
    return v


def _setting(body: dict, field: str, name: str) -> int | float | None:
    """Request field ``field``, which sets GenerationConfig field ``name``: of its type
    and in its range (:data:`~mlx_chatcache.config.RANGES`), else a 400 naming both."""
    v = body.get(field)
    if v is None:
        return None
    integer = RANGES[name].integer
    if type(v) is not int and (integer or type(v) is not float):
        raise _bad(field, f"must be {'an integer' if integer else 'a number'}, got {_json_type(v)}")
    try:
        return check_setting(name, v)
    except SettingError as e:
        raise _bad(field, str(e), "invalid_value") from None


def _temperature(body: dict) -> float | None:
    t = _setting(body, "temperature", "temp")
    if t is not None and t > MAX_TEMPERATURE:
        raise _bad("temperature", f"must be between 0 and {MAX_TEMPERATURE:g}, got {t:g}", "invalid_value")
    return t


def _top_p(body: dict) -> float | None:
    """``top_p``; 0 (which OpenAI's API takes) keeps only the most likely token."""
    return 0.0 if body.get("top_p") == 0 and type(body["top_p"]) is not bool else _setting(body, "top_p", "top_p")


def _opt_bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if type(v) is not bool:
        raise _bad(name, f"must be true or false, got {_json_type(v)}")
    return v


def _opt_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _bad(name, f"must be a string, got {_json_type(v)}")
    return _text(v, name)


def _text(v: str, param: str) -> str:
    """``v`` if it is valid Unicode text; JSON's ``\\ud800`` escapes can make a lone surrogate."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(param, f"is not valid Unicode text (a lone surrogate at character {e.start}); "
                   "send UTF-8 text, with surrogate escapes only in pairs", "invalid_value") from None  # fmt: skip
    return v


def _json_type(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)  # fmt: skip


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", f"must be a string or an array of strings, got {_json_type(v)}")
    if len(stops) > SERVER_DEFAULTS.max_stop_sequences:
        raise _bad("stop", f"takes at most {SERVER_DEFAULTS.max_stop_sequences} sequences, got {len(stops)}", "invalid_value")
    return [_text(s, f"stop[{i}]" if isinstance(v, list) else "stop") for i, s in enumerate(stops) if s]


def _common(body: Any, kind: str) -> Request:
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {_json_type(body)}", None, "invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "is required and must be a string (see GET /v1/models)")
    _text(model, "model")
    n = _opt_int(body, "n", 1)
    if n not in (None, 1):
        raise _bad("n", f"must be 1: this server returns one choice per request, got {n}", "invalid_value")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise _bad("logprobs", "is not supported by this server; drop it", "unsupported_parameter")
    if body.get("tools"):
        raise _bad("tools", "are not supported by this server; drop them", "unsupported_parameter")
    max_tokens = _setting(body, "max_completion_tokens", "max_tokens")
    if max_tokens is None:
        max_tokens = _setting(body, "max_tokens", "max_tokens")
    stream = _opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", f"must be an object, got {_json_type(options)}")
    include_usage = _opt_bool(options or {}, "include_usage")
    return Request(
        kind=kind, model=model, max_tokens=max_tokens,
        temperature=_temperature(body), top_p=_top_p(body), seed=_setting(body, "seed", "seed"),
        stop=_stop(body), stream=stream, include_usage=include_usage,
        cache_key=_opt_str(body, "prompt_cache_key"),
    )  # fmt: skip


# ------------------------------------------------------------------ bodies
def parse_chat(body: Any) -> Request:
    req = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "is required and must be a non-empty array of messages")
    req.messages = [_message(m, i) for i, m in enumerate(messages)]
    return req


def _message(m: Any, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(param, f"must be an object with 'role' and 'content', got {_json_type(m)}")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise _bad(f"{param}.role", "is required and must be a string")
    _text(role, f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text ones
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{param}.content[{j}]", "must be a text part ({'type': 'text', 'text': ...}); "
                           "this server takes text only", "invalid_value")  # fmt: skip
            texts.append(_text(part["text"], f"{param}.content[{j}].text"))
        content = "".join(texts)
    if not isinstance(content, str):
        raise _bad(f"{param}.content", f"must be a string or an array of text parts, got {_json_type(content)}")
    _text(content, f"{param}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_completion(body: Any) -> Request:
    req = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        req.prompt = list(prompt)
    elif isinstance(prompt, str) and prompt:
        req.prompt = _text(prompt, "prompt")
    else:
        raise _bad("prompt", "is required and must be a non-empty string or array of token ids "
                   "(one prompt per request)")  # fmt: skip
    return req
