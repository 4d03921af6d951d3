"""What every cache file says about itself, and the registry of file formats other than ours.

:class:`CacheFileInfo` is a file's validated self-description (everything but the arrays), whatever
its layout. A reader of another program's layout (today mlx-lm's, in :mod:`.mlxlm`) describes
itself as a :class:`ForeignFormat` and calls :func:`register_format` when imported; the package
``mlx_chatcache.files`` imports each such reader once. :mod:`.mlxcc_format` finds readers and writers only
here (:func:`detect`, :func:`reader_for`, :func:`writer_named`), so format modules never import each
other. :func:`parse_tokens`, :func:`parse_messages` and :func:`parse_settings` read the fields every
layout of ours records (JSON in the safetensors metadata).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CacheFormatError
from ..models.fingerprint import ModelFingerprint

MAX_TOKEN_ID = 2**31 - 1


@dataclass
class CacheFileInfo:
    """What a cache file says about itself (everything but the arrays)."""

    path: str
    format_version: int
    layout: str  # "mlxcc" | "mlx-lm" | "mlx-lm-legacy"
    classes: list[str]
    tokens: list[int] | None = None
    model: ModelFingerprint | None = None
    messages: list[dict] | None = None
    text: str | None = None  # raw text the cache holds (caches made without a chat template)
    settings: dict = field(default_factory=dict)  # how the cache was shaped (max_kv_size, keep, ...)
    metadata: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0
    slots: int = 0  # most token slots a (batch, heads, slots, dim) array stores: tokens + room
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int | None:
        return None if self.tokens is None else len(self.tokens)


@dataclass(frozen=True)
class ForeignFormat:
    """A cache file format we read and write besides our own.

    ``name`` is the ``format=`` value that saves in it; ``layouts`` the :attr:`CacheFileInfo.layout`
    values its ``detect`` returns. ``detect(header)`` is a :class:`CacheFileInfo` or None (not this
    format); ``load(header, arrays, info)`` the layers (our classes); ``save(path, cache, metadata)``
    writes atomically.
    """

    name: str
    layouts: tuple[str, ...]
    detect: Callable[..., CacheFileInfo | None]
    load: Callable[..., list]
    save: Callable[..., None]


_FORMATS: list[ForeignFormat] = []


def register_format(fmt: ForeignFormat) -> None:
    """Add ``fmt`` (registering the same name twice replaces the first)."""
    _FORMATS[:] = [f for f in _FORMATS if f.name != fmt.name] + [fmt]


def format_names() -> list[str]:
    return [f.name for f in _FORMATS]


def detect(header) -> CacheFileInfo | None:
    """The info of the first registered format that recognizes ``header``, else None."""
    for fmt in _FORMATS:
        info = fmt.detect(header)
        if info is not None:
            return info
    return None


def reader_for(layout: str) -> ForeignFormat | None:
    return next((f for f in _FORMATS if layout in f.layouts), None)


def writer_named(name: str) -> ForeignFormat | None:
    return next((f for f in _FORMATS if f.name == name), None)


# ------------------------------------------------------------------ recorded fields
# How every layout of ours records a cache's token ids, messages and settings (JSON strings in the
# safetensors metadata), read back into a CacheFileInfo's fields.
def parse_tokens(path, raw: str | None) -> list[int] | None:
    """The token ids recorded as JSON ``raw`` (None: none recorded); CacheFormatError if malformed."""
    if raw is None:
        return None
    try:
        tokens = json.loads(raw)
    except (ValueError, RecursionError):
        tokens = None
    if not isinstance(tokens, list) or not all(
        type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens
    ):
        raise CacheFormatError(f"{path}: token ids are not a list of non-negative integers; the file is damaged")
    return tokens


def parse_messages(path, raw: str | None) -> list[dict] | None:
    """The chat messages recorded as JSON ``raw`` (None: none recorded); CacheFormatError if malformed."""
    if raw is None:
        return None
    try:
        msgs = json.loads(raw)
    except (ValueError, RecursionError):
        msgs = None
    ok = isinstance(msgs, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in msgs
    )
    try:  # JSON escapes can smuggle in lone surrogates, which no file (nor tokenizer) can take
        ok = ok and bool(json.dumps(msgs, ensure_ascii=False).encode("utf-8"))
    except UnicodeEncodeError:
        ok = False
    if not ok:
        raise CacheFormatError(f"{path}: chat messages are malformed; the file is damaged")
    return msgs


def parse_settings(path, raw: str | None) -> dict:
    """The settings recorded as a JSON object ``raw`` ({} when none); CacheFormatError if malformed."""
    if raw is None:
        return {}
    try:
        settings = json.loads(raw)
    except (ValueError, RecursionError):
        settings = None
    if not isinstance(settings, dict):
        raise CacheFormatError(f"{path}: settings are not a JSON object; the file is damaged")
    return settings


__all__ = ["CacheFileInfo", "ForeignFormat", "register_format", "format_names", "detect", "reader_for", "writer_named",
           "MAX_TOKEN_ID", "parse_tokens", "parse_messages", "parse_settings"]
