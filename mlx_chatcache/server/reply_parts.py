"""A reply's text split, as it streams, into reasoning, text and tool calls (the agents' dialects).

Contract
--------
:class:`ReplyParts` ``(service, req, prompt)`` takes the reply's pieces (``feed``) and
its end (``finish``) and gives parts in order: ``("thinking", text)`` inside the
model's reasoning markers (when its tokenizer declares them, mlx-lm's
``think_start``/``think_end``; a prompt that ends with the start marker opens the
reply inside them), ``("text", text)`` and ``("call", call)`` (a tool call in OpenAI's
shape, parsed by :class:`~.tools.ToolCallStream` when the request uses tools). A
partial marker is held back until it completes or cannot; markers never reach a part.
"""

from __future__ import annotations

from .protocol import Request
from .tools import ToolCallStream, partial_suffix


class ThinkSplit:
    """Streamed text in, ``[(inside, text)]`` out, split on ``start``/``end`` markers."""

    def __init__(self, start: str, end: str, inside: bool = False):
        self.start, self.end, self.inside, self.buf = start, end, inside, ""

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self.buf += text
        out = []
        while True:
            marker = self.end if self.inside else self.start
            i = self.buf.find(marker)
            if i < 0:
                cut = len(self.buf) - partial_suffix(self.buf, marker)
                if cut:
                    out.append((self.inside, self.buf[:cut]))
                self.buf = self.buf[cut:]
                return out
            if i:
                out.append((self.inside, self.buf[:i]))
            self.buf, self.inside = self.buf[i + len(marker) :], not self.inside

    def finish(self) -> list[tuple[bool, str]]:
        out = [(self.inside, self.buf)] if self.buf else []
        self.buf = ""
        return out


class ReplyParts:
    def __init__(self, service, req: Request, prompt: list[int]):
        tok = service.tokenizer
        self.calls = ToolCallStream(tok, req.tools) if service.uses_tools(req) else None
        self.think = None
        if getattr(tok, "has_thinking", False) and tok.think_start and tok.think_end:
            inside = tok.decode(prompt[-8:]).rstrip().endswith(tok.think_start)
            self.think = ThinkSplit(tok.think_start, tok.think_end, inside)

    def feed(self, text: str) -> list[tuple[str, object]]:
        spans = self.think.feed(text) if self.think else [(False, text)]
        return self._parts(spans)

    def finish(self) -> list[tuple[str, object]]:
        parts = self._parts(self.think.finish()) if self.think else []
        if self.calls is not None:
            text, calls = self.calls.finish()
            parts += self._out(text, calls)
        return [p for p in parts if p[1]]

    def _parts(self, spans) -> list[tuple[str, object]]:
        parts = []
        for inside, text in spans:
            if inside:
                parts.append(("thinking", text))
            elif self.calls is None:
                parts.append(("text", text))
            else:
                parts += self._out(*self.calls.feed(text))
        return [p for p in parts if p[1]]

    @staticmethod
    def _out(text: str, calls: list[dict]) -> list[tuple[str, object]]:
        return [("text", text)] + [("call", {k: v for k, v in c.items() if k != "index"}) for c in calls]


__all__ = ["ReplyParts", "ThinkSplit"]
