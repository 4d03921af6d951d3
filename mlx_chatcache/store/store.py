"""The prompt-cache store: tiers (memory, then disk, then a remote tier) behind
one lookup/put interface.

Contract
--------
``PromptStore(tiers)``; tiers are asked in order (fastest first).

- :meth:`PromptStore.checkout` ``(scope, model, prompt, shape, key)`` returns
  ``(state, tier)``: a :class:`~mlx_chatcache.files.prompt_cache.PromptCache` of
  ``model`` and ``shape`` the caller owns, holding the cache and exact token ids
  of the entry that serves the longest prefix of ``prompt[:-1]`` (the last
  prompt token is always left to feed, so the model yields logits; an earlier
  tier wins ties), and the name of its tier; on a miss an empty one and None.
  Entries pinned by ``key`` (a conversation id) are preferred. An entry that turns
  out unusable (a corrupt file) is dropped and counted, and the next best is
  tried: the caller sees a shorter hit or none, never an error. Caches whose
  deferred file write is still pending are found too (tier ``"pending"``).
  The cache may hold more tokens than the prefix it serves; the caller trims
  it (``reuse_prefix``), which is what makes the hit length exact.
- :meth:`PromptStore.put` ``(scope, tokens, cache, key)`` stores a cache
  holding ``tokens`` in every tier: the memory tier keeps a copy (shared
  blocks and a tail, or a compact copy), file tiers write a file; ``cache`` stays the caller's. With ``defer=True``
  the file writes wait in :attr:`PromptStore.pending` (sharing the memory
  tier's copy) until :meth:`PromptStore.flush`, so a server writes when it
  has nothing else to do (and before it exits). A trimmable entry replaces the stored entries
  it extends (their tokens are a prefix of its own); ``key`` (a conversation
  id) pins it: pinned entries outlive unpinned ones under eviction, and a
  lookup with that key prefers them. With ``memory_only=True`` only the memory
  tier keeps it (a cache for the requests of this process, e.g. a prompt whose
  request is still running; files and the Redis tier get its final entry).
- With ``on_error``, a failing tier (a full shared disk) is reported to it,
  ``on_error(tier, error)``, and the other tiers are still written.
- :meth:`PromptStore.stats` (counters per tier) and :meth:`PromptStore.pins`
  (what each key pins, per tier) may be read from another thread.
- What a hit returns holds the same tokens the prompt would otherwise have
  been fed with: generation results do not depend on whether there was a hit
  (up to the floating-point differences of feeding a prompt in other chunks).

All other calls must come from one thread (the server's generation worker, or the
one of ``mlxcc generate``/``mlxcc chat``, which build a store of the disk tier
a server uses, ``--cache-dir``).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from ..cache import BaseCache, can_trim_prompt_cache, copy_prompt_cache
from ..cache.cache_kv import hold_kv_in
from ..config import CacheShape
from ..errors import ChatCacheError
from ..files.prompt_cache import PromptCache
from .index import Entry, Pin
from .disk import DiskTier
from .tiers import MemoryTier, Scope, Tier, compact_copy


class PromptStore:
    def __init__(self, tiers: Sequence[Tier] = ()):
        self.tiers = list(tiers)
        self.pending: deque = deque()  # deferred file writes: (tier, scope, tokens, cache, key)
        self.lookups = 0
        self.misses = 0

    def checkout(self, scope: Scope, model, prompt: Sequence[int], shape: CacheShape | None = None,
                 key: str | None = None) -> tuple[PromptCache, str | None]:  # fmt: skip
        """``(state, tier)``: the longest stored prefix of ``prompt`` (see the module
        doc); ``state.tokens`` may run past the prompt."""
        state = PromptCache.new(model, shape)
        self.lookups += 1
        query = list(prompt[:-1])
        tried = 0
        while tried < 16:  # each failed fetch drops an entry; bounded all the same
            best = self._best(scope, query, key)
            if best is None:
                break
            tier, entry, _ = best
            # a deferred write not done yet: its cache is at hand
            cache = copy_prompt_cache(entry.payload) if tier is None else tier.fetch(entry, scope, state.cache)
            if cache is not None:  # holding what it is fed next in the shape's K/V dtype
                state.cache[:], state.tokens[:] = hold_kv_in(cache, state.shape.kv_dtype), entry.tokens
                return state, "pending" if tier is None else tier.name
            tried += 1
        self.misses += 1
        return state, None

    def _best(self, scope, query, key):
        best = None
        for tier in self.tiers:
            found = tier.find(scope, query, key)
            if found and (best is None or found[1] > best[2]):
                best = (tier, found[0], found[1])
        for _, sc, tokens, cache, _ in self.pending:  # e.g. evicted from memory before its file was written
            if sc.namespace != scope.namespace:
                continue
            entry = Entry(sc.namespace, tokens, 0, can_trim_prompt_cache(cache), None, cache)
            n = entry.serves(query)
            if n and (best is None or n > best[2]):
                best = (None, entry, n)
        return best

    def put(self, scope: Scope, tokens: Sequence[int], cache: list[BaseCache], key: str | None = None,
            defer: bool = False, on_error: Callable[[Tier, Exception], None] | None = None,
            memory_only: bool = False) -> dict:  # fmt: skip
        """Store ``cache`` (holding ``tokens``) in every tier (``memory_only``: in the
        memory tier alone); ``{tier: stored?}`` (None: a deferred write, still
        pending). See the module doc for ``on_error``."""
        tokens = tuple(tokens)
        stored = {}
        if not tokens:
            return stored
        tiers = [t for t in self.tiers if isinstance(t, MemoryTier) or not memory_only]
        files = [t for t in tiers if not isinstance(t, MemoryTier)]
        if defer and files:
            cache = compact_copy(cache)  # one copy, shared by the memory tier and the pending writes
        for tier in tiers:
            try:
                if isinstance(tier, MemoryTier):
                    stored[tier.name] = tier.add(scope, tokens, cache, key, compact=defer and bool(files))
                elif defer:
                    self.pending.append((tier, scope, tokens, cache, key))
                    stored[tier.name] = None
                else:
                    stored[tier.name] = tier.add(scope, tokens, cache, key)
            except (ChatCacheError, OSError) as e:
                if on_error is None:
                    raise
                on_error(tier, e)
                stored[tier.name] = False
        return stored

    def flush(self, keep: int = 0, until=None) -> int:
        """Do pending writes, oldest first, until ``keep`` are left (or ``until()``
        says stop); returns how many were written."""
        done = 0
        while len(self.pending) > keep and not (until and until()):
            tier, scope, tokens, cache, key = self.pending.popleft()
            tier.add(scope, tokens, copy_prompt_cache(cache), key)  # a copy: writing pads its buffers
            done += 1
        return done

    def stats(self) -> dict:
        return {"lookups": self.lookups, "misses": self.misses, "pending_writes": len(self.pending),
                **{t.name: t.stats() for t in self.tiers}}  # fmt: skip

    def pins(self) -> dict[str, dict[str, Pin]]:
        """Per pinning key, what each tier holds for it (tiers that index their
        entries here: not the Redis tier, whose entries other replicas share).
        Safe to call from another thread (see :meth:`~.index.EntryIndex.pins`)."""
        out: dict[str, dict[str, Pin]] = {}
        for tier in self.tiers:
            for key, pin in tier.index.pins().items():
                out.setdefault(key, {})[tier.name] = pin
        return out

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def build_store(memory_bytes: int, disk_bytes: int, cache_dir, redis_url: str | None = None,
                redis_bytes: int | None = None) -> PromptStore:  # fmt: skip
    """A store with a memory tier (unless ``memory_bytes`` is 0), a disk tier
    in ``cache_dir`` (unless ``disk_bytes`` is 0 or ``cache_dir`` is None) and a
    Redis tier at ``redis_url`` (when given; needs the ``redis`` package)."""
    tiers: list[Tier] = []
    if memory_bytes > 0:
        tiers.append(MemoryTier(memory_bytes))
    if disk_bytes > 0 and cache_dir is not None:
        tiers.append(DiskTier(cache_dir, disk_bytes))
    if redis_url:
        from .redis_tier import RedisTier  # the redis package is optional

        tiers.append(RedisTier(redis_url, redis_bytes))
    return PromptStore(tiers)


__all__ = ["PromptStore", "build_store"]
