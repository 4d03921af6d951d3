"""Every door that writes a cache file, driven through ``mlxcc``'s entry point (in-process;
a chat holding a session through a symlink is a real process), against every file a save
must not replace by mistake.

:data:`DOORS` lists each command option and REPL command that names a file to
write (tests/test_architecture.py checks that no writing option is missing).
Victims: a session another process holds (the lock is held by this test, as an
open chat would), a closed chat session, a text file, and a symlink to the open
session. Without ``--force`` every door refuses each of them in one line and the
victim keeps its bytes (a chat resuming a closed session, or ``/load`` of one,
uses it and writes nothing); with ``--force`` the closed session and the text
file are replaced, the open session never.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from mlx_chatcache.errors import ChatCacheError
from mlx_chatcache.files.cache_file import is_session
from mlx_chatcache.files.mlxcc_format import read_cache_info, save_prompt_cache
from mlx_chatcache.files.lock import SessionLock


VICTIMS = ("open session", "closed session", "text file", "symlink to open session")
HELD = {"open session", "symlink to open session"}  # another process holds them: refused even with --force


@dataclass(frozen=True)
class Door:
    """How to make ``mlxcc`` write ``victim``: ``run(victim, ctx, force) -> (argv, stdin)``."""

    run: Callable[[Path, dict, bool], tuple[list, str | None]]
    repl: bool = False  # the refusal is the REPL's one "error:" line
    force: bool = True  # has --force (replaces a closed session and a text file)
    uses: frozenset = frozenset()  # victims it reads without writing (a chat resumes a closed session)
    home: bool = False  # the victim is a session of MLXCC_HOME (chat --session NAME)


def _f(force: bool) -> list[str]:
    return ["--force"] if force else []


DOORS: dict[str, Door] = {
    "cache-prompt --prompt-cache-file": Door(
        lambda v, c, force: (["cache-prompt", "--model", c["model"], "-p", "hi", "--prompt-cache-file", v, *_f(force)], None)),
    "generate --save-prompt-cache": Door(
        lambda v, c, force: (["generate", "--model", c["model"], "-p", "hi", "-m", "2", "--save-prompt-cache", v,
                              *_f(force)], None)),  # fmt: skip
    "cache convert OUTPUT": Door(
        lambda v, c, force: (["cache", "convert", c["source"], v, "--to", "mlxcc", *_f(force)], None)),
    "cache trim --output": Door(
        lambda v, c, force: (["cache", "trim", c["source"], "2", "--output", v, *_f(force)], None)),
    # in place: a session or a file that is not a cache is never trimmed, --force or not
    "cache trim FILE": Door(lambda v, c, force: (["cache", "trim", v, "1", *_f(force)], None), force=False),
    "/save": Door(lambda v, c, force: (["chat", "--model", c["model"], "-m", "2"],
                                       f"/save {v}{' --force' if force else ''}\n"), repl=True),  # fmt: skip
    "/load": Door(lambda v, c, force: (["chat", "--model", c["model"], "-m", "2"], f"/load {v}\n"), repl=True,
                  force=False, uses=frozenset({"closed session"})),  # fmt: skip
    "chat --session-file": Door(lambda v, c, force: (["chat", "--model", c["model"], "-m", "2", "--session-file", v], ""),
                                force=False, uses=frozenset({"closed session"})),  # fmt: skip
    "chat --session": Door(lambda v, c, force: (["chat", "--model", c["model"], "-m", "2", "--session", v.stem], ""),
                           force=False, uses=frozenset({"closed session"}), home=True),  # fmt: skip
    # a session that is not damaged is left as it is
    "sessions repair NAME": Door(lambda v, c, force: (["sessions", "repair", v.stem, "--model", c["model"]], None),
                                 force=False, uses=frozenset({"closed session"}), home=True),  # fmt: skip
}


@pytest.fixture(scope="module")
def session_bytes(tiny_model_dirs, tmp_path_factory) -> bytes:
    """A closed chat session of the tiny llama (one turn)."""
    from mlx_chatcache.chat.session import ChatSession
    from mlx_chatcache.config import DEFAULTS
    from mlx_chatcache.models.loading import load

    model, tokenizer = load(str(tiny_model_dirs["llama"]))
    s = ChatSession(model, tokenizer, config=DEFAULTS.updated(max_tokens=3))
    s.ask("Hello there")
    f = tmp_path_factory.mktemp("session") / "s.safetensors"
    s.save(f)
    return f.read_bytes()


@pytest.fixture
def ctx(tmp_path, tiny_model_dirs):
    """The model and a plain cache file for the tools to read (4 tokens, trimmable)."""
    from mlx_chatcache.cache import KVCache
    import mlx.core as mx

    c = KVCache()
    c.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)))
    source = tmp_path / "source.safetensors"
    save_prompt_cache(source, [c], tokens=[1, 2, 3, 4])
    home = tmp_path / "home"
    (home / "sessions").mkdir(parents=True)
    return {"model": str(tiny_model_dirs["llama"]), "source": str(source), "home": home}


@pytest.fixture
def place(tmp_path, session_bytes):
    """``place(victim, door) -> (path to give, path whose bytes must not change)``; the
    open session's lock is held (released at the end of the test)."""
    locks = []

    def make(victim: str, door: Door, ctx: dict) -> tuple[Path, Path]:
        folder = ctx["home"] / "sessions" if door.home else tmp_path
        path = folder / "victim.safetensors"
        real = path
        if victim == "text file":
            path.write_text("my notes\n")
        elif victim == "closed session":
            path.write_bytes(session_bytes)
        else:
            if victim == "symlink to open session":
                real = tmp_path / "open.safetensors"
                path.symlink_to(real)
            real.write_bytes(session_bytes)
            locks.append(SessionLock(real, "'open'").acquire())
        return path, real

    yield make
    for lock in locks:
        lock.release()


