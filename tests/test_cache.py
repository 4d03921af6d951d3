"""Unit tests of the per-layer caches on random arrays (no model).

Invariants checked (issue #2):

- ``type(c).from_state(c.state, c.meta_state)`` continues exactly like ``c``;
- ``state`` holds exactly the live tokens (``shape[2] == size()``, no padding,
  rotating caches in temporal order);
- ``trim(n)`` returns ``min(n, held)``; a rotating cache stops being trimmable
  once it dropped a token;
- ``to_quantized`` on ``KVCache`` and ``RotatingKVCache``;
- ``copy_prompt_cache`` is independent of later updates on either side;
- a bad ``meta_state`` raises ``CacheFormatError``;
- attention through a rotating cache (``make_mask`` + ``update_and_fetch``)
  equals a brute-force reference in which query ``p`` sees key ``k`` iff
  ``k <= p`` and (``k < keep`` or ``k > p - (max_size - keep)``); with a model
  window, iff ``k <= p``, ``k > p - window_size`` and the update returns ``k``
  (the window decides, and within a multi-token update may reach past the
  ring: issue 10, plamo3).
"""

from __future__ import annotations

import math
import zlib

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatcache.cache import (
    CACHE_CLASSES,
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    copy_prompt_cache,
)
from mlx_chatcache.errors import CacheFormatError, UnsupportedCacheError

B, HQ, HKV, D = 1, 4, 2, 64
SCALE = 1.0 / math.sqrt(D)
ATOL = 1e-5
# alternating multi-token / single-token updates, going well past small windows
STEPS = [5, 1, 1, 7, 1, 12, 1, 20, 1, 3, 1, 1, 2, 9, 1, 1, 30, 1, 4, 1]


# ----------------------------------------------------------------- helpers
def rand(rng: np.random.Generator, *shape) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def quant_params(c):
    return getattr(c, "group_size", None), getattr(c, "bits", None)


def is_quantized(c) -> bool:
    return isinstance(c, (QuantizedKVCache, QuantizedRotatingKVCache))


def dequant(x, c):
    """Float keys/values from what a cache returned (tuple when quantized)."""
    if isinstance(x, tuple):
        gs, bits = quant_params(c)
        return mx.dequantize(*x, group_size=gs, bits=bits)
    return x


def qdq(x: mx.array, c) -> mx.array:
    """What a quantized cache ``c`` turns float keys ``x`` into (identity if float)."""
    if not is_quantized(c):
        return x
    gs, bits = quant_params(c)
    return mx.dequantize(*mx.quantize(x, group_size=gs, bits=bits), group_size=gs, bits=bits)


def window_of(c):
    """(keep, ring) of the cache's attention span; ring None = unbounded."""
    if isinstance(c, RotatingKVCache):
        return c.keep, c.max_size - c.keep
    return 0, None


def returned_by_update(offset, N, keep, ring) -> np.ndarray:
    """Which positions ``0..offset+N-1`` an update of ``N`` tokens returns (a
    window cache: the pinned prefix, then the last ``ring`` held or, for several
    tokens past the window, the last ``ring - 1`` held and all new ones)."""
    k = np.arange(offset + N)
    if ring is None or offset + N <= keep + ring:
        return np.ones(offset + N, dtype=bool)
    recent = ring if N == 1 else ring - 1 + N
    return (k < min(keep, offset)) | (k >= offset + N - recent)


