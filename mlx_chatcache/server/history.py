"""How many prompt tokens the server's store served, in total and over time.

Contract
--------
- :class:`ServedTokens` counts, per job, the prompt's tokens, the tokens taken
  from the store and, by the tier that served them, the same; ``totals()`` is
  a copy ``{"prompt_tokens", "cached_tokens", "by_tier": {tier: tokens}}``.
- :class:`StatsHistory` is a ring of at most ``size`` such totals, each with its
  time ``t`` (``clock()``, seconds): :meth:`StatsHistory.sample` keeps a sample
  when none was kept yet or at least ``period_s`` passed since the last one
  (or the clock went back), else drops it. Samples are cumulative: a reader
  differences consecutive ones for the rate over an interval. Nothing runs in
  the background: the caller samples (as each job starts, on each read).

Both may be used from several threads (the generation worker counts and
samples, the HTTP thread reads and samples).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from ..config import SERVER_DEFAULTS


class ServedTokens:
    """Cumulative prompt tokens of the jobs run and those the store served, by tier."""

    def __init__(self):
        self._lock = threading.Lock()
        self._prompt = 0
        self._cached = 0
        self._by_tier: dict[str, int] = {}

    def count(self, prompt: int, cached: int, tier: str | None) -> None:
        """One job: ``prompt`` tokens, ``cached`` of them from the tier named ``tier``."""
        with self._lock:
            self._prompt += prompt
            self._cached += cached
            if tier is not None:
                self._by_tier[tier] = self._by_tier.get(tier, 0) + cached

    def totals(self) -> dict:
        with self._lock:
            return {"prompt_tokens": self._prompt, "cached_tokens": self._cached, "by_tier": dict(self._by_tier)}


class StatsHistory:
    """A bounded ring of timed samples, one per ``period_s`` at most (see the module doc)."""

    def __init__(self, period_s: float = SERVER_DEFAULTS.history_period_s, size: int = SERVER_DEFAULTS.history_size,
                 clock: Callable[[], float] = time.time):  # fmt: skip
        if period_s <= 0 or size < 1:
            raise ValueError(f"a history needs period_s > 0 and size >= 1, not {period_s} and {size}")
        self.period_s = period_s
        self._clock = clock
        self._lock = threading.Lock()
        self._ring: deque[dict] = deque(maxlen=size)

    def sample(self, totals: dict) -> bool:
        """Keep ``totals`` with the time now when a period has passed; True when kept."""
        now = self._clock()
        with self._lock:
            if self._ring:
                if 0 <= now - self._ring[-1]["t"] < self.period_s:
                    return False
            self._ring.append({"t": now, **totals})
            return True

    def samples(self) -> list[dict]:
        """The samples kept, oldest first."""
        with self._lock:
            return list(self._ring)


__all__ = ["ServedTokens", "StatsHistory"]
