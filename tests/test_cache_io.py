"""The cache file format: round trips, self-description, interop with mlx-lm,
refusal of damaged, tampered and foreign files, atomic writes."""

import json
import os
import struct

import mlx.core as mx
import pytest
from mlx_lm.models import cache as lm

from mlx_chatcache.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_chatcache.files.mlxcc_format import (
    FORMAT_VERSION,
    check_cache_fits_model,
    load_cache_file,
    load_prompt_cache,
    read_cache_info,
    save_prompt_cache,
)
from mlx_chatcache.errors import (
    CacheFileError,
    CacheFormatError,
    ChatCacheError,
    ModelMismatchError,
    UnsupportedCacheError,
)
from mlx_chatcache.files.checksum import seal_bytes
from mlx_chatcache.models.fingerprint import ModelFingerprint


def rnd(n, seed=0):
    return mx.random.normal((1, 2, n, 32), key=mx.random.key(seed))


def filled(c, sizes=(10, 1, 1)):
    for i, n in enumerate(sizes):
        c.update_and_fetch(rnd(n, i), rnd(n, 100 + i))
    return c


def all_kinds():
    arrays = ArraysCache(2)
    arrays[0] = mx.arange(12.0).reshape(1, 3, 4)
    return [
        filled(KVCache()),
        filled(RotatingKVCache(8, 2), (10, 1, 1)),
        filled(QuantizedKVCache(32, 8)),
        filled(QuantizedRotatingKVCache(8, 2, 32, 4), (5, 1, 5, 1)),
        arrays,
        CacheList(filled(KVCache()), ArraysCache(1)),
    ]


def assert_same(a, b):
    assert [type(x) for x in a] == [type(y) for y in b]
    for x, y in zip(a, b):
        assert x.meta_state == y.meta_state
        assert len(x.flat_state()) == len(y.flat_state())
        for s, t in zip(x.flat_state(), y.flat_state()):
            assert s.dtype == t.dtype and mx.array_equal(s, t)


FP = ModelFingerprint("m", "w" * 32, "t" * 32)


def test_round_trip_every_kind_exact(tmp_path):
    cache = all_kinds()
    p = tmp_path / "c.safetensors"
    msgs = [{"role": "user", "content": "héllo"}]
    save_prompt_cache(p, cache, tokens=list(range(12)), model=FP, messages=msgs, metadata={"a": "b"})
    loaded, info = load_cache_file(p)
    assert_same(cache, loaded)
    assert info.format_version == FORMAT_VERSION and info.layout == "mlxcc"
    assert info.classes == [type(c).__name__ for c in cache]
    assert info.tokens == list(range(12)) and info.messages == msgs
    assert info.model == FP and info.metadata == {"a": "b"}


def test_save_refuses_tokens_that_do_not_match(tmp_path):
    with pytest.raises(CacheFormatError, match="token"):
        save_prompt_cache(tmp_path / "x.safetensors", [filled(KVCache())], tokens=[1, 2, 3])
    assert not (tmp_path / "x.safetensors").exists()


def test_header_only_info_matches(tmp_path):
    p = tmp_path / "c.safetensors"
    save_prompt_cache(p, [filled(KVCache())], tokens=list(range(12)))
    info = read_cache_info(p)
    # stored bytes: keys and values, each (1, 2 heads, 12 tokens, 32) float32
    assert info.num_tokens == 12 and info.nbytes == 2 * 12 * 2 * 32 * 4 and info.slots == 12


def test_file_holds_exactly_the_live_tokens(tmp_path):
    """K/V arrays are stored without room to grow and without trimmed tokens:
    exactly the live tokens, fewer bytes than mlx-lm's file of the same cache
    (which stores its buffers' room); ``state`` stays exact."""
    from mlx_chatcache.files.safetensors_file import read_arrays, read_header

    ours, theirs = KVCache(), lm.KVCache()
    for c in (ours, theirs):
        c.update_and_fetch(rnd(15), rnd(15, 1))
        c.trim(5)
    save_prompt_cache(tmp_path / "first.safetensors", [ours], tokens=list(range(10)))
    ours.update_and_fetch(rnd(3, 7), rnd(3, 8))  # into the buffer's room, then trimmed again
    ours.trim(3)
    save_prompt_cache(tmp_path / "a.safetensors", [ours], tokens=list(range(10)))
    lm.save_prompt_cache(str(tmp_path / "b.safetensors"), [theirs])
    a, b = (read_header(tmp_path / f) for f in ("a.safetensors", "b.safetensors"))
    ours_bytes = sum(t.end - t.begin for t in a.tensors.values())
    assert ours_bytes == 2 * 10 * 2 * 32 * 4 < sum(t.end - t.begin for t in b.tensors.values())
    stored = read_arrays(a)
    for name, arr in stored.items():
        assert arr.shape[2] == 10  # the 5 trimmed tokens are gone, and there is no room
        assert mx.array_equal(arr, (rnd(15) if name.endswith(".0") else rnd(15, 1))[..., :10, :])
    (loaded,) = load_prompt_cache(tmp_path / "a.safetensors")
    assert all(s.shape[2] == 10 for s in loaded.flat_state())


