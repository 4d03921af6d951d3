"""A cache split into blocks of tokens that entries share, and put together again.

Contract
--------
- :func:`splittable` ``(cache, n)``: True when every layer is a plain
  ``KVCache`` or ``QuantizedKVCache`` holding exactly ``n`` tokens, all its
  arrays laid out with the token axis at 2. Other layers (rotating windows,
  SSM/``ArraysCache``, ``CacheList``, chunked caches) keep state that is not a
  function of a token prefix, so a cache holding one is stored whole.
- :func:`split` ``(cache, chain, have)``: the blocks of ``cache`` that ``have``
  says are not stored yet, ``{chain hash: arrays}`` (one value per block: every
  layer's ``flat_state()`` arrays sliced to the block's tokens, in buffers of
  their own), and the entry's :class:`Blocked` part: each layer's class and
  ``meta_state`` and the tail (the tokens after the last full block).
- :func:`assemble` ``(blocked, values)``: the cache again, from the values of
  the entry's blocks in order; one concatenate (one copy) per array, so the
  caller owns it and the stored blocks never change (the copy includes the
  room the cache grows into, so feeding it does not copy it again).
- :func:`nbytes` ``(arrays)``: the bytes of a block value or a tail.
- :func:`as_layers` ``(blocked, arrays, n)``: a block value or a tail as cache
  layers of the entry's classes holding ``n`` tokens (what a file stores), and
  :func:`from_tail` ``(tail, n)``: the :class:`Blocked` part again from the tail
  layers of an entry of ``n`` tokens.

A block is named by its chain hash (:class:`~.chain.Chain`), which covers the
namespace and every token up to the block's end: entries of one namespace
that share the first ``i`` blocks of tokens share those blocks' values. The
values are those of the first entry stored with them (another computation of
the same tokens may differ in the last bits, as a prefill in other chunks does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from ..cache import BaseCache, KVCache, QuantizedKVCache
from .chain import Chain

_SPLITTABLE = (KVCache, QuantizedKVCache)


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
        if type(c) not in _SPLITTABLE or c.offset != n:
            return False
        if any(a.ndim != 4 or a.shape[2] != n for a in c.flat_state()):
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


def assemble(blocked: Blocked, values: Sequence[Sequence[mx.array]]) -> list[BaseCache]:
    """See the module doc. Each array also gets the room a growing cache takes
    (``grown_slots``) in the same concatenate, so the first tokens fed after a
    checkout are written in place rather than copying the cache again."""
    out, at = [], 0
    for kind, meta, count in zip(blocked.kinds, blocked.metas, blocked.counts):
        arrays = []
        for t in blocked.tail[at : at + count]:
            parts = [v[len(arrays) + at] for v in values] + [t]
            held = sum(p.shape[2] for p in parts)
            room = kind.grown_slots(held) - held
            if room:
                parts.append(mx.zeros((*t.shape[:2], room, t.shape[3]), dtype=t.dtype))
            arrays.append(mx.concatenate(parts, axis=2))
        out.append(kind.from_flat_state(arrays, meta))
        at += count
    return out


def as_layers(blocked: Blocked, arrays: Sequence[mx.array], n: int) -> list[BaseCache]:
    """See the module doc (the splittable classes' ``meta_state`` starts with the offset)."""
    out, at = [], 0
    for kind, meta, count in zip(blocked.kinds, blocked.metas, blocked.counts):
        out.append(kind.from_flat_state(list(arrays[at : at + count]), (str(n), *meta[1:])))
        at += count
    return out


def from_tail(tail: Sequence[BaseCache], n: int) -> Blocked:
    """See the module doc."""
    metas = tuple((str(n), *c.meta_state[1:]) for c in tail)
    counts = tuple(len(c.flat_state()) for c in tail)
    return Blocked(tuple(type(c) for c in tail), metas, counts, tuple(a for c in tail for a in c.flat_state()))


__all__ = ["Blocked", "as_layers", "assemble", "from_tail", "nbytes", "split", "splittable"]
