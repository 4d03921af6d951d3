"""Writing safetensors files atomically.

``write_atomic`` writes a temp file in the target folder, fsyncs it and renames
it over the target: a reader sees the old file or the new one, never a mix,
and a failed write (full disk, kill -9) leaves the old file intact. A writer
killed with -9 leaves its temp file (``.NAME.HOST-PID.XXXXXXXX.tmp.safetensors``);
the next write to the same path, and :func:`remove_stale_temp_files_in` on its
folder, remove such leftovers when their writer is gone (same host, dead pid)
or they have not been touched for an hour.
Every failure of a write, creating the temp file included (a read-only
folder, ``/proc``), is one :class:`CacheFileError` line saying what failed
and what to do; :func:`check_writable` probes the same before any work.
``safetensors_bytes`` gives the bytes of such a file without writing one (a
value for a remote store). Both write the checksums of :mod:`.checksum`: the
tensors' sums go into the metadata first, the header's own is filled in once
the header bytes exist (8 bytes rewritten before the fsync: no second pass
over the data).
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CacheFileError
from .checksum import checksummed, seal_bytes, seal_file

if TYPE_CHECKING:  # mlx loads when arrays are written
    import mlx.core as mx


def write_atomic(path: str | os.PathLike, arrays: dict[str, mx.array], metadata: dict[str, str]) -> None:
    """Write a safetensors file with checksums atomically (temp file + fsync + rename)."""
    import mlx.core as mx

    metadata = checksummed(arrays, metadata)

    def write(tmp: str) -> None:
        mx.save_safetensors(tmp, arrays, metadata)
        seal_file(tmp)

    write_file_atomic(path, write)


def safetensors_bytes(arrays: dict[str, mx.array], metadata: dict[str, str]) -> bytes:
    """The bytes ``write_atomic`` would write, in memory."""
    import mlx.core as mx

    buf = io.BytesIO()
    mx.save_safetensors(buf, arrays, checksummed(arrays, metadata))
    return seal_bytes(buf.getvalue())


def write_file_atomic(path: str | os.PathLike, write) -> None:
    """Atomically replace ``path`` by what ``write(tmp)`` writes to the temp file
    path ``tmp`` (in the same folder, ending in ``.safetensors``). Errors raise
    CacheFileError and leave the previous file unchanged."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise CacheFileError(f"cannot write {path}: folder {folder} does not exist; create it first")
    remove_stale_temp_files(path)
    tmp = None
    try:
        tmp = make_temp_file(path, folder)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(folder)
    except (OSError, RuntimeError, ValueError) as e:
        _remove_quietly(tmp)
        raise write_error(path, folder, e, created=tmp is not None) from e
    except BaseException:
        _remove_quietly(tmp)
        raise


