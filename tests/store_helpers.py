"""Shared by the store tier tests (memory, disk, Redis): token ids, a cache
filled with them, the settings the scopes use, a cache's arrays as numpy and
what a checkout hands out."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mlx_chatcache.config import CacheShape
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.files.tokens import common_prefix_len
from mlx_chatcache.generation.templates import feed_all
from mlx_chatcache.store.store import make_scope
from tiny_models import VOCAB_SIZE

SETTINGS = {"max_kv_size": None, "keep": 4}


def checked_out(store, sc, model, prompt):
    """What ``store.checkout`` hands out for ``prompt`` (the default shape): None on a
    miss, else its ``state`` (a PromptCache), ``cache``, ``tokens``, ``tier`` and
    ``served``: the prompt tokens (but the last) its tokens share, the prefix a hit gives."""
    state, tier = store.checkout(sc, model, prompt)
    assert isinstance(state, PromptCache) and len(state.cache) == len(PromptCache.new(model).cache)
    if tier is None:
        assert state.tokens == [], "a miss hands out an empty cache"
        return None
    served = min(common_prefix_len(state.tokens, prompt), len(prompt) - 1)
    return SimpleNamespace(state=state, cache=state.cache, tokens=state.tokens, tier=tier, served=served)



def tokens_of(n, start=3):
    """``n`` token ids from ``start``, all in the tiny models' vocabulary (ids past it are refused)."""
    return [(start + (i * 7) % 300) % VOCAB_SIZE for i in range(n)]


def filled_state(model, tokens, max_kv_size=None, keep=4):
    """A PromptCache holding ``tokens`` (fed from empty, no sampling)."""
    state = PromptCache.new(model, CacheShape(max_kv_size, keep))
    feed_all(model, state, tokens, 512)
    return state


def filled(model, tokens):
    """Cache layers holding ``tokens`` (fed from empty, no sampling)."""
    return filled_state(model, tokens).cache


def scope(model, settings=SETTINGS):
    return make_scope(model.fingerprint, settings)


def arrays(cache):
    return [np.array(a) for c in cache for a in c.flat_state()]


def synthetic(tokens, layers=2, heads=2, dim=4, dims=None):
    """``KVCache`` layers holding ``tokens`` whose K/V at position ``p`` are a function of
    ``(tokens[p], p)`` alone: caches sharing a prefix hold it bit for bit, whatever the BLAS
    (``dims``: each layer's head size, when they differ)."""
    import mlx.core as mx

    from mlx_chatcache.cache import KVCache

    n = len(tokens)
    base = mx.array([t * 1000.0 + p for p, t in enumerate(tokens)], dtype=mx.float32).reshape(1, 1, n, 1)
    out = []
    for i, d in enumerate(dims or [dim] * layers):
        grid = mx.arange(heads * d, dtype=mx.float32).reshape(1, heads, 1, d) / 64 + i
        k, v = base + grid, -(base + grid)
        out.append(KVCache.from_flat_state([k, v], (str(n),)))
    return out


def values_read(tokens: int, block: int) -> int:
    """How many values a checkout serving ``tokens`` tokens reads: its full blocks and a tail."""
    return -(-tokens // block)


def served(entries, query, block):
    """What the store serves of ``query`` (a prompt but its last token) from entries of
    block caches holding ``entries`` (token lists): the leading run of ``block``-token
    blocks some entry shares with it, then the longest entry that ends within the next
    block and that ``query`` starts with."""
    run = 0
    while any(len(e) >= (run + 1) * block and e[: (run + 1) * block] == query[: (run + 1) * block] for e in entries) \
            and (run + 1) * block <= len(query):  # fmt: skip
        run += 1
    r = run * block
    tails = [len(e) for e in entries if r < len(e) < r + block and len(e) <= len(query) and e == query[: len(e)]]
    return max(tails, default=r)
