"""The checks a cache file the user named passes before its cache is used
(``mlxcc generate --prompt-cache-file``, ``mlxcc chat --prompt-cache-file``, a
chat session), from its header alone: no MLX is imported, so they run before a
model loads.

The user named the file, so a file that cannot serve is an error, never a
silent miss. :func:`check_named_file` refuses, in one line each, a file made by
another model (:class:`~mlx_chatcache.errors.ModelMismatchError`, ``what``
names the file kind in it), one that lists no token ids (mlx-lm's:
:class:`~mlx_chatcache.errors.CacheFormatError`; the generate command uses those
as :mod:`mlx_chatcache.generation.untokenized` says) and one made with other
cache settings than a run asks (:class:`~mlx_chatcache.errors.UsageError`).
:func:`recorded_shape` is what a file says about those settings: what it
records and, for an older file that does not record its KV quantization, what
its quantized layers show. Missing and damaged files are refused where the
header or the layers are read (:mod:`.mlxcc_format`).
:meth:`~mlx_chatcache.files.prompt_cache.PromptCache.load` applies these
checks, then reads and checks the layers.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from ..config import CacheShape, shape_differences, shape_settings
from ..errors import CacheFormatError, UsageError
from .registry import CacheFileInfo

if TYPE_CHECKING:
    from ..models.fingerprint import ModelFingerprint


def check_named_file(info: CacheFileInfo, path: str | os.PathLike, *, fingerprint: ModelFingerprint | None = None,
                     shape: CacheShape | None = None, what: str = "cache file") -> None:  # fmt: skip
    """Refuse the file at ``path`` whose header is ``info`` (module doc): made by
    another model than ``fingerprint`` (None: not checked), listing no token ids,
    or recorded with cache settings that differ from ``shape``'s (None: not checked)."""
    if fingerprint is not None:
        fingerprint.check(info.model, what=what)
    if info.tokens is None:
        raise CacheFormatError(
            f"{path} does not say which tokens it holds (written by {info.layout}); "
            "rebuild it with 'mlxcc cache-prompt'"
        )
    if shape is None:
        return
    theirs, ours = recorded_shape(info), shape.settings()
    differ = shape_differences(theirs, ours)
    if differ:
        made = ", ".join(f"{k}={theirs[k]}" for k in differ)
        asked = ", ".join(f"{k}={ours[k]}" for k in differ)
        raise UsageError(
            f"{path} was made with {made} but {asked} was asked; use the same settings "
            "(or leave them out: the file's are used) or another file"
        )


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


__all__ = ["check_named_file", "recorded_shape"]
