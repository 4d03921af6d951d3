"""The cache class registry covers what mlx-lm's models build.

The installed mlx-lm's ``mlx_lm/models/*.py`` (not ``cache.py``) is scanned for
cache classes the models construct or import from ``.cache``; every one must
be mirrored by ``mlx_chatcache.cache`` (``_MIRROR``, checked on a real mlx-lm
instance) or listed in ``UNSUPPORTED`` with a reason. Names read from files are
resolved through ``CACHE_CLASSES`` only.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm

from mlx_chatcache import cache as cc
from mlx_chatcache.cache import (
    CACHE_CLASSES,
    UNSUPPORTED,
    ArraysCache,
    BaseCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    cache_class,
    make_prompt_cache,
    mirror_cache,
)
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.errors import UnsupportedCacheError

MODELS_DIR = Path(importlib.util.find_spec("mlx_lm.models").submodule_search_locations[0])

_CONSTRUCTED = re.compile(r"\b([A-Z]\w*Cache|CacheList)\s*\(")
_IMPORT = re.compile(r"from\s+\.cache\s+import\s+(\([^)]*\)|[^\n]*)")
_CLASS_DEF = re.compile(r"^class\s+([A-Z]\w*Cache)\b", re.M)


def scan_model_sources() -> dict[str, set[str]]:
    """Cache class name -> model files that construct, import or define it."""
    found: dict[str, set[str]] = {}
    for path in sorted(MODELS_DIR.glob("*.py")):
        if path.name == "cache.py":
            continue
        src = path.read_text(encoding="utf-8")
        names = set(_CONSTRUCTED.findall(src)) | set(_CLASS_DEF.findall(src))
        for m in _IMPORT.finditer(src):
            for name in re.findall(r"\b\w+\b", m.group(1)):
                if name != "as" and name[0].isupper() and ("Cache" in name):
                    names.add(name)
        for name in names:
            found.setdefault(name, set()).add(path.name)
    return found


@pytest.fixture(scope="module")
def scanned():
    return scan_model_sources()


def test_scan_finds_the_common_classes(scanned):
    """Guard against a silently broken scan."""
    assert {"KVCache", "RotatingKVCache", "ArraysCache", "CacheList"} <= set(scanned)
    assert len(scanned["KVCache"]) > 20


def test_every_cache_class_models_use_is_covered_or_explained(scanned):
    missing = {
        name: sorted(files)[:5]
        for name, files in scanned.items()
        if name not in cc._MIRROR and not (isinstance(UNSUPPORTED.get(name), str) and UNSUPPORTED[name].strip())
    }
    assert not missing, (
        "mlx-lm models use cache classes mlx_chatcache neither mirrors (_MIRROR) nor lists "
        f"in UNSUPPORTED with a reason: {missing}"
    )


def test_unsupported_entries_are_explained_and_not_registered():
    for name, reason in UNSUPPORTED.items():
        assert isinstance(reason, str) and len(reason.strip()) >= 20, name
        assert name not in CACHE_CLASSES and name not in cc._MIRROR


def test_registry_is_our_classes_only():
    for name, cls in CACHE_CLASSES.items():
        assert cls.__name__ == name
        assert issubclass(cls, BaseCache)
        assert cls.__module__.startswith("mlx_chatcache.")
        assert cache_class(name) is cls


@pytest.mark.parametrize(
    "name",
    ["os.system", "__class__", "__init__", "BaseCache", "", "KVCache ", "kvcache",
     "mlx_lm.models.cache.KVCache", "LRUPromptCache", "BatchKVCache", "LayerCache", None, 3],
)
def test_cache_class_refuses_unknown_names(name):
    with pytest.raises(UnsupportedCacheError):
        cache_class(name)


def test_cache_class_names_the_reason_for_unsupported():
    for name, reason in UNSUPPORTED.items():
        with pytest.raises(UnsupportedCacheError, match=re.escape(reason[:30])):
            cache_class(name)


# ----------------------------------------------------------------- mirroring
def _lm_instances():
    """A real mlx-lm instance for each name in _MIRROR (with non-default args)."""
    return {
        "KVCache": lambda: lm.KVCache(),
        "ConcatenateKVCache": lambda: lm.ConcatenateKVCache(),
        "QuantizedKVCache": lambda: lm.QuantizedKVCache(group_size=32, bits=4),
        "RotatingKVCache": lambda: lm.RotatingKVCache(max_size=16, keep=3),
        "ChunkedKVCache": lambda: lm.ChunkedKVCache(12),
        "ArraysCache": lambda: lm.ArraysCache(3),
        "CacheList": lambda: lm.CacheList(lm.ArraysCache(2), lm.KVCache(), lm.RotatingKVCache(8, 1)),
    }


def test_every_mirror_entry_has_an_instance_test():
    assert set(cc._MIRROR) <= set(_lm_instances()), "add the new _MIRROR entry to _lm_instances()"


def _expected_params(ours, theirs):
    name = type(theirs).__name__
    if name in ("KVCache", "ConcatenateKVCache"):
        assert type(ours) is KVCache
    elif name == "QuantizedKVCache":
        assert type(ours) is cc.QuantizedKVCache
        assert (ours.group_size, ours.bits) == (theirs.group_size, theirs.bits)
    elif name == "RotatingKVCache":
        assert type(ours) is RotatingKVCache
        assert (ours.max_size, ours.keep) == (theirs.max_size, theirs.keep)
    elif name == "ChunkedKVCache":
        assert type(ours) is cc.ChunkedKVCache and ours.chunk_size == theirs.chunk_size
    elif name == "ArraysCache":
        assert type(ours) is ArraysCache and len(ours.cache) == len(theirs.cache)
    elif name == "CacheList":
        assert type(ours) is CacheList and len(ours.caches) == len(theirs.caches)
        for o, t in zip(ours.caches, theirs.caches):
            _expected_params(o, t)
    else:
        raise AssertionError(f"no expectation for {name}")


def _kv(n, seed):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal((1, 2, n, 32)).astype(np.float32))


def _as_float(x, c):
    if isinstance(x, tuple):
        return mx.dequantize(*x, group_size=c.group_size, bits=c.bits)
    return x


@pytest.mark.parametrize("name", sorted(_lm_instances()))
def test_mirror_of_real_mlx_lm_instance(name):
    if not hasattr(lm, name):
        pytest.skip(f"mlx-lm has no {name}")
    theirs = _lm_instances()[name]()
    assert type(theirs).__name__ == name
    ours = mirror_cache(theirs)
    assert type(ours).__name__ in CACHE_CLASSES
    assert CACHE_CLASSES[type(ours).__name__] is type(ours)
    _expected_params(ours, theirs)
    assert ours.offset == 0 and ours.empty()
    assert mirror_cache(ours) is ours  # already ours: unchanged
    # same answers as mlx-lm for K/V caches while nothing is dropped
    if isinstance(ours, KVCache):
        for i, n in enumerate([5, 1, 1, 3]):
            k, v = _kv(n, i), _kv(n, 100 + i)
            tk, tv = theirs.update_and_fetch(k, v)
            ok, ov = ours.update_and_fetch(k, v)
            if name == "ConcatenateKVCache" or name == "KVCache":
                assert mx.array_equal(tk, ok).item() and mx.array_equal(tv, ov).item()
            else:
                assert mx.array_equal(_as_float(tk, theirs), _as_float(ok, ours)).item()
                assert mx.array_equal(_as_float(tv, theirs), _as_float(ov, ours)).item()
            assert ours.offset == theirs.offset


def test_mirror_refuses_unsupported_with_reason():
    theirs = lm.BatchKVCache(left_padding=[0])
    with pytest.raises(UnsupportedCacheError, match=re.escape(UNSUPPORTED["BatchKVCache"][:30])):
        mirror_cache(theirs)

    class SomethingCache:
        pass

    with pytest.raises(UnsupportedCacheError, match="SomethingCache"):
        mirror_cache(SomethingCache())


def test_mirror_refuses_deepseek_v41_layer_cache():
    mod = pytest.importorskip("mlx_lm.models.deepseek_v41")
    if not hasattr(mod, "LayerCache"):
        pytest.skip("no LayerCache in this mlx-lm")
    try:
        theirs = mod.LayerCache(8)
    except Exception:  # constructor changed: the name check above still holds
        pytest.skip("LayerCache not constructible here")
    with pytest.raises(UnsupportedCacheError, match="LayerCache"):
        mirror_cache(theirs)


# ----------------------------------------------------------------- tiny models
EXPECTED = {
    "llama": ["KVCache", "KVCache"],
    "sliding": ["RotatingKVCache", "KVCache", "RotatingKVCache"],
    "hybrid": ["ArraysCache", "KVCache", "ArraysCache"],
    "ssm": ["ArraysCache", "ArraysCache"],
}


def _all_layers(cache):
    for c in cache:
        yield c
        if isinstance(c, CacheList):
            yield from _all_layers(c.caches)


def test_make_prompt_cache_returns_only_our_classes(tiny_model):
    kind, model, _ = tiny_model
    theirs = model.make_cache()
    cache = make_prompt_cache(model)
    assert len(cache) == len(theirs) == len(model.layers)
    for c in _all_layers(cache):
        assert isinstance(c, BaseCache) and CACHE_CLASSES[type(c).__name__] is type(c)
        assert c.empty() and c.offset == 0
    for o, t in zip(cache, theirs):
        _expected_params(o, t)
    if kind in EXPECTED:
        assert [type(c).__name__ for c in cache] == EXPECTED[kind]


@pytest.mark.parametrize("max_kv,keep,want_keep", [(32, None, DEFAULTS.keep), (32, 0, 0), (3, 8, 2)])
def test_make_prompt_cache_bounds_full_attention_layers(tiny_model, max_kv, keep, want_keep):
    kind, model, _ = tiny_model
    base = make_prompt_cache(model)
    bounded = make_prompt_cache(model, max_kv_size=max_kv, keep=keep)
    for b, c in zip(base, bounded):
        if type(b) is KVCache:
            assert type(c) is RotatingKVCache and (c.max_size, c.keep) == (max_kv, want_keep)
        else:  # model-native windows and SSM state are left as they are
            assert type(c) is type(b) and c.meta_state == b.meta_state