def test_model_mismatch_refused(tmp_path):
    p = tmp_path / "c.safetensors"
    save_prompt_cache(p, [filled(KVCache())], tokens=list(range(12)), model=FP)
    other = ModelFingerprint("other", "x" * 32, "t" * 32)
    with pytest.raises(ModelMismatchError, match="another model|differs"):
        load_prompt_cache(p, model=other)
    load_prompt_cache(p, model=ModelFingerprint("moved/path", FP.weights_hash, FP.tokenizer_hash))


def test_layer_shape_mismatch_refused():
    with pytest.raises(ModelMismatchError):
        check_cache_fits_model([KVCache()], [KVCache(), KVCache()])
    with pytest.raises(ModelMismatchError):
        check_cache_fits_model([ArraysCache(1)], [KVCache()])


# ----------------------------------------------------------------- mlx-lm interop
def lm_filled():
    caches = [lm.KVCache(), lm.RotatingKVCache(8, 2), lm.QuantizedKVCache(32, 8)]
    for c in caches:
        c.update_and_fetch(rnd(10), rnd(10, 1))
        for i in range(4):
            c.update_and_fetch(rnd(1, 2 + i), rnd(1, 9 + i))
    return caches


def test_reads_mlx_lm_032_file(tmp_path):
    theirs = lm_filled()
    p = tmp_path / "lm.safetensors"
    lm.save_prompt_cache(str(p), theirs, {"note": "x"})
    ours, info = load_cache_file(p)
    assert info.layout == "mlx-lm" and info.metadata == {"note": "x"}
    assert [c.offset for c in ours] == [14, 14, 14]
    assert mx.array_equal(ours[0].state[0], theirs[0].keys[..., :14, :])
    assert mx.array_equal(ours[1].state[0], theirs[1]._temporal_order(theirs[1].keys))
    # the wrapped ring keeps mlx-lm's slot order, and continues as mlx-lm's own
    assert ours[1]._idx == theirs[1]._idx == 6 and mx.array_equal(ours[1].keys, theirs[1].keys)
    k, v = rnd(1, 30), rnd(1, 31)
    got, want = ours[1].update_and_fetch(k, v), theirs[1].update_and_fetch(k, v)
    assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])


def test_writes_file_mlx_lm_loads(tmp_path):
    cache = [filled(KVCache()), filled(RotatingKVCache(8, 2), (10, 1, 1)), filled(QuantizedKVCache(32, 8))]
    p = tmp_path / "for_lm.safetensors"
    save_prompt_cache(p, cache, format="mlx-lm", metadata={"k": "v"})
    back, meta = lm.load_prompt_cache(str(p), return_metadata=True)
    assert meta == {"k": "v"} and [c.offset for c in back] == [12, 12, 12]
    assert mx.array_equal(back[0].state[0][..., :12, :], cache[0].state[0])
    # the wrapped ring is written as it is: mlx-lm's cache has our slot order
    assert back[1]._idx == cache[1]._idx == 4 and mx.array_equal(back[1].keys, cache[1].keys)
    k, v = rnd(1, 30), rnd(1, 31)
    got, want = back[1].update_and_fetch(k, v), cache[1].update_and_fetch(k, v)
    assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])
    with pytest.raises(UnsupportedCacheError):
        save_prompt_cache(tmp_path / "q.safetensors", [filled(QuantizedRotatingKVCache(8, 2, 32, 8))], format="mlx-lm")


