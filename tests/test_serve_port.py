"""``mlxcc serve`` checks its port before the model loads: a port out of range
is an argparse error, a port another program holds is one line and exit 1,
fast (``--model`` names a folder that does not exist: had the model been
loaded first, the error would be about it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

import uvicorn  # noqa: F401


def _serve(*flags: str, tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mlx_chatcache", "serve", "--host", "127.0.0.1",
                        "--model", str(tmp_path / "no-such-model"), "--cache-dir", str(tmp_path / "cache"), *flags],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "MLXCC_HOME": str(tmp_path)})  # fmt: skip
    return r, time.monotonic() - t0


@pytest.mark.parametrize("port", ["70000", "-1", "0", "http"])
def test_a_port_out_of_range_is_one_line(port, tmp_path):
    r, _ = _serve("--port", port, tmp_path=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"invalid port '{port}'" in lines[0] and "1 to 65535" in lines[0], r.stderr


def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r, took = _serve("--port", str(port), tmp_path=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0] and "--port" in lines[0]
    assert "no-such-model" not in r.stderr and "Traceback" not in r.stderr
    assert took < 30
