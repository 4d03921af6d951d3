"""The prompt-cache store over its memory and disk tiers: what a checkout serves
(the leading run of shared blocks, then an exact tail; whole values for caches
that do not split), that it is exactly what was stored and continues like a fresh
prefill, that a missing or damaged value only shortens a hit, and that each tier
evicts by itself (LRU by bytes in memory, by modification time on disk), pins
included. Caches whose K/V are a function of token and position (``synthetic``)
make every comparison exact on any BLAS; real models check the hits end to end."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loop_helpers import forward

from mlx_chatcache.config import CacheShape
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.prompt import reuse_prefix
from mlx_chatcache.models.fingerprint import ModelFingerprint
from mlx_chatcache.store.disk import DiskTier
from mlx_chatcache.store.store import PromptStore, make_scope
from mlx_chatcache.store.tiers import MemoryTier, Pin
from store_helpers import SETTINGS, arrays, checked_out, filled, filled_state, served, synthetic, tokens_of

B = 8  # block tokens of these tests' stores
STUB = SimpleNamespace(layers=[None, None], fingerprint=ModelFingerprint("stub", "1" * 16, "2" * 16))
SC = make_scope(STUB.fingerprint, SETTINGS)


def tiers_of(kind, folder, budget=1 << 30):
    return [MemoryTier(budget)] if kind == "memory" else [DiskTier(folder, budget)]


def put(store, tokens, key=None, **kw):
    return store.put(SC, tokens, synthetic(tokens), key, **kw)


def hit(store, prompt):
    """``(served tokens, tier)`` of a checkout of ``prompt``; its arrays are checked to be
    exactly those of the tokens it holds (``synthetic``)."""
    state, tier = store.checkout(SC, STUB, prompt)
    n = len(state.tokens)
    assert state.tokens == prompt[:n] and n < len(prompt)
    if n:
        assert [c.keys.shape[2] for c in state.cache] == [256, 256]  # room to grow
        want = arrays(synthetic(state.tokens))
        assert all(np.array_equal(g[:, :, :n], w) for g, w in zip(arrays(state.cache), want))
    return n, tier


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_blocks_serve_any_shared_prefix_and_a_tail_only_a_prompt_it_starts(kind, tmp_path):
    store = PromptStore(tiers_of(kind, tmp_path), block_tokens=B)
    base = tokens_of(21)  # two blocks and a 5-token tail
    put(store, base)
    assert hit(store, base + [1]) == (21, kind)  # the tail is a prefix of the prompt: all of it
    assert hit(store, base[:19] + [1, 2]) == (16, kind)  # diverges inside the tail: the blocks
    assert hit(store, base[:12] + [1, 2]) == (8, kind)  # diverges inside block 2
    assert hit(store, base[:5] + [1, 2]) == (0, None)  # nothing shared whole
    assert hit(store, base[:17]) == (16, kind)  # the last prompt token is always fed
    other = base[:16] + tokens_of(3, start=200)  # shares both blocks: stores only its own tail
    put(store, other)
    assert store.tiers[0].stats()["blocks"] == 2 and store.tiers[0].stats()["entries"] == 2
    assert hit(store, other + [4]) == (19, kind)


@pytest.mark.parametrize("kind", ["memory", "disk"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=30), min_size=1, max_size=6),
       queries=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=34), min_size=1, max_size=6))  # fmt: skip
def test_random_entries_serve_what_the_rules_say_and_exactly_their_arrays(kind, tmp_path_factory, entries, queries):
    store = PromptStore(tiers_of(kind, tmp_path_factory.mktemp("s")), block_tokens=4)
    for e in entries:
        put(store, e)
    for q in queries:
        n, _ = hit(store, q)
        assert n == served(entries, q[:-1], 4)


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_missing_or_damaged_value_shortens_the_hit_and_never_raises(kind, tmp_path):
    store = PromptStore(tiers_of(kind, tmp_path), block_tokens=B)
    base = tokens_of(30)  # three blocks and a tail
    put(store, base)
    tier = store.tiers[0]
    from mlx_chatcache.store.chain import Chain

    keys = Chain(SC.namespace, base, B).blocks
    tier.drop(keys[1])  # gone (evicted): the run stops before it
    assert hit(store, base + [1]) == (8, kind)
    put(store, base)  # written again
    assert hit(store, base + [1]) == (30, kind)
    if kind == "disk":  # a flipped byte in block 3's K/V: caught by its checksum, dropped, counted
        path = tmp_path / f"{keys[2]}.safetensors"
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))
        assert hit(store, base + [1]) == (16, kind)
        assert tier.stats()["corrupt"] == 1 and not path.exists()
        (tmp_path / f"{keys[0]}.safetensors").write_bytes(b"not a value")
        assert hit(store, base + [1]) == (0, None)
        assert tier.stats()["corrupt"] == 2
        # a whole, valid value under another key is not that value
        os.replace(tmp_path / f"{keys[1]}.safetensors", tmp_path / f"{keys[0]}.safetensors")
        store = PromptStore([DiskTier(tmp_path, 1 << 30)], block_tokens=B)
        assert hit(store, base + [1]) == (0, None) and store.tiers[0].stats()["corrupt"] == 1


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_layers_of_several_head_sizes_are_put_together_exactly(kind, tmp_path):
    store = PromptStore(tiers_of(kind, tmp_path), block_tokens=B)
    base = tokens_of(30)
    store.put(SC, base, synthetic(base, dims=[4, 8]))
    state, tier = store.checkout(SC, STUB, base + [1])
    assert tier == kind and state.tokens == base
    for got, want in zip(arrays(state.cache), arrays(synthetic(base, dims=[4, 8]))):
        np.testing.assert_array_equal(got[:, :, :30], want)


def test_values_found_on_disk_are_kept_in_memory_and_a_restart_serves_them(tmp_path):
    base = tokens_of(30)
    put(PromptStore([DiskTier(tmp_path, 1 << 30)], block_tokens=B), base, key="conv")
    memory, disk = MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)  # a restarted server
    store = PromptStore([memory, disk], block_tokens=B)
    assert hit(store, base + [1]) == (30, "disk")
    assert hit(store, base + [1]) == (30, "memory")
    assert disk.stats()["hits"] == 4 and memory.stats()["entries"] == 1 and memory.stats()["blocks"] == 3


def test_conversations_sharing_a_prompt_store_its_blocks_once(tmp_path):
    system = tokens_of(40)  # five blocks
    store = PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)], block_tokens=B)
    for i in range(10):
        put(store, system + tokens_of(12, start=100 + 20 * i))
    for tier in store.tiers:
        s = tier.stats()
        assert s["blocks"] == 5 + 10 and s["entries"] == 10  # the shared five once, one own block and tail each
    one = len(next(iter(store.memory._values.values())).data)  # noqa: SLF001  (a value's bytes, for scale)
    assert store.memory.nbytes < 30 * one


def test_a_hit_continues_like_a_fresh_prefill(llama_model, tmp_path):
    """Real K/V: what a hit holds is the stored arrays bit for bit, and the logits after
    feeding the rest equal a fresh prefill's within 1e-4 (the chunks differ, so the BLAS
    may round a row differently)."""
    model, _ = llama_model
    sc = make_scope(model.fingerprint, SETTINGS)
    base = tokens_of(40)
    state = filled_state(model, base)
    for store in (PromptStore([MemoryTier(1 << 30)], block_tokens=B),
                  PromptStore([DiskTier(tmp_path, 1 << 30)], block_tokens=B)):  # fmt: skip
        store.put(sc, base, state.cache)
        prompt = base[:25] + tokens_of(10, start=100)
        got = checked_out(store, sc, model, prompt)
        assert got.served == 24 and got.tokens == base[:24]  # three blocks
        for g, w in zip(arrays(got.cache), arrays(state.cache)):
            np.testing.assert_array_equal(g[:, :, :24], w[:, :, :24])
        warm = forward(model, got.cache, prompt[24:])
        cold = forward(model, PromptCache.new(model).cache, prompt)
        np.testing.assert_allclose(np.array(warm), np.array(cold), atol=1e-4)
        again = checked_out(store, sc, model, base + [5])  # the stored values did not change
        assert again.served == 40
        for g, w in zip(arrays(again.cache), arrays(state.cache)):
            np.testing.assert_array_equal(g[:, :, :40], w[:, :, :40])


def test_no_hit_for_another_model_or_shape(llama_model, make_tiny_model):
    model, _ = llama_model
    other, _ = make_tiny_model("llama", seed=1)
    base = tokens_of(20)
    store = PromptStore([MemoryTier(1 << 30)], block_tokens=B)
    store.put(make_scope(model.fingerprint, SETTINGS), base, filled(model, base))
    assert checked_out(store, make_scope(other.fingerprint, SETTINGS), other, base + [1]) is None
    rotating = make_scope(model.fingerprint, {"max_kv_size": 64, "keep": 4})
    assert checked_out(store, rotating, model, base + [1]) is None


@pytest.mark.parametrize("kind", ["hybrid", "ssm"])
def test_caches_that_do_not_split_are_whole_values_serving_only_their_prefixes(tiny_model_dirs, tmp_path, kind):
    from mlx_chatcache.models.loading import load

    model, _ = load(str(tiny_model_dirs[kind]))
    sc = make_scope(model.fingerprint, SETTINGS)
    base = tokens_of(20)
    store = PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)], block_tokens=B)
    store.put(sc, base, filled(model, base))
    assert store.tiers[1].stats()["entries"] == 1 and store.tiers[1].stats()["blocks"] == 0
    assert checked_out(store, sc, model, base[:10] + [1, 2]) is None
    prompt = base + tokens_of(6, start=33)
    for s in (store, PromptStore([DiskTier(tmp_path, 1 << 30)], block_tokens=B)):
        got = checked_out(s, sc, model, prompt)
        assert got.served == 20
        reused = reuse_prefix(got.state, prompt, model)
        warm = forward(model, got.cache, prompt[20:])
        cold = forward(model, PromptCache.new(model).cache, prompt)
        assert reused == 20
        np.testing.assert_allclose(np.array(warm), np.array(cold), atol=1e-4)


@pytest.mark.parametrize("kind,bits", [("sliding", None), ("llama", 4)])
def test_rotating_and_quantized_caches_round_trip_through_both_tiers(tiny_model_dirs, tmp_path, kind, bits):
    from mlx_chatcache.cache import quantize_prompt_cache
    from mlx_chatcache.models.loading import load

    model, _ = load(str(tiny_model_dirs[kind]))
    base = tokens_of(12)  # inside the sliding window: still trimmable
    state = filled_state(model, base)
    if bits:
        quantize_prompt_cache(state.cache, 64, bits)
    want = arrays(state.cache)
    sc = make_scope(model.fingerprint, {**SETTINGS, "kv_bits": bits})
    PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)], block_tokens=B).put(sc, base, state.cache)
    for store in (PromptStore([DiskTier(tmp_path, 1 << 30)], block_tokens=B),):
        got = checked_out(store, sc, model, base + [5, 6])
        assert got.served == 12 and [type(c) for c in got.cache] == [type(c) for c in state.cache]
        for g, w in zip(arrays(got.cache), want):
            np.testing.assert_array_equal(g[..., : w.shape[-2], :] if g.ndim == 4 else g, w)


def test_memory_evicts_least_recently_used_within_its_budget_and_keeps_pins():
    probe = MemoryTier(1 << 30)
    PromptStore([probe], block_tokens=B).put(SC, tokens_of(5), synthetic(tokens_of(5)))
    size = probe.nbytes  # one 5-token entry value
    mem = MemoryTier(3 * size + size // 2)
    store = PromptStore([mem], block_tokens=B)
    seqs = [tokens_of(5, start=s) for s in (10, 40, 70, 100)]
    for s in seqs[:3]:
        put(store, s)
    assert hit(store, seqs[0] + [1])[0] == 5  # now the most recently used
    put(store, seqs[3])  # evicts seqs[1], the least recently used
    assert [hit(store, s + [1])[0] for s in seqs] == [5, 0, 5, 5]
    assert mem.nbytes <= mem.budget and mem.stats()["evicted"] == 1
    put(store, seqs[1], key="conv")  # pinned: evicts the oldest unpinned value
    for s in (tokens_of(5, start=s) for s in (130, 160, 190, 220)):
        put(store, s)  # unpinned pressure never evicts the pinned entry
    assert hit(store, seqs[1] + [1])[0] == 5
    from mlx_chatcache.store.chain import Chain

    (value,) = mem.get([Chain(SC.namespace, seqs[1], B).entry(5)])
    assert store.pins()["conv"] == {"memory": Pin(1, 5, len(value.data))}
    refused = mem.stats()["refused"]
    put(PromptStore([mem], block_tokens=256), tokens_of(200))  # one value larger than the budget: refused
    assert mem.stats()["refused"] > refused and hit(store, seqs[1] + [1])[0] == 5


def test_disk_sweeps_least_recently_used_files_down_to_its_low_water_and_a_command_never_deletes(tmp_path):
    probe = tmp_path / "probe"
    PromptStore([DiskTier(probe, 1 << 30)]).put(SC, tokens_of(5), synthetic(tokens_of(5)))
    size = next(probe.glob("e*.safetensors")).stat().st_size
    seqs = [tokens_of(5, start=s) for s in (10, 40, 70, 100)]
    folder = tmp_path / "d"
    command = PromptStore([DiskTier(folder, None)], block_tokens=B)  # mlxcc generate --cache-dir
    for s in seqs:
        put(command, s)
        time.sleep(0.01)  # distinct modification times
    assert len(list(folder.glob("e*.safetensors"))) == 4
    server = PromptStore([DiskTier(folder, 4 * size + 64)], block_tokens=B)  # within budget: keeps all
    assert hit(server, seqs[0] + [1])[0] == 5  # touched: now the most recently used
    server.tiers[0].budget = 4 * size  # then a fifth value sweeps the oldest, down to 90 % of it
    put(server, tokens_of(5, start=130))
    left = [hit(server, s + [1])[0] for s in seqs + [tokens_of(5, start=130)]]
    assert left == [5, 0, 0, 5, 5] and server.tiers[0].stats()["evicted"] == 2
    assert sum(p.stat().st_size for p in folder.glob("*.safetensors")) <= 0.9 * 4 * size
    (folder / "notes.txt").write_text("a user's file")
    DiskTier(folder, size)  # opening over budget sweeps too, never a foreign file
    assert (folder / "notes.txt").exists() and DiskTier(folder, None).stats()["foreign"] == 1


def test_a_running_disk_tier_finds_values_another_process_adds(tmp_path):
    base = tokens_of(30)
    server = PromptStore([DiskTier(tmp_path, 1 << 30, rescan_seconds=0)], block_tokens=B)
    throttled = PromptStore([DiskTier(tmp_path, 1 << 30, rescan_seconds=3600)], block_tokens=B)
    assert hit(server, base + [1]) == (0, None) and hit(throttled, base + [1]) == (0, None)
    put(PromptStore([DiskTier(tmp_path, None)], block_tokens=B), base)  # the command
    assert hit(server, base + [1]) == (30, "disk")
    assert hit(throttled, base + [1]) == (0, None)  # looked less than an hour ago
    for path in tmp_path.glob("*.safetensors"):
        path.unlink()  # another process evicted them
    assert hit(server, base + [1]) == (0, None) and server.tiers[0].stats()["corrupt"] == 0


def test_temp_files_of_a_killed_writer_are_removed_when_the_disk_tier_opens(tmp_path):
    """A dead writer's temp file goes when a tier opens the folder; a live writer's stays."""
    import subprocess
    import sys

    from mlx_chatcache.files.atomic import _HOST, TEMP_SUFFIX

    put(PromptStore([DiskTier(tmp_path, 1 << 30)], block_tokens=B), tokens_of(20))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = [f".e0a1b2c.safetensors.{_HOST}-{dead.pid}.abcdefgh{TEMP_SUFFIX}"]
    kept = [f".e0a1b2c.safetensors.{_HOST}-{os.getpid()}.abcdefgh{TEMP_SUFFIX}",
            f".e0a1b2c.safetensors.{_HOST}-{os.getppid()}.abcdefgh{TEMP_SUFFIX}"]  # fmt: skip
    for name in gone + kept:
        (tmp_path / name).write_bytes(b"x" * 100)
    restarted = DiskTier(tmp_path, 1 << 30)
    left = {p.name for p in tmp_path.iterdir()}
    assert not left & set(gone) and set(kept) <= left
    assert restarted.stats()["temp_removed"] == 1 and restarted.stats()["blocks"] == 2


def test_deferred_writes_wait_for_flush_and_memory_only_leaves_the_files_alone(tmp_path):
    a, b, c = tokens_of(20), tokens_of(24, start=50), tokens_of(10, start=90)
    store = PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)], block_tokens=B)
    assert put(store, a, defer=True) == {"memory": True, "disk": None}
    put(store, b, defer=True)
    assert not list(tmp_path.glob("*.safetensors")) and len(store.pending) == 2
    assert hit(store, b + [3]) == (24, "memory")  # the memory tier holds the same values meanwhile
    assert store.flush(keep=1) == 1 and len(list(tmp_path.glob("*.safetensors"))) == 3
    store.flush()
    assert put(store, c, defer=True, memory_only=True) == {"memory": True}
    assert not store.pending and store.flush() == 0
    restarted = PromptStore([DiskTier(tmp_path, 1 << 30)], block_tokens=B)
    assert hit(restarted, a + [1]) == (20, "disk") and hit(restarted, b + [1]) == (24, "disk")
    assert hit(restarted, c + [1]) == (0, None)


def test_a_failing_tier_is_reported_and_the_others_written(tmp_path):
    folder = tmp_path / "d"
    store = PromptStore([MemoryTier(1 << 30), DiskTier(folder, 1 << 30)], block_tokens=B)
    folder.chmod(0o500)
    try:
        failed = []
        got = put(store, tokens_of(12), on_error=lambda tier, e: failed.append((tier.name, str(e))))
        if os.geteuid() != 0:  # root writes anyway
            assert got == {"memory": True, "disk": False} and failed[0][0] == "disk"
            assert "could not write" in failed[0][1]
    finally:
        folder.chmod(0o700)
    assert hit(store, tokens_of(12) + [1])[0] == 12


def test_checkout_hands_out_a_prompt_cache_the_caller_owns(llama_model, tmp_path):
    """A checkout is a PromptCache of the model and the shape asked, holding exact token
    ids, with the tier it came from; changing it changes nothing stored; a miss is an
    empty one of that shape."""
    model, _ = llama_model
    shape = CacheShape(max_kv_size=64, keep=6)
    sc = make_scope(model.fingerprint, shape.settings())
    base = tokens_of(30)
    stored = PromptCache.new(model, shape)
    from mlx_chatcache.generation.templates import feed_all

    feed_all(model, stored, base, 512)
    want = arrays(stored.cache)
    store = PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)], block_tokens=B)
    store.put(sc, base, stored.cache)
    for _ in range(2):
        got, where = store.checkout(sc, model, base + [7, 8], shape)
        assert where == "memory" and isinstance(got, PromptCache) and got.cache is not stored.cache
        assert got.shape == shape and got.fingerprint == model.fingerprint and got.tokens == base
        assert [type(c) for c in got.cache] == [type(c) for c in stored.cache]
        for g, w in zip(arrays(got.cache), want):
            np.testing.assert_array_equal(g[..., : w.shape[-2], :] if g.ndim == 4 else g, w)
        forward(model, got.cache, [7, 8])  # fed: the next checkout is unchanged
        mx.eval([c.eval_arrays() for c in got.cache])
    miss, where = store.checkout(sc, model, tokens_of(10, start=200), shape)
    assert where is None and miss.tokens == [] and miss.shape == shape


def test_a_handed_over_cache_serves_the_next_turn_as_it_is_unless_the_tiers_serve_more(llama_model, tmp_path):
    """A cache put with ``hand_over`` is handed to the next checkout of its scope that it
    serves at least as far as the tiers, trimmed to what its values serve: the same layers,
    no copy, the same tokens, arrays and logits as its values give; once. A checkout the
    tiers serve further (another conversation's longer prefix) or another scope gets values
    and leaves it."""
    model, _ = llama_model
    sc = make_scope(model.fingerprint, SETTINGS)
    other = make_scope(model.fingerprint, {**SETTINGS, "tenant": "t"})
    base = tokens_of(40)
    want = arrays(filled(model, base))
    store = PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)], block_tokens=B)
    longer = base[:30] + tokens_of(20, start=150)  # another conversation: shares 30 tokens
    store.put(sc, longer, filled(model, longer))
    turn = filled(model, base)
    store.put(sc, base, turn, ends=[36], hand_over=True)  # values: 5 blocks and a 36-token tail
    prompt = base[:38] + tokens_of(5, start=100)  # the reply's last 2 tokens spelled otherwise

    assert checked_out(store, other, model, prompt) is None  # another scope: its tiers are empty
    assert checked_out(store, sc, model, longer + [1]).cache[0] is not turn[0]  # the tiers serve 50 > 30
    got = checked_out(store, sc, model, prompt)
    assert got.tier == "memory" and got.served == 36 and got.tokens == base[:36]  # as the tail would
    assert all(g is t for g, t in zip(got.cache, turn)) and turn[0].offset == 36  # the very layers, trimmed
    for g, w in zip(arrays(got.cache), want):
        np.testing.assert_array_equal(g[:, :, :36], w[:, :, :36])
    warm = forward(model, got.cache, prompt[36:])
    cold = forward(model, PromptCache.new(model).cache, prompt)
    np.testing.assert_allclose(np.array(warm), np.array(cold), atol=1e-4)
    again = checked_out(store, sc, model, prompt)  # handed over once: now from the values
    assert again.served == 36 and all(g is not t for g, t in zip(again.cache, turn))
    for g, w in zip(arrays(again.cache), want):
        np.testing.assert_array_equal(g[:, :, :36], w[:, :, :36])
