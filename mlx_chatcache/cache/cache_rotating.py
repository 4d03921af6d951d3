"""Fixed-window caches: ``RotatingKVCache`` and ``QuantizedRotatingKVCache``.

Semantics (the reference the tests check): a query at absolute position ``p``
attends to key positions ``k <= p`` with ``k < keep`` (the pinned prefix) or
``k > p - (max_size - keep)`` (the recent window), whatever mix of multi-token
and single-token updates produced the cache. When the model gives its own
``window_size``, that window decides instead: the query sees every key
``p - window_size < k <= p`` among those the update returns. Only a
multi-token update returns keys older than the ring (the pinned prefix, the
last ``R-1`` held and all new ones), so there a window wider than the ring
(plamo3 asks for ``max_size + 1``) reaches further, as in mlx-lm and as in the
model run without a cache.

Layout: slots ``[0, keep)`` hold positions ``[0, keep)``. Until ``offset``
reaches ``max_size`` the buffer is in temporal order. After that the slots
``[keep, max_size)`` form a ring of the last ``R = max_size - keep`` positions;
``_idx`` is the ring slot holding the oldest one (the next to overwrite).
A multi-token update that overflows the window returns ``pinned + last R-1 old
+ new`` (so every new query sees its full window) and then stores
``pinned + last R`` in temporal order; ``keys_and_values()`` returns what the
last update returned until the next update (held for models that share a
layer's keys, gemma3n; mlx-lm's cache holds the same until its next update).

The cache is trimmable until it first drops a token (``offset <= max_size``).

Contract: ``state`` is in temporal order (as every cache's); ``meta_state`` is
``offset, max_size, keep, ring_idx`` where ``ring_idx`` is ``_idx`` once the
window has wrapped (``keep`` before: the buffer is then in temporal order).
Setting ``state`` after ``meta_state`` (``from_state``, a loaded file,
``copy_prompt_cache``) rotates the ring back to that slot order, so a rebuilt
cache has exactly the live cache's buffer layout: models that select keys by
buffer slot (deepseek_v32's sparse indexer) and attention's summation order
continue bit-identically. A ``meta_state`` of three values (files written
before ``ring_idx`` existed) means ``ring_idx = keep``.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from mlx_lm.models import cache as mlx_lm_cache

from .cache_base import Absent, fill_mask, kv_assign, kv_concat, kv_len, kv_slice, parse_ints
from .cache_kv import KVCache, QuantizedKVCache, check_quant_params
from ..errors import CacheFormatError


class RotatingKVCache(KVCache, mlx_lm_cache.RotatingKVCache):
    """Keeps the first ``keep`` tokens and the last ``max_size - keep`` tokens.

    Unlike mlx-lm's (which raises NotImplementedError), ``to_quantized`` works:
    it returns a :class:`QuantizedRotatingKVCache`."""

    def __init__(self, max_size: int, keep: int = 0):
        self._init_empty()
        self.max_size, self.keep = max_size, keep
        self._check_window()

    def _init_empty(self) -> None:
        super()._init_empty()
        self._idx = 0
        self.max_size, self.keep = 1, 0
        self._returned = None  # (keys, values) of the last overflowing update, until the next update

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

    @classmethod
    def grown_slots(cls, held: int) -> int:
        return held  # a window's buffer is its own layout: files hold its state exactly

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
            return fill_mask(N, self.offset, window_size, return_array)
        kpos = self._layout(N)[None]
        qpos = np.arange(self.offset, self.offset + N)[:, None]
        causal = kpos <= qpos  # several tokens: keys returned in temporal order, so bottom-right causal
        if window_size is None:
            allowed = causal & ((kpos < self.keep) | (kpos > qpos - self._ring))
        else:  # the model's window, over the keys returned: may reach past the ring
            allowed = causal & (kpos > qpos - window_size)
        if N == 1:  # as mlx-lm's: None when every held key is seen (even if an array was asked), else 1-D
            return None if allowed.all() else mx.array(allowed[0])
        if not return_array and np.array_equal(allowed, causal):
            return "causal"  # what mlx-lm passes then: the same kernel
        return mx.array(allowed)

    def keys_and_values(self):
        """What the last ``update_and_fetch`` returned."""
        if self._returned is not None:
            return self._returned
        if self.keys is None:
            return None, None
        if self.offset > self.max_size:
            return self.keys, self.values  # ring order, as a one-token update returns it
        return self._temporal()

    # ----------------------------------------------------------- updates
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        S = keys.shape[2]
        self._returned = None
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
        self._returned = (all_k, all_v)
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
    def state(self) -> list:
        return KVCache.state.fget(self)

    @state.setter
    def state(self, v: Sequence) -> None:
        """Temporal-order arrays; stored in the slot order ``_idx`` says."""
        self._returned = None
        KVCache.state.fset(self, v)
        if self.keys is not None and self._wrapped() and self._idx != self.keep:
            self.keys, self.values = self._to_ring(self.keys), self._to_ring(self.values)

    def _wrapped(self) -> bool:
        return self.offset > self.max_size

    def _ring_idx(self) -> int:
        """``_idx`` where it means something (wrapped), else ``keep``."""
        return self._idx if self._wrapped() else self.keep

    def _to_ring(self, x):
        """Temporal ``[pinned, oldest .. newest]`` -> the ring with the oldest at ``_idx``."""
        k, m = self.keep, self.max_size
        cut = m - (self._idx - k)  # temporal slot that lands on slot k (the newest ones wrap)
        return kv_concat([kv_slice(x, 0, k), kv_slice(x, cut, m), kv_slice(x, k, cut)])

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.offset), str(self.max_size), str(self.keep), str(self._ring_idx()))

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        names = ["offset", "max_size", "keep", "ring_idx"][: max(3, min(len(v), 4))]
        vals = parse_ints(type(self).__name__, v, names)
        self.offset, self.max_size, self.keep = vals[:3]
        self._check_window()
        self._idx = vals[3] if len(vals) == 4 else self.keep
        if not (self.keep <= self._idx < self.max_size) or (self._idx != self.keep and not self._wrapped()):
            raise CacheFormatError(
                f"{type(self).__name__} meta state ring_idx={self._idx} is outside the ring "
                f"[keep={self.keep}, max_size={self.max_size}) or set before the window wrapped "
                f"(offset={self.offset})"
            )
        self._returned = None

    def is_trimmable(self) -> bool:
        return self.offset <= self.max_size

    def can_take_back(self, n: int = 1) -> bool:
        return self.offset + n < self.max_size

    def always_trimmable(self) -> bool:
        return False  # not once the window drops a token

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        self._returned = None
        return super().trim(n)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedRotatingKVCache":
        q = QuantizedRotatingKVCache(self.max_size, self.keep, group_size=group_size, bits=bits)
        q.offset, q._idx, q.kv_dtype = self.offset, self._ring_idx(), self.kv_dtype
        if self.keys is not None:  # same slot order: wrapped, the whole ring; else the held tokens
            k, v = (self.keys, self.values) if self._wrapped() else self._temporal()
            q.keys, q.values = q._encode(k), q._encode(v)
        return q


class QuantizedRotatingKVCache(RotatingKVCache, mlx_lm_cache.QuantizedKVCache):
    """A RotatingKVCache storing keys/values quantized (mlx-lm has no such cache;
    it is also an mlx-lm ``QuantizedKVCache``, the class mlx-lm checks for bits)."""

    to_quantized = Absent("it is already quantized")

    def __init__(self, max_size: int, keep: int = 0, group_size: int = 64, bits: int = 8):
        super().__init__(max_size, keep)
        self.group_size, self.bits = group_size, bits

    _encode = QuantizedKVCache._encode
    _state_form = QuantizedKVCache._state_form
    _pack = QuantizedKVCache._pack

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``offset, max_size, keep, group_size, bits, ring_idx`` (ring_idx appended
        after the quantization fields, so files without it parse as before)."""
        rot = RotatingKVCache.meta_state.fget(self)
        return rot[:3] + (str(self.group_size), str(self.bits), rot[3])

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        name = type(self).__name__
        names = ["offset", "max_size", "keep", "group_size", "bits", "ring_idx"]
        vals = parse_ints(name, v, names[: max(5, min(len(v), 6))])  # no ring_idx: older file
        RotatingKVCache.meta_state.fset(self, tuple(v[:3]) + tuple(v[5:]))
        self.group_size, self.bits = vals[3], vals[4]
        check_quant_params(name, self.group_size, self.bits)
