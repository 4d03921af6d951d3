"""``mlxcc chat`` in a real pseudo-terminal (pexpect): prompt_toolkit input,
streamed replies, commands, Ctrl-C stopping a reply but not the program.

Skipped when pexpect is missing or cannot spawn a terminal here.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")

from mlx_chatcache.files.mlxcc_format import read_cache_info  # noqa: E402

TIMEOUT = 30
PROMPT = ">>>"  # prompt_toolkit draws the trailing space as a cursor move


def spawn(model_dir, home, *flags):
    env = {
        **os.environ,
        "MLXCC_HOME": str(home),
        "TERM": "xterm",
        "PROMPT_TOOLKIT_NO_CPR": "1",  # the test terminal does not answer cursor queries
        "COLUMNS": "200",
    }
    args = ["-m", "mlx_chatcache", "chat", "--model", str(model_dir), *flags]
    try:
        child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8",
                              codec_errors="replace", timeout=TIMEOUT, dimensions=(40, 200))  # fmt: skip
    except (OSError, pexpect.ExceptionPexpect) as e:
        pytest.skip(f"pexpect cannot spawn a terminal here: {e}")
    return child


def test_terminal_chat_message_stats_undo_bye(tiny_model_dirs, tmp_path):
    child = spawn(tiny_model_dirs["llama"], tmp_path, "--session", "tty", "--max-tokens", "6")
    try:
        child.expect("new session 'tty'")
        child.expect(PROMPT)
        child.sendline("Good morning!")
        child.expect(PROMPT)  # the reply streamed, then the next prompt
        child.sendline("/show stats")
        child.expect(r"last turn: prompt: (\d+) new \+ 0 reused tokens \(0 recomputed\)")
        child.expect(PROMPT)
        child.sendline("/undo")
        child.expect(r"removed the last exchange; 0 turns left")
        child.expect(PROMPT)
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    info = read_cache_info(tmp_path / "sessions" / "tty.safetensors")
    assert info.messages == [] and info.tokens == []
    assert (tmp_path / "chat_history").read_text().count("Good morning!") == 1


def test_ctrl_c_stops_a_reply_not_the_program(tiny_model_dirs, tmp_path):
    child = spawn(tiny_model_dirs["llama"], tmp_path, "--session", "int", "--max-tokens", "200000")
    try:
        child.expect(PROMPT)
        child.sendline("Write a list: apples, oranges.")
        time.sleep(1.0)  # the reply is streaming (for minutes if not stopped)
        child.sendintr()
        child.expect(r"\[stopped\]")
        child.expect(PROMPT)
        child.sendintr()  # at the prompt: clears the line, the chat goes on
        child.expect(PROMPT)
        child.sendline("/show stats")
        child.expect(r"\(interrupted\)")
        child.expect(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    info = read_cache_info(tmp_path / "sessions" / "int.safetensors")
    assert [m["role"] for m in info.messages] == ["user", "assistant"]
    assert 0 < len(info.tokens) < 200000
