"""Batches of our caches (mlx-lm's batched generation): ``merge`` several
one-sequence caches, run the model on the batch, ``extract`` each row back.

Invariants: one model step on the batch gives each row the logits it gets alone (to
float32 rounding, ``TOL``) and its greedy token; a row extracted is our one-sequence
class holding exactly its tokens (no padding of other rows) and its offset, and
continues like the cache that never left; the batch methods keep the rows they say
they keep.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_chatcache import load_prompt_cache, save_prompt_cache
from mlx_chatcache.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    copy_prompt_cache,
    make_prompt_cache,
)
from mlx_chatcache.errors import UnsupportedCacheError

LENGTHS = (0, 5, 17)
# A batch and a row alone multiply different numbers of rows and attend over differently padded
# keys, so they agree to float32 rounding, not bit for bit: on logits <= ~9 measured <= 7.6e-6
# (OpenBLAS, Xeon AVX-512) and <= 5.7e-6 (bundled BLAS); asserted < 3e-5, with equal greedy tokens.
TOL = 3e-5


def _max_diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a - b).max().item()


def _random_kv(rng, n: int, heads: int = 2, dim: int = 64):
    def one():
        return mx.array(rng.standard_normal((1, heads, n, dim)).astype(np.float32))

    return one(), one()


def _step(model, caches: list, tokens: list[int]) -> mx.array:
    """Logits ``(rows, vocab)`` of one token per row."""
    out = model(mx.array([[t] for t in tokens]), cache=caches)[:, -1, :]
    mx.eval(out)
    return out


def _merged(rows: list[list]) -> list:
    """Layer ``l`` of the batch: the merge of every row's layer ``l``."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*rows)]


def _held(c) -> list[mx.array]:
    return c.flat_state()


# ------------------------------------------------------------------ K/V batches on a model
def test_merged_kv_caches_step_as_each_row_alone_and_extract_as_our_class(make_tiny_model):
    model, _ = make_tiny_model("llama")
    rng = np.random.default_rng(3)
    rows = []
    for n in LENGTHS:
        row = make_prompt_cache(model)
        for c in row:
            if n:
                c.update_and_fetch(*_random_kv(rng, n))
        rows.append(row)
    solo = [copy_prompt_cache(r) for r in rows]
    batch = _merged(rows)
    assert all(isinstance(c, BatchKVCache) for c in batch)

    tokens = [7, 11, 13]
    together = _step(model, batch, tokens)
    for i, n in enumerate(LENGTHS):
        alone = _step(model, solo[i], [tokens[i]])
        assert _max_diff(together[i], alone[0]) < TOL, (n, _max_diff(together[i], alone[0]))
        assert together[i].argmax().item() == alone[0].argmax().item()

    for i, n in enumerate(LENGTHS):
        row = [c.extract(i) for c in batch]
        for layer, own in zip(row, solo[i]):
            assert type(layer) is KVCache and layer.offset == n + 1 and layer.size() == n + 1
            keys, values = layer.state
            assert keys.shape[2] == values.shape[2] == n + 1  # its tokens, no padding
            if n:  # the tokens it had are the very same values
                assert mx.array_equal(keys[..., :n, :], own.state[0][..., :n, :])
                assert mx.array_equal(values[..., :n, :], own.state[1][..., :n, :])
            for mine, theirs in zip(layer.state, own.state):
                assert _max_diff(mine, theirs) < TOL
            assert layer.meta_state == own.meta_state  # one sequence again: our file state
        # it continues like the cache that never joined the batch
        nxt = 29 + i
        assert _max_diff(_step(model, row, [nxt])[0], _step(model, solo[i], [nxt])[0]) < TOL


def test_an_empty_row_extracts_as_an_empty_cache():
    a, b = KVCache(), KVCache()
    b.update_and_fetch(*_random_kv(np.random.default_rng(0), 4))
    batch = KVCache.merge([a, b])
    empty, full = batch.extract(0), batch.extract(1)
    assert type(empty) is KVCache and empty.offset == 0 and empty.state == []
    assert type(full) is KVCache and full.offset == 4
    assert all(mx.array_equal(x, y) for x, y in zip(full.state, b.state))
    assert type(KVCache.merge([KVCache(), KVCache()])) is BatchKVCache