def reference_attention(q, K, V, offset, keep, ring, window):
    """Brute force, float64: q (B,HQ,N,D) at positions offset.., K/V all positions."""
    q, K, V = (np.array(a, dtype=np.float64) for a in (q, K, V))
    N, T = q.shape[2], K.shape[2]
    rep = q.shape[1] // K.shape[1]
    K, V = np.repeat(K, rep, axis=1), np.repeat(V, rep, axis=1)
    p = np.arange(offset, offset + N)[:, None]
    k = np.arange(T)[None]
    allowed = k <= p
    if window is not None:  # the model's window decides, among the keys returned
        allowed &= (k > p - window) & returned_by_update(offset, N, keep, ring)[None]
    elif ring is not None:
        allowed &= (k < keep) | (k > p - ring)
    assert allowed.any(axis=1).all()
    s = np.einsum("bhqd,bhkd->bhqk", q, K) * SCALE
    s = np.where(allowed, s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", s, V)


def cached_attention(c, q, k, v, window=None):
    """One attention step through cache ``c`` the way mlx-lm models do it."""
    N = q.shape[2]
    mask = c.make_mask(N, window_size=window) if window is not None else c.make_mask(N)
    K, V = c.update_and_fetch(k, v)
    K, V = dequant(K, c), dequant(V, c)
    out = mx.fast.scaled_dot_product_attention(q, K, V, scale=SCALE, mask=mask)
    return np.array(out)


def live_positions(c) -> np.ndarray:
    """Absolute positions a cache must hold, in temporal order."""
    if isinstance(c, RotatingKVCache) and c.offset > c.max_size:
        R = c.max_size - c.keep
        return np.concatenate([np.arange(c.keep), np.arange(c.offset - R, c.offset)])
    start = getattr(c, "start_position", 0)
    return np.arange(start, c.offset)


def assert_state_is_live(c, K_all, V_all):
    """``state`` holds exactly the live tokens, temporal order, no padding."""
    pos = live_positions(c)
    st = c.state
    assert c.size() == len(pos)
    for a in c.flat_state():
        assert a.shape[2] == c.size()
    if not st:  # never fed
        assert c.size() == 0 and c.empty()
        return
    if is_quantized(c):  # mlx-lm's nesting: [(keys, scales, biases), (values, scales, biases)]
        gs, bits = quant_params(c)
        Kq = mx.quantize(K_all[:, :, mx.array(pos)], group_size=gs, bits=bits)
        Vq = mx.quantize(V_all[:, :, mx.array(pos)], group_size=gs, bits=bits)
        assert len(st) == 2 and all(isinstance(x, tuple) and len(x) == 3 for x in st)
        for got, want in zip(st, (Kq, Vq)):
            assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))
    else:
        assert len(st) == 2
        assert mx.array_equal(st[0], K_all[:, :, mx.array(pos)]).item()
        assert mx.array_equal(st[1], V_all[:, :, mx.array(pos)]).item()


def restore(c):
    return type(c).from_state(c.state, c.meta_state)


# ------------------------------------------------- rotating / KV reference
ROTATING_SHAPES = [(8, 0), (8, 3), (16, 4), (5, 4), (1, 0), (24, 0), (64, 4)]


def _factories():
    out = [pytest.param(lambda: KVCache(), id="kv"),
           pytest.param(lambda: QuantizedKVCache(group_size=32, bits=8), id="qkv8")]
    for m, k in ROTATING_SHAPES:
        out.append(pytest.param(lambda m=m, k=k: RotatingKVCache(m, k), id=f"rot{m}k{k}"))
    for m, k, bits in [(8, 3, 4), (16, 0, 8)]:
        out.append(pytest.param(
            lambda m=m, k=k, b=bits: QuantizedRotatingKVCache(m, k, group_size=64, bits=b),
            id=f"qrot{m}k{k}b{bits}"))
    return out


@pytest.mark.parametrize("make", _factories())
@pytest.mark.parametrize("window", [None, 3, 11])
@pytest.mark.parametrize("mode", ["plain", "restore_each", "restore_odd"])
def test_attention_matches_bruteforce_reference(make, window, mode):
    rng = np.random.default_rng(zlib.crc32(f"{window}-{mode}".encode()))  # stable across runs
    c = make()
    K_all = mx.zeros((B, HKV, 0, D))
    V_all = mx.zeros((B, HKV, 0, D))
    for i, N in enumerate(STEPS):
        q, k, v = rand(rng, B, HQ, N, D), rand(rng, B, HKV, N, D), rand(rng, B, HKV, N, D)
        offset = c.offset
        K_all = mx.concatenate([K_all, k], axis=2)
        V_all = mx.concatenate([V_all, v], axis=2)
        got = cached_attention(c, q, k, v, window)
        keep, ring = window_of(c)
        want = reference_attention(q, qdq(K_all, c), qdq(V_all, c), offset, keep, ring, window)
        err = np.abs(got - want).max()
        assert err <= ATOL, f"step {i} (N={N}, offset={offset}): max error {err}"
        assert c.offset == offset + N
        assert_state_is_live(c, K_all, V_all)
        if mode == "restore_each" or (mode == "restore_odd" and i % 2):
            c = restore(c)
            assert_state_is_live(c, K_all, V_all)


