"""Tool calls: the request's ``tools``/``tool_choice``, forced calls, and calls parsed from a reply.

The tool-call format is the model's own: mlx-lm's tokenizer wrapper names it
(``tokenizer.tool_parser``, ``tool_call_start``, ``tool_call_end``, chosen by mlx-lm
from the tokenizer config or the chat template), and its parser reads a call's text.

Contract
--------
- :func:`forced_choice` says what a ``tool_choice`` (its shape checked by
  :mod:`~mlx_chatcache.server.protocol`) forces: "required", a function's name, or nothing.
- :func:`forced_call_grammar` is the grammar (for :class:`~mlx_chatcache.generation.constrain.Constraint`)
  that makes the reply exactly one call in the model's format, of the named function
  (or any of ``tools`` for "required"), its arguments valid under the function's
  ``parameters`` (with no properties beyond those listed, as OpenAI's strict mode).
  Formats with a grammar: :data:`FORCED_FAMILIES`; any other is a :class:`ToolError`
  naming ``tool_choice``.
- :class:`ToolCallStream` splits streamed text into content and calls on the format's
  start/end markers, holding back a partial marker; :func:`split_tool_calls` does it
  for a whole reply. A call mlx-lm's parser cannot read stays in the content, as
  written (it is logged), never dropped. Calls come out in OpenAI's shape
  ``{id, type: "function", function: {name, arguments: JSON text}}``.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from functools import partial

from ..errors import ChatCacheError

log = logging.getLogger("mlxcc.server")

COMPACT = {"whitespace_flexible": False}


class ToolError(ChatCacheError):
    """A request's tools cannot be honoured; ``param`` names the field (for a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# ------------------------------------------------------------------ request fields
def forced_choice(tool_choice) -> str | None:
    """What a ``tool_choice`` (checked by the protocol) forces: "required", a function's
    name, or None ("none", "auto", absent: nothing is forced)."""
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    return tool_choice if tool_choice == "required" else None


def tool_family(tokenizer) -> str | None:
    """The name of mlx-lm's tool-call format for ``tokenizer`` (None: it declares none)."""
    parser = getattr(tokenizer, "tool_parser", None)
    return None if parser is None else parser.__module__.rsplit(".", 1)[-1]


# ------------------------------------------------------------------ forced calls
def forced_call_grammar(tokenizer, tools: list[dict], choice: str) -> str:
    """The Lark grammar of one call (``choice``: "required" or a function name); see the module docstring."""
    family = tool_family(tokenizer)
    if family is None:
        raise ToolError("this model's tokenizer declares no tool-call format; drop tools", "tools")
    if family not in FORCED_FAMILIES:
        raise ToolError(f"forced tool calls are not available for this model's tool format {family}; "
                        "use tool_choice 'auto'", "tool_choice")  # fmt: skip
    fns = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    start, end = _marker(tokenizer, tokenizer.tool_call_start), _marker(tokenizer, tokenizer.tool_call_end)
    lines = [f"start: {start} call {end}".rstrip(), "call: " + " | ".join(f"c{i}" for i in range(len(fns)))]
    for i, fn in enumerate(fns):
        lines += _FAMILY_RULES[family](f"c{i}", fn["name"], _parameters(fn), lambda t: _marker(tokenizer, t))
    from ..generation.constrain import lark_grammar

    return lark_grammar("\n".join(lines))


def _marker(tokenizer, text: str) -> str:
    """``text`` in Lark: its special tokens as themselves (``<[id]>``), the rest as strings."""
    if not text:
        return ""
    special = set(getattr(tokenizer, "all_special_tokens", ())) | set(getattr(tokenizer, "added_tokens_encoder", {}))
    names = sorted((t for t in special if t and t in text), key=len, reverse=True)
    if not names:
        return json.dumps(text)
    parts = []
    for piece in re.split("(" + "|".join(map(re.escape, names)) + ")", text):
        ids = tokenizer.encode(piece, add_special_tokens=False) if piece in special else None
        if ids is not None and len(ids) == 1:
            parts.append(f"<[{ids[0]}]>")
        elif piece:
            parts.append(json.dumps(piece))
    return " ".join(parts)


def _parameters(fn: dict) -> dict:
    params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    params.setdefault("additionalProperties", False)
    return params


def _json_rule(rule: str, schema: dict) -> str:
    return f"{rule}: %json " + json.dumps({**schema, "x-guidance": COMPACT})


