"""The disk tier's shared block files: entries sharing a prefix hold its blocks
once on disk, a restart finds them, a block file goes with its last holder, and
a missing or damaged block makes its entry a miss."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from test_store_blocks import LAYERS, SCOPE, arrays, cache_of

from mlx_chatcache.cache import KVCache

from mlx_chatcache.files.mlxcc_format import save_prompt_cache
from mlx_chatcache.store.disk import DiskTier
from mlx_chatcache.store.disk_folder import BLOCKS, block_path, entry_file_name
from mlx_chatcache.store.index import Entry
from mlx_chatcache.store.tiers import make_scope


def files_bytes(folder) -> int:
    """What the tier really takes on disk: every cache file, blocks included."""
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def entry_of(tier: DiskTier, tokens) -> Entry | None:
    return tier.index.get(SCOPE.namespace, tuple(tokens))


def served(tier: DiskTier, tokens):
    entry = entry_of(tier, tokens)
    return None if entry is None else tier.fetch(entry, SCOPE, [KVCache() for _ in range(LAYERS)])


def assert_serves(tier: DiskTier, tokens):
    got = served(tier, tokens)
    assert got is not None, f"no entry for {len(tokens)} tokens"
    for x, y in zip(arrays(got), arrays(cache_of(tokens)), strict=True):
        np.testing.assert_array_equal(x[:, :, : y.shape[2]], y)
    assert all(c.offset == len(tokens) for c in got)


@pytest.mark.parametrize("n", [10, 50])
def test_entries_sharing_a_prompt_store_it_once_on_disk_and_a_restart_serves_them(tmp_path, n):
    shared = list(range(1, 1001))
    convs = [shared + [2000 + 200 * i + j for j in range(200)] for i in range(n)]
    tier = DiskTier(tmp_path, 1 << 40)  # the default block size
    for tokens in convs:
        assert tier.add(SCOPE, tokens, cache_of(tokens), None)
    per_token = sum(a.nbytes for a in arrays(cache_of([1])))
    unique = (1000 + n * 200) * per_token
    assert tier.index.nbytes == files_bytes(tmp_path)
    assert files_bytes(tmp_path) <= 1.25 * unique, files_bytes(tmp_path) / unique
    restarted = DiskTier(tmp_path, 1 << 40)
    assert len(restarted.index) == n and restarted.index.nbytes == tier.index.nbytes
    for tokens in convs[:: max(1, n // 5)]:
        assert_serves(restarted, tokens)
    assert restarted.stats()["corrupt"] == 0


def test_evicting_an_entry_deletes_only_the_blocks_nobody_else_holds(tmp_path):
    base = list(range(1, 33))
    a = base + list(range(100, 132)) + [7, 8]  # blocks: base (shared with b), a's own; tail of 2
    b = base + list(range(200, 232)) + [7, 9]
    c = list(range(500, 560))  # nothing shared
    probe = DiskTier(tmp_path / "probe", 1 << 40, block_tokens=32)
    probe.add(SCOPE, c, cache_of(c), None)
    adds_c = probe.index.nbytes
    folder = tmp_path / "d"
    tier = DiskTier(folder, 1 << 40, block_tokens=32)
    assert tier.add(SCOPE, a, cache_of(a), None) and tier.add(SCOPE, b, cache_of(b), None)
    shared, own_a = (h for h, _ in entry_of(tier, a).blocks)
    own_b = entry_of(tier, b).blocks[1][0]
    assert len(list((folder / BLOCKS).iterdir())) == 3
    tier.index.budget = tier.index.nbytes + adds_c - 1  # c fits once a (least recently used) goes
    assert tier.add(SCOPE, c, cache_of(c), None)
    assert entry_of(tier, a) is None and entry_of(tier, b) is not None and tier.counters["evicted"] == 1
    assert not block_path(folder, own_a).exists()  # nobody holds it
    assert block_path(folder, shared).exists() and block_path(folder, own_b).exists()  # b holds them
    assert not (folder / entry_file_name(SCOPE.namespace, a)).exists()
    assert tier.index.nbytes == files_bytes(folder) <= tier.index.budget
    assert_serves(tier, b)
    assert_serves(tier, c)
    # a restart counts the holders again from the entry files
    restarted = DiskTier(folder, None, block_tokens=32)
    assert restarted.index.nbytes == files_bytes(folder) and restarted.index.has_block(shared)
    restarted._drop(entry_of(restarted, b))
    restarted._sweep()
    assert not block_path(folder, shared).exists() and not block_path(folder, own_b).exists()
    assert_serves(restarted, c)


def test_a_damaged_block_is_a_corrupt_miss_and_a_missing_one_a_plain_miss(tmp_path):
    a, b, c = ([k * 1000 + i for i in range(70)] for k in (1, 2, 3))  # two blocks each, none shared
    tier = DiskTier(tmp_path, 1 << 40, block_tokens=32)
    for tokens in (a, b, c):
        assert tier.add(SCOPE, tokens, cache_of(tokens), None)
    damaged = block_path(tmp_path, entry_of(tier, a).blocks[1][0])
    data = bytearray(damaged.read_bytes())
    data[-16:] = bytes(x ^ 0xFF for x in data[-16:])  # array bytes only: the header still parses
    damaged.write_bytes(bytes(data))
    assert served(tier, a) is None
    assert tier.stats()["corrupt"] == 1 and entry_of(tier, a) is None
    assert not damaged.exists() and not block_path(tmp_path, entry_of(tier, b).blocks[0][0]).parent.joinpath(
        damaged.name).exists()  # fmt: skip
    assert_serves(tier, b)
    block_path(tmp_path, entry_of(tier, c).blocks[0][0]).unlink()  # another process evicted it
    assert served(tier, c) is None
    assert tier.stats()["corrupt"] == 1 and entry_of(tier, c) is None
    assert_serves(tier, b)
    # the damaged block's tokens stored again write it again
    assert tier.add(SCOPE, a, cache_of(a), None) and damaged.exists()
    assert_serves(DiskTier(tmp_path, 1 << 40, block_tokens=32), a)


def test_a_whole_entry_file_from_before_blocks_still_loads_next_to_block_entries(tmp_path):
    old = list(range(1, 101))
    path = tmp_path / entry_file_name(SCOPE.namespace, old)
    save_prompt_cache(path, cache_of(old), tokens=old, model=SCOPE.fingerprint, settings=SCOPE.settings,
                      metadata={"store.namespace": SCOPE.namespace, "store.trimmable": "1"})  # fmt: skip
    tier = DiskTier(tmp_path, 1 << 40, block_tokens=32)
    assert len(tier.index) == 1 and tier.index.nbytes == path.stat().st_size
    assert_serves(tier, old)
    new = list(range(1, 65)) + [900, 901]
    assert tier.add(SCOPE, new, cache_of(new), None)
    assert len(list((tmp_path / BLOCKS).iterdir())) == 2 and path.exists()
    restarted = DiskTier(tmp_path, 1 << 40, block_tokens=32)
    assert restarted.stats()["foreign"] == 0 and len(restarted.index) == 2
    assert_serves(restarted, old)
    assert_serves(restarted, new)


def test_block_entries_another_process_adds_are_found_and_a_smaller_budget_keeps_their_blocks_right(tmp_path):
    base = list(range(1, 33))
    a, b = base + list(range(100, 132)) + [7], base + list(range(200, 232)) + [8]
    server = DiskTier(tmp_path, 1 << 40, rescan_seconds=0, block_tokens=32)
    command = DiskTier(tmp_path, None, block_tokens=32)  # mlxcc generate --cache-dir next to the server
    assert command.add(SCOPE, b, cache_of(b), None) and command.add(SCOPE, a, cache_of(a), None)
    assert server.find(SCOPE, a + [9], None)[1] == len(a)
    assert server.index.nbytes == files_bytes(tmp_path) and len(server.index) == 2
    assert_serves(server, a)  # the newest now
    shared, own_a = (h for h, _ in entry_of(server, a).blocks)
    own_b = entry_of(server, b).blocks[1][0]
    # restarted with room for a alone: b goes, with its own block but not the one a holds too
    small = DiskTier(tmp_path, entry_of(server, a).size, block_tokens=32)
    assert [e.tokens for e in small.index.entries()] == [tuple(a)] and small.counters["evicted"] == 1
    assert block_path(tmp_path, shared).exists() and block_path(tmp_path, own_a).exists()
    assert not block_path(tmp_path, own_b).exists()
    assert small.index.nbytes == files_bytes(tmp_path) <= small.index.budget
    assert_serves(small, a)


def orphans(folder, held):
    """What a writer killed between its block files and its entry file leaves: two blocks
    no entry names, one an hour old and one new; ``held`` (the entries' blocks) aged as the old one.
    Returns (old, new, an hour ago)."""
    old, fresh = block_path(folder, "a" * 32), block_path(folder, "b" * 32)
    shutil.copy(held[0], old)
    shutil.copy(held[0], fresh)
    past = time.time() - 3600
    for p in [old, *held]:  # the held blocks are as old: their entry keeps them
        os.utime(p, (past, past))
    return old, fresh, past


def test_block_files_no_entry_names_are_deleted_at_start_once_old_enough(tmp_path):
    tokens = list(range(1, 101))
    tier = DiskTier(tmp_path, 1 << 40, block_tokens=32)
    assert tier.add(SCOPE, tokens, cache_of(tokens), None)
    held = sorted((tmp_path / BLOCKS).iterdir())
    assert len(held) == 3
    old, fresh, past = orphans(tmp_path, held)
    restarted = DiskTier(tmp_path, 1 << 40, block_tokens=32, orphan_seconds=600)
    assert restarted.stats()["orphans_removed"] == 1
    assert not old.exists() and fresh.exists()  # a live writer's new blocks are left alone
    assert all(p.exists() for p in held)
    assert_serves(restarted, tokens)
    # a writer that uses an old block again makes it new, so a start meanwhile keeps it
    for p in held:
        os.utime(p, (past, past))
    tier.add(SCOPE, tokens + [7] * 40, cache_of(tokens + [7] * 40), None)
    assert all(p.stat().st_mtime > past + 60 for p in held)


def test_an_orphan_a_writer_uses_again_while_it_is_collected_is_kept(tmp_path, monkeypatch):
    """A writer touches an old orphan block to use it again just after the collector
    checked its age: the block stays (an untouched one still goes, and nothing is left
    aside)."""
    tokens = list(range(1, 101))
    tier = DiskTier(tmp_path, 1 << 40, block_tokens=32)
    assert tier.add(SCOPE, tokens, cache_of(tokens), None)
    held = sorted((tmp_path / BLOCKS).iterdir())
    old, fresh, past = orphans(tmp_path, held)
    other = block_path(tmp_path, "c" * 32)
    shutil.copy(old, other)
    os.utime(other, (past, past))
    real = os.replace

    def replace(src, dst):
        if Path(src) == old:
            os.utime(old)  # a writer uses it again, now
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    restarted = DiskTier(tmp_path, 1 << 40, block_tokens=32, orphan_seconds=600)
    assert restarted.stats()["orphans_removed"] == 1 and old.exists() and not other.exists()
    assert sorted((tmp_path / BLOCKS).iterdir()) == sorted([*held, old, fresh])
    assert_serves(restarted, tokens)


@pytest.fixture
def clock(monkeypatch):
    """``time.monotonic`` under the test's control: ``clock[0]`` is now."""
    now = [time.monotonic()]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    return now


def test_a_running_tier_deletes_old_orphan_block_files_on_a_find_miss_at_most_every_half_orphan_seconds(
    tmp_path, clock
):
    tokens, miss = list(range(1, 101)), [5000, 5001]
    server = DiskTier(tmp_path, 1 << 40, rescan_seconds=0, block_tokens=32, orphan_seconds=600)
    assert server.add(SCOPE, tokens, cache_of(tokens), None)
    held = sorted((tmp_path / BLOCKS).iterdir())
    old, fresh, past = orphans(tmp_path, held)  # a command next to the server, killed mid-write
    clock[0] += 299  # the folder was looked at less than orphan_seconds / 2 ago (when the tier opened it)
    assert server.find(SCOPE, miss, None) is None
    assert old.exists() and server.stats()["orphans_removed"] == 0
    clock[0] += 2
    assert server.find(SCOPE, miss, None) is None
    assert not old.exists() and server.stats()["orphans_removed"] == 1
    assert fresh.exists()  # a live writer's new blocks are left alone
    assert all(p.exists() for p in held)
    assert_serves(server, tokens)
    # once old, the other goes at the next pass, not before; the count adds up
    os.utime(fresh, (past, past))
    clock[0] += 299
    assert server.find(SCOPE, miss, None) is None and fresh.exists()
    clock[0] += 2
    assert server.find(SCOPE, miss, None) is None and not fresh.exists()
    assert server.stats()["orphans_removed"] == 2
    assert all(p.exists() for p in held)
    assert_serves(server, tokens)


def test_a_running_tier_keeps_old_block_files_an_entry_another_process_wrote_names(tmp_path, clock):
    other = make_scope(SCOPE.fingerprint, {"max_kv_size": 4096, "keep": None})  # another namespace
    a, b = list(range(1, 101)), list(range(1, 65)) + [9] * 40
    server = DiskTier(tmp_path, 1 << 40, rescan_seconds=0, block_tokens=32, orphan_seconds=600)
    command = DiskTier(tmp_path, None, block_tokens=32)  # mlxcc generate --cache-dir next to the server
    assert command.add(SCOPE, a, cache_of(a), None) and command.add(other, b, cache_of(b), None)
    blocks = sorted((tmp_path / BLOCKS).iterdir())
    assert len(blocks) == 6
    past = time.time() - 3600
    for p in blocks:  # as old as orphans could be
        os.utime(p, (past, past))
    assert server.index.get(SCOPE.namespace, tuple(a)) is None and len(server.index) == 0  # not seen yet
    clock[0] += 301
    assert server.find(SCOPE, [5000], None) is None  # a miss: the rescan indexes both entries, then collects
    assert server.stats()["orphans_removed"] == 0 and all(p.exists() for p in blocks)
    assert len(server.index) == 2
    assert_serves(server, a)
    got = server.fetch(server.index.get(other.namespace, tuple(b)), other, [KVCache() for _ in range(LAYERS)])
    assert got is not None and all(c.offset == len(b) for c in got)


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
@pytest.mark.parametrize("which", [0, 3, 5])
def test_a_block_file_whose_header_is_damaged_is_a_corrupt_miss_that_leaves_no_file_open(tmp_path, which):
    tokens = list(range(1, 6 * 32 + 10))  # six blocks and a tail
    tier = DiskTier(tmp_path, 1 << 40, block_tokens=32)
    assert tier.add(SCOPE, tokens, cache_of(tokens), None)
    damaged = block_path(tmp_path, entry_of(tier, tokens).blocks[which][0])
    data = bytearray(damaged.read_bytes())
    at = 8 + int.from_bytes(data[:8], "little") // 2  # the middle of the JSON header
    data[at] ^= 0x01  # the header fails its checks (its checksum, or its JSON)
    damaged.write_bytes(bytes(data))
    before = open_files()
    assert served(tier, tokens) is None
    assert open_files() == before
    assert tier.stats()["corrupt"] == 1 and not damaged.exists()
    assert tier.add(SCOPE, tokens, cache_of(tokens), None)  # written again, whole
    assert_serves(tier, tokens)


def test_entries_written_with_another_block_size_are_served_by_a_tier_of_this_one(tmp_path):
    old = [list(range(1, 201)), list(range(1, 101)) + [7] * 45]  # 32-token block files
    writer = DiskTier(tmp_path, 1 << 40, block_tokens=32)
    for tokens in old:
        assert writer.add(SCOPE, tokens, cache_of(tokens), None)
    tier = DiskTier(tmp_path, 1 << 40, block_tokens=64)
    new = list(range(1, 101)) + [8] * 70  # 64-token block files beside them
    assert tier.add(SCOPE, new, cache_of(new), None)
    for tokens in [*old, new]:
        assert_serves(tier, tokens)
    assert tier.stats()["corrupt"] == 0 and len(tier.index) == 3


def test_a_folder_that_cannot_be_listed_or_an_entry_file_read_deletes_no_block_file(tmp_path, clock, monkeypatch):
    import mlx_chatcache.store.disk as disk
    import mlx_chatcache.store.disk_folder as folder

    tokens = list(range(1, 101))
    tier = DiskTier(tmp_path, 1 << 40, rescan_seconds=0, block_tokens=32, orphan_seconds=600)
    assert tier.add(SCOPE, tokens, cache_of(tokens), None)
    held = sorted((tmp_path / BLOCKS).iterdir())
    past = time.time() - 3600
    for p in held:  # as old as orphans could be: only the entry file naming them keeps them
        os.utime(p, (past, past))
    os.utime(entry_of(tier, tokens).payload)  # changed since the tier read it: read again
    scandir = os.scandir

    def no_listing(path="."):
        if os.path.samefile(path, tmp_path):
            raise OSError(5, "Input/output error")
        return scandir(path)

    monkeypatch.setattr(disk.os, "scandir", no_listing)
    clock[0] += 301
    assert tier.find(SCOPE, [5000], None) is None
    assert all(p.exists() for p in held) and tier.stats()["orphans_removed"] == 0
    monkeypatch.setattr(disk.os, "scandir", scandir)
    read_cache_info = folder.read_cache_info

    def unreadable(path):
        if path == entry_of(tier, tokens).payload:
            raise OSError(5, "Input/output error")
        return read_cache_info(path)

    monkeypatch.setattr(folder, "read_cache_info", unreadable)
    clock[0] += 301
    assert tier.find(SCOPE, [5000], None) is None
    assert all(p.exists() for p in held) and tier.stats()["orphans_removed"] == 0
    monkeypatch.setattr(folder, "read_cache_info", read_cache_info)
    assert DiskTier(tmp_path, 1 << 40, block_tokens=32).stats()["orphans_removed"] == 0
    assert_serves(tier, tokens)


def test_a_block_file_that_cannot_be_opened_now_is_a_plain_miss_that_deletes_nothing(tmp_path, monkeypatch):
    import builtins

    import mlx_chatcache.files.safetensors_file as safetensors_file

    tokens = list(range(1, 6 * 32 + 10))
    tier = DiskTier(tmp_path, 1 << 40, block_tokens=32)
    assert tier.add(SCOPE, tokens, cache_of(tokens), None)
    files = sorted(tmp_path.rglob("*.safetensors"))
    blocked = block_path(tmp_path, entry_of(tier, tokens).blocks[3][0])

    def too_many(path, *args, **kwargs):
        if str(path) == str(blocked):
            raise OSError(24, "Too many open files")
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(safetensors_file, "open", too_many, raising=False)
    assert served(tier, tokens) is None
    assert tier.stats()["corrupt"] == 0 and all(p.exists() for p in files) and entry_of(tier, tokens) is not None
    monkeypatch.undo()
    assert_serves(tier, tokens)
