"""The Redis tier's writes, on a background thread with a bounded queue.

:class:`RedisWriter` runs jobs the tier queues (``submit`` never blocks: a full
queue drops the job and counts it in ``dropped``). Jobs:

- ``publish``: keep the byte budget (:meth:`plan`: least recently used entries
  out, no entry evicting more than its own size, pinned entries last, expired
  ones forgotten), write the chunks under the write's own version and the
  block values not stored yet (one value per chain hash, whoever writes it
  first), then in one WATCH/MULTI/EXEC transaction set the manifest, the
  block index keys, the LRU score, the size and the counts of the blocks it
  lists (those of a manifest it replaces are released in it: a count reaching
  0 deletes the value and takes its bytes off ``P:kbytes``). A block or chunk
  freed between its write and the transaction is written again in it. A reader sees
  the old manifest (whose chunks stay readable for ``GRACE`` seconds) or the
  new one with all its chunks, never a mix; two
  writers of one entry each publish a complete version and the last one wins.
  Entries the new one makes redundant (trimmable prefixes of it, whose block
  keys now all point to it) are deleted.
- ``touch``: a hit refreshes an entry's TTLs and LRU score (in a transaction
  that commits only while the entry is still the version that was read).
- ``discard``: delete an entry a reader found corrupt or missing a block
  (releasing its blocks; damaged block values are deleted), if it is still
  the version that was read.
- reconcile (:mod:`.redis_reconcile`): a pass that recounts block holders from
  the manifests Redis still holds, frees blocks no manifest lists, deletes the
  chunks of manifests that are gone and recounts ``P:kbytes``. It runs when the
  writer is first idle, then after a job or while idle every
  ``reconcile_seconds``, and as soon as the writer is free when
  a reader finds an entry or a block Redis dropped (``reconcile_soon``); a
  replica runs it only after claiming ``P:reconcile`` for ``reconcile_seconds``,
  so replicas together run one pass per period.

Failures (Redis down) count in ``write_errors`` and lose only that job.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from ..files.checksum import crc32
from .redis_layout import (GRACE, Chain, Keys, Manifest, decode_manifest, index_value, member, parse_index_value,
                           split_member)
from .redis_link import RedisLink, Unavailable, redis_module
from .redis_reconcile import Reconciler, Report

log = logging.getLogger("mlx_chatcache.store.redis")
_RETRIES = 64  # a transaction whose watched keys changed is tried again this often
_STOP = object()


def _WAKE() -> None:
    """A job that only wakes the writer."""


class RedisWriter:
    def __init__(self, link: RedisLink, keys: Keys, budget: int, ttl: int, block: int, queue_size: int,
                 count: Callable[[str, int], None], reconcile_seconds: float):  # fmt: skip
        self.link, self.keys, self.budget, self.ttl, self.block = link, keys, budget, ttl, block
        self._count = count
        self._watch_error = redis_module().WatchError
        self.reconciler = Reconciler(keys, ttl, self._watch_error)
        self.reconcile_seconds = reconcile_seconds
        self.last_pass: Report | None = None
        self._next_pass = time.monotonic()  # the first pass: when the writer is first idle
        self.known_bytes = 0  # the budget's total at the last publish
        self.known_entries = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._thread = threading.Thread(target=self._loop, name="mlxcc-redis-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ queue
    def has_room(self) -> bool:
        return not self._queue.full()

    def submit(self, job: Callable[[], None]) -> bool:
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            self._count("dropped", 1)
            return False

    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued job ran (True) or ``timeout`` passed."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 5.0) -> None:
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=max(0.0, self._next_pass - time.monotonic()))
            except queue.Empty:
                self._run(self._pass_if_due)
                continue
            if job is _STOP:
                self._queue.task_done()
                return
            self._run(job)
            self._run(self._pass_if_due)
            self._queue.task_done()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Unavailable:
            self._count("write_errors", 1)
        except Exception:  # a bug must not kill the writer: log it, lose the job
            log.exception("Redis cache tier: a background write failed")
            self._count("write_errors", 1)

    # ------------------------------------------------------------------ reconcile
    def reconcile_soon(self) -> None:
        """Run a reconcile pass as soon as the writer is free (still at most one
        per ``reconcile_seconds`` across replicas): a reader found an entry or a
        block Redis dropped."""
        if self._next_pass:
            self._next_pass = 0.0
            try:
                self._queue.put_nowait(_WAKE)
            except queue.Full:
                pass  # it runs after the queued jobs

    def _pass_if_due(self) -> None:
        if time.monotonic() < self._next_pass:
            return
        self._next_pass = time.monotonic() + self.reconcile_seconds
        claim = max(1, int(self.reconcile_seconds * 1000))
        try:
            if self.link.run(lambda r: r.set(self.keys.reconcile, "1", nx=True, px=claim)):
                self.reconcile()
        except Unavailable:
            pass  # Redis is down: the next pass will do

    def reconcile(self) -> Report:
        """One reconcile pass now (:mod:`.redis_reconcile`; raises Unavailable)."""
        report = self.link.run(self.reconciler.run)
        self.last_pass = report
        self._count("reconciles", 1)
        self._count("reclaimed", report.freed)
        self._count("reclaimed_chunks", report.chunks_freed)
        return report

    # ------------------------------------------------------------------ jobs
    def publish(self, m: Manifest, chunks: list[bytes], values: dict[str, bytes] | None = None) -> bool:
        """Publish an entry, with the block values ``values`` its manifest lists
        (False: refused by the budget; raises Unavailable)."""
        values = values or {}
        stored = self.link.run(lambda r: self._stored(r, m.namespace, list(values)))
        cost = m.nbytes + sum(len(v) for h, v in values.items() if h not in stored)
        whole = m.whole_bytes(self.block)
        victims = self.link.run(lambda r: self.plan(r, cost, m.key is not None, member(m.namespace, m.eid), whole))
        if victims is None:
            self._count("refused", 1)
            return False
        self.link.run(lambda r: self._write_chunks(r, m, chunks))
        chain = Chain(m.namespace, m.tokens, self.block)
        index = [self.keys.block(m.namespace, h) for h in chain.hashes] if m.trimmable else \
            [self.keys.end(m.namespace, chain.hashes[-1])]  # fmt: skip
        replaced = self.link.run(lambda r: self._publish(r, m, chunks, index, values, stored))
        self._count("added", 1)
        self.link.run(lambda r: self._clean_up(r, m, chain, replaced, victims))
        return True

    def _write_chunks(self, r, m: Manifest, chunks: list[bytes]) -> None:
        pipe = r.pipeline(transaction=False)
        for j, chunk in enumerate(chunks):
            pipe.set(self.keys.chunk(m.namespace, m.eid, m.version, j), chunk, ex=self.ttl + GRACE)
            if (j + 1) % 4 == 0:
                pipe.execute()
        pipe.execute()

    def _stored(self, r, ns: str, hashes: list[str]) -> set[str]:
        """Which of ``hashes`` have a block value in Redis."""
        pipe = r.pipeline(transaction=False)
        for h in hashes:
            pipe.exists(self.keys.value(ns, h))
        return {h for h, n in zip(hashes, pipe.execute() if hashes else ()) if n}

    def _write_values(self, r, ns: str, values: dict[str, bytes]) -> None:
        """Write the block values not stored yet, each with its crc32, and add their
        bytes to ``P:kbytes``, in one transaction per group watching their keys (a
        value another writer stores meanwhile is left as that writer made it)."""
        items = list(values.items())
        for g in range(0, len(items), 4):
            group = items[g : g + 4]
            watched = [k for h, _ in group for k in (self.keys.value(ns, h), self.keys.refs(ns, h))]
            for _ in range(_RETRIES):
                with r.pipeline(transaction=True) as pipe:
                    try:
                        pipe.watch(*watched)
                        there = r.pipeline(transaction=False)
                        for h, _ in group:
                            there.exists(self.keys.value(ns, h))
                        made = [(h, v) for (h, v), e in zip(group, there.execute()) if not e]
                        if not made:
                            break
                        pipe.multi()
                        self._queue_values(pipe, ns, made)
                        pipe.execute()
                        break
                    except self._watch_error:
                        continue

    def _queue_values(self, pipe, ns: str, made: list[tuple[str, bytes]]) -> None:
        """Queue the writes of block values ``made`` (not stored yet): each value, its crc32, their bytes."""
        for h, v in made:
            pipe.set(self.keys.value(ns, h), v, ex=self.ttl + GRACE)
            pipe.hset(self.keys.refs(ns, h), "crc", crc32(v))
            pipe.expire(self.keys.refs(ns, h), self.ttl + GRACE)
        if made:
            pipe.incrby(self.keys.block_bytes, sum(len(v) for _, v in made))

    def _publish(self, r, m: Manifest, chunks: list[bytes], index: list[str], values: dict[str, bytes],
                 stored: set[str]) -> list:  # fmt: skip
        """Set the manifest, its index keys, LRU score, size and its blocks' counts
        in one transaction (the blocks it replaces are released in it too). Its
        chunks and block values are written before; those freed meanwhile are
        written again inside the transaction, so a publish never races a
        reconcile pass twice for them (it is tried again only when a watched key
        changed)."""
        name, value = member(m.namespace, m.eid), index_value(len(m.tokens), m.eid)
        mkey, ns, own = self.keys.manifest(m.namespace, m.eid), m.namespace, self.keys.chunks(m)
        watched = [mkey, *own] + [k for h in m.blocks for k in (self.keys.value(ns, h), self.keys.refs(ns, h))]
        meta = f"{m.nbytes}:{int(m.key is not None)}:{m.whole_bytes(self.block)}"
        self._write_values(r, ns, {h: v for h, v in values.items() if h not in stored})
        for _ in range(_RETRIES):
            with r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(*watched)
                    old = _manifest(pipe.get(mkey), m.namespace, m.eid)
                    there = r.pipeline(transaction=False)  # one round trip while the keys are watched
                    for k in [self.keys.value(ns, h) for h in m.blocks] + own:
                        there.exists(k)
                    got = there.execute()
                    gone = [(h, values[h]) for h, e in zip(m.blocks, got) if not e]
                    lost = [j for j, e in enumerate(got[len(m.blocks) :]) if not e]
                    dropped = [h for h in (old.blocks if old else ()) if h not in set(m.blocks)]
                    release, _ = self._releasing(pipe, ns, dropped)
                    pipe.multi()
                    pipe.set(mkey, m.encode(), ex=self.ttl, get=True)
                    for k in index:
                        pipe.set(k, value, ex=self.ttl, get=True)
                    self._queue_values(pipe, ns, gone)  # freed since they were written
                    for j in lost:
                        pipe.set(own[j], chunks[j], ex=self.ttl + GRACE)
                    pipe.zadd(self.keys.lru, {name: time.time()})
                    pipe.hset(self.keys.meta, name, meta)
                    for h in [h for h in m.blocks if h not in set(old.blocks if old else ())]:
                        pipe.hincrby(self.keys.refs(ns, h), "n", 1)
                    for h in m.blocks:
                        pipe.expire(self.keys.refs(ns, h), self.ttl + GRACE)
                        pipe.expire(self.keys.value(ns, h), self.ttl + GRACE)
                    release(pipe)
                    return pipe.execute()[: 1 + len(index)]
                except self._watch_error:
                    continue
        raise Unavailable("the Redis tier could not publish an entry: its blocks or chunks kept changing")

    def _releasing(self, pipe, ns: str, hashes) -> tuple[Callable, dict[str, int]]:
        """(Watching ``hashes``' keys) what to queue in the transaction that drops one
        holder of each: its count goes down, and at 0 the value is deleted and its
        bytes leave ``P:kbytes``; and those last holders' ``{hash: bytes}``."""
        hashes = list(hashes)
        if not hashes:
            return lambda p: None, {}
        pipe.watch(*[k for h in hashes for k in (self.keys.value(ns, h), self.keys.refs(ns, h))])
        last = {h: pipe.strlen(self.keys.value(ns, h)) for h in hashes if int(pipe.hget(self.keys.refs(ns, h), "n") or 0) <= 1}

        def queue(p):
            for h in hashes:
                if h in last:
                    p.delete(self.keys.refs(ns, h), self.keys.value(ns, h))
                else:
                    p.hincrby(self.keys.refs(ns, h), "n", -1)
            if sum(last.values()):
                p.decrby(self.keys.block_bytes, sum(last.values()))

        return queue, last

    def _clean_up(self, r, m: Manifest, chain: Chain, replaced: list, victims: list[str]) -> None:
        old = decode_manifest(replaced[0], m.namespace, m.eid) if replaced[0] else None
        pipe = r.pipeline(transaction=False)
        if old is not None and old.version != m.version:
            for k in self.keys.chunks(old):
                pipe.expire(k, GRACE)
        superseded = set()
        for raw in replaced[1:] if m.trimmable else ():
            got = parse_index_value(raw)
            if got and got[1] != m.eid and got[0] < len(m.tokens) and chain.entry_id(got[0]) == got[1]:
                superseded.add(member(m.namespace, got[1]))
        pipe.execute()
        for name in [*superseded, *victims]:
            self._delete(r, name)
        self._count("evicted", len(victims))

    def _delete(self, r, name: str, version: str | None = None, damaged: tuple[str, ...] = ()) -> None:
        """Delete entry ``name`` (only if its manifest is still ``version``, when
        given), releasing its blocks; ``damaged``: block values found damaged,
        deleted whoever holds them (their holders become misses)."""
        parts = split_member(name)
        if parts is None:
            return
        ns, mkey = parts[0], self.keys.manifest(*parts)
        for _ in range(_RETRIES):
            with r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(mkey)
                    m = _manifest(pipe.get(mkey), *parts)
                    if version is not None and (m is None or m.version != version):
                        return
                    release, freed = self._releasing(pipe, ns, m.blocks if m else ())
                    bad = {h: pipe.strlen(self.keys.value(ns, h)) for h in damaged if m and h in m.blocks
                           and h not in freed}  # fmt: skip
                    pipe.multi()
                    pipe.delete(mkey)
                    pipe.zrem(self.keys.lru, name)
                    pipe.hdel(self.keys.meta, name)
                    for k in self.keys.chunks(m) if m else ():
                        pipe.expire(k, GRACE)
                    release(pipe)
                    for h in bad:
                        pipe.delete(self.keys.value(ns, h), self.keys.refs(ns, h))
                    if sum(bad.values()):
                        pipe.decrby(self.keys.block_bytes, sum(bad.values()))
                    pipe.execute()
                    return
                except self._watch_error:
                    continue

    def touch(self, m: Manifest) -> None:
        chain = Chain(m.namespace, m.tokens, self.block)
        index = [self.keys.block(m.namespace, h) for h in chain.hashes] if m.trimmable else \
            [self.keys.end(m.namespace, chain.hashes[-1])]  # fmt: skip

        mkey = self.keys.manifest(m.namespace, m.eid)

        def run(r):
            with r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(mkey)
                    current = decode_manifest(pipe.get(mkey) or b"", m.namespace, m.eid)
                    if current is None or current.version != m.version:
                        return  # replaced or deleted since it was read: keep the old chunks' grace period
                    pipe.multi()
                    pipe.expire(mkey, self.ttl)
                    for k in self.keys.chunks(m):
                        pipe.expire(k, self.ttl + GRACE)
                    for k in index:
                        pipe.expire(k, self.ttl)
                    for h in m.blocks:
                        pipe.expire(self.keys.value(m.namespace, h), self.ttl + GRACE)
                        pipe.expire(self.keys.refs(m.namespace, h), self.ttl + GRACE)
                    pipe.zadd(self.keys.lru, {member(m.namespace, m.eid): time.time()}, xx=True)
                    pipe.execute()
                except self._watch_error:
                    return  # replaced, deleted or touched meanwhile: the next hit touches it

        self.link.run(run)

    def discard(self, m: Manifest, damaged: tuple[str, ...] = ()) -> None:
        self.link.run(lambda r: self._delete(r, member(m.namespace, m.eid), m.version, damaged))

    # ------------------------------------------------------------------ budget
    def plan(self, r, nbytes: int, pinned: bool, name: str, whole: int | None = None) -> list[str] | None:
        """Entries to evict so ``nbytes`` more (an entry of ``whole`` bytes with its
        blocks, of which ``nbytes`` are not stored yet) fit the budget (None:
        refused); forgets entries that expired since their last use. The total is
        every entry's own bytes plus the block values' (each once); a victim is
        expected to free its size with its blocks (blocks other entries hold stay,
        so the next write evicts what is still over)."""
        whole = nbytes if whole is None else whole
        if nbytes > self.budget:
            return None
        sizes = {k.decode(): v.decode() for k, v in r.hgetall(self.keys.meta).items()}
        order = [(k.decode(), s) for k, s in r.zrange(self.keys.lru, 0, -1, withscores=True)]
        blocks = int(r.get(self.keys.block_bytes) or 0)
        listed = dict(order)
        expired = [k for k, s in order if s < time.time() - self.ttl] + [k for k in sizes if k not in listed]
        if expired:
            pipe = r.pipeline(transaction=False)
            pipe.zrem(self.keys.lru, *expired)
            pipe.hdel(self.keys.meta, *expired)
            pipe.execute()
        live = [(k, *_size(sizes.get(k))) for k, _ in order if k not in expired and k != name]
        total = sum(n for _, n, _, _ in live) + blocks
        self.known_entries, self.known_bytes = len(live) + 1, total + nbytes  # as it will be if it fits
        need = total + nbytes - self.budget
        if need <= 0:
            return []
        candidates = [c for c in live if not c[2]] + ([c for c in live if c[2]] if pinned else [])
        victims, freed = [], 0
        for k, _, _, n in candidates:
            if freed + n > max(nbytes, whole):
                continue  # would evict more than the new entry's size
            victims.append(k)
            freed += n
            if freed >= need:
                self.known_entries -= len(victims)
                self.known_bytes -= freed
                return victims
        self.known_entries, self.known_bytes = len(live), total
        return None


def _size(raw: str | None) -> tuple[int, bool, int]:
    """``(own bytes, pinned, bytes with its blocks)`` of a ``P:meta`` value."""
    try:
        own, pinned, *whole = raw.split(":")
        return int(own), pinned == "1", int(whole[0]) if whole else int(own)
    except (AttributeError, ValueError, IndexError):
        return 0, False, 0


def _manifest(raw, ns: str, eid: str) -> Manifest | None:
    return decode_manifest(raw, ns, eid) if raw else None
