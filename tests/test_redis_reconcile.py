"""The Redis tier's reconcile pass against a real redis-server: entries Redis
drops on its own (TTL, eviction) give their blocks and chunks back, blocks
other entries hold and chunks of live or in-flight entries stay, counts and
``P:kbytes`` end equal to what Redis really holds, a block gone behind the
tier's back is a miss, and passes racing replicas' writes and deletes never
undercount a block nor take a published entry's chunks."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("redis")

from redis_server import redis_server, tier_factory  # noqa: E402,F401  (fixture)

from mlx_chatcache.cache import KVCache, make_prompt_cache  # noqa: E402
from mlx_chatcache.store.chain import Chain  # noqa: E402
from store_helpers import arrays, scope  # noqa: E402
from test_redis_blocks import BLOCK, KV, fetched, keys  # noqa: E402

HOUR = 3600.0  # a reconcile period no test waits for: passes run when a test asks


@pytest.fixture
def tiers(redis_server):  # noqa: F811
    make, close_all = tier_factory(redis_server.url, BLOCK)
    yield make
    close_all()


def listed(client) -> dict[str, int]:
    """``{hash: live manifests listing it}``."""
    out: dict[str, int] = {}
    for k in keys(client, "m"):
        for h in json.loads(client.get(k)).get("blocks", ()):
            out[h] = out.get(h, 0) + 1
    return out


def assert_consistent(client, ns):
    """Every listed block has a value and its count is its holders; no other value
    is stored; ``P:kbytes`` is the bytes of the values stored."""
    held = listed(client)
    assert {k.rsplit(":", 1)[1] for k in keys(client, "k")} == set(held)
    assert {k.rsplit(":", 1)[1] for k in keys(client, "r")} == set(held)
    assert {h: int(client.hget(f"mlxcc:r:{ns}:{h}", "n")) for h in held} == held
    assert int(client.get("mlxcc:kbytes") or 0) == sum(client.strlen(k) for k in keys(client, "k"))


def manifest_key(client, tokens, ns):
    eid = Chain(ns, tokens, BLOCK).entry_id(len(tokens))
    return f"mlxcc:m:{ns}:{eid}"


def stored_tier(llama_model, tiers, redis_server, n):
    """A tier holding ``n`` conversations, written: (model, client, namespace, tier, conversations)."""
    model, _ = llama_model
    kv, client = KV(model), redis_server.client()
    tier = tiers(reconcile_seconds=HOUR)
    convs = [kv.conversation(i) for i in range(n)]
    for tokens, cache in convs:
        assert tier.add(scope(model), tokens, cache, None) and tier.flush(30)
    return model, client, scope(model).namespace, tier, convs


@contextlib.contextmanager
def racing_passes(replica):
    """Reconcile passes run back to back on ``replica`` while the block runs; yields their reports."""
    stop, passes = threading.Event(), []

    def run():
        while not stop.is_set():
            passes.append(replica.writer.reconcile())

    racer = threading.Thread(target=run)
    racer.start()
    try:
        yield passes
    finally:
        stop.set()
        racer.join(60)


def test_entries_redis_dropped_give_back_their_blocks_and_shared_ones_stay(llama_model, tiers, redis_server):  # noqa: F811
    model, client, ns, tier, convs = stored_tier(llama_model, tiers, redis_server, 3)
    own = [set(Chain(ns, t, BLOCK).hashes[15:]) for t, _ in convs]
    shared = set(Chain(ns, convs[0][0], BLOCK).hashes[:15])
    client.delete(manifest_key(client, convs[0][0], ns))  # evicted by Redis (maxmemory)
    client.pexpire(manifest_key(client, convs[1][0], ns), 1)  # expired (TTL)
    time.sleep(0.05)
    assert len(keys(client, "m")) == 1
    assert int(client.hget(f"mlxcc:r:{ns}:{min(shared)}", "n")) == 3  # held by entries that are gone
    report = tier.writer.reconcile()
    assert report.freed == len(own[0] | own[1]) == 6 and report.forgotten == 2
    left = {k.rsplit(":", 1)[1] for k in keys(client, "k")}
    assert left == shared | own[2]
    assert all(int(client.hget(f"mlxcc:r:{ns}:{h}", "n")) == 1 for h in shared)
    assert_consistent(client, ns)
    assert client.zcard("mlxcc:lru") == client.hlen("mlxcc:meta") == 1
    got = fetched(tier, model, convs[2][0])
    assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(convs[2][1])))
    # the counts are right: deleting the last entry frees every block and every byte
    last = tier.find(scope(model), convs[2][0] + [1], None)[0]
    assert tier.writer.submit(lambda: tier.writer.discard(last.payload)) and tier.flush(10)
    assert keys(client, "k") == keys(client, "r") == [] and int(client.get("mlxcc:kbytes")) == 0
    assert tier.writer.reconcile().freed == 0  # nothing left to do


def test_a_block_gone_behind_the_tiers_back_is_a_miss_and_kbytes_is_corrected(llama_model, tiers, redis_server):  # noqa: F811
    model, client, ns, tier, convs = stored_tier(llama_model, tiers, redis_server, 2)
    passes = tier.stats()["reconciles"]
    gone = Chain(ns, convs[0][0], BLOCK).hashes[16]  # only the first conversation holds it
    size = client.strlen(f"mlxcc:k:{ns}:{gone}")
    client.delete(f"mlxcc:k:{ns}:{gone}")  # evicted by Redis: P:kbytes still counts it
    stored = sum(client.strlen(k) for k in keys(client, "k"))
    assert int(client.get("mlxcc:kbytes")) == stored + size
    client.delete("mlxcc:reconcile")  # the period has passed
    found = tier.find(scope(model), convs[0][0] + [1], None)
    assert found[0].tokens == tuple(convs[0][0])
    assert tier.fetch(found[0], scope(model), make_prompt_cache(model)) is None
    assert tier.stats()["missing"] == 1 and tier.flush(10)
    assert tier.stats()["reconciles"] == passes + 1  # the miss called for a pass
    assert tier.writer.last_pass.kbytes_drift == size  # the discard freed the other blocks' bytes itself
    assert_consistent(client, ns)
    assert len(keys(client, "m")) == 1
    # a value gone with no reader noticing: the next pass corrects P:kbytes
    other = Chain(ns, convs[1][0], BLOCK).hashes[0]
    size = client.strlen(f"mlxcc:k:{ns}:{other}")
    client.delete(f"mlxcc:k:{ns}:{other}")
    report = tier.writer.reconcile()
    assert report.kbytes_drift == size and report.kbytes == sum(client.strlen(k) for k in keys(client, "k"))
    assert client.hget(f"mlxcc:r:{ns}:{other}", "crc") is None  # rewritten with its own checksum
    assert int(client.hget(f"mlxcc:r:{ns}:{other}", "n")) == 1
    found = tier.find(scope(model), convs[1][0] + [1], None)
    assert tier.fetch(found[0], scope(model), make_prompt_cache(model)) is None  # a miss, never a wrong value
    # writing the conversation again (another replica) stores the block again and it is served
    assert tier.flush(10) and keys(client, "k") == []
    again = tiers(reconcile_seconds=HOUR)
    assert again.add(scope(model), *convs[1], None) and again.flush(30)
    got = fetched(tier, model, convs[1][0])
    assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(convs[1][1])))
    assert_consistent(client, ns)


def test_a_manifest_gone_at_lookup_calls_for_a_pass(llama_model, tiers, redis_server):  # noqa: F811
    model, client, ns, tier, [(tokens, cache)] = stored_tier(llama_model, tiers, redis_server, 1)
    client.delete(manifest_key(client, tokens, ns), "mlxcc:reconcile")
    assert tier.find(scope(model), tokens + [1], None) is None and tier.flush(10)
    assert keys(client, "k") == [] and int(client.get("mlxcc:kbytes")) == 0
    # one pass per period across replicas: another replica's notice waits for the next one
    writer = tiers(reconcile_seconds=HOUR)
    assert writer.add(scope(model), tokens, cache, None) and writer.flush(30)
    client.delete(manifest_key(client, tokens, ns))
    other = tiers(reconcile_seconds=HOUR)
    assert other.find(scope(model), tokens + [1], None) is None and other.flush(10)
    assert len(keys(client, "k")) == 18 and other.stats()["reconciles"] == 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from(["put", "drop", "lose_block", "lose_refs"]), st.integers(0, 4)),
                      min_size=1, max_size=10))  # fmt: skip
def test_random_puts_and_losses_end_consistent(llama_model, tiers, redis_server, steps):  # noqa: F811
    model, _ = llama_model
    kv, client = KV(model), redis_server.client()
    client.flushall()
    ns = scope(model).namespace
    tier = tiers(reconcile_seconds=HOUR)
    convs = [kv.conversation(i, unique=70) for i in range(5)]
    for op, i in steps:
        tokens, cache = convs[i]
        h = Chain(ns, tokens, BLOCK).hashes[i % 2 + 14]  # a shared block or one of its own
        if op == "put":
            assert tier.add(scope(model), tokens, cache, None) and tier.flush(30)
        elif op == "drop":
            client.delete(manifest_key(client, tokens, ns))
        elif op == "lose_block":
            client.delete(f"mlxcc:k:{ns}:{h}")
        else:
            client.delete(f"mlxcc:r:{ns}:{h}")
    tier.writer.reconcile()
    for k in keys(client, "k"):  # a value kept is a value that can be served
        assert client.hget(k.replace(":k:", ":r:"), "crc") is not None
    held = listed(client)
    assert {k.rsplit(":", 1)[1] for k in keys(client, "k")} <= set(held)
    assert {h: int(client.hget(f"mlxcc:r:{ns}:{h}", "n") or 0) for h in held} == held
    assert int(client.get("mlxcc:kbytes") or 0) == sum(client.strlen(k) for k in keys(client, "k"))
    for tokens, cache in convs:  # every entry left is served exactly or is a miss
        found = tier.find(scope(model), tokens + [1], None)
        if found and found[0].tokens == tuple(tokens):
            got = tier.fetch(found[0], scope(model), make_prompt_cache(model))
            assert got is None or all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(cache)))
    assert tier.flush(10)
    for tokens, _ in convs:  # then dropping every entry frees every block
        found = tier.find(scope(model), tokens + [1], None)
        if found:
            tier.writer.discard(found[0].payload)
    assert keys(client, "m") == [] and keys(client, "k") == [] and keys(client, "r") == []
    assert int(client.get("mlxcc:kbytes") or 0) == 0


def test_passes_racing_replicas_never_miscount(llama_model, tiers, redis_server):  # noqa: F811
    model, _ = llama_model
    kv, client = KV(model), redis_server.client()
    ns = scope(model).namespace
    replicas = [tiers(queue_size=16, reconcile_seconds=HOUR) for _ in range(3)]
    convs = [kv.conversation(i, unique=40) for i in range(12)]
    with racing_passes(replicas[2]) as passes:
        for i, (tokens, cache) in enumerate(convs):
            assert replicas[i % 3].add(scope(model), tokens, cache, None)
        assert all(t.flush(60) for t in replicas)
        for k, i in enumerate(range(0, 12, 3)):  # each replica in turn deletes, the next one adds
            m = replicas[k % 3].find(scope(model), convs[i][0] + [1], None)[0].payload
            w = replicas[k % 3].writer
            w.submit(lambda m=m, w=w: w.discard(m))
            t, c = kv.conversation(100 + i, unique=40)
            replicas[(k + 1) % 3].add(scope(model), t, c, None)
        assert all(t.flush(60) for t in replicas)
    assert len(passes) >= 2 and sum(t.stats()["write_errors"] for t in replicas) == 0
    assert len(keys(client, "m")) == 12
    assert_consistent(client, ns)
    for tokens, cache in convs[1:3]:
        got = fetched(replicas[1], model, tokens)
        assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(cache)))


def test_a_value_being_published_is_left_alone_for_its_grace_period(tiers, redis_server):  # noqa: F811
    from mlx_chatcache.files.checksum import crc32
    from mlx_chatcache.store.redis_layout import GRACE

    client, tier = redis_server.client(), tiers(reconcile_seconds=HOUR, ttl=1000)
    value, h = b"\x01" * 64, "a" * 32
    client.set(f"mlxcc:k:ns:{h}", value, ex=1000 + GRACE)  # written, its manifest not published yet
    client.hset(f"mlxcc:r:ns:{h}", "crc", crc32(value))
    client.incrby("mlxcc:kbytes", len(value))
    assert tier.writer.reconcile().freed == 0 and client.exists(f"mlxcc:k:ns:{h}")
    client.pexpire(f"mlxcc:k:ns:{h}", 1000 * 1000 - 1)  # written more than GRACE seconds ago: abandoned
    report = tier.writer.reconcile()
    assert report.freed == 1 and report.kbytes == 0 and keys(client, "k") == keys(client, "r") == []


def test_an_entry_and_its_extension_published_back_to_back_keep_their_blocks_while_passes_race(
        llama_model, tiers, redis_server):  # noqa: F811
    """A request's prompt, then its prompt and reply, published one after the other by one
    replica while another runs passes: the extension replaces the prompt's entry, keeps every
    block, and is served whole to the other replica."""
    model, _ = llama_model
    kv, client = KV(model), redis_server.client()
    ns = scope(model).namespace
    writer, other = tiers(queue_size=64, reconcile_seconds=HOUR), tiers(reconcile_seconds=HOUR)
    finals = [kv.conversation(i, unique=150) for i in range(8)]
    with racing_passes(other) as passes:
        for i, (tokens, cache) in enumerate(finals):
            n = len(tokens) - 90  # the prompt: a prefix ending inside a block
            prompt = [KVCache.from_flat_state([a[:, :, :n] for a in c.flat_state()], (str(n),)) for c in cache]
            assert writer.add(scope(model), tokens[:n], prompt, None)
            assert writer.add(scope(model), tokens, cache, f"conversation {i}")
        assert writer.flush(60)
    other.writer.reconcile()
    assert len(passes) >= 2 and len(keys(client, "m")) == len(finals)
    assert_consistent(client, ns)
    for tokens, cache in finals:
        got = fetched(other, model, tokens)
        assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(cache)))
    assert other.stats()["missing"] == other.stats()["corrupt"] == 0


def aged(tier, then=None):
    """Make ``tier``'s writer write and publish chunks that look written more than GRACE seconds
    ago (a pass may delete them as soon as their manifest is gone); ``then(m)`` runs
    after each such write, before the manifest is published."""
    real, real_publish, calls = tier.writer._write_chunks, tier.writer._publish, []

    def age(r, m):
        for k in tier.keys.chunks(m):
            r.pexpire(k, tier.ttl * 1000 - 1)

    def write(r, m, chunks):
        real(r, m, chunks)
        age(r, m)
        calls.append(m)
        if then is not None:
            then(m)

    def publish(r, m, *args):
        replaced = real_publish(r, m, *args)
        age(r, m)  # those written again in the transaction too
        return replaced

    tier.writer._write_chunks, tier.writer._publish = write, publish
    return calls


def chunks_of(client, ns, tokens) -> list[str]:
    eid = Chain(ns, tokens, BLOCK).entry_id(len(tokens))
    return [k for k in keys(client, "c") if k.startswith(f"mlxcc:c:{ns}:{eid}:")]


def assert_chunks_whole(client, ns):
    """Every manifest's chunks are there; any other chunk is on its way out (GRACE)."""
    from mlx_chatcache.store.redis_layout import GRACE

    live = set()
    for k in keys(client, "m"):
        m = json.loads(client.get(k))
        own = [f"mlxcc:c:{ns}:{m['eid']}:{m['version']}:{j}" for j in range(len(m["chunk_sizes"]))]
        assert client.exists(*own) == len(own), k
        live.update(own)
    for k in set(keys(client, "c")) - live:
        assert 0 <= client.pttl(k) <= GRACE * 1000, k


