"""What the store keeps: values, each one cache file of our format held as bytes.

Contract
--------
A value is the bytes of a checksummed cache file (:mod:`mlx_chatcache.files.mlxcc_format`):
the same bytes in memory, in a disk tier's file and in Redis. It holds the K/V of
the tokens ``[start, start + len(tokens))`` of a sequence, lists those tokens, and
records in its user metadata its key, its scope's namespace and ``start``, so a
value read under another key or scope, or for other tokens, is refused:

- a *block* (key ``"b" + h_i``, :mod:`.chain`): ``KVCache`` layers holding one block's
  tokens; a cache splits into blocks when every layer is a plain ``KVCache``
  (:func:`splittable`);
- an *entry* (key ``"e" + ...``): the tokens after the entry's last full block (its
  *tail*, ``start > 0``), or a whole cache that does not split (``start == 0``:
  rotating windows, SSM, quantized or hybrid layers), which serves only queries it
  is a prefix of.

:func:`encode` makes a value, :func:`decode` checks one (header, key, scope, tokens
and, with ``check``, every tensor's checksum) into a :class:`Value`;
:func:`assemble` puts a cache together from the values of its blocks and tail:
their bytes are copied into host buffers that have the room the cache grows into,
which then become MLX arrays (one copy into the device's memory, whatever the device).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..cache import BaseCache, KVCache
from ..errors import CacheFormatError
from ..files.mlxcc_format import FORMAT_NAME, FORMAT_VERSION, load_header, prompt_cache_bytes
from ..files.registry import parse_tokens
from ..files.safetensors_file import NUMPY_DTYPES, Header, check_data, read_header_bytes


@dataclass(frozen=True)
class Value:
    """A checked value: its key, bytes, header, the tokens it holds and where they start."""

    key: str
    data: bytes
    header: Header
    tokens: list[int]
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def splittable(cache: Sequence[BaseCache], n: int) -> bool:
    """Whether ``cache`` splits into blocks: every layer a plain ``KVCache`` holding ``n`` tokens."""
    return n > 0 and bool(cache) and all(type(c) is KVCache and c.offset == n for c in cache)


def encode(scope, key: str, layers: Sequence[BaseCache], tokens: Sequence[int], start: int) -> bytes:
    """The value ``key`` of ``layers``, which hold ``tokens`` (from position ``start``), in ``scope``."""
    meta = {"store.key": key, "store.namespace": scope.namespace, "store.start": str(start)}
    return prompt_cache_bytes(layers, tokens=tokens, model=scope.fingerprint, settings=scope.settings, metadata=meta)


def cut(cache: Sequence[BaseCache], start: int, stop: int) -> list[BaseCache]:
    """The ``KVCache`` layers holding tokens ``start:stop`` of the splittable ``cache``."""
    return [KVCache.from_flat_state([a[:, :, start:stop] for a in c.flat_state()], (str(stop - start),))
            for c in cache]  # fmt: skip


def decode(key: str, data: bytes, scope, check: bool = True) -> Value:
    """The value ``key`` of ``scope`` in ``data``; CacheFormatError (a ChatCacheError) when it
    is damaged or is not that value (``check``: every tensor's bytes against its checksum
    too; without, ``data`` was made here). Only the header's store fields are read: a
    whole cache's layers are checked as a file's when it is loaded (:func:`whole`), a
    block's by :func:`assemble`."""
    header = read_header_bytes(data, f"store value {key}")
    meta, start = header.metadata, header.metadata.get("user.store.start", "")
    if (meta.get("user.store.key") != key or meta.get("user.store.namespace") != scope.namespace
            or meta.get("mlxcc.format") != FORMAT_NAME or meta.get("mlxcc.format_version") != str(FORMAT_VERSION)
            or not start.isdigit() or header.checksums is None):  # fmt: skip
        raise CacheFormatError(f"store value {key} is not that value of this store")
    tokens = parse_tokens(header.path, meta.get("mlxcc.tokens"))
    if tokens is None:
        raise CacheFormatError(f"store value {key} lists no tokens")
    header = check_data(header) if check else replace(header, checked=True)
    return Value(key, data, header, tokens, int(start))


def whole(value: Value, fingerprint) -> list[BaseCache]:
    """The layers of the whole-cache value ``value`` (read with room to grow)."""
    cache, _ = load_header(value.header, model=fingerprint)
    return cache


