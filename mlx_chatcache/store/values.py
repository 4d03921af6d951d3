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

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..cache import BaseCache, KVCache
from ..errors import CacheFormatError
from ..files.mlxcc_format import info_from_header, load_prompt_cache_bytes, prompt_cache_bytes
from ..files.registry import CacheFileInfo
from ..files.safetensors_file import NUMPY_DTYPES, Header, check_data, read_header_bytes


@dataclass(frozen=True)
class Value:
    """A checked value: its key, bytes, header, what it says, and its token range."""

    key: str
    data: bytes
    header: Header
    info: CacheFileInfo
    start: int

    @property
    def tokens(self) -> list[int]:
        return self.info.tokens

    @property
    def end(self) -> int:
        return self.start + len(self.info.tokens)


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
    """The value ``key`` of ``scope`` in ``data``; ChatCacheError when it is damaged or
    is not that value (``check``: every tensor's bytes against its checksum too)."""
    header = read_header_bytes(data, f"store value {key}")
    info = info_from_header(header)
    meta = info.metadata
    start = meta.get("store.start", "")
    if (meta.get("store.key") != key or meta.get("store.namespace") != scope.namespace or info.layout != "mlxcc"
            or info.tokens is None or not start.isdigit() or header.checksums is None):  # fmt: skip
        raise CacheFormatError(f"store value {key} is not that value of this store")
    if check:
        check_data(header)
    return Value(key, data, header, info, int(start))


def whole(value: Value, fingerprint) -> list[BaseCache]:
    """The layers of the whole-cache value ``value`` (read with room to grow)."""
    cache, _ = load_prompt_cache_bytes(value.data, f"store value {value.key}", model=fingerprint)
    return cache


def assemble(values: Sequence[Value]) -> list[BaseCache]:
    """The cache the consecutive block values ``values`` (and a tail) hold together:
    ``KVCache`` layers of every token, in buffers with the room they grow into."""
    n = values[-1].end
    first = values[0]
    layers = first.info.extra["layers"]
    names = [f"layer.{i}.{j}" for i, (_, count) in enumerate(layers) for j in range(count)]
    for v in values:  # checked values of one scope: a layout that differs is a foreign value
        if v.info.classes != first.info.classes or [c for _, c in v.info.extra["layers"]] != [c for _, c in layers]:
            raise CacheFormatError(f"store value {v.key} does not hold the layers of {first.key}")
    slots = KVCache.grown_slots(n)
    arrays, at = [], 0
    for name in names:
        t = first.header.tensors[name]
        parts = [_tensor(v, name, t) for v in values]
        buf = np.empty((*t.shape[:2], slots, t.shape[3]), dtype=parts[0].dtype)
        np.concatenate(parts, axis=2, out=buf[:, :, :n])
        buf[:, :, n:] = 0
        a = mx.array(buf)
        arrays.append(a.view(mx.bfloat16) if t.dtype == "BF16" else a)
    mx.eval(arrays)
    out = []
    for _, count in layers:
        out.append(KVCache.from_flat_state(arrays[at : at + count], (str(n),)))
        at += count
    return out


def _tensor(v: Value, name: str, like) -> np.ndarray:
    """Tensor ``name`` of ``v`` (a view of its bytes), checked to be ``like``'s but for its tokens."""
    t = v.header.tensors.get(name)
    if t is None or t.dtype != like.dtype or len(t.shape) != 4 or t.shape[2] != v.end - v.start \
            or t.shape[:2] != like.shape[:2] or t.shape[3] != like.shape[3]:  # fmt: skip
        raise CacheFormatError(f"store value {v.key}: tensor {name} does not fit the cache")
    host = np.frombuffer(v.data, dtype=NUMPY_DTYPES[t.dtype], count=int(np.prod(t.shape)),
                         offset=v.header.data_start + t.begin)  # fmt: skip
    return host.reshape(t.shape)


__all__ = ["Value", "assemble", "cut", "decode", "encode", "splittable", "whole"]
