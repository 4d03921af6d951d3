"""Paced prompt processing (:mod:`mlx_chatcache.generation.pacing`): calls sized to a time
budget so Ctrl-C is acted upon, with the same results as unpaced calls.

Tolerance: as tests/test_generate.py, any chunking gives last-token logits
within 1e-5 (max abs diff, float32; 1e-4 with the Linux OpenBLAS swap, whose
one-row and many-row products round differently) and equal greedy tokens.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_chatcache.chat.session import ChatSession
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.generation import pacing
from mlx_chatcache.generation.feed import prefill
from mlx_chatcache.generation.loop import generate_step
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.backend import blas
from mlx_chatcache.generation.pacing import PROBE_TOKENS, CallPacer

ATOL = 1e-4 if blas.STATUS.active else 1e-5  # see tests/test_generate.py
GREEDY = DEFAULTS.updated(temp=0.0, max_tokens=6)
TEXT = "The weather was cold and windy, so we stayed inside and read our books. " * 3


class CountingModel:
    """Wraps a model (a new object: no pace measured yet); records each call's token count."""

    def __init__(self, model):
        self.model = model
        self.calls: list[int] = []

    def __call__(self, inputs, cache=None):
        self.calls.append(inputs.shape[1])
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


class FakeClock:
    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(pacing.time, "perf_counter", lambda: self.now)


def test_pacer_sizes_follow_the_measured_time_per_token(monkeypatch):
    clock, model = FakeClock(monkeypatch), CountingModel(None)
    p = CallPacer(model, 0.5)
    assert p.size(512) == PROBE_TOKENS == 1 and p.size(0) == 0
    p.start()
    clock.now += 4 * 0.12  # 0.12 s per token
    p.record(4)
    assert p.size(512) == 4  # 4.2 tokens would fit: the power of two below
    assert not p.fits(5) and p.fits(4)
    p.start()
    clock.now += 4 * 0.001
    p.record(4)
    assert p.size(512) == 8  # fast, but at most twice the size measured
    p.start()
    clock.now += 256 * 0.0001
    p.record(256)
    assert p.size(512) == 512 and p.size(430) == 430  # everything fits: one call
    p.start()
    clock.now += 2.0  # one token takes longer than the budget: one at a time
    p.record(1)
    assert p.size(512) == 1
    assert CallPacer(model, 0.5).size(512) == 1  # remembered for the model object


def test_paced_generation_equals_unpaced(tiny_model):
    kind, model, tok = tiny_model
    prompt = tok.encode(TEXT, add_special_tokens=False)[:60]
    ref = list(generate_step(prompt, model, state=PromptCache.new(model), config=GREEDY))
    counting = CountingModel(model)
    paced = list(generate_step(prompt, counting, state=PromptCache.new(model), config=GREEDY,
                               max_call_seconds=1e-9))  # fmt: skip
    n_prompt_calls = len(counting.calls) - (len(paced) - 1)
    assert counting.calls[0] == PROBE_TOKENS and max(counting.calls[:n_prompt_calls]) <= PROBE_TOKENS
    assert sum(counting.calls[:n_prompt_calls]) == len(prompt)
    assert [t for t, _ in paced] == [t for t, _ in ref]
    for (_, a), (_, b) in zip(paced, ref):
        assert mx.max(mx.abs(a - b)).item() <= ATOL


def test_paced_prefill_with_a_generous_budget_grows_to_full_steps(llama_model):
    model, tok = llama_model
    prompt = tok.encode(TEXT, add_special_tokens=False)[:40]
    counting = CountingModel(model)
    rest = prefill(counting, PromptCache.new(model), prompt, 16, leave=1, pacer=CallPacer(counting, 1e9))
    assert counting.calls == [1, 2, 4, 8, 16, 8] and rest == prompt[-1:]  # growing 2x per call
    counting.calls.clear()  # measured now: the next prompt starts at full steps
    prefill(counting, PromptCache.new(model), prompt, 16, leave=1, pacer=CallPacer(counting, 1e9))
    assert counting.calls == [16, 16, 7]


def test_prefill_feeds_more_than_leave_when_the_rest_would_take_too_long(llama_model):
    model, tok = llama_model
    prompt = tok.encode(TEXT, add_special_tokens=False)[:20]
    counting = CountingModel(model)
    rest = prefill(counting, PromptCache.new(model), prompt, 512, leave=20, pacer=CallPacer(counting, 1e-9))
    assert len(rest) == 1 and sum(counting.calls) == 19 and max(counting.calls) <= PROBE_TOKENS


@pytest.mark.parametrize("budget", [None, 1e-9])
def test_chat_turns_polling_a_stop_are_paced_with_equal_replies(tiny_model, budget):
    kind, model, tok = tiny_model
    turns = ["Good morning! " * 8, "What is the capital of Italy?"]
    ref = ChatSession(model, tok, system_prompt="Be brief.", config=GREEDY)
    ref_replies = [ref.ask(t).text for t in turns]
    counting = CountingModel(model)
    s = ChatSession(counting, tok, system_prompt="Be brief.", config=GREEDY)
    if budget is not None:
        monkey = pytest.MonkeyPatch()
        monkey.setattr("mlx_chatcache.chat.turn.INTERRUPTIBLE_CALL_SECONDS", budget)
    try:
        replies = [s.ask(t, should_stop=lambda: False).text for t in turns]
    finally:
        if budget is not None:
            monkey.undo()
    assert replies == ref_replies
    assert s.tokens == ref.tokens
    assert counting.calls[0] == PROBE_TOKENS  # a model never measured starts with a probe
    if budget is not None:  # then one token per call
        assert set(counting.calls[1:]) == {1}
