"""`mlxcc chat` on the real demo model (SmolLM2-135M-Instruct GGUF): a scripted chat
stopped after turn 1 (in-process) and resumed in a new process prints exactly what one
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


def chat_args(demo_gguf, session) -> list[str]:
    return ["chat", "--model", demo_gguf, "--session", session, "--max-tokens", "8", "--verbose"]


def test_resumed_chat_equals_uninterrupted(demo_gguf, tmp_path, cli):
    home = tmp_path / "home"
    full = cli(*chat_args(demo_gguf, "full"), stdin="".join(t + "\n" for t in TURNS), env={"MLXCC_HOME": home})
    first = cli(*chat_args(demo_gguf, "s"), stdin=TURNS[0] + "\n", env={"MLXCC_HOME": home})
    assert full.returncode == first.returncode == 0, full.stderr + first.stderr
    # the resume: a new process
    second = subprocess.run([sys.executable, "-m", "mlx_chatcache", *chat_args(demo_gguf, "s")], input=TURNS[1] + "\n",
                            capture_output=True, text=True, env={**os.environ, "MLXCC_HOME": str(home)},
                            timeout=600)  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert first.stdout + second.stdout == full.stdout
    assert "Paris" in first.stdout
    m = RESUMED.search(second.stderr)
    assert m, second.stderr
    new, reused, recomputed = map(int, STATS.search(second.stderr).groups())
    assert recomputed == 0 and reused == int(m.group(1))
    full_turn2 = [tuple(map(int, x.groups())) for x in STATS.finditer(full.stderr)][1]
    assert (new, reused, recomputed) == full_turn2  # the same work as the uninterrupted run