def _call_object(name: str, params: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip


def _json_tools_rules(rule: str, name: str, params: dict, marker=json.dumps) -> list[str]:
    return [_json_rule(rule, _call_object(name, params))]


def _mistral_rules(rule: str, name: str, params: dict, marker=json.dumps) -> list[str]:
    return [f'{rule}: "[" {rule}o "]"', _json_rule(f"{rule}o", _call_object(name, params))]


def _required(params: dict) -> list[tuple[str, dict]]:
    """The required parameters in schema order (the forced call gives exactly those)."""
    required = set(params.get("required", ()))
    return [(k, v if isinstance(v, dict) else {}) for k, v in params["properties"].items() if k in required]


def _raw_string(schema: dict) -> str | None:
    """A Lark expression for an unquoted string value (None when ``schema`` is not a plain string)."""
    if schema.get("type") != "string":
        return None
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"] if isinstance(v, str)) or None
    n = schema.get("maxLength")
    return "/[^<\\n]{%d,%s}/" % (max(int(schema.get("minLength", 0)), 0), "" if n is None else int(n))


def _qwen3_coder_rules(rule: str, name: str, params: dict, marker=json.dumps) -> list[str]:
    parts, lines = [json.dumps(f"\n<function={name}>\n")], []
    for j, (key, schema) in enumerate(_required(params)):
        value = _raw_string(schema)
        if value is None:
            value = f"{rule}v{j}"
            lines.append(_json_rule(value, schema))
        parts += [json.dumps(f"<parameter={key}>\n"), f"({value})", json.dumps("\n</parameter>\n")]
    parts.append(json.dumps("</function>\n"))
    return [f"{rule}: " + " ".join(parts), *lines]


def _pythonic_rules(rule: str, name: str, params: dict, marker=json.dumps) -> list[str]:
    parts, lines = [json.dumps(f"[{name}(")], []
    for j, (key, schema) in enumerate(_required(params)):
        value = f"{rule}v{j}"
        if schema.get("type") == "string" and "enum" not in schema:  # a Python string without escapes
            n = schema.get("maxLength")
            lines.append(f"{value}: /\"[^\"\\\\\\n]{{{int(schema.get('minLength', 0))},{'' if n is None else int(n)}}}\"/")
        else:
            lines.append(_json_rule(value, schema))
        parts += [json.dumps((", " if j else "") + f"{key}="), value]
    parts.append(json.dumps(")]"))
    return [f"{rule}: " + " ".join(parts), *lines]


def _trimmed_string(schema: dict) -> str:
    """A Lark regex of an unquoted string that neither starts nor ends with whitespace (parsers strip it)."""
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    if high is not None and int(high) < 2:
        return "/[^<\\s\\x1c-\\x1f\\x85]{%d,%d}/" % (min(low, int(high)), int(high))
    middle = "{%d,%s}" % (max(low - 2, 0), "" if high is None else int(high) - 2)
    edge = "[^<\\s\\x1c-\\x1f\\x85]"  # Python's str.strip also takes these
    return "/(%s|%s[^<]%s%s)%s/" % (edge, edge, middle, edge, "" if low else "?")


def _span(schema: dict) -> str:
    n = schema.get("maxLength")
    return "{%d,%s}" % (max(int(schema.get("minLength", 0)), 0), "" if n is None else int(n))


def _enum_token(schema: dict, writable) -> str:
    """The enum's string values that ``writable`` accepts, as Lark alternatives."""
    values = [v for v in schema["enum"] if isinstance(v, str) and writable(v)]
    if not values:
        raise ToolError(f"no value of the enum {schema['enum']!r} can be written in this model's tool format; "
                        "use tool_choice 'auto'", "tool_choice")  # fmt: skip
    return " | ".join(json.dumps(v) for v in values)


def _bare(schema: dict) -> str:
    """A string written as is, stripped by the parser."""
    if "enum" in schema:
        return _enum_token(schema, lambda v: v == v.strip() and "<" not in v)
    return _trimmed_string(schema)


def _bare_not_null(schema: dict) -> str:
    """A string written as is, stripped, and read as None when it spells null (minimax_m2, minicpm5)."""
    if "enum" in schema:
        return _enum_token(schema, lambda v: v == v.strip() and "<" not in v and v.lower() != "null")
    return _trimmed_string(schema) + " & ~/[nN][uU][lL][lL]/"


def _json_string(schema: dict) -> str:
    """A JSON string literal without escapes or ``<`` (muse_spark)."""
    if "enum" in schema:
        return _enum_token(schema, lambda v: json.dumps(v) == f'"{v}"' and "<" not in v)
    return '/"[^"\\\\<\\x00-\\x1f]%s"/' % _span(schema)


SCALARS = ("integer", "number", "boolean", "null")


def _values(rule: str, params: dict, string_token, scalars_only: bool = False) -> tuple[list, list[str]]:
    """Each required parameter as ``(key, Lark expression)``, and the rules they use: strings
    through ``string_token(schema)``, other values as compact JSON (only scalars when
    ``scalars_only``: the format's own syntax would misread a JSON object or array)."""
    pairs, lines = [], []
    for j, (key, schema) in enumerate(_required(params)):
        name = f"{rule}v{j}"
        if schema.get("type") == "string":
            name = name.upper()
            lines.append(f"{name}: {string_token(schema)}")
        elif scalars_only and schema.get("type") not in SCALARS:
            raise ToolError(f"parameter {key!r} ({schema.get('type', 'any type')}) cannot be forced in this model's "
                            "tool format; use tool_choice 'auto'", "tool_choice")  # fmt: skip
        else:
            lines.append(_json_rule(name, schema))
        pairs.append((key, name))
    return pairs, lines


def _words(*names: str) -> None:
    """Formats that write names bare need word characters only."""
    for n in names:
        if not re.fullmatch(r"\w+", n):
            raise ToolError(f"the name {n!r} cannot be written in this model's tool format (letters, digits "
                            "and _ only); use tool_choice 'auto'", "tool_choice")  # fmt: skip


def _arg_pairs_rules(tag: str):
    """glm47 and longcat: ``name<TAG_key>k</TAG_key><TAG_value>v</TAG_value>...``."""

    def rules(rule: str, name: str, params: dict, marker=json.dumps) -> list[str]:
        pairs, lines = _values(rule, params, _bare)
        if not pairs and tag == "longcat_arg":  # longcat reads a call without arguments only as JSON
            return [_json_rule(rule, _call_object(name, params))]
        parts = [json.dumps(name)]
        for key, value in pairs:
            parts += [marker(f"<{tag}_key>"), json.dumps(key), marker(f"</{tag}_key>"), marker(f"<{tag}_value>"),
                      value, marker(f"</{tag}_value>")]  # fmt: skip
        return [f"{rule}: " + " ".join(parts), *lines]

    return rules


def _tagged_rules(opening: str, param: str, closing: str, value, rule: str, name: str, params: dict,
                  marker=json.dumps) -> list[str]:
    """A call written as ``opening`` (with the tool's name), each parameter inside
    ``<{param} name="key">...</{param}>``, then ``closing`` (may be empty)."""
    pairs, lines = _values(rule, params, value)
    parts = [json.dumps(opening.format(name=name))]
    for key, v in pairs:
        parts += [json.dumps(f'<{param} name="{key}">'), v, json.dumps(f"</{param}>")]
    return [f"{rule}: " + " ".join([*parts, *([json.dumps(closing)] if closing else [])]), *lines]


_minimax_m2_rules = partial(_tagged_rules, '<invoke name="{name}">', "parameter", "</invoke>", _bare_not_null)
_minicpm5_rules = partial(_tagged_rules, '"{name}">', "param", "", _bare_not_null)  # after '<function name='
_muse_spark_rules = partial(_tagged_rules, '<atem:invoke name="{name}">', "atem:parameter", "</atem:invoke>",
                            _json_string)  # fmt: skip


def _function_gemma_rules(rule: str, name: str, params: dict, marker=json.dumps) -> list[str]:
    esc = marker("<escape>")
    _words(name, *(k for k, _ in _required(params)))
    pairs, lines = _values(rule, params, lambda s: _enum_token(s, lambda v: not set(v) & set("<}")) if "enum" in s
                           else f"/[^<}}]{_span(s)}/", scalars_only=True)  # fmt: skip
    strings = {k for k, s in _required(params) if s.get("type") == "string"}
    parts = [json.dumps(f"call:{name}{{")]
    for j, (key, value) in enumerate(pairs):
        parts += [json.dumps(("," if j else "") + f"{key}:")]
        parts += [esc, value, esc] if key in strings else [value]
    return [f"{rule}: " + " ".join([*parts, json.dumps("}")]), *lines]


def _gemma4_rules(rule: str, name: str, params: dict, marker=json.dumps) -> list[str]:
    quote = marker('<|"|>')
    _words(name, *(k for k, _ in _required(params)))
    pairs, lines = _values(rule, params, lambda s: _enum_token(s, lambda v: "<" not in v and "\x00" not in v)
                           if "enum" in s else f"/[^<\\x00]{_span(s)}/", scalars_only=True)  # fmt: skip
    strings = {k for k, s in _required(params) if s.get("type") == "string"}
    parts = [json.dumps(f"call:{name}{{")]
    for j, (key, value) in enumerate(pairs):
        parts += [json.dumps(("," if j else "") + f"{key}:")]
        parts += [quote, value, quote] if key in strings else [value]
    return [f"{rule}: " + " ".join([*parts, json.dumps("}")]), *lines]


def _kimi_k2_rules(rule: str, name: str, params: dict, marker=json.dumps) -> list[str]:
    if ":" in name:
        raise ToolError(f"the name {name!r} cannot be written in this model's tool format (it holds ':'); "
                        "use tool_choice 'auto'", "tool_choice")  # fmt: skip
    head = [marker("<|tool_call_begin|>"), json.dumps(f"functions.{name}:0"), marker("<|tool_call_argument_begin|>")]
    return [f"{rule}: " + " ".join([*head, f"{rule}a", marker("<|tool_call_end|>")]), _json_rule(f"{rule}a", params)]


def _kimi_k3_rules(rule: str, name: str, params: dict, marker=json.dumps) -> list[str]:
    if '"' in name or "&" in name:
        raise ToolError(f"the name {name!r} cannot be written in this model's tool format (it holds '\"' or '&'); "
                        "use tool_choice 'auto'", "tool_choice")  # fmt: skip
    parts = [marker(f'<|open|>call tool="{name}"<|sep|><|open|>json type="object"<|sep|>'), f"{rule}a",
             marker("<|close|>json<|sep|><|close|>call<|sep|>")]  # fmt: skip
    return [f"{rule}: " + " ".join(parts), _json_rule(f"{rule}a", params)]


_FAMILY_RULES = {
    "json_tools": _json_tools_rules,
    "mistral": _mistral_rules,
    "qwen3_coder": _qwen3_coder_rules,
    "pythonic": _pythonic_rules,
    "glm47": _arg_pairs_rules("arg"),
    "longcat": _arg_pairs_rules("longcat_arg"),
    "minimax_m2": _minimax_m2_rules,
    "minicpm5": _minicpm5_rules,
    "muse_spark": _muse_spark_rules,
    "function_gemma": _function_gemma_rules,
    "gemma4": _gemma4_rules,
    "kimi_k2": _kimi_k2_rules,
    "kimi_k3": _kimi_k3_rules,
}
FORCED_FAMILIES = tuple(_FAMILY_RULES)


# ------------------------------------------------------------------ parsing replies
class ToolCallStream:
    """Streamed text in, ``(content, calls)`` out (see the module docstring); each call
    carries its ``index`` in the reply."""

    def __init__(self, tokenizer, tools: list[dict]):
        self.tokenizer, self.tools = tokenizer, tools
        self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
        self.buf, self.inside, self.count = "", False, 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content and the calls that ``text`` completes."""
        self.buf += text
        content, calls = [], []
        while True:
            if not self.inside:
                i = self.buf.find(self.start)
                if i < 0:
                    cut = len(self.buf) - partial_suffix(self.buf, self.start)
                    content.append(self.buf[:cut])
                    self.buf = self.buf[cut:]
                    break
                content.append(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(self.start) :], True
            else:
                j = self.buf.find(self.end) if self.end else -1
                if j < 0:  # an end-less format's call runs to the end of the reply
                    break
                self._call(self.buf[:j], content, calls)
                self.buf, self.inside = self.buf[j + len(self.end) :], False
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        """What is held back, at the end of the reply (an unclosed call is content)."""
        content, calls = [], []
        if self.inside and not self.end:
            self._call(self.buf, content, calls)
        else:
            content.append((self.start if self.inside else "") + self.buf)
        self.buf, self.inside = "", False
        return "".join(content), calls

    def _call(self, body: str, content: list[str], calls: list[dict]) -> None:
        try:
            parsed = self.tokenizer.tool_parser(body, self.tools)
            found = parsed if isinstance(parsed, list) else [parsed]
            shaped = [openai_call(c) for c in found]
        except Exception as e:  # mlx-lm's parsers raise what they meet (ValueError, SyntaxError, ...)
            log.warning("a tool call could not be parsed (%s: %s); it stays in the content", type(e).__name__, e)
            content.append(self.start + body + self.end)
            return
        for c in shaped:
            calls.append({"index": self.count, **c})
            self.count += 1


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that starts ``marker`` (shorter than it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def openai_call(parsed: dict) -> dict:
    """mlx-lm's ``{name, arguments}`` (maybe ``id``) as OpenAI's tool call."""
    name, arguments = parsed["name"], parsed.get("arguments", {})
    if not isinstance(name, str):
        raise ValueError(f"the call's name is not a string: {name!r}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    call_id = parsed.get("id") if isinstance(parsed.get("id"), str) else "call_" + uuid.uuid4().hex[:24]
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def split_tool_calls(tokenizer, tools: list[dict], text: str) -> tuple[str | None, list[dict]]:
    """A whole reply as ``(content, calls)``; content None when the reply is only calls."""
    stream = ToolCallStream(tokenizer, tools)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    content, calls = content + rest, calls + more
    return (None if calls and not content.strip() else content), [{k: v for k, v in c.items() if k != "index"} for c in calls]


__all__ = [
    "FORCED_FAMILIES",
    "ToolError",
    "forced_choice",
    "tool_family",
    "forced_call_grammar",
    "ToolCallStream",
    "openai_call",
    "split_tool_calls",
]
