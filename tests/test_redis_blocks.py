"""The Redis tier's shared blocks against a real redis-server: conversations
sharing a prefix store its K/V once (also when replicas wrote them), a block
lives while an entry lists it, a damaged block makes only its entries misses,
and a checkout is bit-identical to the whole-entry path."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("redis")

from redis_server import redis_server, tier_factory  # noqa: E402,F401  (fixture)

from mlx_chatcache.cache import KVCache, QuantizedKVCache, make_prompt_cache  # noqa: E402
from mlx_chatcache.store.chain import Chain  # noqa: E402
from mlx_chatcache.store.store import PromptStore  # noqa: E402
from store_helpers import arrays, checked_out, filled, scope, tokens_of  # noqa: E402

BLOCK = 64
PREFIX = tokens_of(1000)


@pytest.fixture
def tiers(redis_server):  # noqa: F811
    make, close_all = tier_factory(redis_server.url, BLOCK)
    yield make
    close_all()


class KV:
    """Random K/V in the model's layer shapes; the values of a token position
    are the same in every conversation sharing the tokens up to it."""

    def __init__(self, model):
        self.shapes = [[a.shape for a in c.flat_state()] for c in filled(model, tokens_of(2))]
        self.prefix = self._random(len(PREFIX), 0)

    def _random(self, n, seed):
        rng = np.random.default_rng(seed)
        return [[rng.standard_normal((s[0], s[1], n, s[3])).astype(np.float32) for s in layer] for layer in self.shapes]

    def conversation(self, i, unique=200):
        tokens = PREFIX + tokens_of(unique, start=1000 + 37 * i)
        own = self._random(unique, 1 + i)
        cache = [KVCache.from_flat_state([mx.array(np.concatenate([p, o], axis=2)) for p, o in zip(ps, os)],
                                         (str(len(tokens)),))
                 for ps, os in zip(self.prefix, own)]  # fmt: skip
        return tokens, cache

    def token_bytes(self) -> int:
        return sum(4 * s[0] * s[1] * s[3] for layer in self.shapes for s in layer)


def keys(client, kind):
    return sorted(k.decode() for k in client.keys(f"mlxcc:{kind}:*"))


def value_bytes(client) -> int:
    return sum(client.strlen(k) for kind in ("k", "c") for k in client.keys(f"mlxcc:{kind}:*"))


def fetched(tier, model, tokens):
    found = tier.find(scope(model), list(tokens) + [1], None)
    assert found is not None and found[0].tokens == tuple(tokens)
    return tier.fetch(found[0], scope(model), make_prompt_cache(model))


def test_ten_conversations_store_their_shared_prefix_once(llama_model, tiers, redis_server):  # noqa: F811
    model, _ = llama_model
    kv, tier, client = KV(model), tiers(), redis_server.client()
    convs = [kv.conversation(i) for i in range(10)]
    for i, (tokens, cache) in enumerate(convs):
        assert tier.add(scope(model), tokens, cache, f"conv{i}") and tier.flush(30)
    assert tier.stats()["added"] == 10
    unique = (len(PREFIX) + 10 * 200) * kv.token_bytes()
    stored = value_bytes(client)
    assert stored <= 1.25 * unique, (stored, unique)
    hashes = {h for tokens, _ in convs for h in Chain(scope(model).namespace, tokens, BLOCK).hashes}
    assert len(keys(client, "k")) == len(hashes) == 15 + 10 * 3  # 15 shared blocks, 3 of each conversation's own
    assert int(client.get("mlxcc:kbytes")) == sum(client.strlen(k) for k in keys(client, "k"))
    assert tier.stats()["bytes"] <= 1.25 * unique
    reader = tiers()
    for tokens, cache in convs:
        got = fetched(reader, model, tokens)
        assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(cache)))


def test_replicas_share_blocks_and_checkout_matches_the_whole_entry_path(llama_model, tiers, redis_server):  # noqa: F811
    model, _ = llama_model
    kv, client = KV(model), redis_server.client()
    a, b = tiers(), tiers()
    (t1, c1), (t2, c2) = kv.conversation(1), kv.conversation(2)
    assert a.add(scope(model), t1, c1, None) and a.flush(10)
    assert b.add(scope(model), t2, c2, None) and b.flush(10)
    ns = scope(model).namespace
    shared = Chain(ns, t1, BLOCK).hashes[:15]
    assert shared == Chain(ns, t2, BLOCK).hashes[:15]
    assert len(keys(client, "k")) == 15 + 2 * 3
    assert [int(client.hget(f"mlxcc:r:{ns}:{h}", "n")) for h in shared] == [2] * 15
    whole = tiers(prefix="whole", share_blocks=False)
    assert whole.add(scope(model), t1, c1, None) and whole.flush(10)
    from_whole = fetched(whole, model, t1)
    for reader in (a, b):
        got = fetched(reader, model, t1)
        assert [x.dtype for x in arrays(got)] == [x.dtype for x in arrays(from_whole)]
        assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(from_whole)))
    # a checkout through the store serves a prefix of the entry, as before
    got = checked_out(PromptStore([b]), scope(model), model, t1[:1100] + [5, 6])
    assert got.tier == "redis" and got.served == 1100 and got.tokens == t1


class TwoStored(NamedTuple):
    """Three conversations sharing PREFIX (tokens, cache) and a tier holding the first two."""

    model: object
    kv: KV
    client: object
    ns: str
    tier: object
    convs: list


@pytest.fixture
def two_stored(llama_model, tiers, redis_server):  # noqa: F811
    model, _ = llama_model
    kv, tier = KV(model), tiers()
    convs = [kv.conversation(i) for i in range(3)]
    for tokens, cache in convs[:2]:
        assert tier.add(scope(model), tokens, cache, None) and tier.flush(30)
    return TwoStored(model, kv, redis_server.client(), scope(model).namespace, tier, convs)


def test_deleting_or_evicting_an_entry_frees_only_blocks_nobody_else_holds(two_stored, tiers):
    model, kv, client, ns, tier, convs = two_stored
    own = [set(Chain(ns, t, BLOCK).hashes[15:]) for t, _ in convs]
    first = tier.find(scope(model), convs[0][0] + [1], None)[0]
    assert tier.writer.submit(lambda: tier.writer.discard(first.payload)) and tier.flush(10)
    left = {k.rsplit(":", 1)[1] for k in keys(client, "k")}
    assert not (own[0] & left) and own[1] <= left and len(left) == 15 + 3
    assert int(client.get("mlxcc:kbytes")) == sum(client.strlen(k) for k in keys(client, "k"))
    assert fetched(tier, model, convs[1][0]) is not None
    # eviction: room for the prefix and two conversations of their own tokens; the third evicts the oldest
    client.flushall()
    small = tiers(budget=int(kv.token_bytes() * 1500))
    for tokens, cache in convs:
        assert small.add(scope(model), tokens, cache, None) and small.flush(10)
    assert small.stats()["evicted"] >= 1
    left = {k.rsplit(":", 1)[1] for k in keys(client, "k")}
    assert not (own[0] & left) and own[2] <= left
    assert int(client.get("mlxcc:kbytes")) == sum(client.strlen(k) for k in keys(client, "k"))
    assert int(client.get("mlxcc:kbytes")) <= small.index.budget
    assert small.find(scope(model), convs[0][0] + [1], None)[1] < len(convs[0][0])  # only the shared prefix is left
    got = fetched(small, model, convs[2][0])
    assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(convs[2][1])))


def test_a_damaged_block_makes_its_entries_misses_and_others_are_served(two_stored, tiers):
    model, _, client, ns, writer, convs = two_stored
    assert writer.add(scope(model), *convs[2], None) and writer.flush(30)
    bad = Chain(ns, convs[0][0], BLOCK).hashes[16]  # a block only the first conversation holds
    value = bytearray(client.get(f"mlxcc:k:{ns}:{bad}"))
    value[len(value) // 2] ^= 0x01
    client.set(f"mlxcc:k:{ns}:{bad}", bytes(value))
    reader = tiers()
    found = reader.find(scope(model), convs[0][0] + [1], None)
    assert reader.fetch(found[0], scope(model), make_prompt_cache(model)) is None
    assert reader.stats()["corrupt"] == 1 and reader.stats()["hits"] == 0
    assert reader.flush(10)
    assert client.get(f"mlxcc:k:{ns}:{bad}") is None  # the damaged value is gone for every replica
    assert int(client.get("mlxcc:kbytes")) == sum(client.strlen(k) for k in keys(client, "k"))
    assert reader.find(scope(model), convs[0][0] + [1], None)[0].tokens != tuple(convs[0][0])
    for tokens, cache in convs[1:]:
        got = fetched(reader, model, tokens)
        assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(cache)))
    # a block gone missing (evicted by Redis itself) is a miss, counted, and its entry dropped
    gone = Chain(ns, convs[1][0], BLOCK).hashes[16]
    client.delete(f"mlxcc:k:{ns}:{gone}")
    found = reader.find(scope(model), convs[1][0] + [1], None)
    assert reader.fetch(found[0], scope(model), make_prompt_cache(model)) is None
    assert reader.stats()["missing"] == 1 and reader.flush(10)
    assert len(keys(client, "m")) == 1
    assert fetched(reader, model, convs[2][0]) is not None


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 90), block=st.sampled_from([1, 7, 16, 32]), quantized=st.booleans(),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]), cut=st.integers(1, 5000))  # fmt: skip
def test_block_values_round_trip_bit_exactly(n, block, quantized, dtype, cut):
    from mlx_chatcache.files.checksum import crc32
    from mlx_chatcache.store.redis_blocks import Layout, assemble, block_ok, split, splittable

    cache = []
    for seed in range(2):
        c = QuantizedKVCache(group_size=32, bits=4) if quantized else KVCache()
        k, v = (mx.random.normal((1, 2, n, 64), key=mx.random.key(seed * 2 + j)).astype(getattr(mx, dtype))
                for j in range(2))  # fmt: skip
        c.update_and_fetch(k, v)
        cache.append(type(c).from_flat_state([mx.contiguous(a[:, :, :n]) for a in c.flat_state()], c.meta_state))
    assert splittable(cache, n)
    chain = Chain("ns", list(range(n)), block)
    values, tail, layout = split(cache, chain)
    layout = Layout.from_json(layout.to_json())  # as the manifest carries it
    assert len(values) == n // block and all(block_ok(v, crc32(v), layout, block) for v in values.values())
    chunks = [tail[i : i + cut] for i in range(0, len(tail), cut)] or [b""]  # the tail as Redis holds it
    got = assemble(layout, [values[h] for h in chain.hashes], chunks, block)
    assert [type(c) for c in got] == [type(c) for c in cache]
    for x, y in zip([a for c in got for a in c.flat_state()], [a for c in cache for a in c.flat_state()]):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x),
                              np.array(y.view(mx.uint16) if y.dtype == mx.bfloat16 else y))  # fmt: skip
    if values:  # one flipped bit anywhere in a block value is caught
        v = next(iter(values.values()))
        bad = bytearray(v)
        bad[len(bad) - 1] ^= 0x80
        assert not block_ok(bytes(bad), crc32(v), layout, block)
        assert not block_ok(v[:-1], crc32(v[:-1]), layout, block)  # and so is a short one


def test_counts_stay_exact_when_replicas_write_and_delete_at_once(llama_model, tiers, redis_server):  # noqa: F811
    import json

    model, _ = llama_model
    kv, client = KV(model), redis_server.client()
    ns = scope(model).namespace
    replicas = [tiers(queue_size=16) for _ in range(3)]
    convs = [kv.conversation(i, unique=40) for i in range(12)]
    for i, (tokens, cache) in enumerate(convs):  # queued on three writer threads, published concurrently
        assert replicas[i % 3].add(scope(model), tokens, cache, None)
    assert all(t.flush(60) for t in replicas)
    for i in range(0, 12, 3):  # deletes racing each other and the publishes of a second round
        m = replicas[0].find(scope(model), convs[i][0] + [1], None)[0].payload
        replicas[i % 3].writer.submit(lambda m=m: replicas[0].writer.discard(m))
        t, c = kv.conversation(100 + i, unique=40)
        replicas[(i + 1) % 3].add(scope(model), t, c, None)
    assert all(t.flush(60) for t in replicas)
    assert sum(t.stats()["write_errors"] for t in replicas) == 0
    listed: dict[str, int] = {}
    for k in keys(client, "m"):
        for h in json.loads(client.get(k))["blocks"]:
            listed[h] = listed.get(h, 0) + 1
    assert len(keys(client, "m")) == 12
    assert {k.rsplit(":", 1)[1] for k in keys(client, "k")} == set(listed)
    assert {h: int(client.hget(f"mlxcc:r:{ns}:{h}", "n")) for h in listed} == listed
    assert int(client.get("mlxcc:kbytes")) == sum(client.strlen(k) for k in keys(client, "k"))


def test_a_tail_goes_from_its_chunks_into_the_cache_once_and_a_damaged_chunk_is_caught(
        llama_model, tiers, redis_server, monkeypatch):  # noqa: F811
    """The tail's chunks, as received, are what the cache is assembled from: no bytes
    object of the tail's size is built on the way (traced allocations stay under half
    of it), the cache is bit-exact, and a flipped bit in any chunk is a counted miss."""
    import tracemalloc

    from mlx_chatcache.store import redis_tier

    model, _ = llama_model
    kv, client = KV(model), redis_server.client()
    tokens, cache = kv.conversation(0, unique=BLOCK * 3 + 23)  # 1000 + 215 tokens: a tail of 63
    tail_bytes = (len(tokens) % BLOCK) * kv.token_bytes()
    writer = tiers(chunk_bytes=tail_bytes // 3 + 5)  # cuts land inside arrays and rows
    assert writer.add(scope(model), tokens, cache, None) and writer.flush(30)
    chunk_keys = sorted(keys(client, "c"), key=lambda k: int(k.rsplit(":", 1)[1]))
    assert len(chunk_keys) == 3 and sum(client.strlen(k) for k in chunk_keys) == tail_bytes
    seen, real = [], redis_tier.assemble

    def spy(layout, values, tail, block):
        tracemalloc.start()
        try:
            got = real(layout, values, tail, block)
            seen.append((list(tail), tracemalloc.get_traced_memory()[1]))
        finally:
            tracemalloc.stop()
        return got

    monkeypatch.setattr(redis_tier, "assemble", spy)
    got = fetched(tiers(), model, tokens)
    assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(cache)))
    [(chunks, peak)] = seen
    assert chunks == [client.get(k) for k in chunk_keys]  # the chunks as stored, not joined
    assert peak < tail_bytes // 2, (peak, tail_bytes)
    for j in range(3):  # a flipped bit in any chunk of the tail is caught
        k = f"{chunk_keys[0].rsplit(':', 1)[0]}:{j}"
        value = bytearray(client.get(k))
        value[len(value) // 2] ^= 0x04
        client.set(k, bytes(value))
        reader = tiers()
        found = reader.find(scope(model), tokens + [1], None)
        assert found[0].tokens == tuple(tokens)
        assert reader.fetch(found[0], scope(model), make_prompt_cache(model)) is None
        assert reader.stats()["corrupt"] == 1 and reader.stats()["hits"] == 0 and reader.flush(10)
        assert keys(client, "m") == [] and keys(client, "k") == []  # deleted for every replica
        client.flushall()
        again = tiers(chunk_bytes=tail_bytes // 3 + 5)
        assert again.add(scope(model), tokens, cache, None) and again.flush(30)
        chunk_keys = keys(client, "c")