@pytest.mark.parametrize("m,keep", [(8, 0), (8, 3), (16, 4)])
@pytest.mark.parametrize("at_step", [0, 3, 7])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rotating", [False, True])
def test_to_quantized_continues_like_quantized_reference(m, keep, at_step, bits, rotating):
    """KVCache / RotatingKVCache -> to_quantized mid-stream; afterwards attention
    equals the reference over quantize-dequantized keys of the whole history."""
    rng = np.random.default_rng(at_step * 10 + bits)
    c = RotatingKVCache(m, keep) if rotating else KVCache()
    K_all = mx.zeros((B, HKV, 0, D))
    V_all = mx.zeros((B, HKV, 0, D))
    for i, N in enumerate(STEPS[:12]):
        if i == at_step:
            before = c
            c = c.to_quantized(group_size=32, bits=bits)
            assert type(c) is (QuantizedRotatingKVCache if rotating else QuantizedKVCache)
            assert (c.group_size, c.bits) == (32, bits)
            assert c.offset == before.offset and c.size() == before.size()
            if rotating:
                assert (c.max_size, c.keep) == (m, keep)
            assert_state_is_live(c, K_all, V_all)
        q, k, v = rand(rng, B, HQ, N, D), rand(rng, B, HKV, N, D), rand(rng, B, HKV, N, D)
        offset = c.offset
        K_all = mx.concatenate([K_all, k], axis=2)
        V_all = mx.concatenate([V_all, v], axis=2)
        got = cached_attention(c, q, k, v)
        keep_, ring = window_of(c)
        want = reference_attention(q, qdq(K_all, c), qdq(V_all, c), offset, keep_, ring, None)
        assert np.abs(got - want).max() <= ATOL
        assert_state_is_live(c, K_all, V_all)


def test_to_quantized_of_empty_and_of_quantized():
    for c in (KVCache(), RotatingKVCache(8, 2)):
        q = c.to_quantized()
        assert q.empty() and q.offset == 0 and q.state == []
    # as on mlx-lm's classes, which its generate loop relies on (it quantizes
    # every layer that has the method): quantized and chunked caches have none
    for c in (QuantizedKVCache(), QuantizedRotatingKVCache(8, 2), ChunkedKVCache(8)):
        assert not hasattr(c, "to_quantized")
        with pytest.raises(AttributeError, match="has no to_quantized"):
            c.to_quantized()


# ------------------------------------------------- from_state continuation
def _stepper_kv(c, rng, N):
    """Returns (outputs, exact): what the layer would see after one update."""
    if isinstance(c, ChunkedKVCache):
        c.maybe_trim_front()
    k, v = rand(rng, B, HKV, N, D), rand(rng, B, HKV, N, D)
    if isinstance(c, RotatingKVCache):
        # buffer order may differ after a restore: compare attention, not buffers
        q = rand(rng, B, HQ, N, D)
        return [cached_attention(c, q, k, v)], False
    K, V = c.update_and_fetch(k, v)
    flat = [np.array(a) for x in (K, V) for a in (x if isinstance(x, tuple) else (x,))]
    return flat, True


def _stepper_arrays(c, rng, N):
    """A toy recurrent layer: conv tail in slot 0, running state in slot 1."""
    x = rand(rng, B, N, 8)
    tail = mx.zeros((B, 2, 8)) if c[0] is None else c[0]
    c[0] = mx.concatenate([tail, x], axis=1)[:, -2:]
    s = mx.zeros((B, 8)) if c[1] is None else c[1]
    c[1] = 0.5 * s + x.sum(axis=1)
    c.advance(N)
    return [np.array(c[0]), np.array(c[1])], True


