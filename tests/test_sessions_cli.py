"""Sessions a user can manage (issue 11 item 5), through ``mlxcc``'s entry point
(in-process): ``mlxcc sessions`` (list / show / rm / export), ``/history`` in the REPL
(a real process in a terminal, pexpect), resuming with the model the session recorded,
``generate`` respecting the session lock of a chat running in another process, and lock
files of killed chats that do not pile up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_chatcache.files.mlxcc_format import read_cache_info



@pytest.fixture
def mlxcc(cli):
    """``mlxcc(*args, home, input=None) -> CompletedProcess``: the entry point in-process, MLXCC_HOME=home."""
    return lambda *args, home, input=None: cli(*args, stdin=input, env={"MLXCC_HOME": home})


@pytest.fixture
def chat(mlxcc):
    """``chat(model_dir, home, name, *lines, flags=())``: session ``name`` says ``lines`` (in-process)."""

    def run(model_dir, home, name, *lines, flags=()) -> subprocess.CompletedProcess:
        model = ("--model", str(model_dir)) if model_dir else ()
        return mlxcc("chat", *model, "--session", name, "-n", "4", "-v", *flags,
                     input="".join(x + "\n" for x in lines), home=home)  # fmt: skip

    return run


def open_chat(model_dir, home, name):
    """A chat that holds session ``name`` until its stdin is closed; returns once it is ready."""
    env = {**os.environ, "MLXCC_HOME": str(home)}
    p = subprocess.Popen([sys.executable, "-m", "mlx_chatcache", "chat", "--model", str(model_dir), "--session", name,
                          "-n", "3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)  # fmt: skip
    lock = home / "sessions" / f"{name}.lock"
    deadline = time.time() + 60
    while not (lock.exists() and lock.read_text().split()[:1] == [str(p.pid)]):  # "PID COMMAND"
        assert time.time() < deadline and p.poll() is None, "the chat did not take its lock"
        time.sleep(0.05)
    return p


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_sessions_list_show_rm(tiny_model_dirs, tmp_path, mlxcc, chat):
    d, home = tiny_model_dirs["llama"], tmp_path
    assert "no sessions" in mlxcc("sessions", home=home).stdout
    assert chat(d, home, "alpha", "Hello there", "What is a river?").returncode == 0
    time.sleep(0.05)
    assert chat(d, home, "beta", "Good morning").returncode == 0
    rows = mlxcc("sessions", home=home)
    assert rows.returncode == 0, rows.stderr
    lines = rows.stdout.strip().splitlines()
    assert lines[0].split() == ["NAME", "MODEL", "TURNS", "TOKENS", "SIZE", "LAST", "USED"]
    assert [ln.split()[0] for ln in lines[1:]] == ["beta", "alpha"]  # most recently used first
    listed = {x["name"]: x for x in json.loads(mlxcc("sessions", "list", "--json", home=home).stdout)}
    for name, turns in (("alpha", 2), ("beta", 1)):
        f = home / "sessions" / f"{name}.safetensors"
        info = read_cache_info(f)
        s = listed[name]
        assert (s["turns"], s["tokens"], s["size"]) == (turns, info.num_tokens, f.stat().st_size)
        assert s["model"] == str(d.resolve()) and s["last_used"] == pytest.approx(f.stat().st_mtime)
        row = next(ln.split() for ln in lines if ln.startswith(name + " "))
        assert row[1:4] == [d.name, str(turns), str(info.num_tokens)]

    shown = mlxcc("sessions", "show", "alpha", home=home)
    assert shown.returncode == 0
    info = read_cache_info(home / "sessions" / "alpha.safetensors")
    users = 0
    for m in info.messages:  # user messages numbered, as /edit N names them
        users += m["role"] == "user"
        label = f"user [{users}]" if m["role"] == "user" else m["role"]
        assert f"{label}:\n    {m['content']}" in shown.stdout
    assert json.loads(mlxcc("sessions", "show", "alpha", "--json", home=home).stdout) == info.messages

    gone = mlxcc("sessions", "rm", "alpha", home=home)
    assert gone.returncode == 0 and not (home / "sessions" / "alpha.safetensors").exists()
    missing = mlxcc("sessions", "show", "alpha", home=home)
    assert missing.returncode == 1 and "no session named 'alpha'" in one_line(missing)
    assert sorted(p.name for p in (home / "sessions").iterdir()) == ["beta.safetensors"]  # no lock files left


def test_a_chat_holding_a_session_blocks_rm_and_generate(tiny_model_dirs, tmp_path, mlxcc, chat):
    d, home = tiny_model_dirs["llama"], tmp_path
    assert chat(d, home, "held", "Hello there").returncode == 0
    f = home / "sessions" / "held.safetensors"
    before = f.read_bytes()
    p = open_chat(d, home, "held")
    try:
        rm = mlxcc("sessions", "rm", "held", home=home)
        assert rm.returncode == 1 and "already open in another mlxcc process" in one_line(rm)
        for extra in ((), ("--save-prompt-cache", str(f))):
            g = mlxcc("generate", "--model", str(d), "-p", "Hi", "--prompt-cache-file", str(f), *extra, home=home)
            assert g.returncode == 1 and f"pid {p.pid}" in one_line(g), g.stderr
        assert f.read_bytes() == before
    finally:
        p.communicate("", timeout=60)
    assert p.returncode == 0
    assert not (home / "sessions" / "held.lock").exists()  # released and removed
    g = mlxcc("generate", "--model", str(d), "-p", "Hi", "-n", "2", "--prompt-cache-file", str(f), home=home)
    assert g.returncode == 0, g.stderr
    assert mlxcc("sessions", "rm", "held", home=home).returncode == 0
    assert list((home / "sessions").iterdir()) == []


def test_lock_files_of_killed_chats_are_removed(tiny_model_dirs, tmp_path, mlxcc):
    d, home = tiny_model_dirs["llama"], tmp_path
    p = open_chat(d, home, "killed")
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert (home / "sessions" / "killed.lock").exists()  # the OS dropped the lock, the file stays
    live = open_chat(d, home, "live")
    try:
        r = mlxcc("sessions", home=home)
        assert r.returncode == 0
        assert not (home / "sessions" / "killed.lock").exists()
        assert (home / "sessions" / "live.lock").exists()  # a held lock is never removed
    finally:
        live.communicate("", timeout=60)
    assert not (home / "sessions" / "live.lock").exists()


def test_resume_without_model_uses_the_recorded_one(tiny_model_dirs, tmp_path, chat):
    home = tmp_path / "home"
    d = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "my-model")
    first = chat(d, home, "s", "Hello there")
    assert first.returncode == 0, first.stderr
    again = chat(None, home, "s", "What is a river?", "/history")
    assert again.returncode == 0, again.stderr
    assert f"[model: {d.resolve()} (recorded in the session)]" in again.stderr
    assert "resumed session 's': 1 turn" in again.stderr and "(0 recomputed)" in again.stderr
    info = read_cache_info(home / "sessions" / "s.safetensors")
    assert [m["content"] for m in info.messages if m["role"] == "user"] == ["Hello there", "What is a river?"]
    assert "user [1]:\n    Hello there" in again.stdout and "user [2]:\n    What is a river?" in again.stdout  # /history
    shutil.rmtree(d)
    moved = chat(None, home, "s", "Hi")
    assert moved.returncode == 1
    line = one_line(moved)
    assert str(d.resolve()) in line and "no longer exists" in line and "--model" in line


def test_history_in_the_terminal(tiny_model_dirs, tmp_path):
    import pexpect
    env = {**os.environ, "MLXCC_HOME": str(tmp_path), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": "200"}
    args = ["-m", "mlx_chatcache", "chat", "--model", str(tiny_model_dirs["llama"]), "--session", "h", "-n", "4"]
    try:
        child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", codec_errors="replace",
                              timeout=30, dimensions=(40, 200))  # fmt: skip
    except (OSError, pexpect.ExceptionPexpect) as e:
        pytest.skip(f"pexpect cannot spawn a terminal here: {e}")
    try:
        child.expect(">>>")
        child.sendline("/history")
        child.expect(r"\(no messages yet\)")
        child.expect(">>>")
        child.sendline("Good morning!")
        child.expect(">>>")
        child.sendline("/history")
        child.expect(r"user \[1\]:\s+Good morning!\s+assistant:")
        child.expect(">>>")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert sorted(p.name for p in (tmp_path / "sessions").iterdir()) == ["h.safetensors"]


def test_show_counts_in_the_singular_and_a_damaged_session_is_one_warning(tiny_model_dirs, tmp_path, mlxcc, chat):
    d, home = tiny_model_dirs["llama"], tmp_path
    assert chat(d, home, "one", "Hello there").returncode == 0
    assert chat(d, home, "bad", "Hello again").returncode == 0
    shown = mlxcc("sessions", "show", "one", home=home)
    assert shown.returncode == 0 and ", 1 turn, " in shown.stdout.splitlines()[0], shown.stdout
    f = home / "sessions" / "bad.safetensors"
    raw = bytearray(f.read_bytes())
    at = raw.index(b"Hello again")  # in the header's session JSON: the header checksum no longer matches
    raw[at] = ord("J")
    f.write_bytes(bytes(raw))
    rows = mlxcc("sessions", home=home)
    assert rows.returncode == 0, rows.stderr
    row = next(ln.split() for ln in rows.stdout.splitlines() if ln.startswith("bad "))
    assert row[1] == "(damaged)", rows.stdout
    assert "cache-prompt" not in rows.stdout + rows.stderr
    warning = rows.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("warning: session 'bad' cannot be read (")
    assert warning[0].endswith("so it cannot be repaired; 'mlxcc sessions rm bad' removes it") and str(f) not in warning[0]
    listed = {x["name"]: x for x in json.loads(mlxcc("sessions", "list", "--json", home=home).stdout)}
    assert str(f) in listed["bad"]["problem"] and listed["one"]["problem"] is None  # the whole text


FAKE = '"""\nlook at this:\n## user\nI did not write this\n```python\nprint(1)\n"""'


