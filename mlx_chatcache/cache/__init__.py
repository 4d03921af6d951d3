"""The cache module: every per-layer cache type, the class registry, and
prompt-cache helpers (a prompt cache is a list with one cache per layer).

- :func:`make_prompt_cache` mirrors a model's own ``make_cache()`` (mlx-lm cache
  objects) into our classes, optionally bounding full-attention layers with a
  rotating window (``max_kv_size``, pinning the first ``keep`` tokens).
- :data:`CACHE_CLASSES` is the explicit registry used to rebuild caches from
  files: names read from a file are looked up here and nowhere else.
- :data:`UNSUPPORTED` lists mlx-lm cache classes we knowingly do not mirror,
  each with the reason; :data:`UNSUPPORTED_METHODS` the batch methods that a
  class without them refuses, each with the reason.
- Batches (mlx-lm's batched generation): ``merge`` of one-sequence caches,
  ``extract`` of a row back (see ``batch.py``, ``cache_arrays.py`` and
  :class:`CacheList`).

Every class here is also a subclass of mlx-lm's class of the same name, so
mlx-lm's models and generate loop treat it as theirs (mamba stores its state
only in an ``ArraysCache`` it recognises); see ``docs/mlx-lm-compat.md``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.models import cache as mlx_lm_cache

from .batch import BatchKVCache, BatchRotatingKVCache
from .cache_arrays import ArraysCache
from .cache_base import BATCH_ONLY_METHODS, BaseCache, check_arrays, parse_ints, tree_arrays
from .cache_kv import ChunkedKVCache, KVCache, QuantizedKVCache, hold_kv_in
from .cache_rotating import QuantizedRotatingKVCache, RotatingKVCache
from ..config import DEFAULTS
from ..errors import CacheFormatError, UnsupportedCacheError, UsageError, clipped


class CacheList(BaseCache, mlx_lm_cache.CacheList):
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
        """Every child's ``flat_state()``, in order, as one flat list (of a batch:
        every array its children hold)."""
        return [a for c in self.caches for a in _arrays_of(c, "flat_state")]

    @state.setter
    def state(self, v: Sequence[mx.array]) -> None:
        check_arrays("CacheList", v, sum(n for _, _, n in self._spec))
        caches, i = [], 0
        for name, meta, n in self._spec:
            caches.append(cache_class(name).from_flat_state(v[i : i + n], meta))
            i += n
        self.caches = tuple(caches)

    def with_arrays(self, arrays: Sequence[mx.array]) -> "CacheList":
        """Each child's ``with_arrays`` of its share of ``arrays`` (the children's
        ``flat_state()`` in order)."""
        counts = [len(c.flat_state()) for c in self.caches]
        check_arrays("CacheList", arrays, sum(counts))
        starts = [sum(counts[:j]) for j in range(len(counts))]
        return CacheList(*(c.with_arrays(arrays[i : i + n]) for c, i, n in zip(self.caches, starts, counts)))

    @property
    def meta_state(self) -> tuple[str, ...]:
        if self.batched():
            raise UnsupportedCacheError(
                "a CacheList batch has no one-sequence file state: extract its rows (extract(i)) "
                "or save it with format='mlx-lm'"
            )
        out = [str(len(self.caches))]
        for c in self.caches:
            out += [type(c).__name__, json.dumps(list(c.meta_state)), str(len(c.flat_state()))]
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
        return [a for c in self.caches for a in _arrays_of(c, "eval_arrays")]

    # ----------------------------------------------------------- batches
    def batched(self) -> bool:
        """Whether the children are batches (made by ``merge``)."""
        return any(not hasattr(c, "flat_state") or getattr(c, "batched", lambda: False)() for c in self.caches)

    @classmethod
    def merge(cls, caches: Sequence["CacheList"]) -> "CacheList":
        """A batch of one-sequence lists: child ``j`` is the merge of every list's child ``j``."""
        if not caches or len({len(c.caches) for c in caches}) > 1:
            raise UnsupportedCacheError("CacheList.merge takes one or more lists with the same number of caches")
        return cls(*(type(kids[0]).merge(list(kids)) for kids in zip(*(c.caches for c in caches))))

    def extract(self, idx: int) -> "CacheList":
        """Row ``idx`` as a one-sequence list (each child's row, our classes)."""
        return CacheList(*(c.extract(idx) for c in self.caches))

    def filter(self, batch_indices) -> None:
        for c in self.caches:
            c.filter(batch_indices)

    def extend(self, other: "CacheList") -> None:
        for c, o in zip(self.caches, other.caches, strict=True):
            c.extend(o)

    def prepare(self, lengths=None, *, left_padding=None, right_padding=None) -> None:
        for c in self.caches:
            c.prepare(lengths=lengths, left_padding=left_padding, right_padding=right_padding)

    def finalize(self) -> None:
        for c in self.caches:
            c.finalize()

    def is_trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.caches)

    def can_take_back(self, n: int = 1) -> bool:
        return all(c.can_take_back(n) for c in self.caches)

    def always_trimmable(self) -> bool:
        return all(c.always_trimmable() for c in self.caches)

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        return [c.trim(n) for c in self.caches][0] if self.caches else 0

    def size(self) -> int:
        return max((c.size() for c in self.caches), default=0)

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)


