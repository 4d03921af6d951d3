"""Block values of the Redis tier: a cache's K/V in blocks of tokens, as bytes.

A cache whose layers are all plain ``KVCache``/``QuantizedKVCache`` holding
exactly its ``n`` tokens (:func:`splittable`, as :mod:`.blocks` says) is stored as the values of its
full blocks plus a tail (the tokens after the last full block); any other
cache is stored whole (:mod:`.redis_tier`).

- A block value is every layer's ``flat_state()`` arrays sliced to the
  block's tokens, in C order, one after the other (its crc32 is kept next to
  its count, :mod:`.redis_layout`, so a value's size stays the arrays' own). It is named by the block's chain hash
  (:class:`~.chain.Chain`: the namespace and every token up to the block's
  end), so entries sharing the first ``i`` blocks of tokens share those values.
- The tail is the same concatenation for the tail tokens (the manifest's chunk
  checksums cover it).
- :class:`Layout` (kept in the manifest) says how to cut a payload into arrays
  and make the layers again: each layer's class, ``meta_state`` and arrays'
  dtypes and shapes without the token axis (axis 2).

:func:`block_ok` checks a block value's checksum and size; :func:`assemble`
builds the cache from checked block values and the tail's checked chunks: each
byte copied once, from the value or chunk into the cache's own buffers.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..cache import BaseCache, KVCache, QuantizedKVCache
from ..files.checksum import crc32
from . import blocks
from .chain import Chain

_KINDS = {"KVCache": KVCache, "QuantizedKVCache": QuantizedKVCache}
# mlx dtype name -> numpy dtype of the same bytes (bfloat16 travels as its bits)
_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16, "uint32": np.uint32,
           "int32": np.int32, "uint8": np.uint8, "int8": np.int8}  # fmt: skip


def _name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def splittable(cache: Sequence[BaseCache], n: int) -> bool:
    """:func:`.blocks.splittable`, with arrays of dtypes this module writes."""
    return blocks.splittable(cache, n) and all(_name(a.dtype) in _DTYPES for c in cache for a in c.flat_state())


@dataclass(frozen=True)
class Layout:
    """``layers``: ``(class name, meta_state, arrays)`` per layer, each array ``(dtype, d0, d1, d3)``."""

    layers: tuple[tuple[str, tuple[str, ...], tuple[tuple[str, int, int, int], ...]], ...]

    @classmethod
    def of(cls, cache: Sequence[BaseCache]) -> "Layout":
        return cls(tuple(
            (type(c).__name__, tuple(c.meta_state),
             tuple((_name(a.dtype), a.shape[0], a.shape[1], a.shape[3]) for a in c.flat_state()))
            for c in cache
        ))  # fmt: skip

    def to_json(self) -> list:
        return [[k, list(m), [list(a) for a in arrays]] for k, m, arrays in self.layers]

    @classmethod
    def from_json(cls, raw) -> "Layout | None":
        """The layout ``to_json`` made, or None when ``raw`` is not one."""
        try:
            layers = tuple(
                (str(k), tuple(str(s) for s in m), tuple((str(a[0]), int(a[1]), int(a[2]), int(a[3])) for a in arrays))
                for k, m, arrays in raw
            )  # fmt: skip
        except (TypeError, ValueError, IndexError):
            return None
        ok = layers and all(k in _KINDS and arrays and all(a[0] in _DTYPES and min(a[1:]) > 0 for a in arrays)
                            for k, _, arrays in layers)  # fmt: skip
        return cls(layers) if ok else None

    def _arrays(self):
        return [a for _, _, arrays in self.layers for a in arrays]

    def payload_bytes(self, tokens: int) -> int:
        """Bytes of the payload of ``tokens`` tokens (a block's or the tail's)."""
        return sum(np.dtype(_DTYPES[d]).itemsize * d0 * d1 * tokens * d3 for d, d0, d1, d3 in self._arrays())


def _numpy(a: mx.array) -> np.ndarray:
    if _name(a.dtype) == "bfloat16":
        a = a.view(mx.uint16)
    return np.asarray(a)


def split(cache: Sequence[BaseCache], chain: Chain) -> tuple[dict[str, bytes], bytes, Layout]:
    """``({chain hash: block value}, tail payload, layout)`` of a :func:`splittable` cache."""
    flat = [_numpy(a) for c in cache for a in c.flat_state()]
    size, values = chain.block, {}
    for i, h in enumerate(chain.hashes):
        values[h] = b"".join(a[:, :, i * size : (i + 1) * size].tobytes() for a in flat)
    start = len(chain.hashes) * size
    tail = b"".join(a[:, :, start:].tobytes() for a in flat)
    return values, tail, Layout.of(cache)


def block_ok(value: bytes | None, checksum, layout: Layout, block: int) -> bool:
    """Whether ``value`` is a whole block value of ``layout`` whose crc32 is ``checksum``."""
    if value is None or len(value) != layout.payload_bytes(block):
        return False
    try:
        return int(checksum) == crc32(value)
    except (TypeError, ValueError):
        return False


def assemble(layout: Layout, values: Sequence[bytes], tail: Sequence[bytes], block: int) -> list[BaseCache] | None:
    """The cache from checked block values (in order) and the tail payload, given as
    its chunks in order; None when the tail does not fit the layout. Each byte is
    copied once, straight into the cache's buffers (:class:`~.blocks.Assembly`): a
    block value's arrays from NumPy views of it, a tail array lying inside one chunk
    from a view of that chunk, one a chunk boundary cuts row by row from its chunks."""
    n_tail = _tail_tokens(layout, sum(len(c) for c in tail))
    if n_tail is None:
        return None
    at = len(values) * block
    specs = [(getattr(mx, d), d0, d1, d3) for _, _, arrays in layout.layers for d, d0, d1, d3 in arrays]
    asm = blocks.Assembly([_KINDS[k] for k, _, _ in layout.layers], [m for _, m, _ in layout.layers],
                          [len(arrays) for _, _, arrays in layout.layers], specs, at + n_tail)  # fmt: skip
    parts = [_views(layout, memoryview(v), block) for v in values]
    payload = _Payload(tail)
    offset = 0
    for k, (d, d0, d1, d3) in enumerate(layout._arrays()):
        size = np.dtype(_DTYPES[d]).itemsize * d0 * d1 * n_tail * d3
        whole = payload.view(offset, size)
        arrays = [p[k] for p in parts] + ([] if whole is None else [_shaped(whole, d, d0, d1, n_tail, d3)])
        if arrays:
            asm.fill(k, arrays)
        if whole is None:
            payload.copy(offset, asm.rows(k, at, n_tail))
        offset += size
    return asm.cache()


class _Payload:
    """A payload held as its chunks, one after the other."""

    def __init__(self, chunks: Sequence[bytes]):
        self.chunks = [memoryview(c).cast("B") for c in chunks]
        self.starts = [0]
        for c in self.chunks:
            self.starts.append(self.starts[-1] + len(c))

    def view(self, offset: int, size: int) -> memoryview | None:
        """Bytes ``offset:offset+size`` when one chunk holds them all (no copy), else None."""
        i = bisect.bisect_right(self.starts, offset) - 1
        if i >= len(self.chunks) or offset + size > self.starts[i + 1]:
            return None if size else self.chunks[0][:0]
        return self.chunks[i][offset - self.starts[i] : offset - self.starts[i] + size]

    def copy(self, offset: int, rows: Sequence[memoryview]) -> None:
        """Copy the bytes from ``offset`` on into ``rows``, in order, each byte once."""
        i = bisect.bisect_right(self.starts, offset) - 1
        for row in rows:
            done = 0
            while done < len(row):
                lo = offset - self.starts[i]
                n = min(len(row) - done, len(self.chunks[i]) - lo)
                row[done : done + n] = self.chunks[i][lo : lo + n]
                done, offset = done + n, offset + n
                if offset == self.starts[i + 1]:
                    i += 1


def _views(layout: Layout, value: memoryview, t: int) -> list[np.ndarray]:
    """The arrays of a payload of ``t`` tokens, as NumPy views of its bytes."""
    out, offset = [], 0
    for d, d0, d1, d3 in layout._arrays():
        size = np.dtype(_DTYPES[d]).itemsize * d0 * d1 * t * d3
        out.append(_shaped(value[offset : offset + size], d, d0, d1, t, d3))
        offset += size
    return out


def _shaped(data: memoryview, d: str, d0: int, d1: int, t: int, d3: int) -> np.ndarray:
    return np.frombuffer(data, np.dtype(_DTYPES[d])).reshape(d0, d1, t, d3)


def _tail_tokens(layout: Layout, nbytes: int) -> int | None:
    per = layout.payload_bytes(1)
    return nbytes // per if nbytes % per == 0 else None


__all__ = ["Layout", "assemble", "block_ok", "split", "splittable"]
