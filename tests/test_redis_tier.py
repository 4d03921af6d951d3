"""The Redis store tier against fakeredis: sharing between instances (replicas),
prefix lookup through the hash chain, chunked values, verification of every
value before use, versioned manifests, budget, TTL and Redis going away."""

from __future__ import annotations

import logging
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

fakeredis = pytest.importorskip("fakeredis")

from mlx_chatcache.cache import make_prompt_cache  # noqa: E402
from mlx_chatcache.files.mlxcc_format import prompt_cache_bytes  # noqa: E402
from mlx_chatcache.errors import UsageError  # noqa: E402
from mlx_chatcache.files.prompt_cache import PromptCache  # noqa: E402
from mlx_chatcache.generation.prompt import reuse_prefix  # noqa: E402
from mlx_chatcache.store.store import PromptStore, build_store  # noqa: E402
from mlx_chatcache.store.tiers import MemoryTier  # noqa: E402
from mlx_chatcache.store.redis_layout import Chain, Manifest  # noqa: E402
from mlx_chatcache.store.redis_tier import RedisTier  # noqa: E402
from loop_helpers import forward  # noqa: E402
from store_helpers import SETTINGS, arrays, checked_out, filled, scope, tokens_of  # noqa: E402

BLOCK = 16


@pytest.fixture
def server():
    return fakeredis.FakeServer()


@pytest.fixture
def make_tier(server):
    made = []

    def make(**kw):
        kw.setdefault("block", BLOCK)
        kw.setdefault("chunk_bytes", 64 << 10)
        tier = RedisTier("redis://fake", kw.pop("budget", 1 << 30), client=fakeredis.FakeRedis(server=server), **kw)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def raw(server):
    return fakeredis.FakeRedis(server=server)


def put(tier, model, tokens, key=None):
    assert tier.add(scope(model), tokens, filled(model, tokens), key)
    assert tier.flush(10)


def keys(raw, kind):
    return sorted(k.decode() for k in raw.keys(f"mlxcc:{kind}:*"))


def test_a_second_instance_continues_from_the_first_ones_entry(llama_model, make_tier):
    model, _ = llama_model
    base = tokens_of(100)
    a, b = make_tier(), make_tier()  # two replicas sharing one Redis
    put(a, model, base)
    store = PromptStore([MemoryTier(1 << 30), b])
    prompt = base[:70] + tokens_of(9, start=200)  # diverges inside block 5 (tokens 64..79)
    got = checked_out(store, scope(model), model, prompt)
    assert got.tier == "redis" and got.served == 70 and got.tokens == base
    np.testing.assert_array_equal(arrays(got.cache), arrays(filled(model, base)))
    state = PromptCache(got.cache, got.tokens)
    reused = reuse_prefix(state, prompt, model)
    warm = forward(model, state.cache, prompt[reused:])
    cold = forward(model, make_prompt_cache(model), prompt)
    assert reused == 70
    np.testing.assert_allclose(np.array(warm), np.array(cold), atol=1e-4)
    assert b.stats()["hits"] == 1 and b.stats()["corrupt"] == 0
    # a shorter query than the entry is served too, and one shorter than a block never is
    assert checked_out(store, scope(model), model, base[:40] + [9]).served == 40
    assert checked_out(store, scope(model), model, base[: BLOCK - 2] + [9]) is None


