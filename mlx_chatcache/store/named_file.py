"""A store tier over one cache file the user named (``mlxcc generate
--prompt-cache-file/--save-prompt-cache``, a chat session file).

Contract
--------
``CacheFileTier(read_path, write_path, what)`` implements the :class:`~.tiers.Tier`
contract for at most one entry: the file at ``read_path`` (None: nothing to
read). It differs from the anonymous tiers (memory, disk, Redis) in three ways:

- **strict**: the user named this file, so a file that cannot serve is an error,
  never a silent miss. :meth:`find` raises, in one line each, for a missing or
  damaged file (:class:`~mlx_chatcache.errors.CacheFileError` /
  :class:`~mlx_chatcache.errors.CacheFormatError`), a file made by another model
  (:class:`~mlx_chatcache.errors.ModelMismatchError`, ``what`` names the file
  kind in it), one that lists no token ids (mlx-lm's: the caller handles those,
  see :mod:`mlx_chatcache.generation.untokenized`) and one made with other
  cache settings (``max_kv_size``/``keep`` and the KV quantization, which every
  file mlxcc writes records; for an older file that does not,
  :func:`recorded_shape` reads ``kv_bits``/``kv_group_size`` off its quantized
  layers; :class:`~mlx_chatcache.errors.UsageError`);
  :meth:`fetch` raises for layers the model does not make;
- **never evicted** and without a byte budget; :meth:`add` always (re)writes
  ``write_path`` (None: nothing is written) through the door
  (:func:`mlx_chatcache.files.cache_file.write`), atomically, also for an empty
  cache (a chat that was cleared). ``write_path`` is the
  :class:`~mlx_chatcache.files.cache_file.Claim` the caller holds, or a path
  claimed for each write;
- **carries the file's contents**: :meth:`add` takes the
  :class:`~mlx_chatcache.files.prompt_cache.PromptCache` being stored (the chat
  messages or raw text its tokens are, the settings the file records and user
  metadata, e.g. a chat session's record), which
  :meth:`~.store.PromptStore.put` passes to named tiers only.

:meth:`find` reads only the header (the token ids) as long as the file's
tokens are all a prefix of the query; when only part of them is, it loads the
layers to learn whether they can be trimmed back (kept for :meth:`fetch`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..cache import BaseCache, can_trim_prompt_cache
from ..config import shape_differences, shape_settings
from ..errors import CacheFileError, CacheFormatError, UsageError
from ..files import cache_file
from ..files.mlxcc_format import check_cache_fits_model, load_cache_file, read_cache_info
from ..files.registry import CacheFileInfo
from ..files.tokens import common_prefix_len
from .index import Entry
from .tiers import Scope, Tier

if TYPE_CHECKING:
    from ..files.prompt_cache import PromptCache


class CacheFileTier(Tier):
    name = "file"
    named = True

    def __init__(self, read_path: str | os.PathLike | None,
                 write_path: cache_file.Claim | str | os.PathLike | None = None,
                 what: str = "cache file", header: CacheFileInfo | None = None):  # fmt: skip
        """``write_path``: the claim of the file to write (or a path, claimed per write);
        ``header``: ``read_path``'s header as the caller just read it (not read again;
        the layers' token ids are checked against it when they are loaded)."""
        super().__init__(0)
        self.read_path = None if read_path is None else Path(read_path)
        self._target = write_path if write_path is None or isinstance(write_path, cache_file.Claim) \
            else Path(write_path)  # fmt: skip
        self.write_path = self._target.path if isinstance(self._target, cache_file.Claim) else self._target
        self.what = what
        self._info: tuple[tuple, CacheFileInfo] | None = None  # (file identity, header)
        if header is not None and self.read_path is not None:
            self._info = (_identity(self.read_path), header)
        self._loaded: tuple[tuple, list[BaseCache]] | None = None  # layers read by find, for fetch

    # ------------------------------------------------------------------ reading
    def info(self) -> CacheFileInfo | None:
        """The header of ``read_path`` (None when there is none), read again when the file changed."""
        if self.read_path is None:
            return None
        ident = _identity(self.read_path)
        if self._info is None or self._info[0] != ident:
            self._info = (ident, read_cache_info(self.read_path))
            self._loaded = None
        return self._info[1]

    def find(self, scope, query, key):
        info = self.info()
        if info is None:
            return None
        self._check(info, scope)
        tokens = tuple(info.tokens)
        n = common_prefix_len(tokens, query)
        if n == 0:
            return None
        trimmable = n == len(tokens) or can_trim_prompt_cache(self._layers(scope))
        if not trimmable:
            return None
        return Entry(scope.namespace, tokens, info.nbytes, True, None, self.read_path), n

    def _check(self, info: CacheFileInfo, scope: Scope) -> None:
        path = self.read_path
        if scope.fingerprint is not None:
            scope.fingerprint.check(info.model, what=self.what)
        if info.tokens is None:
            raise CacheFormatError(
                f"{path} does not say which tokens it holds (written by {info.layout}); "
                "rebuild it with 'mlxcc cache-prompt'"
            )
        theirs, ours = recorded_shape(info), scope.settings
        differ = shape_differences(theirs, ours)
        if differ:
            made = ", ".join(f"{k}={theirs[k]}" for k in differ)
            asked = ", ".join(f"{k}={ours[k]}" for k in differ)
            raise UsageError(
                f"{path} was made with {made} but {asked} was asked; use the same settings "
                "(or leave them out: the file's are used) or another file"
            )

    def _layers(self, scope: Scope) -> list[BaseCache]:
        ident = self._info[0]
        if self._loaded is None or self._loaded[0] != ident:
            cache, info = load_cache_file(self.read_path, model=scope.fingerprint,
                                            what=self.what)  # fmt: skip
            if info.tokens != self._info[1].tokens:
                raise CacheFileError(f"{self.read_path} changed while it was read; run the command again")
            self._loaded = (ident, cache)
        return self._loaded[1]

    def fetch(self, entry, scope, expected):
        cache = self._layers(scope)
        self._loaded = None  # the caller owns these layers now
        check_cache_fits_model(cache, expected, self.read_path)
        self._hit(entry)
        return cache

    def _hit(self, entry: Entry) -> None:
        self.counters["hits"] += 1
        self.counters["hit_tokens"] += len(entry.tokens)

    # ------------------------------------------------------------------ writing
    def add(self, scope, tokens, cache, key, prompt: PromptCache | None = None):
        """Write ``cache`` (holding ``tokens``) with what ``prompt`` says its tokens are,
        its settings, metadata and snapshots (None: nothing but the layers and token ids)."""
        if self.write_path is None:
            return False
        messages, text = (None, None) if prompt is None else (prompt.messages, prompt.text)
        settings, metadata = ({}, {}) if prompt is None else (prompt.settings, prompt.metadata)
        cache_file.write(self._target, cache, tokens=list(tokens), model=scope.fingerprint,
                         messages=messages, text=text, settings=settings, metadata=metadata,
                         snapshots=() if prompt is None else prompt.snapshots)  # fmt: skip
        self.counters["added"] += 1
        return True

    def stats(self) -> dict:
        return {"read": str(self.read_path) if self.read_path else None,
                "write": str(self.write_path) if self.write_path else None, **self.counters}  # fmt: skip