def test_reads_legacy_layout(tmp_path):
    """Build a file in the mlx-lm <= 0.31 layout from its documented shape:
    metadata 0.{i} = meta_state, 1.* = user metadata, 2.{i} = class names."""
    kv, rot = lm.KVCache(), lm.RotatingKVCache(8, 2)
    for c in (kv, rot):
        c.update_and_fetch(rnd(10), rnd(10, 1))
        for i in range(3):
            c.update_and_fetch(rnd(1, 5 + i), rnd(1, 15 + i))
    arrays = {
        "0.0": kv.keys[..., :13, :], "0.1": kv.values[..., :13, :],
        "1.0": rot.keys, "1.1": rot.values,  # raw ring layout
    }
    meta = {
        "0.0": "",
        "0.1.0": str(rot.keep), "0.1.1": str(rot.max_size), "0.1.2": str(rot.offset), "0.1.3": str(rot._idx),
        "1.user": "kept",
        "2.0": "KVCache", "2.1": "RotatingKVCache",
    }
    p = tmp_path / "legacy.safetensors"
    mx.save_safetensors(str(p), arrays, meta)
    ours, info = load_cache_file(p)
    assert info.layout == "mlx-lm-legacy" and info.metadata == {"user": "kept"}
    assert mx.array_equal(ours[0].state[0], kv.keys[..., :13, :])
    assert mx.array_equal(ours[1].state[0], rot._temporal_order(rot.keys))
    assert ours[1].offset == 13
    assert ours[1]._idx == rot._idx == 5 and mx.array_equal(ours[1].keys, rot.keys)  # mlx-lm's slot order


# ----------------------------------------------------------------- bad files
@pytest.fixture
def good_file(tmp_path):
    p = tmp_path / "good.safetensors"
    save_prompt_cache(p, [filled(KVCache()), filled(KVCache())], tokens=list(range(12)), model=FP)
    return p


def rewrite_header(src, dst, edit):
    """``src`` with its header edited, written to ``dst``, the header checksum
    recomputed (as a forger would: the checks behind the checksum must hold alone)."""
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    dst.write_bytes(seal_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :]))
    return dst


def test_truncated_anywhere(good_file, tmp_path):
    raw = good_file.read_bytes()
    for cut in [0, 4, 8, 20, len(raw) // 2, len(raw) - 1]:
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(raw[:cut])
        with pytest.raises(CacheFileError, match="truncated|damaged|not a valid"):
            load_prompt_cache(bad)


def test_missing_and_foreign(tmp_path):
    with pytest.raises(CacheFileError, match="not found"):
        load_prompt_cache(tmp_path / "nope.safetensors")
    p = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(p), {"w": mx.zeros((2, 2))})
    with pytest.raises(CacheFormatError, match="not a prompt cache"):
        load_prompt_cache(p)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h["__metadata__"].update({"mlxcc.layer.0.class": "os.system"}), "unknown cache class"),
        (lambda h: h["__metadata__"].update({"mlxcc.layer.0.class": "__class__"}), "unknown cache class"),
        (lambda h: h["__metadata__"].update({"mlxcc.format_version": "99"}), "newer"),
        (lambda h: h["__metadata__"].update({"mlxcc.layer.0.meta": '["12x"]'}), "integer"),
        (lambda h: h["__metadata__"].update({"mlxcc.layer.0.meta": '["13"]'}), "hold|tokens"),
        (lambda h: h["__metadata__"].update({"mlxcc.tokens": "[1, 2]"}), "token ids"),
        (lambda h: h["__metadata__"].update({"mlxcc.tokens": "[-1]"}), "token ids"),
        (lambda h: h["__metadata__"].update({"mlxcc.num_layers": "3"}), "missing|class"),
        (lambda h: h["layer.0.0"].update({"shape": [1, 2, 13, 32]}), "byte range"),
        (lambda h: h["layer.0.0"].update({"dtype": "F64"}), "dtype"),
        (lambda h: h["layer.0.0"].update({"data_offsets": [0, 10**15]}), "byte range"),
        (lambda h: h["layer.0.1"].update({"data_offsets": h["layer.0.0"]["data_offsets"]}), "overlap|range"),
    ],
)
def test_tampered_header(good_file, tmp_path, edit, match):
    bad = rewrite_header(good_file, tmp_path / "bad.safetensors", edit)
    with pytest.raises(ChatCacheError, match=match):
        load_prompt_cache(bad)


def test_huge_declared_header(tmp_path):
    p = tmp_path / "huge.safetensors"
    p.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(CacheFileError, match="declares"):
        load_prompt_cache(p)


