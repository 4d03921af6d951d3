"""Whole-file operations on cache files: convert between our layout and
mlx-lm's, trim, and compare two files.

- :func:`convert_cache_file` rewrites a file (ours or mlx-lm's) in the other
  layout. ``to="mlx-lm"`` writes with mlx-lm's own writer (what
  ``mlx_lm.generate --prompt-cache-file`` loads) plus mlx-lm's ``model`` /
  ``tokenizer_config`` metadata and, in keys mlx-lm ignores, the token ids,
  messages and fingerprint, so converting back loses nothing.
- :func:`trim_cache_file` keeps the first ``keep`` tokens (``mlxcc cache trim
  FILE N``; ``--drop N`` removes the last N like mlx-lm's ``trim_prompt_cache``).
  Layers that cannot drop tokens (recurrent state, a rotating window that has
  wrapped) are refused. A trimmed chat keeps its token ids but not its
  messages (they no longer match): a later ``generate`` reuses the common
  prefix. (``mlxcc cache trim`` refuses chat session files: ``/undo`` does that in a chat.)
- :func:`diff_cache_files` compares two headers (no arrays read).

Every write goes through the door (:func:`~mlx_chatcache.files.cache_file.write`,
atomic: temp file + rename) to ``dst``: the
:class:`~mlx_chatcache.files.cache_file.Claim` the caller holds, or a path
claimed for the write (a file that is not a cache, a chat session and a file
another process holds are refused).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import UnsupportedCacheError, UsageError
from . import cache_file
from .mlxcc_format import CacheFileInfo, load_cache_file, read_cache_info
from .mlxlm import recorded_metadata
from .tokens import common_prefix_len

FORMATS = ("mlx-lm", "mlxcc")


def _save(dst: cache_file.Claim | str | os.PathLike, cache, info: CacheFileInfo, fmt: str) -> None:
    if fmt == "mlx-lm":
        meta = dict(info.metadata)
        meta.setdefault("model", _loadable(info.model.model_id) if info.model else "")
        meta.setdefault("tokenizer_config", "{}")
        meta.update(recorded_metadata(info))
        cache_file.write(dst, cache, metadata=meta, format="mlx-lm")
        return
    cache_file.write(dst, cache, tokens=info.tokens, model=info.model, messages=info.messages,
                     text=info.text, settings=info.settings, metadata=info.metadata)  # fmt: skip


def _loadable(model_id: str) -> str:
    """What mlx-lm loads the model from: a local folder made absolute (a hub id as is)."""
    return os.path.abspath(model_id) if model_id and os.path.isdir(model_id) else model_id


def _layout_format(info: CacheFileInfo) -> str:
    return "mlxcc" if info.layout == "mlxcc" else "mlx-lm"


def convert_cache_file(src, dst, to: str) -> CacheFileInfo:
    """Write the cache in ``src`` to ``dst`` in layout ``to`` ("mlx-lm" or "mlxcc")."""
    if to not in FORMATS:
        raise UsageError(f"unknown cache format {to!r}; use one of {', '.join(FORMATS)}")
    cache, info = load_cache_file(src)
    _save(dst, cache, info, to)
    return info


def trim_cache_file(src, dst, n: int, drop: bool = False) -> tuple[int, int]:
    """Keep the first ``n`` tokens of ``src``'s cache (``drop``: all but the last
    ``n``) and write it to ``dst`` (may equal ``src``) in the same layout;
    returns (tokens before, tokens after). A chat session's record (its bookkeeping
    of the conversation) does not hold for fewer tokens: the copy is a prompt cache."""
    from ..cache import can_trim_prompt_cache, cache_offset, trim_prompt_cache  # imports mlx-lm

    cache, info = load_cache_file(src)
    held = cache_offset(cache)
    if n > held:
        raise UsageError(f"{src} holds {held} tokens; cannot {'drop' if drop else 'keep'} {n}")
    keep = held - n if drop else n
    if keep < held:
        if not can_trim_prompt_cache(cache):
            bad = next(i for i, c in enumerate(cache) if not c.is_trimmable())
            why = ("keeps a recurrent state, not one entry per token" if type(cache[bad]).__name__ == "ArraysCache"
                   else "is a rotating window that has dropped tokens already")  # fmt: skip
            raise UnsupportedCacheError(f"{src} cannot be trimmed: layer {bad} ({type(cache[bad]).__name__}) {why}; "
                                        "rebuild the cache from the shorter prompt instead")  # fmt: skip
        trim_prompt_cache(cache, held - keep)
        if cache_offset(cache) != keep:
            raise UnsupportedCacheError(f"{src} cannot be trimmed to {keep} tokens; rebuild the cache instead")
        if info.tokens is not None:
            info.tokens = info.tokens[:keep]
        if info.messages is not None:
            info.messages = []  # the kept tokens no longer end at a message boundary
        if info.text is not None:
            info.text = ""
        info.metadata = {k: v for k, v in info.metadata.items() if k != cache_file.SESSION_KEY}
    _save(dst, cache, info, _layout_format(info))
    return held, keep


@dataclass
class CacheDiff:
    a: CacheFileInfo
    b: CacheFileInfo
    same_model: bool | None  # None: a file does not say
    common_prefix: int | None  # None: a file holds no token ids
    layer_differences: list[str] = field(default_factory=list)
    setting_differences: list[str] = field(default_factory=list)

    @property
    def diverge_at(self) -> int | None:
        """First token index where both hold a token and they differ."""
        n = self.common_prefix
        if n is None or n >= min(len(self.a.tokens), len(self.b.tokens)):
            return None
        return n


def _layer_settings(info: CacheFileInfo, i: int) -> tuple[str, ...] | None:
    layers = info.extra.get("layers")
    if not layers:
        return None
    return tuple(layers[i][0])[1:]  # meta state without the offset (token counts are compared apart)


def diff_cache_files(path_a, path_b) -> CacheDiff:
    a, b = read_cache_info(path_a), read_cache_info(path_b)
    same = a.model.matches(b.model) if a.model and b.model else None
    known = a.tokens is not None and b.tokens is not None
    prefix = common_prefix_len(a.tokens, b.tokens) if known else None
    d = CacheDiff(a, b, same, prefix)
    if len(a.classes) != len(b.classes):
        d.layer_differences.append(f"{len(a.classes)} layers vs {len(b.classes)}")
    for i, (ca, cb) in enumerate(zip(a.classes, b.classes)):
        if ca != cb:
            d.layer_differences.append(f"layer {i}: {ca} vs {cb}")
        elif (sa := _layer_settings(a, i)) != (sb := _layer_settings(b, i)) and None not in (sa, sb):
            d.layer_differences.append(f"layer {i} ({ca}): settings {list(sa)} vs {list(sb)}")
    for k in sorted(set(a.settings) | set(b.settings)):
        if a.settings.get(k) != b.settings.get(k):
            d.setting_differences.append(f"{k}: {a.settings.get(k)} vs {b.settings.get(k)}")
    return d


__all__ = ["convert_cache_file", "trim_cache_file", "diff_cache_files", "CacheDiff", "FORMATS"]
