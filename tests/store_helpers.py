"""Shared by the store tier tests (memory, disk, Redis): token ids, a cache
filled with them, the settings the scopes use, and a cache's arrays as numpy."""

from __future__ import annotations

import numpy as np

from mlx_chatcache.config import CacheShape
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.templates import feed_all
from mlx_chatcache.store.tiers import make_scope
from tiny_models import VOCAB_SIZE

SETTINGS = {"max_kv_size": None, "keep": 4}




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
    return [np.array(a) for c in cache for a in c.state]
