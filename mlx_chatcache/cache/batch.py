"""Batches of K/V caches for batched generation (several sequences in one cache).

:class:`BatchKVCache` and :class:`BatchRotatingKVCache` are mlx-lm's classes of
the same name (left-padded rows, mlx-lm's masks and updates, used unchanged),
made by ``KVCache.merge`` / ``RotatingKVCache.merge`` from our single-sequence
caches. What differs: ``extract(i)`` returns OUR single-sequence class
(``KVCache`` / ``RotatingKVCache``) holding exactly row ``i``'s live tokens and
its offset, so it continues like the cache it was merged from, and saves as one.

``BaseCache.merge`` finds the batch class here (``BATCH_CLASSES``). Contract of ``merge(caches)``: row ``i`` of the batch is ``caches[i]``'s live
tokens, right-aligned (left padding before them); all-empty caches give an empty
batch of ``len(caches)`` rows. A window cache merges only without pinned tokens
(``keep == 0``: mlx-lm's batch window has none) and only with others of the same
window size; a quantized or chunked cache does not merge (mlx-lm has no batch
form of them): each refusal is one :class:`UnsupportedCacheError` line.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models import cache as mlx_lm_cache

from .cache_base import BATCH_CLASSES
from .cache_kv import KVCache
from .cache_rotating import RotatingKVCache
from ..errors import UnsupportedCacheError


class BatchKVCache(mlx_lm_cache.BatchKVCache):
    """mlx-lm's ``BatchKVCache`` whose rows are extracted as our ``KVCache``, holding
    K/V in its rows' dtype (``kv_dtype``, as :class:`KVCache` does; None: as computed)."""

    kv_dtype = None

    @classmethod
    def merge(cls, caches: Sequence) -> "BatchKVCache":
        """One batch of ``caches`` (our or mlx-lm's ``KVCache`` objects), row ``i`` = ``caches[i]``."""
        if not caches:
            raise UnsupportedCacheError("BatchKVCache.merge needs at least one cache")
        dtypes = {getattr(c, "kv_dtype", None) for c in caches}
        if len(dtypes) > 1:
            raise UnsupportedCacheError("caches holding K/V in different dtypes cannot share a batch")
        out = cls([0] * len(caches)) if all(c.size() == 0 for c in caches) else super().merge(list(caches))
        out.kv_dtype = dtypes.pop()
        return out

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.kv_dtype is not None:
            keys, values = keys.astype(self.kv_dtype), values.astype(self.kv_dtype)
        return super().update_and_fetch(keys, values)

    def extract(self, idx: int):
        """Row ``idx`` as our ``KVCache``: exactly its tokens (no padding), offset = their count."""
        mx.eval(self.left_padding)
        start = max(0, self.left_padding.tolist()[idx])
        out = KVCache()
        if self.keys is not None and self._idx > start:
            keys = mx.contiguous(self.keys[idx : idx + 1, :, start : self._idx, :])
            values = mx.contiguous(self.values[idx : idx + 1, :, start : self._idx, :])
            out = KVCache.from_state([keys, values], (str(keys.shape[2]),))
        out.kv_dtype = self.kv_dtype
        return out


class BatchRotatingKVCache(mlx_lm_cache.BatchRotatingKVCache):
    """mlx-lm's ``BatchRotatingKVCache`` whose rows are extracted as our ``RotatingKVCache``."""

    @classmethod
    def merge(cls, caches: Sequence) -> "BatchRotatingKVCache":
        """One batch of window ``caches`` (ours, ``keep == 0``, one window size), row ``i`` = ``caches[i]``."""
        if not caches:
            raise UnsupportedCacheError("BatchRotatingKVCache.merge needs at least one cache")
        sizes = {c.max_size for c in caches}
        if len(sizes) > 1:
            raise UnsupportedCacheError(
                f"window caches of sizes {sorted(sizes)} cannot share a batch: merge caches of one window size"
            )
        if any(getattr(c, "keep", 0) for c in caches):
            raise UnsupportedCacheError(
                "a window cache with pinned tokens (keep > 0, made by max_kv_size) cannot be batched: "
                "mlx-lm's batch window pins none; generate it alone"
            )
        max_size = sizes.pop()
        if all(c.size() == 0 for c in caches):
            return cls(max_size, [0] * len(caches))
        return super().merge([_as_mlx_lm_window(c) for c in caches])

    def extract(self, idx: int):
        """Row ``idx`` as our ``RotatingKVCache``: its last ``min(offset, max_size)``
        tokens in temporal order, its offset."""
        row = super().extract(idx)  # mlx-lm's RotatingKVCache, temporal order
        out = RotatingKVCache(self.max_size)
        held = min(row.offset, self.max_size)
        if row.keys is None or held == 0:
            return out
        keys, values = (mx.contiguous(x[..., x.shape[2] - held :, :]) for x in (row.keys, row.values))
        meta = (str(row.offset), str(self.max_size), "0", "0")
        return RotatingKVCache.from_state([keys, values], meta)


def _as_mlx_lm_window(c) -> mlx_lm_cache.RotatingKVCache:
    """mlx-lm's ``RotatingKVCache`` holding ``c``'s live tokens in temporal order (what its merge reads)."""
    if not hasattr(c, "flat_state"):
        return c
    out = mlx_lm_cache.RotatingKVCache(c.max_size)
    if c.size():
        keys, values = c.state
        out.keys, out.values, out.offset, out._idx = keys, values, c.offset, keys.shape[2]
    return out


BATCH_CLASSES.update({
    KVCache: BatchKVCache, mlx_lm_cache.KVCache: BatchKVCache,
    RotatingKVCache: BatchRotatingKVCache, mlx_lm_cache.RotatingKVCache: BatchRotatingKVCache,
})  # fmt: skip
