"""``mlxcc chat`` in a real pseudo-terminal (pexpect): prompt_toolkit input,
streamed replies, commands, Ctrl-C stopping a reply but not the program.

Skipped when pexpect is missing or cannot spawn a terminal here.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

import pexpect

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


PASTE_ON, PASTE_OFF = "\x1b[?2004h", "\x1b[?2004l"  # what a program writes to turn bracketed paste on / off


def paste(text: str) -> str:
    """What a terminal in bracketed paste mode sends for a paste of ``text`` (lines end in CR)."""
    return "\x1b[200~" + text.replace("\n", "\r") + "\x1b[201~"


def user_messages(home, name):
    return [m["content"] for m in read_cache_info(home / "sessions" / f"{name}.safetensors").messages
            if m["role"] == "user"]  # fmt: skip


def test_a_paste_at_the_prompt_is_one_message_even_one_starting_with_a_slash(tiny_model_dirs, tmp_path):
    child = spawn(tiny_model_dirs["llama"], tmp_path, "--session", "p", "--max-tokens", "3", "-v")
    try:
        child.expect(PROMPT)
        child.send(paste("line one\nline two\nline three"))
        child.send("\r")
        child.expect(r"\[stats\]")
        child.expect(PROMPT)
        child.send(paste("/help\nmore"))
        child.send("\r")
        child.expect(r"\[stats\]")
        child.expect(PROMPT)
        child.sendline("/bye")
        child.expect(pexpect.EOF)
        output = child.before
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert user_messages(tmp_path, "p") == ["line one\nline two\nline three", "/help\nmore"]
    assert "Commands (anything" not in output and "unknown command" not in output
    assert output.rfind(PASTE_OFF) > output.rfind(PASTE_ON)  # the chat ends with the mode off


def test_a_paste_while_a_reply_streams_is_one_message(tiny_model_dirs, tmp_path):
    """The test plays the terminal: it brackets the paste only when the chat has turned
    bracketed paste mode on (the last mode sequence written before the paste)."""
    child = spawn(tiny_model_dirs["llama"], tmp_path, "--session", "s", "--max-tokens", "40", "-v")
    try:
        child.expect(PROMPT)
        child.sendline("Write a list: apples, oranges.")
        child.expect_exact(PASTE_OFF)  # the prompt returned
        seen = child.expect_exact([PASTE_ON, "[stats]"])  # the mode while the reply streams
        mode_on = seen == 0
        text = "line one\nline two\nline three"
        child.send(paste(text) if mode_on else text.replace("\n", "\r"))
        if seen == 0:
            child.expect_exact("[stats]")
        child.expect(PROMPT)
        child.send("\r")  # the pasted text waits at the prompt: Enter sends it
        child.expect(r"\[stats\]")
        child.expect(PROMPT)
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert mode_on, "bracketed paste was off while the reply streamed"
    assert user_messages(tmp_path, "s") == ["Write a list: apples, oranges.", "line one\nline two\nline three"]


def test_ctrl_d_in_an_unsaved_chat_warns_once(tiny_model_dirs, tmp_path):
    child = spawn(tiny_model_dirs["llama"], tmp_path, "--max-tokens", "3")
    kept = tmp_path / "kept.safetensors"
    try:
        child.expect(PROMPT)
        child.sendeof()  # nothing said yet: nothing to keep
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    child = spawn(tiny_model_dirs["llama"], tmp_path, "--max-tokens", "3", "-v")
    try:
        child.expect(PROMPT)
        child.sendline("Good morning!")
        child.expect(r"\[stats\]")  # the reply is over (a Ctrl-D typed during it is read by no prompt)
        child.expect(PROMPT)
        child.sendeof()
        child.expect_exact("[this chat is not saved: /save FILE keeps it; Ctrl-D again to quit without saving]")
        child.expect(PROMPT)
        child.sendline(f"/save {kept}")
        child.expect_exact(f"[session saved to {kept}]")
        child.expect(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert [m["content"] for m in read_cache_info(kept).messages][:1] == ["Good morning!"]


def test_edit_on_a_terminal_starts_from_the_old_message(tiny_model_dirs, tmp_path):
    """/edit shows the message it replaces, editable: typing at its end extends it."""
    child = spawn(tiny_model_dirs["llama"], tmp_path, "--session", "ed", "--max-tokens", "4")
    try:
        child.expect(PROMPT)
        child.sendline("Good morning")
        child.expect(PROMPT)  # the reply streamed, then the next prompt
        child.sendline("/edit")
        child.expect(r"new text for your last message")
        child.expect("Good morning")  # drawn in the editable line
        child.sendline(" to you")
        child.expect(PROMPT)
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    info = read_cache_info(tmp_path / "sessions" / "ed.safetensors")
    assert [m["content"] for m in info.messages if m["role"] == "user"] == ["Good morning to you"]


def test_the_chat_offers_to_repair_a_damaged_session(tiny_model_dirs, tmp_path):
    """A session whose cache is damaged: on a terminal the chat asks, repairs it from its
    messages (saved), and the conversation goes on from the repaired cache."""
    import subprocess

    env = {**os.environ, "MLXCC_HOME": str(tmp_path)}
    made = subprocess.run([sys.executable, "-m", "mlx_chatcache", "chat", "--model", str(tiny_model_dirs["llama"]),
                           "--session", "dmg", "-n", "3"], input="Good morning!\n", text=True, env=env,
                          capture_output=True, timeout=TIMEOUT)  # fmt: skip
    assert made.returncode == 0, made.stderr
    f = tmp_path / "sessions" / "dmg.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF  # in the last tensor's data: the header, and so the conversation, stays whole
    f.write_bytes(bytes(raw))
    child = spawn(tiny_model_dirs["llama"], tmp_path, "--session", "dmg", "--max-tokens", "3", "-v")
    try:
        child.expect(r"is damaged \(.*\); its 2 messages are intact\. Compute its cache again from them now\? \[Y/n\]")
        child.sendline("y")
        child.expect(r"\[repaired: (\d+) tokens computed again and saved\]")
        repaired = int(child.match.group(1))
        child.expect(PROMPT)
        child.sendline("And then?")
        child.expect(r"\[stats\] prompt: \d+ new \+ (\d+) reused tokens \(0 recomputed\)")
        assert int(child.match.group(1)) == repaired
        child.expect(PROMPT)
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    info = read_cache_info(f)
    assert [m["content"] for m in info.messages if m["role"] == "user"] == ["Good morning!", "And then?"]


def test_keys_typed_during_a_reply_are_not_echoed_into_it(tiny_model_dirs, tmp_path):
    """While a reply streams the terminal does not echo typed keys into it; they wait for the
    next prompt, which shows them (Enter sends them)."""
    child = spawn(tiny_model_dirs["llama"], tmp_path, "--session", "keys", "--max-tokens", "150", "-v")
    try:
        child.expect(PROMPT)
        child.sendline("Write a list: apples, oranges.")
        child.expect_exact(PASTE_OFF)  # the prompt returned: the reply streams
        child.send("qzqzqz")
        child.expect_exact("[stats]")
        assert "qzqzqz" not in child.before  # the reply as the terminal showed it
        child.expect(PROMPT)
        child.expect_exact("qzqzqz")  # at the next prompt, in the line being edited
        child.send("\r")
        child.expect_exact("[stats]")
        child.expect(PROMPT)
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert user_messages(tmp_path, "keys") == ["Write a list: apples, oranges.", "qzqzqz"]
