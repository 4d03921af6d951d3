"""Growing K/V caches: ``KVCache``, ``QuantizedKVCache`` and ``ChunkedKVCache``.

All three keep keys/values in a buffer that grows in ``step``-sized blocks;
only ``[0:held]`` is live. ``state`` returns exactly the live part, so a saved
file never holds padding or trimmed-away tokens. ``state`` may be set with
arrays that carry room after the live tokens up to the next multiple of
``step`` (``grown_slots``: what a loader reads a file into, and what files of
format version 2-4 stored); the cache grows into it in place. A cache rebuilt
from exact arrays makes its room at its first update (one new buffer per array).

Each subclasses mlx-lm's class of the same name (see ``docs/mlx-lm-compat.md``).
``to_quantized`` exists only where mlx-lm's class has it (``KVCache``): mlx-lm's
generate loop quantizes every layer that has the method.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import cache as mlx_lm_cache

from .cache_base import (
    Absent,
    BaseCache,
    check_arrays,
    check_form,
    kv_assign,
    kv_grow,
    kv_len,
    kv_slice,
    kv_zeros_like,
    nest_like,
    parse_ints,
    standard_mask,
    tree_arrays,
)
from ..config import KV_DTYPES
from ..errors import CacheFormatError, UsageError


class KVCache(BaseCache, mlx_lm_cache.KVCache):
    """Full-attention cache: every token stays. Trimmable."""

    step = 256
    kv_dtype: mx.Dtype | None = None  # the dtype K/V are held in (set by hold_kv_in); None: as computed

    def __init__(self):
        self._init_empty()

    def _init_empty(self) -> None:
        self.keys = None
        self.values = None
        self.offset = 0

    # ----------------------------------------------------------- storage hooks
    def _encode(self, x: mx.array):
        """How new keys/values are stored: in ``kv_dtype`` when set, else as computed.
        The one place K/V are cast: every path (prefill, decode, a rotating window's
        wrap, quantizing) stores what this returns."""
        return x if self.kv_dtype is None or x.dtype == self.kv_dtype else x.astype(self.kv_dtype)

    @property
    def _start(self) -> int:
        """Absolute position of buffer slot 0 (non-zero only for chunked caches)."""
        return 0

    def _held(self) -> int:
        return self.offset - self._start

    # ----------------------------------------------------------- model interface
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append keys/values ``(B, H, S, D)``; return all held keys and values."""
        prev, S = self._held(), keys.shape[2]
        keys, values = self._encode(keys), self._encode(values)
        self._reserve(keys, values, prev + S)
        kv_assign(self.keys, prev, keys)
        kv_assign(self.values, prev, values)
        self.offset += S
        return self._fetch()

    def _reserve(self, keys, values, need: int) -> None:
        """Make the buffers hold at least ``need`` steps, keeping the live part."""
        if self.keys is not None and kv_len(self.keys) >= need:
            return
        capacity = -(-need // self.step) * self.step
        held = self._held()
        if self.keys is None:
            self.keys = kv_zeros_like(keys, capacity)
            self.values = kv_zeros_like(values, capacity)
            return
        self.keys = kv_grow(kv_slice(self.keys, 0, held), capacity)
        self.values = kv_grow(kv_slice(self.values, 0, held), capacity)

    def _fetch(self):
        held = self._held()
        if kv_len(self.keys) == held:
            return self.keys, self.values
        return kv_slice(self.keys, 0, held), kv_slice(self.values, 0, held)

    def keys_and_values(self):
        """What the last ``update_and_fetch`` returned (models that share one
        layer's keys/values with later layers read them here)."""
        if self.keys is None:
            return None, None
        return self._fetch()

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return standard_mask(N, self.offset, window_size, return_array)

    # ----------------------------------------------------------- contract
    @property
    def state(self) -> list:
        """``[keys, values]``, each as stored (see ``_state_form``); ``[]`` when empty."""
        if self.keys is None:
            return []
        # new array objects: later in-place writes into our buffers must not
        # reach the caller's list (nor a cache rebuilt from it), and vice versa
        return [tree_map(lambda a: a[...], x) for x in self._fetch()]

    @state.setter
    def state(self, v: Sequence) -> None:
        name = type(self).__name__
        if not v:
            if self._held() != 0:
                raise CacheFormatError(f"{name} with {self._held()} tokens has no arrays")
            self.keys = self.values = None
            return
        check_form(name, v, self._state_form())
        # own objects: update_and_fetch writes into them in place
        self.keys, self.values = (self._pack([a[...] for a in tree_arrays(x)]) for x in v)
        flat = tree_arrays([self.keys, self.values])
        # a copy or a loaded cache holds what it is fed next as it holds its K/V (hold_kv_in may say otherwise)
        self.kv_dtype = next((a.dtype for a in flat if a.dtype != mx.uint32), None)
        slots = flat[0].shape[2] if flat[0].ndim == 4 else -1
        if slots not in (self._held(), self.grown_slots(self._held())):
            slots = -1
        for a in flat:
            if a.ndim != 4 or a.shape[2] != slots or a.shape[:2] != flat[0].shape[:2]:
                raise CacheFormatError(
                    f"{name} array of shape {tuple(a.shape)} does not hold {self._held()} tokens "
                    "as (batch, heads, tokens, dim)"
                )

    def with_arrays(self, arrays: Sequence[mx.array]):
        """As BaseCache's, keeping ``kv_dtype`` (an empty copy has no arrays to take it from)."""
        out = super().with_arrays(arrays)
        out.kv_dtype = self.kv_dtype
        return out

    def nest_state(self, arrays: list[mx.array]) -> list:
        if not arrays:
            return []
        form = self._state_form()
        check_arrays(type(self).__name__, arrays, len(tree_arrays(form)))
        return nest_like(form, arrays)

    @classmethod
    def grown_slots(cls, held: int) -> int:
        """The tokens, then room up to the next multiple of ``step``."""
        return held + (-held % cls.step)

    def _state_form(self) -> list:
        """What ``state`` holds, as names nested like its arrays."""
        return ["keys", "values"]

    def _pack(self, arrays):
        """Keys or values as stored, from their arrays."""
        return arrays[0]

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.offset),)

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        (self.offset,) = parse_ints(type(self).__name__, v, ["offset"])

    def eval_arrays(self) -> list[mx.array]:
        if self.keys is None:
            return []
        return tree_arrays([self.keys, self.values])

    def is_trimmable(self) -> bool:
        return True

    def can_take_back(self, n: int = 1) -> bool:
        return True

    def always_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = max(0, min(self._held(), n))
        self.offset -= n
        return n

    def size(self) -> int:
        return self._held()

    def empty(self) -> bool:
        return self.keys is None

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedKVCache":
        """A quantized copy holding the same tokens (mlx-lm's defaults)."""
        q = QuantizedKVCache(group_size=group_size, bits=bits)
        q.offset, q.kv_dtype = self.offset, self.kv_dtype
        if self.keys is not None:
            k, v = self._fetch()
            q.keys, q.values = q._encode(k), q._encode(v)
        return q