@pytest.mark.parametrize("kind", ["sliding", "hybrid", "ssm"])
def test_caches_of_fed_prompts_step_as_each_row_alone(make_tiny_model, kind):
    """Window, convolution and SSM layers too: rows fed prompts of 5, 9 and 21 tokens
    (past the sliding window of 16), merged, step together as each alone."""
    model, _ = make_tiny_model(kind)
    rng = np.random.default_rng(5)
    rows = []
    for n in (5, 9, 21):
        row = make_prompt_cache(model)
        model(mx.array(rng.integers(3, 300, (1, n))), cache=row)
        for c in row:  # what call_model does for layers that do not count their tokens
            if isinstance(c, ArraysCache) and c.offset != n:
                c.offset = n
        mx.eval([c.flat_state() for c in row])
        rows.append(row)
    solo = [copy_prompt_cache(r) for r in rows]
    batch = _merged(rows)
    tokens = [17, 19, 23]
    together = _step(model, batch, tokens)
    for i in range(3):
        alone = _step(model, solo[i], [tokens[i]])[0]
        assert _max_diff(together[i], alone) < TOL and together[i].argmax().item() == alone.argmax().item()
    for i in range(3):
        row = [c.extract(i) for c in batch]
        for layer, own in zip(row, solo[i]):
            assert type(layer) is type(own) and layer.offset == own.offset
            # a window comes back in temporal slot order (its ring position, the last field, may differ)
            cut = 3 if isinstance(own, RotatingKVCache) else None
            assert layer.meta_state[:cut] == own.meta_state[:cut]
            for mine, theirs in zip(_held(layer), _held(own)):
                assert mine.shape == theirs.shape and _max_diff(mine, theirs) < TOL
        assert _max_diff(_step(model, row, [31])[0], _step(model, solo[i], [31])[0]) < TOL


