"""Shared by the CLI tests that run the real ``mlxcc``: the runner, the one-line
error check, waiting, unwritable folders and files that are not ours to replace.

Unwritable folders: tests run as root here, and root ignores permission bits,
so a folder is made unwritable with ``chattr +i`` (immutable: not even root can
create a file in it) when running as root, with ``chmod 555`` otherwise; the
test is skipped when neither works.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TIMEOUT = 60


@contextlib.contextmanager
def unwritable(folder: Path):
    """While active, no file can be created in ``folder`` (see the module doc)."""
    if os.geteuid() == 0:
        r = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot make a folder read-only for root here: {r.stderr.decode().strip()}")
        undo = ["chattr", "-i", str(folder)]
    else:
        folder.chmod(0o555)
        undo = ["chmod", "755", str(folder)]
    try:
        probe = folder / ".probe"
        with contextlib.suppress(OSError):
            probe.touch()
            probe.unlink()
            pytest.skip("the folder is still writable")
        yield folder
    finally:
        subprocess.run(undo, check=True)


def mlxcc(*args, stdin: str | None = None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_chatcache", *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)  # fmt: skip


def one_error_line(p: subprocess.CompletedProcess) -> str:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert "Traceback" not in p.stderr and len(lines) == 1, p.stderr
    return lines[0]


def wait_for(ok, seconds: float = TIMEOUT) -> None:
    end = time.monotonic() + seconds
    while not ok():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def foreign_files(folder: Path, model_dir) -> dict[str, Path]:
    """Files no save may replace without --force: a text file and a model's weights."""
    notes = folder / "notes.txt"
    notes.write_text("my notes\n")
    weights = folder / "model.safetensors"
    weights.write_bytes((Path(model_dir) / "model.safetensors").read_bytes())
    return {"notes": notes, "weights": weights}
