"""Clean one-line errors and a readable ``cache info`` (issue 11, item 8), through
``mlxcc``'s entry point in-process (the ``cli`` fixture), and in subprocesses where the
process itself matters: arguments that are not UTF-8 (bytes reach it as the shell
passes them), stdin decoded under the locale the process starts with, a full disk
in a mount namespace of its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st


TIMEOUT = 60


def mlxcc(*args, stdin: bytes | None = None, cwd=None, env=None) -> subprocess.CompletedProcess:
    argv = [sys.executable.encode(), b"-m", b"mlx_chatcache"]
    argv += [a if isinstance(a, bytes) else str(a).encode() for a in args]
    p = subprocess.run(argv, input=stdin, capture_output=True, timeout=TIMEOUT, cwd=cwd, env=env)
    p.stdout, p.stderr = p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    return p


def one_error_line(p) -> str:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode != 0 and "Traceback" not in p.stderr and len(lines) == 1, p.stderr
    return lines[0]


def test_an_argument_that_is_not_utf8_is_one_line(tiny_model_dirs):
    p = mlxcc("generate", "--model", tiny_model_dirs["llama"], "-m", "4", "-p", b"caf\xe9 au lait")
    line = one_error_line(p)
    assert line == ("mlxcc: error: argument --prompt is not valid UTF-8 text (byte 0xe9 at character 4); "
                    "type it again or convert it to UTF-8 (e.g. iconv -t UTF-8)")  # fmt: skip
    p = mlxcc("generate", "--model", tiny_model_dirs["llama"], "-m", "4", "-p", "-", stdin=b"caf\xe9\n")
    assert "the prompt read from stdin is not valid UTF-8 text" in one_error_line(p)


@pytest.mark.parametrize("lang", ["C.UTF-8", "C"])
def test_piped_chat_line_that_is_not_utf8_is_skipped_and_the_chat_goes_on(tiny_model_dirs, tmp_path, lang):
    env = {**os.environ, "MLXCC_HOME": str(tmp_path), "LC_ALL": lang, "LANG": lang, "PYTHONIOENCODING": "utf-8"}
    p = mlxcc("chat", "--model", tiny_model_dirs["llama"], "-m", "4", "--verbose",
              stdin=b"caf\xe9 au lait\nGood morning!\n", env=env)  # fmt: skip
    assert "Traceback" not in p.stderr, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: the input is not valid UTF-8 text (byte 0xe9 at character 4); type it again "
                      "or convert it to UTF-8 (e.g. iconv -t UTF-8); nothing was sent"], p.stderr  # fmt: skip
    assert p.stderr.count("[stats]") == 1  # the next message was answered


def test_kv_group_size_that_does_not_divide_the_head_size_names_one_that_does(tiny_model_dirs, tmp_path, cli):
    model = tiny_model_dirs["llama"]  # head size 64
    expected = ("KV quantization group size 128 does not divide this model's head size 64; "
                "use --kv-group-size 32 or 64")  # fmt: skip
    p = cli("generate", "--model", model, "-p", "Hello", "-m", "4", "--kv-bits", "4", "--kv-group-size", "128")
    assert one_error_line(p) == "mlxcc: error: " + expected
    p = cli("chat", "--model", model, "-m", "4", "--kv-bits", "4", "--kv-group-size", "128", "--verbose",
            stdin=b"Hello\nHello again\n/set max_tokens 3\n", env={"MLXCC_HOME": tmp_path})  # fmt: skip
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: " + expected] * 2, p.stderr  # each turn says so; the chat goes on
    assert "Traceback" not in p.stderr and "inconsistent" not in p.stderr
    p = cli("generate", "--model", model, "-p", "Hello", "-m", "4", "--kv-bits", "4", "--kv-group-size", "32")
    assert p.returncode == 0, p.stderr


def test_a_folder_that_is_not_a_model(tmp_path, cli):
    (tmp_path / "notes.txt").write_text("hello")
    p = cli("generate", "--model", tmp_path, "-p", "Hello")
    assert one_error_line(p).startswith(f"mlxcc: error: {tmp_path} is not a model folder: no config.json")
    p = cli("chat", "--model", tmp_path / "notes.txt", stdin=b"")
    assert f"{tmp_path / 'notes.txt'} is not a model" in one_error_line(p)


@pytest.mark.parametrize("content", [b"hello, these are my notes\n", b"", b"x"])
def test_a_text_file_given_as_a_cache_is_not_a_safetensors_file(tiny_model_dirs, tmp_path, content, cli):
    f = tmp_path / "notes.txt"
    f.write_bytes(content)
    expected = f"{f} is not a safetensors file (it does not start with a safetensors header)"
    for args in (["cache", "info", f], ["generate", "--model", tiny_model_dirs["llama"], "-p", "Hi",
                                          "--prompt-cache-file", f]):  # fmt: skip
        line = one_error_line(cli(*args))
        assert expected in line and "bytes" not in line, line


@pytest.fixture
def mlx_lm_file(tmp_path):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    f = tmp_path / "lm.safetensors"
    config = json.dumps({"chat_template": "{% for m in messages %}" * 40, "eos_token": "<|im_end|>"})
    save_prompt_cache(str(f), [c], {"model": "/models/Qwen3-0.6B-4bit", "tokenizer_config": config})
    return f


def test_cache_info_shows_the_model_an_mlx_lm_file_records(mlx_lm_file, cli):
    p = cli("cache", "info", mlx_lm_file)
    assert p.returncode == 0, p.stderr
    assert "model:       /models/Qwen3-0.6B-4bit (as recorded by mlx-lm)" in p.stdout.splitlines()
    p = cli("cache", "info", mlx_lm_file, "--json")
    assert json.loads(p.stdout)["model"] == "/models/Qwen3-0.6B-4bit"


def test_cache_info_wraps_long_values(mlx_lm_file, tiny_model_dirs, tmp_path, cli):
    env = {"COLUMNS": "80", "MLXCC_HOME": tmp_path}
    p = cli("cache", "info", mlx_lm_file, env=env)
    assert p.returncode == 0 and max(map(len, p.stdout.splitlines()[1:])) <= 80, p.stdout  # (a path stays whole)
    assert "--json shows all" in p.stdout  # the ~1,000-character config is cut, not dumped
    session = tmp_path / "s.safetensors"
    p = cli("chat", "--model", tiny_model_dirs["llama"], "-m", "4", "--session-file", session,
            "--system-prompt", "You are a helpful assistant who answers briefly. " * 8, stdin=b"Hi\n", env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr
    p = cli("cache", "info", session, env=env)
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and max(map(len, lines[1:])) <= 80, p.stdout
    assert any(line.startswith("settings:    ") and "max_kv_size=None" in line for line in lines)  # after weights=
    assert any(line.startswith("metadata:    session = {") for line in lines)


@given(st.text(), st.integers(min_value=3, max_value=400))
def test_one_line_is_one_short_line_that_starts_like_the_text(text, limit):
    from mlx_chatcache.errors import clipped, one_line

    line = one_line(text, limit)
    joined = " ".join(text.split())
    assert len(line) <= limit and not any(c in line for c in "\n\r\t")
    assert line == joined if len(joined) <= limit else (line.endswith("...") and joined.startswith(line[:-3]))
    assert clipped(joined, limit) == line


# every command a user can run (``mlxcc`` and its nested actions): arguments it parses,
# and arguments with a wrong or missing value (None: it takes no value that can be wrong)
COMMAND_ARGS = {
    "generate": ([], ["--temp", "hot"]),
    "cache-prompt": (["--prompt-cache-file", "c.safetensors"], ["--prompt-cache-file", "c", "--max-kv-size", "big"]),
    "chat": ([], ["--temp", "hot"]),
    "cache": ([], ["nothing"]),
    "cache info": (["c.safetensors"], []),
    "cache convert": (["a", "b", "--to", "mlxcc"], ["a", "b", "--to", "gguf"]),
    "cache trim": (["c.safetensors", "3"], ["c.safetensors", "-1"]),
    "cache diff": (["a", "b"], ["a"]),
    "sessions": ([], ["nothing"]),
    "sessions list": ([], None),
    "sessions show": (["s"], []),
    "sessions export": (["s"], ["s", "--format", "pdf"]),
    "sessions rm": (["s"], []),
    "sessions repair": (["s"], ["s", "--weights", "f16"]),
    "doctor": ([], ["--weights", "f16"]),
    "serve": ([], ["--port", "http"]),
}


def all_commands() -> set[str]:
    import argparse

    from mlx_chatcache.cli.main import build_parser

    found, todo = set(), [build_parser()]
    while todo:
        parser = todo.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    found.add(child.prog.removeprefix("mlxcc "))
                    todo.append(child)
    return found


def test_the_table_names_every_command():
    assert set(COMMAND_ARGS) == all_commands()


@pytest.mark.parametrize("command", sorted(COMMAND_ARGS))
def test_bad_arguments_point_at_the_help_of_the_command_given(command, tmp_path, cli):
    needed, bad_value = COMMAND_ARGS[command]
    words = command.split()
    help_hint = f"(see 'mlxcc {command} --help')"
    p = cli(*words, *needed, "--no-such-flag", cwd=tmp_path)
    line = one_error_line(p)
    assert p.returncode == 2 and "unrecognized arguments: --no-such-flag" in line and line.endswith(help_hint), line
    if bad_value is not None:
        p = cli(*words, *bad_value, cwd=tmp_path)
        line = one_error_line(p)
        assert p.returncode == 2 and line.startswith(f"mlxcc {command}: error: ") and line.endswith(help_hint), line


def saved_cache(cli, model_dir, path, prompt="Hello") -> None:
    p = cli("generate", "--model", model_dir, "-p", prompt, "-m", "1", "--save-prompt-cache", path)
    assert p.returncode == 0, p.stderr


def test_cache_diff_of_two_models_compares_no_token_ids(tiny_model_dirs, tmp_path, cli):
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    saved_cache(cli, tiny_model_dirs["llama"], a)
    saved_cache(cli, tiny_model_dirs["hybrid"], b)
    saved_cache(cli, tiny_model_dirs["llama"], c, "Hello there, how are you?")
    p = cli("cache", "diff", a, b)
    assert p.returncode == 1 and re.match(r"model: +no \(", p.stdout), p.stdout  # not comparable: exit status 1
    assert "common prefix: not compared (different models" in p.stdout and "diverge at" not in p.stdout, p.stdout
    d = json.loads(cli("cache", "diff", a, b, "--json").stdout)
    assert d["same_model"] is False and d["common_prefix"] is None and d["diverge_at"] is None
    same = cli("cache", "diff", a, c)
    n = json.loads(cli("cache", "diff", a, c, "--json").stdout)["common_prefix"]
    assert n > 1 and f"common prefix: {n} tokens" in same.stdout, same.stdout


def on_a_full_disk(tmp_path, *commands: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """Run ``commands`` (shell) with ``$D`` a 256 KB tmpfs that is nearly full (a new
    mount namespace: ``unshare -rm``); skipped when this system refuses it, except in CI."""
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        if os.environ.get("CI") == "true":  # CI runs as root on a machine where this works
            pytest.fail(f"cannot mount a small tmpfs: {probe.stderr.strip()}")
        pytest.skip(f"cannot mount a small tmpfs here: {probe.stderr.strip()}")
    d = tmp_path / "full"
    d.mkdir(exist_ok=True)
    setup = (f'D={d}; mount -t tmpfs -o size=256k tmpfs "$D" && '
             'dd if=/dev/zero of="$D/filler" bs=1k count=224 2>/dev/null')
    script = " && ".join([setup, *commands])
    p = subprocess.run(["unshare", "-rm", "sh", "-c", script], input=stdin, capture_output=True, timeout=TIMEOUT)
    p.stdout, p.stderr = p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    return p


def test_a_full_disk_says_the_disk_is_full(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    py = f"{sys.executable} -m mlx_chatcache"
    p = on_a_full_disk(tmp_path, f'{py} generate --model {model} -p Hello -m 2 --save-prompt-cache "$D/x.safetensors"')
    line = one_error_line(p)
    assert p.returncode == 1 and "x.safetensors: the disk is full (" in line, p.stderr
    assert "bytes free in " in line and "free some space or save elsewhere" in line and "[write]" not in line
    env = f"MLXCC_HOME={tmp_path / 'home'}"
    p = on_a_full_disk(tmp_path, f'{env} {py} chat --model {model} -m 2 -v --session-file "$D/s.safetensors"',
                       stdin=b"Hello\nGood morning!\n")  # fmt: skip
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert errors and all("the disk is full (" in ln for ln in errors), p.stderr
    assert p.stderr.count("[stats]") == 2 and "Traceback" not in p.stderr, p.stderr  # the chat went on
