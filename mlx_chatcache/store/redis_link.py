"""The Redis tier's connection: fail fast, log once, reconnect with backoff.

:class:`RedisLink` wraps one client (its connection pool is shared by the
generation worker and the tier's writer thread): ``redis.Redis``, or, once the
first call finds ``cluster_enabled`` in ``INFO cluster``, ``redis.cluster.RedisCluster``
over the whole cluster the URL names a node of. ``run(fn)``
calls ``fn(client)``; when Redis is unreachable, slow (a socket timeout) or was
restarted (a dead pooled connection), the call raises :class:`Unavailable`, the
link counts Redis as down and refuses calls without touching the network until
a backoff delay has passed (doubling from the first to the longest delay while
it stays down), then lets one call try again. The first failure of an outage
is logged once (warning) and so is the recovery; nothing in between.

redis-py's own retries are switched off: a request must never wait through
several attempts, it falls back to the memory and disk tiers instead.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

from ..errors import UsageError, one_line

log = logging.getLogger("mlx_chatcache.store.redis")
T = TypeVar("T")


class Unavailable(Exception):
    """Redis cannot be used right now (down, slow, restarting, or backing off)."""


def redis_module():
    try:
        import redis
    except ImportError:
        raise UsageError(
            "the Redis cache tier needs the redis package: pip install 'mlx-chatcache[redis]'"
        ) from None
    return redis


def connect(url: str, socket_timeout: float, connect_timeout: float, cluster: bool = False):
    """A client for ``url`` (no connection is made yet): a cluster client with ``cluster``."""
    redis = redis_module()
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry

    timeouts = {"socket_timeout": socket_timeout, "socket_connect_timeout": connect_timeout,
                "retry": Retry(NoBackoff(), 0)}  # fmt: skip
    try:
        if cluster:
            return RedisCluster.from_url(url, **timeouts)
        return redis.Redis.from_url(url, health_check_interval=0, **timeouts)
    except ValueError as e:
        raise UsageError(f"--cache-redis {url!r} is not a Redis URL ({e}); use redis://host:port/db") from None


class RedisLink:
    def __init__(self, client, url: str, backoff: tuple[float, float], clock: Callable[[], float] = time.monotonic,
                 make_cluster: Callable[[], object] | None = None):  # fmt: skip
        """``make_cluster``: the cluster client to use when ``client``'s server is a cluster node."""
        self.client, self.url, self._make_cluster = client, url, make_cluster
        self.cluster = False
        self.first_delay, self.max_delay = backoff
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._delay = self.first_delay
        self.down = False
        self.outages = 0
        self.failures = 0
        self._errors = _errors()

    def available(self) -> bool:
        """False while backing off after a failure (no network is touched)."""
        return not self.down or self._clock() >= self._down_until

    def run(self, fn: Callable[[object], T]) -> T:
        if not self.available():
            raise Unavailable(f"Redis at {self.url} is down; retrying later")
        try:
            if self._make_cluster is not None:
                self._detect()
            result = fn(self.client)
        except self._errors as e:
            self._failed(e)
            raise Unavailable(str(e)) from e
        if self.down:
            self._recovered()
        return result

    def _detect(self) -> None:
        """Use the cluster client when the server is a cluster node (asked once, on the first call that connects)."""
        if self.client.info("cluster").get("cluster_enabled"):
            self.client.close()
            self.client, self.cluster = self._make_cluster(), True
        self._make_cluster = None

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self.failures += 1
            if not self.down:
                self.down, self._delay = True, self.first_delay
                self.outages += 1
                log.warning(
                    "Redis cache tier at %s failed (%s: %s); serving from the other tiers, reconnecting with backoff",
                    self.url, type(e).__name__, one_line(str(e), 200),
                )  # fmt: skip
            else:
                self._delay = min(self._delay * 2, self.max_delay)
            self._down_until = self._clock() + self._delay

    def _recovered(self) -> None:
        with self._lock:
            if self.down:
                self.down = False
                log.warning("Redis cache tier at %s is reachable again", self.url)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # closing a broken pool must not fail shutdown
            pass


def _errors() -> tuple[type[BaseException], ...]:
    """What counts as "Redis cannot be used": every error of redis-py (connection loss,
    timeouts, a server that refuses: loading its dump, out of memory, a read-only
    replica, a cluster slot whose master is down) and of the socket."""
    redis = redis_module()
    return (redis.RedisError, OSError)
