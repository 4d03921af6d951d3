"""Where a command may save a cache file, checked before any work is done.

:func:`check_save_target` refuses, with one :class:`CacheFileError` line each:

- a path that cannot be written: its folder is missing, it is a folder, or a
  temp file cannot be created next to it (probed with the writer's own temp
  file, so read-only folders, ``/proc`` and full inode tables are caught
  before a model is loaded or a token generated);
- an existing file that is not a prompt cache (ours or mlx-lm's), e.g. a
  text file or a model's ``model.safetensors``, unless ``force``. Empty files
  hold nothing and may be replaced.

The save itself stays atomic (:mod:`mlx_chatcache.files.atomic_write`); these
checks only make a mistake cost nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CacheFileError
from . import formats
from .atomic_write import check_writable
from .safetensors_file import read_header

FORCE_HINT = "add --force to replace it, or choose another file name"


def cache_file_kind(path: str | os.PathLike) -> str | None:
    """``"mlxcc"`` or the registered format's layout (``"mlx-lm"``, ...) when
    ``path`` is a prompt cache file, else None (not a safetensors file,
    damaged, or a safetensors file of something else)."""
    from .cache_io import FORMAT_NAME

    try:
        header = read_header(path)
    except CacheFileError:
        return None
    if header.metadata.get("mlxcc.format") == FORMAT_NAME:
        return "mlxcc"
    info = formats.detect(header)
    return None if info is None else info.layout


def check_overwrite(path: str | os.PathLike, force: bool = False) -> None:
    """Refuse to replace an existing non-cache file at ``path`` (unless ``force``)."""
    path = Path(path)
    if force or not path.exists() or path.is_dir():
        return
    try:
        if path.stat().st_size == 0:
            return
    except OSError:
        return
    if cache_file_kind(path) is None:
        what = "a safetensors file without prompt cache metadata (model weights?)" if _is_safetensors(path) \
            else "not a prompt cache file"  # fmt: skip
        raise CacheFileError(f"refusing to overwrite {path}: it is {what}; {FORCE_HINT}")


def _is_safetensors(path: Path) -> bool:
    try:
        read_header(path)
    except CacheFileError:
        return False
    return True


def check_save_target(path: str | os.PathLike, force: bool = False) -> None:
    """Both checks of the module doc: ``path`` can be written and may be replaced."""
    check_writable(path)
    check_overwrite(path, force)


__all__ = ["check_save_target", "check_overwrite", "cache_file_kind", "FORCE_HINT"]
