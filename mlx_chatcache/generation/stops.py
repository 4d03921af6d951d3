"""Stop strings: reply text is cut at the first one, and text that may still become
one is held back until it does or cannot (``mlxcc serve``'s ``stop``, ``mlxcc chat --stop``)."""

from __future__ import annotations


class StopMatcher:
    """Cuts reply text at the first of ``stops``; holds back a tail that may
    still become one. ``matched`` is the stop string the text was cut at (None: none yet)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.pending += text
        found = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


__all__ = ["StopMatcher"]