def recorded_shape(info: CacheFileInfo) -> dict:
    """The settings that shaped the cache of the file ``info`` describes: those it
    records and, for a file that does not record ``kv_bits`` (written before it
    was), the KV quantization its quantized layers show (a float file leaves it open);
    a file that does not record ``kv_dtype`` held its K/V as computed: "auto"."""
    shape = shape_settings(info.settings)
    shape.setdefault("kv_dtype", "auto")  # a file from before kv_dtype holds K/V as they were computed
    if "kv_bits" not in shape:
        found = _header_quantization(info)
        if found is not None:
            shape["kv_bits"], shape["kv_group_size"] = found
    return shape


def _header_quantization(info: CacheFileInfo) -> tuple[int, int] | None:
    """``(bits, group_size)`` of the first quantized layer the header lists (our layout), or None."""

    def of(name: str, meta) -> tuple[int, int] | None:
        try:
            if name == "QuantizedKVCache":  # offset, group_size, bits
                return int(meta[2]), int(meta[1])
            if name == "QuantizedRotatingKVCache":  # offset, max_size, keep, group_size, bits[, ring_idx]
                return int(meta[4]), int(meta[3])
            if name == "CacheList":  # n, then (class, JSON meta, array count) per child
                kids = [(meta[1 + 3 * j], json.loads(meta[2 + 3 * j])) for j in range(int(meta[0]))]
                return next((q for q in (of(*k) for k in kids) if q is not None), None)
        except (IndexError, ValueError, TypeError):
            return None  # a damaged header: loading the layers says so
        return None

    layers = info.extra.get("layers") or []
    return next((q for q in (of(n, m) for n, (m, _) in zip(info.classes, layers)) if q is not None), None)


def _identity(path: Path) -> tuple:
    try:
        st = path.stat()
    except OSError:
        return ()
    return (st.st_ino, st.st_size, st.st_mtime_ns)


__all__ = ["CacheFileTier", "recorded_shape"]
