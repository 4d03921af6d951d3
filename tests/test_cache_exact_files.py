"""Cache files and store values hold exactly the tokens a cache holds (no room
to grow on disk); files of versions 2-4, which carry room, still load and
continue exactly."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_chatcache.cache import ChunkedKVCache, KVCache, QuantizedKVCache
from mlx_chatcache.cache.cache_base import kv_len
from mlx_chatcache.errors import CacheFileError
from mlx_chatcache.files.atomic import write_atomic
from mlx_chatcache.files.mlxcc_format import (
    FORMAT_VERSION,
    load_cache_file,
    load_prompt_cache_bytes,
    prompt_cache_bytes,
    save_prompt_cache,
)
from mlx_chatcache.files.safetensors_file import read_arrays, read_header

KINDS = {
    "float": KVCache,
    "q8": lambda: QuantizedKVCache(32, 8),
    "chunked": lambda: ChunkedKVCache(100),
}


def rnd(n, seed=0):
    return mx.random.normal((1, 2, n, 32), key=mx.random.key(seed))


def filled(make, n):
    c = make()
    if n:
        c.update_and_fetch(rnd(n, 1), rnd(n, 2))
    return c


def same_leaves(x, y) -> bool:
    xs, ys = [a for _, a in tree_flatten(x)], [b for _, b in tree_flatten(y)]
    return len(xs) == len(ys) and all(a.shape == b.shape and mx.array_equal(a, b).item() for a, b in zip(xs, ys))


def same_state(a, b) -> bool:
    xs, ys = a.flat_state(), b.flat_state()
    return a.offset == b.offset and len(xs) == len(ys) and all(
        x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(xs, ys)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_55_token_cache_stores_exactly_55_slots(tmp_path, kind):
    """File and store value (the bytes a Redis tier keeps) hold the 55 tokens, no room."""
    c = filled(KINDS[kind], 55)
    p = tmp_path / "c.safetensors"
    save_prompt_cache(p, [c], tokens=list(range(55)))
    header = read_header(p)
    assert header.metadata["mlxcc.format_version"] == str(FORMAT_VERSION) == "5"
    assert {t.shape[2] for t in header.tensors.values()} == {55}
    data = prompt_cache_bytes([c], tokens=list(range(55)))
    (loaded,), info = load_prompt_cache_bytes(data, "value")
    assert info.slots == 55 and same_state(loaded, c)


def loaded_slots(held: int) -> int:
    """Slots a loaded K/V array of ``held`` tokens has: room to the next step when
    that room at most doubles it, else exactly the tokens (room at the first update)."""
    grown = KVCache.grown_slots(held)
    return grown if grown <= 2 * held else held


@pytest.mark.parametrize("held", [55, 128, 200, 256, 300])
def test_loaded_k_v_arrays_get_room_that_at_most_doubles_them(tmp_path, held):
    c = filled(KVCache, held)
    p = tmp_path / "c.safetensors"
    save_prompt_cache(p, [c], tokens=list(range(held)))
    (from_file,), _ = load_cache_file(p)
    (from_bytes,), _ = load_prompt_cache_bytes(prompt_cache_bytes([c], tokens=list(range(held))), "value")
    for loaded in (from_file, from_bytes):
        assert kv_len(loaded.keys) == kv_len(loaded.values) == loaded_slots(held)
        assert same_state(loaded, c)
    assert loaded_slots(200) == KVCache.step and loaded_slots(55) == 55


@pytest.mark.parametrize("kind", ["float", "q8"])
def test_a_damaged_tensor_read_into_room_is_refused(tmp_path, kind):
    """The checksum covers the file's bytes also when they are read into room."""
    p = tmp_path / "c.safetensors"
    save_prompt_cache(p, [filled(KINDS[kind], 200)], tokens=list(range(200)))
    header = read_header(p)
    t = header.tensors["layer.0.1"]
    data = bytearray(p.read_bytes())
    data[header.data_start + (t.begin + t.end) // 2] ^= 0x40
    p.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="checksum"):
        load_cache_file(p)


def legacy_v4_file(path, cache, tokens):
    """The file the version 4 writer made for ``cache``: each K/V array padded with
    zeros to the next multiple of 256 tokens, version 4, checksums of those arrays."""
    arrays = {}
    save_prompt_cache(path, cache, tokens=tokens)
    header = read_header(path)
    meta = dict(header.metadata)
    for key in ("mlxcc.tensor_crc32", "mlxcc.header_crc32"):
        meta.pop(key, None)
    meta["mlxcc.format_version"] = "4"
    for name, a in read_arrays(header).items():
        n = a.shape[2]
        arrays[name] = mx.pad(a, [(0, 0), (0, 0), (0, -n % KVCache.step), (0, 0)])
    path.unlink()
    write_atomic(path, arrays, meta)


@pytest.mark.parametrize("kind", ["float", "q8"])
def test_version_4_padded_file_loads_and_continues_exactly(tmp_path, kind):
    """An older file with room loads into that room (no copy at the next update)
    and continues bit-identically to the cache that was saved."""
    saved = filled(KINDS[kind], 55)
    p = tmp_path / "v4.safetensors"
    legacy_v4_file(p, [saved], list(range(55)))
    assert {t.shape[2] for t in read_header(p).tensors.values()} == {KVCache.step}
    (loaded,), info = load_cache_file(p)
    assert info.format_version == 4 and same_state(loaded, saved)
    assert kv_len(loaded.keys) == KVCache.step  # the file's room, used in place
    for i in range(3):
        want = saved.update_and_fetch(rnd(4, 10 + i), rnd(4, 20 + i))
        got = loaded.update_and_fetch(rnd(4, 10 + i), rnd(4, 20 + i))
        assert same_leaves(want, got)
    assert kv_len(loaded.keys) == KVCache.step and same_state(loaded, saved)
    out = tmp_path / "again.safetensors"
    save_prompt_cache(out, [loaded], tokens=list(range(67)))
    assert {t.shape[2] for t in read_header(out).tensors.values()} == {67}  # written back exact


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(KINDS)), n=st.integers(0, 600), k=st.integers(1, 300), trim=st.integers(0, 40))
def test_save_load_append_equals_the_never_saved_cache(tmp_path, kind, n, k, trim):
    """For any fill (and a trim before saving), a saved and loaded cache fed ``k``
    more tokens returns and holds exactly what the never-saved cache does."""
    saved = filled(KINDS[kind], n)
    saved.trim(trim)
    held = saved.size()
    p = tmp_path / "h.safetensors"
    save_prompt_cache(p, [saved], tokens=list(range(saved.offset)))
    if held:
        assert {t.shape[2] for t in read_header(p).tensors.values()} == {held}
    (loaded,), _ = load_cache_file(p)
    assert same_state(loaded, saved)
    if held:
        assert kv_len(loaded.keys) == loaded_slots(held)
    want = saved.update_and_fetch(rnd(k, 7), rnd(k, 8))
    got = loaded.update_and_fetch(rnd(k, 7), rnd(k, 8))
    assert same_leaves(want, got)
    assert same_state(loaded, saved)
