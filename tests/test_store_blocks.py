"""The memory tier's shared blocks: a block tier serves exactly what a
whole-entry tier serves, counts each block once and frees it with its last entry."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loop_helpers import forward
from store_helpers import checked_out, scope, tokens_of

from mlx_chatcache.cache import KVCache, QuantizedKVCache, RotatingKVCache, copy_prompt_cache
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.prompt import reuse_prefix
from mlx_chatcache.models.fingerprint import ModelFingerprint
from mlx_chatcache.store.blocks import assemble, split, splittable
from mlx_chatcache.store.chain import Chain
from mlx_chatcache.store.index import Entry, EntryIndex
from mlx_chatcache.store.store import PromptStore
from mlx_chatcache.store.tiers import MemoryTier, make_scope

SCOPE = make_scope(ModelFingerprint("blocks-test", "0" * 16, "0" * 16), {"max_kv_size": None, "keep": None})
LAYERS, HEADS, DIM = 2, 2, 32


def kv_of(tokens) -> list[np.ndarray]:
    """Per layer (keys, values): the K/V at position p depend only on tokens[:p+1],
    as a model's do, so conversations sharing a prefix share those values."""
    rows = []
    for p in range(len(tokens)):
        seed = int.from_bytes(hashlib.sha256(repr(tuple(tokens[: p + 1])).encode()).digest()[:4], "little")
        rows.append(np.random.default_rng(seed).standard_normal((LAYERS * 2, HEADS, DIM)).astype(np.float32))
    return np.stack(rows, axis=2) if rows else np.zeros((LAYERS * 2, HEADS, 0, DIM), np.float32)


def cache_of(tokens):
    kv = kv_of(tokens)
    return [KVCache.from_flat_state([mx.array(kv[2 * i][None]), mx.array(kv[2 * i + 1][None])], (str(len(tokens)),))
            for i in range(LAYERS)]  # fmt: skip


def arrays(cache):
    return [np.array(a) for c in cache for a in c.flat_state()]


def arrays_mx(cache):
    return [a for c in cache for a in c.flat_state()]


def held_bytes(tier: MemoryTier) -> int:
    """What the tier really holds: each block value once plus every entry's own part."""
    blocks = sum(a.nbytes for v in tier._values.values() for a in v)
    return blocks + sum(e.nbytes for e in tier.index.entries())


# ---------------------------------------------------------------- the index
def test_index_counts_a_shared_block_once_and_frees_it_with_its_last_entry():
    idx = EntryIndex(1000)
    a = Entry("ns", (1, 2, 3), 10, True, blocks=(("b1", 100), ("b2", 100)))
    b = Entry("ns", (1, 2, 4), 20, True, blocks=(("b1", 100), ("b3", 100)))
    idx.add(a, [])
    idx.add(b, [])
    assert idx.nbytes == 10 + 20 + 300
    assert idx.remove(a) == ["b2"] and idx.has_block("b1") and idx.nbytes == 20 + 200
    assert sorted(idx.remove(b)) == ["b1", "b3"] and idx.nbytes == 0


def test_plan_counts_what_evicting_really_frees():
    idx = EntryIndex(400)
    a = Entry("ns", (1,), 10, True, blocks=(("s", 200),))
    b = Entry("ns", (2,), 10, True, blocks=(("s", 200),))
    idx.add(a, [])
    idx.add(b, [])
    assert idx.nbytes == 220
    # 200 more bytes (need 20): evicting a frees only its 10 own bytes (b still holds "s"),
    # then b would free 210, past the 200 the entry adds: refused
    assert idx.plan(200, False) is None
    # a new entry holding "s" too adds only its own bytes
    assert idx.plan(150, False, blocks=(("s", 200),)) == []
    # 250 more bytes (need 70): a and b both go, the second freeing "s" (220 <= 250)
    assert idx.plan(250, False) == [a, b]
    # whole size past the budget: refused even though its blocks are stored
    assert idx.plan(250, False, blocks=(("s", 200),)) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3), min_size=1, max_size=4), st.integers(0, 50)),
                max_size=25))  # fmt: skip
