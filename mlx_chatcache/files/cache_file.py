"""The one door to a cache file a user names: the rules every command and the
chat apply before they write one.

:func:`claim` takes a path to write and, before any work is done, refuses with
one line (:class:`CacheFileError` or :class:`SessionError`):

- a path that cannot be written: its folder is missing, it is a folder, or a
  temp file cannot be created next to it (probed with the writer's own temp
  file, so read-only folders and ``/proc`` are caught before a model loads);
- a file another mlxcc process holds (an open chat session): the lock of the
  file's real path is taken (:mod:`mlx_chatcache.files.lock`), so a symlink or
  another spelling of the path shares it; ``force`` never overrides this;
- an existing file that is not a prompt cache (ours or mlx-lm's), e.g. a text
  file or a model's ``model.safetensors``, unless ``force``. Empty files hold
  nothing and may be replaced;
- an existing chat session, unless it is the caller's own (``mine``: the chat
  that holds it) or ``force``.

The write itself stays atomic (:mod:`mlx_chatcache.files.atomic_write`): a
reader always sees a whole file, so reading takes no lock.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CacheFileError, SessionError
from . import formats
from .atomic_write import check_writable
from .lock import SessionLock
from .safetensors_file import read_header

SESSION_KEY = "session"  # user metadata key holding a chat session's JSON
FORCE_HINT = "add --force to replace it, or choose another file name"


def is_session(info: formats.CacheFileInfo) -> bool:
    """Whether a cache file's header is a chat session's (messages and the session key)."""
    return info.messages is not None and SESSION_KEY in info.metadata


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


def check_overwrite(path: str | os.PathLike, force: bool = False, mine: bool = False) -> None:
    """Refuse to replace an existing non-cache file, or another chat's session, at ``path``
    (unless ``force``; ``mine``: the session is the caller's own)."""
    path = Path(path)
    if force or not path.exists() or path.is_dir():
        return
    try:
        if path.stat().st_size == 0:
            return
    except OSError:
        return
    kind = cache_file_kind(path)
    if kind is None:
        what = "a safetensors file without prompt cache metadata (model weights?)" if _is_safetensors(path) \
            else "not a prompt cache file"  # fmt: skip
        raise CacheFileError(f"refusing to overwrite {path}: it is {what}; {FORCE_HINT}")
    if not mine and kind == "mlxcc" and _session_turns(path) is not None:
        raise CacheFileError(
            f"refusing to overwrite {path}: it is a chat session ({_session_turns(path)}); continue it with "
            f"'mlxcc chat --session-file {path}', or {FORCE_HINT}"
        )


def _session_turns(path: Path) -> str | None:
    """``"N turns"`` when ``path`` is a chat session, else None."""
    from .cache_io import read_cache_info

    try:
        info = read_cache_info(path)
    except CacheFileError:
        return None
    if not is_session(info):
        return None
    n = sum(1 for m in info.messages if isinstance(m, dict) and m.get("role") == "user")
    return f"{n} turn" + ("" if n == 1 else "s")


def _is_safetensors(path: Path) -> bool:
    try:
        read_header(path)
    except CacheFileError:
        return False
    return True


class Claim:
    """A path a command will write, checked and locked (see the module doc) until
    :meth:`release` (or the end of a ``with`` block)."""

    def __init__(self, path: str | os.PathLike, lock: SessionLock):
        self.path = Path(path).expanduser()
        self.lock = lock

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_target(path: str | os.PathLike, force: bool = False, mine: bool = False) -> None:
    """The checks of :func:`claim` without the lock: ``path`` can be written and may be replaced."""
    check_writable(path)
    check_overwrite(path, force, mine)


def claim(path: str | os.PathLike, *, force: bool = False, mine: bool = False, label: str | None = None,
          required: bool = False) -> Claim:
    """Check ``path`` and take its lock (module doc). ``required``: fail when no lock
    file can be made (a chat's own session); otherwise a read-only folder holds none."""
    path = Path(path).expanduser()
    check_writable(path)
    lock = SessionLock(path, label or str(path)).acquire(required=required)
    try:
        check_overwrite(path, force, mine)
    except (CacheFileError, SessionError):
        lock.release()
        raise
    return Claim(path, lock)


__all__ = ["SESSION_KEY", "FORCE_HINT", "Claim", "claim", "check_target", "is_session", "cache_file_kind", "check_overwrite"]
