"""``ArraysCache``: fixed-size state slots (SSM / convolution layers), for one
sequence or, after ``merge``, a batch of sequences (mlx-lm's batched generation).

One sequence: ``state`` is the present slot arrays, ``meta_state`` the tokens
seen and which slots are present (see ``cache_base``).

A batch (made by ``merge``, ``extend``, ``filter``, or a ``left_padding`` given
to the constructor) has one row per sequence along axis 0 of every slot, and
per row: the left padding and (while a right-padded prompt is fed, after
``prepare(lengths=...)``) the length of the tokens fed, both counted from the
start of the next update, both moved by ``advance(n)``; ``make_mask(N)`` is True
where a position of the next ``N`` is a real token of that row, None when no row
is padded. Each row also counts the real tokens it has seen, so ``extract(i)``
gives back an ``ArraysCache`` of one sequence with row ``i``'s slots and its
count. Paddings are held as Python ints (``left_padding``/``lengths`` return
new arrays), so ``advance`` builds no graph and needs no evaluation. A batch has
no single-sequence ``meta_state``: saving it in our file format is refused
(mlx-lm's file layout holds it).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models import cache as mlx_lm_cache

from .cache_base import BaseCache, check_arrays, parse_ints
from ..errors import CacheFormatError, UnsupportedCacheError, shown

NO_LIMIT = 1 << 30  # the length of a row that has no right padding, in a batch where others have


def _ints(v) -> list[int] | None:
    if v is None:
        return None
    return [int(x) for x in (v.tolist() if isinstance(v, mx.array) else v)]


def _vector(v: list[int] | None) -> mx.array | None:
    return None if v is None else mx.array(v, dtype=mx.int32)


class ArraysCache(BaseCache, mlx_lm_cache.ArraysCache):
    """Fixed-size state slots (SSM / convolution layers). Not trimmable:
    the state after n tokens cannot be rolled back to n - k.

    ``offset`` counts tokens seen: models call ``advance(n)``, and for those
    that only replace the slots (mamba), :func:`~mlx_chatcache.generation.model_call.call_model`
    advances it."""

    def __init__(self, size: int, left_padding: Sequence[int] | None = None):
        self._init_empty()
        self.cache = [None] * size
        if left_padding is not None and len(left_padding):  # a list or an array
            self._left = _ints(left_padding)
            self._rows = [0] * len(self._left)

    def _init_empty(self) -> None:
        self.cache: list = []
        self.offset = 0
        self._rows: list[int] | None = None  # a batch: tokens seen per row
        self._left: list[int] | None = None
        self._lengths: list[int] | None = None
        self._present = None  # slot flags read from meta_state, until state is set

    # ----------------------------------------------------------- padding
    @property
    def left_padding(self) -> mx.array | None:
        return _vector(self._left)

    @left_padding.setter
    def left_padding(self, v) -> None:
        self._left = _ints(v)

    @property
    def lengths(self) -> mx.array | None:
        return _vector(self._lengths)

    @lengths.setter
    def lengths(self, v) -> None:
        self._lengths = _ints(v)

    @property
    def batch_size(self) -> int:
        """Rows: of the slots, else of the batch, else 1."""
        like = next((a for a in self.cache if a is not None), None)
        return like.shape[0] if like is not None else self._row_count()

    def batched(self) -> bool:
        """Whether this cache is a batch (see the module doc)."""
        return self._rows is not None

    def _row_count(self) -> int:
        return len(self._rows) if self._rows is not None else 1

    # ----------------------------------------------------------- model interface
    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, value) -> None:
        self.cache[i] = value

    def advance(self, n: int) -> None:
        if self._rows is not None:
            rows = self._row_count()
            left = self._left or [0] * rows
            ends = self._lengths or [NO_LIMIT] * rows
            self._rows = [r + max(0, min(n, e) - max(0, lp)) for r, lp, e in zip(self._rows, left, ends)]
        if self._left is not None:
            self._left = [x - n for x in self._left]
        if self._lengths is not None:
            self._lengths = [x - n for x in self._lengths]
        self.offset += n

    def make_mask(self, N: int, **_ignored):
        """None without padding, else ``(rows, N)``: True at the real tokens."""
        if self._left is None and self._lengths is None:
            return None
        pos = mx.arange(N)[None]
        mask = None
        if self._left is not None:
            mask = pos >= mx.array(self._left)[:, None]
        if self._lengths is not None:
            inside = pos < mx.array(self._lengths)[:, None]
            mask = inside if mask is None else mask & inside
        return mask

    # ----------------------------------------------------------- batches
    @classmethod
    def merge(cls, caches: Sequence["ArraysCache"]) -> "ArraysCache":
        """A batch of one-sequence ``caches`` (row ``i`` = ``caches[i]``; a slot
        missing in some gets zeros there, one missing in all stays None)."""
        if not caches:
            raise UnsupportedCacheError("ArraysCache.merge needs at least one cache")
        sizes = {len(c.cache) for c in caches}
        if len(sizes) > 1 or any(getattr(c, "_rows", None) for c in caches):
            raise UnsupportedCacheError("ArraysCache.merge takes one-sequence caches with the same slots")
        out = cls(sizes.pop())
        out._rows = [getattr(c, "offset", 0) for c in caches]  # mlx-lm's own counts none
        out.offset = max(out._rows)
        if all(c.empty() for c in caches):
            out._left = [0] * len(caches)
        for e in range(len(out.cache)):
            rows = [c.cache[e] for c in caches]
            like = next((a for a in rows if a is not None), None)
            if like is not None:
                zero = mx.zeros((1, *like.shape[1:]), like.dtype)
                out.cache[e] = mx.concatenate([zero if a is None else a for a in rows])
        return out

    def extract(self, idx: int) -> "ArraysCache":
        """Row ``idx`` as an ``ArraysCache`` of one sequence (its slots, its token count)."""
        out = ArraysCache(len(self.cache))
        out.cache = [None if a is None else mx.contiguous(a[idx : idx + 1]) for a in self.cache]
        out.offset = self._rows[idx] if self._rows is not None else self.offset
        return out

    def filter(self, batch_indices) -> None:
        """Keep the rows ``batch_indices`` (in that order), in place."""
        keep = _ints(batch_indices)
        rows = mx.array(keep, dtype=mx.int32)
        self.cache = [None if a is None else a[rows] for a in self.cache]
        self._rows = [(self._rows or [self.offset])[i] for i in keep]
        for name in ("_left", "_lengths"):
            if getattr(self, name) is not None:
                setattr(self, name, [getattr(self, name)[i] for i in keep])

    def extend(self, other: "ArraysCache") -> None:
        """Append ``other``'s rows after ours, in place (a one-sequence cache is one row)."""
        a, b = self.batch_size, other.batch_size
        for e, (x, y) in enumerate(zip(self.cache, other.cache)):
            like = x if x is not None else y
            if like is not None:
                x = mx.zeros((a, *like.shape[1:]), like.dtype) if x is None else x
                y = mx.zeros((b, *like.shape[1:]), like.dtype) if y is None else y
                self.cache[e] = mx.concatenate([x, y])
        for name, public, missing in (("_left", "left_padding", 0), ("_lengths", "lengths", NO_LIMIT)):
            mine, theirs = getattr(self, name), _ints(getattr(other, public))
            if mine is not None or theirs is not None:
                setattr(self, name, (mine or [missing] * a) + (theirs or [missing] * b))
        mine = self._rows or [self.offset] * a
        self._rows = mine + (getattr(other, "_rows", None) or [getattr(other, "offset", 0)] * b)
        self.offset = max(self._rows)

    def prepare(self, lengths: Sequence[int] | None = None, *, left_padding: Sequence[int] | None = None,
                right_padding: Sequence[int] | None = None) -> None:  # fmt: skip
        """Before a padded update: ``lengths`` of each row's tokens in it,
        ``left_padding`` added to each row's (``right_padding`` is implied by ``lengths``)."""
        if lengths is not None:
            self._lengths = _ints(lengths)
        if left_padding is not None:
            extra = _ints(left_padding)
            self._left = [x + y for x, y in zip(self._left or [0] * len(extra), extra)]
        if self._rows is None and (self._left is not None or self._lengths is not None):
            self._rows = [self.offset] * len(self._left or self._lengths)

    def finalize(self) -> None:
        """After a padded update: no padding left (rows keep their token counts)."""
        self._left = self._lengths = None

    # ----------------------------------------------------------- contract
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
        if self._rows is not None:
            raise UnsupportedCacheError(
                f"an ArraysCache batch of {self._row_count()} sequences has no one-sequence file state: "
                "extract its rows (extract(i)) or save it with format='mlx-lm'"
            )
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
