"""Tests of :mod:`mlx_chatcache.generation.sample` on synthetic distributions (no model).

- ``temp == 0`` is the argmax; ``top_k == 1`` is the argmax at any temperature.
- top-k / top-p / min-p never sample outside the allowed set. The set is
  computed independently in numpy. Each case takes 2000 seeded draws, which
  must also hit more than one token (the filter does not collapse to greedy).
- Temperature sampling follows ``softmax(logprobs / temp)``: with 4000 seeded
  draws every empirical frequency is within 0.04 of its probability (about
  4.5 standard deviations at worst).
- The repetition penalty divides positive and multiplies negative logits of
  tokens in the context window only; other logits are unchanged (exact).
- The presence and frequency penalties and ``logit_bias`` equal a hand-written
  numpy reference on random logits and contexts (Hypothesis); every processor
  setting outside :data:`~mlx_chatcache.config.RANGES` is UsageError.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_chatcache.config import DEFAULTS, check_setting
from mlx_chatcache.errors import UsageError
from mlx_chatcache.generation.sample import (
    make_logits_processors,
    make_sampler,
    min_p_mask,
    top_k_mask,
    top_p_mask,
)

V = 40
DRAWS = 2000


def cfg(**changes):
    """DEFAULTS with ``changes`` (None values kept, unlike ``updated``)."""
    return dataclasses.replace(DEFAULTS, **changes)


def random_logprobs(seed: int, rows: int = 1, scale: float = 2.0) -> mx.array:
    """``(rows, V)`` normalised log-probabilities with distinct values."""
    logits = np.random.default_rng(seed).normal(0, scale, (rows, V)).astype(np.float32)
    lp = mx.array(logits)
    return lp - mx.logsumexp(lp, axis=-1, keepdims=True)


def draws(sampler, logprobs: mx.array, n: int = DRAWS) -> set[int]:
    """Distinct tokens of ``n`` draws from one row (sampled as one batch)."""
    batch = mx.broadcast_to(logprobs, (n, V))  # (n, V)
    return set(np.array(sampler(batch)).tolist())


# ------------------------------------------------------------ allowed sets (numpy)
def allowed_top_k(p: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(-p)[:k].tolist())


def allowed_top_p(p: np.ndarray, top_p: float) -> set[int]:
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    return set(order[before < top_p].tolist())


def allowed_min_p(p: np.ndarray, min_p: float) -> set[int]:
    return set(np.nonzero(p >= min_p * p.max())[0].tolist())


# ------------------------------------------------------------ greedy
def test_greedy_is_argmax():
    lp = random_logprobs(0, rows=8)
    assert make_sampler(temp=0.0)(lp).tolist() == np.argmax(np.array(lp), axis=-1).tolist()


@pytest.mark.parametrize("temp", [0.3, 1.0, 5.0])
def test_top_k_1_is_greedy_at_any_temperature(temp):
    lp = random_logprobs(1, rows=8)
    sampler = make_sampler(temp=temp, top_k=1)
    for _ in range(5):
        assert sampler(lp).tolist() == np.argmax(np.array(lp), axis=-1).tolist()


# ------------------------------------------------------------ filters
@pytest.mark.parametrize(
    "settings, allowed",
    [
        ({"top_k": 5}, lambda p: allowed_top_k(p, 5)),
        ({"top_p": 0.6}, lambda p: allowed_top_p(p, 0.6)),
        ({"top_p": 0.9}, lambda p: allowed_top_p(p, 0.9)),
        ({"min_p": 0.1}, lambda p: allowed_min_p(p, 0.1)),
        ({"min_p": 0.3}, lambda p: allowed_min_p(p, 0.3)),
        ({"top_k": 6, "top_p": 0.8}, lambda p: allowed_top_k(p, 6) & allowed_top_p(p, 0.8)),
        ({"top_p": 0.9, "min_p": 0.2}, lambda p: allowed_top_p(p, 0.9) & allowed_min_p(p, 0.2)),
    ],
)
@pytest.mark.parametrize("temp", [0.7, 2.0])
def test_filters_never_sample_outside_the_allowed_set(settings, allowed, temp):
    mx.random.seed(1234)
    lp = random_logprobs(2, scale=1.5)
    expected = allowed(np.exp(np.array(lp[0], dtype=np.float64)))
    assert 1 < len(expected) < V  # the case really filters
    got = draws(make_sampler(temp=temp, **settings), lp)
    assert got <= expected
    assert len(got) > 1


def test_masks_match_numpy_sets():
    lp = random_logprobs(3, scale=1.5)
    p = np.exp(np.array(lp[0], dtype=np.float64))
    as_set = lambda m: set(np.nonzero(np.array(m[0]))[0].tolist())  # noqa: E731
    assert as_set(top_k_mask(lp, 7)) == allowed_top_k(p, 7)
    assert as_set(top_p_mask(lp, 0.75)) == allowed_top_p(p, 0.75)
    assert as_set(min_p_mask(lp, 0.2)) == allowed_min_p(p, 0.2)


def test_min_tokens_to_keep():
    lp = random_logprobs(4, scale=4.0)  # peaked: strict filters keep 1 token
    p = np.exp(np.array(lp[0], dtype=np.float64))
    assert len(allowed_min_p(p, 0.9)) == 1
    mask = min_p_mask(lp, 0.9, min_keep=3)
    assert set(np.nonzero(np.array(mask[0]))[0].tolist()) == allowed_top_k(p, 3)
    mask = top_p_mask(lp, 0.01, min_keep=4)
    assert set(np.nonzero(np.array(mask[0]))[0].tolist()) == allowed_top_k(p, 4)


def test_temperature_sampling_follows_the_distribution():
    mx.random.seed(7)
    lp = random_logprobs(5, scale=1.0)[:, :8]
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)  # (1, 8)
    temp, n = 2.0, 4000
    tokens = np.array(make_sampler(temp=temp)(mx.broadcast_to(lp, (n, 8))))
    freq = np.bincount(tokens, minlength=8) / n
    target = np.array(mx.softmax(lp[0] / temp))
    assert np.abs(freq - target).max() < 0.04


@pytest.mark.parametrize(
    "settings",
    [{"temp": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"min_p": 2.0}, {"min_tokens_to_keep": 0}],
)
def test_bad_settings_raise_usage_error(settings):
    with pytest.raises(UsageError):
        make_sampler(**settings)


# ------------------------------------------------------------ repetition penalty
def test_no_processors_by_default():
    assert make_logits_processors() == []
    assert make_logits_processors(cfg(repetition_penalty=1.0)) == []


def test_repetition_penalty_lowers_repeated_tokens():
    logits = mx.array([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])  # (1, 6)
    (process,) = make_logits_processors(cfg(repetition_penalty=2.0, repetition_context_size=3))
    context = mx.array([3, 0, 1, 4, 1])  # window of 3: {1, 4}
    out = np.array(process(context, logits))[0]
    assert out.tolist() == [2.0, -2.0, 0.5, 3.0, -4.0, 1.0]
    assert np.array(logits).tolist() == [[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]  # input untouched
    # a token in the window is now less likely relative to every other token
    lp = out - np.log(np.exp(out).sum())
    lp0 = np.array(logits[0] - mx.logsumexp(logits[0]))
    assert lp[1] < lp0[1] and lp[4] < lp0[4]


def test_repetition_penalty_with_empty_context():
    logits = mx.array([[1.0, 2.0]])
    (process,) = make_logits_processors(cfg(repetition_penalty=1.5))
    assert np.array(process(mx.array([], dtype=mx.uint32), logits)).tolist() == [[1.0, 2.0]]


def test_bad_penalty_raises_usage_error():
    with pytest.raises(UsageError):
        make_logits_processors(cfg(repetition_penalty=-1.0))
    with pytest.raises(UsageError):
        make_logits_processors(cfg(repetition_penalty=1.2, repetition_context_size=0))


# ------------------------------------------------------------ presence / frequency / logit_bias
def reference_penalties(logits: np.ndarray, context: list[int], size: int, presence: float, frequency: float):
    """OpenAI's definition over the last ``size`` context tokens, written out token by token."""
    out = logits.astype(np.float64).copy()
    window = context[-size:]
    for t in set(window):
        out[:, t] -= presence  # once if present
        out[:, t] -= frequency * window.count(t)  # once per occurrence
    return out


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-30, 30, width=32), min_size=V, max_size=V),
    context=st.lists(st.integers(0, V - 1), max_size=50),
    size=st.integers(1, 60),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
)
def test_presence_and_frequency_penalties_equal_the_reference(logits, context, size, presence, frequency):
    x = np.array([logits], dtype=np.float32)
    config = cfg(presence_penalty=presence, frequency_penalty=frequency, repetition_context_size=size)
    out = mx.array(x)
    for process in make_logits_processors(config):
        out = process(mx.array(context, dtype=mx.uint32), out)
    expected = reference_penalties(x, context, size, presence, frequency)
    np.testing.assert_allclose(np.array(out), expected, rtol=1e-5, atol=1e-4)
    assert len(make_logits_processors(config)) == (presence != 0) + (frequency != 0)


