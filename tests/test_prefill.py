"""The one prompt feeder (:func:`mlx_chatcache.generation.feed.prefill`) and the one
recovery from a failed model call (:func:`~mlx_chatcache.generation.feed.consistent_on_error`).

Tolerance: as tests/test_generate.py (cached vs uncached logits, float32 rounding).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from loop_helpers import forward

from mlx_chatcache.backend import blas
from mlx_chatcache.cache import cache_offset, can_trim_prompt_cache, make_prompt_cache
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.generation import feed
from mlx_chatcache.generation.feed import PrefillStopped, consistent_on_error, prefill
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.templates import feed_all
from mlx_chatcache.server.worker import GenerationWorker, Job
from mlx_chatcache.store.store import PromptStore
from mlx_chatcache.store.tiers import MemoryTier

ATOL = 1e-4 if blas.STATUS.active else 1e-5
TEXT = "The weather was cold and windy, so we stayed inside and read our books. " * 2


class FailingModel:
    """Raises KeyboardInterrupt after its ``at``-th call has updated the cache."""

    def __init__(self, model, at: int):
        self.model, self.at, self.calls = model, at, 0

    def __call__(self, inputs, cache=None):
        self.calls += 1
        out = self.model(inputs, cache=cache)
        if self.calls == self.at:
            raise KeyboardInterrupt
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def uncached(model, tokens) -> mx.array:
    return forward(model, make_prompt_cache(model), tokens)[0]


def test_prefill_records_each_chunk_and_stops_between_calls(llama_model):
    model, tok = llama_model
    prompt = tok.encode(TEXT, add_special_tokens=False)[:14]
    state = PromptCache.new(model)
    polls = []

    def stop() -> bool:
        polls.append(len(state.tokens))
        return len(polls) == 3

    with pytest.raises(PrefillStopped):
        prefill(model, state, prompt, 4, should_stop=stop)
    assert polls == [0, 4, 8]  # before every call, with the chunks fed so far recorded
    assert state.tokens == prompt[:8] and cache_offset(state.cache) == 8
    rest = prefill(model, state, prompt[8:], 4)
    assert state.tokens == prompt[:-1] and rest == prompt[-1:]
    got = forward(model, state.cache, rest)[0]
    assert mx.max(mx.abs(got - uncached(model, prompt))).item() <= ATOL


def test_prefill_polls_before_the_calls_it_leaves_to_the_caller(llama_model):
    model, tok = llama_model
    prompt = tok.encode(TEXT, add_special_tokens=False)[:10]
    polls = []
    rest = prefill(model, PromptCache.new(model), prompt, 4, leave=3, should_stop=lambda: polls.append(1) or False)
    assert len(rest) == 3 and len(polls) == 3  # two chunks (4 + 3), then before the 3 tokens left
    polls.clear()
    prefill(model, PromptCache.new(model), prompt, 16, leave=1, should_stop=lambda: polls.append(1) or False)
    assert len(polls) == 1  # one token left: one decode-sized call, not polled


@pytest.mark.parametrize("trim_back", [True, False])
def test_a_failed_call_leaves_the_fed_chunks_or_an_empty_state(tiny_model, trim_back):
    kind, model, tok = tiny_model
    prompt = tok.encode(TEXT, add_special_tokens=False)[:14]
    state = PromptCache.new(model)
    failing = FailingModel(model, at=3)
    with pytest.raises(KeyboardInterrupt):
        with consistent_on_error(state, failing, trim_back=trim_back):
            prefill(failing, state, prompt, 4)
    assert len(state.tokens) == cache_offset(state.cache)  # never half-updated
    if trim_back and can_trim_prompt_cache(state.cache):
        assert state.tokens == prompt[:8]  # the third chunk was taken back off
    else:
        assert kind in ("hybrid", "ssm") or not trim_back
        assert state.tokens == []  # an SSM state cannot be taken back: empty
    rest = prefill(model, state, prompt[len(state.tokens) :], 4)
    got = forward(model, state.cache, rest)[0]
    assert mx.max(mx.abs(got - uncached(model, prompt))).item() <= ATOL


def test_cache_prompt_feeds_through_the_one_prefill(llama_model, monkeypatch):
    model, tok = llama_model
    prompt = tok.encode(TEXT, add_special_tokens=False)[:11]
    fed = []
    real = feed.call_model

    def counting(model, tokens, cache, **kw):
        fed.extend(tokens)
        return real(model, tokens, cache, **kw)

    monkeypatch.setattr(feed, "call_model", counting)
    state = PromptCache.new(model)
    feed_all(model, state, prompt, 4)
    assert fed == prompt and state.tokens == prompt and cache_offset(state.cache) == 11


def test_a_server_job_cancelled_during_its_checkpoint_keeps_what_it_fed(make_tiny_model):
    model, tok = make_tiny_model("hybrid", seed=0)  # conv layers: the checkpoint path
    prompt = tok.encode(TEXT, add_special_tokens=False)[:20]
    config = DEFAULTS.updated(prefill_step_size=4, max_tokens=2)
    job = Job(prompt, config, emit=lambda event: None, boundary=15)
    cancelling = CancellingModel(model, job, at=2)
    worker = GenerationWorker(cancelling, tok, PromptStore([MemoryTier(1 << 30)]), config, max_queue=1)
    state = PromptCache.new(model)
    with pytest.raises(Exception) as got:
        worker._checkpoint(job, state)
    assert type(got.value).__name__ == "_Cancelled"
    assert state.tokens == prompt[:8] and cache_offset(state.cache) == 8  # two chunks, kept for the store


class CancellingModel(FailingModel):
    """Cancels ``job`` during its ``at``-th call (the client went away)."""

    def __init__(self, model, job, at: int):
        super().__init__(model, at=0)
        self.job, self.cancel_at = job, at

    def __call__(self, inputs, cache=None):
        out = super().__call__(inputs, cache=cache)
        if self.calls == self.cancel_at:
            self.job.cancel()
        return out
