"""Speculative decoding (:mod:`mlx_chatcache.generation.speculative`) is exact.

- Greedy: with any drafts (random, always wrong, always right, right then wrong), of any length,
  the tokens are those plain decoding gives, the state holds what plain decoding leaves, and the
  cache's next logits equal plain decoding's within ATOL (cached vs cached, same tokens): a draft
  never changes a token and a rejected draft leaves nothing behind. Drafts crossing a stop token,
  ``max_tokens``, a consumer that stops early (a stop string) and a rotating window's wrap too.
- Sampled: the tokens follow the model's distribution (the speculative-sampling rule with a draft
  model, the token-match rule with chosen drafts), checked with a chi-square test on a bigram
  model over a 4-token vocabulary: the statistic stays below df + 6 sqrt(2 df) (a false alarm
  less than about once in 10^6 runs), and a draft equal to the model is always accepted.
- Models whose cache cannot take drafts back (SSM/convolution layers) are refused in one line;
  a processor that keeps state (a grammar) gets no drafts and the same tokens.

The tiny models' top-two logit margins are far larger than the float32 differences of feeding
several tokens in one call (tests/test_generate.py), so greedy tokens must be equal.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny_models import SLIDING_WINDOW

from mlx_chatcache.backend import blas
from mlx_chatcache.config import DEFAULTS, CacheShape
from mlx_chatcache.errors import UsageError
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.drafts import Drafts, PromptLookup
from mlx_chatcache.generation.loop import generate_step
from mlx_chatcache.generation.speculative import speculative_generate_step
from mlx_chatcache.generation.text import stream_generate
from mlx_chatcache.models.draft_pair import DraftPair

ATOL = 1e-4 if blas.STATUS.active else 1e-5
TEXT = "The weather was cold and windy, so we stayed inside and read our books by the fire."
GREEDY = DEFAULTS.updated(temp=0.0)


class Scripted:
    """A draft source proposing ``choose(context, k)`` (the protocol of generation/drafts.py)."""

    def __init__(self, choose):
        self.choose, self.seq = choose, []

    def start(self, context):
        self.seq = list(context)

    def propose(self, k):
        return Drafts([int(t) for t in self.choose(self.seq, k)][:k])

    def advance(self, tokens, accepted):
        self.seq.extend(tokens)

    def finish(self, n):
        del self.seq[n:]


def plain(model, prompt, config, state=None):
    state = state or PromptCache.new(model, config.shape)
    return [t for t, _ in generate_step(prompt, model, state=state, config=config)], state


def speculative(model, prompt, config, source, k, state=None, stops=(), stats=None):
    state = state or PromptCache.new(model, config.shape)
    steps = speculative_generate_step(prompt, model, state=state, config=config, drafts=source,
                                      num_draft_tokens=k, stop_tokens=stops, draft_stats=stats)  # fmt: skip
    return [t for t, _, _ in steps], state


def next_logits(model, state: PromptCache, token: int) -> mx.array:
    """The logits after feeding ``token`` to a copy of the state's cache."""
    from mlx_chatcache.cache import copy_prompt_cache

    return model(mx.array([[token]]), cache=copy_prompt_cache(state.cache))[0, -1]


def oracle(prompt, reply):
    """Drafts that are always right: the plain reply's next tokens."""
    whole = list(prompt) + list(reply)
    return lambda seq, k: whole[len(seq) : len(seq) + k]