@settings(max_examples=40, deadline=None)
@given(bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=8),
       logits=st.lists(st.floats(-30, 30, width=32), min_size=V, max_size=V))  # fmt: skip
def test_logit_bias_adds_to_the_named_tokens_only(bias, logits):
    x = np.array([logits], dtype=np.float32)
    out = mx.array(x)
    for process in make_logits_processors(cfg(logit_bias=check_setting("logit_bias", bias))):
        out = process(mx.array([1, 2], dtype=mx.uint32), out)
    expected = x.astype(np.float64).copy()
    for t, b in bias.items():
        expected[0, t] += b
    np.testing.assert_allclose(np.array(out), expected, rtol=1e-5, atol=1e-4)


def test_logit_bias_of_100_forces_a_token_and_minus_100_removes_the_argmax():
    lp = random_logprobs(3)
    best = int(mx.argmax(lp).item())
    target = (best + 7) % V
    (up,) = make_logits_processors(cfg(logit_bias=((target, 100.0),)))
    assert int(mx.argmax(up(mx.array([0]), lp)).item()) == target
    (down,) = make_logits_processors(cfg(logit_bias=((best, -100.0),)))
    assert int(mx.argmax(down(mx.array([0]), lp)).item()) != best


def test_logit_bias_past_the_vocabulary_is_usage_error():
    (process,) = make_logits_processors(cfg(logit_bias=((V, 1.0),)))
    with pytest.raises(UsageError, match=f"token id {V}"):
        process(mx.array([0]), random_logprobs(0))


@pytest.mark.parametrize("bad", [{"presence_penalty": 2.5}, {"frequency_penalty": -3.0},
                                 {"presence_penalty": float("nan")}, {"logit_bias": ((0, 101.0),)},
                                 {"logit_bias": ((-1, 1.0),)}, {"logit_bias": "x"}])  # fmt: skip
def test_bad_processor_settings_raise_usage_error(bad):
    with pytest.raises(UsageError, match=next(iter(bad))):
        make_logits_processors(cfg(**bad))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), temp=st.floats(0.3, 2.0), top_p=st.sampled_from([1.0, 0.9]))
def test_a_seeded_sampler_draws_what_the_seeded_global_generator_draws_whatever_draws_between(seed, temp, top_p):
    logits = mx.random.normal((1, 64), key=mx.random.key(3))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.random.seed(seed)
    plain = make_sampler(temp, top_p)
    expected = [plain(logprobs).item() for _ in range(8)]
    own = make_sampler(temp, top_p, seed=seed)
    mx.random.seed(seed + 1 if seed < 2**64 - 1 else 0)
    got = []
    for _ in range(8):
        mx.random.uniform(shape=(3,))  # another row's draw in between
        got.append(own(logprobs).item())
    assert got == expected