# ----------------------------------------------------------------- atomic writes
def test_failed_write_keeps_old_file(good_file, monkeypatch):
    before = good_file.read_bytes()

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", boom)
    with pytest.raises(CacheFileError, match="No space left.*unchanged"):
        save_prompt_cache(good_file, [filled(KVCache())], tokens=list(range(12)))
    assert good_file.read_bytes() == before
    assert [p.name for p in good_file.parent.iterdir()] == [good_file.name]


def test_model_cache_shapes_fit(llama_model):
    model, _ = llama_model
    check_cache_fits_model(make_prompt_cache(model), make_prompt_cache(model))


@pytest.mark.parametrize("kind", ["llama", "sliding", "hybrid"])
def test_mlx_lm_file_continues_identically(kind, tiny_model_dirs, tmp_path):
    """A cache made and saved by mlx-lm 0.32 itself, loaded by us, continues with
    exactly the logits mlx-lm's own cache gives (and ours can be written back for mlx-lm)."""
    from mlx_chatcache.models.loading import load

    model, _ = load(str(tiny_model_dirs[kind]))
    prompt = mx.array([[5, 9, 33, 71, 12, 40, 41, 7, 99, 100, 3, 17, 18, 19, 20, 21, 22, 23, 24, 25]])
    nxt = mx.array([[57, 58, 59]])
    theirs = lm.make_prompt_cache(model)
    model(prompt, cache=theirs)
    p = tmp_path / "from_mlx_lm.safetensors"
    lm.save_prompt_cache(str(p), theirs)
    ours = load_prompt_cache(p)
    check_cache_fits_model(ours, make_prompt_cache(model))
    expected = model(nxt, cache=theirs)
    got = model(nxt, cache=ours)
    assert mx.array_equal(expected, got)
    # and back: a file we write in mlx-lm format continues identically in mlx-lm
    q = tmp_path / "for_mlx_lm.safetensors"
    save_prompt_cache(q, ours, format="mlx-lm")
    again = lm.load_prompt_cache(str(q))
    assert mx.array_equal(model(mx.array([[60]]), cache=again), model(mx.array([[60]]), cache=ours))


# ------------------------------------------------------------------ room to grow after a load
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("make", [KVCache, lambda: QuantizedKVCache(32, 8)], ids=["float", "q8"])
def test_loaded_cache_grows_without_reallocating(tmp_path, dtype, make):
    """The file holds exactly the tokens; the loader reads them into buffers with
    room to the next step boundary, so the first updates after a resume write
    into that room, and it continues exactly like the cache that was saved."""
    from mlx.utils import tree_flatten

    from mlx_chatcache.cache.cache_base import kv_len
    from mlx_chatcache.files.safetensors_file import read_header

    saved = make()
    saved.update_and_fetch(rnd(200).astype(dtype), rnd(200, 1).astype(dtype))
    p = tmp_path / "c.safetensors"
    save_prompt_cache(p, [saved], tokens=list(range(200)))
    assert {t.shape[2] for t in read_header(p).tensors.values()} == {200}  # no room in the file
    (loaded,) = load_prompt_cache(p)
    assert kv_len(loaded.keys) == kv_len(loaded.values) == KVCache.step
    assert all(s.shape[2] == 200 for s in loaded.flat_state())  # the contract: live tokens only
    for i in range(3):
        k, v = rnd(7, 10 + i).astype(dtype), rnd(7, 20 + i).astype(dtype)
        want, got = saved.update_and_fetch(k, v), loaded.update_and_fetch(k, v)
        for a, b in zip(tree_flatten(want), tree_flatten(got)):
            assert a[1].dtype == b[1].dtype and mx.array_equal(a[1], b[1])
    assert kv_len(loaded.keys) == KVCache.step  # still the buffer it was loaded into


def test_loaded_float_buffer_is_written_in_place(tmp_path):
    import numpy as np

    c = KVCache()
    c.update_and_fetch(rnd(200), rnd(200, 1))
    save_prompt_cache(tmp_path / "c.safetensors", [c], tokens=list(range(200)))
    (loaded,) = load_prompt_cache(tmp_path / "c.safetensors")

    def address(a):
        return np.array(a, copy=False).__array_interface__["data"][0]

    before = address(loaded.keys)
    loaded.update_and_fetch(rnd(1, 5), rnd(1, 6))
    mx.eval(loaded.keys)
    assert address(loaded.keys) == before