def kinds(prompt, reply, vocab):
    rng = np.random.default_rng(7)
    right = oracle(prompt, reply)
    return {
        "random": lambda seq, k: rng.integers(0, vocab, k),
        "wrong": lambda seq, k: [(t + 1) % vocab for t in right(seq, k)] or [3] * k,
        "right": right,
        "right then wrong": lambda seq, k: right(seq, k)[: k // 2] + [(t + 1) % vocab for t in right(seq, k)[k // 2 :]],
    }


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_tokens_and_caches_are_plain_decodings_with_any_drafts(llama_model, k):
    model, tok = llama_model
    prompt = tok.encode(TEXT)
    config = GREEDY.updated(max_tokens=24)
    reply, ref = plain(model, prompt, config)
    vocab = model.args.vocab_size
    for name, choose in kinds(prompt, reply, vocab).items():
        stats = {}
        got, state = speculative(model, prompt, config, Scripted(choose), k, stats=stats)
        assert got == reply, name
        assert state.tokens == ref.tokens and all(c.offset == len(ref.tokens) for c in state.cache), name
        assert mx.abs(next_logits(model, state, reply[-1]) - next_logits(model, ref, reply[-1])).max().item() <= ATOL
        if name == "right":
            assert stats["accepted"] == stats["drafted"] > 0 and stats["rounds"] <= math.ceil(len(reply) / k)
        if name == "wrong":
            assert stats["accepted"] == 0 and stats["rounds"] == len(reply)


def test_drafts_crossing_a_stop_token_or_max_tokens_end_where_plain_decoding_ends(llama_model):
    model, tok = llama_model
    prompt = tok.encode(TEXT)
    reply, _ = plain(model, prompt, GREEDY.updated(max_tokens=30))
    j = next(i for i in range(4, len(reply)) if reply[i] not in reply[:i])  # a token first seen at j
    for k in (2, 8):
        got, state = speculative(model, prompt, GREEDY.updated(max_tokens=30), Scripted(oracle(prompt, reply)), k,
                                 stops={reply[j]})  # fmt: skip
        assert got == reply[: j + 1] and state.tokens == prompt + reply[:j]
        assert all(c.offset == len(state.tokens) for c in state.cache)
        got, state = speculative(model, prompt, GREEDY.updated(max_tokens=7), Scripted(oracle(prompt, reply)), k)
        assert got == reply[:7] and state.tokens == prompt + reply[:6]


def test_a_consumer_that_stops_early_finds_the_tokens_before_the_last_it_took(llama_model):
    """A stop string: the consumer closes the generator after a token in the middle of a round."""
    model, tok = llama_model
    prompt = tok.encode(TEXT)
    reply, _ = plain(model, prompt, GREEDY.updated(max_tokens=20))
    state = PromptCache.new(model)
    steps = speculative_generate_step(prompt, model, state=state, config=GREEDY.updated(max_tokens=20),
                                      drafts=Scripted(oracle(prompt, reply)), num_draft_tokens=8)  # fmt: skip
    taken = []
    for token, _, from_draft in steps:
        taken.append(token)
        if len(taken) == 5:
            assert from_draft  # in the middle of a round's accepted drafts
            break
    steps.close()
    assert taken == reply[:5] and state.tokens == prompt + reply[:4]
    assert all(c.offset == len(state.tokens) for c in state.cache)
    # the next turn reuses it and continues as plain decoding does
    more, _ = plain(model, prompt + reply[:5], GREEDY.updated(max_tokens=6))
    assert [r.token for r in stream_generate(model, tok, prompt + reply[:5], state=state,
                                             config=GREEDY.updated(max_tokens=6, prompt_lookup="prompt"))] == more


@pytest.mark.parametrize("shape", ["sliding model", "max_kv_size"])
def test_greedy_drafts_across_a_rotating_windows_wrap(tiny_model_dirs, llama_model, shape):
    from mlx_chatcache.models.loading import load

    if shape == "sliding model":
        model, tok = load(str(tiny_model_dirs["sliding"]))
        config = GREEDY.updated(max_tokens=2 * SLIDING_WINDOW)
    else:
        model, tok = llama_model
        config = GREEDY.updated(max_tokens=40, max_kv_size=32, keep=4)
    prompt = tok.encode(TEXT)[:12]
    reply, ref = plain(model, prompt, config)
    for name, choose in kinds(prompt, reply, model.args.vocab_size).items():
        stats = {}
        got, state = speculative(model, prompt, config, Scripted(choose), 4, stats=stats)
        assert got == reply, name
        assert state.tokens == ref.tokens
        assert mx.abs(next_logits(model, state, reply[-1]) - next_logits(model, ref, reply[-1])).max().item() <= ATOL
        if name == "right":  # drafts while the window has room for them, none once it wraps
            assert 0 < stats["accepted"] < len(reply) - 1


def test_prompt_lookup_and_a_draft_model_give_plain_greedy_text(llama_model, make_tiny_model):
    model, tok = llama_model
    draft, _ = make_tiny_model("llama", seed=1)
    prompt = tok.encode(TEXT + " " + TEXT)
    config = GREEDY.updated(max_tokens=40)
    reply = [r.token for r in stream_generate(model, tok, prompt, config=config)]
    looked = list(stream_generate(model, tok, prompt, config=config.updated(prompt_lookup="prompt")))
    assert [r.token for r in looked] == reply
    drafted = list(stream_generate(model, tok, prompt, draft_model=draft, config=config))
    assert [r.token for r in drafted] == reply
    selfish = list(stream_generate(model, tok, prompt, draft_model=model, num_draft_tokens=4, config=config))
    assert [r.token for r in selfish] == reply and sum(r.from_draft for r in selfish) >= len(reply) * 3 // 5


def test_mlx_lms_from_draft_pattern(llama_model):
    """mlx-lm's own test: the model as its own draft, 2 drafts, 5 tokens."""
    model, tok = llama_model
    out = list(stream_generate(model, tok, tok.encode(TEXT), max_tokens=5, draft_model=model, num_draft_tokens=2))
    assert [r.from_draft for r in out] == [True, True, False, True, True]


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    look = PromptLookup(ngram=3, min_ngram=2)
    look.start([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    assert look.propose(4).tokens == [4, 5, 9, 2]  # "1 2 3" last ended before 4
    look.advance([4], 0)
    assert look.propose(3).tokens == [5, 9, 2]  # "2 3 4" ended before 5
    look.advance([6], 0)
    assert look.propose(3).tokens == []  # neither "3 4 6" nor "4 6" came before
    look.advance([2, 3], 1)
    assert look.propose(3).tokens == [4, 6, 2]  # no "6 2 3": the 2-gram "2 3", its latest match



# ----------------------------------------------------------------- sampling
class Bigram(nn.Module):
    """A model whose next-token logits depend on the last token only (``table[token]``), over a
    tiny vocabulary; its one layer is a K/V cache that stores one number per token."""

    def __init__(self, table):
        super().__init__()
        self.embed_tokens = nn.Embedding(len(table), 1)
        self.table = mx.array(table, dtype=mx.float32)
        self.layers = [None]

    def __call__(self, inputs, cache=None):
        x = inputs.astype(mx.float32)[:, None, :, None]  # (1, 1, T, 1)
        if cache is not None:
            cache[0].update_and_fetch(x, x)
        return self.table[inputs]  # (1, T, V)


TARGET = [[2.0, 1.0, 0.0, -1.0], [0.0, 1.5, 0.5, 0.0], [1.0, 0.0, 1.0, 0.3], [-0.5, 0.2, 0.9, 1.4]]
DRAFT = [[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, -1.0], [0.5, 0.0, 1.5, 0.0], [0.0, 0.0, 0.0, 1.0]]


def exact_pairs(table, first: int, temp: float) -> np.ndarray:
    p = np.exp(np.array(table) / temp)
    p /= p.sum(axis=1, keepdims=True)
    return p[first][:, None] * p  # P(t1 = a, t2 = b)


def chi2_ok(counts: np.ndarray, expected: np.ndarray) -> bool:
    df = counts.size - 1
    stat = (((counts - expected) ** 2) / expected).sum()
    return stat < df + 6 * math.sqrt(2 * df)


@pytest.mark.parametrize("source", ["draft model", "chosen drafts"])
def test_sampled_tokens_follow_the_models_distribution(source):
    target, n, temp = Bigram(TARGET), 1500, 0.8
    config = DEFAULTS.updated(temp=temp, max_tokens=2)
    counts = np.zeros((4, 4))
    rng = np.random.default_rng(1)
    mx.random.seed(3)
    for _ in range(n):
        if source == "draft model":
            steps = speculative_generate_step([0], target, Bigram(DRAFT), config=config, num_draft_tokens=3)
        else:
            steps = speculative_generate_step([0], target, config=config, num_draft_tokens=3,
                                              drafts=Scripted(lambda seq, k: rng.integers(0, 4, k)))  # fmt: skip
        a, b = [t for t, _, _ in steps]
        counts[a, b] += 1
    assert chi2_ok(counts, exact_pairs(TARGET, 0, temp) * n), counts


def test_a_draft_equal_to_the_model_is_always_accepted_when_sampling():
    """The speculative-sampling rule accepts x with min(1, p(x)/q(x)) = 1 when q = p (the
    token-match rule would accept only about sum(p^2) of them)."""
    target, stats = Bigram(TARGET), {}
    mx.random.seed(5)
    steps = speculative_generate_step([0], target, Bigram(TARGET), config=DEFAULTS.updated(temp=1.0, max_tokens=40),
                                      num_draft_tokens=3, draft_stats=stats)  # fmt: skip
    assert len(list(steps)) == 40
    assert stats["drafted"] > 20 and stats["accepted"] == stats["drafted"]


# ----------------------------------------------------------------- refusals
@pytest.mark.parametrize("kind", ["ssm", "hybrid"])
def test_caches_that_cannot_take_drafts_back_are_refused_in_one_line(tiny_model_dirs, kind):
    from mlx_chatcache.models.loading import load

    model, tok = load(str(tiny_model_dirs[kind]))
    with pytest.raises(UsageError) as e:
        list(stream_generate(model, tok, TEXT, config=GREEDY.updated(max_tokens=3, prompt_lookup="prompt")))
    assert "ArraysCache" in str(e.value) and "\n" not in str(e.value)
    # the same call without drafts runs
    assert len(list(stream_generate(model, tok, TEXT, config=GREEDY.updated(max_tokens=3, prompt_lookup="prompt",
                                                                           num_draft_tokens=0)))) == 3


def test_a_grammar_gets_no_drafts_and_the_same_tokens(llama_model):
    model, tok = llama_model
    config = GREEDY.updated(max_tokens=12)
    plain_json = [r.token for r in stream_generate(model, tok, TEXT, config=config, json_schema={})]
    looked = [r for r in stream_generate(model, tok, TEXT, config=config.updated(prompt_lookup="prompt"),
                                         json_schema={})]  # fmt: skip
    assert [r.token for r in looked] == plain_json and not any(r.from_draft for r in looked)


def test_a_prompt_cache_without_the_draft_models_layers_is_refused(llama_model, make_tiny_model):
    model, tok = llama_model
    draft, _ = make_tiny_model("llama", seed=1)
    with pytest.raises(UsageError) as e:
        list(stream_generate(model, tok, TEXT, draft_model=draft, state=PromptCache.new(model), max_tokens=2))
    assert "make_prompt_cache(draft_model)" in str(e.value)
    with pytest.raises(UsageError):
        DraftPair(model, object())
    pair = DraftPair(model, draft)
    state = PromptCache.new(pair, CacheShape())
    assert len(state.cache) == 2 * len(model.layers)
