"""The Redis tier: values in Redis (or Valkey, or a Redis Cluster), shared by replicas.

``RedisTier(url)`` keeps each value (:mod:`.values`) under its own key,
``PREFIX:KEY``, written once with ``SET NX`` and a TTL (``redis_ttl_seconds``;
every read refreshes it with ``GETEX``). Nothing else is kept: no index, no
counts. Redis bounds what it holds itself: run it with ``maxmemory`` and an
``allkeys-lru`` (or ``volatile-lru``) policy, and a value it evicts or lets
expire is a miss like any other. Every command names one key, so the same code
runs on a Redis Cluster: a URL naming any node of a cluster (``cluster_enabled``
in ``INFO cluster``) uses the whole cluster through redis-py's cluster client.
A pin means nothing here: Redis's own policy decides (a value in use is read,
and so refreshed, at every turn).

Reads happen on the calling thread (several keys in one pipeline round trip);
writes are queued for one background thread (``redis_write_queue`` puts at most:
more are dropped, counted in ``dropped``), which first asks which keys exist, then
sends only the missing values and refreshes the TTL of the others. When Redis
is down, slow or restarting (:mod:`.redis_link`), calls return misses at once
until the backoff delay passes: requests are served from the other tiers. A value
is checked (checksums, key, scope, tokens) by the store before use: replicas must
trust the Redis server for who wrote a value, never for its integrity.
"""

from __future__ import annotations

import queue
import threading
import time

from ..config import SERVER_DEFAULTS
from .redis_link import RedisLink, Unavailable, connect
from .tiers import Tier


class RedisTier(Tier):
    name = "redis"

    def __init__(self, url: str, *, ttl: int | None = None, prefix: str | None = None,
                 queue_size: int | None = None, socket_timeout: float | None = None,
                 backoff: tuple[float, float] | None = None, client=None):  # fmt: skip
        d = SERVER_DEFAULTS
        super().__init__(None)
        self.counters.update({"dropped": 0, "write_errors": 0, "lookup_errors": 0, "written": 0})
        self.url, self.ttl, self.prefix = url, int(ttl or d.redis_ttl_seconds), prefix or d.redis_key_prefix
        timeout = d.redis_socket_timeout if socket_timeout is None else socket_timeout
        timeouts = (timeout, min(timeout, d.redis_connect_timeout))
        self.link = RedisLink(client or connect(url, *timeouts), url, backoff or d.redis_backoff_seconds,
                              make_cluster=None if client else lambda: connect(url, *timeouts, cluster=True))
        self._queue: queue.Queue = queue.Queue(d.redis_write_queue if queue_size is None else queue_size)
        self._thread = threading.Thread(target=self._write_loop, name="mlxcc-redis-writer", daemon=True)
        self._thread.start()

    def _name(self, key: str) -> str:
        return f"{self.prefix}:{key}"

    def _each(self, command: str, keys, *args) -> list:
        """``command`` on each key, in one pipeline (single-key commands: cluster-safe)."""

        def run(r):
            pipe = r.pipeline(transaction=False)
            for k in keys:
                getattr(pipe, command)(self._name(k), *args)
            return pipe.execute()

        return self.link.run(run) if keys else []

    # ------------------------------------------------------------------ reading
    def has(self, keys):
        try:
            return [bool(n) for n in self._each("exists", keys)]
        except Unavailable:
            self.counters["lookup_errors"] += 1
            return [False] * len(keys)

    def get(self, keys):
        try:
            out = self._each("getex", keys, self.ttl)
        except Unavailable:
            self.counters["lookup_errors"] += 1
            return [None] * len(keys)
        self.counters["hits"] += sum(v is not None for v in out)
        return out

    def drop(self, key):
        try:
            self._each("delete", [key])
        except Unavailable:
            pass  # its TTL ends it

    # ------------------------------------------------------------------ writing
    def put(self, values):
        try:
            self._queue.put_nowait({k: v.data for k, v in values.items()})
        except queue.Full:
            self.counters["dropped"] += 1

    def _write_loop(self) -> None:
        while True:
            values = self._queue.get()
            try:
                if values is None:
                    return
                self.link.run(lambda r: self._write(r, values))
            except Unavailable:
                self.counters["write_errors"] += 1
            finally:
                self._queue.task_done()

    def _write(self, r, values: dict[str, bytes]) -> None:
        keys = list(values)
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self._name(k))
        have = pipe.execute()
        pipe = r.pipeline(transaction=False)
        for k, held in zip(keys, have):
            if held:
                pipe.expire(self._name(k), self.ttl)
            else:
                pipe.set(self._name(k), values[k], nx=True, ex=self.ttl)
        pipe.execute()
        self.counters["written"] += sum(not held for held in have)
        self.counters["added"] += sum(not held for held in have)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait up to ``timeout`` seconds for queued writes (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # ------------------------------------------------------------------ state
    def stats(self):
        """Counters, and Redis's own memory use and ``maxmemory`` (its budget; None: none, or
        Redis unreachable), summed over a cluster's nodes. Values are not counted."""
        used = limit = None
        try:
            info = self.link.run(lambda r: r.info("memory"))
            nodes = [info] if "used_memory" in info else list(info.values())
            used, limit = sum(n["used_memory"] for n in nodes), sum(n["maxmemory"] for n in nodes) or None
        except Unavailable:
            pass
        return {**super().stats(), "budget": limit, "bytes": used, "entries": None, "blocks": None, "records": None,
                "pending_writes": self._queue.qsize(), "connected": not self.link.down,
                "outages": self.link.outages, "cluster": self.link.cluster}  # fmt: skip

    def close(self) -> None:
        """Let queued writes finish (a few seconds at most), then stop."""
        self.flush(5.0)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(2.0)
        self.link.close()


__all__ = ["RedisTier"]
