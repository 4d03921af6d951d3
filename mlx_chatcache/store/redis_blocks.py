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
builds the cache from checked values: each byte copied once, from the value
into the cache's own buffers (the tail's chunks are joined first, one more
copy of the tail only).
"""

from __future__ import annotations

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


def assemble(layout: Layout, values: Sequence[bytes], tail: bytes, block: int) -> list[BaseCache] | None:
    """The cache from checked block values (in order) and the tail payload; None
    when the tail does not fit the layout. Each value's bytes are copied once,
    from NumPy views of them straight into the cache's buffers (:class:`~.blocks.Assembly`)."""
    n_tail = _tail_tokens(layout, len(tail))
    if n_tail is None:
        return None
    n = len(values) * block + n_tail
    specs = [(getattr(mx, d), d0, d1, d3) for _, _, arrays in layout.layers for d, d0, d1, d3 in arrays]
    asm = blocks.Assembly([_KINDS[k] for k, _, _ in layout.layers], [m for _, m, _ in layout.layers],
                          [len(arrays) for _, _, arrays in layout.layers], specs, n)  # fmt: skip
    parts = [_views(layout, memoryview(v), t) for v, t in [*((v, block) for v in values), (tail, n_tail)]]
    for k in range(len(specs)):
        asm.fill(k, [p[k] for p in parts])
    return asm.cache()


def _views(layout: Layout, value: memoryview, t: int) -> list[np.ndarray]:
    """The arrays of a payload of ``t`` tokens, as NumPy views of its bytes."""
    out, offset = [], 0
    for d, d0, d1, d3 in layout._arrays():
        dt = np.dtype(_DTYPES[d])
        out.append(np.frombuffer(value, dt, d0 * d1 * t * d3, offset).reshape(d0, d1, t, d3))
        offset += d0 * d1 * t * d3 * dt.itemsize
    return out


def _tail_tokens(layout: Layout, nbytes: int) -> int | None:
    per = layout.payload_bytes(1)
    return nbytes // per if nbytes % per == 0 else None


__all__ = ["Layout", "assemble", "block_ok", "split", "splittable"]
