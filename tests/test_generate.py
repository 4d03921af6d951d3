"""Tests of :mod:`mlx_chatcache.generation.loop` on the tiny models (float32, CPU).

References are computed without any reuse: the model is called on the whole
token sequence for every step (no cache, or a fresh cache per call).

Tolerances:

- Cached vs uncached last-token logits: max abs diff <= 1e-5. This holds for
  one call, chunks of 3 and token by token, and after trim + re-feed.
- Greedy token sequences must be *equal*. The tiny models' top-two logit
  margins are far larger than the float32 differences above.
- ``kv_bits=8`` (group 64) vs float cache, fed the same tokens: max abs logit
  diff <= 3% of the float logits' range (max - min, about 11 here; measured
  0.7-1.6%, the same as mlx-lm's own quantized cache). Greedy tokens may
  differ on near-ties, so only the logits are compared.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from loop_helpers import forward
from tiny_models import IM_END, SLIDING_WINDOW

from mlx_chatcache.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)
from mlx_chatcache.backend import blas
from mlx_chatcache.config import DEFAULTS, CacheShape
from mlx_chatcache.errors import UsageError
from mlx_chatcache.generation.feed import prefill
from mlx_chatcache.generation.loop import generate_step
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.prompt import reuse_prefix
from mlx_chatcache.generation.text import generate, stream_generate

# cached vs uncached logits: float32 rounding. With the Linux OpenBLAS swap one-row and many-row
# products run different kernels (measured <= 3.9e-5 in tests/test_cache_models.py's setting;
# bit-exact with the bundled BLAS); CI runs the suite both ways.
ATOL = 1e-4 if blas.STATUS.active else 1e-5
QUANT_RTOL = 0.03  # of the logit range
TEXT = "The weather was cold and windy, so we stayed inside and read our books."
GREEDY = DEFAULTS.updated(temp=0.0)


# ----------------------------------------------------------------- helpers
def prompt_ids(tokenizer, n: int, text: str = TEXT) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


def uncached_logits(model, tokens, cache=None) -> mx.array:
    """Last-position logits ``(V,)`` of one forward over the whole sequence."""
    return model(mx.array(tokens)[None], cache=cache)[0, -1]


def reference_greedy(model, prompt, n: int, make_cache=lambda: None) -> list[int]:
    """``n`` greedy tokens, recomputing the whole sequence at every step."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(mx.argmax(uncached_logits(model, seq, make_cache())).item())
    return seq[len(prompt) :]


def run(model, prompt, state=None, config=GREEDY, **kw) -> list[int]:
    return [t for t, _ in generate_step(prompt, model, state=state, config=config, **kw)]


def max_diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a - b).max().item()


class PinnedWindowReference(KVCache):
    """A KVCache that never drops a token but masks like a rotating cache.

    A query at position p sees key k iff k <= p and (k < keep or
    k > p - (max_size - keep)), and also k > p - window_size for a model
    window: the semantics ``RotatingKVCache`` promises.
    """

    def __init__(self, max_size: int, keep: int):
        super().__init__()
        self.max_size, self.keep = max_size, keep

    def make_mask(self, N, return_array=False, window_size=None):
        q = mx.arange(self.offset, self.offset + N)[:, None]  # (N, 1)
        k = mx.arange(self.offset + N)[None]  # (1, offset + N)
        mask = (k <= q) & ((k < self.keep) | (k > q - (self.max_size - self.keep)))
        if window_size is not None:
            mask = mask & (k > q - window_size)
        return mask  # (N, offset + N)


def pinned_window_cache(model, max_size: int, keep: int) -> list:
    return [
        PinnedWindowReference(max_size, keep) if type(c) is KVCache else c
        for c in make_prompt_cache(model)
    ]


# ----------------------------------------------------------------- greedy = reference
def test_greedy_matches_uncached_reference(tiny_model):
    kind, model, tok = tiny_model
    prompt = prompt_ids(tok, 10)
    state = PromptCache.new(model)
    out = run(model, prompt, state, GREEDY.updated(max_tokens=12))
    assert out == reference_greedy(model, prompt, 12)
    assert len(set(out)) > 3  # not a degenerate loop
    assert state.tokens == prompt + out[:-1]  # the last sampled token is not fed


