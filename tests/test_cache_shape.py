"""CacheShape: the one description of what shapes a cache, its one key list, a file's
recorded shape and adopt-or-refuse against flags."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_chatcache.cli.common import CONFIG_FLAGS
from mlx_chatcache.config import DEFAULTS, SHAPE_KEYS, CacheShape, GenerationConfig
from mlx_chatcache.errors import CacheFormatError

KV = ("kv_bits", "kv_group_size", "quantized_kv_start", "kv_dtype")
sizes = st.none() | st.integers(1, 10**6)
shapes = st.builds(CacheShape, sizes, st.integers(0, 100), st.sampled_from([None, 2, 4, 8]),
                   st.sampled_from([32, 64, 128]), st.integers(0, 10**4),
                   st.sampled_from(["auto", "float16", "bfloat16", "float32"]))  # fmt: skip


def test_one_key_list_for_config_files_and_flags():
    assert SHAPE_KEYS == ("max_kv_size", "keep", "kv_bits", "kv_group_size", "quantized_kv_start", "kv_dtype")
    config_fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    assert set(SHAPE_KEYS) <= config_fields
    assert DEFAULTS.shape == CacheShape()  # the defaults are CacheShape's
    assert set(SHAPE_KEYS) - set(CONFIG_FLAGS) == {"keep"}  # every other shape key is a flag


@given(shapes)
def test_config_and_shape_round_trip(shape):
    config = DEFAULTS.updated(temp=0.5).shaped(shape)
    assert config.shape == shape and config.temp == 0.5
    assert list(shape.settings()) == list(SHAPE_KEYS)
    assert CacheShape.recorded({**shape.settings(), "weights": "q"}, "f") == shape
    windowed = DEFAULTS.windowed(shape).shape
    assert (windowed.max_kv_size, windowed.keep) == (shape.max_kv_size, shape.keep)
    assert {k: getattr(windowed, k) for k in KV} == {k: getattr(DEFAULTS, k) for k in KV}


def test_recorded_fills_defaults_and_refuses_a_damaged_window():
    assert CacheShape.recorded({}, "f") == CacheShape()
    assert CacheShape.recorded({"kv_bits": 8}, "f") == CacheShape(kv_bits=8)
    for bad in ({"max_kv_size": "64"}, {"max_kv_size": 64, "keep": 1.5}, {"max_kv_size": 64.0}):
        with pytest.raises(CacheFormatError, match=r"^f: settings max_kv_size/keep are not integers"):
            CacheShape.recorded(bad, "f")


@given(shapes, st.dictionaries(st.sampled_from(SHAPE_KEYS + ("temp",)), st.none() | st.integers(1, 512)))
def test_adopted_takes_kv_flags_and_refuses_another_window(made, flags):
    got = made.adopted(flags)
    want = flags.get("max_kv_size")
    if want is not None and want != made.max_kv_size:
        assert got is None
        return
    assert (got.max_kv_size, got.keep) == (made.max_kv_size, made.keep)  # the window is the file's
    for k in KV:
        assert getattr(got, k) == (flags[k] if flags.get(k) is not None else getattr(made, k))
