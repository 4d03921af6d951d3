"""A cache split into blocks of tokens that entries share, and put together again.

Contract
--------
- :func:`splittable` ``(cache, n)``: True when every layer is a plain
  ``KVCache`` or ``QuantizedKVCache`` holding exactly ``n`` tokens, all its
  arrays laid out with the token axis at 2, of the :data:`DTYPES` a cache is
  assembled in. Other layers (rotating windows,
  SSM/``ArraysCache``, ``CacheList``, chunked caches) keep state that is not a
  function of a token prefix, so a cache holding one is stored whole.
- :func:`split` ``(cache, chain, have)``: the blocks of ``cache`` that ``have``
  says are not stored yet, ``{chain hash: arrays}`` (one value per block: every
  layer's ``flat_state()`` arrays sliced to the block's tokens, in buffers of
  their own), and the entry's :class:`Blocked` part: each layer's class and
  ``meta_state`` and the tail (the tokens after the last full block).
- :func:`assemble` ``(blocked, values)``: the cache again, from the values of
  the entry's blocks in order: each block's and the tail's bytes copied once,
  straight into buffers of the cache's own (:class:`Assembly`, which the disk
  and Redis tiers fill from files and bytes too), so the caller owns it and
  the stored blocks never change (the buffers include the room the cache
  grows into, so feeding it does not copy it again).
- :func:`nbytes` ``(arrays)``: the bytes of a block value or a tail.
- :func:`as_layers` ``(blocked, arrays, n)``: a block value or a tail as cache
  layers of the entry's classes holding ``n`` tokens (what a file stores).

A block is named by its chain hash (:class:`~.chain.Chain`), which covers the
namespace and every token up to the block's end: entries of one namespace
that share the first ``i`` blocks of tokens share those blocks' values. The
values are those of the first entry stored with them (another computation of
the same tokens may differ in the last bits, as a prefill in other chunks does).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..cache import BaseCache, KVCache, QuantizedKVCache
from ..files.grown_read import SafetensorsStream
from .chain import Chain

SPLITTABLE = (KVCache, QuantizedKVCache)


@dataclass(frozen=True)
class Blocked:
    """What an entry holds besides its blocks: each layer's class, ``meta_state``
    and array count, and the tail arrays (all layers', in order)."""

    kinds: tuple[type, ...]
    metas: tuple[tuple[str, ...], ...]
    counts: tuple[int, ...]
    tail: tuple[mx.array, ...]

    @property
    def nbytes(self) -> int:
        return nbytes(self.tail)


def nbytes(arrays: Sequence[mx.array]) -> int:
    return sum(a.nbytes for a in arrays)


def splittable(cache: Sequence[BaseCache], n: int) -> bool:
    if n <= 0 or not cache:
        return False
    for c in cache:
        if type(c) not in SPLITTABLE or c.offset != n:
            return False
        if any(a.ndim != 4 or a.shape[2] != n or a.dtype not in DTYPES for a in c.flat_state()):
            return False
    return True


def split(cache: Sequence[BaseCache], chain: Chain, have: Callable[[str], bool]
          ) -> tuple[dict[str, list[mx.array]], Blocked]:  # fmt: skip
    """See the module doc; ``cache`` must be :func:`splittable` for ``len(chain.tokens)``."""
    flat = [a for c in cache for a in c.flat_state()]
    size = chain.block
    new = {}
    for i, h in enumerate(chain.hashes):
        if not have(h) and h not in new:
            new[h] = [mx.contiguous(a[:, :, i * size : (i + 1) * size]) for a in flat]
    start = len(chain.hashes) * size
    tail = tuple(mx.contiguous(a[:, :, start:]) for a in flat)
    mx.eval(*[a for v in new.values() for a in v], *tail)
    blocked = Blocked(tuple(type(c) for c in cache), tuple(tuple(c.meta_state) for c in cache),
                      tuple(len(c.flat_state()) for c in cache), tail)  # fmt: skip
    return new, blocked


def assemble(blocked: Blocked, values: Sequence[Sequence[mx.array | np.ndarray]]) -> list[BaseCache]:
    """See the module doc: the blocks' and the tail's bytes are copied once, each
    straight into its place in the assembled buffers (:class:`Assembly`). A block's
    arrays may be given as their :func:`host_view` (kept by a caller that assembles often)."""
    specs = [(t.dtype, t.shape[0], t.shape[1], t.shape[3]) for t in blocked.tail]
    n = sum(v[0].shape[2] for v in values) + blocked.tail[0].shape[2]
    asm = Assembly(blocked.kinds, blocked.metas, blocked.counts, specs, n)
    parts = [[a if isinstance(a, np.ndarray) else host_view(a) for a in arrays] for arrays in [*values, blocked.tail]]
    for k in range(len(specs)):
        asm.fill(k, [p[k] for p in parts])
    return asm.cache()


class Assembly:
    """The buffers a cache of ``n`` tokens is put together in, filled in place.

    One buffer per array of the layers ``kinds`` (classes), ``metas``
    (``meta_state``, its offset ``n``) and ``counts`` (arrays per layer), array
    ``k`` of shape ``(d0, d1, slots, d3)`` and dtype ``specs[k] = (dtype, d0, d1,
    d3)``, with ``slots = kind.grown_slots(n)``: the room the cache grows into
    (zeroed), so feeding it after a checkout does not copy it again. The
    caller fills every token range ``0:n`` (they start out as the allocator
    left them), from arrays (:meth:`fill`) or by reading into them
    (:meth:`rows`: a file's bytes land in place); :meth:`cache` then makes the
    layers, which own the buffers. Writing goes through writable NumPy views
    of MLX's own buffers, so each stored byte is copied once, into its place."""

    def __init__(self, kinds: Sequence[type], metas: Sequence[Sequence[str]], counts: Sequence[int],
                 specs: Sequence[tuple[mx.Dtype, int, int, int]], n: int):  # fmt: skip
        self.kinds, self.metas, self.counts, self.n = tuple(kinds), tuple(metas), tuple(counts), n
        self.specs = tuple(specs)
        if any(d not in DTYPES for d, *_ in specs):
            raise ValueError(f"cannot assemble arrays of {sorted({str(d) for d, *_ in specs} - set(map(str, DTYPES)))}")
        slots = [kind.grown_slots(n) for kind, count in zip(kinds, counts) for _ in range(count)]
        self._buffers = _allocate([(_bits(d), (d0, d1, s, d3)) for (d, d0, d1, d3), s in zip(specs, slots)], n)
        self._views = [np.array(b, copy=False) for b in self._buffers]  # MLX's memory, writable
        flat = [memoryview(v).cast("B") for v in self._views]  # C-contiguous, or this raises
        self._rows = [[f[r : r + v.strides[1]] for r in range(0, f.nbytes, v.strides[1])]
                      for f, v in zip(flat, self._views)]  # each buffer's rows (axis 0 and 1), in order

    def fill(self, k: int, parts: Sequence[np.ndarray]) -> None:
        """Copy ``parts`` (``(d0, d1, t_i, d3)`` each, of buffer ``k``'s dtype or its bits,
        together ``t <= n`` tokens) to buffer ``k``'s tokens ``0:t``, in order."""
        t = sum(p.shape[2] for p in parts)
        if t > self.n:
            raise ValueError(f"{t} tokens do not fit an assembly of {self.n}")
        np.concatenate(parts, axis=2, out=self._views[k][:, :, :t])

    def rows(self, k: int, at: int, t: int) -> list[memoryview]:
        """Buffer ``k``'s bytes for tokens ``at:at+t`` (within ``0:n``), row by row (``d0 x d1`` rows, in order)."""
        if not 0 <= at <= at + t <= self.n:
            raise ValueError(f"tokens {at}:{at + t} are not within an assembly of {self.n}")
        token = self._views[k].strides[2]
        a, b = at * token, (at + t) * token
        return [row[a:b] for row in self._rows[k]]

    def cache(self) -> list[BaseCache]:
        """The layers, holding the buffers (no copy)."""
        self._views, self._rows = [], []
        arrays = [b if b.dtype == d else b.view(d) for b, (d, *_) in zip(self._buffers, self.specs)]
        out, at = [], 0
        for kind, meta, count in zip(self.kinds, self.metas, self.counts):
            out.append(kind.from_flat_state(arrays[at : at + count], meta))
            at += count
        return out


def _allocate(arrays: Sequence[tuple[mx.Dtype, tuple[int, int, int, int]]], n: int) -> list[mx.array]:
    """New evaluated arrays of these dtypes and shapes whose slots from ``n`` on (axis 2)
    are zero; the slots before ``n`` are left as the allocator gives them (the caller
    writes every one): ``mx.load`` of a stream (:class:`_Room`) that writes only the room,
    so no pass over the whole buffers is spent on zeros that are overwritten anyway."""
    loaded = mx.load(_Room(arrays, n), format="safetensors")
    out = [loaded[str(k)] for k in range(len(arrays))]
    mx.eval(out)
    return out


class _Room(SafetensorsStream):
    """A safetensors stream of arrays ``k`` (named ``str(k)``) whose read writes zeros
    only into each row's slots from ``n`` on, leaving the rest of the reader's buffer as it is."""

    def __init__(self, arrays, n: int):
        entries, self.parts, at = {}, [], 0
        for k, (dtype, shape) in enumerate(arrays):
            size = dtype.size * math.prod(shape)
            row = size // (shape[0] * shape[1]) if size else 1
            entries[str(k)] = {"dtype": _SAFETENSORS[dtype], "shape": list(shape), "data_offsets": [at, at + size]}
            self.parts.append((at, at + size, row, row // shape[2] * n if shape[2] else 0))
            at += size
        self._lay_out(entries, at)
        self.begins = [p[0] for p in self.parts]

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        n = min(len(out), max(0, self.size - self.pos))
        lo, hi, head = self.pos, self.pos + n, len(self.head)
        if lo < head:
            out[: min(hi, head) - lo] = self.head[lo : min(hi, head)]
        first = max(0, bisect.bisect_right(self.begins, lo - head) - 1)  # reads come one array at a time
        for begin, end, row, live in self.parts[first:]:  # the room of each row this read covers
            if begin >= hi - head:
                break
            a, b = max(lo - head, begin), min(hi - head, end)
            for r in range(begin + (max(a - begin, 0) // row) * row, b, row):
                z0, z1 = max(r + live, a), min(r + row, b)
                if z0 < z1:
                    out[z0 + head - lo : z1 + head - lo] = bytes(z1 - z0)
        self.pos = hi
        return n


_SAFETENSORS = {mx.float32: "F32", mx.float16: "F16", mx.uint32: "U32", mx.uint16: "U16", mx.int32: "I32",
                mx.uint8: "U8", mx.int8: "I8"}  # fmt: skip
DTYPES = frozenset({*_SAFETENSORS, mx.bfloat16})  # what an Assembly's buffers may hold


def _bits(dtype: mx.Dtype) -> mx.Dtype:
    """A dtype NumPy has, of ``dtype``'s size (bfloat16 is handled as its bits)."""
    return mx.uint16 if dtype == mx.bfloat16 else dtype


def host_view(a: mx.array) -> np.ndarray:
    """A NumPy view of the evaluated array ``a`` (bfloat16 as its bits), no copy."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a, copy=False)


def as_layers(blocked: Blocked, arrays: Sequence[mx.array], n: int) -> list[BaseCache]:
    """See the module doc (the splittable classes' ``meta_state`` starts with the offset)."""
    out, at = [], 0
    for kind, meta, count in zip(blocked.kinds, blocked.metas, blocked.counts):
        out.append(kind.from_flat_state(list(arrays[at : at + count]), (str(n), *meta[1:])))
        at += count
    return out


__all__ = ["DTYPES", "SPLITTABLE", "Assembly", "Blocked", "as_layers", "assemble", "host_view", "nbytes", "split", "splittable"]
