"""The lock that lets one mlxcc process at a time hold a cache file (a chat session).

:class:`SessionLock` is an exclusive, non-blocking ``flock`` on a lock file next
to the cache file (``NAME.lock`` for ``NAME.safetensors``), dropped by the OS
when the process dies. The lock file is the one of the file's real path
(symlinks resolved), so every spelling of a path, and every link to it, shares
one lock. The lock file is removed when the lock is released, and a holder
checks that the file it locked is still the one at that path (so a file removed
meanwhile never yields a second holder); ones left by killed processes are
removed by :func:`remove_stale_lock`. The lock file says which process holds it
and what it runs (``PID mlxcc COMMAND``), so a refusal names the right remedy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import SessionError

CACHE_SUFFIX = ".safetensors"


def lock_path_for(path: str | os.PathLike) -> Path:
    """The lock file of ``path``: next to its real path (symlinks and ``..`` resolved)."""
    path = Path(os.path.realpath(os.path.expanduser(path)))
    if path.suffix == CACHE_SUFFIX:
        return path.with_suffix(".lock")
    return path.with_name(path.name + ".lock")


class SessionLock:
    """An exclusive, non-blocking lock on a session (``flock`` on ``NAME.lock``).

    Held from ``acquire()`` (or ``with``) until ``release()``, which removes the
    lock file; the OS drops the lock when the process dies, so a crashed chat
    never leaves a session locked. ``acquire(required=False)`` holds nothing,
    instead of failing, when the lock file cannot be created (a read-only
    folder, where no chat can lock or save either).
    """

    def __init__(self, path: Path, label: str | None = None, *, lock_file: Path | None = None):
        self.path = Path(lock_file) if lock_file is not None else lock_path_for(path)
        self.label = label or str(path)
        self._fd: int | None = None

    def acquire(self, required: bool = True) -> "SessionLock":
        for _ in range(20):  # another holder may remove the file between our open and flock
            fd = self._open(required)
            if fd is None or self._lock(fd):
                return self
        raise SessionError(f"could not lock {self.path}: it keeps being replaced; try again")

    def _open(self, required: bool) -> int | None:
        try:
            if required:  # a session's folder is ours to make; another file's is not
                self.path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            if not required:
                return None
            raise SessionError(f"cannot create the lock file {self.path}: {e.strerror}") from None

    def _lock(self, fd: int) -> bool:
        """Lock ``fd``; False when the file was removed from the path meanwhile (retry)."""
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.read(fd, 200).decode("utf-8", "replace").split()
            except OSError:
                holder = []
            os.close(fd)
            raise SessionError(self._held_message(holder)) from None
        if not _same_file(fd, self.path):
            os.close(fd)
            return False
        try:  # who holds it, for the message of a refused process: best effort (a full disk takes none)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {_command()}\n".encode())
        except OSError:
            pass
        self._fd = fd
        return True

    def _held_message(self, holder: list[str]) -> str:
        """Why the lock is refused: who holds it (the lock file's ``PID COMMAND``) and what to do."""
        pid = f" (pid {holder[0]})" if holder and holder[0].isdigit() else ""
        command = " ".join(holder[1:])
        what = "session" if self.label.startswith("'") else "file"
        if command and command != "mlxcc chat":
            return (f"{what} {self.label} is already open in another mlxcc process{pid} running '{command}'; "
                    "wait until it is done (or stop it), or use another file")  # fmt: skip
        return (f"{what} {self.label} is already open in another mlxcc process{pid}"
                + (" running 'mlxcc chat'" if command else "") + "; close that chat first or use another "
                + ("session name" if what == "session" else "file"))

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(self.path)  # while still locked: a waiting opener sees a removed file
            except OSError:
                pass
            try:
                os.close(self._fd)  # drops the flock
            finally:
                self._fd = None

    def __enter__(self) -> "SessionLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _command() -> str:
    """What this process runs, as a lock file records it: ``mlxcc COMMAND`` (or the program's name)."""
    argv = sys.argv or [""]
    if os.path.basename(argv[0]) in ("mlxcc", "__main__.py") and len(argv) > 1 and \
            argv[1].replace("-", "").isalpha():  # fmt: skip
        return f"mlxcc {argv[1]}"
    return os.path.basename(argv[0]) or "python"


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def remove_stale_lock(lock_file: Path) -> bool:
    """Remove ``lock_file`` if no process holds it (left by a killed chat); True if removed."""
    lock = SessionLock(Path(lock_file), lock_file=Path(lock_file))
    try:
        lock.acquire(required=False)
    except SessionError:
        return False  # held: a live chat
    removed = lock.held
    lock.release()
    return removed


__all__ = ["SessionLock", "lock_path_for", "remove_stale_lock"]
