"""A real ``redis-server`` for tests: started on a free loopback port in a temp
folder (no persistence), stopped after; can be killed and restarted mid-test.

``redis_server`` (fixture) yields a :class:`RedisServer`; ``shared_redis``
is one per module. When the ``redis-server`` binary is missing the tests using
them are skipped, except under CI (``CI=true``), where they fail: .ci/run
installs it. (benchmarks/redis_replicas.py uses :class:`RedisServer` too,
passing ``binary``.)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    """The redis-server binary; skips the test without it (fails it under CI)."""
    path = shutil.which("redis-server")
    if path is None:
        message = "redis-server is not installed (Debian: apt-get install redis-server)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + "; CI must install it (.ci/run does)", pytrace=False)
        pytest.skip(message)
    return path


class RedisServer:
    """``redis-server`` on ``port`` (default: a free one) with its files in ``folder``."""

    def __init__(self, folder: Path, port: int | None = None, binary: str | None = None):
        self.binary = binary or redis_binary()
        self.folder, self.port = Path(folder), port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log = open(self.folder / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder), "--daemonize", "no"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=self.folder,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self._tail()}")
            if self.ping():
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def kill(self) -> None:
        """SIGKILL: every connection drops, everything stored is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        if getattr(self, "log", None):
            self.log.close()

    def _tail(self) -> str:
        try:
            return (self.folder / "redis.log").read_text(errors="replace")[-500:]
        except OSError:
            return ""


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory):
    """One Redis for a module's tests (two-server tests share it)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


def tier_factory(url: str, block: int):
    """``(make, close_all)``: ``make(**kw)`` opens a RedisTier on ``url`` (budget 1 GiB and
    ``block`` unless given); ``close_all()`` closes every tier it made."""
    from mlx_chatcache.store.redis_tier import RedisTier

    made = []

    def make(**kw):
        kw.setdefault("block", block)
        tier = RedisTier(url, kw.pop("budget", 1 << 30), **kw)
        made.append(tier)
        return tier

    def close_all():
        for t in made:
            t.close()

    return make, close_all