def step(c, rng, N):
    if isinstance(c, CacheList):
        outs, exact = [], True
        for child in c.caches:
            o, e = step(child, rng, N)
            outs += o
            exact &= e
        return outs, exact
    if isinstance(c, ArraysCache):
        return _stepper_arrays(c, rng, N)
    return _stepper_kv(c, rng, N)


ALL_KINDS = {
    "kv": lambda: KVCache(),
    "qkv": lambda: QuantizedKVCache(group_size=64, bits=4),
    "rot0": lambda: RotatingKVCache(8, 0),
    "rot3": lambda: RotatingKVCache(8, 3),
    "qrot": lambda: QuantizedRotatingKVCache(12, 2, group_size=32, bits=8),
    "chunked": lambda: ChunkedKVCache(10),
    "arrays": lambda: ArraysCache(2),
    "list_arrays_kv": lambda: CacheList(ArraysCache(2), KVCache()),
    "list_kv_rot": lambda: CacheList(KVCache(), RotatingKVCache(6, 2)),
    "list_q_chunked": lambda: CacheList(QuantizedKVCache(), ChunkedKVCache(8)),
}


def _compare(a, b, exact):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        if exact:
            assert np.array_equal(x, y)
        else:
            assert np.abs(x - y).max() <= ATOL


@pytest.mark.parametrize("kind", sorted(ALL_KINDS))
@pytest.mark.parametrize("split", [0, 1, 4, 7, 12])
def test_from_state_continues_identically(kind, split):
    """Restore after ``split`` updates; both copies then see the same updates."""
    seed = 1234 + split
    c = ALL_KINDS[kind]()
    rng = np.random.default_rng(seed)
    steps = STEPS[:14]
    for N in steps[:split]:
        step(c, rng, N)
    r = restore(c)
    assert type(r) is type(c)
    assert r.meta_state == c.meta_state
    assert r.offset == c.offset and r.size() == c.size()
    assert r.is_trimmable() == c.is_trimmable()
    assert len(r.flat_state()) == len(c.flat_state())
    for x, y in zip(r.flat_state(), c.flat_state()):
        assert x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()
    for N in steps[split:]:
        s1 = np.random.default_rng(seed * 7 + N)
        s2 = np.random.default_rng(seed * 7 + N)
        o1, exact = step(c, s1, N)
        o2, _ = step(r, s2, N)
        _compare(o1, o2, exact)
        assert r.offset == c.offset and r.meta_state[:1] == c.meta_state[:1]


def test_arrays_cache_with_empty_slot_round_trips():
    c = ArraysCache(3)
    c[1] = mx.arange(6).reshape(1, 2, 3)
    c.advance(4)
    r = restore(c)
    assert r[0] is None and r[2] is None
    assert mx.array_equal(r[1], c[1]).item()
    assert r.offset == 4 and r.size() == 4 and r.meta_state == ("4", "010")
    e = restore(ArraysCache(2))
    assert e.empty() and e.state == [] and len(e.cache) == 2


def test_empty_caches_round_trip():
    for make in ALL_KINDS.values():
        c = make()
        r = restore(c)
        assert r.empty() and r.offset == 0 and r.size() == 0 and r.state == []


# ------------------------------------------------- trim semantics
KV_TRIMMABLE = {
    "kv": lambda: KVCache(),
    "qkv": lambda: QuantizedKVCache(group_size=32, bits=8),
    "rot": lambda: RotatingKVCache(40, 4),
    "qrot": lambda: QuantizedRotatingKVCache(40, 0, group_size=64, bits=4),
    "chunked": lambda: ChunkedKVCache(100),
}


