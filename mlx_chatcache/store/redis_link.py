"""The Redis tier's connection: fail fast, log once, reconnect with backoff.

:class:`RedisLink` wraps one ``redis.Redis`` client (its connection pool is
shared by the generation worker and the tier's writer thread). ``run(fn)``
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


def connect(url: str, socket_timeout: float, connect_timeout: float):
    """A ``redis.Redis`` client for ``url`` (no connection is made yet)."""
    redis = redis_module()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    try:
        return redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
        )  # fmt: skip
    except ValueError as e:
        raise UsageError(f"--cache-redis {url!r} is not a Redis URL ({e}); use redis://host:port/db") from None


class RedisLink:
    def __init__(self, client, url: str, backoff: tuple[float, float], clock: Callable[[], float] = time.monotonic):
        self.client, self.url = client, url
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
            result = fn(self.client)
        except self._errors as e:
            self._failed(e)
            raise Unavailable(str(e)) from e
        if self.down:
            self._recovered()
        return result

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
    """What counts as "Redis cannot be used": connection loss, timeouts, a
    server that refuses (loading its dump, out of memory, read-only replica)."""
    redis = redis_module()
    return (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError)