def test_chunks_of_manifests_redis_dropped_are_freed_and_live_ones_kept(llama_model, tiers, redis_server):  # noqa: F811
    from mlx_chatcache.store.redis_layout import GRACE

    model, _ = llama_model
    kv, client, ns = KV(model), redis_server.client(), scope(model).namespace
    tier = tiers(reconcile_seconds=HOUR, chunk_bytes=20_000)  # tails of several chunks
    whole = tiers(reconcile_seconds=HOUR, chunk_bytes=1 << 20, share_blocks=False)  # values stored whole
    aged(tier), aged(whole)
    convs = [kv.conversation(i) for i in range(4)]
    for t, (tokens, cache) in zip([tier, tier, whole, whole], convs):
        assert t.add(scope(model), tokens, cache, None) and t.flush(30)
    chunks = [chunks_of(client, ns, tokens) for tokens, _ in convs]
    assert all(chunks) and len(chunks[0]) > 1 and len(chunks[2]) > 1
    client.delete(manifest_key(client, convs[0][0], ns))  # evicted by Redis (maxmemory)
    client.delete(manifest_key(client, convs[2][0], ns))
    client.persist(chunks[2][0])  # a chunk without a TTL goes too
    report = tier.writer.reconcile()
    assert report.chunks_freed == len(chunks[0]) + len(chunks[2])
    assert tier.stats()["reclaimed_chunks"] == report.chunks_freed
    assert set(keys(client, "c")) == set(chunks[1] + chunks[3])
    assert_consistent(client, ns)
    assert_chunks_whole(client, ns)
    for t, (tokens, cache) in [(whole, convs[1]), (tier, convs[3])]:
        got = fetched(t, model, tokens)
        assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(cache)))
    # kept: the chunks of a manifest not published yet (written less than GRACE seconds ago)
    # and those of a deleted entry, readable for GRACE seconds by readers in flight
    fresh = tiers(reconcile_seconds=HOUR)
    assert fresh.add(scope(model), *convs[0], None) and fresh.flush(30)
    client.delete(manifest_key(client, convs[0][0], ns))
    found = tier.find(scope(model), convs[1][0] + [1], None)[0]
    assert tier.writer.submit(lambda: tier.writer.discard(found.payload)) and tier.flush(10)
    assert all(0 < client.pttl(k) <= GRACE * 1000 for k in chunks[1])
    kept = set(keys(client, "c"))
    assert tier.writer.reconcile().chunks_freed == 0 and set(keys(client, "c")) == kept
    assert kept == set(chunks[1] + chunks[3] + chunks_of(client, ns, convs[0][0]))