# ------------------------------------------------------------------ windows
def test_window_rows_extract_as_our_window_with_exactly_their_tokens():
    rng = np.random.default_rng(2)
    caches = []
    for n in (0, 3, 8, 13):
        c = RotatingKVCache(8)
        for k in (n // 2, n - n // 2):
            if k:
                c.update_and_fetch(*_random_kv(rng, k, dim=4))
        caches.append(c)
    batch = RotatingKVCache.merge(caches)
    assert isinstance(batch, BatchRotatingKVCache)
    for i, c in enumerate(caches):
        row = batch.extract(i)
        assert type(row) is RotatingKVCache and row.offset == c.offset and row.size() == c.size()
        assert len(row.state) == len(c.state)
        assert all(mx.array_equal(x, y) for x, y in zip(row.state, c.state))


def test_what_cannot_be_batched_is_refused_in_one_line():
    with pytest.raises(UnsupportedCacheError, match="keep > 0"):
        RotatingKVCache.merge([RotatingKVCache(8, 2), RotatingKVCache(8, 2)])
    with pytest.raises(UnsupportedCacheError, match="sizes \\[4, 8\\]"):
        RotatingKVCache.merge([RotatingKVCache(8), RotatingKVCache(4)])
    with pytest.raises(UnsupportedCacheError, match="different classes"):
        KVCache.merge([KVCache(), RotatingKVCache(8)])
    with pytest.raises(UnsupportedCacheError, match="QuantizedKVCache.merge is not supported"):
        QuantizedKVCache.merge([QuantizedKVCache(32, 8)])


# ------------------------------------------------------------------ ArraysCache batches
def _arrays_row(rng, offset: int, present=(True, True)) -> ArraysCache:
    c = ArraysCache(2)
    if present[0]:
        c[0] = mx.array(rng.standard_normal((1, 3, 4)).astype(np.float32))
    if present[1]:
        c[1] = mx.array(rng.standard_normal((1, 5)).astype(np.float32))
    c.offset = offset
    return c


def _same_row(a: ArraysCache, b: ArraysCache) -> bool:
    return (
        type(a) is ArraysCache
        and a.offset == b.offset
        and not a.batched()
        and a.meta_state[0] == b.meta_state[0]
        and all((x is None and y is None) or (y is None and not mx.any(x).item()) or mx.array_equal(x, y)
                for x, y in zip(a.cache, b.cache))  # fmt: skip
    )


def test_arrays_cache_batch_round_trip():
    rng = np.random.default_rng(4)
    rows = [_arrays_row(rng, 4), _arrays_row(rng, 0, (False, False)), _arrays_row(rng, 9)]
    batch = ArraysCache.merge(rows)
    assert batch.batched() and batch.batch_size == 3 and batch.make_mask(4) is None
    assert batch[0].shape == (3, 3, 4) and not mx.any(batch[0][1]).item()  # the empty row is zeros
    for i, r in enumerate(rows):
        assert _same_row(batch.extract(i), r)

    batch.filter([2, 0])
    assert [batch.extract(i).offset for i in range(2)] == [9, 4]
    assert _same_row(batch.extract(0), rows[2]) and _same_row(batch.extract(1), rows[0])

    extra = _arrays_row(rng, 6)
    batch.extend(extra)  # a one-sequence cache joins as one row
    batch.extend(ArraysCache.merge([ArraysCache(2), ArraysCache(2)]))
    assert batch.batch_size == 5 and batch[1].shape == (5, 5)
    assert _same_row(batch.extract(2), extra)
    assert batch.left_padding.tolist() == [0, 0, 0, 0, 0]
    assert [batch.extract(i).offset for i in range(5)] == [9, 4, 6, 0, 0]


def test_arrays_cache_made_with_left_padding_is_a_batch():
    for pads in ([2, 0], mx.array([2, 0])):
        c = ArraysCache(1, left_padding=pads)
        assert c.batched() and c.batch_size == 2 and c.make_mask(3).tolist() == [[False, False, True], [True] * 3]
    assert not ArraysCache(1).batched() and not ArraysCache(1, left_padding=[]).batched()


def test_arrays_cache_padding_masks_and_counts_only_real_tokens():
    c = ArraysCache.merge([ArraysCache(1), ArraysCache(1), ArraysCache(1)])
    c.prepare(lengths=[6, 3, 5], left_padding=[0, 0, 2])
    mask = c.make_mask(6)
    assert mask.tolist() == [[True] * 6, [True] * 3 + [False] * 3, [False] * 2 + [True] * 3 + [False]]
    assert c.lengths.tolist() == [6, 3, 5] and c.left_padding.tolist() == [0, 0, 2]
    c.advance(4)
    assert c.lengths.tolist() == [2, -1, 1] and c.left_padding.tolist() == [-4, -4, -2]
    c.advance(2)
    c.finalize()
    assert c.make_mask(1) is None and c.lengths is None and c.left_padding is None
    assert [c.extract(i).offset for i in range(3)] == [6, 3, 3]


def test_a_batch_has_no_one_sequence_file_state_and_saves_in_mlx_lms_layout(tmp_path):
    rng = np.random.default_rng(6)
    batch = ArraysCache.merge([_arrays_row(rng, 2), _arrays_row(rng, 3), ArraysCache(2)])
    batch.prepare(lengths=[4, 2, 3], left_padding=[0, 1, 0])
    with pytest.raises(UnsupportedCacheError, match="extract its rows"):
        batch.meta_state
    with pytest.raises(UnsupportedCacheError, match="extract its rows"):
        CacheList.merge([CacheList(_arrays_row(rng, 2)), CacheList(_arrays_row(rng, 3))]).meta_state
    path = str(tmp_path / "b.safetensors")
    with pytest.raises(UnsupportedCacheError, match="tokens"):  # mlx-lm's layout holds no tokens
        save_prompt_cache(path, [batch], tokens=[1, 2])
    save_prompt_cache(path, [batch])
    (back,) = load_prompt_cache(path)
    assert type(back) is ArraysCache and back.batched()
    assert back.left_padding.tolist() == [0, 1, 0] and back.lengths.tolist() == [4, 2, 3]
    assert all(mx.array_equal(x, y) for x, y in zip(back.cache, batch.cache))


# ------------------------------------------------------------------ CacheList batches
def test_cache_list_batch_round_trip():
    rng = np.random.default_rng(7)
    rows = []
    for n in (3, 0, 6):
        kv = KVCache()
        if n:
            kv.update_and_fetch(*_random_kv(rng, n, dim=4))
        rows.append(CacheList(_arrays_row(rng, n), kv))
    batch = CacheList.merge(rows)
    assert isinstance(batch[0], ArraysCache) and isinstance(batch[1], BatchKVCache) and batch.batched()
    for i, r in enumerate(rows):
        row = batch.extract(i)
        assert type(row) is CacheList and not row.batched()
        assert _same_row(row[0], r[0])
        assert type(row[1]) is KVCache and row[1].offset == r[1].offset
        assert all(mx.array_equal(x, y) for x, y in zip(row[1].state, r[1].state))
        assert row.meta_state == r.meta_state
    batch.filter([2])
    assert batch.extract(0)[1].offset == 6


# ------------------------------------------------------------------ random batch histories
_ROW = st.tuples(st.integers(0, 50), st.booleans())  # (tokens seen, holds a state)
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("filter"), st.lists(st.integers(0, 7), max_size=6)),
        st.tuples(st.just("extend"), st.lists(_ROW, min_size=1, max_size=3)),
    ),
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(first=st.lists(_ROW, min_size=1, max_size=4), ops=_OPS)
def test_arrays_cache_rows_survive_any_merge_filter_extend_history(first, ops):
    """After any history of merge/filter/extend, row ``i`` extracts as the one-sequence
    cache it started as (a row with no state: zeros, when others have one)."""
    counter = iter(range(10_000))

    def make(offset: int, held: bool) -> ArraysCache:
        c = ArraysCache(1)
        if held:
            c[0] = mx.full((1, 3), float(next(counter) + 1))
        c.offset = offset
        return c

    rows = [make(*r) for r in first]
    batch = ArraysCache.merge(rows)
    for op, arg in ops:
        if op == "filter":
            keep = [i for i in dict.fromkeys(arg) if i < len(rows)]
            batch.filter(keep)
            rows = [rows[i] for i in keep]
        else:
            new = [make(*r) for r in arg]
            batch.extend(new[0] if len(new) == 1 else ArraysCache.merge(new))
            rows += new
    assert batch.batch_size == len(rows) or batch[0] is None
    for i, want in enumerate(rows):
        got = batch.extract(i)
        assert type(got) is ArraysCache and got.offset == want.offset and not got.batched()
        if want[0] is not None:
            assert mx.array_equal(got[0], want[0])
        else:
            assert got[0] is None or not mx.any(got[0]).item()


