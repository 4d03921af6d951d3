"""The cache contract shared by every per-layer cache, and helpers for K/V storage.

Contract of :class:`BaseCache` (what the file format, the generate loop and the
chat session rely on):

- ``state``: a list holding exactly the live content (never padding, never
  trimmed-away tokens, rotating caches in temporal order), nested as mlx-lm
  nests it: a K/V cache's is ``[keys, values]``, each an array, or for a
  quantized cache a tuple ``(packed, scales, biases)``. Settable, in that same
  nesting only; a growing K/V cache also takes arrays that carry the room older
  files stored after the live tokens (see ``KVCache``), and grows into it in place.
- ``flat_state()``: the arrays of ``state`` in order, unnested: what a cache
  file stores (files hold no room to grow: a loader makes it, see
  ``grown_slots``), and what every caller that needs a layer's arrays reads.
  ``from_flat_state(c.flat_state(), c.meta_state)`` rebuilds ``c`` as
  ``from_state`` does (``nest_state`` gives the flat arrays their nesting back).
- ``with_arrays(arrays)``: a cache like ``c`` (class, ``meta_state``, and how it
  stores what it is fed next: a K/V layer's ``kv_dtype``, empty or not) holding
  ``arrays`` in place of ``c.flat_state()``; every in-memory copy is made by it.
- ``meta_state``: a tuple of plain strings with everything that is not an array
  (offsets, window size, keep, a window's ring position, bits, group size).
  Settable; parsing errors raise :class:`CacheFormatError`.
- ``from_state(state, meta_state)`` rebuilds an equivalent cache with the same
  buffer layout (a wrapped window's ring back in its slots), so
  ``type(c).from_state(c.state, c.meta_state)`` continues exactly like ``c``.
- ``offset`` (tokens seen), ``size()`` (tokens held), ``is_trimmable()``,
  ``trim(n) -> int``, ``nbytes``, ``empty()``, ``eval_arrays()`` (what to pass to
  ``mx.eval`` without copying).
- Taking tokens back, asked before the cache is fed (conservative: False when unsure):
  ``can_take_back(n)``: after ``n`` more tokens are fed, ``trim(n)`` returns the cache
  to its content now, as the model's next call sees it (a plain K/V cache; a chunked
  one, which may have dropped tokens before its chunk as that call would; a window
  that will not have dropped a token; never an SSM/convolution ``ArraysCache``).
  ``always_trimmable()``: at every fill, ``trim`` reaches every shorter length it has
  held (plain and quantized K/V caches, and lists of them: their rollbacks need no
  copy); when True, ``can_take_back(n)`` is True for every ``n``.
- Batches (mlx-lm's batched generation): ``merge(caches)`` makes one batch
  cache of several single-sequence caches (``KVCache`` -> ``BatchKVCache``,
  ``RotatingKVCache`` -> ``BatchRotatingKVCache``, see ``batch.py``; an
  ``ArraysCache`` or ``CacheList`` merges into its own class); a batch's
  ``extract(i)`` gives back row ``i`` as our single-sequence class holding
  exactly its tokens. The batch methods a class lacks (:data:`BATCH_ONLY_METHODS`)
  raise :class:`UnsupportedCacheError` with the reason.

Each concrete class also subclasses its mlx-lm counterpart, so that mlx-lm's
models and generate loop, which look at a cache's class, treat it as theirs
(see ``docs/mlx-lm-compat.md``); everything a model or mlx-lm's generate loop
calls is defined here, never inherited from mlx-lm.

K/V caches store keys and values as ``(B, n_kv_heads, seq, head_dim)``; a
quantized cache stores each as a tuple ``(packed, scales, biases)`` sharing that
layout along the sequence axis (axis 2). The ``kv_*`` helpers work on both forms.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from ..errors import CacheFormatError, UnsupportedCacheError, shown

BATCH_ONLY_METHODS: dict[str, str] = {
    name: "it is a method of a batch of sequences, and this cache holds one sequence: "
    "merge single-sequence caches first (KVCache.merge, RotatingKVCache.merge, ArraysCache.merge, "
    "CacheList.merge)"
    for name in ("extract", "filter", "extend", "prepare", "finalize")
}
BATCH_ONLY_METHODS["merge"] = (
    "mlx-lm has no batch form of this cache (only of KVCache, RotatingKVCache without pinned "
    "tokens, ArraysCache and lists of them); generate it alone"
)


BATCH_CLASSES: dict[type, type] = {}
"""One-sequence cache class -> the batch class its ``merge`` makes (filled by ``batch.py``)."""


def merge_batch(cls: type, caches: Sequence):
    """``cls.merge(caches)`` of a class without its own: the batch class registered
    for the caches' one class (:data:`BATCH_CLASSES`), else UnsupportedCacheError."""
    kinds = {type(c) for c in caches}
    if len(kinds) > 1:
        names = ", ".join(sorted(k.__name__ for k in kinds))
        raise UnsupportedCacheError(f"caches of different classes ({names}) cannot share a batch")
    kind = kinds.pop() if kinds else cls
    if kind not in BATCH_CLASSES:
        raise UnsupportedCacheError(f"{kind.__name__}.merge is not supported: {BATCH_ONLY_METHODS['merge']}")
    return BATCH_CLASSES[kind].merge(caches)


