"""The README's quick start runs verbatim on a fresh clone: its lines are run, one by one, in
a copy of the repository's tracked files (what a clone holds), each exiting 0. ``make install``
finds the venv made already (``.venv`` links to this checkout's), so it installs nothing; the
chats read no input (end of input: they end at once). On the offline demo model."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def quick_start(readme: str) -> list[str]:
    """The command lines of the README's "Quick start" block (continuations joined, comments dropped)."""
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = []
    for raw in block.replace("\\\n", " ").splitlines():
        code = raw.split("  #", 1)[0].rstrip()  # a comment after a command
        if code.strip() and not code.lstrip().startswith("#"):
            lines.append(code.strip())
    return lines


def test_the_quick_start_lines_are_found():
    lines = quick_start((ROOT / "README.md").read_text())
    assert lines[:2] == ["make install", ". .venv/bin/activate"] and len(lines) >= 8
    assert all(line.startswith(("make ", ". ", "mlxcc ")) for line in lines), lines


def test_the_quick_start_runs_verbatim_on_a_fresh_clone(demo_gguf, tmp_path):
    venv = Path(sys.executable).parent.parent
    if not (venv / ".installed").exists() or shutil.which("make") is None:
        pytest.skip("the quick start runs in a venv made by 'make install' (and needs make)")
    clone = tmp_path / "clone"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, clone / name)
    (clone / ".venv").symlink_to(venv)
    env = {**os.environ, "MLXCC_HOME": str(tmp_path / "home"), "PATH": os.defpath}
    env.pop("VIRTUAL_ENV", None)
    lines = quick_start((clone / "README.md").read_text())
    script = "set -e\n" + "\n".join(f"echo '>>> {i}' >&2\n{line}" for i, line in enumerate(lines))
    p = subprocess.run(["bash", "-c", script], cwd=clone, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=900)  # fmt: skip
    ran = re.findall(r">>> (\d+)", p.stderr)
    assert p.returncode == 0, f"line {ran[-1] if ran else 0} failed: {lines[int(ran[-1]) if ran else 0]}\n{p.stderr[-3000:]}"
    assert len(ran) == len(lines) and "Traceback" not in p.stderr
    assert "reused" in p.stderr and (clone / "chat.safetensors").is_file() and (clone / "rules.safetensors").is_file()