@pytest.mark.parametrize("kind", ["ssm", "hybrid"])
def test_a_right_padded_batch_prefill_gives_each_row_its_own_state(make_tiny_model, kind):
    """mlx-lm's batch prefill: prompts of 5 and 9 tokens right-padded to 9 in one call
    (``prepare(lengths=...)``, ``finalize()``): each row's next logits and extracted
    state are those of its prompt alone (the padding never reaches the state)."""
    model, _ = make_tiny_model(kind)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 9)]
    batch = _merged([make_prompt_cache(model) for _ in prompts])
    width = max(map(len, prompts))
    for c in batch:
        c.prepare(lengths=[len(p) for p in prompts], right_padding=[width - len(p) for p in prompts])
    model(mx.array([p + [0] * (width - len(p)) for p in prompts]), cache=batch)
    for c in batch:
        c.finalize()
    together = _step(model, batch, [17, 19])
    for i, p in enumerate(prompts):
        solo = make_prompt_cache(model)
        model(mx.array([p]), cache=solo)
        assert _max_diff(together[i], _step(model, solo, [[17, 19][i]])[0]) < TOL
        row = [c.extract(i) for c in batch]
        for layer, own in zip(row, solo):
            if isinstance(own, ArraysCache):
                assert layer.offset == own.offset == len(p) + 1
                for mine, theirs in zip(layer.cache, own.cache):  # SSM states reach ~3: relative
                    assert mx.allclose(mine, theirs, rtol=1e-4, atol=TOL).item()
