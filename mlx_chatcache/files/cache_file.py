"""The one door to a cache file a user names: the rules every command and the
chat apply before they write one, and the one function that writes it.

:func:`claim` takes a path to write and, before any work is done (no model
loaded, no token generated), refuses with one line (:class:`CacheFileError` or
:class:`SessionError`):

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

The caller holds the :class:`Claim` for the duration of its work and writes
with :func:`write`, which refuses a claim that was released. A process holds
a file's lock once (``flock`` is per open file): code that writes a file its
caller holds (a chat's session, ``generate``'s rolling cache) is given the
claim, never the path. :func:`hold` locks a file a command only reads.

The write itself stays atomic (:mod:`mlx_chatcache.files.atomic`): a
reader always sees a whole file, so reading takes no lock.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CacheFileError, SessionError
from . import registry
from .atomic import check_writable
from .lock import SessionLock
from .safetensors_file import read_header

SESSION_KEY = "session"  # user metadata key holding a chat session's JSON
FORCE_HINT = "add --force to replace it, or choose another file name"


def is_session(info: registry.CacheFileInfo) -> bool:
    """Whether a cache file's header is a chat session's (messages and the session key)."""
    return info.messages is not None and SESSION_KEY in info.metadata


def cache_file_kind(path: str | os.PathLike) -> str | None:
    """``"mlxcc"`` or the registered format's layout (``"mlx-lm"``, ...) when
    ``path`` is a prompt cache file, else None (not a safetensors file,
    damaged, or a safetensors file of something else)."""
    from .mlxcc_format import FORMAT_NAME

    try:
        header = read_header(path)
    except CacheFileError:
        return None
    if header.metadata.get("mlxcc.format") == FORMAT_NAME:
        return "mlxcc"
    info = registry.detect(header)
    return None if info is None else info.layout


def check_overwrite(path: str | os.PathLike, force: bool = False, mine: bool = False,
                    shown: str | os.PathLike | None = None) -> None:
    """Refuse to replace an existing non-cache file, or another chat's session, at ``path``
    (unless ``force``; ``mine``: the session is the caller's own; ``shown``: the
    path as the user gave it, for the message)."""
    path = Path(path)
    name = path if shown is None else shown
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
        hint = "keep the session in another file" if mine else FORCE_HINT
        raise CacheFileError(f"refusing to overwrite {name}: it is {what}; {hint}")
    if not mine and kind == "mlxcc" and (turns := _session_turns(path)) is not None:
        raise CacheFileError(
            f"refusing to overwrite {name}: it is a chat session ({turns}); continue it with "
            f"'mlxcc chat --session-file {name}', or {FORCE_HINT}"
        )


def _session_turns(path: Path) -> str | None:
    """``"N turns"`` when ``path`` is a chat session, else None."""
    from .mlxcc_format import read_cache_info

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
    """A path a command will write (or read, :func:`hold`), checked and locked
    (see the module doc) until :meth:`release` (or the end of a ``with`` block).

    ``path`` is the path as given (messages show it); ``real`` is its real path
    (symlinks resolved), which the lock, the checks and :func:`write` use, so a
    symlink's target is written and the link stays.
    """

    def __init__(self, path: str | os.PathLike, lock: SessionLock, *, writes: bool = True):
        self.path = Path(path).expanduser()
        self.real = Path(os.path.realpath(self.path))
        self.lock = lock
        self.writes = writes
        self.active = True

    def covers(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` (any spelling, or a symlink) is the file this claim holds."""
        return Path(os.path.realpath(Path(path).expanduser())) == self.real

    def release(self) -> None:
        self.active = False
        self.lock.release()

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Claim({str(self.path)!r}{'' if self.active else ', released'})"


def claim(path: str | os.PathLike, *, force: bool = False, mine: bool = False, label: str | None = None,
          required: bool = False) -> Claim:
    """Check ``path`` and take its lock (module doc), before any work is done.

    ``force``: replace a file that is not a prompt cache, or a chat session (never
    one another process holds). ``mine``: the caller's own chat session, which it
    reads before it writes (a session there is replaced, a non-cache file is still
    refused). ``required``: fail when no lock file can be made (a chat's own
    session); otherwise a read-only folder holds none. ``label`` names the file in
    the lock's message."""
    path = Path(path).expanduser()
    real = Path(os.path.realpath(path))
    if required:  # a chat's session: its folder is ours to make (MLXCC_HOME/sessions)
        try:
            real.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # said in one line below
    _check_writable(path, real)
    lock = SessionLock(real, label or str(path)).acquire(required=required)
    try:
        check_overwrite(real, force, mine, shown=path)
    except (CacheFileError, SessionError):
        lock.release()
        raise
    return Claim(path, lock)


def hold(path: str | os.PathLike, label: str | None = None) -> Claim:
    """Take the lock of a cache file a command only reads (no checks): while it is held
    no chat can open it; refused when another process holds it. :func:`write` refuses it."""
    path = Path(path).expanduser()
    return Claim(path, SessionLock(path, label or str(path)).acquire(required=False), writes=False)


def write(target: Claim | str | os.PathLike, cache, *, tokens=None, model=None, messages=None, text=None,
          settings: dict | None = None, metadata: dict[str, str] | None = None, format: str = "mlxcc",
          force: bool = False, snapshots=()) -> None:
    """Write ``cache`` (a layer list; the other fields as
    :func:`~mlx_chatcache.files.mlxcc_format.save_prompt_cache` takes them) atomically
    to ``target``: a :class:`Claim` the caller holds, or a path, claimed (``force``)
    for the duration of the write. The one way a command writes a cache file."""
    from .mlxcc_format import save_prompt_cache

    if not isinstance(target, Claim):
        with claim(target, force=force) as c:
            return write(c, cache, tokens=tokens, model=model, messages=messages, text=text, settings=settings,
                         metadata=metadata, format=format, snapshots=snapshots)  # fmt: skip
    if not (target.active and target.writes):
        raise SessionError(f"{target.path} is not claimed for writing; claim it first (files.cache_file.claim)")
    save_prompt_cache(target.real, cache, tokens=tokens, model=model, messages=messages, text=text,
                      settings=settings, metadata=metadata, format=format, snapshots=snapshots)  # fmt: skip


def _check_writable(path: Path, real: Path) -> None:
    """``check_writable`` of the real path, with the path as given in its message."""
    try:
        check_writable(real)
    except CacheFileError as e:
        if real == path:
            raise
        raise CacheFileError(str(e).replace(str(real), str(path))) from None


__all__ = ["SESSION_KEY", "FORCE_HINT", "Claim", "claim", "hold", "write", "is_session", "cache_file_kind",
           "check_overwrite"]