def test_state_setter_takes_only_the_live_tokens_or_the_room_older_files_stored():
    c = KVCache()
    c.offset = 10
    for slots in (10, KVCache.step):
        ok = mx.zeros((1, 2, slots, 32))
        c.state = [ok, ok]
        assert c.state[0].shape[2] == 10
    for slots in (9, 11, KVCache.step + 1):
        bad = mx.zeros((1, 2, slots, 32))
        with pytest.raises(CacheFormatError, match="does not hold 10 tokens"):
            c.state = [bad, bad]


def test_file_changed_or_shortened_after_header_check(good_file, tmp_path):
    import dataclasses

    from mlx_chatcache.files.safetensors_file import read_arrays, read_header

    header = read_header(good_file)
    names = list(header.tensors)
    os.utime(good_file, ns=(0, 12345))  # same bytes, another file as far as we can tell
    with pytest.raises(CacheFileError, match="changed"):
        read_arrays(header)
    blind = dataclasses.replace(read_header(good_file), identity=())
    with open(good_file, "r+b") as f:
        f.truncate(blind.data_start + 4)
    with pytest.raises(CacheFileError, match="shrank or changed"):
        read_arrays(blind, names)


@pytest.mark.parametrize("make", [KVCache, lambda: QuantizedKVCache(32, 8)], ids=["float", "q8"])
@pytest.mark.parametrize("keep, grow", [(10, 290), (KVCache.step, 10)])  # room after the trim; none
def test_trimmed_tokens_never_reach_a_later_file(tmp_path, make, keep, grow):
    """Trim far back, save, grow past the next step again, save: each file
    stores exactly the live tokens, never the tokens trimmed before."""
    from mlx_chatcache.files.safetensors_file import read_arrays, read_header

    c = make()
    c.update_and_fetch(rnd(500, 1) + 5.0, rnd(500, 2) + 5.0)  # nothing near zero
    c.trim(500 - keep)
    save_prompt_cache(tmp_path / "a.safetensors", [c], tokens=list(range(keep)))
    c.update_and_fetch(rnd(grow, 3), rnd(grow, 4))  # past the next step: the second file stores more
    n = keep + grow
    save_prompt_cache(tmp_path / "b.safetensors", [c], tokens=list(range(n)))
    assert read_header(tmp_path / "a.safetensors").tensors["layer.0.0"].shape[2] == keep
    for name, arr in read_arrays(read_header(tmp_path / "b.safetensors")).items():
        assert arr.shape[2] == n, name
    (loaded,) = load_prompt_cache(tmp_path / "b.safetensors")
    assert same_live(loaded, c)


def test_reads_version_1_files_without_room(tmp_path):
    """Files from format version 1 hold exactly the live tokens; they still load,
    continue like the saved cache, and are written back in the current version."""
    from mlx_chatcache.cache.cache_base import kv_len

    c = filled(KVCache())
    p = tmp_path / "v1.safetensors"
    k, v = c.state
    meta = {
        "mlxcc.format": "mlx_chatcache", "mlxcc.format_version": "1", "mlxcc.num_layers": "1",
        "mlxcc.layer.0.class": "KVCache", "mlxcc.layer.0.meta": json.dumps(list(c.meta_state)),
        "mlxcc.layer.0.arrays": "2", "mlxcc.tokens": json.dumps(list(range(12))),
    }  # fmt: skip
    mx.save_safetensors(str(p), {"layer.0.0": k, "layer.0.1": v}, meta)
    (old,), info = load_cache_file(p)
    assert info.format_version == 1 and kv_len(old.keys) == 12  # room would more than double it
    assert_same([c], [old])
    got, want = old.update_and_fetch(rnd(2, 9), rnd(2, 9)), c.update_and_fetch(rnd(2, 9), rnd(2, 9))
    assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])
    save_prompt_cache(tmp_path / "new.safetensors", [old], tokens=list(range(14)))
    assert read_cache_info(tmp_path / "new.safetensors").format_version == FORMAT_VERSION == 5


def wrapped_rings():
    """Wrapped windows whose ring does not start at slot ``keep`` (float and quantized)."""
    return [filled(RotatingKVCache(8, 2), (10, 1, 1, 1)), filled(QuantizedRotatingKVCache(8, 2, 32, 8), (5, 1, 5, 1, 1))]


def same_live(a, b) -> bool:
    xs, ys = a.flat_state(), b.flat_state()
    return len(xs) == len(ys) and all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(xs, ys))


