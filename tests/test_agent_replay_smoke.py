"""Smoke test of benchmarks/agent_replay.py: three turns of the recorded session (system prompt cut short)
on the tiny model through /v1/messages, /v1/responses and mlx-lm's server; the table is printed and written,
and from turn 2 on mlxcc computes no more than each turn's new tokens plus one block."""

from __future__ import annotations

import re

import pytest
from test_benchmarks_smoke import run

pytestmark = pytest.mark.bench  # make bench-smoke runs it (pyproject.toml), with the other scripts


def test_agent_replay_smoke(tmp_path):
    results = tmp_path / "RESULTS.md"
    out = run("agent_replay.py", "--tiny", "--turns", "3", "--system-chars", "1500", "--max-new", "2",
              "--write-results", "--results", str(results), timeout=300)  # fmt: skip
    assert re.search(r"^\| turn +\| new tokens +\| mlxcc /v1/messages prompt", out, re.M), out
    over = int(re.search(r"computed - new \(max\), mlxcc: (-?\d+)", out).group(1))
    assert over <= 64, out
    assert "<!-- BEGIN agent_replay -->" in results.read_text()
