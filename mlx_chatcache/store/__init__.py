"""A tiered prompt-cache store: memory, local disk, Redis (shared by replicas).

Layers: :mod:`.trie` (longest shared token prefix), :mod:`.index` (entries,
byte budget, LRU, the eviction rule), :mod:`.tiers` (``MemoryTier``,
``DiskTier`` behind one interface), :mod:`.redis_tier` (``RedisTier``, the
same interface over Redis), :mod:`.store` (``PromptStore``: lookup across
tiers, put into all). The store sits between generation and cache
files: it hands out caches and their token ids, and keeps caches it is given;
feeding and sampling stay in :mod:`mlx_chatcache.generate`.
"""

from .index import Entry, EntryIndex
from .store import Checkout, PromptStore
from .tiers import DiskTier, MemoryTier, Scope, Tier, make_scope
from .trie import TokenTrie


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


__all__ = [
    "TokenTrie", "Entry", "EntryIndex", "Tier", "MemoryTier", "DiskTier", "Scope", "make_scope",
    "PromptStore", "Checkout", "build_store",
]  # fmt: skip