class QuantizedKVCache(KVCache, mlx_lm_cache.QuantizedKVCache):
    """A KVCache whose keys/values are stored quantized (affine, per group);
    its ``state`` nests them as mlx-lm's does:
    ``[(keys, key_scales, key_biases), (values, value_scales, value_biases)]``."""

    to_quantized = Absent("it is already quantized")

    def __init__(self, group_size: int = 64, bits: int = 8):
        self._init_empty()
        self.group_size, self.bits = group_size, bits

    def _encode(self, x: mx.array):
        """Cast to ``kv_dtype`` (KVCache._encode), then quantized: scales and biases take that dtype."""
        return tuple(mx.quantize(KVCache._encode(self, x), group_size=self.group_size, bits=self.bits))

    def _state_form(self):
        return [("keys", "key_scales", "key_biases"), ("values", "value_scales", "value_biases")]

    def _pack(self, arrays):
        check_quantized(type(self).__name__, arrays, self.group_size, self.bits)
        return tuple(arrays)

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.offset), str(self.group_size), str(self.bits))

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        self.offset, self.group_size, self.bits = parse_ints(
            type(self).__name__, v, ["offset", "group_size", "bits"]
        )
        check_quant_params(type(self).__name__, self.group_size, self.bits)


def hold_kv_in(cache: list, kv_dtype: str) -> list:
    """``cache`` (one cache per layer) with every K/V layer, inside a CacheList too,
    holding its keys/values in ``kv_dtype`` (one of config.KV_DTYPES; "auto": as
    the model computes them) from now on. Other layers (ArraysCache: SSM state) are
    left as they are."""
    if kv_dtype not in KV_DTYPES:
        raise UsageError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    dtype = None if kv_dtype == "auto" else getattr(mx, kv_dtype)

    def hold(c):
        if isinstance(c, KVCache):
            c.kv_dtype = dtype
        for inner in getattr(c, "caches", ()):
            hold(inner)

    for c in cache:
        hold(c)
    return cache