def test_index_bytes_are_unique_blocks_plus_own_parts(ops):
    idx = EntryIndex(10_000)
    live = {}
    for add, path, own in ops:
        tokens = tuple(path)
        blocks = tuple((repr(tokens[: i + 1]), 30) for i in range(len(tokens)))
        if add:
            if idx.get("ns", tokens) is None:
                e = Entry("ns", tokens, own, True, blocks=blocks)
                victims = idx.plan(e.nbytes, False, blocks=e.blocks)
                if victims is not None:
                    before = idx.nbytes
                    for v in victims:
                        idx.remove(v)
                        live.pop(v.tokens)
                    assert before - idx.nbytes <= e.nbytes + sum(n for b, n in e.blocks if not idx.has_block(b))
                    idx.add(e, [])
                    live[tokens] = e
        elif tokens in live:
            idx.remove(live.pop(tokens))
        unique = {b: n for e in live.values() for b, n in e.blocks}
        assert idx.nbytes == sum(e.nbytes for e in live.values()) + sum(unique.values()) <= idx.budget


# ---------------------------------------------------------------- split and assemble
@pytest.mark.parametrize("n", [1, 31, 32, 33, 100])
def test_split_then_assemble_is_bit_identical(n):
    tokens = list(range(5, 5 + n))
    cache = cache_of(tokens)
    assert splittable(cache, n)
    chain = Chain("ns", tokens, 32)
    values, blocked = split(cache, chain, lambda h: False)
    assert len(values) == n // 32 and blocked.tail[0].shape[2] == n % 32
    got = assemble(blocked, [values[h] for h in chain.hashes])
    assert [c.meta_state for c in got] == [c.meta_state for c in cache]
    for x, y in zip(arrays(got), arrays(cache)):
        np.testing.assert_array_equal(x, y)
    # it carries the room it grows into, and continues like the cache it came from
    assert all(c.keys.shape[2] == KVCache.grown_slots(n) for c in got)
    one = mx.ones((1, HEADS, 1, DIM))
    for a, b in zip(got, copy_prompt_cache(cache)):
        fed, want = a.update_and_fetch(one, one)[0], b.update_and_fetch(one, one)[0]
        np.testing.assert_array_equal(np.array(fed), np.array(want))


def test_quantized_layers_split_and_assemble_exactly():
    tokens = list(range(70))
    q = [c.to_quantized(group_size=32, bits=4) for c in cache_of(tokens)]
    assert all(type(c) is QuantizedKVCache for c in q) and splittable(q, 70)
    chain = Chain("ns", tokens, 32)
    values, blocked = split(q, chain, lambda h: False)
    got = assemble(blocked, [values[h] for h in chain.hashes])
    assert all(type(c) is QuantizedKVCache for c in got)
    for x, y in zip(arrays(got), arrays(q)):
        np.testing.assert_array_equal(x, y)


def test_a_rotating_layer_keeps_the_entry_whole():
    rot = RotatingKVCache(max_size=64, keep=4)
    rot.update_and_fetch(mx.zeros((1, HEADS, 10, DIM)), mx.zeros((1, HEADS, 10, DIM)))
    cache = cache_of(list(range(10)))[:1] + [rot]
    assert not splittable(cache, 10)
    tier = MemoryTier(1 << 30, block_tokens=4)
    assert tier.add(SCOPE, list(range(10)), cache, None)
    assert tier.stats()["blocks"] == 0 and tier.index.nbytes == sum(a.nbytes for a in arrays_mx(cache))


# ---------------------------------------------------------------- the tier
def test_fifty_conversations_sharing_a_prompt_store_it_once():
    shared = list(range(1, 1001))
    tier = MemoryTier(1 << 40)  # the default block size
    per_token = LAYERS * 2 * HEADS * DIM * 4
    for i in range(50):
        tokens = shared + [2000 + 200 * i + j for j in range(200)]
        assert tier.add(SCOPE, tokens, cache_of(tokens), None)
    unique = (1000 + 50 * 200) * per_token
    assert tier.index.nbytes == held_bytes(tier)
    assert tier.index.nbytes <= 1.25 * unique, tier.index.nbytes / unique


def test_eviction_frees_blocks_only_with_their_last_entry():
    base = list(range(1, 65))
    a, b = base + [100, 101], base + [200, 201]
    one = sum(x.nbytes for x in arrays(cache_of(a)))  # 66 tokens
    tier = MemoryTier(int(one * 1.6), block_tokens=32)
    assert tier.add(SCOPE, a, cache_of(a), None) and tier.add(SCOPE, b, cache_of(b), None)
    assert tier.stats()["blocks"] == 2 and tier.index.nbytes == held_bytes(tier) < one * 1.1
    c = list(range(500, 570))  # shares nothing: a (least recently used) cannot free enough alone
    assert tier.add(SCOPE, c, cache_of(c), None)
    assert tier.index.get(SCOPE.namespace, tuple(c)) is not None
    assert tier.index.nbytes == held_bytes(tier) <= tier.index.budget
    assert tier.counters["evicted"] == 2 and tier.stats()["blocks"] == 2  # c's two blocks only


