"""Claude Code and Codex, the real CLIs from npm (``make install`` puts them in ``.venv/npm``),
against a real ``mlxcc serve`` on a tiny random-weight model with a long context and a
tool-call template (tests/reply_model.py: its replies end, as an agent needs).

Each CLI runs two turns as a user would (a prompt, then the same conversation continued),
exits 0 with the model's reply as its result, and on its second turn the server serves at
least 90 % of the first turn's prompt from the store (``/health``'s ``last_job``; Claude
Code's own ``usage.cache_read_input_tokens`` says the same). Their prompts are kept to a
few thousand tokens (two of Claude Code's tools, Codex's instructions in a short file) so
each test takes seconds; everything else is what the CLIs send by themselves. Each CLI
gets a fresh home folder, no network but the server's loopback address, and a time limit.
Under CI a missing CLI fails; elsewhere it skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reply_model import build_reply_model
from server_process import ServerProcess


REPLY = "Hi there."
TIMEOUT = 240


def _cli(name: str) -> str:
    found = Path(sys.prefix) / "npm" / "node_modules" / ".bin" / name
    if found.exists():
        return str(found)
    if shutil.which(name):
        return shutil.which(name)
    if os.environ.get("CI"):
        pytest.fail(f"{name} is not installed: make install installs it with npm")
    pytest.skip(f"{name} is not installed (make install, with npm)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    folder = build_reply_model(root / "scripted", REPLY)
    with ServerProcess(folder, root / "cache", "--context-length", "131072", "--max-tokens", "64") as s:
        yield s


def _run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "NO_COLOR": "1"}
    p = subprocess.run(args, env={**base, **env}, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                       stdin=subprocess.DEVNULL)  # fmt: skip
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    return p


def _last_job(server) -> dict:
    return server.health()["last_job"]


def test_claude_code_two_turns(server, tmp_path):
    claude = _cli("claude")
    (tmp_path / "home").mkdir()
    (tmp_path / "project").mkdir()
    env = {"HOME": str(tmp_path / "home"), "ANTHROPIC_BASE_URL": server.root, "ANTHROPIC_API_KEY": "local",
           "ANTHROPIC_MODEL": server.model_id, "ANTHROPIC_DEFAULT_HAIKU_MODEL": server.model_id,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}  # fmt: skip
    tools = ["--tools", "Read,Bash", "--output-format", "json"]
    first = json.loads(_run([claude, "-p", "Say hello", *tools], env, tmp_path / "project").stdout)
    turn1 = _last_job(server)
    assert first["is_error"] is False and first["result"] == REPLY and first["stop_reason"] == "end_turn", first
    assert first["usage"]["output_tokens"] > 0
    second = json.loads(_run([claude, "-p", "--continue", "Say more", *tools], env, tmp_path / "project").stdout)
    turn2 = _last_job(server)
    assert second["is_error"] is False and second["result"] == REPLY, second
    assert second["session_id"] == first["session_id"]  # the same conversation, continued
    assert turn2["prompt_tokens"] > turn1["prompt_tokens"] > 2000
    assert turn2["cached_tokens"] >= 0.9 * turn1["prompt_tokens"], (turn1, turn2)
    assert second["usage"]["cache_read_input_tokens"] == turn2["cached_tokens"]  # what the server said it served


def test_codex_two_turns(server, tmp_path):
    codex = _cli("codex")
    home = tmp_path / "codex"
    home.mkdir()
    (tmp_path / "project").mkdir()
    (tmp_path / "instructions.md").write_text("You are a coding agent. Answer briefly.\n")
    (home / "config.toml").write_text(
        f'model = "{server.model_id}"\nmodel_provider = "mlxcc"\n'
        f'model_instructions_file = "{tmp_path / "instructions.md"}"\n\n'
        f'[model_providers.mlxcc]\nname = "mlxcc"\nbase_url = "{server.base_url}"\nwire_api = "responses"\n'
    )
    env = {"HOME": str(tmp_path), "CODEX_HOME": str(home)}
    flags = ["--skip-git-repo-check", "-c", "features.multi_agent=false", "-c", "features.goals=false"]
    first = _run([codex, "exec", *flags, "Say hello"], env, tmp_path / "project")
    turn1 = _last_job(server)
    assert REPLY in first.stdout, (first.stdout, first.stderr[-1000:])
    second = _run([codex, "exec", *flags, "resume", "--last", "Say more"], env, tmp_path / "project")
    turn2 = _last_job(server)
    assert REPLY in second.stdout, (second.stdout, second.stderr[-1000:])
    assert turn2["prompt_tokens"] > turn1["prompt_tokens"] > 2000
    assert turn2["cached_tokens"] >= 0.9 * turn1["prompt_tokens"], (turn1, turn2)
    assert server.health()["requests"]["responses"] >= 2
