"""Reconcile the Redis tier's block counts and byte counter with what Redis holds.

Redis drops keys on its own: a manifest expires (TTL) or is evicted (a
``maxmemory`` policy), and so may a block value or its ``P:r`` hash. Nothing
then releases the blocks such a manifest listed or deletes its chunks before
their own TTL, and ``P:kbytes`` keeps counting values that are gone. :meth:`Reconciler.run` (one pass) puts it right
(key layout: :mod:`.redis_layout`):

1. Blocks. It reads every manifest (SCAN and MGET in batches) and counts, per
   block, the manifests listing it; the blocks whose stored count differs, or
   whose value and crc32 are not both there, are to fix. For each batch of
   those, in one WATCH/MULTI/EXEC transaction, it watches their value and
   ``P:r`` keys, reads the manifests again (a writer changes a block's count in
   the transaction that publishes or deletes a manifest listing it, so a
   manifest published or deleted meanwhile is either counted or aborts the
   transaction, which is then tried again) and sets each count to the
   manifests listing it. A block no manifest lists is deleted and its bytes
   leave ``P:kbytes`` (unless it was written with its crc32 less than
   ``GRACE`` seconds ago and never counted: its publish may be in flight). A listed block whose
   value or crc32 is gone loses both, keeping its count: its entries are misses
   until it is written again, with its own crc32.
2. Budget. ``P:lru``/``P:meta`` members whose manifest is gone are dropped.
3. Chunks. A chunk key (a tail, or part of a whole value) whose entry has no
   manifest is deleted, unless its remaining TTL is above ``ttl`` (written or
   refreshed less than ``GRACE`` seconds ago: its publish may be in flight) or
   at most ``GRACE`` (a deleted entry's, expiring by itself, that readers in
   flight may still read). In one WATCH/MULTI/EXEC transaction per
   batch watching the chunks and their manifest keys, it reads both again: a
   manifest published meanwhile aborts it (the publish transaction in turn
   watches its chunks and writes them again when they are gone). Chunks of a
   live manifest's other versions are left to expire by their TTL. The rule
   reads a chunk's age from its TTL, so replicas sharing a Redis must share
   ``redis_ttl_seconds`` (a replica with a longer one deletes in-flight chunks,
   which their publish then writes again; one with a shorter one frees none).
4. Bytes. ``P:kbytes`` is set to the size of the block values that exist, read
   while watching it (every write or delete of a value changes it in the same
   transaction, so one made meanwhile aborts the pass's and the read is made
   again).

A count may come out too high (a manifest expiring during the pass; the next
pass lowers it), never lower than the manifests listing the block. A pass
costs a few SCANs of the tier's keys, two reads of every manifest when a
block needs fixing, one otherwise, and an EXISTS and a PTTL per chunk, in
batches of ``batch`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .redis_layout import GRACE, Keys, decode_manifest

_BATCH = 256  # keys per SCAN step, MGET, pipeline and transaction
_RETRIES = 8  # a transaction whose watched keys changed is tried again this often, then left to the next pass


@dataclass
class Report:
    """What one pass changed."""

    freed: int = 0  # block values deleted (no manifest listed them, or one was unusable)
    recounted: int = 0  # block counts set to the manifests listing them
    forgotten: int = 0  # P:lru/P:meta members whose manifest was gone
    chunks_freed: int = 0  # chunk keys deleted (their manifest was gone)
    kbytes: int | None = None  # P:kbytes after the pass (None: it kept changing)
    kbytes_drift: int = 0  # what P:kbytes was off by


@dataclass(frozen=True)
class _Block:
    size: int  # bytes of its value (0: none)
    count: int  # its P:r count (0: none)
    crc: bool  # whether its crc32 is there
    fresh: bool  # written less than GRACE seconds ago


class Reconciler:
    def __init__(self, keys: Keys, ttl: int, watch_error: type[Exception], batch: int = _BATCH):
        self.keys, self.ttl, self._watch_error, self.batch = keys, ttl, watch_error, batch

    def run(self, r) -> Report:
        """One pass over the tier's keys on client ``r`` (raises Redis errors)."""
        report = Report()
        listed, stored = self._listed(r), self._stored(r)
        todo = sorted(b for b in set(listed) | set(stored) if _wrong(listed.get(b, 0), stored.get(b)))
        for g in range(0, len(todo), self.batch):
            self._fix(r, todo[g : g + self.batch], report)
        self._forget_gone(r, report)
        for names in self._scan(r, "c"):
            self._free_chunks(r, names, report)
        self._recount_bytes(r, report)
        return report

    # ------------------------------------------------------------------ reads
    def _scan(self, r, kind: str) -> Iterator[list]:
        run = []
        for key in r.scan_iter(match=self.keys.pattern(kind), count=self.batch):
            run.append(key)
            if len(run) == self.batch:
                yield run
                run = []
        if run:
            yield run

    def _listed(self, r, only: set | None = None) -> dict[tuple[str, str], int]:
        """``{(namespace, hash): manifests listing it}`` (of the blocks in ``only``, if given)."""
        counts: dict[tuple[str, str], int] = {}
        for names in self._scan(r, "m"):
            for name, raw in zip(names, r.mget(names)):
                parts = self.keys.split("m", name)
                m = decode_manifest(raw, *parts) if raw and parts else None
                for h in m.blocks if m else ():
                    if only is None or (m.namespace, h) in only:
                        counts[(m.namespace, h)] = counts.get((m.namespace, h), 0) + 1
        return counts

    def _stored(self, r) -> dict[tuple[str, str], _Block]:
        """Every block with a value or a ``P:r`` hash, as Redis holds it now."""
        found = set()
        for kind in ("k", "r"):
            for names in self._scan(r, kind):
                found.update(b for b in (self.keys.split(kind, k) for k in names) if b)
        found = sorted(found)
        out = {}
        for g in range(0, len(found), self.batch):
            out.update(self._state(r, found[g : g + self.batch]))
        return out

    def _state(self, r, blocks: list[tuple[str, str]]) -> dict[tuple[str, str], _Block]:
        pipe = r.pipeline(transaction=False)
        for ns, h in blocks:
            pipe.strlen(self.keys.value(ns, h))
            pipe.pttl(self.keys.value(ns, h))
            pipe.hmget(self.keys.refs(ns, h), "n", "crc")
        got = pipe.execute()
        out = {}
        for i, b in enumerate(blocks):
            size, pttl, (count, crc) = got[3 * i : 3 * i + 3]
            out[b] = _Block(size, _int(count), crc is not None, pttl > self.ttl * 1000)
        return out

    # ------------------------------------------------------------------ fixes
    def _fix(self, r, blocks: list[tuple[str, str]], report: Report) -> None:
        watched = [k for ns, h in blocks for k in (self.keys.value(ns, h), self.keys.refs(ns, h))]
        for _ in range(_RETRIES):
            with r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(*watched)
                    listed, state = self._listed(r, set(blocks)), self._state(r, blocks)
                    pipe.multi()
                    freed, bytes_freed, recounted = 0, 0, 0
                    for ns, h in blocks:
                        n, b = listed.get((ns, h), 0), state[(ns, h)]
                        value, refs = self.keys.value(ns, h), self.keys.refs(ns, h)
                        if n == 0:
                            if b.size and b.crc and not b.count and b.fresh:
                                continue  # just written (with its crc32): its manifest may be on its way
                            if b.size or b.count or b.crc:
                                pipe.delete(value, refs)
                        elif b.size and b.crc:
                            if b.count != n:
                                pipe.hset(refs, "n", n)
                                recounted += 1
                            continue
                        else:  # listed, but its value or its crc32 is gone
                            pipe.delete(value)
                            pipe.hdel(refs, "crc")
                            pipe.hset(refs, "n", n)
                            pipe.expire(refs, self.ttl + GRACE)
                            recounted += b.count != n
                        freed += bool(b.size)
                        bytes_freed += b.size
                    if bytes_freed:
                        pipe.decrby(self.keys.block_bytes, bytes_freed)
                    pipe.execute()
                    report.freed += freed
                    report.recounted += recounted
                    return
                except self._watch_error:
                    continue

    def _forget_gone(self, r, report: Report) -> None:
        """Drop the LRU and size entries of manifests that are gone."""
        names = {m for m, _ in r.zscan_iter(self.keys.lru, count=self.batch)}
        names |= {k for k, _ in r.hscan_iter(self.keys.meta, count=self.batch)}
        names = sorted(names)
        for g in range(0, len(names), self.batch):
            run = names[g : g + self.batch]
            mkeys = [self._manifest_key(n) for n in run]
            pipe = r.pipeline(transaction=False)
            for k in mkeys:
                if k:  # (a malformed name has no manifest)
                    pipe.exists(k)
            there = iter(pipe.execute())
            gone = [(n, k) for n, k in zip(run, mkeys) if not (k and next(there))]
            if gone:
                report.forgotten += self._drop(r, gone)

    def _drop(self, r, gone: list) -> int:
        with r.pipeline(transaction=True) as pipe:
            try:
                watched = [k for _, k in gone if k]
                if watched:
                    pipe.watch(*watched)
                    there = r.pipeline(transaction=False)
                    for k in watched:
                        there.exists(k)
                    back = {k for k, e in zip(watched, there.execute()) if e}  # published again meanwhile
                    gone = [(n, k) for n, k in gone if k not in back]
                pipe.multi()
                if gone:
                    pipe.zrem(self.keys.lru, *[n for n, _ in gone])
                    pipe.hdel(self.keys.meta, *[n for n, _ in gone])
                pipe.execute()
                return len(gone)
            except self._watch_error:
                return 0  # the next pass

    def _orphans(self, r, names: list) -> list:
        """The chunk keys of ``names`` to delete now (step 3 of the module doc)."""
        owners = [(k, self.keys.chunk_owner(k)) for k in names]
        owners = [(k, o) for k, o in owners if o]
        pipe = r.pipeline(transaction=False)
        for k, (ns, eid, _) in owners:
            pipe.exists(self.keys.manifest(ns, eid))
            pipe.pttl(k)
        got = pipe.execute() if owners else []
        grace, fresh = GRACE * 1000, self.ttl * 1000
        return [k for i, (k, _) in enumerate(owners)
                if not got[2 * i] and (got[2 * i + 1] == -1 or grace < got[2 * i + 1] <= fresh)]  # fmt: skip

    def _free_chunks(self, r, names: list, report: Report) -> None:
        todo = self._orphans(r, names)
        for _ in range(_RETRIES):
            if not todo:
                return
            owners = {self.keys.manifest(*self.keys.chunk_owner(k)[:2]) for k in todo}
            with r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(*todo, *owners)
                    todo = self._orphans(r, todo)
                    pipe.multi()
                    if todo:
                        pipe.delete(*todo)
                    pipe.execute()
                    report.chunks_freed += len(todo)
                    return
                except self._watch_error:
                    continue

    def _manifest_key(self, name) -> str | None:
        name = name.decode(errors="replace") if isinstance(name, bytes) else name
        ns, _, eid = name.rpartition(":")
        return self.keys.manifest(ns, eid) if ns and len(eid) == 32 else None

    def _recount_bytes(self, r, report: Report) -> None:
        for _ in range(_RETRIES):
            with r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(self.keys.block_bytes)
                    before = _int(pipe.get(self.keys.block_bytes))
                    total = 0
                    for names in self._scan(r, "k"):
                        sizes = r.pipeline(transaction=False)
                        for k in names:
                            sizes.strlen(k)
                        total += sum(sizes.execute())
                    pipe.multi()
                    pipe.set(self.keys.block_bytes, total)
                    pipe.execute()
                    report.kbytes, report.kbytes_drift = total, before - total
                    return
                except self._watch_error:
                    continue


def _wrong(listed: int, b: _Block | None) -> bool:
    """Whether a block listed by ``listed`` manifests, stored as ``b``, needs fixing."""
    if b is None:
        return listed > 0  # listed, nothing stored: its count must still be there
    if listed == 0:
        return True
    return b.count != listed or bool(b.size) != b.crc


def _int(raw) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0


__all__ = ["Reconciler", "Report"]
