"""Start and stop ``mlxcc serve`` in a subprocess on a free loopback port, bounded in time.

``ServerProcess(model, cache_dir, *flags)`` is a context manager: entering
starts ``python -m mlx_chatcache serve --host 127.0.0.1 --port P ...`` and waits
(at most ``start_timeout`` seconds) until ``GET /health`` answers; leaving
stops it with SIGINT (the server drains: running requests finish), then SIGKILL after
``stop_timeout`` seconds. ``base_url`` is ``http://127.0.0.1:P/v1``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str | Path, cache_dir: str | Path | None, *flags: str,
                 start_timeout: float = 90.0, stop_timeout: float = 20.0, env: dict | None = None):  # fmt: skip
        self.port = free_port()
        self.args = [sys.executable, "-m", "mlx_chatcache", "serve", "--model", str(model),
                     "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *flags]  # fmt: skip
        if cache_dir is not None:
            self.args += ["--cache-dir", str(cache_dir)]
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    def health(self) -> dict:
        with urllib.request.urlopen(self.root + "/health", timeout=5) as r:
            return json.loads(r.read())

    def __enter__(self) -> "ServerProcess":
        self._log_file = tempfile.TemporaryFile()  # not a pipe: a chatty server never blocks on it
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlxcc serve exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                self.model_id = self.health()["model"]
                return self
            except OSError:
                time.sleep(0.2)
        self.__exit__(None, None, None)
        raise TimeoutError(f"mlxcc serve did not answer /health within {self.start_timeout} s")

    def read_log(self) -> str:
        self._log_file.seek(0)
        return self._log_file.read().decode(errors="replace")

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