def test_a_pass_between_a_chunk_write_and_its_publish_never_loses_the_entry(llama_model, tiers, redis_server):  # noqa: F811
    """A writer slower than GRACE: a pass deletes its chunks before the manifest is
    published, and again after any write of them outside the publish's transaction;
    the publish writes them again inside it, and the entry is served."""
    model, _ = llama_model
    kv, client, ns = KV(model), redis_server.client(), scope(model).namespace
    other = tiers(reconcile_seconds=HOUR)
    writer = tiers(reconcile_seconds=HOUR)
    passes = []
    calls = aged(writer, then=lambda m: passes.append(other.writer.reconcile()))
    tokens, cache = kv.conversation(0)
    assert writer.add(scope(model), tokens, cache, None) and writer.flush(30)
    assert passes[0].chunks_freed == len(calls[0].chunk_sizes) and len(passes) == len(calls) == 1
    assert writer.stats()["write_errors"] == 0 and writer.stats()["added"] == 1
    got = fetched(other, model, tokens)
    assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(cache)))
    assert other.stats()["missing"] == other.stats()["corrupt"] == 0
    assert_chunks_whole(client, ns)


def test_passes_racing_replicas_never_lose_a_published_entrys_chunks(llama_model, tiers, redis_server):  # noqa: F811
    model, _ = llama_model
    kv, client = KV(model), redis_server.client()
    ns = scope(model).namespace
    replicas = [tiers(queue_size=16, reconcile_seconds=HOUR, chunk_bytes=20_000) for _ in range(3)]
    for t in replicas:
        aged(t)  # every chunk written is one a pass may delete once its manifest is gone
    convs = [kv.conversation(i, unique=40) for i in range(12)]
    added = [kv.conversation(100 + i, unique=40) for i in range(0, 12, 3)]
    with racing_passes(replicas[2]) as passes:
        for i, (tokens, cache) in enumerate(convs):
            assert replicas[i % 3].add(scope(model), tokens, cache, None)
        assert all(t.flush(60) for t in replicas)
        for k, i in enumerate(range(0, 12, 3)):  # deletes, entries Redis drops, new publishes, racing the passes
            m = replicas[k % 3].find(scope(model), convs[i][0] + [1], None)[0].payload
            w = replicas[k % 3].writer
            w.submit(lambda m=m, w=w: w.discard(m))
            client.delete(manifest_key(client, convs[i + 1][0], ns))
            replicas[(k + 1) % 3].add(scope(model), *added[k], None)
        assert all(t.flush(60) for t in replicas)
    assert len(passes) >= 2 and sum(t.stats()["write_errors"] for t in replicas) == 0
    replicas[2].writer.reconcile()
    assert len(keys(client, "m")) == 12 - 4 - 4 + 4
    assert_consistent(client, ns)
    assert_chunks_whole(client, ns)
    for tokens, _ in [convs[i + 1] for i in range(0, 12, 3)]:
        assert chunks_of(client, ns, tokens) == []  # dropped by Redis: the passes freed their chunks
    reader = tiers(reconcile_seconds=HOUR)
    for tokens, cache in [convs[i] for i in range(12) if i % 3 == 2] + added:
        got = fetched(reader, model, tokens)
        assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(cache)))
    assert reader.stats()["missing"] == reader.stats()["corrupt"] == 0