def check_quant_params(name: str, group_size: int, bits: int) -> None:
    if bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128):
        raise CacheFormatError(
            f"{name} has unsupported quantization bits={bits}, group_size={group_size}; "
            "use bits in 2,3,4,5,6,8 and group_size in 32,64,128"
        )


def check_quantized(name: str, arrays, group_size: int, bits: int) -> None:
    """``(packed, scales, biases)`` must be what ``mx.quantize`` makes, so they dequantize."""
    w, scales, biases = arrays
    floating = (mx.float16, mx.bfloat16, mx.float32)
    ok = (
        all(a.ndim == 4 for a in arrays)
        and w.dtype == mx.uint32
        and scales.dtype in floating
        and biases.dtype in floating
        and scales.shape == biases.shape
        and w.shape[:-1] == scales.shape[:-1]
        and w.shape[-1] * 32 == scales.shape[-1] * group_size * bits
    )
    if not ok:
        shown = ", ".join(f"{a.dtype}{tuple(a.shape)}" for a in arrays)
        raise CacheFormatError(
            f"{name} arrays ({shown}) are not {bits}-bit quantized data with groups of {group_size}"
        )


class ChunkedKVCache(KVCache, mlx_lm_cache.ChunkedKVCache):
    """KVCache for chunked local attention (llama4): keeps at most the last
    ``chunk_size`` tokens once the model calls ``maybe_trim_front``.

    Like mlx-lm's, it has no ``make_mask`` (the model builds its chunk mask
    from ``start_position``; a mask asked of it is mlx-lm's default) and no
    ``to_quantized``."""

    make_mask = Absent("the model builds its chunk mask itself")
    to_quantized = Absent("chunked caches are not quantized")

    def always_trimmable(self) -> bool:
        return False  # tokens before start_position are gone

    def __init__(self, chunk_size: int):
        self._init_empty()
        self.chunk_size = chunk_size

    def _init_empty(self) -> None:
        super()._init_empty()
        self.start_position = 0

    @property
    def _start(self) -> int:
        return self.start_position

    def maybe_trim_front(self) -> None:
        extra = self._held() - self.chunk_size
        if self.keys is None or extra <= 0:
            return
        held = self._held()
        self.start_position += extra
        self.keys = kv_slice(self.keys, extra, held)
        self.values = kv_slice(self.values, extra, held)

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.offset), str(self.chunk_size), str(self.start_position))

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        self.offset, self.chunk_size, self.start_position = parse_ints(
            "ChunkedKVCache", v, ["offset", "chunk_size", "start_position"]
        )
        if self.start_position > self.offset or self.chunk_size == 0:
            raise CacheFormatError("ChunkedKVCache meta state is inconsistent (start > offset or chunk 0)")
