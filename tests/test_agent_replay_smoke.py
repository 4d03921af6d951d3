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


def test_cut_layers_keeps_the_first_layers_of_a_model_that_then_loads(tmp_path):
    """``--layers N`` (the servers' own per-turn cost): the folder's model keeps its first N
    layers, loads through the real loader and gives the logits of its first N layers."""
    import sys
    from pathlib import Path

    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from agent_replay import cut_layers
    from mlx_chatcache.models.loading import load
    from tiny_models import build_tiny_model

    folder = build_tiny_model("llama", tmp_path / "m")
    full, _ = load(str(folder))
    assert len(full.model.layers) > 1
    assert "first 1 layer" in cut_layers(folder, 1)
    cut, _ = load(str(folder))
    assert len(cut.model.layers) == 1
    full.model.layers = full.model.layers[:1]
    ids = mx.array([[3, 4, 5, 6]])
    np.testing.assert_array_equal(np.array(cut(ids)), np.array(full(ids)))
