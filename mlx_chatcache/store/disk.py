"""The disk tier: a store folder of value files, one per key (see :class:`DiskTier`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..config import SERVER_DEFAULTS, default_cache_dir
from ..errors import ChatCacheError, UsageError
from ..files.safetensors_file import read_header
from ..files.atomic import TEMP_SUFFIX, remove_stale_temp_files_in, write_file_atomic
from .chain import is_key, kinds
from .tiers import Tier
from .values import in_parallel

MARKER = ".mlxcc-store"
_MARKER_TEXT = "mlxcc prompt-cache store folder: files named like store keys are written and deleted by mlxcc\n"
_SUFFIX = ".safetensors"
LOW_WATER = 0.9  # a sweep evicts down to this share of the budget


class DiskTier(Tier):
    """Values as files ``KEY.safetensors`` in ``folder`` (each a checksummed cache file
    of our format: ``mlxcc cache info`` reads one), found again by a new instance (a
    restarted server) and by other processes sharing the folder.

    The folder must be a store folder (:func:`claim_folder`). Only files named like a
    store key are the store's: nothing else in the folder is read, counted or deleted
    (``stats()["foreign"]`` counts the rest); temp files of writers that died mid-write
    are removed when the tier opens the folder.

    Writes are atomic (a reader sees a whole file or none). A read touches the file's
    modification time, the least-recently-used order every process shares. With a
    ``budget``, a write that takes the folder's files past it sweeps: the folder is
    listed again and the least recently used unpinned files are deleted down to
    :data:`LOW_WATER` of the budget (pinned ones only when nothing else is left).
    ``budget`` None is a command's view of a server's folder (``--cache-dir``): it
    adds values and never deletes one but a damaged one. Files other processes write
    are seen by a listing, at most once per ``rescan_seconds``, when a lookup misses."""

    name = "disk"

    def __init__(self, folder: str | os.PathLike, budget: int | None,
                 rescan_seconds: float = SERVER_DEFAULTS.disk_rescan_seconds):  # fmt: skip
        super().__init__(budget)
        self.folder = claim_folder(folder)
        self.rescan_seconds = rescan_seconds
        self.counters["temp_removed"] = len(remove_stale_temp_files_in(self.folder))
        self._files: dict[str, tuple[int, int]] = {}  # key -> (bytes, mtime_ns)
        self.foreign = 0
        self._listed = 0.0
        self._list()
        if budget is not None and self._bytes() > budget:
            self._sweep()

    # ------------------------------------------------------------------ reading
    def has(self, keys):
        found = [k in self._files for k in keys]
        if not all(found) and time.monotonic() - self._listed >= self.rescan_seconds:
            self._list()
            found = [k in self._files for k in keys]
        return found

    def get(self, keys):
        out = []
        for k, data in zip(keys, in_parallel(_read, [self._path(k) for k in keys])):
            if data is None:  # gone (another process's sweep), or unreadable now: a miss
                self._files.pop(k, None)
            else:
                self._files[k] = (len(data), time.time_ns())
                self.counters["hits"] += 1
            out.append(data)
        return out

    # ------------------------------------------------------------------ writing
    def put(self, values):
        for k, v in values.items():
            path = self._path(k)
            if k in self._files and _touch(path):
                continue  # (a file swept by another process meanwhile is written again)
            write_file_atomic(path, lambda tmp, data=v.data: Path(tmp).write_bytes(data))
            self._files[k] = (len(v.data), time.time_ns())
            self.counters["added"] += 1
        if self.budget is not None and self._bytes() > self.budget:
            self._sweep()

    def drop(self, key):
        self._files.pop(key, None)
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError:
            pass

    def _sweep(self) -> None:
        """Delete least recently used files down to :data:`LOW_WATER` of the budget."""
        self._list()
        total, goal = self._bytes(), self.budget * LOW_WATER
        order = sorted(self._files, key=lambda k: (k in self.pinned, self._files[k][1]))
        for k in order:
            if total <= goal:
                break
            total -= self._files[k][0]
            self.drop(k)
            self.counters["evicted"] += 1

    # ------------------------------------------------------------------ the folder
    def _list(self) -> None:
        """Learn the folder's value files anew (those of other processes too)."""
        self._listed = time.monotonic()
        files, foreign = {}, 0
        try:
            with os.scandir(self.folder) as it:
                for e in it:
                    key = e.name[: -len(_SUFFIX)]
                    if not (e.name.endswith(_SUFFIX) and is_key(key)):
                        foreign += e.name != MARKER and not _is_temp(e.name)
                        continue
                    try:
                        st = e.stat()
                    except OSError:
                        continue  # deleted meanwhile
                    files[key] = (st.st_size, st.st_mtime_ns)
        except OSError:
            return  # cannot be listed now: keep what is known
        self._files, self.foreign = files, foreign

    def _bytes(self) -> int:
        return sum(size for size, _ in list(self._files.values()))  # (a copy: stats may run on another thread)

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}{_SUFFIX}"

    def recent_headers(self):
        """``(key, header)`` of the folder's values, most recently used first; a value that
        cannot be read now is left out (only headers are read: no arrays)."""
        for key in sorted(self._files, key=lambda k: self._files[k][1], reverse=True):
            try:
                yield key, read_header(self._path(key))
            except (ChatCacheError, OSError):
                continue

    def pins(self):
        return self.pinned.report(lambda k: self._files.get(k, (0, 0))[0])

    def stats(self):
        return {**super().stats(), **kinds(self._files), "bytes": self._bytes(), "foreign": self.foreign}


def claim_folder(folder: str | os.PathLike) -> Path:
    """The store folder ``folder``: made and marked when new or empty, used as it is when
    marked (:data:`MARKER`) or when it holds only store values; anything else is one
    UsageError line, and nothing in the folder is touched."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"cache folder {folder} is a file, not a folder; give an empty or new folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        names = os.listdir(folder)
    except OSError as e:
        raise UsageError(f"cannot use cache folder {folder}: {e.strerror or e}; give a folder you can write") from e
    if MARKER in names:
        return folder
    other = next((n for n in sorted(names) if not (_is_temp(n) or n.endswith(_SUFFIX) and is_key(n[: -len(_SUFFIX)]))), None)
    if other is not None:
        raise UsageError(
            f"{folder} holds other files (such as {other}) and is not an mlxcc cache folder; "
            f"give an empty or new folder (the default for serve is {default_cache_dir()})"
        )
    try:
        (folder / MARKER).write_text(_MARKER_TEXT)
    except OSError as e:
        raise UsageError(f"cannot use cache folder {folder}: {e.strerror or e}; give a folder you can write") from e
    return folder


def _read(path: Path) -> bytes | None:
    """The bytes of ``path``, touched as used (None: it cannot be read now)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    _touch(path)
    return data


def _touch(path: Path) -> bool:
    """Mark ``path`` used now (the LRU order is modification times); False when it is gone."""
    try:
        os.utime(path)
    except OSError:
        return False
    return True


def _is_temp(name: str) -> bool:
    """A temp file of our atomic writes (``.NAME.*.tmp.safetensors``)."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


__all__ = ["MARKER", "DiskTier", "claim_folder"]