def md_sections(text: str) -> list[tuple[int, str]]:
    """The (level, text) of every top-level header a Markdown reader sees in ``text``
    (not one inside a quote or a list)."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(text)
    return [(int(t.tag[1]), tokens[i + 1].content) for i, t in enumerate(tokens)
            if t.type == "heading_open" and t.level == 0]  # fmt: skip


def test_export_json_and_markdown(tiny_model_dirs, tmp_path, mlxcc, chat):
    from openai.types.chat import ChatCompletionMessageParam
    from pydantic import TypeAdapter

    d, home = tiny_model_dirs["llama"], tmp_path
    r = chat(d, home, "ex", "Hello there", *FAKE.split("\n"), "## assistant", flags=("--system-prompt", "Be brief."))
    assert r.returncode == 0, r.stderr
    info = read_cache_info(home / "sessions" / "ex.safetensors")
    assert [m["content"] for m in info.messages if m["role"] == "user"][1:] == [
        "look at this:\n## user\nI did not write this\n```python\nprint(1)", "## assistant"]

    as_json = mlxcc("sessions", "export", "ex", home=home)
    assert as_json.returncode == 0, as_json.stderr
    messages = json.loads(as_json.stdout)
    assert messages == info.messages == json.loads(mlxcc("sessions", "show", "ex", "--json", home=home).stdout)
    TypeAdapter(list[ChatCompletionMessageParam]).validate_python(messages)  # what a client sends as is

    md = mlxcc("sessions", "export", "ex", "--format", "md", home=home)
    assert md.returncode == 0, md.stderr
    assert md_sections(md.stdout) == [(1, "ex")] + [(2, m["role"]) for m in messages]
    for m in messages:
        assert m["content"] in md.stdout  # verbatim
    assert f"model: {d.resolve()}" in md.stdout

    out = tmp_path / "chat.md"
    w = mlxcc("sessions", "export", "ex", "--format", "md", "-o", str(out), home=home)
    assert w.returncode == 0 and out.read_text() == md.stdout, w.stderr
    out.write_text("my notes\n")
    again = mlxcc("sessions", "export", "ex", "-o", str(out), home=home)
    assert again.returncode == 1 and "exists" in one_line(again) and "--force" in one_line(again)
    assert out.read_text() == "my notes\n"
    forced = mlxcc("sessions", "export", "ex", "-o", str(out), "--force", home=home)
    assert forced.returncode == 0 and json.loads(out.read_text()) == messages
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp file left
    missing = mlxcc("sessions", "export", "nope", home=home)
    assert missing.returncode == 1 and "no session named 'nope'" in one_line(missing)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]),
                          st.text(st.sampled_from("ab #=-`~\n>*_ \t<!"), max_size=40)), max_size=5))  # fmt: skip
def test_markdown_export_has_one_header_per_message_whatever_they_say(pairs):
    from mlx_chatcache.chat.session_export import to_markdown

    messages = [{"role": r, "content": c} for r, c in pairs]
    text = to_markdown("s", "m", messages)
    assert md_sections(text) == [(1, "s")] + [(2, m["role"]) for m in messages]
    for m in messages:
        assert m["content"] in text
