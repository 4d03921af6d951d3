"""The Redis tier against a real redis-server: the same protocol paths as
fakeredis covers, plus what only a real server does: connections that die with
the server, a server restarted empty, a server too slow to answer (paused
clients), and writers racing each other over real sockets."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("redis")

from redis_server import redis_server, tier_factory  # noqa: E402,F401  (fixture)

from mlx_chatcache.cache import make_prompt_cache  # noqa: E402
from mlx_chatcache.store.store import PromptStore  # noqa: E402
from mlx_chatcache.store.tiers import MemoryTier, make_scope  # noqa: E402
from store_helpers import SETTINGS, arrays, checked_out, filled, tokens_of  # noqa: E402

@pytest.fixture
def tiers(redis_server):  # noqa: F811
    make, close_all = tier_factory(redis_server.url, 16)
    yield make
    close_all()


def test_round_trip_in_chunks_between_two_tiers(llama_model, tiers, redis_server):  # noqa: F811
    model, _ = llama_model
    sc = make_scope(model.fingerprint, SETTINGS)
    base = tokens_of(200)
    a, b = tiers(chunk_bytes=200_000, share_blocks=False), tiers()
    assert a.add(sc, base, filled(model, base), "conv") and a.flush(10)
    assert len(redis_server.client().keys("mlxcc:c:*")) > 1
    got = checked_out(PromptStore([b]), sc, model, base[:150] + [1, 2])
    assert got.tier == "redis" and got.served == 150
    np.testing.assert_array_equal(arrays(got.cache), arrays(filled(model, base)))


def test_killed_then_restarted_redis(llama_model, tiers, redis_server):  # noqa: F811
    model, _ = llama_model
    sc = make_scope(model.fingerprint, SETTINGS)
    one, two = tokens_of(60), tokens_of(60, start=77)
    tier = tiers(backoff=(0.05, 0.2))
    store = PromptStore([MemoryTier(1 << 30), tier])
    store.put(sc, one, filled(model, one))
    assert tier.flush(10) and tier.stats()["added"] == 1
    redis_server.kill()
    t0 = time.monotonic()
    for _ in range(3):  # every lookup still answers (from memory), fast
        assert checked_out(store, sc, model, one + [5]).tier == "memory"
        store.put(sc, two, filled(model, two))
    assert time.monotonic() - t0 < 5
    tier.flush(10)
    assert tier.stats()["connected"] is False and tier.stats()["outages"] == 1
    redis_server.start()  # same port, empty
    time.sleep(0.25)
    deadline = time.monotonic() + 10
    while tier.stats()["added"] < 2 and time.monotonic() < deadline:
        store.put(sc, two + [9], filled(model, two + [9]))  # writes resume once the link is back
        tier.flush(10)
        time.sleep(0.1)
    assert tier.stats()["connected"] is True and tier.stats()["added"] >= 2
    fresh = PromptStore([tiers()])
    assert checked_out(fresh, sc, model, two + [9, 1]).served == 61
    assert checked_out(fresh, sc, model, one + [1]) is None  # lost with the restart


def test_slow_redis_times_out_and_falls_back(llama_model, tiers, redis_server):  # noqa: F811
    model, _ = llama_model
    sc = make_scope(model.fingerprint, SETTINGS)
    base = tokens_of(60)
    tier = tiers(socket_timeout=0.3, backoff=(0.05, 0.2))
    assert tier.add(sc, base, filled(model, base), None) and tier.flush(10)
    redis_server.client().execute_command("CLIENT", "PAUSE", "3000", "ALL")
    t0 = time.monotonic()
    assert tier.find(sc, base + [1], None) is None  # no answer within the socket timeout: a miss
    took = time.monotonic() - t0
    assert 0.25 < took < 1.5
    assert tier.stats()["connected"] is False and tier.stats()["lookup_errors"] == 1
    t0 = time.monotonic()
    assert tier.find(sc, base + [1], None) is None  # backing off: no network at all
    assert time.monotonic() - t0 < 0.05
    time.sleep(3.2)  # the pause is over
    deadline = time.monotonic() + 5
    while tier.find(sc, base + [1], None) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tier.find(sc, base + [1], None)[1] == 60 and tier.stats()["connected"] is True


def slowed(fn):
    def run(*args):
        time.sleep(0.03)
        return fn(*args)

    return run


def test_racing_writers_never_give_a_reader_a_wrong_value(llama_model, tiers):
    model, _ = llama_model
    sc = make_scope(model.fingerprint, SETTINGS)
    base = tokens_of(120)
    cache, want = filled(model, base), arrays(filled(model, base))
    writers = [tiers(chunk_bytes=size, queue_size=8) for size in (30_000, 45_000, 1 << 20)]
    for w in writers:
        w._known = lambda eid: False  # write every time, as replicas that never saw the entry would
        w.writer._write_chunks = slowed(w.writer._write_chunks)  # so that reads fall between publishes
        for _ in range(6):  # serialized here (MLX work stays on this thread), published by the writer threads
            assert w.add(sc, base, cache, None)
    reader, reads, versions = tiers(), 0, set()
    while any(w.writer.pending() for w in writers) or reads < 3:  # read while they publish
        found = reader.find(sc, base + [1], None)
        got = found and reader.fetch(found[0], sc, make_prompt_cache(model))
        if got:
            reads += 1
            versions.add(found[0].payload.version)
            assert all(np.array_equal(x, y) for x, y in zip(arrays(got), want))
    assert len(versions) > 1  # the reader saw the entry replaced under it
    assert reader.stats()["corrupt"] == 0 and sum(w.stats()["added"] for w in writers) == 18
