"""Ctrl-C is acted upon within a second, also while a long prompt is processed,
and progress is shown on a terminal only (issue 11, items 3 and 4).

The real command runs in a pseudo-terminal (pexpect). The prefill tests use
the demo model (SmolLM2-135M Q4_1 on the CPU), where a 430-token prompt is
one 38-second model call when it is not paced; they allow 5 s from Ctrl-C to
the message (the shared CI machine is slow), far below that call.
"""

from __future__ import annotations

import os
import re
import subprocess
import signal
import sys
import time

import pytest

import pexpect

from mlx_chatcache.files.mlxcc_format import read_cache_info  # noqa: E402


TIMEOUT = 120
LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 30  # ~430 tokens
PROGRESS = re.compile(r"(?:prompt|caching) \[[#.]+\] (\d+)/(\d+) tokens")


def _sigint_as_at_a_terminal() -> None:
    """Ctrl-C as a user at a terminal has it: a suite started in the background by a
    shell without job control (``cmd &``) inherits SIGINT ignored, and so would the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args, home=None):
    env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": "200"}
    if home is not None:
        env["MLXCC_HOME"] = str(home)
    try:
        return pexpect.spawn(sys.executable, ["-m", "mlx_chatcache", *map(str, args)], env=env, encoding="utf-8",
                             codec_errors="replace", timeout=TIMEOUT, dimensions=(40, 200),
                             preexec_fn=_sigint_as_at_a_terminal)  # fmt: skip
    except (OSError, pexpect.ExceptionPexpect) as e:
        pytest.skip(f"pexpect cannot spawn a terminal here: {e}")


def wait_for_moving_progress(child) -> None:
    """The progress line shows two different partial counts: it moves within the prompt."""
    child.expect(PROGRESS)
    first = int(child.match.group(1))
    while True:
        child.expect(PROGRESS)
        done, total = map(int, child.match.groups())
        if done != first and done < total:
            return


# ------------------------------------------------------------------ Ctrl-C during a long prompt
@pytest.mark.real_model
def test_ctrl_c_during_a_long_message_cancels_it_within_seconds(demo_gguf, tmp_path):
    child = spawn("chat", "--model", demo_gguf, "--max-tokens", "4", home=tmp_path)
    try:
        child.expect(">>>")
        child.sendline(LONG)
        wait_for_moving_progress(child)
        sent = time.monotonic()
        child.sendintr()
        child.expect(r"\[cancelled before the reply started; your message was not sent\]", timeout=30)
        assert time.monotonic() - sent < 5.0
        child.expect(">>>")
        child.sendline("/show stats")
        child.expect("no turn yet")  # the chat goes on, without the cancelled message
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


@pytest.mark.real_model
@pytest.mark.parametrize("command", ["generate", "cache-prompt"])
def test_ctrl_c_during_a_long_prompt_exits_within_seconds(demo_gguf, tmp_path, command):
    target = tmp_path / "c.safetensors"
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(LONG)
    if command == "generate":
        args = ["generate", "--model", demo_gguf, "-p", LONG, "-m", "4", "--save-prompt-cache", target]
        message = rf"mlxcc: interrupted: before the reply started; nothing saved to {re.escape(str(target))}"
    else:
        args = ["cache-prompt", "--model", demo_gguf, "--prompt-file", prompt_file, "--prompt-cache-file", target]
        message = rf"mlxcc: interrupted; nothing saved to {re.escape(str(target))}"
    child = spawn(*args)
    try:
        wait_for_moving_progress(child)
        sent = time.monotonic()
        child.sendintr()
        child.expect(message, timeout=30)
        child.expect(pexpect.EOF, timeout=30)
        assert time.monotonic() - sent < 5.0
    finally:
        child.close(force=True)
    assert child.exitstatus == 130
    assert not target.exists()


def test_generate_interrupted_mid_reply_ends_the_line_and_keeps_the_file(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    f = tmp_path / "c.safetensors"
    p = subprocess.run([sys.executable, "-m", "mlx_chatcache", "generate", "--model", str(model), "-p", "Hello",
                        "-m", "4", "--save-prompt-cache", str(f)], capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert p.returncode == 0, p.stderr
    before = f.read_bytes()
    child = spawn("generate", "--model", model, "-p", "Write a list", "-m", "200000",
                  "--prompt-cache-file", f, "--save-prompt-cache", f)  # fmt: skip
    try:
        child.expect(PROGRESS)
        time.sleep(2.0)  # the reply is streaming (for minutes if not stopped)
        child.sendintr()
        child.expect(r"(?m)^mlxcc: interrupted: the reply was cut short; nothing saved to "
                     r".*c\.safetensors \(it is unchanged\)")
        printed = child.before
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 130
    assert printed.endswith("\n"), repr(printed[-40:])  # the message starts on its own line
    assert f.read_bytes() == before
    assert read_cache_info(f).messages[-1]["content"] != ""


# ------------------------------------------------------------------ progress on a terminal, not on a pipe
def test_generate_shows_load_and_prompt_progress_on_a_terminal_only(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    child = spawn("generate", "--model", model, "-p", "word " * 300, "-m", "4")
    try:
        child.expect(r"loading model llama")
        child.expect(PROGRESS)
        child.expect(pexpect.EOF)
        rest = child.before
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert re.search(r"\r +\r", rest)  # the progress line is erased before the reply
    # on a pipe: no progress at all, stdout holds only the reply
    p = subprocess.run([sys.executable, "-m", "mlx_chatcache", "generate", "--model", str(model), "-p", "word " * 300,
                        "-m", "4"], capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert p.returncode == 0 and p.stderr == "" and "\r" not in p.stdout, p.stderr


def test_chat_shows_prompt_progress_on_a_terminal(tiny_model_dirs, tmp_path):
    child = spawn("chat", "--model", tiny_model_dirs["llama"], "-m", "4", "--prefill-step-size", "16", home=tmp_path)
    try:
        child.expect("loading model llama")
        child.expect(">>>")
        child.sendline("word " * 300)
        child.expect(PROGRESS)
        child.expect(">>>")
        child.sendline("/bye")
        child.expect_exact("[this chat is not saved: ")  # no session: the first /bye says so
        child.expect(">>>")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    p = subprocess.run([sys.executable, "-m", "mlx_chatcache", "chat", "--model", str(tiny_model_dirs["llama"]),
                        "-m", "4"], input="word " * 300 + "\n", capture_output=True, text=True, timeout=TIMEOUT,
                       env={**os.environ, "MLXCC_HOME": str(tmp_path)})  # fmt: skip
    assert p.returncode == 0 and "tokens" not in p.stderr and "loading" not in p.stderr, p.stderr
