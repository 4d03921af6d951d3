"""The store's tiers behind one interface: memory (live cache objects) here,
a disk directory (cache files in our format) in :mod:`.disk`.

Contract of a tier (:class:`Tier`)
----------------------------------
- ``find(scope, query, key) -> (Entry, n) | None``: the entry serving the
  longest prefix of ``query`` in ``scope`` (see :mod:`.index`);
- ``fetch(entry, scope, expected) -> list[BaseCache] | None``: an independent
  cache holding exactly ``entry.tokens`` (the caller may change it freely), or
  None when the entry turned out unusable (then it is dropped and counted in
  ``stats()["corrupt"]``, unless its disk file was simply gone); ``expected`` is an empty cache the model makes, to
  check layer kinds against;
- ``add(scope, tokens, cache, key) -> bool``: store a cache holding ``tokens``
  (False: refused by the budget rule). The memory tier keeps shared blocks
  and a tail, or a compact copy (:class:`MemoryTier`), the disk tier writes
  block files and an entry file, or one file (:class:`~.disk.DiskTier`);
  ``cache`` stays the caller's;
- ``stats() -> dict``: entries, bytes, budget and counters;
- ``close()``: at shutdown (a no-op but for the Redis tier).

A *named* tier (``named = True``: :class:`~.named_file.CacheFileTier`, one
cache file the user named) is strict instead: what it cannot serve raises
rather than being a miss, it is never evicted, and its ``add`` also takes the
file's contents (messages, text, settings, user metadata).

Every tier holds entries within its byte budget (:class:`EntryIndex`). Only
the generation worker calls tiers (they are not thread-safe; the disk tier
does MLX work to write files). The Redis tier (:mod:`.redis_tier`) implements
the same methods over serialized files; its own writer thread does no MLX work.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..cache import BaseCache, can_trim_prompt_cache, copy_prompt_cache, prompt_cache_nbytes
from ..config import SERVER_DEFAULTS
from ..models.fingerprint import ModelFingerprint
from .blocks import Blocked, assemble, host_view, nbytes, split, splittable
from .chain import Chain
from .index import Entry, EntryIndex


@dataclass(frozen=True)
class Scope:
    """Which model and cache shape entries belong to: ``namespace`` keys them,
    ``fingerprint`` is written into and checked against files, ``settings``
    (max_kv_size, keep, KV quantization and, for a command's or server's
    scope, the weight policy) are hashed into the namespace and written with
    each entry, so ``mlxcc cache info`` can say what made it."""

    namespace: str
    fingerprint: ModelFingerprint
    settings: dict = field(default_factory=dict, hash=False, compare=False)


def make_scope(fingerprint: ModelFingerprint, settings: dict) -> Scope:
    ident = json.dumps(
        {"weights": fingerprint.weights_hash, "tokenizer": fingerprint.tokenizer_hash, **settings}, sort_keys=True
    )
    return Scope(hashlib.sha256(ident.encode()).hexdigest()[:32], fingerprint, dict(settings))


class Tier:
    name = "tier"
    named = False  # a file the user named (see the module doc)

    def __init__(self, budget: int):
        self.index = EntryIndex(budget)
        self.counters = {"hits": 0, "hit_tokens": 0, "added": 0, "refused": 0, "evicted": 0, "corrupt": 0}

    def find(self, scope: Scope, query: Sequence[int], key: str | None) -> tuple[Entry, int] | None:
        return self.index.longest(scope.namespace, query, key)

    def fetch(self, entry: Entry, scope: Scope, expected: Sequence[BaseCache]) -> list[BaseCache] | None:
        raise NotImplementedError

    def add(self, scope: Scope, tokens: Sequence[int], cache: list[BaseCache], key: str | None) -> bool:
        raise NotImplementedError

    def stats(self) -> dict:
        return {"entries": len(self.index), "bytes": self.index.nbytes, "budget": self.index.budget,
                "pinned_entries": self.index.pinned_count(), **self.counters}  # fmt: skip

    def close(self) -> None:
        """Finish background work (the Redis tier's queued writes) and let go of connections."""

    # shared by the tiers
    def _covered(self, entry: Entry) -> Entry | None:
        """A stored trimmable entry that extends ``entry``'s tokens (and so serves
        everything it would), pinned to the same key or ``entry`` unpinned."""
        found = self.index.longest(entry.namespace, entry.tokens, entry.key)
        if found is None:
            return None
        other, n = found
        if n == len(entry.tokens) < len(other.tokens) and other.trimmable and other.key in (None, entry.key):
            return other
        return None

    def _admit(self, entry: Entry) -> bool:
        """Insert ``entry`` under the budget rule, dropping what it supersedes."""
        replaced = self.index.get(entry.namespace, entry.tokens)
        dropping = self.index.superseded(entry) + ([replaced] if replaced is not None else [])
        victims = self.index.plan(entry.nbytes, entry.pinned, dropping, entry.blocks)
        if victims is None:
            self.counters["refused"] += 1
            return False
        for old in dropping + victims:
            self._drop(old, keep_payload_of=entry)
        self.counters["evicted"] += len(victims)
        self.index.add(entry, [])
        self.counters["added"] += 1
        return True

    def _drop(self, entry: Entry, keep_payload_of: Entry | None = None) -> None:
        self.index.remove(entry)

    def _hit(self, entry: Entry) -> None:
        self.index.touch(entry)
        self.counters["hits"] += 1
        self.counters["hit_tokens"] += len(entry.tokens)


class MemoryTier(Tier):
    """Cache objects in memory; ``fetch`` returns a copy, so entries never change.

    With ``block_tokens`` (default ``SERVER_DEFAULTS.store_block_tokens``), a
    cache of plain K/V layers is kept as shared blocks of that many tokens plus
    its tail (:mod:`.blocks`): entries sharing a prefix hold its blocks once,
    and the budget counts each block once (:class:`~.index.EntryIndex`). A cache
    that cannot be split (see :func:`~.blocks.splittable`), or any cache when
    ``block_tokens`` is 0, is kept whole: a compact copy (live tokens only, in
    buffers of its own, so ``nbytes`` is what it really holds)."""

    name = "memory"

    def __init__(self, budget: int, block_tokens: int = SERVER_DEFAULTS.store_block_tokens):
        super().__init__(budget)
        self.block_tokens = block_tokens
        self._values: dict[str, list[mx.array]] = {}  # block id -> its arrays
        self._host: dict[str, list[np.ndarray]] = {}  # block id -> NumPy views of them (for assemble)
        self._loose: set[str] = set()  # blocks that may have lost their last entry

    def fetch(self, entry, scope, expected):
        self._hit(entry)
        if isinstance(entry.payload, Blocked):
            return assemble(entry.payload, [self._host[b] for b, _ in entry.blocks])
        return copy_prompt_cache(entry.payload)

    def add(self, scope, tokens, cache, key, compact: bool = False):
        """``compact``: ``cache`` is a compact copy already, kept as it is when stored whole."""
        covering = self._covered(Entry(scope.namespace, tuple(tokens), 0, True, key))
        if covering is not None:
            self.index.touch(covering)
            return True
        trimmable = can_trim_prompt_cache(cache)
        if self.block_tokens > 0 and splittable(cache, len(tokens)):
            chain = Chain(scope.namespace, tokens, self.block_tokens)
            new, blocked = split(cache, chain, self._values.__contains__)
            self._values.update(new)
            self._host.update((h, [host_view(a) for a in v]) for h, v in new.items())
            self._loose.update(new)
            blocks = tuple((h, nbytes(self._values[h])) for h in chain.hashes)
            entry = Entry(scope.namespace, tuple(tokens), blocked.nbytes, trimmable, key, blocked, blocks)
        else:
            compact = cache if compact else compact_copy(cache)
            entry = Entry(scope.namespace, tuple(tokens), prompt_cache_nbytes(compact), trimmable, key, compact)
        try:
            return self._admit(entry)
        finally:
            for b in self._loose:
                if not self.index.has_block(b):
                    self._values.pop(b, None)
                    self._host.pop(b, None)
            self._loose.clear()

    def _drop(self, entry, keep_payload_of=None):
        self._loose.update(self.index.remove(entry))

    def stats(self) -> dict:
        return {**super().stats(), "blocks": len(self._values), "block_tokens": self.block_tokens}


def compact_copy(cache: Sequence[BaseCache]) -> list[BaseCache]:
    """A copy of ``cache`` whose arrays hold the live tokens only, in buffers of
    their own (a slice would keep the whole source buffer alive), each layer storing
    what it is fed next as its source does (``BaseCache.with_arrays``)."""
    out = [c.with_arrays([mx.contiguous(a) for a in c.flat_state()]) for c in cache]
    mx.eval([c.eval_arrays() for c in out])
    return out