def batch_only(name: str):
    """A method that raises UnsupportedCacheError with the reason in
    :data:`BATCH_ONLY_METHODS` (``merge``: a classmethod)."""

    def refuse(self, *args, **kwargs):
        cls = self if isinstance(self, type) else type(self)
        raise UnsupportedCacheError(f"{cls.__name__}.{name} is not supported: {BATCH_ONLY_METHODS[name]}")

    refuse.__name__ = name
    return classmethod(refuse) if name == "merge" else refuse


class Absent:
    """A class attribute that is not there: reading it raises AttributeError, so
    ``hasattr(obj, name)`` is False although a base class defines ``name``.

    mlx-lm's generate loop quantizes every layer that *has* ``to_quantized``;
    its quantized caches have none, and neither may ours that inherit one.
    """

    def __init__(self, reason: str):
        self.reason = reason

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        raise AttributeError(f"{(owner or type(obj)).__name__} has no {self.name}: {self.reason}")


class BaseCache:
    """Base class of every mlx_chatcache per-layer cache."""

    offset: int = 0

    @property
    def state(self) -> list:
        return []

    @state.setter
    def state(self, v: Sequence) -> None:
        if v:
            raise CacheFormatError(f"{type(self).__name__} holds no arrays but {len(v)} were given")

    @property
    def meta_state(self) -> tuple[str, ...]:
        return ()

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        if v:
            raise CacheFormatError(f"{type(self).__name__} takes no meta state, got {tuple(v)!r}")

    @classmethod
    def from_state(cls, state: Sequence, meta_state: Sequence[str]):
        """Rebuild a cache from ``state`` and ``meta_state`` (validated)."""
        obj = cls._with_meta(meta_state)
        obj.state = list(state)
        return obj

    @classmethod
    def from_flat_state(cls, arrays: Sequence[mx.array], meta_state: Sequence[str]):
        """Rebuild a cache from ``flat_state()``'s arrays and ``meta_state`` (validated)."""
        obj = cls._with_meta(meta_state)
        obj.state = obj.nest_state(list(arrays))
        return obj

    @classmethod
    def _with_meta(cls, meta_state: Sequence[str]):
        obj = cls.__new__(cls)
        obj._init_empty()
        obj.meta_state = tuple(meta_state)
        return obj

    def _init_empty(self) -> None:
        """Set the attributes an instance needs before ``meta_state`` is applied."""

    def with_arrays(self, arrays: Sequence[mx.array]):
        """A cache like this one (see the module doc) holding ``arrays``, a ``flat_state()``."""
        return type(self).from_flat_state(arrays, self.meta_state)

    def flat_state(self) -> list[mx.array]:
        """The arrays of ``state`` in order, unnested (what a cache file stores)."""
        return tree_arrays(self.state)

    def nest_state(self, arrays: list[mx.array]) -> list:
        """``arrays`` (a ``flat_state()``) in the nesting of this cache's ``state``
        (its ``meta_state`` already set); arrays of the wrong count stay as they
        are, for the ``state`` setter to refuse."""
        return arrays

    @classmethod
    def grown_slots(cls, held: int) -> int:
        """Slots (axis 2) a loader reads each of this class's arrays of ``held``
        tokens into, so that the next tokens fit without a copy (``held``: no room)."""
        return held

    def eval_arrays(self) -> list[mx.array]:
        """Arrays to ``mx.eval`` after an update (the live buffers, not copies)."""
        return self.flat_state()

    def is_trimmable(self) -> bool:
        return False

    def can_take_back(self, n: int = 1) -> bool:
        """Whether ``trim(n)`` undoes feeding ``n`` more tokens (see the module doc)."""
        return False

    def always_trimmable(self) -> bool:
        """Whether ``trim`` reaches every shorter length at every fill (see the module doc)."""
        return False

    def trim(self, n: int) -> int:
        return 0

    def size(self) -> int:
        return 0

    def empty(self) -> bool:
        return not self.state

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.eval_arrays())

    @classmethod
    def merge(cls, caches: Sequence):
        """One batch cache of one-sequence ``caches`` of one class (see :func:`merge_batch`)."""
        return merge_batch(cls, caches)

    extract = batch_only("extract")
    filter = batch_only("filter")
    extend = batch_only("extend")
    prepare = batch_only("prepare")
    finalize = batch_only("finalize")


# ---------------------------------------------------------------- meta parsing
def parse_ints(cls_name: str, meta: Sequence[str], names: Sequence[str]) -> list[int]:
    """Parse ``meta`` as non-negative ints called ``names``; CacheFormatError otherwise."""
    if len(meta) != len(names):
        raise CacheFormatError(
            f"{cls_name} meta state needs {len(names)} values ({', '.join(names)}), got {len(meta)}"
        )
    out = []
    for name, s in zip(names, meta):
        if not isinstance(s, str) or not (s.isascii() and s.isdigit()) or len(s) > 18:
            raise CacheFormatError(f"{cls_name} meta state '{name}' is not a non-negative integer: {shown(s)}")
        out.append(int(s))
    return out


