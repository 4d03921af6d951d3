"""Every refusal names a step that works: each test makes ``mlxcc`` refuse something, in one
line, reads the step the line names and takes it, through the real command (subprocesses).
(A damaged session's repair: tests/test_session_repair.py; a full disk: tests/test_cli_messages.py.)"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import mlxcc, one_error_line

from mlx_chatcache.files.cache_file import is_session
from mlx_chatcache.files.mlxcc_format import read_cache_info



def in_home(tmp_path) -> dict:
    return {**os.environ, "MLXCC_HOME": str(tmp_path / "home")}


@pytest.fixture
def session_file(tiny_model_dirs, tmp_path):
    """A chat session of two turns in a file of its own."""
    f = tmp_path / "s.safetensors"
    p = mlxcc("chat", "--model", tiny_model_dirs["llama"], "-m", "3", "--session-file", f, stdin="Hello\nAgain\n",
              env=in_home(tmp_path))  # fmt: skip
    assert p.returncode == 0, p.stderr
    return f


def test_trimming_a_session_names_two_steps_that_work(tiny_model_dirs, tmp_path, session_file):
    before = session_file.read_bytes()
    line = one_error_line(mlxcc("cache", "trim", session_file, "5"))
    assert "cache convert" not in line and session_file.read_bytes() == before
    # step one: /undo in the chat the line names
    chat = re.search(r"'(mlxcc chat --session-file [^']+)'", line).group(1)
    p = mlxcc(*shlex.split(chat)[1:], "--model", tiny_model_dirs["llama"], stdin="/undo\n", env=in_home(tmp_path))
    assert p.returncode == 0 and "removed the last exchange; 1 turn left" in p.stderr, p.stderr
    # step two: --output OUT writes the first tokens as a prompt cache
    assert "--output OUT" in line
    out = tmp_path / "trimmed.safetensors"
    p = mlxcc("cache", "trim", session_file, "5", "--output", out)
    assert p.returncode == 0, p.stderr
    info = read_cache_info(out)
    assert info.tokens == read_cache_info(session_file).tokens[:5] and not is_session(info)
    assert mlxcc("cache", "trim", out, "3").returncode == 0  # a prompt cache: trimmed in place too


def test_a_file_held_by_a_generate_says_to_wait_for_it(tiny_model_dirs, tmp_path):
    d, f = tiny_model_dirs["llama"], tmp_path / "roll.safetensors"
    assert mlxcc("generate", "--model", d, "-p", "Hi", "-m", "2", "--save-prompt-cache", f).returncode == 0
    rolling = ["generate", "--model", d, "-p", "Go on", "--prompt-cache-file", f, "--save-prompt-cache", f]
    first = subprocess.Popen([sys.executable, "-m", "mlx_chatcache", *map(str, rolling), "-m", "200000"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        lock = tmp_path / "roll.lock"
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().startswith(f"{first.pid} ")):
            assert time.monotonic() < deadline and first.poll() is None, "the first generate did not take the lock"
            time.sleep(0.05)
        line = one_error_line(mlxcc(*rolling, "-m", "2"))
        assert f"(pid {first.pid}) running 'mlxcc generate'" in line and "wait until it is done" in line
        assert "chat" not in line and "session" not in line
    finally:
        first.send_signal(signal.SIGINT)  # the step the line names: the first run ends (Ctrl-C: nothing saved)
        first.wait(timeout=60)
    p = mlxcc(*rolling, "-m", "2")
    assert p.returncode == 0, p.stderr


def test_load_of_a_file_that_is_no_session_says_what_load_takes(tiny_model_dirs, tmp_path, session_file):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    chat = ["chat", "--model", tiny_model_dirs["llama"], "-m", "2"]
    p = mlxcc(*chat, stdin=f"/load {notes}\n", env=in_home(tmp_path))
    line = one_error_line(p)
    assert "overwrite" not in line and "it is not a prompt cache file; /load takes a session file" in line
    assert notes.read_text() == "my notes\n"
    p = mlxcc(*chat, stdin=f"/load {session_file}\n", env=in_home(tmp_path))  # what it takes: loaded
    assert p.returncode == 0 and f"[loaded {session_file}: 2 turns," in p.stderr, p.stderr


def test_an_empty_system_prompt_is_said_to_be_empty(tiny_model_dirs, tmp_path):
    f = tmp_path / "c.safetensors"
    line = one_error_line(mlxcc("cache-prompt", "--model", tiny_model_dirs["llama"], "--system-prompt", "",
                                "--prompt-cache-file", f))  # fmt: skip
    assert "--system-prompt is empty" in line and not f.exists()
    p = mlxcc("cache-prompt", "--model", tiny_model_dirs["llama"], "--system-prompt", "Be brief.", "--prompt-cache-file", f)
    assert p.returncode == 0 and read_cache_info(f).messages == [{"role": "system", "content": "Be brief."}]


def test_a_folder_given_as_a_cache_file_is_said_to_be_a_folder(tiny_model_dirs, tmp_path):
    d = tiny_model_dirs["llama"]
    folder = tmp_path / "caches"
    folder.mkdir()
    line = one_error_line(mlxcc("generate", "--model", d, "-p", "Hi", "-m", "2", "--prompt-cache-file", folder))
    assert "is a folder, not a cache file; give the path of a .safetensors file in it" in line
    f = folder / "c.safetensors"
    assert mlxcc("generate", "--model", d, "-p", "Hi", "-m", "2", "--save-prompt-cache", f).returncode == 0
    p = mlxcc("generate", "--model", d, "-p", "Hi", "-m", "2", "--prompt-cache-file", f)
    assert p.returncode == 0, p.stderr


def test_set_says_the_range_as_typed_and_the_value_that_works(tiny_model_dirs, tmp_path):
    p = mlxcc("chat", "--model", tiny_model_dirs["llama"], "-m", "2",
              stdin="/set temp inf\n/set repetition_penalty 0\n/set repetition_penalty none\n/set temp 1e3\n")
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: /set temp: must be a finite number >= 0, got inf",
                      "error: /set repetition_penalty: must be a finite number > 0 (or none), got 0"]
    assert "[repetition_penalty = None]" in p.stderr and "[temp = 1000.0]" in p.stderr
