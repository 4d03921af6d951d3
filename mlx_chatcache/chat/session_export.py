"""A saved conversation as text another program reads: JSON or Markdown.

Contract
--------
:func:`to_json` is exactly the session's messages, a JSON list of
``{"role", "content"}`` objects: the ``messages`` argument of an OpenAI-style
chat completion request. :func:`to_markdown` is a ``# NAME`` title, a model
line, then one ``## ROLE`` section per message, in order, with the content
verbatim; content that could end its section early (a line that reads as a
Markdown header, a code fence or an HTML block left open) is put in a backtick
fence longer than any backtick run it holds, so every top-level header of the
document is one of ours (a header inside a quote or a list stays in it). Both
read only what they are given (a file's header, no arrays).
"""

from __future__ import annotations

import json
import re

FORMATS = ("json", "md")

_HEADER = re.compile(r"^ {0,3}(#{1,6}(\s|$)|=+\s*$|-+\s*$)")  # ATX header or setext underline
# HTML blocks that a blank line does not end: they would swallow the sections after them
_OPEN_HTML = re.compile(r"^ {0,3}(<(script|pre|style|textarea)(\s|>|$)|<!--|<\?|<![A-Za-z]|<!\[CDATA\[)", re.I)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def to_json(messages: list[dict]) -> str:
    """The messages as a JSON list of ``{"role", "content"}`` (nothing else), indented."""
    return json.dumps([{"role": m["role"], "content": m["content"]} for m in messages], indent=2,
                      ensure_ascii=False) + "\n"  # fmt: skip


def to_markdown(name: str, model: str | None, messages: list[dict]) -> str:
    """A Markdown document: title, model line, one ``## ROLE`` section per message."""
    parts = [f"# {name}", f"model: {model or 'unknown'}"]
    for m in messages:
        parts += [f"## {m['role']}", _block(m["content"])]
    return "\n\n".join(parts) + "\n"


def _block(text: str) -> str:
    """``text`` verbatim, or fenced when it could end its section early (see the module doc)."""
    if _self_contained(text):
        return text
    runs = [len(r) for r in re.findall(r"`+", text)]
    fence = "`" * max(4, max(runs, default=0) + 1)
    return f"{fence}text\n{text}\n{fence}"


def _self_contained(text: str) -> bool:
    """Whether ``text`` has no header-like line outside its code fences and closes every fence."""
    open_fence = None  # (character, length) of the fence the current line is inside
    for line in text.splitlines():
        m = _FENCE.match(line)
        if open_fence is None:
            if m:
                open_fence = (m.group(1)[0], len(m.group(1)))
            elif _HEADER.match(line) or _OPEN_HTML.match(line):
                return False
        elif m and m.group(1)[0] == open_fence[0] and len(m.group(1)) >= open_fence[1] \
                and not line.strip().strip(open_fence[0]):  # fmt: skip
            open_fence = None
    return open_fence is None


__all__ = ["FORMATS", "to_json", "to_markdown"]