# ----------------------------------------------------------------- cached logits
@pytest.mark.parametrize("mode", ["one_call", "chunks_of_3", "token_by_token"])
def test_cached_logits_equal_uncached(tiny_model, mode):
    kind, model, tok = tiny_model
    prompt = prompt_ids(tok, SLIDING_WINDOW + 4)  # sliding layers wrap
    cache = make_prompt_cache(model)
    if mode == "one_call":
        logits = forward(model, cache, prompt)[0]
    else:
        step = 3 if mode == "chunks_of_3" else 1
        rest = prefill(model, PromptCache(cache), prompt, step)
        assert rest == prompt[-1:]
        logits = forward(model, cache, rest)[0]
    assert max_diff(logits, uncached_logits(model, prompt)) <= ATOL


def test_prefill_reports_progress(llama_model):
    model, tok = llama_model
    prompt = prompt_ids(tok, 11)
    seen = []
    rest = prefill(model, PromptCache.new(model), prompt, 4, lambda d, t: seen.append((d, t)))
    assert rest == prompt[-1:]
    assert seen == [(0, 11), (4, 11), (8, 11), (10, 11)]


# ----------------------------------------------------------------- trim + re-feed
def test_trim_then_refeed_gives_identical_logits(tiny_model):
    kind, model, tok = tiny_model
    prompt = prompt_ids(tok, 12)
    cache = make_prompt_cache(model)
    prefill(model, PromptCache(cache), prompt, 5)
    if not can_trim_prompt_cache(cache):
        assert kind in ("hybrid", "ssm")  # ArraysCache state cannot be rolled back
        pytest.skip(f"{kind} caches are not trimmable")
    before = forward(model, cache, prompt[-1:])[0]
    assert trim_prompt_cache(cache, 5) == 5
    after = forward(model, cache, prompt[-5:])[0]
    assert max_diff(before, after) <= ATOL
    assert max_diff(after, uncached_logits(model, prompt)) <= ATOL


# ----------------------------------------------------------------- multi-turn reuse
def test_second_turn_reuses_everything_held(tiny_model):
    kind, model, tok = tiny_model
    p1 = prompt_ids(tok, 9)
    state = PromptCache.new(model)
    r1 = list(stream_generate(model, tok, p1, state=state, config=GREEDY.updated(max_tokens=6)))
    reply = [r.token for r in r1]
    assert r1[-1].reused_tokens == 0 and r1[-1].prompt_tokens == 9
    assert state.tokens == p1 + reply[:-1]
    held = len(state.tokens)

    p2 = p1 + reply + tok.encode(" Thank you very much", add_special_tokens=False)
    config = GREEDY.updated(max_tokens=8)
    r2 = list(stream_generate(model, tok, p2, state=state, config=config))
    assert r2[-1].reused_tokens == held
    assert [r.token for r in r2] == run(model, p2, None, config)
    assert state.tokens == p2 + [r.token for r in r2][:-1]


def test_divergent_prompt_trims_or_rebuilds(tiny_model):
    kind, model, tok = tiny_model
    p1 = prompt_ids(tok, 8)
    state = PromptCache.new(model)
    run(model, p1, state, GREEDY.updated(max_tokens=4))
    assert len(state.tokens) == 11 < SLIDING_WINDOW  # sliding layers still trimmable
    trimmable = can_trim_prompt_cache(state.cache)
    assert trimmable == (kind in ("llama", "sliding"))

    p3 = p1[:5] + tok.encode(" Please summarise this", add_special_tokens=False)
    config = GREEDY.updated(max_tokens=8)
    r3 = list(stream_generate(model, tok, p3, state=state, config=config))
    assert r3[-1].reused_tokens == (5 if trimmable else 0)
    assert [r.token for r in r3] == run(model, p3, None, config)
    assert state.tokens == p3 + [r.token for r in r3][:-1]


def test_reuse_prefix_keeps_one_token_to_feed(tiny_model):
    kind, model, tok = tiny_model
    prompt = prompt_ids(tok, 6)
    state = PromptCache.new(model)
    prefill(model, state, prompt + [5], 10)  # the cache holds exactly `prompt`
    assert state.tokens == prompt
    reused = reuse_prefix(state, prompt, model)
    if kind in ("llama", "sliding"):
        assert reused == 5 and state.tokens == prompt[:5]
    else:  # cannot drop the last token: start again
        assert reused == 0 and state.tokens == []
    assert reuse_prefix(state, prompt, model) == reused  # idempotent