def assemble(values: Sequence[Value]) -> list[BaseCache]:
    """The cache the consecutive block values ``values`` (and a tail) hold together:
    ``KVCache`` layers of every token, in buffers with the room they grow into.
    CacheFormatError when a value does not hold such layers, alike."""
    n, first = values[-1].end, values[0]
    layers = _kv_layers(first)
    for v in values[1:]:
        if _kv_layers(v) != layers:
            raise CacheFormatError(f"store value {v.key} does not hold the layers of {first.key}")
    order = list(first.header.tensors)  # file order; every value's must be the same
    like = first.header.tensors[order[0]]
    dtype, (d0, d1, _, d3) = NUMPY_DTYPES[like.dtype], like.shape
    parts = []
    for v in values:
        t = v.end - v.start
        if list(v.header.tensors) != order or any(e.dtype != like.dtype or e.shape != (d0, d1, t, d3)
                                                 for e in v.header.tensors.values()):  # fmt: skip
            return _assemble_each(values, layers, n)  # layers of several shapes (or a foreign value)
        parts.append(np.frombuffer(v.data, dtype=dtype, count=len(order) * d0 * d1 * t * d3,
                                   offset=v.header.data_start).reshape(len(order), d0, d1, t, d3))  # fmt: skip
    buf = np.empty((len(order), d0, d1, KVCache.grown_slots(n), d3), dtype=dtype)  # every array, tokens on axis 3
    np.concatenate(parts, axis=3, out=buf[:, :, :, :n])
    buf[:, :, :, n:] = 0
    at = {name: i for i, name in enumerate(order)}
    return _layers([buf[at[f"layer.{i}.{j}"]] for i in range(layers) for j in (0, 1)], like.dtype, n)


def _assemble_each(values: Sequence[Value], layers: int, n: int) -> list[BaseCache]:
    """:func:`assemble` one array at a time, for layers whose arrays differ in shape or dtype."""
    first, slots, host = values[0], KVCache.grown_slots(n), []
    raw = [np.frombuffer(v.data, dtype=np.uint8, offset=v.header.data_start) for v in values]
    for name in [f"layer.{i}.{j}" for i in range(layers) for j in (0, 1)]:
        like = first.header.tensors[name]
        dtype, (d0, d1, _, d3) = NUMPY_DTYPES[like.dtype], like.shape
        parts = []
        for v, flat in zip(values, raw):
            t = v.header.tensors[name]
            if t.dtype != like.dtype or t.shape != (d0, d1, v.end - v.start, d3):
                raise CacheFormatError(f"store value {v.key}: tensor {name} does not fit the cache")
            parts.append(flat[t.begin : t.end].view(dtype).reshape(t.shape))
        buf = np.empty((d0, d1, slots, d3), dtype=dtype)
        np.concatenate(parts, axis=2, out=buf[:, :, :n])
        buf[:, :, n:] = 0
        host.append((buf, like.dtype))
    return _layers([b for b, _ in host], [d for _, d in host], n)


def _layers(host: list[np.ndarray], dtypes, n: int) -> list[BaseCache]:
    """``KVCache`` layers of ``n`` tokens holding the host arrays ``host`` (K, V, K, V, ...) as
    MLX arrays (``dtypes``: their safetensors dtype, or one for all)."""
    dtypes = [dtypes] * len(host) if isinstance(dtypes, str) else dtypes
    arrays = [mx.array(a).view(mx.bfloat16) if d == "BF16" else mx.array(a) for a, d in zip(host, dtypes)]
    mx.eval(arrays)
    return [KVCache.from_flat_state(arrays[2 * i : 2 * i + 2], (str(n),)) for i in range(len(arrays) // 2)]


def _kv_layers(v: Value) -> int:
    """How many ``KVCache`` layers of two 4-D arrays each ``v`` holds (CacheFormatError: other layers)."""
    meta, tensors = v.header.metadata, v.header.tensors
    n = meta.get("mlxcc.num_layers", "")
    layers = int(n) if n.isdigit() else 0
    names = {f"layer.{i}.{j}" for i in range(layers) for j in (0, 1)}
    if not layers or set(tensors) != names or any(len(t.shape) != 4 for t in tensors.values()) or any(
        meta.get(f"mlxcc.layer.{i}.class") != "KVCache" or meta.get(f"mlxcc.layer.{i}.arrays") != "2"
        for i in range(layers)
    ):  # fmt: skip
        raise CacheFormatError(f"store value {v.key} does not hold K/V layers")
    return layers


__all__ = ["Value", "assemble", "cut", "decode", "encode", "splittable", "whole"]