def test_a_touch_of_a_version_replaced_meanwhile_leaves_its_chunks_to_their_grace(llama_model, tiers, redis_server):  # noqa: F811
    """A hit's touch reads the entry's version, then another replica publishes the entry
    again before the touch lands: the touch does nothing, so the old version's chunks
    still expire within GRACE."""
    from mlx_chatcache.store import redis_writer
    from mlx_chatcache.store.redis_layout import GRACE

    model, _ = llama_model
    kv, client, ns = KV(model), redis_server.client(), scope(model).namespace
    reader, other = tiers(reconcile_seconds=HOUR), tiers(reconcile_seconds=HOUR)
    tokens, cache = kv.conversation(0)
    assert reader.add(scope(model), tokens, cache, None) and reader.flush(30)
    m = reader.find(scope(model), tokens + [1], None)[0].payload
    old_chunks, armed, real = chunks_of(client, ns, tokens), [True], redis_writer.decode_manifest

    def decode(*args):
        got = real(*args)
        if armed and armed.pop():  # between the touch's read and its writes
            assert other.add(scope(model), tokens, cache, None) and other.flush(30)
        return got

    redis_writer.decode_manifest = decode
    try:
        reader.writer.touch(m)
    finally:
        redis_writer.decode_manifest = real
    assert not armed and json.loads(client.get(manifest_key(client, tokens, ns)))["version"] != m.version
    assert old_chunks and all(client.pttl(k) <= GRACE * 1000 for k in old_chunks)
    got = fetched(reader, model, tokens)
    assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(cache)))