def same_buffers(a, b) -> bool:
    xs, ys = a.eval_arrays(), b.eval_arrays()
    return len(xs) == len(ys) and all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(xs, ys))


def step_both(a, b, seed):
    """One more token into each: the returned keys/values (the whole ring) are identical."""
    got, want = a.update_and_fetch(rnd(1, seed), rnd(1, seed + 1)), b.update_and_fetch(rnd(1, seed), rnd(1, seed + 1))
    flat = lambda kv: [t for x in kv for t in (x if isinstance(x, tuple) else (x,))]
    return all(mx.array_equal(x, y).item() for x, y in zip(flat(got), flat(want), strict=True))


def test_rotating_files_keep_the_live_slot_order(tmp_path):
    """A wrapped ring saved and loaded has the live buffer slot for slot (its ring
    position is in meta_state); both continue bit-identically, also past a wrap."""
    cache = wrapped_rings()
    assert [c._idx for c in cache] == [5, 4]  # the ring starts mid-buffer
    p = tmp_path / "ring.safetensors"
    save_prompt_cache(p, cache, tokens=list(range(13)))
    loaded = load_prompt_cache(p)
    assert_same(cache, loaded)  # state: temporal, as before; meta_state: the same ring_idx
    for c, l in zip(cache, loaded):
        assert l._idx == c._idx and same_buffers(l, c)
        for i in range(8):  # once around the ring and more
            assert step_both(l, c, 40 + 2 * i) and l._idx == c._idx


def test_reads_version_2_rotating_files_in_temporal_order(tmp_path):
    """Version 1/2 files have no ring_idx (3 / 5 meta values): they load as before,
    the ring starting at slot keep, holding the same tokens in temporal order."""
    cache = wrapped_rings()
    for c in cache:
        meta = list(c.meta_state)
        old_meta = meta[:3] if len(meta) == 4 else meta[:5]  # without ring_idx
        arrays = {f"layer.0.{j}": a for j, a in enumerate(c.flat_state())}
        p = tmp_path / f"v2-{type(c).__name__}.safetensors"
        mx.save_safetensors(str(p), arrays, {
            "mlxcc.format": "mlx_chatcache", "mlxcc.format_version": "2", "mlxcc.num_layers": "1",
            "mlxcc.layer.0.class": type(c).__name__, "mlxcc.layer.0.meta": json.dumps(old_meta),
            "mlxcc.layer.0.arrays": str(len(arrays)),
        })  # fmt: skip
        (old,), info = load_cache_file(p)
        assert info.format_version == 2 and old._idx == old.keep
        assert old.meta_state == tuple(old_meta) + (str(old.keep),)
        assert all(mx.array_equal(x, y).item() for x, y in zip(old.flat_state(), c.flat_state()))
        assert same_buffers(old, type(c).from_state(c.state, old_meta))  # temporal slots


def test_cache_bytes_are_the_file_and_load_with_the_same_checks(llama_model, tmp_path):
    import numpy as np

    from mlx_chatcache.errors import CacheFileError, ModelMismatchError
    from mlx_chatcache.files.mlxcc_format import load_prompt_cache_bytes, prompt_cache_bytes
    from mlx_chatcache.files.prompt_cache import PromptCache
    from mlx_chatcache.generation.templates import feed_all

    model, _ = llama_model
    tokens = [5 + i % 90 for i in range(70)]
    state = PromptCache.new(model)
    feed_all(model, state, tokens, 512)
    data = prompt_cache_bytes(state.cache, tokens=tokens, model=model.fingerprint, metadata={"k": "v"})
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, state.cache, tokens=tokens, model=model.fingerprint, metadata={"k": "v"})
    on_disk = load_cache_file(path)
    cache, info = load_prompt_cache_bytes(data, "mem", model=model.fingerprint)
    assert info.tokens == tokens and info.metadata == {"k": "v"} == on_disk[1].metadata
    assert len(data) == path.stat().st_size
    for a, b in zip(cache, on_disk[0]):
        for x, y in zip(a.flat_state(), b.flat_state()):
            np.testing.assert_array_equal(np.array(x), np.array(y))
    with pytest.raises(CacheFileError, match="mem is not a valid cache file"):
        load_prompt_cache_bytes(data[: len(data) // 2], "mem")
    other = ModelFingerprint("x", "0" * 64, "0" * 64)
    with pytest.raises(ModelMismatchError):
        load_prompt_cache_bytes(data, "mem", model=other)
