"""A failed save never loses the conversation, and a save never replaces what
is not ours (issue 11, items 1 and 2), driven through ``mlxcc``'s entry point (in-process;
the chats whose autosave fails run as real processes in a terminal, pexpect).

Unwritable folders: tests run as root here, and root ignores permission bits,
so a folder is made unwritable with ``chattr +i`` (immutable: not even root can
create a file in it) when running as root, with ``chmod 555`` otherwise; the
test is skipped when neither works. ``/proc`` is another folder nobody can
create a file in.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

from mlx_chatcache.files.mlxcc_format import read_cache_info

from cli_helpers import TIMEOUT, foreign_files, one_error_line, unwritable, wait_for  # noqa: E402


# ------------------------------------------------------------------ item 1: unwritable targets
@pytest.mark.parametrize("where", ["proc", "read-only folder"])
def test_generate_refuses_an_unwritable_save_before_generating(tiny_model_dirs, tmp_path, where, cli):
    folder = Path("/proc") if where == "proc" else tmp_path / "ro"
    folder.mkdir(exist_ok=True) if where != "proc" else None
    with unwritable(folder) if where != "proc" else contextlib.nullcontext():
        p = cli("generate", "--model", tiny_model_dirs["llama"], "-p", "Hello", "-m", "4",
                "--save-prompt-cache", folder / "z.safetensors")  # fmt: skip
    assert p.returncode == 1 and p.stdout == ""  # refused before a token was generated
    line = one_error_line(p)
    assert line.startswith(f"mlxcc: error: could not write {folder / 'z.safetensors'}: cannot create a file in folder")
    assert "save elsewhere" in line


def test_cache_prompt_refuses_an_unwritable_file_before_work(tiny_model_dirs, tmp_path, cli):
    ro = tmp_path / "ro"
    ro.mkdir()
    with unwritable(ro):
        p = cli("cache-prompt", "--model", tiny_model_dirs["llama"], "--system-prompt", "Be brief.",
                "--prompt-cache-file", ro / "c.safetensors")  # fmt: skip
    assert p.returncode == 1 and p.stdout == ""
    assert "could not write" in one_error_line(p)
    p = cli("cache-prompt", "--model", tiny_model_dirs["llama"], "--system-prompt", "Be brief.",
            "--prompt-cache-file", "/proc/c.safetensors")  # fmt: skip
    assert p.returncode == 1 and "cannot create a file in folder /proc" in one_error_line(p)


def test_save_to_an_unwritable_place_keeps_the_chat(tiny_model_dirs, tmp_path, cli):
    ro = tmp_path / "ro"
    ro.mkdir()
    good = tmp_path / "good.safetensors"
    script = f"Good morning!\n/save /proc/z.safetensors\n/save {ro / 'z.safetensors'}\n/save {good}\nThanks!\n"
    with unwritable(ro):
        p = cli("chat", "--model", tiny_model_dirs["llama"], "-m", "4", stdin=script)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in p.stderr and len(errors) == 2, p.stderr
    assert errors[0].startswith("error: could not write /proc/z.safetensors")
    assert errors[1].startswith(f"error: could not write {ro / 'z.safetensors'}")
    assert f"[session saved to {good}]" in p.stderr
    info = read_cache_info(good)  # the conversation survived both failures
    assert [m["role"] for m in info.messages] == ["user", "assistant"]
    assert info.messages[0]["content"] == "Good morning!"
    assert p.returncode == 1  # a command failed and the input is a script


def test_autosave_into_a_folder_turned_read_only_is_reported_and_retried(tiny_model_dirs, tmp_path):
    import pexpect
    folder = tmp_path / "sessions"
    folder.mkdir()
    path = folder / "s.safetensors"
    env = {**os.environ, "MLXCC_HOME": str(tmp_path / "home"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    args = ["-m", "mlx_chatcache", "chat", "--model", str(tiny_model_dirs["llama"]), "-m", "4",
            "--session-file", str(path)]  # fmt: skip
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", codec_errors="replace",
                          timeout=TIMEOUT, dimensions=(40, 200))  # fmt: skip
    try:
        child.expect(">>>")
        child.sendline("Good morning!")
        wait_for(lambda: path.exists() and len(read_cache_info(path).messages) == 2)
        child.expect(">>>")
        with unwritable(folder):
            child.sendline("What is the capital of Italy?")
            child.expect(r"error: could not save the session: could not write .*s\.safetensors")
            child.expect("retried after the next turn")
            child.expect(">>>")
            assert len(read_cache_info(path).messages) == 2  # the old file is intact
        child.sendline("Thank you.")
        child.expect(r"\[session saved to .*s\.safetensors again\]")
        child.expect(">>>")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    info = read_cache_info(path)
    assert [m["content"] for m in info.messages if m["role"] == "user"] == [
        "Good morning!", "What is the capital of Italy?", "Thank you."]  # fmt: skip


def test_quitting_with_an_unsaved_session_warns_first(tiny_model_dirs, tmp_path):
    import pexpect
    folder = tmp_path / "sessions"
    folder.mkdir()
    path = folder / "s.safetensors"
    other = tmp_path / "other.safetensors"
    env = {**os.environ, "MLXCC_HOME": str(tmp_path / "home"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    args = ["-m", "mlx_chatcache", "chat", "--model", str(tiny_model_dirs["llama"]), "-m", "4",
            "--session-file", str(path)]  # fmt: skip
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", codec_errors="replace",
                          timeout=TIMEOUT, dimensions=(40, 200))  # fmt: skip
    try:
        child.expect(">>>")
        with unwritable(folder):
            child.sendline("Good morning!")
            child.expect("could not save the session")
            child.expect(">>>")
            child.sendline("/bye")
            child.expect(r"NOT saved in .*/save FILE to keep it elsewhere")
            child.expect(">>>")
            child.sendline(f"/save {other}")
            child.expect(r"\[session saved to")
            child.expect(">>>")
            child.sendline("/bye")
            child.expect(r"NOT saved in")
            child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert [m["role"] for m in read_cache_info(other).messages] == ["user", "assistant"]


# ------------------------------------------------------------------ item 2: never overwrite what is not ours
@pytest.fixture
def victims(tmp_path, tiny_model_dirs):
    return foreign_files(tmp_path, tiny_model_dirs["llama"])


@pytest.mark.parametrize("victim", ["notes", "weights"])
def test_generate_never_overwrites_a_file_that_is_not_a_cache(tiny_model_dirs, victims, victim, cli):
    target = victims[victim]
    before = target.read_bytes()
    p = cli("generate", "--model", tiny_model_dirs["llama"], "-p", "Hello", "-m", "4", "--save-prompt-cache", target)
    assert p.returncode == 1 and p.stdout == ""
    line = one_error_line(p)
    assert f"refusing to overwrite {target}" in line and "--force" in line
    assert target.read_bytes() == before
    p = cli("cache-prompt", "--model", tiny_model_dirs["llama"], "-p", "Hello", "--prompt-cache-file", target)
    assert p.returncode == 1 and "refusing to overwrite" in one_error_line(p)
    assert target.read_bytes() == before
    p = cli("generate", "--model", tiny_model_dirs["llama"], "-p", "Hello", "-m", "4",
            "--save-prompt-cache", target, "--force")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert read_cache_info(target).messages[-1]["role"] == "assistant"


def test_rolling_cache_files_and_empty_files_are_still_replaced(tiny_model_dirs, tmp_path, cli):
    f = tmp_path / "c.safetensors"
    f.touch()
    model = tiny_model_dirs["llama"]
    for prompt in ("Hello", "And again"):
        p = cli("generate", "--model", model, "-p", prompt, "-m", "4", *(["--prompt-cache-file", f] if f.stat().st_size else []),
                "--save-prompt-cache", f)  # fmt: skip
        assert p.returncode == 0, p.stderr
    assert [m["content"] for m in read_cache_info(f).messages if m["role"] == "user"] == ["Hello", "And again"]
    lm = tmp_path / "lm.safetensors"  # an mlx-lm cache file may be replaced too
    from mlx_lm.models.cache import KVCache as LmKV, save_prompt_cache as lm_save
    import mlx.core as mx

    c = LmKV()
    c.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    lm_save(str(lm), [c], {"model": "x"})
    p = cli("cache-prompt", "--model", model, "-p", "Hello", "--prompt-cache-file", lm)
    assert p.returncode == 0, p.stderr
    assert read_cache_info(lm).layout == "mlxcc"


def test_repl_save_refuses_a_foreign_file_unless_force(tiny_model_dirs, victims, cli):
    notes = victims["notes"]
    script = f"Good morning!\n/save {notes}\n/save {notes} --force\n"
    p = cli("chat", "--model", tiny_model_dirs["llama"], "-m", "4", stdin=script)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"refusing to overwrite {notes}" in errors[0] and "--force" in errors[0], p.stderr
    assert f"[session saved to {notes}]" in p.stderr
    assert [m["role"] for m in read_cache_info(notes).messages] == ["user", "assistant"]
