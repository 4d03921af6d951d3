"""The disk tier: a store folder of cache files in our format (see :class:`DiskTier`)."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

from ..cache import cache_class, can_trim_prompt_cache
from ..config import SERVER_DEFAULTS
from ..errors import ChatCacheError
from ..files.atomic import make_temp_file, remove_stale_temp_files_in
from ..files.checksum import MAX_THREADS
from ..files.mlxcc_format import check_cache_fits_model, info_from_header, load_cache_file, save_prompt_cache
from ..files.safetensors_file import DTYPES, read_into, start_read_into
from .blocks import SPLITTABLE, Assembly, as_layers, split, splittable
from .chain import Chain
from .disk_folder import (
    BLOCKS, block_fields, block_path, claim_folder, entry_file_name, entry_of, is_block_name, read_entry,
)  # fmt: skip
from .index import Entry
from .tiers import Tier

_OPEN_FILES = 32  # block files a checkout holds open at once


class DiskTier(Tier):
    """One cache file per entry in ``folder``, found again by a new instance (a
    restarted server). The folder must be a store folder (made, marked or
    adopted by :func:`~.disk_folder.claim_folder`; else a one-line UsageError).

    The store deletes only its own entries (:func:`~.disk_folder.read_entry`):
    other files in the folder (a session saved there, model weights, damaged
    or unreadable files) are skipped and counted in ``stats()["foreign"]``,
    never deleted; the temp files of writers that died mid-write (a ``kill -9``) are
    removed when the tier opens the folder (``stats()["temp_removed"]``; a live
    writer's are kept). An entry that fails on fetch is dropped and counted corrupt;
    its file is deleted only while its header still makes it a store entry.

    ``budget`` None is a command's view of a server's folder (``--cache-dir``):
    no byte budget, so neither the scan nor ``add`` evicts anything: the
    command only adds its entries (and replaces the shorter prefixes an entry
    supersedes); the budget is enforced by the server that owns the folder
    (its scan evicts the oldest entries beyond it). OSErrors while scanning (a
    file removed meanwhile) skip that file. The least recently used order
    survives restarts via file modification times (touched on every hit).

    Entries other processes add to the folder (``mlxcc generate --cache-dir``
    next to a running server) are found without a restart: a ``find`` that
    misses or serves only part of the query first indexes the entry files that
    appeared or changed since the last look (at most once per
    ``rescan_seconds``; it never evicts or deletes). An indexed entry whose
    file another process removed is dropped at its fetch (a miss, not corrupt).

    With ``block_tokens`` (default ``SERVER_DEFAULTS.disk_block_tokens``), a
    cache of plain K/V layers holding at least one block of tokens is stored as
    shared block files plus an entry file holding its tail and naming its blocks
    (:mod:`.blocks`, :func:`~.disk_folder.block_path`): entries sharing a prefix
    hold its blocks once, and the budget counts each block file once. Blocks
    are written before the entry file (each atomically), so an entry a reader
    sees has its blocks. A block file is deleted when this tier drops or evicts
    the last entry it knows holding it; a restart and the rescan count holders
    from the entry files. An entry whose block file is gone is a miss (dropped,
    not corrupt); one whose block file is damaged is dropped and counted corrupt,
    and the damaged block file deleted (so the next entry holding it writes it again).
    Block files no entry file in the folder names (orphans: a writer killed
    between its blocks and its entry file left them) are deleted once older than
    ``orphan_seconds``: when a tier opens the folder, and by the rescan, after it
    indexed the new entry files, at most once per ``orphan_seconds / 2``
    (``stats()["orphans_removed"]``). The named blocks are read from every entry
    file in the folder (every namespace, every process) before any block file's
    age; a writer touches the block files it uses again and writes new ones
    before its entry file, so a live writer's blocks are never deleted (as long
    as it writes its entry file within ``orphan_seconds`` of its blocks). An
    orphan is moved aside before it is deleted and put back if a writer touched
    it meanwhile (a reader of that writer's entry in those microseconds finds
    the block gone and drops the entry, as when a block file was deleted).

    A block entry's checkout copies each stored byte once: its entry file's tail
    and its block files are read (``os.preadv``) straight into the cache's own
    buffers, room to grow included (:class:`~.blocks.Assembly`), and every
    tensor is checked against its file's checksum where it landed."""

    name = "disk"

    def __init__(self, folder: str | os.PathLike, budget: int | None,
                 rescan_seconds: float = SERVER_DEFAULTS.disk_rescan_seconds,
                 block_tokens: int = SERVER_DEFAULTS.disk_block_tokens,
                 orphan_seconds: float = SERVER_DEFAULTS.disk_orphan_seconds):  # fmt: skip
        super().__init__(sys.maxsize if budget is None else budget)
        self.counters["foreign"] = 0
        self.folder = claim_folder(folder)
        self.block_tokens = block_tokens
        self._loose: set[str] = set()  # blocks that may have lost their last entry
        self._named: dict[str, tuple[int, tuple[str, ...]]] = {}  # entry file -> (mtime_ns, the blocks it names)
        self.counters["orphans_removed"] = 0
        removed = remove_stale_temp_files_in(self.folder) + remove_stale_temp_files_in(self.folder / BLOCKS)
        self.counters["temp_removed"] = len(removed)
        self.rescan_seconds = rescan_seconds
        self.orphan_seconds = orphan_seconds
        self._seen = self._listing() or {}  # before the scan: a file written meanwhile is looked at again
        self._rescanned = self._collected = time.monotonic()
        self._scan(evict=budget is not None)

    def find(self, scope, query, key):
        found = super().find(scope, query, key)
        if (found is None or found[1] < len(query)) and self._rescan():
            found = super().find(scope, query, key)
        return found

    def _listing(self) -> dict[str, int] | None:
        """``{name: mtime_ns}`` of the folder's entry-like files (None if it cannot be listed)."""
        out = {}
        try:
            with os.scandir(self.folder) as it:
                for e in it:
                    if e.name.endswith(".safetensors") and not e.name.startswith("."):
                        try:
                            out[e.name] = e.stat().st_mtime_ns
                        except OSError:
                            continue  # removed meanwhile
        except OSError:
            return None
        return out

    def _rescan(self) -> bool:
        """Index the store entries in files new or changed since the last look;
        True when one was added. Throttled to once per ``rescan_seconds``; then,
        at most once per ``orphan_seconds / 2``, delete the orphan block files."""
        now = time.monotonic()
        if now - self._rescanned < self.rescan_seconds:
            return False
        self._rescanned = now
        listing, added, self._unsure = self._listing(), False, False
        if listing is None:
            return False  # the folder cannot be listed now: nothing indexed, nothing collected
        for name, mtime in listing.items():
            if self._seen.get(name) == mtime:
                continue
            read = self._read(self.folder / name)
            if read is not None and self.index.get(read[0].namespace, read[0].tokens) is None:
                self.index.add(read[0], [])
                added = True
        self._seen = listing
        if now - self._collected >= self.orphan_seconds / 2:
            named = self._named_blocks(listing)
            if not self._unsure:
                self._collected = now
                self._remove_orphans(named)
        return added

    def _read(self, path: Path) -> tuple[Entry, int] | None:
        """:func:`~.disk_folder.read_entry`, noting the blocks the entry file names. A file
        that cannot be read (an OSError) is None and keeps the blocks it named when last
        read; it makes this look unsure: no orphans are collected from it."""
        try:
            read = read_entry(path, os_errors=True)
        except OSError:
            self._unsure = True
            return None
        if read is None:
            self._named.pop(path.name, None)
        else:
            self._named[path.name] = (read[1], tuple(b for b, _ in read[0].blocks))
        return read

    def _named_blocks(self, listing: dict[str, int]) -> set[str]:
        """The blocks the entry files in ``listing`` (:meth:`_listing`) name; a file
        not read at its listed mtime (foreign, or unreadable before) is read again."""
        self._named = {name: self._named[name] for name in listing if name in self._named}
        for name, mtime in listing.items():
            if self._named.get(name, (None,))[0] != mtime:
                self._read(self.folder / name)
        return self._held()

    def _held(self) -> set[str]:
        """The blocks the entry files read so far name."""
        return {b for _, blocks in self._named.values() for b in blocks}

    def _scan(self, evict: bool) -> None:
        found, self._unsure = [], False
        try:
            paths = sorted(self.folder.glob("*.safetensors"))
        except OSError:
            paths, self._unsure = [], True
        for path in paths:
            if path.name.startswith("."):
                continue  # a writer's temp file
            read = self._read(path)
            if read is None:
                self.counters["foreign"] += 1
            else:
                found.append(read)
        if not self._unsure:
            self._remove_orphans(self._held())
        total, kept, held, gone = 0, [], set(), []
        for entry, _ in sorted(found, key=lambda x: -x[1]):  # newest first
            adds = entry.nbytes + sum(n for b, n in entry.blocks if b not in held)
            if evict and total + adds > self.index.budget:  # the budget shrank since they were written
                _unlink(entry.payload)
                self.counters["evicted"] += 1
                gone.append(entry)
                continue
            total += adds
            held.update(b for b, _ in entry.blocks)
            kept.append(entry)
        for b in {b for e in gone for b, _ in e.blocks} - held:
            _unlink(block_path(self.folder, b))
        for entry in reversed(kept):  # oldest first: LRU order
            if self.index.get(entry.namespace, entry.tokens) is None:
                self.index.add(entry, [])

    def _remove_orphans(self, named: set[str]) -> None:
        """Delete the block files no entry file names (``named``: the blocks they do,
        read before this looks at the block files' ages) that are older than
        ``orphan_seconds``; counted in ``stats()["orphans_removed"]``."""
        try:
            with os.scandir(self.folder / BLOCKS) as it:
                candidates = [e for e in it if is_block_name(e.name) and e.name.split(".")[0] not in named]
        except OSError:
            return  # no blocks folder yet: nothing to collect
        old = time.time() - self.orphan_seconds
        for e in candidates:
            try:
                if e.stat().st_mtime < old and _collect(Path(e.path), old):
                    self.counters["orphans_removed"] += 1
            except OSError:
                continue  # removed meanwhile

    def fetch(self, entry, scope, expected):
        path = entry.payload
        if not Path(path).exists():  # another process removed it: a miss
            self._drop(entry)
            self._sweep()
            return None
        if entry.blocks:
            return self._fetch_blocks(entry, scope, expected)
        try:
            cache, info = load_cache_file(path, model=scope.fingerprint)
            if tuple(info.tokens or ()) != entry.tokens:
                raise ChatCacheError(f"{path} changed since it was indexed")
            check_cache_fits_model(cache, expected, path)
        except (ChatCacheError, OSError):
            self.index.remove(entry)
            self.counters["corrupt"] += 1
            if read_entry(path) is not None:  # still a store entry by its header: damaged further in
                _unlink(path)
            return None
        self._hit(entry)
        _touch(path)
        return cache

    def add(self, scope, tokens, cache, key):
        tokens = tuple(tokens)
        covering = self._covered(Entry(scope.namespace, tokens, 0, True, key))
        if covering is not None:
            self.index.touch(covering)
            _touch(covering.payload)
            return True
        path = self.folder / entry_file_name(scope.namespace, tokens)
        trimmable = can_trim_prompt_cache(cache)
        meta = {"store.namespace": scope.namespace, "store.trimmable": "1" if trimmable else "0"}
        if key is not None:
            meta["store.key"] = key
        old = self.index.get(scope.namespace, tokens)
        try:
            if path.exists() and old is not None:
                self._admit(Entry(scope.namespace, tokens, old.nbytes, trimmable, key, path, old.blocks))
                return True  # the same tokens are on disk already: only the key/recency change
            if self.block_tokens > 0 and len(tokens) >= self.block_tokens and splittable(cache, len(tokens)):
                entry = self._write_blocked(scope, tokens, cache, path, meta)
            else:
                save_prompt_cache(path, cache, tokens=tokens, model=scope.fingerprint, settings=scope.settings,
                                  metadata=meta)  # fmt: skip
                entry = Entry(scope.namespace, tokens, path.stat().st_size, trimmable, key, path)
            if not self._admit(entry):
                path.unlink(missing_ok=True)
                self._loose.update(b for b, _ in entry.blocks)
                return False
            return True
        finally:
            self._sweep()

    def _write_blocked(self, scope, tokens, cache, path, meta) -> Entry:
        """Write the block files ``cache`` needs that are not in the folder, then its entry file."""
        chain = Chain(scope.namespace, tokens, self.block_tokens)
        new, blocked = split(cache, chain, lambda h: _touch(block_path(self.folder, h)))  # used again: not an orphan
        (self.folder / BLOCKS).mkdir(exist_ok=True)
        for h, value in new.items():
            layers = as_layers(blocked, value, self.block_tokens)
            save_prompt_cache(block_path(self.folder, h), layers, model=scope.fingerprint,
                              metadata={"store.namespace": scope.namespace, "store.block": h})  # fmt: skip
            self._loose.add(h)
        blocks = tuple((h, block_path(self.folder, h).stat().st_size) for h in chain.hashes)
        tail = as_layers(blocked, blocked.tail, len(tokens) - len(blocks) * self.block_tokens)
        save_prompt_cache(path, tail, model=scope.fingerprint, settings=scope.settings,
                          metadata={**meta, **block_fields(tokens, blocks)})  # fmt: skip
        return Entry(scope.namespace, tokens, path.stat().st_size, meta["store.trimmable"] == "1",
                     meta.get("store.key"), path, blocks)  # fmt: skip

    def _fetch_blocks(self, entry, scope, expected):
        """``fetch`` of a block entry: its entry file's tail and its block files read
        straight into the assembled cache (:class:`~.blocks.Assembly`; see :meth:`_read_blocked`)."""
        paths = [block_path(self.folder, b) for b, _ in entry.blocks]
        if not all(p.exists() for p in paths):  # another process evicted a block: a miss
            self._drop(entry)
            self._sweep()
            return None
        bad = [entry.payload]
        try:
            cache = self._read_blocked(entry, scope, paths, bad)
            check_cache_fits_model(cache, expected, entry.payload)
        except OSError:  # a file that cannot be opened or read now (gone meanwhile, too many open files): a miss
            return None
        except (ChatCacheError, ValueError, IndexError):
            self.counters["corrupt"] += 1
            if bad[-1] != entry.payload:
                _unlink(bad[-1])  # a damaged block: the next entry holding it writes it again
            self.index.remove(entry)
            self._loose.update(b for b, _ in entry.blocks)
            if read_entry(Path(entry.payload)) is not None:
                _unlink(entry.payload)
            self._sweep()
            return None
        self._hit(entry)
        _touch(entry.payload)
        return cache

    def _read_blocked(self, entry, scope, paths, bad: list) -> list:
        """The cache of block entry ``entry``: the one copy of each stored byte is the
        scatter read of its file straight into the cache's buffers (with room to grow);
        each file's checksums are then checked where its bytes landed. The entry file
        is read first (its layers give the cache's layout), then the block files, up to
        ``_OPEN_FILES`` at a time: their headers on this thread, then their data over a
        few threads (no MLX work: reads and checksums into NumPy views, which free the
        GIL; no header parsing competes with them for it). The file that failed is the
        last in ``bad`` (what to delete when it is damaged)."""
        n = len(entry.tokens)
        places, sizes = [], []

        def tail(header):  # the entry file: its layers say how to lay out the cache
            info = info_from_header(header)
            scope.fingerprint.check(info.model)
            read = entry_of(info, Path(entry.payload), header.file_size)
            if read is None or read.tokens != entry.tokens or read.blocks != entry.blocks:
                raise ChatCacheError(f"{header.path} changed since it was indexed")
            kinds = [cache_class(c) for c in info.classes]
            if any(k not in SPLITTABLE for k in kinds):
                raise ChatCacheError(f"{header.path} holds layers that are not stored in blocks")
            metas = [(str(n), *m[1:]) for m, _ in info.extra["layers"]]
            counts = [c for _, c in info.extra["layers"]]
            names = [f"layer.{i}.{j}" for i, c in enumerate(counts) for j in range(c)]
            shapes = [header.tensors[x].shape if x in header.tensors else () for x in names]
            if not shapes or any(len(s) != 4 for s in shapes):
                raise ChatCacheError(f"{header.path}: its layers are not K/V arrays")
            specs = [(getattr(mx, DTYPES[header.tensors[x].dtype][1]), s[0], s[1], s[3]) for x, s in zip(names, shapes)]
            places.append(_Places(Assembly(kinds, metas, counts, specs, n), names))
            t = shapes[0][2]  # the tail's tokens: the blocks hold the rest, in equal parts
            if not paths or (n - t) % len(paths) or (n - t) // len(paths) <= t:
                raise ChatCacheError(f"{header.path}: its {t} tail tokens do not fit {len(paths)} blocks of {n} tokens")
            sizes.append((n - t) // len(paths))  # the size the entry was written with, whatever this tier's
            return places[0].of(header, n - t, t)

        bad.append(entry.payload)
        read_into(entry.payload, tail)
        like = None  # the last block file's header: the next one's tensor table is expected to equal it
        with ThreadPoolExecutor(min(os.cpu_count() or 1, MAX_THREADS)) as pool:  # reads and sums free the GIL
            for first in range(0, len(paths), _OPEN_FILES):
                started = []
                try:
                    for i in range(first, min(first + _OPEN_FILES, len(paths))):  # the headers, here
                        bad.append(paths[i])
                        place = places[0].block(scope, i, entry.blocks[i][0], sizes[0])
                        started.append(start_read_into(paths[i], place, like))
                        like = started[-1].header
                except BaseException:
                    for read in started:
                        read.close()
                    raise
                reads = [(read.header.path, pool.submit(read.finish)) for read in started]  # then the data
                for p, read in reads:
                    bad.append(p)
                    read.result()
        bad.append(entry.payload)
        return places[0].asm.cache()

    def _drop(self, entry, keep_payload_of=None):
        self._loose.update(self.index.remove(entry))
        if keep_payload_of is None or keep_payload_of.payload != entry.payload:
            _unlink(entry.payload)

    def _sweep(self) -> None:
        """Delete the block files no entry holds any more."""
        for b in self._loose:
            if not self.index.has_block(b):
                _unlink(block_path(self.folder, b))
        self._loose.clear()

    def stats(self) -> dict:
        return {**super().stats(), "block_tokens": self.block_tokens}


def _unlink(path: Path) -> None:
    try:
        Path(path).unlink(missing_ok=True)
    except OSError:
        pass


def _collect(path: Path, old: float) -> bool:
    """Delete the orphan block file ``path`` unless a writer uses it again meanwhile
    (True: deleted). A writer touches a block it uses again before its entry file
    names it, and writes it again when it is gone; so the file is first moved
    aside, then deleted only if it was still last changed before ``old`` (else it
    is put back)."""
    aside = make_temp_file(path, path.parent)  # a killed collector's is a stale temp file
    try:
        os.replace(path, aside)
    except OSError:
        _unlink(Path(aside))
        raise
    try:
        if os.stat(aside).st_mtime >= old:
            os.replace(aside, path)
            return False
    except OSError:
        _unlink(Path(aside))  # a writer that finds the block gone writes it again
        raise
    os.unlink(aside)
    return True


def _touch(path: Path) -> bool:
    """Most recently used, also for the next process (the LRU order is mtimes); False when ``path`` is not there."""
    try:
        os.utime(path)
    except OSError:
        return False
    return True


class _Places:
    """Where the tensors of a block entry's files go in its :class:`~.blocks.Assembly`."""

    def __init__(self, asm: Assembly, names: list[str]):
        self.asm, self.names = asm, names  # names: the files' tensor of each of the assembly's arrays
        self.checked = None  # (tensor table, tokens) last checked: block files of one entry share one
        self.order: list[int] = []  # the checked table's tensors, in file order, as buffer indices

    def block(self, scope, i: int, h: str, size: int):
        """The ``place`` of block ``i`` (chain hash ``h``), checking the file is that block."""
        def place(header):
            meta = header.metadata
            if meta.get("user.store.namespace") != scope.namespace or meta.get("user.store.block") != h:
                raise ChatCacheError(f"{header.path} is not block {h} of this store")
            return self.of(header, i * size, size)

        return place

    def of(self, header, at: int, t: int) -> list[list[memoryview]]:
        """Where the K/V tensors of a file of ``t`` tokens go (from token ``at``), in file order;
        ChatCacheError when its tensors are not exactly those, in the cache's dtypes and shapes."""
        if self.checked is None or self.checked[0] is not header.tensors or self.checked[1] != t:
            for name, (d, d0, d1, d3) in zip(self.names, self.asm.specs):
                e = header.tensors.get(name)
                if e is None or e.shape != (d0, d1, t, d3) or getattr(mx, DTYPES[e.dtype][1]) != d:
                    raise ChatCacheError(f"{header.path}: tensor {name} does not fit the entry's cache")
            if len(self.names) != len(header.tensors):
                raise ChatCacheError(f"{header.path} holds tensors the entry's cache has not")
            index = {name: k for k, name in enumerate(self.names)}
            self.order = [index[name] for name in header.tensors]
            self.checked = (header.tensors, t)
        return [self.asm.rows(k, at, t) for k in self.order]
