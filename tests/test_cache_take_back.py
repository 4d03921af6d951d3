"""Property test of the cache classes' ``can_take_back(n)`` and ``always_trimmable()``.

Over random caches of every class (lists of them included) at random fill levels:
- they give the answers the generate loop, the chat checkpoints and the server
  worker computed for themselves before the predicates were methods (the old
  rules are written out below as the reference);
- they hold: ``can_take_back(n)`` True means feeding ``n`` tokens and trimming
  ``n`` gives back the same offset and content; ``always_trimmable()`` True means
  every shorter length is reached by ``trim``, and implies ``can_take_back``.
"""

from __future__ import annotations

import os

import mlx.core as mx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_chatcache.cache import (
    CACHE_CLASSES,
    ArraysCache,
    BaseCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    copy_prompt_cache,
)

EXAMPLES = int(os.environ.get("MLXCC_HYPOTHESIS_EXAMPLES", "40"))
H, D = 1, 64


# ------------------------------------------------------------ the old rules (reference)
def old_can_take_back(layer: BaseCache) -> bool:
    """The generate loop's rule: trimmable by one token after it is fed one more."""
    if not layer.is_trimmable():
        return False
    inner = getattr(layer, "caches", None)
    if inner is not None:
        return all(old_can_take_back(c) for c in inner)
    window = getattr(layer, "max_size", None)
    return window is None or layer.offset + 1 < window


def old_always_undoable(layer: BaseCache) -> bool:
    """The generate loop's once-per-call shortcut (a sufficient condition for the rule above)."""
    return layer.is_trimmable() and not hasattr(layer, "max_size") and not hasattr(layer, "caches")


def old_always_trimmable(c: BaseCache) -> bool:
    """The chat checkpoints' and the server worker's rule."""
    if isinstance(c, CacheList):
        return all(old_always_trimmable(x) for x in c.caches)
    return type(c) in (KVCache, QuantizedKVCache)


# ------------------------------------------------------------ random caches
DRAWN = (KVCache, QuantizedKVCache, ChunkedKVCache, RotatingKVCache, QuantizedRotatingKVCache, ArraysCache, CacheList)


def test_every_cache_class_is_drawn():
    assert set(CACHE_CLASSES.values()) == set(DRAWN)


def leaf(draw) -> BaseCache:
    kind = draw(st.sampled_from(["kv", "qkv", "chunked", "rot", "qrot", "arrays"]))
    if kind == "kv":
        return KVCache()
    if kind == "qkv":
        return QuantizedKVCache(group_size=64, bits=draw(st.sampled_from([4, 8])))
    if kind == "chunked":
        return ChunkedKVCache(draw(st.integers(1, 12)))
    if kind == "arrays":
        return ArraysCache(2)
    size = draw(st.integers(2, 12))
    keep = draw(st.integers(0, size - 1))
    if kind == "rot":
        return RotatingKVCache(size, keep)
    return QuantizedRotatingKVCache(size, keep, group_size=64, bits=8)


@st.composite
def layers(draw) -> BaseCache:
    if draw(st.booleans()):
        return leaf(draw)
    return CacheList(*(leaf(draw) for _ in range(draw(st.integers(0, 3)))))


def feed(c: BaseCache, n: int) -> None:
    """``n`` tokens into ``c`` the way a model does (one update of ``n``)."""
    if n == 0:
        return
    if isinstance(c, CacheList):
        for x in c.caches:
            feed(x, n)
        return
    if isinstance(c, ArraysCache):
        c[0] = mx.random.normal((1, 3, 4))
        c[1] = mx.random.normal((1, 2, 4))
        c.advance(n)
        return
    if isinstance(c, ChunkedKVCache):  # as llama4 does at the start of each call
        c.maybe_trim_front()
    keys, values = mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))
    c.update_and_fetch(keys, values)


def content(c: BaseCache) -> list:
    """What the model sees at its next call: offset, tokens held and the live arrays'
    values (an empty buffer counts as none; a chunked cache after the call drops what
    precedes its chunk)."""
    c = copy_prompt_cache([c])[0]
    for x in c.caches if isinstance(c, CacheList) else [c]:
        if isinstance(x, ChunkedKVCache):
            x.maybe_trim_front()
    return [c.offset, c.size(), [a.tolist() for a in c.flat_state() if a.size]]


# ------------------------------------------------------------ properties
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(layer=layers(), fills=st.lists(st.integers(0, 7), max_size=4), n=st.integers(1, 4))
def test_take_back_predicates_match_the_old_rules_and_hold(layer, fills, n):
    for f in fills:
        feed(layer, f)
    mx.eval(layer.eval_arrays())

    assert layer.can_take_back(1) == old_can_take_back(layer)
    assert layer.always_trimmable() == old_always_trimmable(layer)
    if old_always_undoable(layer):  # the loop's shortcut never said yes where the method says no
        assert layer.can_take_back(1)
    if layer.always_trimmable():
        assert layer.can_take_back(n)
        for k in range(layer.offset + 1):  # every shorter length is reached
            c = copy_prompt_cache([layer])[0]
            assert c.trim(k) == k and c.offset == layer.offset - k

    if layer.can_take_back(n):
        before = content(layer)
        c = copy_prompt_cache([layer])[0]
        feed(c, n)
        c.trim(n)
        assert content(c) == before
