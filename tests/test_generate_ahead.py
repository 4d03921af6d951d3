"""Tests of how :func:`mlx_chatcache.generation.loop.generate_step` schedules model calls.

- Feeding ahead: with a trimmable cache and no logits processors, token ``k >= 2``
  is fed (and token ``k+1`` computed) before token ``k`` is yielded. At every
  yield ``state.tokens`` is what the cache was fed; a stop token fed ahead is
  trimmed back off, and MLX's random key is restored, so a call that ends
  leaves the state and the random generator as the synchronous loop does.
  Untrimmable caches (hybrid/ssm kinds, a rotating window about to drop a
  token) and logits processors keep the synchronous loop.
- The prompt's last call: a float model is fed the prompt's last chunk in the
  call that samples the first token (one call for a prompt of at most
  ``prefill_step_size`` tokens); a quantized model keeps mlx-lm's split (all
  but the last token, then the last token).

The synchronous loop is forced with a logits processor that changes nothing.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import pytest
from tiny_models import SLIDING_WINDOW

from mlx_chatcache.cache import KVCache, cache_offset, can_trim_prompt_cache
from mlx_chatcache.chat.turn import stream_reply
from mlx_chatcache.config import DEFAULTS, CacheShape
from mlx_chatcache.generation.feed import final_call_size, prefill
from mlx_chatcache.generation.loop import generate_step
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.chat.session import ChatSession

GREEDY = DEFAULTS.updated(temp=0.0)
TEXT = "The weather was cold and windy, so we stayed inside and read our books."


def unchanged(context, logits):
    """A logits processor that changes nothing (forces the synchronous loop)."""
    return logits


class CountingModel:
    """Wraps a model; records the number of tokens of every call."""

    def __init__(self, model):
        self.model = model
        self.calls: list[int] = []

    def __call__(self, inputs, cache=None):
        self.calls.append(inputs.shape[1])
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


def steps(model, prompt, state, config=GREEDY, **kw) -> list[int]:
    return [t for t, _ in generate_step(prompt, model, state=state, config=config, **kw)]


def consistent(state) -> bool:
    return len(state.tokens) == cache_offset(state.cache)


# ----------------------------------------------------------------- when a token is fed
def test_token_is_fed_before_it_is_yielded_only_when_trimmable(tiny_model):
    kind, model, tok = tiny_model
    counting = CountingModel(model)
    prompt = prompt_ids(tok, 6)
    state = PromptCache.new(counting)
    fed_at_yield, prompt_calls = [], None
    for n, (t, _) in enumerate(generate_step(prompt, counting, state=state, config=GREEDY.updated(max_tokens=5)), 1):
        assert consistent(state)
        fed_at_yield.append(len(state.tokens) - len(prompt))
        prompt_calls = prompt_calls or len(counting.calls)
        assert len(counting.calls) == prompt_calls + fed_at_yield[-1]  # one call per token fed
    if kind in ("llama", "sliding"):  # fed ahead, but not the first nor the max_tokens-th token
        assert fed_at_yield == [0, 2, 3, 4, 4]
    else:  # ArraysCache layers cannot be trimmed: token k is fed when k+1 is asked for
        assert not can_trim_prompt_cache(state.cache)
        assert fed_at_yield == [0, 1, 2, 3, 4]


def test_logits_processors_keep_the_synchronous_loop(llama_model):
    model, tok = llama_model
    prompt = prompt_ids(tok, 6)
    state = PromptCache.new(model)
    gen = generate_step(prompt, model, state=state, config=GREEDY.updated(max_tokens=5), logits_processors=[unchanged])
    for n, _ in enumerate(gen, 1):
        assert len(state.tokens) == len(prompt) + n - 1 and consistent(state)


def test_same_tokens_and_state_with_and_without_feeding_ahead(tiny_model):
    kind, model, tok = tiny_model
    prompt = prompt_ids(tok, 7)
    config = GREEDY.updated(max_tokens=10)
    a, b = PromptCache.new(model), PromptCache.new(model)
    out_a = steps(model, prompt, a, config)
    out_b = steps(model, prompt, b, config, logits_processors=[unchanged])
    assert out_a == out_b
    assert a.tokens == b.tokens == prompt + out_a[:-1] and consistent(a)


# ----------------------------------------------------------------- early stops
@pytest.mark.parametrize("close", [True, False], ids=["closed", "suspended"])
def test_consumer_stopping_early_leaves_the_fed_token_recorded(tiny_model, close):
    kind, model, tok = tiny_model
    prompt = prompt_ids(tok, 6)
    state = PromptCache.new(model)
    gen = generate_step(prompt, model, state=state, config=GREEDY.updated(max_tokens=20))
    got = [next(gen)[0] for _ in range(3)]
    if close:
        gen.close()
    assert consistent(state)
    if kind in ("llama", "sliding"):
        assert state.tokens == prompt + got  # the 3rd token was fed ahead
    else:
        assert state.tokens == prompt + got[:2]
    # the state is reused as documented: the continuation equals a fresh run
    more = prompt + got + tok.encode(" and more", add_special_tokens=False)
    config = GREEDY.updated(max_tokens=6)
    assert steps(model, more, state, config) == steps(model, more, None, config)
    del gen


def test_stop_token_fed_ahead_is_trimmed_back(tiny_model):
    """Every position of the reply as the stop token, across the sliding
    window's edge: the state is always ``prompt + reply[:-1]``."""
    kind, model, tok = tiny_model
    prompt = prompt_ids(tok, 9)
    config = GREEDY.updated(max_tokens=SLIDING_WINDOW - len(prompt) + 4)
    ref = steps(model, prompt, None, config)
    for k, stop in enumerate(ref, 1):
        if stop in ref[: k - 1]:
            continue
        state = PromptCache.new(model)
        out = steps(model, prompt, state, config, stop_tokens={stop})
        assert out == ref[:k], (kind, k)
        assert state.tokens == prompt + out[:-1] and consistent(state), (kind, k)


