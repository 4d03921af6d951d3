"""`mlxcc generate` / `cache-prompt` on the real demo model (SmolLM2-135M-Instruct,
Q4_1 GGUF, greedy). Short prompts and replies: MLX's CPU quantized matmul runs at
~8 tokens/s here, so each check costs seconds."""

import re

import pytest

from mlx_chatcache.files.mlxcc_format import read_cache_info
from mlx_chatcache.cli.main import main
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.generation.text import generate
from mlx_chatcache.models.loading import load
from mlx_chatcache.generation.templates import render_chat

pytestmark = pytest.mark.real_model
SYSTEM = "You are a helpful assistant. Answer in one short sentence."


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def reused_of(err: str) -> int:
    return int(re.search(r"(\d+) reused", err).group(1))


def test_cache_prompt_then_generate_equals_uncached(demo_gguf, tmp_path, capsys):
    f = str(tmp_path / "sys.safetensors")
    run_cli(capsys, "cache-prompt", "--model", demo_gguf, "--system-prompt", SYSTEM, "--prompt-cache-file", f)
    n_cached = read_cache_info(f).num_tokens
    q = "What is the capital of France?"
    cached, err = run_cli(capsys, "generate", "--model", demo_gguf, "-p", q, "-m", "10",
                          "--prompt-cache-file", f, "--verbose")
    uncached, _ = run_cli(capsys, "generate", "--model", demo_gguf, "-p", q, "-m", "10", "--system-prompt", SYSTEM)
    assert cached == uncached
    assert "Paris" in cached
    assert reused_of(err) >= n_cached - 2


def test_rolling_cache_three_turns(demo_gguf, tmp_path, capsys):
    f = str(tmp_path / "roll.safetensors")
    turns = ["What is the capital of France?", "And of Italy?", "And of Spain?"]
    outs = []
    for i, q in enumerate(turns):
        args = ["generate", "--model", demo_gguf, "-p", q, "-m", "8", "--save-prompt-cache", f, "--verbose"]
        if i:
            held = read_cache_info(f).num_tokens
            args += ["--prompt-cache-file", f]
        out, err = run_cli(capsys, *args)
        outs.append(out)
        if i:  # everything the file held is reused, but for a few boundary tokens
            assert reused_of(err) >= held - 3
    info = read_cache_info(f)
    model, tokenizer = load(demo_gguf)
    expected = generate(model, tokenizer, render_chat(tokenizer, info.messages[:-1]),
                        config=DEFAULTS.updated(max_tokens=8))
    assert outs[-1] == expected + "\n"
