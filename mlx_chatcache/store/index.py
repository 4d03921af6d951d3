"""Bookkeeping shared by every store tier: entries, a token trie per
namespace, LRU order, a byte budget and the eviction rule.

Contract
--------
An :class:`Entry` is one stored prompt cache: ``namespace`` (which model and
cache shape made it: entries of another namespace are never returned),
``tokens`` (the exact ids the cache holds), ``nbytes``, ``trimmable`` (whether
it can serve a shorter prefix of its tokens), ``key`` (the conversation it is
pinned to, or None) and ``payload`` (what the tier keeps: cache objects, a
file path, ...); ``blocks`` (the shared blocks it also holds, as
``(block id, nbytes)``: ``nbytes`` is then its own part only, the tail).

A block is counted once however many entries hold it, and freed (its bytes
leave :attr:`EntryIndex.nbytes`) when the last entry holding it is removed:
``nbytes`` is what the tier really holds, unique blocks plus the entries' own
parts. An entry's *size* is its own bytes plus all its blocks'.

:class:`EntryIndex` keeps entries within ``budget`` bytes:

- an entry whose size exceeds the budget is refused (nothing is evicted for it);
- otherwise the least recently used entries are evicted until it fits, with
  **no entry evicting more than its own size's worth** of others: a victim
  whose eviction would push the bytes freed past what the new entry adds
  (its own bytes and the blocks not stored yet) is
  skipped; if the entry still does not fit it is refused and nothing is evicted;
- pinned entries (``key`` not None) are evicted only to make room for another
  pinned entry, and only after every unpinned candidate;
- adding an entry for tokens already stored in its namespace replaces the old
  one; :meth:`EntryIndex.superseded` lists the stored prefixes a trimmable
  entry makes redundant (it can serve all of them).

:meth:`EntryIndex.longest` returns the entry serving the longest prefix of a
query (see :mod:`.trie`); with a ``key``, that conversation's own entries win
ties. :meth:`EntryIndex.pins` says what each key pins (:class:`Pin`). Nothing
here touches MLX or the file system.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..files.tokens import common_prefix_len
from .trie import TokenTrie


@dataclass(eq=False)
class Entry:
    namespace: str
    tokens: tuple[int, ...]
    nbytes: int
    trimmable: bool
    key: str | None = None
    payload: Any = None
    blocks: tuple[tuple[str, int], ...] = ()
    id: int = field(default=0, compare=False)

    @property
    def size(self) -> int:
        """Its own bytes plus those of every block it holds."""
        return self.nbytes + sum(n for _, n in self.blocks)

    @property
    def pinned(self) -> bool:
        return self.key is not None

    def serves(self, query: Sequence[int]) -> int:
        """How many tokens of ``query`` this entry can serve."""
        n = common_prefix_len(self.tokens, query)
        return n if self.trimmable or n == len(self.tokens) else 0


@dataclass(frozen=True)
class Pin:
    """The entries pinned to one key: how many, the longest one's tokens, their bytes."""

    entries: int
    tokens: int
    nbytes: int