@pytest.mark.parametrize("kind", sorted(KV_TRIMMABLE))
@pytest.mark.parametrize("restored", [False, True])
def test_trim_returns_min_n_held_and_continues_like_fresh(kind, restored):
    rng = np.random.default_rng(5)
    c = KV_TRIMMABLE[kind]()
    K_all, V_all = rand(rng, B, HKV, 20, D), rand(rng, B, HKV, 20, D)
    c.update_and_fetch(K_all[:, :, :13], V_all[:, :, :13])
    c.update_and_fetch(K_all[:, :, 13:14], V_all[:, :, 13:14])
    if restored:
        c = restore(c)
    assert c.is_trimmable()
    assert c.trim(0) == 0 and c.offset == 14
    assert c.trim(3) == 3
    assert c.offset == 11 and c.size() == 11
    assert_state_is_live(c, K_all, V_all)
    assert c.trim(100) == 11
    assert c.offset == 0 and c.size() == 0
    assert c.trim(1) == 0
    # refill past the trimmed point: same as a fresh cache fed the same tokens
    fresh = KV_TRIMMABLE[kind]()
    for cc in (c, fresh):
        cc.update_and_fetch(K_all[:, :, :9], V_all[:, :, :9])
    assert c.trim(2) == 2 and fresh.trim(2) == 2
    for cc in (c, fresh):
        cc.update_and_fetch(K_all[:, :, 7:8], V_all[:, :, 7:8])
        cc.update_and_fetch(K_all[:, :, 8:20], V_all[:, :, 8:20])
    assert_state_is_live(c, K_all, V_all)
    for x, y in zip(c.flat_state(), fresh.flat_state()):
        assert mx.array_equal(x, y).item()


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("how", ["single", "multi", "restored"])
def test_rotating_not_trimmable_once_a_token_dropped(quantized, how):
    rng = np.random.default_rng(9)
    m, keep = 8, 2
    c = QuantizedRotatingKVCache(m, keep, 32, 8) if quantized else RotatingKVCache(m, keep)
    k = rand(rng, B, HKV, 12, D)
    c.update_and_fetch(k[:, :, :6], k[:, :, :6])
    c.update_and_fetch(k[:, :, 6:7], k[:, :, 6:7])
    c.update_and_fetch(k[:, :, 7:8], k[:, :, 7:8])
    assert c.offset == m and c.is_trimmable()  # full, nothing dropped yet
    assert c.trim(1) == 1 and c.offset == m - 1
    c.update_and_fetch(k[:, :, 7:8], k[:, :, 7:8])
    if how == "single":
        c.update_and_fetch(k[:, :, 8:9], k[:, :, 8:9])
    else:
        c.update_and_fetch(k[:, :, 8:11], k[:, :, 8:11])
    if how == "restored":
        c = restore(c)
    assert c.offset > m
    assert not c.is_trimmable()
    before = (c.offset, [np.array(a) for a in c.flat_state()])
    assert c.trim(1) == 0 and c.trim(100) == 0
    assert c.offset == before[0]
    for a, b in zip(c.flat_state(), before[1]):
        assert np.array_equal(np.array(a), b)


def test_chunked_trim_after_front_trim():
    rng = np.random.default_rng(2)
    c = ChunkedKVCache(6)
    K = rand(rng, B, HKV, 15, D)
    c.update_and_fetch(K[:, :, :10], K[:, :, :10])
    c.maybe_trim_front()
    assert c.start_position == 4 and c.size() == 6 and c.offset == 10
    assert_state_is_live(c, K, K)
    assert c.trim(2) == 2 and c.offset == 8 and c.size() == 4
    assert c.trim(50) == 4 and c.offset == 4 and c.size() == 0
    r = restore(c)
    assert (r.offset, r.start_position, r.size()) == (4, 4, 0)


def test_non_trimmable_and_list_trim():
    a = ArraysCache(2)
    a[0] = mx.zeros((1, 2, 3))
    a.advance(5)
    assert not a.is_trimmable() and a.trim(3) == 0 and a.offset == 5

    rng = np.random.default_rng(0)
    k = rand(rng, B, HKV, 5, D)
    mixed = CacheList(ArraysCache(1), KVCache())
    mixed[0][0] = mx.zeros((1, 2))
    mixed[1].update_and_fetch(k, k)
    assert not mixed.is_trimmable() and mixed.trim(2) == 0 and mixed[1].offset == 5

    both = CacheList(KVCache(), RotatingKVCache(16, 2))
    for child in both.caches:
        child.update_and_fetch(k, k)
    assert both.is_trimmable() and both.trim(2) == 2
    assert [x.offset for x in both.caches] == [3, 3]
    assert both.trim(9) == 3 and both.size() == 0


