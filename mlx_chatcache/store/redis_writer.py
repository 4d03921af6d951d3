"""The Redis tier's writes, on a background thread with a bounded queue.

:class:`RedisWriter` runs jobs the tier queues (``submit`` never blocks: a full
queue drops the job and counts it in ``dropped``). Jobs:

- ``publish``: keep the byte budget (:meth:`plan`: least recently used entries
  out, no entry evicting more than its own size, pinned entries last, expired
  ones forgotten), write the chunks under the write's own version, then in one
  MULTI/EXEC transaction set the manifest, the block index keys, the LRU score
  and the size. A reader sees the old manifest (whose chunks stay readable for
  ``GRACE`` seconds) or the new one with all its chunks, never a mix; two
  writers of one entry each publish a complete version and the last one wins.
  Entries the new one makes redundant (trimmable prefixes of it, whose block
  keys now all point to it) are deleted.
- ``touch``: a hit refreshes an entry's TTLs and LRU score (if it is still
  the version that was read).
- ``discard``: delete an entry a reader found corrupt, if it is still the
  version that was read.

Failures (Redis down) count in ``write_errors`` and lose only that job.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from .redis_layout import Chain, Keys, Manifest, decode_manifest, index_value, member, parse_index_value, split_member
from .redis_link import RedisLink, Unavailable

log = logging.getLogger("mlx_chatcache.store.redis")
GRACE = 60  # seconds a replaced or deleted version's chunks stay readable for readers in flight
_STOP = object()


class RedisWriter:
    def __init__(self, link: RedisLink, keys: Keys, budget: int, ttl: int, block: int, queue_size: int,
                 count: Callable[[str, int], None]):  # fmt: skip
        self.link, self.keys, self.budget, self.ttl, self.block = link, keys, budget, ttl, block
        self._count = count
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
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                job()
            except Unavailable:
                self._count("write_errors", 1)
            except Exception:  # a bug must not kill the writer: log it, lose the job
                log.exception("Redis cache tier: a background write failed")
                self._count("write_errors", 1)
            finally:
                self._queue.task_done()

    # ------------------------------------------------------------------ jobs
    def publish(self, m: Manifest, chunks: list[bytes]) -> bool:
        """Publish an entry (False: refused by the budget; raises Unavailable)."""
        victims = self.link.run(lambda r: self.plan(r, m.nbytes, m.key is not None, member(m.namespace, m.eid)))
        if victims is None:
            self._count("refused", 1)
            return False
        self.link.run(lambda r: self._write_chunks(r, m, chunks))
        chain = Chain(m.namespace, m.tokens, self.block)
        index = [self.keys.block(m.namespace, h) for h in chain.hashes] if m.trimmable else \
            [self.keys.end(m.namespace, chain.hashes[-1])]  # fmt: skip
        replaced = self.link.run(lambda r: self._publish(r, m, index))
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

    def _publish(self, r, m: Manifest, index: list[str]) -> list:
        name, value = member(m.namespace, m.eid), index_value(len(m.tokens), m.eid)
        pipe = r.pipeline(transaction=True)
        pipe.set(self.keys.manifest(m.namespace, m.eid), m.encode(), ex=self.ttl, get=True)
        for k in index:
            pipe.set(k, value, ex=self.ttl, get=True)
        pipe.zadd(self.keys.lru, {name: time.time()})
        pipe.hset(self.keys.meta, name, f"{m.nbytes}:{int(m.key is not None)}")
        return pipe.execute()[: 1 + len(index)]

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

    def _delete(self, r, name: str, version: str | None = None) -> None:
        """Delete entry ``name`` (only if its manifest is still ``version``, when given)."""
        parts = split_member(name)
        if parts is None:
            return
        mkey = self.keys.manifest(*parts)

        def txn(pipe):
            raw = pipe.get(mkey)
            m = decode_manifest(raw, *parts) if raw else None
            if version is not None and (m is None or m.version != version):
                return
            pipe.multi()
            pipe.delete(mkey)
            pipe.zrem(self.keys.lru, name)
            pipe.hdel(self.keys.meta, name)
            for k in self.keys.chunks(m) if m else ():
                pipe.expire(k, GRACE)

        r.transaction(txn, mkey)

    def touch(self, m: Manifest) -> None:
        chain = Chain(m.namespace, m.tokens, self.block)
        index = [self.keys.block(m.namespace, h) for h in chain.hashes] if m.trimmable else \
            [self.keys.end(m.namespace, chain.hashes[-1])]  # fmt: skip

        def run(r):
            current = decode_manifest(r.get(self.keys.manifest(m.namespace, m.eid)) or b"", m.namespace, m.eid)
            if current is None or current.version != m.version:
                return  # replaced or deleted since it was read: keep the old chunks' grace period
            pipe = r.pipeline(transaction=False)
            pipe.expire(self.keys.manifest(m.namespace, m.eid), self.ttl)
            for k in self.keys.chunks(m):
                pipe.expire(k, self.ttl + GRACE)
            for k in index:
                pipe.expire(k, self.ttl)
            pipe.zadd(self.keys.lru, {member(m.namespace, m.eid): time.time()}, xx=True)
            pipe.execute()

        self.link.run(run)

    def discard(self, m: Manifest) -> None:
        self.link.run(lambda r: self._delete(r, member(m.namespace, m.eid), m.version))

    # ------------------------------------------------------------------ budget
    def plan(self, r, nbytes: int, pinned: bool, name: str) -> list[str] | None:
        """Entries to evict so ``nbytes`` more fit the budget (None: refused);
        forgets entries that expired since their last use."""
        if nbytes > self.budget:
            return None
        sizes = {k.decode(): v.decode() for k, v in r.hgetall(self.keys.meta).items()}
        order = [(k.decode(), s) for k, s in r.zrange(self.keys.lru, 0, -1, withscores=True)]
        listed = dict(order)
        expired = [k for k, s in order if s < time.time() - self.ttl] + [k for k in sizes if k not in listed]
        if expired:
            pipe = r.pipeline(transaction=False)
            pipe.zrem(self.keys.lru, *expired)
            pipe.hdel(self.keys.meta, *expired)
            pipe.execute()
        live = [(k, *_size(sizes.get(k))) for k, _ in order if k not in expired and k != name]
        total = sum(n for _, n, _ in live)
        self.known_entries, self.known_bytes = len(live) + 1, total + nbytes  # as it will be if it fits
        need = total + nbytes - self.budget
        if need <= 0:
            return []
        candidates = [c for c in live if not c[2]] + ([c for c in live if c[2]] if pinned else [])
        victims, freed = [], 0
        for k, n, _ in candidates:
            if freed + n > nbytes:
                continue  # would evict more than the new entry's size
            victims.append(k)
            freed += n
            if freed >= need:
                self.known_entries -= len(victims)
                self.known_bytes -= freed
                return victims
        self.known_entries, self.known_bytes = len(live), total
        return None


def _size(raw: str | None) -> tuple[int, bool]:
    try:
        n, pinned = raw.split(":")
        return int(n), pinned == "1"
    except (AttributeError, ValueError):
        return 0, False