def make_temp_file(path: Path, folder: Path) -> str:
    """Create (empty) and return the temp file a write of ``path`` goes to."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_HOST}-{os.getpid()}.", suffix=TEMP_SUFFIX, dir=folder)
    os.close(fd)
    return tmp


def write_error(path: Path, folder: Path, e: BaseException, created: bool = True) -> CacheFileError:
    """The one-line CacheFileError for a failed write of ``path``: what failed, what to do."""
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    if not created:
        return CacheFileError(
            f"could not write {path}: cannot create a file in folder {folder} ({reason}); "
            "nothing was changed: save elsewhere or make the folder writable"
        )
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = f"folder {folder} cannot be written: save elsewhere or make it writable"
    elif isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or _out_of_space(folder, reason):
        free = _free_bytes(folder)
        # the system's own words ("No space left on device"); MLX gives none, so they are said for it
        said = [reason if isinstance(e, OSError) and e.errno is not None else "no space left on device"]
        said += [f"{free:,} bytes free in {folder}"] if free is not None else []
        left = f" ({'; '.join(said)})" if said else ""
        return CacheFileError(f"could not write {path}: the disk is full{left}; the previous file (if any) "
                              "is unchanged; free some space or save elsewhere")  # fmt: skip
    else:
        hint = "save elsewhere or check the path"
    return CacheFileError(f"could not write {path}: {reason}; the previous file (if any) is unchanged; {hint}")


FULL_DISK_MARGIN = 1 << 20  # a failed write with less free space than this (or than it wrote) met a full disk


def _out_of_space(folder: Path, reason: str) -> bool:
    """Whether a write that failed without an errno (MLX: "[write] Unable to write
    N bytes to file.") failed for want of space: less is free than N or 1 MiB."""
    if not reason.startswith("[write]"):
        return False
    free = _free_bytes(folder)
    asked = re.search(r"(\d+) bytes", reason)
    return free is not None and free < max(int(asked.group(1)) if asked else 0, FULL_DISK_MARGIN)


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Atomically replace ``path`` by ``text`` (UTF-8): a text file that is not a cache
    (an export), written as :func:`write_file_atomic` writes; its errors likewise."""
    write_file_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def check_writable(path: str | os.PathLike) -> None:
    """Refuse (CacheFileError) a ``path`` that :func:`write_file_atomic` could not
    write: its folder is missing, or a temp file cannot be created in it (probed)."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise CacheFileError(f"cannot write {path}: folder {folder} does not exist; create it first")
    if path.is_dir():
        raise CacheFileError(f"cannot write {path}: it is a folder; give a file name")
    try:
        tmp = make_temp_file(path, folder)
    except OSError as e:
        raise write_error(path, folder, e, created=False) from e
    _remove_quietly(tmp)


TEMP_SUFFIX = ".tmp.safetensors"
STALE_AFTER = 3600.0  # seconds without a write: no live writer leaves its temp file idle that long
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]  # pids only mean something on their host
# the part between ".NAME." and the suffix: [HOST-PID.] then mkstemp's 8 random characters
_MIDDLE = re.compile(r"^(?:([0-9a-f]{6})-(\d{1,10})\.)?[a-z0-9_]{8}$")
_NAME_AND_MIDDLE = re.compile(r"^.+?\.(?:([0-9a-f]{6})-(\d{1,10})\.)?[a-z0-9_]{8}$")  # NAME, then the middle


def remove_stale_temp_files(path: str | os.PathLike) -> list[Path]:
    """Remove the temp files killed writers of ``path`` left behind; returns them.

    Only names of our pattern (``.NAME.*.tmp.safetensors`` next to ``path``) are
    considered, and of those only the ones whose writer is gone (:func:`_writer_gone`).
    A live writer's temp file is never touched.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    return _remove_stale(folder, f".{path.name}.", _MIDDLE)


def remove_stale_temp_files_in(folder: str | os.PathLike) -> list[Path]:
    """Remove the temp files killed writers left in ``folder``, whatever file they
    were writing (a store's entries are named once, so no later write of the same
    name would find them); returns them. The same rule as :func:`remove_stale_temp_files`."""
    return _remove_stale(Path(folder), ".", _NAME_AND_MIDDLE)


def _remove_stale(folder: Path, prefix: str, pattern: re.Pattern) -> list[Path]:
    """Remove ``folder``'s files ``PREFIX REST .tmp.safetensors`` whose REST matches
    ``pattern`` (its groups 1 and 2: the writer's host tag and pid) and whose writer is gone."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(TEMP_SUFFIX)):
            continue
        tag = pattern.match(name[len(prefix) : -len(TEMP_SUFFIX)])
        if tag is None:  # not our temp file (for this path: e.g. one for "NAME.other")
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            idle = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if _writer_gone(tag.group(1), tag.group(2), idle):
            try:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
            except OSError:
                pass
    return removed


def _writer_gone(host: str | None, pid: str | None, idle: float) -> bool:
    """Whether a temp file's writer is known to be gone: its tag names this host and a
    pid that no longer exists, or the file has not changed for ``STALE_AFTER`` seconds
    (untagged files from older versions, other hosts)."""
    return (host == _HOST and not _pid_alive(int(pid))) or idle > STALE_AFTER


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid we wrote: leave it to the age rule
    if pid == os.getpid():
        return True  # ours (another thread may be writing it)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists (another user's) or cannot tell: keep the file
    return True


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_quietly(p: str | None) -> None:
    if p is None:
        return
    try:
        os.unlink(p)
    except OSError:
        pass
