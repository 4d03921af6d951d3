"""The prompt-cache store with real caches: memory and disk tiers, restarts,
corrupt files, budgets, and that a hit continues exactly like a fresh prefill."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from loop_helpers import forward

from mlx_chatcache.cache import make_prompt_cache
from mlx_chatcache.config import CacheShape
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.prompt import reuse_prefix
from mlx_chatcache.generation.templates import feed_all
from mlx_chatcache.store.store import PromptStore
from mlx_chatcache.store.disk import DiskTier
from mlx_chatcache.store.tiers import MemoryTier, make_scope
from store_helpers import checked_out, tokens_of

SETTINGS = {"max_kv_size": None, "keep": 4}


def filled(model, tokens):
    state = PromptCache.new(model)
    feed_all(model, state, tokens, 512)
    return state


def scope(model):
    return make_scope(model.fingerprint, SETTINGS)


def next_logits(model, state, prompt):
    """Logits after feeding what ``state`` lacks of ``prompt`` (state reused as in generate)."""
    reused = reuse_prefix(state, prompt, model)
    return forward(model, state.cache, prompt[reused:]), reused


def arrays(cache):
    return [np.array(a) for c in cache for a in c.flat_state()]


def test_memory_hit_continues_like_a_fresh_prefill(llama_model):
    model, _ = llama_model
    base = tokens_of(40)
    store = PromptStore([MemoryTier(1 << 30)])
    store.put(scope(model), base, filled(model, base).cache)
    prompt = base[:25] + tokens_of(10, start=100)
    got = checked_out(store, scope(model), model, prompt)
    assert got.served == 25 and got.tier == "memory" and got.tokens == base
    warm, reused = next_logits(model, PromptCache(got.cache, got.tokens), prompt)
    cold, _ = next_logits(model, PromptCache.new(model), prompt)
    assert reused == 25
    np.testing.assert_allclose(np.array(warm), np.array(cold), atol=1e-4)
    # the stored entry did not change when the checked-out copy was trimmed and fed
    again = checked_out(store, scope(model), model, base + [5])
    assert again.served == 40
    np.testing.assert_array_equal(arrays(again.cache), arrays(filled(model, base).cache))


def test_no_hit_for_another_model_or_shape(llama_model, make_tiny_model):
    model, _ = llama_model
    other, _ = make_tiny_model("llama", seed=1)
    base = tokens_of(20)
    store = PromptStore([MemoryTier(1 << 30)])
    store.put(scope(model), base, filled(model, base).cache)
    assert checked_out(store, scope(other), other, base + [1]) is None
    rotating = make_scope(model.fingerprint, {"max_kv_size": 64, "keep": 4})
    assert checked_out(store, rotating, model, base + [1]) is None


def test_disk_tier_survives_a_new_instance(llama_model, tmp_path):
    model, _ = llama_model
    base = tokens_of(30)
    state = filled(model, base)
    want = arrays(state.cache)
    DiskTier(tmp_path, 1 << 30).add(scope(model), base, state.cache, key="conv-1")
    disk = DiskTier(tmp_path, 1 << 30)  # a restarted server
    store = PromptStore([MemoryTier(1 << 30), disk])
    got = checked_out(store, scope(model), model, base + tokens_of(5, 200))
    assert got.tier == "disk" and got.served == 30 and got.tokens == base
    assert [a.shape for a in arrays(got.cache)] == [a.shape for a in want]
    np.testing.assert_array_equal(arrays(got.cache), want)
    entry = disk.index.entries()[0]
    assert entry.key == "conv-1" and entry.trimmable
    assert disk.stats()["hits"] == 1 and disk.stats()["corrupt"] == 0


def test_corrupt_disk_entries_are_skipped_and_counted(llama_model, tmp_path):
    """Files the scan cannot prove to be store entries are skipped and kept (foreign);
    an entry damaged after it was indexed is dropped, counted and, still ours by its
    header, deleted."""
    model, _ = llama_model
    a, b = tokens_of(20), tokens_of(24, start=50)
    disk = DiskTier(tmp_path, 1 << 30)
    disk.add(scope(model), a, filled(model, a).cache, key=None)
    disk.add(scope(model), b, filled(model, b).cache, key=None)
    (tmp_path / "junk.safetensors").write_bytes(b"not a cache")
    path_b = disk.index.get(scope(model).namespace, tuple(b)).payload
    raw = bytearray(path_b.read_bytes())
    path_b.write_bytes(bytes(raw[: len(raw) // 2]))  # truncated: header claims more than is there
    restarted = DiskTier(tmp_path, 1 << 30)
    assert restarted.stats()["foreign"] == 2 and restarted.stats()["corrupt"] == 0 and len(restarted.index) == 1
    assert path_b.exists() and (tmp_path / "junk.safetensors").exists()
    # damaged after it was indexed: the lookup falls back (here: to nothing) and counts it
    path_a = restarted.index.entries()[0].payload
    data = bytearray(path_a.read_bytes())
    data[-64:] = b"\xff" * 64  # array bytes only: the header still parses
    path_a.write_bytes(bytes(data[:-8]))
    store = PromptStore([restarted])
    assert checked_out(store, scope(model), model, a + [9]) is None
    assert restarted.stats()["corrupt"] == 1 and len(restarted.index) == 0
    assert path_a.exists()  # its header no longer matches its size: not provably ours, kept
    # an intact entry that does not fit (here: one layer fewer expected) is ours: dropped and deleted
    c = tokens_of(16, start=90)
    restarted.add(scope(model), c, filled(model, c).cache, key=None)
    entry = restarted.index.get(scope(model).namespace, tuple(c))
    assert restarted.fetch(entry, scope(model), make_prompt_cache(model)[:-1]) is None
    assert restarted.stats()["corrupt"] == 2 and not entry.payload.exists()
    assert DiskTier(tmp_path, 1 << 30).stats()["foreign"] == 3  # junk, b and a: all still there


def test_disk_budget_evicts_least_recently_used_files(llama_model, tmp_path):
    model, _ = llama_model
    seqs = [tokens_of(20, start=s) for s in (10, 60, 110)]
    size = None
    probe = DiskTier(tmp_path / "probe", 1 << 30)
    probe.add(scope(model), seqs[0], filled(model, seqs[0]).cache, None)
    size = probe.index.nbytes
    disk = DiskTier(tmp_path / "d", 2 * size + size // 2)
    for s in seqs[:2]:
        assert disk.add(scope(model), s, filled(model, s).cache, None)
    assert disk.fetch(disk.index.get(scope(model).namespace, tuple(seqs[0])), scope(model), make_prompt_cache(model))
    assert disk.add(scope(model), seqs[2], filled(model, seqs[2]).cache, None)  # evicts seqs[1]
    files = sorted(p.name for p in (tmp_path / "d").glob("*.safetensors"))
    assert len(files) == 2 and disk.index.get(scope(model).namespace, tuple(seqs[1])) is None
    assert sum(p.stat().st_size for p in (tmp_path / "d").glob("*.safetensors")) <= disk.index.budget
    # the restarted tier keeps the same two, in the same recency order
    again = DiskTier(tmp_path / "d", disk.index.budget)
    assert [e.tokens for e in again.index.entries()] == [e.tokens for e in disk.index.entries()]


def test_longer_entry_replaces_its_prefixes(llama_model, tmp_path):
    model, _ = llama_model
    turn1 = tokens_of(20)
    turn2 = turn1 + tokens_of(15, start=150)
    store = PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)])
    store.put(scope(model), turn1, filled(model, turn1).cache, key="c")
    store.put(scope(model), turn2, filled(model, turn2).cache, key="c")
    for tier in store.tiers:
        assert [e.tokens for e in tier.index.entries()] == [tuple(turn2)]
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    got = checked_out(store, scope(model), model, turn1 + [7, 8])
    assert got.served == 20 and got.tokens == turn2  # served by trimming the longer entry
    # a prefix of a stored trimmable entry adds nothing: it is served already
    assert store.put(scope(model), turn1, filled(model, turn1).cache, key="c") == {"disk": True, "memory": True}
    for tier in store.tiers:
        assert [e.tokens for e in tier.index.entries()] == [tuple(turn2)]


def test_memory_budget_counts_cache_bytes(llama_model):
    model, _ = llama_model
    one = filled(model, tokens_of(10)).cache
    size = sum(c.nbytes for c in one) * 10 // (-10 % 256 + 10)  # live tokens only: 10 of 256 slots
    tier = MemoryTier(int(size * 2.5))
    for s in (10, 60, 110):
        tier.add(scope(model), tokens_of(10, start=s), filled(model, tokens_of(10, start=s)).cache, None)
        assert tier.index.nbytes <= tier.index.budget
    assert len(tier.index) == 2 and tier.stats()["evicted"] == 1
    big = filled(model, tokens_of(300)).cache  # larger than the whole budget: refused, evicts nothing
    assert not tier.add(scope(model), tokens_of(300), big, None)
    assert len(tier.index) == 2 and tier.stats()["refused"] == 1


@pytest.mark.parametrize("kind", ["hybrid", "ssm"])
def test_untrimmable_entries_serve_only_their_own_prefix(tiny_model_dirs, kind):
    from mlx_chatcache.models.loading import load

    model, _ = load(str(tiny_model_dirs[kind]))
    base = tokens_of(20)
    store = PromptStore([MemoryTier(1 << 30)])
    store.put(scope(model), base, filled(model, base).cache)
    assert checked_out(store, scope(model), model, base[:10] + [1, 2]) is None
    prompt = base + tokens_of(6, start=33)
    got = checked_out(store, scope(model), model, prompt)
    assert got.served == 20
    warm, reused = next_logits(model, PromptCache(got.cache, got.tokens), prompt)
    cold, _ = next_logits(model, PromptCache.new(model), prompt)
    assert reused == 20
    np.testing.assert_allclose(np.array(warm), np.array(cold), atol=1e-4)
    mx.eval(warm)


def test_deferred_file_writes_wait_for_flush(llama_model, tmp_path):
    model, _ = llama_model
    a, b = tokens_of(20), tokens_of(24, start=50)
    store = PromptStore([MemoryTier(1 << 30, block_tokens=0), DiskTier(tmp_path, 1 << 30)])
    state = filled(model, a)
    want = arrays(state.cache)
    assert store.put(scope(model), a, state.cache, defer=True) == {"memory": True, "disk": None}
    store.put(scope(model), b, filled(model, b).cache, defer=True)
    assert not list(tmp_path.glob("*.safetensors")) and len(store.pending) == 2
    assert store.flush(keep=1) == 1 and len(list(tmp_path.glob("*.safetensors"))) == 1
    # a pending write's cache serves lookups even when the memory tier no longer has it
    mem = store.tiers[0]
    mem.index.remove(mem.index.get(scope(model).namespace, tuple(b)))
    got = checked_out(store, scope(model), model, b + [3])
    assert got.tier == "pending" and got.served == 24
    store.flush()
    restarted = PromptStore([DiskTier(tmp_path, 1 << 30)])
    got = checked_out(restarted, scope(model), model, a + [1])
    assert got.served == 20
    np.testing.assert_array_equal(arrays(got.cache), want)
    # the memory entry was shared with the pending write and is still compact and unchanged
    entry = store.tiers[0].index.get(scope(model).namespace, tuple(a))
    np.testing.assert_array_equal(arrays(entry.payload), want)
    assert entry.nbytes == sum(c.nbytes for c in entry.payload)


def test_a_memory_only_put_leaves_the_files_alone(llama_model, tmp_path):
    model, _ = llama_model
    a = tokens_of(20)
    store = PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)])
    assert store.put(scope(model), a, filled(model, a).cache, defer=True, memory_only=True) == {"memory": True}
    assert not store.pending and store.flush() == 0 and not list(tmp_path.glob("*.safetensors"))
    got = checked_out(store, scope(model), model, a + [1])
    assert got.tier == "memory" and got.served == 20


@pytest.mark.parametrize("kind,bits", [("sliding", None), ("llama", 4)])
def test_rotating_and_quantized_caches_round_trip_through_both_tiers(tiny_model_dirs, tmp_path, kind, bits):
    from mlx_chatcache.cache import quantize_prompt_cache
    from mlx_chatcache.models.loading import load

    model, _ = load(str(tiny_model_dirs[kind]))
    base = tokens_of(12)  # inside the sliding window: still trimmable
    state = filled(model, base)
    if bits:
        quantize_prompt_cache(state.cache, 64, bits)
    want = arrays(state.cache)
    sc = make_scope(model.fingerprint, {**SETTINGS, "kv_bits": bits})
    mem = PromptStore([MemoryTier(1 << 30)])
    mem.put(sc, base, state.cache)
    PromptStore([DiskTier(tmp_path, 1 << 30)]).put(sc, base, state.cache)
    for store in (mem, PromptStore([DiskTier(tmp_path, 1 << 30)])):
        got = checked_out(store, sc, model, base + [5, 6])
        assert got.served == 12 and [type(c) for c in got.cache] == [type(c) for c in state.cache]
        got_arrays = arrays(got.cache)
        assert len(got_arrays) == len(want)
        for g, w in zip(got_arrays, want):  # an older file may carry room: compare the live part
            np.testing.assert_array_equal(g[..., : w.shape[-2], :] if g.ndim == 4 else g, w)


def test_temp_files_of_a_killed_writer_are_removed_when_the_disk_tier_opens(llama_model, tmp_path):
    """Entry names are content hashes, never written again: the scan is what removes a
    dead writer's temp file; a live writer's (ours, another process') is kept."""
    import os
    import subprocess
    import sys

    from mlx_chatcache.files.atomic import _HOST, TEMP_SUFFIX

    model, _ = llama_model
    DiskTier(tmp_path, 1 << 30).add(scope(model), tokens_of(20), make_prompt_cache(model), key=None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = [f".0a1b2c.safetensors.{_HOST}-{dead.pid}.abcdefgh{TEMP_SUFFIX}",
            f".ffee99.safetensors.{_HOST}-{dead.pid}.x_1y2z3w{TEMP_SUFFIX}"]  # fmt: skip
    kept = [f".0a1b2c.safetensors.{_HOST}-{os.getpid()}.abcdefgh{TEMP_SUFFIX}",
            f".0a1b2c.safetensors.{_HOST}-{os.getppid()}.abcdefgh{TEMP_SUFFIX}",
            f"0a1b2c.safetensors.{_HOST}-{dead.pid}.abcdefgh{TEMP_SUFFIX}"]  # fmt: skip
    for name in gone + kept:
        (tmp_path / name).write_bytes(b"x" * 100)
    restarted = DiskTier(tmp_path, 1 << 30)
    left = {p.name for p in tmp_path.iterdir()}
    assert not left & set(gone) and set(kept) <= left
    assert restarted.stats()["temp_removed"] == 2 and len(restarted.index) == 1


def test_a_running_disk_tier_finds_entries_another_process_adds(llama_model, tmp_path):
    """A server's disk tier serves an entry a command writes into its folder later
    (another DiskTier on the same folder, as ``generate --cache-dir`` makes), without
    a restart; a file another process removed is a miss, not a corrupt entry; the
    rescan happens at most once per ``rescan_seconds``."""
    model, _ = llama_model
    base = tokens_of(30)
    state = filled(model, base)
    query = base + tokens_of(5, 200)
    server = DiskTier(tmp_path, 1 << 30, rescan_seconds=0)
    throttled = DiskTier(tmp_path, 1 << 30, rescan_seconds=3600)
    store = PromptStore([server])
    assert checked_out(store, scope(model), model, query) is None
    DiskTier(tmp_path, None).add(scope(model), base, state.cache, key=None)  # the command
    got = checked_out(store, scope(model), model, query)
    assert got.tier == "disk" and got.served == 30 and got.tokens == base
    np.testing.assert_array_equal(arrays(got.cache), arrays(state.cache))
    assert throttled.find(scope(model), query, None) is None  # looked less than an hour ago
    for path in tmp_path.glob("*.safetensors"):
        path.unlink()  # another process evicted it
    assert checked_out(store, scope(model), model, query) is None
    assert server.stats()["corrupt"] == 0 and server.stats()["entries"] == 0


@pytest.mark.parametrize("tier", ["memory", "pending", "disk"])
def test_checkout_hands_out_one_prompt_cache(llama_model, tmp_path, tier):
    """A checkout is a PromptCache of the model and the shape asked, holding the entry's
    layers and exact token ids, with the tier it came from; a miss is an empty one of that shape."""
    model, _ = llama_model
    shape = CacheShape(max_kv_size=64, keep=6)
    sc = make_scope(model.fingerprint, shape.settings())
    base = tokens_of(30)
    stored = PromptCache.new(model, shape)
    feed_all(model, stored, base, 512)
    want = arrays(stored.cache)
    store = PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)])
    store.put(sc, base, stored.cache, defer=tier == "pending")
    if tier != "memory":
        mem = store.tiers[0]
        mem.index.remove(mem.index.get(sc.namespace, tuple(base)))
    got, where = store.checkout(sc, model, base[:20] + [7, 8], shape)
    assert where == tier and isinstance(got, PromptCache)
    assert got.shape == shape and got.fingerprint == model.fingerprint
    assert got.tokens == base and got.cache is not stored.cache
    assert [type(c) for c in got.cache] == [type(c) for c in stored.cache]
    np.testing.assert_array_equal(arrays(got.cache), want)
    assert reuse_prefix(got, base[:20] + [7, 8], model) == 20 and len(got.tokens) == 20
    miss, where = store.checkout(sc, model, tokens_of(10, start=200), shape)
    assert where is None and miss.tokens == [] and miss.shape == shape
    assert [type(c) for c in miss.cache] == [type(c) for c in stored.cache]