def test_values_are_chunked_and_round_trip_exactly(llama_model, make_tier, raw):
    model, _ = llama_model
    base = tokens_of(300)
    tier = make_tier(chunk_bytes=100_000, share_blocks=False)  # a whole value (what untrimmable caches get)
    put(tier, model, base)
    data = prompt_cache_bytes(filled(model, base), tokens=base, model=model.fingerprint, settings=SETTINGS,
                              metadata={"store.namespace": scope(model).namespace, "store.trimmable": "1"})  # fmt: skip
    chunks = keys(raw, "c")
    assert len(chunks) == -(-len(data) // 100_000) > 1
    assert all(len(raw.get(k)) <= 100_000 for k in chunks)
    got = make_tier().find(scope(model), base + [1], None)
    cache = make_tier().fetch(got[0], scope(model), make_prompt_cache(model))
    np.testing.assert_array_equal(arrays(cache), arrays(filled(model, base)))


def test_a_corrupted_chunk_is_rejected_counted_and_deleted(llama_model, make_tier, raw):
    model, _ = llama_model
    base = tokens_of(80)
    put(make_tier(share_blocks=False), model, base)
    chunk = keys(raw, "c")[0]
    value = bytearray(raw.get(chunk))
    value[len(value) // 2] ^= 0xFF
    raw.set(chunk, bytes(value))
    reader = make_tier()
    store = PromptStore([reader])
    assert checked_out(store, scope(model), model, base + [1]) is None
    assert reader.stats()["corrupt"] == 1 and reader.stats()["hits"] == 0
    assert reader.flush(10) and keys(raw, "m") == []  # the bad value is gone for every replica


def forge(raw, tier, model, tokens, data):
    """Store ``data`` as the value of ``tokens``' entry with a consistent manifest
    (checksums right): only the checks of the file itself can catch it."""
    ns = scope(model).namespace
    eid = Chain(ns, tokens, BLOCK).entry_id(len(tokens))
    m, chunks = Manifest.for_value(ns, eid, "f0f0", data, 1 << 20, tokens, True, None)
    for j, c in enumerate(chunks):
        raw.set(tier.keys.chunk(ns, eid, m.version, j), c)
    raw.set(tier.keys.manifest(ns, eid), m.encode())
    for h in Chain(ns, tokens, BLOCK).hashes:
        raw.set(tier.keys.block(ns, h), f"{len(tokens)}:{eid}")


def test_foreign_values_are_never_used(llama_model, make_tiny_model, make_tier, raw):
    model, _ = llama_model
    other, _ = make_tiny_model("llama", seed=1)
    base = tokens_of(64)
    meta = {"store.namespace": scope(model).namespace}
    cases = {
        "another model's cache": prompt_cache_bytes(filled(other, base), tokens=base, model=other.fingerprint,
                                                     metadata=meta),
        "other token ids in the file": prompt_cache_bytes(filled(model, tokens_of(64, 9)), tokens=tokens_of(64, 9),
                                                          model=model.fingerprint, metadata=meta),
        "another namespace": prompt_cache_bytes(filled(model, base), tokens=base, model=model.fingerprint,
                                                metadata={"store.namespace": "0" * 32}),
        "not a cache file": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
    }  # fmt: skip
    reader = make_tier()
    for n, (what, data) in enumerate(cases.items(), start=1):
        forge(raw, reader, model, base, data)
        got = checked_out(PromptStore([reader]), scope(model), model, base + [1])
        assert got is None, what
        assert reader.stats()["corrupt"] == n, what
        reader._bad.clear()  # the forged version name repeats; a real writer's never does
    assert reader.stats()["hits"] == 0


def test_two_writers_of_one_entry_never_mix_versions(llama_model, make_tier, raw):
    model, _ = llama_model
    base = tokens_of(120)
    a, b = make_tier(chunk_bytes=50_000), make_tier(chunk_bytes=70_000)
    put(a, model, base)
    reader = make_tier()
    seen = reader.find(scope(model), base + [1], None)[0]  # holds a's manifest
    put(b, model, base)  # replaces it: another version, other chunk boundaries
    assert len(keys(raw, "m")) == 1
    fresh = reader.find(scope(model), base + [1], None)[0]
    assert fresh.payload.version != seen.payload.version
    want = arrays(filled(model, base))
    for entry in (seen, fresh):  # the replaced version stays readable for a grace period
        np.testing.assert_array_equal(arrays(reader.fetch(entry, scope(model), make_prompt_cache(model))), want)
    old_chunk = reader.keys.chunks(seen.payload)[0]
    assert 0 < raw.ttl(old_chunk) <= 60
    raw.delete(old_chunk)  # the grace period is over: the old manifest's value is incomplete
    assert reader.fetch(seen, scope(model), make_prompt_cache(model)) is None
    assert reader.stats()["missing"] == 1 and reader.stats()["corrupt"] == 0


def test_interleaved_writes_publish_one_complete_version(llama_model, make_tier, raw):
    model, _ = llama_model
    base = tokens_of(90)
    a, b = make_tier(chunk_bytes=40_000, share_blocks=False), make_tier(chunk_bytes=90_000, share_blocks=False)
    gate, entered = threading.Event(), threading.Event()
    real = a.writer._write_chunks

    def slow_chunks(r, m, chunks):  # a's chunks land, then it stalls before publishing
        real(r, m, chunks)
        entered.set()
        gate.wait(10)

    a.writer._write_chunks = slow_chunks
    assert a.add(scope(model), base, filled(model, base), None)
    assert entered.wait(10)
    put(b, model, base)  # b publishes while a is between its chunks and its manifest
    gate.set()
    assert a.flush(10)
    reader = make_tier()
    entry = reader.find(scope(model), base + [1], None)[0]
    assert entry.payload.chunk_sizes[0] == 40_000  # the last publisher's version, whole
    cache = reader.fetch(entry, scope(model), make_prompt_cache(model))
    np.testing.assert_array_equal(arrays(cache), arrays(filled(model, base)))


def test_longer_entry_supersedes_its_prefix(llama_model, make_tier, raw):
    model, _ = llama_model
    turn1 = tokens_of(50)
    turn2 = turn1 + tokens_of(40, start=150)
    tier = make_tier()
    put(tier, model, turn1, key="c")
    put(tier, model, turn2, key="c")
    assert len(keys(raw, "m")) == 1 and len(raw.hgetall("mlxcc:meta")) == 1
    got = make_tier().find(scope(model), turn1 + [7], None)
    assert got[1] == 50 and got[0].tokens == tuple(turn2)


def test_budget_evicts_least_recently_used_and_refuses_oversized(llama_model, make_tier, raw):
    model, _ = llama_model
    seqs = [tokens_of(40, start=s) for s in (10, 60, 110)]
    probe = make_tier()
    put(probe, model, seqs[0])
    size = probe.stats()["bytes"]
    raw.flushall()
    tier = make_tier(budget=int(size * 2.5))
    put(tier, model, seqs[0])
    put(tier, model, seqs[1])
    assert tier.fetch(tier.find(scope(model), seqs[0] + [1], None)[0], scope(model), make_prompt_cache(model))
    assert tier.flush(10)  # the hit refreshed seqs[0]: seqs[1] is now the oldest
    put(tier, model, seqs[2])
    assert tier.stats()["evicted"] == 1 and len(keys(raw, "m")) == 2
    assert tier.find(scope(model), seqs[1] + [1], None) is None
    assert tier.find(scope(model), seqs[0] + [1], None) is not None
    assert sum(int(v.split(b":")[0]) for v in raw.hgetall("mlxcc:meta").values()) <= tier.index.budget
    small = make_tier(budget=size // 2)
    put(small, model, tokens_of(40, start=200))
    assert small.stats()["refused"] == 1


def test_entries_expire_and_hits_refresh_them(llama_model, make_tier, raw):
    model, _ = llama_model
    base = tokens_of(40)
    tier = make_tier(ttl=100)
    put(tier, model, base)
    mkey = keys(raw, "m")[0]
    assert 0 < raw.ttl(mkey) <= 100
    assert all(0 < raw.ttl(k) <= 100 for k in keys(raw, "b"))
    assert all(0 < raw.ttl(k) <= 160 for k in keys(raw, "c"))
    raw.expire(mkey, 5)
    tier.fetch(tier.find(scope(model), base + [1], None)[0], scope(model), make_prompt_cache(model))
    assert tier.flush(10) and raw.ttl(mkey) > 50


def test_untrimmable_entries_serve_only_themselves(tiny_model_dirs, make_tier):
    from mlx_chatcache.models.loading import load

    model, _ = load(str(tiny_model_dirs["hybrid"]))
    base = tokens_of(40)
    put(make_tier(), model, base)
    reader = PromptStore([make_tier()])
    assert checked_out(reader, scope(model), model, base[:35] + [1, 2]) is None
    got = checked_out(reader, scope(model), model, base + [1, 2])
    assert got.served == 40 and got.tier == "redis"
    state = PromptCache(got.cache, got.tokens)
    prompt = base + [1, 2]
    warm = forward(model, state.cache, prompt[reuse_prefix(state, prompt, model) :])
    cold = forward(model, make_prompt_cache(model), prompt)
    np.testing.assert_allclose(np.array(warm), np.array(cold), atol=1e-4)
    mx.eval(warm)


def test_redis_down_falls_back_logs_once_and_reconnects(llama_model, make_tier, server, caplog):
    model, _ = llama_model
    base = tokens_of(40)
    tier = make_tier(backoff=(0.05, 0.2))
    store = PromptStore([MemoryTier(1 << 30), tier])
    server.connected = False
    with caplog.at_level(logging.WARNING, logger="mlx_chatcache.store.redis"):
        for _ in range(5):
            store.put(scope(model), base, filled(model, base))
            got = checked_out(store, scope(model), model, base + [1])
            assert got.tier == "memory" and got.served == 40  # served from memory all along
            time.sleep(0.06)
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "failed" in caplog.records[0].message and len(caplog.records) == 1
        assert tier.stats()["connected"] is False
        server.connected = True
        time.sleep(0.25)  # past the longest backoff
        store.put(scope(model), base, filled(model, base))
        assert tier.flush(10)
        assert "reachable again" in caplog.records[-1].message and len(caplog.records) == 2
    reader = PromptStore([make_tier()])
    assert checked_out(reader, scope(model), model, base + [1]).tier == "redis"
    assert tier.stats()["connected"] is True and tier.stats()["outages"] == 1


def test_a_full_write_queue_drops_and_counts(llama_model, make_tier):
    model, _ = llama_model
    tier = make_tier(queue_size=1)
    gate = threading.Event()
    tier.writer.submit(lambda: gate.wait(10))  # the writer is busy with this one
    time.sleep(0.05)
    assert tier.add(scope(model), tokens_of(40), filled(model, tokens_of(40)), None)  # queued
    assert not tier.add(scope(model), tokens_of(40, 99), filled(model, tokens_of(40, 99)), None)
    assert tier.stats()["dropped"] == 1
    gate.set()
    assert tier.flush(10) and tier.stats()["added"] == 1


def test_bad_url_is_one_clear_error():
    with pytest.raises(UsageError, match="not a Redis URL"):
        build_store(0, 0, None, redis_url="http://localhost:6379")
