"""The Redis tier against real servers: one redis-server for the module (emptied per
test) and a real 3-master Redis Cluster. Replicas (two tiers on one Redis) serve
each other's values; shared blocks are one key each; a damaged, foreign or evicted
value is a miss; Redis killed, restarted, paused or full only slows requests; every
command names one key, so the same code serves a cluster, where a killed master
turns into misses."""

from __future__ import annotations

import time

import pytest

import redis  # noqa: F401

from redis_server import redis_cluster, redis_server, shared_redis  # noqa: E402,F401  (fixtures)

from mlx_chatcache.errors import UsageError  # noqa: E402
from mlx_chatcache.store.chain import Chain  # noqa: E402
from mlx_chatcache.store.redis_tier import RedisTier  # noqa: E402
from mlx_chatcache.store.store import PromptStore  # noqa: E402
from mlx_chatcache.store.tiers import MemoryTier  # noqa: E402
from store_helpers import synthetic, tokens_of  # noqa: E402
from test_store import SC, hit  # noqa: E402

B = 8


@pytest.fixture
def tiers():
    made = []

    def make(url, **kw):
        made.append(RedisTier(url, **kw))
        return made[-1]

    yield make
    for t in made:
        t.close()


def put(store, tokens):
    store.put(SC, tokens, synthetic(tokens))
    for t in store.tiers:
        if isinstance(t, RedisTier):
            assert t.flush(10)


def our_keys(client) -> list[bytes]:
    return list(client.scan_iter("mlxcc:*"))


def test_replicas_serve_each_others_values_and_a_shared_prompt_is_one_key_per_block(tiers, redis_server):  # noqa: F811
    a = PromptStore([MemoryTier(1 << 30), tiers(redis_server.url)], block_tokens=B)
    b = PromptStore([tiers(redis_server.url)], block_tokens=B)
    system = tokens_of(40)  # five blocks
    convs = [system + tokens_of(12, start=100 + 20 * i) for i in range(10)]
    for c in convs:
        put(a, c)
    assert len(our_keys(redis_server.client())) == 5 + 10 + 10  # shared blocks once; each its block and tail
    for c in convs:
        assert hit(b, c + [1]) == (52, "redis")
    assert b.tiers[0].stats()["hits"] == 10 * 7
    ttl = redis_server.client().ttl(f"mlxcc:{Chain(SC.namespace, system, B).blocks[0]}")
    assert 0 < ttl <= b.tiers[0].ttl  # every value expires unless it is used


def test_damaged_and_foreign_values_are_misses_that_are_deleted(tiers, redis_server):  # noqa: F811
    store = PromptStore([tiers(redis_server.url)], block_tokens=B)
    base = tokens_of(30)
    put(store, base)
    r = redis_server.client()
    keys = [f"mlxcc:{k}" for k in Chain(SC.namespace, base, B).blocks]
    value = bytearray(r.get(keys[1]))
    value[-5] ^= 0x10  # one bit of block 2's K/V
    r.set(keys[1], bytes(value))
    assert hit(store, base + [1]) == (8, "redis")
    assert store.tiers[0].stats()["corrupt"] == 1 and not r.exists(keys[1])
    r.set(keys[1], r.get(keys[0]))  # a whole, valid value under another key
    assert hit(store, base + [1]) == (8, "redis") and store.tiers[0].stats()["corrupt"] == 2
    r.set(keys[0], b"\x00" * 40)  # not a value at all
    assert hit(store, base + [1]) == (0, None) and store.tiers[0].stats()["corrupt"] == 3


def test_redis_killed_then_restarted_only_slows_requests(tiers, redis_server):  # noqa: F811
    tier = tiers(redis_server.url, backoff=(0.05, 0.2))
    store = PromptStore([MemoryTier(1 << 30), tier], block_tokens=B)
    one, two = tokens_of(20), tokens_of(20, start=77)
    put(store, one)
    redis_server.kill()
    t0 = time.monotonic()
    for _ in range(3):  # every lookup still answers (from memory), fast; puts never raise
        assert hit(store, one + [5]) == (20, "memory")
        store.put(SC, two, synthetic(two))
    assert hit(PromptStore([tier], block_tokens=B), one + [5]) == (0, None)
    assert time.monotonic() - t0 < 5
    tier.flush(10)
    assert tier.stats()["connected"] is False and tier.stats()["outages"] == 1
    redis_server.start()  # same port, empty
    deadline = time.monotonic() + 10
    while hit(PromptStore([tier], block_tokens=B), two + [5])[0] < 20:
        assert time.monotonic() < deadline, tier.stats()
        put(store, two)
        time.sleep(0.1)
    assert tier.stats()["connected"] is True


def test_a_paused_redis_costs_a_lookup_its_socket_timeout_only(tiers, redis_server):  # noqa: F811
    tier = tiers(redis_server.url, socket_timeout=0.3, backoff=(5.0, 5.0))
    store = PromptStore([tier], block_tokens=B)
    base = tokens_of(20)
    put(store, base)
    redis_server.client().execute_command("CLIENT", "PAUSE", "3000", "ALL")
    t0 = time.monotonic()
    assert hit(store, base + [1]) == (0, None)  # timed out: a miss
    assert hit(store, base + [1]) == (0, None)  # backing off: no network at all
    assert time.monotonic() - t0 < 1.5 and tier.stats()["lookup_errors"] >= 1


def test_values_redis_evicts_under_maxmemory_are_misses_and_never_errors(tiers, redis_server):  # noqa: F811
    r = redis_server.client()
    r.config_set("maxmemory-policy", "allkeys-lru")
    r.config_set("maxmemory", r.info("memory")["used_memory"] + 200_000)
    store = PromptStore([tiers(redis_server.url)], block_tokens=B)
    seqs = [tokens_of(200, start=s) for s in range(0, 60, 3)]  # more than fits
    for s in seqs:
        put(store, s)
    assert len(our_keys(r)) < 20 * 26 and r.info("stats")["evicted_keys"] > 0
    served = [hit(store, s + [1])[0] for s in seqs]  # each exact where it hits (checked by hit)
    assert max(served) > 0 and store.tiers[0].stats()["write_errors"] == 0


def test_a_bad_url_is_one_clear_line():
    with pytest.raises(UsageError, match="not a Redis URL"):
        RedisTier("http://127.0.0.1:1")


def test_a_cluster_serves_replicas_with_single_key_commands_and_a_killed_master_is_misses(tiers, redis_cluster):  # noqa: F811
    a, b = tiers(redis_cluster.nodes[1].url), tiers(redis_cluster.nodes[2].url, backoff=(0.05, 0.2))
    sa, sb = PromptStore([a], block_tokens=B), PromptStore([b], block_tokens=B)
    convs = [tokens_of(40) + tokens_of(12, start=100 + 20 * i) for i in range(6)]
    for c in convs:
        put(sa, c)
    assert a.stats()["cluster"] and a.stats()["write_errors"] == 0
    assert [hit(sb, c + [1]) for c in convs] == [(52, "redis")] * 6
    assert b.stats()["cluster"] and b.stats()["lookup_errors"] == 0
    held = [n.client().dbsize() for n in redis_cluster.nodes]
    assert all(held) and sum(held) == 5 + 6 + 6  # spread over the three masters
    redis_cluster.nodes[0].kill()
    for c in convs:  # slots of the dead master miss; nothing raises, every hit is exact
        assert hit(sb, c + [1])[0] in (0, 8, 16, 24, 32, 40, 48, 52)
    sb.put(SC, tokens_of(30, start=7), synthetic(tokens_of(30, start=7)))
    assert b.flush(10)
