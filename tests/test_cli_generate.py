"""`mlxcc generate`, `mlxcc cache-prompt` and `mlxcc cache info` through the real
command-line entry point, on the tiny models (greedy decoding throughout)."""

import json
import re
import subprocess
import sys

import pytest

from mlx_chatcache.cache import can_trim_prompt_cache
from mlx_chatcache.files.mlxcc_format import load_prompt_cache, read_cache_info
from mlx_chatcache.files.tokens import common_prefix_len
from mlx_chatcache.cli.main import main
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.generation.text import generate
from mlx_chatcache.models.loading import load
from mlx_chatcache.generation.templates import render_chat

KINDS = ["llama", "sliding", "hybrid"]
SYSTEM = "You are a terse assistant who answers about rivers and mountains of the world."


def run_cli(capsys, *argv):
    """Run mlxcc in-process; returns (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def reused_of(stderr: str) -> int:
    m = re.search(r"(\d+) reused", stderr)
    assert m, f"no reused count in: {stderr!r}"
    return int(m.group(1))


@pytest.mark.parametrize("kind", KINDS)
def test_cache_prompt_then_generate_equals_uncached(kind, tiny_model_dirs, tmp_path, capsys):
    model_dir = str(tiny_model_dirs[kind])
    f = str(tmp_path / "sys.safetensors")
    code, out, _ = run_cli(capsys, "cache-prompt", "--model", model_dir, "--system-prompt", SYSTEM,
                           "--prompt-cache-file", f)
    assert code == 0 and "Cached" in out
    cached = read_cache_info(f)
    code, from_cache, err = run_cli(capsys, "generate", "--model", model_dir, "-p", "Name a river.",
                                    "-m", "16", "--prompt-cache-file", f, "--verbose")
    assert code == 0
    code, uncached, _ = run_cli(capsys, "generate", "--model", model_dir, "-p", "Name a river.",
                                "-m", "16", "--system-prompt", SYSTEM)
    assert code == 0
    assert from_cache == uncached and len(from_cache.strip()) > 0
    # the whole cached system prompt is a prefix of the new prompt: all of it is reused
    assert reused_of(err) >= cached.num_tokens - 2


@pytest.mark.parametrize("kind", KINDS)
def test_rolling_cache_matches_single_uncached_call(kind, tiny_model_dirs, tmp_path, capsys):
    model_dir = str(tiny_model_dirs[kind])
    f = str(tmp_path / "roll.safetensors")
    turns = ["Hello, who are you?", "Tell me about the Nile.", "And the Amazon?"]
    outputs, reused = [], []
    for i, text in enumerate(turns):
        args = ["generate", "--model", model_dir, "-p", text, "-m", "12", "--save-prompt-cache", f, "--verbose"]
        if i:
            before = read_cache_info(f)
            trimmable_before = can_trim_prompt_cache(load_prompt_cache(f))
            args += ["--prompt-cache-file", f]
        code, out, err = run_cli(capsys, *args)
        assert code == 0, err
        outputs.append(out)
        if i:
            reused.append(reused_of(err))
            model, tokenizer = load(model_dir)
            prompt = render_chat(tokenizer, before.messages + [{"role": "user", "content": text}])
            # reuse is exactly the common prefix of what the file held and the new
            # prompt, unless the cache must be trimmed and cannot be (a wrapped
            # rotating window): then it is rebuilt. Tiny random models emit
            # invalid UTF-8, so their replies do not always re-tokenize the same.
            common = common_prefix_len(before.tokens, prompt)
            fits = common == len(before.tokens) or trimmable_before
            assert reused[-1] == (common if fits else 0)
            if kind == "llama":  # trimmable: at least the whole previous prompt is reused
                assert reused[-1] >= len(render_chat(tokenizer, before.messages[:-1]))
    info = read_cache_info(f)
    assert [m["role"] for m in info.messages] == ["user", "assistant"] * 3
    # one uncached call on the same three-turn conversation prints the same last reply
    model, tokenizer = load(model_dir)
    prompt = render_chat(tokenizer, info.messages[:-1])
    expected = generate(model, tokenizer, prompt, config=DEFAULTS.updated(max_tokens=12))
    assert outputs[-1] == expected + "\n"


def test_raw_prefix_cache(tiny_model_dirs, tmp_path, capsys):
    model_dir = str(tiny_model_dirs["llama"])
    f = str(tmp_path / "raw.safetensors")
    prefix = "Once upon a time, in a land of rivers and mountains, "
    code, _, _ = run_cli(capsys, "cache-prompt", "--model", model_dir, "--ignore-chat-template",
                         "-p", prefix, "--prompt-cache-file", f)
    assert code == 0
    n_cached = read_cache_info(f).num_tokens
    code, a, err = run_cli(capsys, "generate", "--model", model_dir, "--ignore-chat-template",
                           "--prompt-cache-file", f, "-p", "there lived a dragon", "-m", "16", "--verbose")
    assert code == 0
    code, b, _ = run_cli(capsys, "generate", "--model", model_dir, "--ignore-chat-template",
                         "-p", prefix + "there lived a dragon", "-m", "16")
    assert a == b
    assert reused_of(err) >= n_cached - 2


def test_wrong_model_refused(tiny_model_dirs, make_tiny_model_dir, tmp_path, capsys):
    f = str(tmp_path / "c.safetensors")
    run_cli(capsys, "cache-prompt", "--model", str(tiny_model_dirs["llama"]), "--system-prompt", SYSTEM,
            "--prompt-cache-file", f)
    other = str(make_tiny_model_dir("llama", seed=1))
    code, out, err = run_cli(capsys, "generate", "--model", other, "-p", "hi", "--prompt-cache-file", f)
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "another model" in err or "differ" in err


def test_chat_and_raw_files_do_not_mix(tiny_model_dirs, tmp_path, capsys):
    model_dir = str(tiny_model_dirs["llama"])
    f = str(tmp_path / "c.safetensors")
    run_cli(capsys, "cache-prompt", "--model", model_dir, "--system-prompt", SYSTEM, "--prompt-cache-file", f)
    code, _, err = run_cli(capsys, "generate", "--model", model_dir, "-p", "x", "--ignore-chat-template",
                           "--prompt-cache-file", f)
    assert code != 0 and "holds a chat" in err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", "-p", "hi", "--temp", "hot"], "invalid"),
        (["generate", "-p", "hi", "--top-p", "2"], "between 0 and 1"),
        (["generate", "-p", "hi", "--kv-bits", "7"], "one of"),
        (["generate", "-p", "hi", "--prompt-cache-file", "/nonexistent/c.safetensors"], "not found"),
        (["cache", "info", "/nonexistent/c.safetensors"], "not found"),
        (["cache-prompt", "--prompt-cache-file", "x.safetensors"], "nothing to cache"),
    ],
)
def test_errors_are_one_line(argv, needle, tiny_model_dirs, capsys):
    argv = list(argv)
    if argv[0] != "cache" and "--model" not in argv:
        argv += ["--model", str(tiny_model_dirs["llama"])]
    with pytest.raises(SystemExit) if needle in ("invalid", "between 0 and 1", "one of") else _nullctx():
        code = main(argv)
        assert code != 0
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_corrupt_file_is_one_line_in_a_real_process(tiny_model_dirs, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    for argv in (["cache", "info", str(bad)],
                 ["generate", "--model", str(tiny_model_dirs["llama"]), "-p", "hi", "--prompt-cache-file", str(bad)]):
        p = subprocess.run([sys.executable, "-m", "mlx_chatcache", *argv], capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and p.stdout == ""
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "not a valid cache file" in lines[0], p.stderr


def test_cache_info_json(tiny_model_dirs, tmp_path, capsys):
    model_dir = str(tiny_model_dirs["sliding"])
    f = str(tmp_path / "c.safetensors")
    run_cli(capsys, "generate", "--model", model_dir, "-p", "hello", "-m", "4", "--save-prompt-cache", f)
    code, out, _ = run_cli(capsys, "cache", "info", f, "--json")
    assert code == 0
    info = json.loads(out)
    for key in ("format_version", "model", "cache_types", "num_tokens", "nbytes"):
        assert key in info
    assert info["cache_types"] == {"RotatingKVCache": 2, "KVCache": 1}
    assert info["model"] == model_dir and info["num_tokens"] > 0 and info["nbytes"] > 0
    # every layer stores exactly the tokens it holds: no room to grow on disk
    assert info["stored_slots"] == info["num_tokens"] and info["format_version"] == 5
    code, out, _ = run_cli(capsys, "cache", "info", f)
    assert "room for" not in out
    assert "hello" in (info["preview"] or "")
    code, out, _ = run_cli(capsys, "cache", "info", f)
    assert "RotatingKVCache" in out and "tokens:" in out
