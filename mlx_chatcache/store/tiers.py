"""The store's tiers behind one interface, and the memory tier.

Contract of a tier (:class:`Tier`)
----------------------------------
A tier maps keys (:mod:`.chain`) to values (:mod:`.values`, or records: :mod:`.records`;
a tier only keeps their ``data``) and evicts by itself:

- ``has(keys) -> list[bool]``: which keys it holds now (a later ``get`` may still miss);
- ``get(keys) -> list[Value | bytes | None]``: each value (checked already, or its
  bytes for the store to check), None for a miss; a hit counts as a use (LRU);
- ``put(values)``: keep the :class:`~.values.Value` s (``{key: value}``) it does not
  hold, and count a use of those it holds; it may refuse or evict what it likes;
- ``drop(key)``: forget a value found damaged;
- ``pin(name, tokens, keys)``: the values of the entry of ``tokens`` tokens that pinning
  key ``name`` (a conversation) put last outlive unpinned ones here (see :class:`Pins`);
- ``stats()``, ``pins()`` (per name, a :class:`Pin`) and ``close()``.

Tiers are called by the thread that owns the store (the generation worker); ``stats``
and ``pins`` may be read from another. The memory tier is :class:`MemoryTier`; the
disk tier is :class:`~.disk.DiskTier`, the Redis tier :class:`~.redis_tier.RedisTier`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Sequence

from .chain import kinds
from .values import Value

PINNED_ENTRIES = 4  # entries each pinning key keeps pinned (a chat turn puts its prompt and its reply)


@dataclass(frozen=True)
class Pin:
    """The entries pinned to one key: how many, the longest one's tokens, their values' bytes."""

    entries: int
    tokens: int
    nbytes: int


class Pins:
    """The values each pinning key holds: those of the last :data:`PINNED_ENTRIES` entries it put."""

    def __init__(self):
        self._names: dict[str, OrderedDict[str, tuple[int, tuple[str, ...]]]] = {}
        self._held: Counter[str] = Counter()  # value key -> entries pinning it

    def pin(self, name: str, tokens: int, keys: Sequence[str]) -> None:
        entries = self._names.setdefault(name, OrderedDict())
        entry = keys[-1]
        if entry in entries:
            self._held.subtract(entries.pop(entry)[1])
        entries[entry] = (tokens, tuple(keys))
        self._held.update(keys)
        while len(entries) > PINNED_ENTRIES:
            self._held.subtract(entries.popitem(last=False)[1][1])
        self._held = +self._held  # drop the keys no entry pins any more

    def __contains__(self, key: str) -> bool:
        return key in self._held

    def report(self, size_of) -> dict[str, Pin]:
        """Per name, what it pins (``size_of(key)``: a value's bytes here, 0 when absent)."""
        out = {}
        for name, entries in list(self._names.items()):
            held = list(entries.values())
            nbytes = sum(size_of(k) for k in {k for _, keys in held for k in keys})
            out[name] = Pin(len(held), max(t for t, _ in held), nbytes)
        return out


class Tier:
    name = "tier"

    def __init__(self, budget: int | None):
        self.budget = budget
        self.pinned = Pins()
        self.counters = {"hits": 0, "added": 0, "refused": 0, "evicted": 0, "corrupt": 0}

    def has(self, keys: Sequence[str]) -> list[bool]:
        raise NotImplementedError

    def get(self, keys: Sequence[str]) -> list[Value | bytes | None]:
        raise NotImplementedError

    def put(self, values: dict[str, Value]) -> None:
        raise NotImplementedError

    def drop(self, key: str) -> None:
        raise NotImplementedError

    def pin(self, name: str, tokens: int, keys: Sequence[str]) -> None:
        self.pinned.pin(name, tokens, keys)

    def pins(self) -> dict[str, Pin]:
        return {}

    def stats(self) -> dict:
        return {"budget": self.budget, **self.counters}

    def close(self) -> None:
        """Finish background work (queued writes) and let go of connections."""


class MemoryTier(Tier):
    """Values in this process, least recently used evicted first within ``budget`` bytes.
    Pinned values go only after every unpinned one, and only for another pinned put;
    a value larger than the budget, or one that would evict pinned values for an
    unpinned put, is refused (counted)."""

    name = "memory"

    def __init__(self, budget: int):
        super().__init__(budget)
        self._values: OrderedDict[str, Value] = OrderedDict()  # least recently used first
        self.nbytes = 0

    def has(self, keys):
        return [k in self._values for k in keys]

    def get(self, keys):
        out = []
        for k in keys:
            v = self._values.get(k)
            if v is not None:
                self._values.move_to_end(k)
                self.counters["hits"] += 1
            out.append(v)
        return out

    def put(self, values):
        pinned = any(k in self.pinned for k in values)
        for k, v in values.items():
            if k in self._values:
                self._values.move_to_end(k)
            elif self._room(len(v.data), pinned):
                self._values[k] = v
                self.nbytes += len(v.data)
                self.counters["added"] += 1
            else:
                self.counters["refused"] += 1

    def _room(self, need: int, pinned: bool) -> bool:
        """Evict until ``need`` more bytes fit; False (nothing evicted) when they cannot."""
        over = self.nbytes + need - self.budget
        if over <= 0 or need > self.budget:
            return need <= self.budget
        victims = []
        for k in self._evictable(pinned):
            victims.append(k)
            over -= len(self._values[k].data)
            if over <= 0:
                break
        if over > 0:
            return False
        for k in victims:
            self.drop(k)
        self.counters["evicted"] += len(victims)
        return True

    def _evictable(self, pinned: bool):
        """Keys in eviction order: unpinned ones (least recently used first), then pinned ones for a pinned put."""
        yield from (k for k in self._values if k not in self.pinned)
        if pinned:
            yield from (k for k in self._values if k in self.pinned)

    def drop(self, key):
        v = self._values.pop(key, None)
        if v is not None:
            self.nbytes -= len(v.data)

    def pins(self):
        return self.pinned.report(lambda k: len(v.data) if (v := self._values.get(k)) is not None else 0)

    def stats(self):
        return {**super().stats(), **kinds(self._values), "bytes": self.nbytes}


__all__ = ["MemoryTier", "Pin", "Pins", "Tier"]