def test_block_values_a_pass_frees_before_their_publish_are_written_again_in_it(llama_model, tiers, redis_server):  # noqa: F811
    """A writer slower than GRACE: a pass frees the block values it wrote (no manifest
    lists them yet) before its manifest is published; the publish writes them again in
    its transaction, counts their bytes once, and the entry is served."""
    model, _ = llama_model
    kv, client, ns = KV(model), redis_server.client(), scope(model).namespace
    other, writer = tiers(reconcile_seconds=HOUR), tiers(reconcile_seconds=HOUR)
    real, passes = writer.writer._write_values, []

    def write_values(r, ns_, values):
        real(r, ns_, values)
        for h in values:  # written more than GRACE seconds ago
            r.pexpire(writer.keys.value(ns_, h), writer.ttl * 1000 - 1)
        passes.append(other.writer.reconcile())

    writer.writer._write_values = write_values
    tokens, cache = kv.conversation(0)
    assert writer.add(scope(model), tokens, cache, None) and writer.flush(30)
    assert len(passes) == 1 and passes[0].freed == len(Chain(ns, tokens, BLOCK).hashes) > 0
    assert writer.stats()["write_errors"] == 0 and writer.stats()["added"] == 1
    assert_consistent(client, ns)
    got = fetched(other, model, tokens)
    assert all(np.array_equal(x, y) for x, y in zip(arrays(got), arrays(cache)))
    assert other.stats()["missing"] == other.stats()["corrupt"] == 0