class EntryIndex:
    def __init__(self, budget: int):
        self.budget = int(budget)
        self.nbytes = 0
        self._tries: dict[str, TokenTrie] = {}
        self._lru: OrderedDict[int, Entry] = OrderedDict()  # oldest first
        self._by_key: dict[str, set[int]] = {}
        self._ids = itertools.count(1)
        self._blocks: dict[str, list[int]] = {}  # block id -> [entries holding it, nbytes]

    def __len__(self) -> int:
        return len(self._lru)

    def entries(self) -> list[Entry]:
        """Every entry, least recently used first."""
        return list(self._lru.values())

    # ------------------------------------------------------------------ lookup
    def longest(self, namespace: str, query: Sequence[int], key: str | None = None) -> tuple[Entry, int] | None:
        trie = self._tries.get(namespace)
        found = trie.longest(query) if trie else None
        for eid in self._by_key.get(key, ()) if key is not None else ():
            e = self._lru[eid]
            n = e.serves(query) if e.namespace == namespace else 0
            if n and (found is None or n >= found[1]):
                found = (e, n)
        return found

    def pinned_count(self) -> int:
        """How many entries are pinned to a key."""
        return sum(len(ids) for ids in list(self._by_key.values()))

    def pins(self) -> dict[str, Pin]:
        """What each key pins. May be called from a thread other than the one
        changing the index: a snapshot, which may miss an entry changing meanwhile."""
        out = {}
        for key, ids in list(self._by_key.items()):
            entries = [e for e in map(self._lru.get, list(ids)) if e is not None]
            if entries:
                out[key] = Pin(len(entries), max(len(e.tokens) for e in entries), sum(e.size for e in entries))
        return out

    def get(self, namespace: str, tokens: Sequence[int]) -> Entry | None:
        trie = self._tries.get(namespace)
        return trie.get(tokens) if trie else None

    def has_block(self, block: str) -> bool:
        """Whether an entry holds ``block``."""
        return block in self._blocks

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` most recently used."""
        self._lru.move_to_end(entry.id)

    def superseded(self, entry: Entry) -> list[Entry]:
        """Stored entries ``entry`` makes redundant: shorter prefixes of its
        tokens in its namespace (when it is trimmable), not pinned to another key."""
        trie = self._tries.get(entry.namespace)
        if not entry.trimmable or trie is None:
            return []
        return [
            e for e, n in trie.prefixes(entry.tokens)
            if n < len(entry.tokens) and e.key in (None, entry.key)
        ]  # fmt: skip

    # ------------------------------------------------------------------ update
    def plan(self, nbytes: int, pinned: bool, dropping: Sequence[Entry] = (),
             blocks: Sequence[tuple[str, int]] = ()) -> list[Entry] | None:  # fmt: skip
        """The entries to evict so that an entry of ``nbytes`` own bytes holding
        ``blocks`` fits (None: refused). ``dropping``: entries removed anyway
        (superseded or replaced), which free their bytes without counting as
        evictions. Removing entries frees their own bytes and the blocks no
        remaining entry (nor the new one) holds."""
        if nbytes + sum(n for _, n in blocks) > self.budget:
            return None
        keep = {b for b, _ in blocks}
        adds = nbytes + sum(n for b, n in blocks if b not in self._blocks)
        held: dict[str, int] = {}  # block -> holders removed so far

        def frees(e: Entry) -> int:
            out = e.nbytes
            for b, n in e.blocks:
                if b not in keep and self._blocks[b][0] - held.get(b, 0) == 1:
                    out += n
            return out

        def take(e: Entry) -> None:
            for b, _ in e.blocks:
                held[b] = held.get(b, 0) + 1

        skip, freed_dropping = set(), 0
        for e in dropping:
            if e.id in self._lru and e.id not in skip:
                freed_dropping += frees(e)
                take(e)
                skip.add(e.id)
        need = self.nbytes - freed_dropping + adds - self.budget
        if need <= 0:
            return []
        victims, freed = [], 0
        candidates = [e for e in self._lru.values() if not e.pinned and e.id not in skip]
        if pinned:
            candidates += [e for e in self._lru.values() if e.pinned and e.id not in skip]
        for e in candidates:
            gain = frees(e)
            if freed + gain > adds:
                continue  # would evict more than the new entry adds
            victims.append(e)
            take(e)
            freed += gain
            if freed >= need:
                return victims
        return None

    def add(self, entry: Entry, victims: list[Entry]) -> None:
        """Insert ``entry`` after removing ``victims`` (from :meth:`plan`) and
        any entry stored for the same tokens."""
        for v in victims:
            self.remove(v)
        old = self.get(entry.namespace, entry.tokens)
        if old is not None:
            self.remove(old)
        entry.id = next(self._ids)
        self._tries.setdefault(entry.namespace, TokenTrie()).add(entry.tokens, entry, entry.trimmable)
        self._lru[entry.id] = entry
        if entry.key is not None:
            self._by_key.setdefault(entry.key, set()).add(entry.id)
        self.nbytes += entry.nbytes
        for b, n in entry.blocks:
            count = self._blocks.setdefault(b, [0, n])
            if count[0] == 0:
                self.nbytes += n
            count[0] += 1

    def remove(self, entry: Entry) -> list[str]:
        """Remove ``entry``; the blocks no entry holds any more (freed)."""
        if self._lru.pop(entry.id, None) is None:
            return []
        trie = self._tries[entry.namespace]
        trie.remove(entry.tokens)
        if not len(trie):
            del self._tries[entry.namespace]
        if entry.key is not None:
            ids = self._by_key[entry.key]
            ids.discard(entry.id)
            if not ids:
                del self._by_key[entry.key]
        self.nbytes -= entry.nbytes
        freed = []
        for b, n in entry.blocks:
            count = self._blocks[b]
            count[0] -= 1
            if count[0] == 0:
                del self._blocks[b]
                self.nbytes -= n
                freed.append(b)
        return freed
