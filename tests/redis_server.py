"""A real ``redis-server`` for tests: started on a free loopback port in a temp
folder (no persistence), stopped after; can be killed and restarted mid-test.
:class:`RedisCluster` is three of them as the masters of a Redis Cluster.

``shared_redis`` (fixture) is one server per module, emptied before each test
that asks for ``redis_server`` (the same server); ``redis_cluster`` one cluster
per module. When the ``redis-server`` binary is missing the tests using them
are skipped, except under CI (``CI=true``), where they fail: .ci/run installs
it. (benchmarks/redis_replicas.py uses :class:`RedisServer` too, passing ``binary``.)
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


def free_cluster_port() -> int:
    """A free port below 55536 whose cluster bus port (10000 higher) is free too."""
    import random

    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


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

    def __init__(self, folder: Path, port: int | None = None, binary: str | None = None, args: tuple = ()):
        self.binary = binary or redis_binary()
        self.folder, self.port, self.args = Path(folder), port or free_port(), tuple(args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log = open(self.folder / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder), "--daemonize", "no", *self.args],
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


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory):
    """One Redis for a module's tests."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(shared_redis):
    """The module's Redis, running, empty and with its default settings."""
    if shared_redis.proc is None or shared_redis.proc.poll() is not None:  # killed by the last test
        shared_redis.start()
    r = shared_redis.client()  # (a server the last test paused answers once the pause ends)
    r.flushall()
    r.config_set("maxmemory", 0)
    return shared_redis


class RedisCluster:
    """Three ``redis-server --cluster-enabled yes`` on free loopback ports, joined as the
    three masters of a cluster (no replicas) by ``redis-cli --cluster create``."""

    def __init__(self, folder: Path):
        args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000")
        self.nodes = [RedisServer(Path(folder) / f"n{i}", free_cluster_port(), args=args) for i in range(3)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> "RedisCluster":
        for n in self.nodes:
            n.start()
        cli = shutil.which("redis-cli") or str(Path(self.nodes[0].binary).with_name("redis-cli"))
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)  # fmt: skip
        deadline = time.monotonic() + timeout
        while any(n.client().info("cluster").get("cluster_enabled") != 1 or b"cluster_state:ok" not in
                  n.client().execute_command("CLUSTER", "INFO") for n in self.nodes):  # fmt: skip
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()
