"""Token sampling and logits processing.

Contract
--------
- A **sampler** maps log-probabilities ``(B, V)`` (already normalised: each row
  logsumexps to 0) to token ids ``(B,)``. :func:`make_sampler` builds one from
  the sampling settings. At ``temp == 0`` it is the argmax. Otherwise the filters
  (top-k, top-p, min-p) choose the allowed set from the model's own
  distribution (before temperature), so temperature changes how likely each
  allowed token is, never which tokens are allowed. Then a token is drawn from
  ``softmax(logprobs / temp)`` restricted to that set. The top-p and min-p
  filters always leave at least ``min_tokens_to_keep`` tokens.
- A **logits processor** maps ``(tokens, logits)`` to new logits.
  ``tokens`` is an ``mx.array`` ``(T,)`` with the whole context so far
  (the full prompt, reused part included, and the tokens generated so far).
  ``logits`` is ``(B, V)``. This is the same calling convention as mlx-lm
  processors, so theirs can be passed too.
- Randomness comes from MLX's global generator; the generate loop seeds it with
  ``GenerationConfig.seed``. A sampler made with a ``seed`` draws from its own
  stream instead: the same draws the global generator gives after
  ``mx.random.seed(seed)``, whatever else draws meanwhile (rows of a batch).
- ``None`` for any setting means "use :data:`DEFAULTS`". Bad values raise
  :class:`UsageError`.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Sequence

import mlx.core as mx

from ..config import DEFAULTS, GenerationConfig, SettingError, check_setting
from ..errors import UsageError

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
Filter = Callable[[mx.array], mx.array]  # logprobs (B, V) -> keep mask (B, V) bool

NEG_INF = -float("inf")


# ------------------------------------------------------------------ samplers
def greedy(logprobs: mx.array) -> mx.array:
    """Argmax over the vocabulary: ``(B, V) -> (B,)``."""
    return mx.argmax(logprobs, axis=-1)


def make_sampler(
    temp: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    min_tokens_to_keep: int | None = None,
    seed: int | None = None,
) -> Sampler:
    """A sampler for these settings (see the module docstring; ``seed``: its own stream)."""
    temp, filters = _settings(temp, top_p, top_k, min_p, min_tokens_to_keep)
    if filters is None:
        return greedy

    stream = [mx.random.key(seed)] if seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        for keep_mask in filters:  # each filter sees the model's distribution
            logprobs = mx.where(keep_mask(logprobs), logprobs, NEG_INF)
        key = None
        if stream is not None:  # the global generator's step: its next state, and the key drawn with
            stream[0], key = mx.random.split(stream[0])
        return mx.random.categorical(logprobs * (1.0 / temp), axis=-1, key=key)  # (B,)

    return sample


def make_distribution(
    temp: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    min_tokens_to_keep: int | None = None,
) -> Callable[[mx.array], mx.array] | None:
    """The distribution :func:`make_sampler`'s sampler draws from, as a function of
    log-probabilities ``(B, V) -> (B, V)`` (normalised log-probabilities, -inf where a
    filter drops a token); None for the greedy sampler (it draws no distribution)."""
    temp, filters = _settings(temp, top_p, top_k, min_p, min_tokens_to_keep)
    if filters is None:
        return None

    def distribution(logprobs: mx.array) -> mx.array:
        for keep_mask in filters:
            logprobs = mx.where(keep_mask(logprobs), logprobs, NEG_INF)
        scaled = logprobs * (1.0 / temp)
        return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)

    return distribution


def _settings(temp, top_p, top_k, min_p, keep) -> tuple[float, list[Filter] | None]:
    """The temperature and filters of these settings (defaults for None; checked);
    filters None: greedy."""
    temp = DEFAULTS.temp if temp is None else temp
    top_p = DEFAULTS.top_p if top_p is None else top_p
    top_k = DEFAULTS.top_k if top_k is None else top_k
    min_p = DEFAULTS.min_p if min_p is None else min_p
    keep = DEFAULTS.min_tokens_to_keep if keep is None else keep
    _check_settings(temp, top_p, top_k, min_p, keep)
    if temp == 0 or top_k == 1:
        return temp, None
    filters: list[Filter] = []
    if top_k > 0:
        filters.append(lambda lp: top_k_mask(lp, top_k))
    if top_p < 1.0:
        filters.append(lambda lp: top_p_mask(lp, top_p, keep))
    if min_p > 0.0:
        filters.append(lambda lp: min_p_mask(lp, min_p, keep))
    return temp, filters


def _check_settings(temp, top_p, top_k, min_p, keep) -> None:
    if not (isinstance(temp, (int, float)) and temp >= 0 and math.isfinite(temp)):
        raise UsageError(f"temperature must be a finite number >= 0, got {temp!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise UsageError(f"top-p must be in (0, 1], got {top_p!r}; use 1 to disable it")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise UsageError(f"top-k must be an integer >= 0, got {top_k!r}; use 0 to disable it")
    if not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
        raise UsageError(f"min-p must be in [0, 1], got {min_p!r}; use 0 to disable it")
    if not (isinstance(keep, int) and keep >= 1):
        raise UsageError(f"min-tokens-to-keep must be an integer >= 1, got {keep!r}")


# ------------------------------------------------------------------ filters
def _rank_mask(logprobs: mx.array, n: int) -> mx.array:
    """Bool mask of the ``n`` most likely tokens per row: ``(B, V) -> (B, V)``."""
    V = logprobs.shape[-1]
    if n >= V:
        return mx.ones(logprobs.shape, dtype=mx.bool_)
    top = mx.argpartition(-logprobs, kth=n - 1, axis=-1)[..., :n]  # (B, n) indices
    mask = mx.zeros(logprobs.shape, dtype=mx.bool_)
    return mx.put_along_axis(mask, top, mx.array(True), axis=-1)


def top_k_mask(logprobs: mx.array, k: int) -> mx.array:
    """Keep exactly the ``k`` most likely tokens (ties broken arbitrarily)."""
    return _rank_mask(logprobs, k)


def top_p_mask(logprobs: mx.array, p: float, min_keep: int = 1) -> mx.array:
    """Keep the smallest most-likely set whose probability reaches ``p``.

    A token is kept when the probability of all strictly more likely tokens
    (in sorted order) is still below ``p``; the top token is always kept.
    """
    order = mx.argsort(-logprobs, axis=-1)  # (B, V) most likely first
    probs = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))  # (B, V) sorted
    mass_before = mx.cumsum(probs, axis=-1) - probs  # (B, V) exclusive prefix sum
    keep_sorted = mass_before < p  # (B, V) in sorted order
    mask = mx.put_along_axis(mx.zeros(logprobs.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
    return mask | _rank_mask(logprobs, min_keep)


def min_p_mask(logprobs: mx.array, min_p: float, min_keep: int = 1) -> mx.array:
    """Keep tokens at least ``min_p`` times as likely as the most likely one."""
    best = mx.max(logprobs, axis=-1, keepdims=True)  # (B, 1)
    mask = logprobs >= best + math.log(min_p)  # (B, V)
    return mask | _rank_mask(logprobs, min_keep)


# ------------------------------------------------------------------ processors
PROCESSOR_SETTINGS = ("logit_bias", "repetition_penalty", "repetition_context_size", "presence_penalty",
                      "frequency_penalty")  # fmt: skip


def make_logits_processors(config: GenerationConfig | None = None) -> list[LogitsProcessor]:
    """The processors ``config`` (:data:`DEFAULTS` when None) asks for, in mlx-lm's
    order; empty when there is nothing to do. A setting outside its range is
    :class:`UsageError`. Each penalty looks at the last ``repetition_context_size``
    tokens of the context (the prompt included, as mlx-lm's):

    - ``logit_bias``: each (id, bias) pair adds ``bias`` to that token's logit;
    - ``repetition_penalty`` (> 0; 1 or None disables): the logit of every token
      among them is divided by it when positive, multiplied when negative;
    - ``presence_penalty``: subtracted once from the logit of every token among them;
    - ``frequency_penalty``: subtracted from a token's logit once per occurrence among them.
    """
    c = config or DEFAULTS
    for name in PROCESSOR_SETTINGS:
        try:
            check_setting(name, getattr(c, name))
        except SettingError as e:
            raise UsageError(e.named) from None
    size = c.repetition_context_size
    out: list[LogitsProcessor] = []
    if c.logit_bias:
        out.append(logit_bias_processor(c.logit_bias))
    if c.repetition_penalty is not None and c.repetition_penalty != 1:
        out.append(repetition_penalty_processor(float(c.repetition_penalty), size))
    if c.presence_penalty:
        out.append(presence_penalty_processor(float(c.presence_penalty), size))
    if c.frequency_penalty:
        out.append(frequency_penalty_processor(float(c.frequency_penalty), size))
    return out


def logit_bias_processor(bias: Sequence[tuple[int, float]]) -> LogitsProcessor:
    """Adds each ``(token id, bias)``'s bias to that token's logit; an id past the
    logits' width is :class:`UsageError`."""
    ids_list = [int(i) for i, _ in bias]
    ids, values = mx.array(ids_list), mx.array([float(b) for _, b in bias])
    top = max(ids_list, default=-1)

    def process(tokens: mx.array | Sequence[int], logits: mx.array) -> mx.array:
        if top >= logits.shape[-1]:
            raise UsageError(f"logit_bias names token id {top}, but this model's ids go from 0 to "
                             f"{logits.shape[-1] - 1}; use ids of this model's tokenizer")  # fmt: skip
        return logits.at[:, ids].add(values.astype(logits.dtype))

    return process


def repetition_penalty_processor(penalty: float, context_size: int) -> LogitsProcessor:
    """The repetition penalty described in :func:`make_logits_processors`."""

    def process(tokens: mx.array | Sequence[int], logits: mx.array) -> mx.array:
        recent = sorted(set(_as_list(tokens)[-context_size:]))
        if not recent:
            return logits
        ids = mx.array(recent)  # (R,) distinct token ids
        seen = logits[:, ids]  # (B, R)
        factor = mx.where(seen > 0, 1.0 / penalty, penalty).astype(logits.dtype)  # (B, R)
        return logits.at[:, ids].multiply(factor)  # (B, V), a new array

    return process


def presence_penalty_processor(penalty: float, context_size: int) -> LogitsProcessor:
    """The presence penalty described in :func:`make_logits_processors`."""
    return _additive_penalty(penalty, context_size, per_occurrence=False)


def frequency_penalty_processor(penalty: float, context_size: int) -> LogitsProcessor:
    """The frequency penalty described in :func:`make_logits_processors`."""
    return _additive_penalty(penalty, context_size, per_occurrence=True)


def _additive_penalty(penalty: float, context_size: int, per_occurrence: bool) -> LogitsProcessor:
    def process(tokens: mx.array | Sequence[int], logits: mx.array) -> mx.array:
        counts = Counter(_as_list(tokens)[-context_size:])
        if not counts:
            return logits
        ids = sorted(counts)
        amount = [penalty * counts[i] if per_occurrence else penalty for i in ids]
        return logits.at[:, mx.array(ids)].subtract(mx.array(amount).astype(logits.dtype))

    return process


def _as_list(tokens) -> list[int]:
    return tokens.tolist() if isinstance(tokens, mx.array) else list(tokens)


__all__ = [
    "Sampler",
    "LogitsProcessor",
    "greedy",
    "make_sampler",
    "make_distribution",
    "top_k_mask",
    "top_p_mask",
    "min_p_mask",
    "make_logits_processors",
    "logit_bias_processor",
    "repetition_penalty_processor",
    "presence_penalty_processor",
    "frequency_penalty_processor",
]