# ------------------------------------------------- copy_prompt_cache
def _snapshot(cache):
    return [(c.meta_state, [np.array(a) for a in c.flat_state()]) for c in cache]


def _assert_snapshot(cache, snap):
    assert len(cache) == len(snap)
    for c, (meta, arrays) in zip(cache, snap):
        assert c.meta_state == meta
        st = c.flat_state()
        assert len(st) == len(arrays)
        for a, b in zip(st, arrays):
            assert np.array_equal(np.array(a), b)


def _prompt_cache():
    return [make() for make in ALL_KINDS.values()]


@pytest.mark.parametrize("prefill", [3, 10, 256, 300])
def test_copy_prompt_cache_is_independent(prefill):
    """Later updates (incl. trim + in-place refill and ring overwrites) to the
    original must not leak into the copy, nor the other way round."""
    rng = np.random.default_rng(prefill)
    orig = _prompt_cache()
    for c in orig:
        step(c, rng, prefill)
    copy = copy_prompt_cache(orig)
    snap = _snapshot(copy)
    # original moves on: trim what can be trimmed, then more tokens (in place)
    for c in orig:
        if c.is_trimmable():
            c.trim(2)
        step(c, rng, 1)
        step(c, rng, 1)
    _assert_snapshot(copy, snap)
    # and the other way round
    orig_snap = _snapshot(orig)
    for c in copy:
        if c.is_trimmable():
            c.trim(1)
        step(c, rng, 1)
        step(c, rng, 3)
    _assert_snapshot(orig, orig_snap)


@pytest.mark.parametrize("kind", ["kv", "qkv", "chunked"])
def test_restored_cache_is_independent_of_its_source(kind):
    """from_state twice in a row, then trim + refill one of them in place."""
    rng = np.random.default_rng(3)
    a = ALL_KINDS[kind]()
    step(a, rng, 7)
    b = restore(a)
    c = restore(b)
    snap = _snapshot([c])
    b.trim(2)
    step(b, rng, 1)
    _assert_snapshot([c], snap)
    snap_b = _snapshot([b])
    c.trim(3)
    step(c, rng, 2)
    _assert_snapshot([b], snap_b)


# ------------------------------------------------- bad meta_state
GOOD = mx.zeros((1, 2, 3, 64))

BAD_META = [
    (KVCache, ("abc",)),
    (KVCache, ("-1",)),
    (KVCache, ("1.5",)),
    (KVCache, (" 3",)),
    (KVCache, ("²",)),  # str.isdigit() is True, int() fails
    (KVCache, (3,)),
    (KVCache, ()),
    (KVCache, ("3", "4")),
    (KVCache, ("9" * 40,)),
    (QuantizedKVCache, ("0", "64")),
    (QuantizedKVCache, ("0", "64", "7")),
    (QuantizedKVCache, ("0", "48", "8")),
    (QuantizedKVCache, ("0", "64", "eight")),
    (RotatingKVCache, ("0", "8")),
    (RotatingKVCache, ("0", "8", "2", "1")),
    (RotatingKVCache, ("0", "8", "8")),
    (RotatingKVCache, ("0", "8", "9")),
    (RotatingKVCache, ("0", "0", "0")),
    (RotatingKVCache, ("0", "x", "1")),
    (RotatingKVCache, ("0", "8", "-1")),
    (RotatingKVCache, ("20", "8", "2", "8")),  # ring_idx == max_size
    (RotatingKVCache, ("20", "8", "2", "1")),  # ring_idx < keep
    (RotatingKVCache, ("5", "8", "2", "4")),  # ring_idx set before the window wrapped
    (RotatingKVCache, ("20", "8", "2", "3", "4")),
    (RotatingKVCache, ("20", "8", "2", "x")),
    (QuantizedRotatingKVCache, ("0", "8", "2")),
    (QuantizedRotatingKVCache, ("0", "8", "2", "64")),
    (QuantizedRotatingKVCache, ("0", "8", "8", "64", "8")),
    (QuantizedRotatingKVCache, ("0", "8", "2", "64", "1")),
    (QuantizedRotatingKVCache, ("0", "8", "2", "sixty", "8")),
    (QuantizedRotatingKVCache, ("20", "8", "2", "64", "8", "8")),
    (QuantizedRotatingKVCache, ("5", "8", "2", "64", "8", "3")),
    (QuantizedRotatingKVCache, ("20", "8", "2", "64", "8", "3", "1")),
    (QuantizedRotatingKVCache, ("20", "8", "2", "3")),  # ring_idx where group_size goes
    (ChunkedKVCache, ("0", "0", "0")),
    (ChunkedKVCache, ("1", "4", "2")),
    (ChunkedKVCache, ("a", "4", "0")),
    (ChunkedKVCache, ("0", "4")),
    (ArraysCache, ("0",)),
    (ArraysCache, ("x", "11")),
    (ArraysCache, ("0", "12")),
    (ArraysCache, ("0", "1" * 65)),
    (ArraysCache, ("0", "11", "2")),
    (CacheList, ()),
    (CacheList, ("x",)),
    (CacheList, ("2", "KVCache", '["0"]', "0")),
    (CacheList, ("1", "KVCache", "not json", "0")),
    (CacheList, ("1", "KVCache", '{"a": 1}', "0")),
    (CacheList, ("1", "KVCache", "[0]", "0")),
    (CacheList, ("1", "KVCache", '["0"]', "two")),
    (CacheList, ("1", "KVCache", '["zero"]', "0")),
    (CacheList, ("1", "RotatingKVCache", '["0", "4", "4"]', "0")),
]