def test_stop_token_at_the_edge_of_a_rotating_window(tiny_model):
    """Token k would be the first a ``max_kv_size`` window drops: it is not fed
    ahead (it could not be taken back), so a stop there leaves the usual state."""
    kind, model, tok = tiny_model
    prompt = prompt_ids(tok, 6)
    ref = steps(model, prompt, None, GREEDY.updated(max_tokens=8))
    k = next(k for k in range(2, len(ref) + 1) if ref[k - 1] not in ref[: k - 1])
    max_kv = len(prompt) + k - 1  # holding prompt + r1..r(k-1) fills the window
    config = GREEDY.updated(max_tokens=8, max_kv_size=max_kv, keep=2)
    state = PromptCache.new(model, CacheShape(max_kv, 2))
    out = steps(model, prompt, state, config, stop_tokens={ref[k - 1]})
    assert out == ref[:k]
    assert state.tokens == prompt + out[:-1] and consistent(state)
    assert can_trim_prompt_cache(state.cache) == (kind in ("llama", "sliding"))


def test_stop_token_fed_ahead_undoes_the_kv_quantization_it_started(llama_model):
    """Token 2, fed ahead, brings the cache to ``quantized_kv_start`` (it is
    quantized), then turns out a stop token: the float layers come back, as
    in the synchronous loop, and the next call gives the same logits."""
    model, tok = llama_model
    prompt = prompt_ids(tok, 6)
    config = GREEDY.updated(max_tokens=6, kv_bits=8, quantized_kv_start=8)
    ref = steps(model, prompt, None, config)
    stop = ref[1]
    assert stop != ref[0]
    ahead, sync = PromptCache.new(model), PromptCache.new(model)
    out = steps(model, prompt, ahead, config, stop_tokens={stop})
    assert out == steps(model, prompt, sync, config, stop_tokens={stop}, logits_processors=[unchanged]) == ref[:2]
    assert ahead.tokens == sync.tokens == prompt + ref[:1] and consistent(ahead)
    assert [type(c) for c in ahead.cache] == [type(c) for c in sync.cache] == [KVCache] * len(sync.cache)
    more = prompt + out + tok.encode(" Yes", add_special_tokens=False)
    a = list(generate_step(more, model, state=ahead, config=config))
    b = list(generate_step(more, model, state=sync, config=config, logits_processors=[unchanged]))
    assert [t for t, _ in a] == [t for t, _ in b]
    assert all(mx.array_equal(x, y).item() for (_, x), (_, y) in zip(a, b))


# ----------------------------------------------------------------- random numbers
@pytest.mark.parametrize("kind_state", ["trimmable", "synchronous"])
def test_seeded_sampling_is_unchanged_by_feeding_ahead(llama_model, kind_state):
    """Seeded temp > 0 sampling: the same tokens with and without feeding ahead,
    also for an unseeded call after a call that ended on a stop token fed ahead."""
    model, tok = llama_model
    prompt = prompt_ids(tok, 5)
    config = DEFAULTS.updated(temp=1.5, seed=11, max_tokens=12)
    procs = [unchanged] if kind_state == "synchronous" else None
    ref = steps(model, prompt, None, config, logits_processors=[unchanged])
    assert steps(model, prompt, None, config, logits_processors=procs) == ref
    stop = ref[4]
    assert stop not in ref[:4]

    def two_calls(processors):
        first = steps(model, prompt, None, config, logits_processors=processors, stop_tokens={stop})
        second = steps(model, prompt, None, dataclasses.replace(config, seed=None), logits_processors=processors)
        return first, second

    assert two_calls(procs) == two_calls([unchanged])
    assert two_calls(procs)[0] == ref[:5]


