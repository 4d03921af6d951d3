"""Fixed-window caches: ``RotatingKVCache`` and ``QuantizedRotatingKVCache``.

Semantics (the reference the tests check): a query at absolute position ``p``
attends to key positions ``k <= p`` with ``k < keep`` (the pinned prefix) or
``k > p - (max_size - keep)`` (the recent window), whatever mix of multi-token
and single-token updates produced the cache. A model's own ``window_size``
further limits every key to ``k > p - window_size``.

Layout: slots ``[0, keep)`` hold positions ``[0, keep)``. Until ``offset``
reaches ``max_size`` the buffer is in temporal order. After that the slots
``[keep, max_size)`` form a ring of the last ``R = max_size - keep`` positions;
``_idx`` is the ring slot holding the oldest one (the next to overwrite).
A multi-token update that overflows the window returns ``pinned + last R-1 old
+ new`` (so every new query sees its full window) and then stores
``pinned + last R`` in temporal order.

The cache is trimmable until it first drops a token (``offset <= max_size``).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from .cache_base import kv_assign, kv_concat, kv_len, kv_slice, parse_ints, standard_mask
from .cache_kv import KVCache, QuantizedKVCache, check_quant_params
from ..errors import CacheFormatError


class RotatingKVCache(KVCache):
    """Keeps the first ``keep`` tokens and the last ``max_size - keep`` tokens."""

    def __init__(self, max_size: int, keep: int = 0):
        self._init_empty()
        self.max_size, self.keep = max_size, keep
        self._check_window()

    def _init_empty(self) -> None:
        super()._init_empty()
        self._idx = 0
        self.max_size, self.keep = 1, 0

    def _check_window(self) -> None:
        if not 0 <= self.keep < self.max_size:
            raise CacheFormatError(
                f"rotating cache needs 0 <= keep < max_size, got keep={self.keep}, max_size={self.max_size}"
            )

    @property
    def _ring(self) -> int:
        return self.max_size - self.keep

    def _held(self) -> int:
        return min(self.offset, self.max_size)

    def spare_slots(self) -> int:
        return 0  # a window's buffer layout is its own: files hold its state exactly

    def file_state(self) -> list[mx.array]:
        return self.state

    # ----------------------------------------------------------- positions
    def _positions(self) -> np.ndarray:
        """Absolute position of each held slot, in buffer order."""
        n, keep, R = self._held(), self.keep, self._ring
        if self.offset <= self.max_size:
            return np.arange(n)
        ring_age = (np.arange(R) - (self._idx - keep)) % R  # 0 = oldest
        return np.concatenate([np.arange(keep), self.offset - R + ring_age])

    def _old_kept(self) -> np.ndarray:
        """Positions an overflowing multi-token update keeps from the past, in order."""
        o, keep, R = self.offset, self.keep, self._ring
        return np.concatenate([np.arange(min(keep, o)), np.arange(max(keep, o - R + 1), o)])

    def _layout(self, N: int) -> np.ndarray:
        """Key positions that ``update_and_fetch`` of ``N`` tokens will return."""
        new = np.arange(self.offset, self.offset + N)
        if self.offset + N <= self.max_size:
            return np.arange(self.offset + N)
        if N == 1:
            pos = self._positions()
            pos[self._idx if self.offset > self.max_size else self.keep] = self.offset
            return pos
        return np.concatenate([self._old_kept(), new])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if self.offset + N <= self.max_size:
            return standard_mask(N, self.offset, window_size, return_array)
        kpos = self._layout(N)[None]
        qpos = np.arange(self.offset, self.offset + N)[:, None]
        allowed = (kpos <= qpos) & ((kpos < self.keep) | (kpos > qpos - self._ring))
        if window_size is not None:
            allowed &= kpos > qpos - window_size
        if N == 1 and allowed.all() and not return_array:
            return None
        return mx.array(allowed)

    # ----------------------------------------------------------- updates
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        S = keys.shape[2]
        if self.offset + S <= self.max_size:
            return self._update_fill(keys, values)
        if S == 1:
            return self._update_ring(keys, values)
        return self._update_overflow(keys, values)

    def _update_fill(self, keys, values):
        """Not yet full: grow like a KVCache, capped at max_size."""
        out = super().update_and_fetch(keys, values)
        if kv_len(self.keys) > self.max_size:  # step rounding overshot
            self.keys = kv_slice(self.keys, 0, self.max_size)
            self.values = kv_slice(self.values, 0, self.max_size)
        self._idx = self.keep
        return out

    def _update_ring(self, keys, values):
        """Full, one token: overwrite the oldest ring slot in place."""
        if self.offset == self.max_size:
            self._idx = self.keep
        keys, values = self._encode(keys), self._encode(values)
        kv_assign(self.keys, self._idx, keys)
        kv_assign(self.values, self._idx, values)
        self.offset += 1
        self._idx = self.keep + (self._idx + 1 - self.keep) % self._ring
        return self.keys, self.values

    def _update_overflow(self, keys, values):
        """Several tokens past the window: attend over pinned + last R-1 + new."""
        keys, values = self._encode(keys), self._encode(values)
        o, keep, R = self.offset, self.keep, self._ring
        old_k, old_v = self._temporal()
        n_pin = min(keep, o)
        recent = max(0, o - max(keep, o - R + 1))  # recent old tokens to keep
        n_old = kv_len(old_k) if old_k is not None else 0

        def combine(old, new):
            parts = [] if old is None else [kv_slice(old, 0, n_pin), kv_slice(old, n_old - recent, n_old)]
            return kv_concat(parts + [new])

        all_k, all_v = combine(old_k, keys), combine(old_v, values)
        self.offset += kv_len(keys)
        L = kv_len(all_k)
        self.keys = kv_concat([kv_slice(all_k, 0, keep), kv_slice(all_k, L - R, L)])
        self.values = kv_concat([kv_slice(all_v, 0, keep), kv_slice(all_v, L - R, L)])
        self._idx = keep
        return all_k, all_v

    def _temporal(self):
        """Held keys/values in temporal order (None when empty)."""
        if self.keys is None:
            return None, None
        n = self._held()
        if self.offset <= self.max_size or self._idx == self.keep:
            return kv_slice(self.keys, 0, n), kv_slice(self.values, 0, n)
        k, i, m = self.keep, self._idx, self.max_size

        def order(x):
            return kv_concat([kv_slice(x, 0, k), kv_slice(x, i, m), kv_slice(x, k, i)])

        return order(self.keys), order(self.values)

    def _fetch(self):
        return self._temporal()

    # ----------------------------------------------------------- contract
    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.offset), str(self.max_size), str(self.keep))

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        self.offset, self.max_size, self.keep = parse_ints(
            type(self).__name__, v, ["offset", "max_size", "keep"]
        )
        self._check_window()
        self._idx = self.keep

    def is_trimmable(self) -> bool:
        return self.offset <= self.max_size

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        return super().trim(n)

    def to_quantized(self, group_size: int = 64, bits: int = 8) -> "QuantizedRotatingKVCache":
        q = QuantizedRotatingKVCache(self.max_size, self.keep, group_size=group_size, bits=bits)
        q.offset = self.offset
        q._idx = self.keep  # the copy is stored in temporal order
        if self.keys is not None:
            k, v = self._temporal()
            q.keys, q.values = q._encode(k), q._encode(v)
        return q


class QuantizedRotatingKVCache(RotatingKVCache):
    """A RotatingKVCache storing keys/values quantized (mlx-lm has no such cache)."""

    def __init__(self, max_size: int, keep: int = 0, group_size: int = 64, bits: int = 8):
        super().__init__(max_size, keep)
        self.group_size, self.bits = group_size, bits

    _encode = QuantizedKVCache._encode
    _array_names = QuantizedKVCache._array_names
    _pack = QuantizedKVCache._pack

    @property
    def meta_state(self) -> tuple[str, ...]:
        return RotatingKVCache.meta_state.fget(self) + (str(self.group_size), str(self.bits))

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        name = type(self).__name__
        vals = parse_ints(name, v, ["offset", "max_size", "keep", "group_size", "bits"])
        RotatingKVCache.meta_state.fset(self, tuple(v[:3]))
        self.group_size, self.bits = vals[3], vals[4]
        check_quant_params(name, self.group_size, self.bits)

    def to_quantized(self, group_size: int = 64, bits: int = 8):
        raise CacheFormatError("QuantizedRotatingKVCache is already quantized")
