"""`mlxcc chat` on the real demo model (SmolLM2-135M-Instruct GGUF): a scripted chat
stopped after turn 1 and resumed in a new process prints exactly what one
uninterrupted run prints, and the resumed turn recomputes no history."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real_model

TURNS = ["What is the capital of France?", "And of Italy?"]
STATS = re.compile(r"\[stats\] prompt: (\d+) new \+ (\d+) reused tokens \((\d+) recomputed\)")
RESUMED = re.compile(r"resumed session 's': 1 turn, (\d+) tokens in the cache, 0 tokens recomputed")


def chat(demo_gguf, home, stdin, session):
    env = {**os.environ, "MLXCC_HOME": str(home)}
    cmd = [sys.executable, "-m", "mlx_chatcache", "chat", "--model", demo_gguf, "--session", session,
           "--max-tokens", "8", "--verbose"]
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    return p


def test_resumed_chat_equals_uninterrupted(demo_gguf, tmp_path):
    home = tmp_path / "home"
    full = chat(demo_gguf, home, "".join(t + "\n" for t in TURNS), "full")
    first = chat(demo_gguf, home, TURNS[0] + "\n", "s")
    second = chat(demo_gguf, home, TURNS[1] + "\n", "s")
    assert first.stdout + second.stdout == full.stdout
    assert "Paris" in first.stdout
    m = RESUMED.search(second.stderr)
    assert m, second.stderr
    new, reused, recomputed = map(int, STATS.search(second.stderr).groups())
    assert recomputed == 0 and reused == int(m.group(1))
    full_turn2 = [tuple(map(int, x.groups())) for x in STATS.finditer(full.stderr)][1]
    assert (new, reused, recomputed) == full_turn2  # the same work as the uninterrupted run