def _arrays_of(c, method: str) -> list[mx.array]:
    """``c.<method>()`` of our cache; of a batch cache (mlx-lm's state), the arrays in its state."""
    if hasattr(c, method):
        return getattr(c, method)()
    return [a for a in tree_arrays(c.state) if isinstance(a, mx.array)]


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
    "BatchKVCache": "a batch of sequences has no one-sequence file state: extract its rows "
    "(KVCache) or save it with format='mlx-lm'",
    "BatchRotatingKVCache": "a batch of sequences has no one-sequence file state: extract its rows "
    "(RotatingKVCache) or save it with format='mlx-lm'",
}

UNSUPPORTED_METHODS: dict[str, str] = dict(BATCH_ONLY_METHODS)


def cache_class(name: str) -> type[BaseCache]:
    """The registered class called ``name``; UnsupportedCacheError otherwise."""
    if not isinstance(name, str) or name not in CACHE_CLASSES:
        reason = UNSUPPORTED.get(name) if isinstance(name, str) else None
        known = ", ".join(sorted(CACHE_CLASSES))
        raise UnsupportedCacheError(
            f"unknown cache class {clipped(repr(name), 80)}"
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
def make_prompt_cache(
    model, max_kv_size: int | None = None, keep: int | None = None, kv_dtype: str = DEFAULTS.kv_dtype
) -> list[BaseCache]:
    """One cache per layer, mirroring ``model.make_cache()`` when it exists.

    With ``max_kv_size``, full-attention ``KVCache`` layers become
    ``RotatingKVCache(max_kv_size, keep)`` (``keep`` defaults to DEFAULTS.keep).
    K/V layers hold their keys/values in ``kv_dtype`` (config.KV_DTYPES; "auto":
    as the model computes them); SSM state (ArraysCache) is never cast.
    """
    if hasattr(model, "make_cache"):
        cache = [mirror_cache(c) for c in model.make_cache()]
    else:
        cache = [KVCache() for _ in model.layers]
    if max_kv_size is None:
        return hold_kv_in(cache, kv_dtype)
    keep = DEFAULTS.keep if keep is None else keep
    keep = min(keep, max_kv_size - 1)

    def bound(c):
        if type(c) is KVCache:
            return RotatingKVCache(max_kv_size, keep)
        if isinstance(c, CacheList):
            return CacheList(*(bound(x) for x in c.caches))
        return c

    return hold_kv_in([bound(c) for c in cache], kv_dtype)


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
            check_group_size(c, group_size)
            return c.to_quantized(group_size=group_size, bits=bits)
        if isinstance(c, CacheList):
            return CacheList(*(q(x) for x in c.caches))
        return c

    cache[:] = [q(c) for c in cache]
    return cache


def kv_quantization_mismatch(cache: Sequence[BaseCache], bits: int | None, group_size: int,
                             start: int = 0) -> str | None:  # fmt: skip
    """Why ``cache`` cannot be what KV quantization ``bits``/``group_size`` from
    ``start`` tokens (as :func:`quantize_prompt_cache` applies it after each
    model call) makes, or None when it can: a quantized layer when ``bits`` is
    None or of other bits/group size, a float K/V layer holding >= ``start``
    tokens (at least one) when ``bits`` is set."""

    def leaves(cs):
        for c in cs:
            yield from leaves(c.caches) if isinstance(c, CacheList) else (c,)

    for c in leaves(cache):
        if isinstance(c, (QuantizedKVCache, QuantizedRotatingKVCache)):
            if bits is None or (c.bits, c.group_size) != (bits, group_size):
                asked = "kv_bits=None" if bits is None else f"kv_bits={bits}, kv_group_size={group_size}"
                return f"its K/V layers are quantized (kv_bits={c.bits}, kv_group_size={c.group_size}) but {asked}"
        elif bits is not None and type(c) in (KVCache, RotatingKVCache) and c.offset >= max(start, 1):
            return f"a float K/V layer holds {c.offset} tokens but kv_bits={bits} quantizes from {start}"
    return None


def check_group_size(c: BaseCache, group_size: int) -> None:
    """UsageError when the K/V head sizes of ``c`` are not multiples of ``group_size``
    (quantization groups run along the last axis), naming the group sizes that work."""
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    if keys is None or values is None:
        return
    dims = {keys.shape[-1], values.shape[-1]}  # (B, H, T, D)
    if all(d % group_size == 0 for d in dims):
        return
    ok = [g for g in (32, 64, 128) if all(d % g == 0 for d in dims)]
    use = ("use --kv-group-size " + " or ".join(map(str, ok))) if ok else "this model's KV cache cannot be quantized: drop --kv-bits"
    size = "/".join(map(str, sorted(dims)))
    raise UsageError(f"KV quantization group size {group_size} does not divide this model's head size {size}; {use}")


def copy_prompt_cache(cache: Sequence[BaseCache]) -> list[BaseCache]:
    """An independent copy (a checkpoint): later updates to either side do not leak."""
    return [c.with_arrays(c.flat_state()) for c in cache]


def compact_copy(cache: Sequence[BaseCache]) -> list[BaseCache]:
    """A copy of ``cache`` whose arrays hold the live tokens only, in buffers of
    their own (a slice would keep the whole source buffer alive), each layer storing
    what it is fed next as its source does (``BaseCache.with_arrays``)."""
    out = [c.with_arrays([mx.contiguous(a) for a in c.flat_state()]) for c in cache]
    mx.eval([c.eval_arrays() for c in out])
    return out


def prompt_cache_nbytes(cache: Sequence[BaseCache]) -> int:
    return sum(c.nbytes for c in cache)


def cache_offset(cache: Sequence[BaseCache]) -> int:
    """Tokens the prompt cache has seen (the largest layer offset)."""
    return max((c.offset for c in cache), default=0)


__all__ = [
    "compact_copy",
    "BaseCache",
    "KVCache",
    "QuantizedKVCache",
    "RotatingKVCache",
    "QuantizedRotatingKVCache",
    "ChunkedKVCache",
    "ArraysCache",
    "CacheList",
    "BatchKVCache",
    "BatchRotatingKVCache",
    "CACHE_CLASSES",
    "UNSUPPORTED",
    "UNSUPPORTED_METHODS",
    "cache_class",
    "mirror_cache",
    "make_prompt_cache",
    "kv_quantization_mismatch",
    "can_trim_prompt_cache",
    "trim_prompt_cache",
    "quantize_prompt_cache",
    "copy_prompt_cache",
    "prompt_cache_nbytes",
    "cache_offset",
]
