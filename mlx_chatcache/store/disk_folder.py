"""The disk tier's folder: which folder the store may use, and which of its
files are the store's own (the only files it ever deletes).

Contract
--------
- A *store folder* holds the marker file :data:`MARKER` (``.mlxcc-store``).
  :func:`claim_folder` makes a missing folder and marks it, marks an empty
  one, uses a marked one as it is, and *adopts* (marks) an unmarked folder
  whose every file is a store entry or a store temp file (a server's folder
  from before the marker existed). Anything else is refused with one
  :class:`~mlx_chatcache.errors.UsageError` line, and nothing in the folder is touched: a path
  that is not a folder, a folder that cannot be made, read or written, or an
  unmarked folder holding other files (model weights, saved sessions, ...).
- :func:`read_entry` is the store entry a file holds, or None when the file
  cannot be proved to be one. A store entry is a file in our layout that
  records ``store.namespace`` and its tokens, under the name
  :func:`entry_file_name` gives them. A *block entry* holds only its tail (the
  tokens after its last full block) and records its tokens in ``store.tokens``
  and its shared blocks in ``store.blocks`` (JSON ``[[chain hash, file bytes],
  ...]``); the blocks are files :func:`block_path` names, in the subfolder
  :data:`BLOCKS` (each in our format: checksummed). Without ``mlxcc.tokens``
  a reader that does not know block entries sees a foreign file, never deletes it. Files that are not (``foreign``) are
  never deleted, also in a marked folder (a user may save a session there).
- :func:`is_store_temp` names the temp files our atomic writes leave
  (``.NAME.*.tmp.safetensors``, see :mod:`mlx_chatcache.files.atomic`);
  the writer removes its own stale ones, the scan ignores them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

from ..config import default_cache_dir
from ..errors import ChatCacheError, UsageError
from ..files.atomic import TEMP_SUFFIX
from ..files.mlxcc_format import read_cache_info
from ..files.registry import CacheFileInfo
from .index import Entry

MARKER = ".mlxcc-store"
BLOCKS = "blocks"
_HASH = frozenset("0123456789abcdef")
_MARKER_TEXT = "mlxcc prompt-cache store folder: files named like entries are written and deleted by mlxcc\n"


def claim_folder(folder: str | os.PathLike) -> Path:
    """The store folder ``folder``, made or marked as the module doc says (or refused)."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"cache folder {folder} is a file, not a folder; give an empty or new folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        names = os.listdir(folder)
    except OSError as e:
        raise UsageError(f"cannot use cache folder {folder}: {_reason(e)}; give a folder you can write") from e
    if MARKER in names:
        return folder
    other = next((n for n in sorted(names)
                  if n != BLOCKS and not is_store_temp(n) and read_entry(folder / n) is None), None)  # fmt: skip
    if other is not None:
        raise UsageError(
            f"{folder} holds other files (such as {other}) and is not an mlxcc cache folder; "
            f"give an empty or new folder (the default for serve is {default_cache_dir()})"
        )
    try:
        (folder / MARKER).write_text(_MARKER_TEXT)
    except OSError as e:
        raise UsageError(f"cannot use cache folder {folder}: {_reason(e)}; give a folder you can write") from e
    return folder


def read_entry(path: Path, os_errors: bool = False) -> tuple[Entry, int] | None:
    """``(entry, mtime_ns)`` of the store entry in ``path``, or None (see the module doc);
    with ``os_errors``, a file that cannot be read (an OSError: gone, or an I/O error)
    raises it instead of being None."""
    if not path.name.endswith(".safetensors") or path.name.startswith("."):
        return None
    try:
        stat = path.stat()
        info = read_cache_info(path)
    except ChatCacheError:
        return None
    except OSError:
        if os_errors:
            raise
        return None
    entry = entry_of(info, path, stat.st_size)
    return None if entry is None else (entry, stat.st_mtime_ns)


def entry_of(info: CacheFileInfo, path: Path, size: int) -> Entry | None:
    """The store entry of the file ``path`` (``size`` bytes) whose header says ``info``, or None."""
    meta = info.metadata
    namespace = meta.get("store.namespace")
    tokens, blocks = info.tokens, ()
    if info.tokens is None and "store.blocks" in meta:
        tokens, blocks = _block_fields(meta)
    if info.layout != "mlxcc" or not namespace or tokens is None:
        return None
    if path.name != entry_file_name(namespace, tokens):
        return None
    key = meta.get("store.key") or None
    return Entry(namespace, tuple(tokens), size, meta.get("store.trimmable") == "1", key, path, blocks)


def block_fields(tokens: Sequence[int], blocks: Sequence[tuple[str, int]]) -> dict[str, str]:
    """The metadata of a block entry holding ``tokens`` and ``blocks`` (see the module doc)."""
    return {"store.tokens": json.dumps(list(tokens)), "store.blocks": json.dumps([list(b) for b in blocks])}


def _block_fields(meta: dict) -> tuple[list[int] | None, tuple[tuple[str, int], ...]]:
    try:
        tokens, blocks = json.loads(meta["store.tokens"]), json.loads(meta["store.blocks"])
        ok = all(type(t) is int for t in tokens) and all(
            type(h) is str and len(h) == 32 and set(h) <= _HASH and type(n) is int and n >= 0 for h, n in blocks
        )
    except (KeyError, TypeError, ValueError):
        return None, ()
    return (tokens, tuple((h, n) for h, n in blocks)) if ok else (None, ())


def is_block_entry(info: CacheFileInfo) -> bool:
    """Whether a file's header is a block entry's (its tokens in ``store.tokens``, not ``mlxcc.tokens``):
    a store entry, not a file that lists no token ids."""
    return info.tokens is None and "store.blocks" in info.metadata


def block_path(folder: Path, block: str) -> Path:
    """The file of shared block ``block`` (a chain hash) in store folder ``folder``."""
    return folder / BLOCKS / f"{block}.safetensors"


def is_block_name(name: str) -> bool:
    """Whether ``name`` is how :func:`block_path` names a block file."""
    stem = name[: -len(".safetensors")]
    return name.endswith(".safetensors") and len(stem) == 32 and set(stem) <= _HASH


def entry_file_name(namespace: str, tokens: Sequence[int]) -> str:
    digest = hashlib.sha256(json.dumps([namespace, list(tokens)]).encode()).hexdigest()[:40]
    return f"{namespace[:16]}-{digest}.safetensors"


def is_store_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


__all__ = ["BLOCKS", "MARKER", "block_fields", "block_path", "claim_folder", "read_entry", "entry_file_name", "entry_of",
           "is_block_entry", "is_block_name", "is_store_temp"]
