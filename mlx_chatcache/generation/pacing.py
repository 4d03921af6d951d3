"""Model calls short enough for Ctrl-C to be acted upon within a second.

Python runs a signal handler (Ctrl-C) only between bytecodes, and a model call
is evaluated in one go by MLX: a 430-token chunk of the quantized demo model
on a 2-core CPU is one 38-second call that nothing can interrupt. A
:class:`CallPacer` splits prompt processing into calls whose predicted time
stays under ``max_seconds``:

- the prediction is the time per token of the model's latest measured call
  (kept per model object for the life of the process, so a later prompt
  starts at the right size);
- a call's size is the largest power of two whose predicted time fits, at
  most twice the size the time was measured at (a prediction is never
  extrapolated far) and at most the caller's limit (the prefill step);
- a model never measured starts with :data:`PROBE_TOKENS` tokens.

Only where the prompt is split changes: the same tokens are fed in the same
order, so logits are equal within the float tolerance that any chunking
gives (tests/test_generate.py: max abs diff <= 1e-5 on float32, whatever the
chunks). Since sizes follow measured times, two runs may split a long prompt
differently. Calls that take well under ``max_seconds`` (a GPU, a short
prompt) are not split, beyond the ramp-up of a model's first prompt in a
process (1, 2, 4, ... tokens: a few extra small calls).
"""

from __future__ import annotations

import contextlib
import time
import weakref

PROBE_TOKENS = 1  # first call of a model never measured (also pays one-time warm-up)

# id(model) -> (model, seconds per token, tokens of the call it was measured on)
_RATES: dict[int, tuple[weakref.ref, float, int]] = {}


def _measured(model) -> tuple[float, int] | None:
    known = _RATES.get(id(model))
    if known is None or known[0]() is not model:
        return None
    return known[1], known[2]


def _remember(model, rate: float, size: int) -> None:
    key = id(model)
    with contextlib.suppress(TypeError):  # not weak-referenceable: not remembered
        _RATES[key] = (weakref.ref(model, lambda _: _RATES.pop(key, None)), rate, size)


class CallPacer:
    """Sizes of successive model calls on ``model`` (see the module doc)."""

    def __init__(self, model, max_seconds: float):
        self.model = model
        self.max_seconds = max_seconds
        self._started = 0.0

    def size(self, limit: int) -> int:
        """Tokens for the next call, 1 to ``limit``."""
        if limit <= 1:
            return max(limit, 0)
        known = _measured(self.model)
        if known is None:
            return min(PROBE_TOKENS, limit)
        rate, measured_at = known
        fit = self.max_seconds / rate if rate > 0 else float(limit)
        if fit >= limit and 2 * measured_at >= limit:
            return limit
        n = 1
        while n * 2 <= fit and n * 2 <= 2 * measured_at and n * 2 <= limit:
            n *= 2
        return min(n, limit)

    def fits(self, n: int) -> bool:
        """Whether ``n`` tokens may go in one call."""
        return n <= 1 or self.size(n) >= n

    def start(self) -> None:
        self._started = time.perf_counter()

    def record(self, n: int) -> None:
        """A call of ``n`` tokens, started at :meth:`start`, has been evaluated."""
        if n > 0:
            _remember(self.model, (time.perf_counter() - self._started) / n, n)


__all__ = ["CallPacer", "PROBE_TOKENS"]