prompts = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 90), st.integers(0, 40)), min_size=1, max_size=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts)
def test_a_block_tier_serves_exactly_what_a_whole_entry_tier_serves(requests):
    """Each request: a base (one of 4 shared prompts), a cut into it, fresh tokens;
    it is checked out, then its tokens are put (as a server does after replying)."""
    bases = [[(7 * k + 13 * i) % 500 + 1 for i in range(120)] for k in range(4)]
    stores = [PromptStore([MemoryTier(1 << 30, block_tokens=0)]), PromptStore([MemoryTier(1 << 30, block_tokens=32)])]
    for r, (k, cut, extra) in enumerate(requests):
        prompt = bases[k][:cut] + [600 + r * 50 + j for j in range(extra)] + [9]
        got = [_checkout(s, prompt) for s in stores]
        assert got[0][:2] == got[1][:2]  # tier and tokens
        for x, y in zip(got[0][2], got[1][2]):
            np.testing.assert_array_equal(x, y)
        for s in stores:
            s.put(SCOPE, prompt, cache_of(prompt))
    whole, blocked = (s.tiers[0] for s in stores)
    assert whole.counters == blocked.counters
    assert blocked.index.nbytes == held_bytes(blocked) <= whole.index.nbytes


def _checkout(store, prompt):
    """(tier, tokens, arrays) of what the store serves for ``prompt``."""
    best = store._best(SCOPE, list(prompt[:-1]), None)
    if best is None:
        return None, (), []
    tier, entry, _ = best
    return tier.name, entry.tokens, arrays(tier.fetch(entry, SCOPE, []))


def test_real_model_turns_get_the_same_hits_and_arrays_from_blocks_and_whole_entries(llama_model):
    """Conversations sharing a system prompt, turn after turn as a server runs them
    (checkout, reuse the prefix, feed the rest, put): both tiers serve the same."""
    model, _ = llama_model
    sc = scope(model)
    system = tokens_of(70)
    stores = [PromptStore([MemoryTier(1 << 30, block_tokens=0)]), PromptStore([MemoryTier(1 << 30, block_tokens=16)])]
    turns = [system + tokens_of(9, start=200 + 31 * c) + tokens_of(5 * t, start=400 + c) for c in range(3)
             for t in range(1, 3)]  # fmt: skip
    for prompt in turns + turns[:2]:
        got = [checked_out(s, sc, model, prompt) for s in stores]
        whole, blocks = ((g.tier, g.served, g.tokens) if g else None for g in got)
        assert whole == blocks
        if got[0] is not None:
            for x, y in zip(arrays(got[0].cache), arrays(got[1].cache)):
                np.testing.assert_array_equal(x, y)
        for s, g in zip(stores, got):
            state = g.state if g else PromptCache.new(model)
            reused = reuse_prefix(state, prompt, model)
            forward(model, state.cache, prompt[reused:])
            state.tokens[:] = list(prompt)
            s.put(sc, state.tokens, state.cache)
    assert stores[0].stats()["memory"]["hits"] == stores[1].stats()["memory"]["hits"] >= 5
    assert stores[1].tiers[0].index.nbytes < stores[0].tiers[0].index.nbytes


def test_assembly_buffers_have_zeroed_room_however_the_loader_reads_them():
    """The buffers come from a stream that writes only the room: reads of any size give the same bytes."""
    import random

    from mlx_chatcache.store.blocks import _allocate, _Room

    arrays = [(mx.float32, (1, 3, 300, 4)), (mx.uint16, (2, 2, 260, 3)), (mx.float32, (1, 1, 0, 4))]
    one = _Room(arrays, 257)
    whole = bytearray(b"\xff" * one.size)
    one.readinto(whole)
    chunked, rng = _Room(arrays, 257), random.Random(0)
    got, pos = bytearray(b"\xff" * chunked.size), 0
    while pos < chunked.size:
        chunked.seek(pos)
        pos += chunked.readinto(memoryview(got)[pos : pos + rng.randint(1, 700)])
    assert got == whole
    for a in _allocate(arrays, 257):
        assert a.shape[2] < 257 or not mx.any(a[:, :, 257:]).item()