# ----------------------------------------------------------------- rotating window
def test_max_kv_size_runs_past_the_window(tiny_model):
    kind, model, tok = tiny_model
    max_kv, keep = 12, 3
    config = GREEDY.updated(max_kv_size=max_kv, keep=keep, prefill_step_size=5, max_tokens=10)
    ref_cache = lambda: pinned_window_cache(model, max_kv, keep)  # noqa: E731
    p1 = prompt_ids(tok, 15)  # the prompt alone overflows the window
    state = PromptCache.new(model, CacheShape(max_kv, keep))
    out1 = run(model, p1, state, config)
    assert out1 == reference_greedy(model, p1, 10, ref_cache)
    rotating = [c for c in state.cache if isinstance(c, RotatingKVCache) and c.max_size == max_kv]
    assert bool(rotating) == (kind != "ssm")  # ssm has no attention layer
    assert all(c.size() == max_kv and not c.is_trimmable() for c in rotating)

    # next turn extends what the cache holds: reused without trimming
    p2 = p1 + out1 + tok.encode(" Good morning", add_special_tokens=False)
    r2 = list(stream_generate(model, tok, p2, state=state, config=config))
    assert r2[-1].reused_tokens == len(p1) + len(out1) - 1
    assert [r.token for r in r2] == reference_greedy(model, p2, 10, ref_cache)

    # a divergent prompt cannot trim a cache that dropped tokens: rebuilt, same shape
    p3 = p1[:5] + tok.encode(" Please summarise", add_special_tokens=False)
    r3 = list(stream_generate(model, tok, p3, state=state, config=config))
    assert r3[-1].reused_tokens == 0
    assert [r.token for r in r3] == reference_greedy(model, p3, 10, ref_cache)
    assert (state.shape.max_kv_size, state.shape.keep) == (max_kv, keep)


def test_state_shape_conflict_is_a_usage_error(llama_model):
    model, tok = llama_model
    state = PromptCache.new(model, CacheShape(32, 4))
    with pytest.raises(UsageError):
        run(model, prompt_ids(tok, 4), state, GREEDY.updated(max_kv_size=64))


# ----------------------------------------------------------------- quantized KV
def test_kv_bits_8_close_to_float(llama_model):
    model, tok = llama_model
    tokens = prompt_ids(tok, 16)
    config = GREEDY.updated(kv_bits=8, kv_group_size=64, quantized_kv_start=0, max_tokens=1)
    float_state, q_state = PromptCache.new(model), PromptCache.new(model)
    run(model, tokens[:8], float_state, GREEDY.updated(max_tokens=1))
    run(model, tokens[:8], q_state, config)
    assert all(type(c) is QuantizedKVCache and c.bits == 8 for c in q_state.cache)
    for t in tokens[8:]:  # feed the same tokens to both caches
        ref = forward(model, float_state.cache, [t])[0]
        got = forward(model, q_state.cache, [t])[0]
        spread = (mx.max(ref) - mx.min(ref)).item()
        assert 0 < max_diff(ref, got) <= QUANT_RTOL * spread  # 0 would mean not quantized


def test_quantized_kv_start_delays_quantization(llama_model):
    model, tok = llama_model
    prompt = prompt_ids(tok, 8)
    config = GREEDY.updated(kv_bits=8, quantized_kv_start=12)
    state = PromptCache.new(model)
    run(model, prompt, state, config.updated(max_tokens=3))  # fed 10 tokens
    assert all(type(c) is KVCache for c in state.cache)
    state2 = PromptCache.new(model)
    run(model, prompt, state2, config.updated(max_tokens=6))  # fed 13 tokens
    assert all(type(c) is QuantizedKVCache for c in state2.cache)


# ----------------------------------------------------------------- stopping
def force_token_after(token: int, position: int):
    """A logits processor making ``token`` certain once the context reaches ``position``."""

    def process(context, logits):
        if context.size < position:
            return logits
        return mx.where(mx.arange(logits.shape[-1]) == token, 100.0, -100.0)[None]

    return process


