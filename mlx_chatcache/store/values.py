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

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Callable, Sequence, TypeVar

import mlx.core as mx
import numpy as np

from ..cache import BaseCache, KVCache
from ..errors import CacheFormatError
from ..files.mlxcc_format import FORMAT_NAME, FORMAT_VERSION, load_header, prompt_cache_bytes
from ..files.registry import parse_tokens
from ..files.safetensors_file import NUMPY_DTYPES, Header, check_data, read_header_bytes


T, R = TypeVar("T"), TypeVar("R")
_THREADS = min(os.cpu_count() or 1, 4)  # threads reading and checking values
_pools: dict[int, ThreadPoolExecutor] = {}  # per process (a forked child has none of its parent's threads)


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

    @cached_property
    def kv(self) -> list[np.ndarray]:
        """Its ``KVCache`` layers' arrays (keys, values, keys, ...), views of its bytes shaped
        ``(d0, d1, tokens, d3)``; CacheFormatError when it holds other layers."""
        meta, tensors = self.header.metadata, self.header.tensors
        n = meta.get("mlxcc.num_layers", "")
        names, required = _kv_layout(int(n) if n.isdigit() else 0)
        entries = [tensors[name] for name in names] if names and tensors.keys() == set(names) else []
        first = entries[0] if entries and required.items() <= meta.items() else None
        bad = CacheFormatError(f"store value {self.key} does not hold K/V layers of its tokens")
        if first is None or len(first.shape) != 4 or first.shape[2] != len(self.tokens):
            raise bad
        flat = np.frombuffer(self.data, dtype=np.uint8, offset=self.header.data_start)
        size = first.end - first.begin
        if size and all(t.dtype == first.dtype and t.shape == first.shape for t in entries):
            # arrays of one shape filling the data section (the usual case): one view, indexed
            arrays = flat[: len(entries) * size].view(NUMPY_DTYPES[first.dtype]).reshape(len(entries), *first.shape)
            return [arrays[t.begin // size] for t in entries]
        if any(len(t.shape) != 4 or t.shape[2] != len(self.tokens) for t in entries):
            raise bad
        return [flat[t.begin : t.end].view(NUMPY_DTYPES[t.dtype]).reshape(t.shape) for t in entries]


@lru_cache(maxsize=16)
def _kv_layout(layers: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """The tensor names of ``layers`` ``KVCache`` layers (keys, values, keys, ...) and the
    metadata their header holds for them."""
    names = tuple(f"layer.{i}.{j}" for i in range(layers) for j in (0, 1))
    required = {f"mlxcc.layer.{i}.{k}": v for i in range(layers) for k, v in (("class", "KVCache"), ("arrays", "2"))}
    return names, required


def in_parallel(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]``, over a few threads when there are several: reading a
    value's bytes and checking them free the GIL."""
    if len(items) < 2 or _THREADS < 2:
        return [fn(x) for x in items]
    pool = _pools.get(os.getpid())
    if pool is None:
        pool = _pools[os.getpid()] = ThreadPoolExecutor(_THREADS, thread_name_prefix="mlxcc-store")
    return list(pool.map(fn, items))


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
    ``KVCache`` layers of every token, in buffers with the room they grow into (each
    array's host buffer filled from views of the values' bytes, then copied into MLX).
    CacheFormatError when a value does not hold such layers, alike."""
    n, first = values[-1].end, values[0]
    views = [v.kv for v in values]
    if any(len(vs) != len(views[0]) for vs in views):
        raise CacheFormatError(f"store values of {first.key} do not hold the same layers")
    slots, arrays = KVCache.grown_slots(n), []
    for k in range(len(views[0])):  # one host buffer at a time: it becomes an MLX array at once
        parts = [vs[k] for vs in views]
        (d0, d1, _, d3), dtype = parts[0].shape, parts[0].dtype
        if any(p.dtype != dtype or p.shape[:2] != (d0, d1) or p.shape[3] != d3 for p in parts):
            raise CacheFormatError(f"store values of {first.key}: their arrays {k} do not fit together")
        buf = np.empty((d0, d1, slots, d3), dtype=dtype)
        np.concatenate(parts, axis=2, out=buf[:, :, :n])
        buf[:, :, n:] = 0
        a = mx.array(buf)
        arrays.append(a.view(mx.bfloat16) if first.header.tensors[f"layer.{k // 2}.{k % 2}"].dtype == "BF16" else a)
    mx.eval(arrays)
    return [KVCache.from_flat_state(arrays[i : i + 2], (str(n),)) for i in range(0, len(arrays), 2)]


__all__ = ["Value", "assemble", "cut", "decode", "encode", "in_parallel", "splittable", "whole"]
