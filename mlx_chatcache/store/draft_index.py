"""An n-gram index over the tokens the store holds for one scope: drafts for speculative decoding.

Contract
--------
A :class:`DraftIndex` keeps the last ``capacity`` tokens it was given (a ring of int32 ids;
sequences are kept apart, so no n-gram spans two) and, for every n-gram of ``sizes`` tokens
in them, where it last ended: a hash table of ``slots`` positions (int64), newest entry
wins a slot. Memory is fixed when it is made: ``4 * capacity + 8 * slots`` bytes
(:attr:`DraftIndex.nbytes`), whatever it is fed; older tokens fall out of the ring as new
ones come, and a slot whose position fell out (or whose n-gram is not the one looked up: a
hash collision) is a miss.

- :meth:`DraftIndex.add` ``(tokens, blocks=())`` appends a sequence. ``blocks``: the store's
  chain keys of its full blocks of ``block`` tokens (:mod:`.chain`): the blocks it indexed
  before (an LRU of as many keys as the ring holds blocks) are skipped, so a conversation
  put again after each turn adds its new tokens only.
- :meth:`DraftIndex.lookup` ``(context, k, min_ngram)`` matches the context's last n-gram,
  longest size first (the longest of ``sizes`` down to ``min_ngram``), and returns up to
  ``k`` tokens that followed its latest occurrence, verified against the ring (never a token
  the store did not hold after that n-gram), or [].

:class:`~mlx_chatcache.store.store.PromptStore` feeds it (``draft_tokens`` > 0): every
``put`` of the scope (the server's requests and replies, a command's), every value a
checkout reads from the disk or Redis tier (other replicas', earlier runs'), and, when it is
made, the newest values of the scope in the disk tier, up to its capacity. It is used from
the thread that uses the store; :meth:`stats` may be read from any.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

import numpy as np

_P = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the polynomial hash (mod 2**64)
_SEP = -1  # between sequences: no n-gram holds it


class DraftIndex:
    def __init__(self, capacity: int, sizes: Sequence[int] = (2, 3, 4), block: int = 64):
        if capacity < 1:
            raise ValueError("a draft index needs room for at least one token")
        self.capacity, self.sizes, self.block = capacity, tuple(sorted(set(sizes))), block
        self.slots = 1 << max(int(capacity * len(self.sizes) - 1).bit_length(), 4)  # about one per n-gram held
        self.ring = np.full(capacity, _SEP, dtype=np.int32)
        self.table = np.zeros(self.slots, dtype=np.int64)  # 1 + the position after the n-gram; 0: empty
        self.total = 0  # tokens (and separators) ever appended: positions are absolute
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.counters = {"sequences": 0, "added": 0, "lookups": 0, "hits": 0}

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes + self.table.nbytes

    # ------------------------------------------------------------------ adding
    def add(self, tokens: Sequence[int], blocks: Sequence[str] = ()) -> int:
        """Index ``tokens`` (see the module docstring); how many tokens it appended."""
        skip = 0
        for key in blocks:
            if key not in self._seen:
                break
            self._seen.move_to_end(key)
            skip += self.block
        start = max(skip - max(self.sizes), 0)  # the n-grams that end in the new tokens
        seq = np.asarray(tokens[start:], dtype=np.int64)
        if seq.size <= min(self.sizes):
            return 0
        for key in blocks[skip // self.block :]:
            self._seen[key] = None
        while len(self._seen) > self.capacity // self.block + 1:
            self._seen.popitem(last=False)
        seq = seq[-(self.capacity - 1) :]
        first = self.total + 1  # after the separator
        self._append(np.concatenate([[_SEP], seq]).astype(np.int32))
        for n in self.sizes:
            if seq.size <= n:
                continue
            h = _hashes(seq, n)  # h[j]: the n-gram seq[j:j+n], followed by seq[j+n]
            self.table[_slot(h[: seq.size - n], n, self.slots)] = first + n + np.arange(seq.size - n) + 1
        self.counters["sequences"] += 1
        self.counters["added"] += int(seq.size)
        return int(seq.size)

    def _append(self, values: np.ndarray) -> None:
        at = self.total % self.capacity
        head = min(values.size, self.capacity - at)
        self.ring[at : at + head] = values[:head]
        self.ring[: values.size - head] = values[head:]
        self.total += int(values.size)

    def add_all(self, sequences: Iterable[Sequence[int]]) -> None:
        for s in sequences:
            self.add(s)

    # ------------------------------------------------------------------ lookup
    def lookup(self, context: Sequence[int], k: int, min_ngram: int = 2) -> list[int]:
        """Up to ``k`` tokens that followed the context's last n-gram (see the module docstring)."""
        self.counters["lookups"] += 1
        oldest = self.total - self.capacity
        for n in (s for s in reversed(self.sizes) if min_ngram <= s <= len(context)):
            gram = np.asarray(context[-n:], dtype=np.int64)
            j = int(self.table[_slot(_hashes(gram, n), n, self.slots)][0]) - 1  # absolute: after the n-gram
            if j - n < max(oldest, 0) or j >= self.total:
                continue
            if not np.array_equal(self._read(j - n, j), gram):
                continue
            follow = self._read(j, min(j + k, self.total))
            cut = np.flatnonzero(follow == _SEP)
            follow = follow[: cut[0]] if cut.size else follow
            if follow.size:
                self.counters["hits"] += 1
                return follow.tolist()
        return []

    def _read(self, a: int, b: int) -> np.ndarray:
        """Ring tokens of absolute positions ``[a, b)`` (still held)."""
        idx = np.arange(a, b) % self.capacity
        return self.ring[idx].astype(np.int64)

    def stats(self) -> dict:
        return {"capacity_tokens": self.capacity, "tokens": min(self.total, self.capacity), "bytes": self.nbytes,
                **self.counters}  # fmt: skip


def _hashes(seq: np.ndarray, n: int) -> np.ndarray:
    """The hash of every n-gram of ``seq``: ``out[j]`` is that of ``seq[j:j+n]``."""
    with np.errstate(over="ignore"):
        s = seq.astype(np.uint64) + np.uint64(1)
        m = s.size - n + 1
        h = np.zeros(m, dtype=np.uint64)
        for i in range(n):
            h = h * _P + s[i : i + m]
    return h


def _slot(h: np.ndarray, n: int, slots: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = h ^ (h >> np.uint64(29)) ^ (np.uint64(n) * _P)
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        return ((x ^ (x >> np.uint64(32))) & np.uint64(slots - 1)).astype(np.int64)


__all__ = ["DraftIndex"]