@pytest.mark.parametrize("cls,meta", BAD_META, ids=lambda x: repr(x) if isinstance(x, tuple) else x.__name__)
def test_bad_meta_state_raises_cache_format_error(cls, meta):
    with pytest.raises(CacheFormatError):
        cls.from_state([], meta)


BAD_STATE = [
    (KVCache, [GOOD], ("3",)),  # one array missing
    (KVCache, [GOOD, GOOD], ("4",)),  # 3 tokens held, offset says 4
    (KVCache, [GOOD, mx.zeros((1, 2, 4, 64))], ("3",)),
    (KVCache, [GOOD[0], GOOD[0]], ("3",)),  # not 4-d
    (KVCache, [], ("3",)),  # tokens but no arrays
    (KVCache, [GOOD, "x"], ("3",)),
    (RotatingKVCache, [GOOD, GOOD], ("20", "8", "2")),  # wrapped: must hold 8
    (QuantizedKVCache, [GOOD, GOOD], ("3", "64", "8")),  # needs 6 arrays
    (ChunkedKVCache, [GOOD, GOOD], ("10", "8", "2")),  # holds 8, not 3
    (ArraysCache, [GOOD], ("1", "11")),
    (ArraysCache, [GOOD, GOOD], ("1", "01")),
    (CacheList, [GOOD], ("1", "KVCache", '["3"]', "2")),
    (CacheList, [GOOD, GOOD], ("1", "KVCache", '["3"]', "1")),
]


@pytest.mark.parametrize("cls,state,meta", BAD_STATE)
def test_bad_state_raises_cache_format_error(cls, state, meta):
    with pytest.raises(CacheFormatError):
        cls.from_state(state, meta)


def test_cache_list_with_unknown_child_class_is_refused():
    for name in ("os.system", "__class__", "BatchKVCache", "LayerCache"):
        with pytest.raises(UnsupportedCacheError):
            CacheList.from_state([], ("1", name, "[]", "0"))


def test_registry_names_match_classes():
    for name, cls in CACHE_CLASSES.items():
        assert cls.__name__ == name


@pytest.mark.parametrize("kind", sorted(ALL_KINDS))
def test_state_is_a_snapshot(kind):
    """A list returned by ``state`` is not changed by later (in-place) updates."""
    rng = np.random.default_rng(11)
    c = ALL_KINDS[kind]()
    step(c, rng, 256)  # exactly one growth step: the buffer is full
    st = c.flat_state()
    before = [np.array(a) for a in st]
    for _ in range(3):
        if c.is_trimmable():
            c.trim(2)
        step(c, rng, 1)
    for a, b in zip(st, before):
        assert np.array_equal(np.array(a), b)