def test_seeded_sampling_matches_the_synchronous_step_by_step_loop(llama_model):
    """The old loop (prefill + decode_one_token per token) as the reference."""
    from loop_helpers import decode_one_token
    from mlx_chatcache.generation.sample import make_sampler

    model, tok = llama_model
    prompt = prompt_ids(tok, 1)  # one token: the first call is the same in both
    config = DEFAULTS.updated(temp=1.2, top_k=50, seed=5, max_tokens=9)
    mx.random.seed(5)
    state = PromptCache.new(model)
    sampler = make_sampler(1.2, 1.0, 50, 0.0, 1)
    token, _ = decode_one_token(model, state, prompt, sampler)
    old = [token]
    for _ in range(8):
        token, _ = decode_one_token(model, state, [token], sampler)
        old.append(token)
    assert steps(model, prompt, None, config) == old


# ----------------------------------------------------------------- the prompt's last call
def test_prompt_within_one_step_is_one_model_call(tiny_model):
    kind, model, tok = tiny_model
    counting = CountingModel(model)
    for n, step, expected in [(11, 16, [11]), (11, 11, [11]), (11, 4, [4, 4, 3]), (9, 4, [4, 4, 1])]:
        counting.calls.clear()
        prompt = prompt_ids(tok, n)
        seen = []
        gen = generate_step(prompt, counting, config=GREEDY.updated(max_tokens=1, prefill_step_size=step),
                            state=PromptCache.new(counting), progress=lambda d, t: seen.append((d, t)))  # fmt: skip
        next(gen)
        assert counting.calls == expected, (n, step)
        assert seen[0] == (0, n) and seen[-1] == (n, n)
        assert seen == [(0, n)] + [(sum(expected[: i + 1]), n) for i in range(len(expected) - 1)] + [(n, n)]


def test_quantized_model_keeps_the_last_token_alone(make_tiny_model):
    model, tok = make_tiny_model("llama", seed=0)
    nn.quantize(model, group_size=64, bits=4)
    counting = CountingModel(model)
    assert final_call_size(counting, 11, 16) == 1
    prompt = prompt_ids(tok, 11)
    next(generate_step(prompt, counting, config=GREEDY.updated(max_tokens=1, prefill_step_size=16),
                       state=PromptCache.new(counting)))  # fmt: skip
    assert counting.calls == [10, 1]
    seen = []
    rest = prefill(counting, PromptCache.new(model), prompt, 4, lambda d, t: seen.append((d, t)))
    assert rest == prompt[-1:] and seen == [(0, 11), (4, 11), (8, 11), (10, 11)]


def test_chat_turn_feeds_its_new_tokens_in_one_call(tiny_model):
    kind, model, tok = tiny_model
    counting = CountingModel(model)
    s = ChatSession(counting, tok, system_prompt="Be brief.", config=DEFAULTS.updated(max_tokens=4))
    s.ask("Good morning!")
    counting.calls.clear()
    r = s.ask("What is the capital of Italy?")
    assert r.stats.new_tokens <= DEFAULTS.prefill_step_size
    assert counting.calls[0] == r.stats.new_tokens  # the prompt: one call
    assert counting.calls[1:] == [1] * (len(counting.calls) - 1)
    # a small prefill step: a new chat feeds its system prompt first (its checkpoint is there),
    # in full chunks; then the rest: full chunks first, the last chunk with the first token
    config = DEFAULTS.updated(max_tokens=2, prefill_step_size=5)
    s2 = ChatSession(counting, tok, system_prompt="Be brief.", config=config)
    head = len(s2.encode(s2.render(s2.messages[:1], add_generation_prompt=False)))
    counting.calls.clear()
    r2 = s2.ask("Good morning!")
    head_calls = [5] * (head // 5) + ([head % 5] if head % 5 else [])
    assert counting.calls[: len(head_calls)] == head_calls
    n, chunks = r2.stats.new_tokens - head, []
    while sum(chunks) < n:
        chunks.append(counting.calls[len(head_calls) + len(chunks)])
    assert sum(chunks) == n and chunks[:-1] == [5] * (len(chunks) - 1) and 1 <= chunks[-1] <= 5


def test_interrupted_reply_leaves_the_documented_state(llama_model):
    model, tok = llama_model
    prompt = prompt_ids(tok, 8)
    state = PromptCache.new(model)
    calls = []

    def stop_after_three():
        calls.append(1)
        return len(calls) >= 3

    reply = stream_reply(model, tok, prompt, state, GREEDY.updated(max_tokens=20), 0.0, None, stop_after_three)
    assert reply.interrupted and len(reply.tokens) == 3
    assert state.tokens == prompt + reply.tokens[:-1] and consistent(state)
