"""A quantized K/V cache's ``state`` is mlx-lm's nesting,
``[(keys, key_scales, key_biases), (values, value_scales, value_biases)]``, and
the setter takes only that; ``flat_state()`` is those six arrays in that order,
which is what a cache file stores (the on-disk layout of every earlier file)."""

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_chatcache.cache import CacheList, KVCache, QuantizedKVCache, QuantizedRotatingKVCache, copy_prompt_cache
from mlx_chatcache.errors import CacheFormatError
from mlx_chatcache.files.mlxcc_format import FORMAT_VERSION, load_prompt_cache, save_prompt_cache
from mlx_chatcache.files.safetensors_file import read_header

GS, BITS = 32, 4
KINDS = {
    "qkv": lambda: QuantizedKVCache(group_size=GS, bits=BITS),
    "qrot": lambda: QuantizedRotatingKVCache(64, 2, group_size=GS, bits=BITS),  # not wrapped
}


def kv(n, seed):
    return mx.random.normal((1, 2, n, 32), key=mx.random.key(seed))


def filled(kind, n=10):
    c = KINDS[kind]()
    K, V = kv(n, 1), kv(n, 2)
    c.update_and_fetch(K, V)
    return c, mx.quantize(K, group_size=GS, bits=BITS), mx.quantize(V, group_size=GS, bits=BITS)


def equal(xs, ys) -> bool:
    xs, ys = list(xs), list(ys)
    return len(xs) == len(ys) and all(
        x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(xs, ys)
    )


def next_outputs(c):
    k, v = c.update_and_fetch(kv(3, 7), kv(3, 8))
    return list(k) + list(v)


@pytest.mark.parametrize("kind", KINDS)
def test_state_is_mlx_lms_nesting(kind):
    c, Kq, Vq = filled(kind)
    s = c.state
    assert len(s) == 2 and all(isinstance(x, tuple) and len(x) == 3 for x in s)
    assert mx.array_equal(c.state[0][1], Kq[1]).item()  # the key scales, as mlx-lm's test reads them
    assert equal(s[0], Kq) and equal(s[1], Vq)
    assert equal(c.flat_state(), list(Kq) + list(Vq))
    assert equal(c.eval_arrays(), [a for x in (c.keys, c.values) for a in x])
    assert c.nbytes == sum(a.nbytes for a in c.eval_arrays())


@pytest.mark.parametrize("kind", KINDS)
def test_from_state_and_from_flat_state_continue_exactly_like_the_cache(kind):
    c, _, _ = filled(kind)
    rebuilt = [type(c).from_state(c.state, c.meta_state),
               type(c).from_flat_state(c.flat_state(), c.meta_state),
               copy_prompt_cache([c])[0]]  # fmt: skip
    for r in rebuilt:
        assert r.meta_state == c.meta_state and equal(r.flat_state(), c.flat_state())
    want = next_outputs(c)
    for r in rebuilt:
        assert equal(next_outputs(r), want)


@pytest.mark.parametrize("kind", KINDS)
def test_setter_takes_the_nested_form_only(kind):
    c, Kq, Vq = filled(kind)
    meta = c.meta_state
    with pytest.raises(CacheFormatError, match=r"state must be \[\(keys, key_scales, key_biases\)"):
        type(c).from_state(c.flat_state(), meta)  # the six arrays unnested
    with pytest.raises(CacheFormatError):
        type(c).from_state([Kq, Vq[:2]], meta)
    with pytest.raises(CacheFormatError, match="needs 6 arrays, got 5"):
        type(c).from_flat_state(c.flat_state()[:5], meta)
    r = type(c).from_state([list(Kq), list(Vq)], meta)  # lists inside are fine; state gives tuples
    assert all(isinstance(x, tuple) for x in r.state) and equal(r.flat_state(), c.flat_state())


leaf = st.sampled_from(["array", "int", "none"])
shapes = st.recursive(leaf, lambda inner: st.lists(inner, max_size=7) | st.lists(inner, max_size=7).map(tuple),
                      max_leaves=12)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes)
def test_any_other_nesting_is_refused_with_a_cache_format_error(shape):
    c, Kq, Vq = filled("qkv")
    arrays = iter([*Kq, *Vq] * 20)

    def build(s):
        if isinstance(s, (list, tuple)):
            return type(s)(build(x) for x in s)
        return {"array": lambda: next(arrays), "int": lambda: 3, "none": lambda: None}[s]()

    state = build(shape)
    if not isinstance(state, list):
        state = [state]
    exact = (len(state) == 2 and all(isinstance(x, (list, tuple)) and len(x) == 3 for x in state)
             and all(isinstance(a, mx.array) for x in state for a in x))  # fmt: skip
    if exact:
        return
    with pytest.raises(CacheFormatError):
        QuantizedKVCache.from_state(state, c.meta_state)


@pytest.mark.parametrize("kind", KINDS)
def test_file_stores_the_six_arrays_in_their_flat_order(tmp_path, kind):
    """The on-disk layout: ``layer.0.0`` .. ``layer.0.5`` are keys, key scales, key biases,
    values, value scales, value biases; a file written with those six arrays by
    hand (as every earlier version wrote them) loads into the nested state."""
    c, Kq, Vq = filled(kind)
    p = tmp_path / "q.safetensors"
    save_prompt_cache(p, [c], tokens=list(range(10)))
    header = read_header(p)
    assert header.metadata["mlxcc.format_version"] == str(FORMAT_VERSION)
    on_disk = mx.load(str(p))
    assert sorted(on_disk) == [f"layer.0.{j}" for j in range(6)]
    assert equal((on_disk[f"layer.0.{j}"] for j in range(6)), list(Kq) + list(Vq))

    by_hand = tmp_path / "by_hand.safetensors"
    mx.save_safetensors(str(by_hand), {f"layer.0.{j}": a for j, a in enumerate([*Kq, *Vq])}, header.metadata)
    (loaded,) = load_prompt_cache(by_hand)
    assert type(loaded) is type(c) and loaded.meta_state == c.meta_state
    assert equal(loaded.state[0], Kq) and equal(loaded.state[1], Vq)
    assert equal(next_outputs(loaded), next_outputs(c))


def test_cache_list_counts_and_stores_a_quantized_childs_six_arrays(tmp_path):
    q, Kq, Vq = filled("qkv")
    f = KVCache()
    f.update_and_fetch(kv(10, 3), kv(10, 4))
    cl = CacheList(q, f)
    assert cl.meta_state[1:4] == ("QuantizedKVCache", f'["10", "{GS}", "{BITS}"]', "6")
    assert equal(cl.state, [*Kq, *Vq, *f.state])
    p = tmp_path / "cl.safetensors"
    save_prompt_cache(p, [cl], tokens=list(range(10)))
    assert sorted(mx.load(str(p))) == [f"layer.0.{j}" for j in range(8)]
    (back,) = load_prompt_cache(p)
    assert equal(back.caches[0].state[0], Kq) and equal(back.flat_state(), cl.flat_state())
