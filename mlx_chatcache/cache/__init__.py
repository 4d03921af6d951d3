"""The cache module: every per-layer cache type, the class registry, and
prompt-cache helpers (a prompt cache is a list with one cache per layer).

- :func:`make_prompt_cache` mirrors a model's own ``make_cache()`` (mlx-lm cache
  objects) into our classes, optionally bounding full-attention layers with a
  rotating window (``max_kv_size``, pinning the first ``keep`` tokens).
- :data:`CACHE_CLASSES` is the explicit registry used to rebuild caches from
  files: names read from a file are looked up here and nowhere else.
- :data:`UNSUPPORTED` lists mlx-lm cache classes we knowingly do not mirror,
  each with the reason.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import mlx.core as mx

from .cache_base import BaseCache, check_arrays, parse_ints, shown
from .cache_kv import ChunkedKVCache, KVCache, QuantizedKVCache
from .cache_rotating import QuantizedRotatingKVCache, RotatingKVCache
from ..config import DEFAULTS
from ..errors import CacheFormatError, UnsupportedCacheError


class ArraysCache(BaseCache):
    """Fixed-size state slots (SSM / convolution layers). Not trimmable:
    the state after n tokens cannot be rolled back to n - k."""

    def __init__(self, size: int, left_padding=None):
        self._init_empty()
        self.cache = [None] * size

    def _init_empty(self) -> None:
        self.cache: list = []
        self.offset = 0
        self.left_padding = None  # batch padding: unused in single-stream work
        self.lengths = None
        self._present = None  # slot flags read from meta_state, until state is set

    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, value) -> None:
        self.cache[i] = value

    def advance(self, n: int) -> None:
        self.offset += n

    def make_mask(self, N: int, **_ignored):
        return None

    @property
    def state(self) -> list[mx.array]:
        return [a for a in self.cache if a is not None]

    @state.setter
    def state(self, v: Sequence[mx.array]) -> None:
        flags = self._present if self._present is not None else [a is not None for a in self.cache]
        slots = [i for i, p in enumerate(flags) if p]
        check_arrays("ArraysCache", v, len(slots))
        self.cache = [None] * len(flags)
        for i, a in zip(slots, v):
            self.cache[i] = a

    @property
    def meta_state(self) -> tuple[str, ...]:
        present = "".join("1" if a is not None else "0" for a in self.cache)
        return (str(self.offset), present or "-")

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        if len(v) != 2:
            raise CacheFormatError(f"ArraysCache meta state needs 2 values, got {len(v)}")
        (self.offset,) = parse_ints("ArraysCache", v[:1], ["offset"])
        flags = "" if v[1] == "-" else v[1]
        if not isinstance(flags, str) or len(flags) > 64 or set(flags) - {"0", "1"}:
            raise CacheFormatError(f"ArraysCache slot flags must be 0/1 digits, got {shown(v[1])}")
        self._present = [c == "1" for c in flags]
        self.cache = [None] * len(flags)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return all(a is None for a in self.cache)


class CacheList(BaseCache):
    """Several caches serving one layer (e.g. an SSM state and a KV cache)."""

    def __init__(self, *caches: BaseCache):
        self.caches = tuple(caches)

    def _init_empty(self) -> None:
        self.caches = ()
        self._spec: list[tuple[str, tuple[str, ...], int]] = []

    def __getitem__(self, i):
        return self.caches[i]

    @property
    def offset(self) -> int:
        return max((c.offset for c in self.caches), default=0)

    @property
    def state(self) -> list[mx.array]:
        return [a for c in self.caches for a in c.state]

    @state.setter
    def state(self, v: Sequence[mx.array]) -> None:
        check_arrays("CacheList", v, sum(n for _, _, n in self._spec))
        caches, i = [], 0
        for name, meta, n in self._spec:
            caches.append(cache_class(name).from_state(v[i : i + n], meta))
            i += n
        self.caches = tuple(caches)

    @property
    def meta_state(self) -> tuple[str, ...]:
        out = [str(len(self.caches))]
        for c in self.caches:
            out += [type(c).__name__, json.dumps(list(c.meta_state)), str(len(c.state))]
        return tuple(out)

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        if not v or not (v[0].isascii() and v[0].isdigit()) or len(v) != 1 + 3 * int(v[0]):
            raise CacheFormatError("CacheList meta state is malformed")
        self._spec = []
        for j in range(int(v[0])):
            name, meta, n = v[1 + 3 * j : 4 + 3 * j]
            try:
                meta = json.loads(meta)
            except (ValueError, TypeError, RecursionError) as e:  # bad JSON, huge ints, deep nesting
                raise CacheFormatError(f"CacheList child {j} meta state is not JSON") from e
            if not isinstance(meta, list) or not all(isinstance(m, str) for m in meta):
                raise CacheFormatError(f"CacheList child {j} meta state is not a list of strings")
            (count,) = parse_ints("CacheList", [n], ["array count"])
            self._spec.append((name, tuple(meta), count))

    def eval_arrays(self) -> list[mx.array]:
        return [a for c in self.caches for a in c.eval_arrays()]

    def is_trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.caches)

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        return [c.trim(n) for c in self.caches][0] if self.caches else 0

    def size(self) -> int:
        return max((c.size() for c in self.caches), default=0)

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)


# ------------------------------------------------------------------ registry
CACHE_CLASSES: dict[str, type[BaseCache]] = {
    cls.__name__: cls
    for cls in (
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
        QuantizedRotatingKVCache,
        ChunkedKVCache,
        ArraysCache,
        CacheList,
    )
}

UNSUPPORTED: dict[str, str] = {
    "LayerCache": "deepseek_v41's compressed-attention cache keeps pending compressor "
    "state with its own update protocol; generate with mlx-lm for that model",
    "BatchKVCache": "batched (multi-sequence) generation only; single-stream work uses KVCache",
    "BatchRotatingKVCache": "batched (multi-sequence) generation only; single-stream work "
    "uses RotatingKVCache",
}


def cache_class(name: str) -> type[BaseCache]:
    """The registered class called ``name``; UnsupportedCacheError otherwise."""
    if not isinstance(name, str) or name not in CACHE_CLASSES:
        reason = UNSUPPORTED.get(name) if isinstance(name, str) else None
        known = ", ".join(sorted(CACHE_CLASSES))
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."  # names from hostile files
        raise UnsupportedCacheError(
            f"unknown cache class {shown}"
            + (f" ({reason})" if reason else "")
            + f"; known classes: {known}. The file may come from a newer version or be damaged"
        )
    return CACHE_CLASSES[name]


# mlx-lm cache class name -> builder of our equivalent (empty) cache
_MIRROR: dict[str, Callable[[Any], BaseCache]] = {
    "KVCache": lambda c: KVCache(),
    "ConcatenateKVCache": lambda c: KVCache(),
    "QuantizedKVCache": lambda c: QuantizedKVCache(c.group_size, c.bits),
    "RotatingKVCache": lambda c: RotatingKVCache(c.max_size, c.keep),
    "ChunkedKVCache": lambda c: ChunkedKVCache(c.chunk_size),
    "ArraysCache": lambda c: ArraysCache(len(c.cache)),
    "CacheList": lambda c: CacheList(*(mirror_cache(x) for x in c.caches)),
}


def mirror_cache(c: Any) -> BaseCache:
    """Our cache equivalent to one (empty) mlx-lm cache object."""
    if isinstance(c, BaseCache):
        return c
    name = type(c).__name__
    if name not in _MIRROR:
        reason = UNSUPPORTED.get(name, "no mlx_chatcache equivalent yet")
        raise UnsupportedCacheError(f"the model uses cache class {name}: {reason}")
    return _MIRROR[name](c)


# ------------------------------------------------------------------ prompt caches
def make_prompt_cache(model, max_kv_size: int | None = None, keep: int | None = None) -> list[BaseCache]:
    """One cache per layer, mirroring ``model.make_cache()`` when it exists.

    With ``max_kv_size``, full-attention ``KVCache`` layers become
    ``RotatingKVCache(max_kv_size, keep)`` (``keep`` defaults to DEFAULTS.keep).
    """
    if hasattr(model, "make_cache"):
        cache = [mirror_cache(c) for c in model.make_cache()]
    else:
        cache = [KVCache() for _ in model.layers]
    if max_kv_size is None:
        return cache
    keep = DEFAULTS.keep if keep is None else keep
    keep = min(keep, max_kv_size - 1)

    def bound(c):
        if type(c) is KVCache:
            return RotatingKVCache(max_kv_size, keep)
        if isinstance(c, CacheList):
            return CacheList(*(bound(x) for x in c.caches))
        return c

    return [bound(c) for c in cache]


def can_trim_prompt_cache(cache: Sequence[BaseCache]) -> bool:
    return bool(cache) and all(c.is_trimmable() for c in cache)


def trim_prompt_cache(cache: Sequence[BaseCache], num_tokens: int) -> int:
    """Trim every layer by ``num_tokens`` when all can; returns tokens trimmed (0 if not)."""
    if not can_trim_prompt_cache(cache):
        return 0
    return [c.trim(num_tokens) for c in cache][0]


def quantize_prompt_cache(
    cache: list[BaseCache], group_size: int, bits: int, start: int = 0
) -> list[BaseCache]:
    """Replace float K/V layers holding >= ``start`` tokens by quantized ones, in place."""

    def q(c):
        if type(c) in (KVCache, RotatingKVCache) and c.offset >= start:
            return c.to_quantized(group_size=group_size, bits=bits)
        if isinstance(c, CacheList):
            return CacheList(*(q(x) for x in c.caches))
        return c

    cache[:] = [q(c) for c in cache]
    return cache


def copy_prompt_cache(cache: Sequence[BaseCache]) -> list[BaseCache]:
    """An independent copy (a checkpoint): later updates to either side do not leak."""
    return [type(c).from_state(c.state, c.meta_state) for c in cache]


def prompt_cache_nbytes(cache: Sequence[BaseCache]) -> int:
    return sum(c.nbytes for c in cache)


def cache_offset(cache: Sequence[BaseCache]) -> int:
    """Tokens the prompt cache has seen (the largest layer offset)."""
    return max((c.offset for c in cache), default=0)


__all__ = [
    "BaseCache",
    "KVCache",
    "QuantizedKVCache",
    "RotatingKVCache",
    "QuantizedRotatingKVCache",
    "ChunkedKVCache",
    "ArraysCache",
    "CacheList",
    "CACHE_CLASSES",
    "UNSUPPORTED",
    "cache_class",
    "mirror_cache",
    "make_prompt_cache",
    "can_trim_prompt_cache",
    "trim_prompt_cache",
    "quantize_prompt_cache",
    "copy_prompt_cache",
    "prompt_cache_nbytes",
    "cache_offset",
]