def test_eos_stops_with_finish_reason_stop(llama_model):
    model, tok = llama_model
    prompt = prompt_ids(tok, 6)
    eos = tok.convert_tokens_to_ids(IM_END)
    assert eos in tok.eos_token_ids
    state = PromptCache.new(model)
    config = GREEDY.updated(max_tokens=20)
    rs = list(
        stream_generate(model, tok, prompt, state=state, config=config,
                        logits_processors=[force_token_after(eos, len(prompt) + 3)])
    )  # fmt: skip
    assert [r.finish_reason for r in rs] == [None, None, None, "stop"]
    assert rs[-1].token == eos and rs[-1].generation_tokens == 4
    text = "".join(r.text for r in rs)
    assert IM_END not in text and text == tok.decode([r.token for r in rs[:-1]])
    assert state.tokens == prompt + [r.token for r in rs[:-1]]  # EOS not fed


def test_max_tokens_gives_finish_reason_length(llama_model):
    model, tok = llama_model
    rs = list(stream_generate(model, tok, TEXT, config=GREEDY.updated(max_tokens=5)))
    assert [r.finish_reason for r in rs] == [None] * 4 + ["length"]
    assert [r.generation_tokens for r in rs] == [1, 2, 3, 4, 5]
    r = rs[-1]
    assert r.prompt_tokens == len(tok.encode(TEXT)) and r.reused_tokens == 0
    assert r.ttft > 0 and r.prompt_tps > 0 and r.generation_tps > 0 and r.peak_memory > 0
    assert r.logprobs.shape == (model.args.vocab_size,)
    assert abs(mx.logsumexp(r.logprobs).item()) < 1e-4


@pytest.mark.parametrize("as_string", [True, False])
def test_extra_eos_token_stops(llama_model, as_string):
    model, tok = llama_model
    prompt = prompt_ids(tok, 8)
    ref = reference_greedy(model, prompt, 10)
    stop = ref[3]
    cut = ref.index(stop) + 1
    extra = tok.convert_ids_to_tokens(stop) if as_string else stop
    config = GREEDY.updated(max_tokens=10)
    rs = list(stream_generate(model, tok, prompt, config=config, extra_eos_tokens=[extra]))
    assert [r.token for r in rs] == ref[:cut]
    assert rs[-1].finish_reason == "stop"


def test_unknown_extra_eos_is_a_usage_error(llama_model):
    model, tok = llama_model
    with pytest.raises(UsageError):
        generate(model, tok, TEXT, extra_eos_tokens=["not one token at all"])


# ----------------------------------------------------------------- text API, seeds, errors
def test_generate_returns_the_streamed_text(llama_model, capsys):
    model, tok = llama_model
    config = GREEDY.updated(max_tokens=7)
    text = generate(model, tok, TEXT, config=config, verbose=True)
    assert text == "".join(r.text for r in stream_generate(model, tok, TEXT, config=config))
    assert text == tok.decode(run(model, tok.encode(TEXT), None, config))
    assert "Generation: 7 tokens" in capsys.readouterr().out


def test_seed_makes_sampling_reproducible(llama_model):
    model, tok = llama_model
    prompt = prompt_ids(tok, 6)
    config = DEFAULTS.updated(temp=1.5, seed=3, max_tokens=10)
    a, b = run(model, prompt, None, config), run(model, prompt, None, config)
    assert a == b
    assert a != run(model, prompt, None, dataclasses.replace(config, seed=4))


class ExplodingModel:
    """Wraps a model; raises KeyboardInterrupt on call number ``at``."""

    def __init__(self, model, at: int):
        self.model, self.at, self.calls = model, at, 0
        self.layers = model.layers
        self.make_cache = model.make_cache

    def __call__(self, inputs, cache=None):
        self.calls += 1
        out = self.model(inputs, cache=cache)
        if self.calls == self.at:
            raise KeyboardInterrupt
        return out


def test_interrupted_model_call_resets_the_state(llama_model):
    model, tok = llama_model
    prompt = prompt_ids(tok, 10)
    state = PromptCache.new(model)
    run(model, prompt, state, GREEDY.updated(max_tokens=3))
    assert len(state.tokens) == 12
    more = state.tokens + tok.encode(" and then", add_special_tokens=False)
    with pytest.raises(KeyboardInterrupt):
        run(ExplodingModel(model, at=2), more, state, GREEDY.updated(max_tokens=3, prefill_step_size=1))
    assert state.tokens == [] and all(c.offset == 0 for c in state.cache)
    assert run(model, more, state, GREEDY.updated(max_tokens=3)) == reference_greedy(model, more, 3)