def check_arrays(cls_name: str, state: Sequence, count: int) -> None:
    if len(state) != count or not all(isinstance(a, mx.array) for a in state):
        raise CacheFormatError(f"{cls_name} needs {count} arrays, got {len(state)}")


# ---------------------------------------------------------------- state nesting
def tree_arrays(tree) -> list[mx.array]:
    """The arrays of an array or a nested list/tuple of arrays, depth first:
    how every layer's ``state`` (and a quantized K/V buffer) flattens."""
    return [a for _, a in tree_flatten(tree)]


def nest_like(form, arrays: list[mx.array]):
    """``arrays`` put where ``form`` (a nested list/tuple of names) has its names, in order."""
    it = iter(arrays)
    return tree_map(lambda _: next(it), form)


def check_form(cls_name: str, state, form) -> None:
    """CacheFormatError unless ``state`` nests arrays as ``form`` nests its names."""

    def fits(s, f) -> bool:
        if isinstance(f, str):
            return isinstance(s, mx.array)
        return isinstance(s, (list, tuple)) and len(s) == len(f) and all(map(fits, s, f))

    def outline(x, leaf, depth=0) -> str:
        if not isinstance(x, (list, tuple)) or depth > 2:
            return leaf(x)
        inner = ", ".join(outline(y, leaf, depth + 1) for y in x[:8]) + (", ..." if len(x) > 8 else "")
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"

    if not fits(state, form):
        got = outline(state, lambda x: "array" if isinstance(x, mx.array) else type(x).__name__)
        raise CacheFormatError(f"{cls_name} state must be {outline(form, str)}, got {got}")


# ---------------------------------------------------------------- K/V helpers
def kv_len(x) -> int:
    """Sequence length (axis 2) of a float or quantized K/V buffer."""
    return (x[0] if isinstance(x, tuple) else x).shape[2]


def kv_slice(x, start: int, stop: int):
    """Steps ``[start, stop)`` of a float or quantized buffer (runs per token: no tree_map)."""
    if isinstance(x, tuple):
        return tuple(t[..., start:stop, :] for t in x)
    return x[..., start:stop, :]


def kv_concat(parts: list):
    """Concatenate float or quantized buffers along the sequence axis."""
    parts = [p for p in parts if kv_len(p) > 0] or parts[:1]
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tuple):
        return tuple(mx.concatenate(ts, axis=2) for ts in zip(*parts))
    return mx.concatenate(parts, axis=2)


def kv_assign(buf, start: int, value) -> None:
    """Write ``value`` into ``buf[..., start:start+len, :]`` in place."""
    stop = start + kv_len(value)
    if isinstance(buf, tuple):
        for b, v in zip(buf, value):
            b[..., start:stop, :] = v
    else:
        buf[..., start:stop, :] = value


def kv_grow(x, capacity: int):
    """``x`` followed by zeroed steps up to ``capacity`` steps: one new buffer
    per array, the live steps copied once."""
    def grow(t):
        return mx.pad(t, [(0, 0), (0, 0), (0, capacity - t.shape[2]), (0, 0)])

    return tree_map(grow, x)


def kv_zeros_like(x, n: int):
    """Zeros of ``n`` steps with the batch/head/feature layout of ``x``."""
    def z(t):
        B, H, _, D = t.shape
        return mx.zeros((B, H, n, D), dtype=t.dtype)

    return tree_map(z, x)


# ---------------------------------------------------------------- masks
def causal_mask(n: int, offset: int, window_size: int | None = None) -> mx.array:
    """Boolean (n, offset + n) mask: query i sees keys <= offset + i, within the window."""
    q = mx.arange(offset, offset + n)[:, None]
    k = mx.arange(offset + n)[None]
    mask = k <= q
    if window_size is not None:
        mask = mask & (k > q - window_size)
    return mask


def standard_mask(n: int, offset: int, window_size: int | None, return_array: bool):
    """The mask of a linear (non-rotating) cache, as mlx-lm's linear caches make it:
    an array whenever the model gives a window, else None for one token and
    "causal" for several (the same values either way; the same kernels as mlx-lm)."""
    if window_size is not None:
        return causal_mask(n, offset, window_size)
    if n == 1:
        return None
    if return_array:
        return causal_mask(n, offset)
    return "causal"


def fill_mask(n: int, offset: int, window_size: int | None, return_array: bool):
    """The mask of a window cache that has not dropped a token yet, as mlx-lm's
    ``RotatingKVCache`` makes it: an array only where the window cuts (for one
    token a 1-D one, and None otherwise even when an array is asked for)."""
    if n == 1:
        cut = window_size is not None and offset >= window_size
        return causal_mask(1, offset, window_size)[0] if cut else None
    if window_size is not None and offset + n > window_size:
        return causal_mask(n, offset, window_size)
    if return_array:
        return causal_mask(n, offset)
    return "causal"