def run_door(cli, door: Door, path: Path, ctx: dict, force: bool):
    argv, stdin = door.run(path, ctx, force)
    return cli(*argv, stdin=stdin, env={"MLXCC_HOME": ctx["home"]})


def refusal(p, door: Door) -> str:
    """The one line that says why the door refused (exit 1, nothing else on stderr, no output)."""
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 1 and "Traceback" not in p.stderr and len(lines) == 1, (p.returncode, p.stderr)
    assert lines[0].startswith("error: " if door.repl else "mlxcc: error: "), lines
    assert p.stdout == ""
    return lines[0]


def is_cache(path: Path) -> bool:
    try:
        read_cache_info(path)
    except ChatCacheError:
        return False
    return True


@pytest.mark.parametrize("victim", VICTIMS)
@pytest.mark.parametrize("name", list(DOORS))
def test_a_door_never_replaces_a_victim_without_force(name, victim, ctx, place, cli):
    door = DOORS[name]
    path, real = place(victim, door, ctx)
    before = real.read_bytes()
    p = run_door(cli, door, path, ctx, force=False)
    assert real.read_bytes() == before
    if victim in door.uses:  # read, not written
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        return
    line = refusal(p, door)
    if victim in HELD:
        assert "already open in another mlxcc process" in line
    assert not any(f.name.endswith(".tmp.safetensors") for f in path.parent.iterdir())


@pytest.mark.parametrize("victim", VICTIMS)
@pytest.mark.parametrize("name", [n for n, d in DOORS.items() if d.force])
def test_force_replaces_a_closed_session_or_a_text_file_never_an_open_one(name, victim, ctx, place, cli):
    door = DOORS[name]
    path, real = place(victim, door, ctx)
    before = real.read_bytes()
    p = run_door(cli, door, path, ctx, force=True)
    if victim in HELD:
        assert "already open in another mlxcc process" in refusal(p, door)
        assert real.read_bytes() == before
        return
    assert p.returncode == 0 and "error" not in p.stderr, p.stderr
    assert real.read_bytes() != before and is_cache(real)
    assert is_session(read_cache_info(real)) == (name == "/save")  # only /save writes a session


def test_load_switches_the_chat_and_writes_nothing(ctx, tmp_path, session_bytes, place, cli):
    """``/load OTHER`` leaves the current session's file as last saved; the chat is then saved to OTHER."""
    current = ctx["home"] / "sessions" / "cur.safetensors"
    current.write_bytes(session_bytes)
    other = tmp_path / "other.safetensors"
    other.write_bytes(session_bytes)
    env = {"MLXCC_HOME": ctx["home"]}
    p = cli("chat", "--model", ctx["model"], "-m", "2", "--session", "cur", stdin=f"/load {other}\n/bye\n", env=env)
    assert p.returncode == 0, p.stderr
    assert current.read_bytes() == session_bytes and other.read_bytes() == session_bytes
    p = cli("chat", "--model", ctx["model"], "-m", "2", "--session", "cur", stdin=f"/load {other}\nMore please\n",
            env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert current.read_bytes() == session_bytes  # the turn after /load went to OTHER
    assert [m["content"] for m in read_cache_info(other).messages if m["role"] == "user"] == ["Hello there", "More please"]
    assert not list(ctx["home"].glob("sessions/*.lock")) and not list(tmp_path.glob("*.lock"))


def test_a_symlinked_session_file_shares_the_lock_of_its_target(ctx, tmp_path, session_bytes, cli):
    """A chat (another process) holding a session through a symlink keeps ``generate`` on the real path out."""

    real = tmp_path / "real.safetensors"
    real.write_bytes(session_bytes)
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)
    env = {"MLXCC_HOME": str(ctx["home"])}
    chat = subprocess.Popen([sys.executable, "-m", "mlx_chatcache", "chat", "--model", ctx["model"], "-m", "2",
                             "--session-file", str(link)], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **env})  # fmt: skip
    try:
        line = chat.stderr.readline()
        while "resumed session" not in line:
            assert line, "the chat ended before resuming"
            line = chat.stderr.readline()
        g = cli("generate", "--model", ctx["model"], "-p", "hi", "-m", "2", "--prompt-cache-file", real,
                "--save-prompt-cache", real, "--force", env=env)  # fmt: skip
        assert g.returncode == 1 and f"pid {chat.pid}" in g.stderr, g.stderr
        assert real.read_bytes() == session_bytes
    finally:
        chat.communicate("", timeout=60)
    assert chat.returncode == 0 and link.is_symlink()
