"""``mlxcc chat`` end to end on the tiny models (greedy unless said).

Most runs call ``mlx_chatcache.cli.main.main`` in-process with stdin replaced
(stdin is then not a terminal, so input is read line by line); a resume in a
new process and a second process on a held session run the real command in
subprocesses, saves killed mid-way run in processes forked by tests/fork_server.py. ``--verbose`` prints
one ``[stats]`` line per turn on stderr, which the tests parse for token counts.
"""

from __future__ import annotations

import io
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fork_server import ForkServer
from tiny_models import IM_END, IM_START

from mlx_chatcache.files.mlxcc_format import read_cache_info
from mlx_chatcache.cli.main import main
from mlx_chatcache.errors import UsageError
from mlx_chatcache.cli.chat_input import StreamReader, message_text, parse_command, parse_setting, read_input

SYSTEM = "Keep your answers short."
TURNS = [
    "Good morning!",
    "What is the capital of Italy?",
    "Write a list: apples, oranges.",
    "Thank you very much.",
]
STATS = re.compile(
    r"\[stats\] prompt: (\d+) new \+ (\d+) reused tokens \((\d+) recomputed\).*reply: (\d+) tokens"
)
RESUMED = re.compile(r"resumed session '(\w+)': (\d+) turns?, (\d+) tokens in the cache, 0 tokens recomputed")


def stats(err: str) -> list[dict]:
    return [
        dict(zip(("new", "reused", "recomputed", "generated"), map(int, m.groups())))
        for m in STATS.finditer(err)
    ]


def script(*lines: str) -> str:
    return "".join(line + "\n" for line in lines)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MLXCC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def chat(home, monkeypatch, capsys):
    """``chat(model_dir, stdin, *flags) -> (rc, stdout, stderr)`` in-process."""

    def run(model_dir, stdin: str, *flags: str):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        rc = main(["chat", "--model", str(model_dir), "--max-tokens", "8", "-v", *flags])
        cap = capsys.readouterr()
        return rc, cap.out, cap.err

    return run


def subprocess_chat(model_dir, stdin: str, *flags: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLXCC_HOME": str(home)}
    cmd = [sys.executable, "-m", "mlx_chatcache", "chat", "--model", str(model_dir), "--max-tokens", "8", "-v", *flags]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=120)


# ------------------------------------------------------------------ resume
@pytest.mark.blas  # the replies of one run and of a stopped and resumed one compared
def test_stopped_and_resumed_chat_prints_what_one_run_prints(tiny_model_dirs, chat, home):
    d = tiny_model_dirs["llama"]
    flags = ("--system-prompt", SYSTEM)
    rc, full_out, full_err = chat(d, script(*TURNS), "--session", "full", *flags)
    assert rc == 0
    full = stats(full_err)
    assert len(full) == 4

    k = 2
    rc, first_out, first_err = chat(d, script(*TURNS[:k]), "--session", "s", *flags)
    assert rc == 0, first_err
    assert "new session 's'" in first_err
    second = subprocess_chat(d, script(*TURNS[k:], "/bye"), "--session", "s", *flags, home=home)  # a new process
    assert second.returncode == 0, second.stderr
    assert first_out + second.stdout == full_out
    m = RESUMED.search(second.stderr)
    assert m and int(m.group(2)) == k, second.stderr
    cached = int(m.group(3))
    resumed = stats(second.stderr)
    # the resumed turn feeds only its own tokens: all history comes from the file
    assert resumed[0]["recomputed"] == 0 and resumed[0]["reused"] == cached
    assert resumed == full[k:]
    info = read_cache_info(home / "sessions" / "s.safetensors")
    assert [m["content"] for m in info.messages if m["role"] == "user"] == TURNS
    assert not list((home / "sessions").glob(".*tmp*"))


def test_each_turn_feeds_only_its_new_tokens(tiny_model_dirs, llama_model, chat):
    tokenizer = llama_model[1]  # every tiny kind shares the tokenizer
    rc, out, err = chat(tiny_model_dirs["hybrid"], script(*TURNS), "--session", "h")
    assert rc == 0
    st = stats(err)
    assert len(st) == 4 and st[0]["reused"] == 0
    for q, prev, cur in zip(TURNS[1:], st, st[1:]):
        # everything fed or generated before is reused (all but the held-back last token)
        assert cur["reused"] == prev["new"] + prev["reused"] + prev["generated"] - 1
        assert cur["recomputed"] == 0
        # fed: that held-back token + what ChatML adds after a reply cut at --max-tokens
        assert prev["generated"] == 8
        added = f"{IM_END}\n{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n"
        assert cur["new"] == 1 + len(tokenizer.encode(added, add_special_tokens=False))


# ------------------------------------------------------------------ undo / retry
@pytest.mark.blas  # replies after /undo and /retry compared with the first ones
@pytest.mark.parametrize(
    "kind,flags",
    [("llama", ()), ("llama", ("--max-kv-size", "40")), ("hybrid", ())],
    ids=["kv", "rotating-wrapped", "hybrid"],
)
def test_undo_and_retry_reproduce_without_prefill(kind, flags, tiny_model_dirs, chat, home):
    d = tiny_model_dirs[kind]
    sp = ("--system-prompt", SYSTEM)
    rc, out_a, err_a = chat(d, script(*TURNS[:3]), "--session", "a", *sp, *flags)
    assert rc == 0
    msgs_a = read_cache_info(home / "sessions" / "a.safetensors").messages
    rc, out_b, err_b = chat(d, script(*TURNS[:3], "/undo", TURNS[2], "/retry", "/show cache"), "--session", "b", *sp, *flags)
    assert rc == 0, err_b
    assert "[removed the last exchange; 2 turns left]" in err_b
    assert "recomputed" not in err_b.split("[removed")[1].split("\n")[0]
    msgs_b = read_cache_info(home / "sessions" / "b.safetensors").messages
    assert msgs_b == msgs_a
    reply3 = msgs_a[-1]["content"] + "\n"
    assert out_b.startswith(out_a + reply3 + reply3)
    st_a, st_b = stats(err_a), stats(err_b)
    assert st_b[:3] == st_a
    assert st_b[3] == st_a[2] and st_b[4] == st_a[2]  # same new/reused counts, 0 recomputed
    if flags:  # the window wrapped before the undo: rolled back from a checkpoint copy
        assert st_a[2]["reused"] > 40
        assert "rotating window of 40 tokens" in out_b and "trimmable:   no" in out_b


@pytest.mark.blas  # two seeded runs compared
def test_retry_with_seed_is_reproducible(tiny_model_dirs, chat):
    d = tiny_model_dirs["llama"]
    flags = ("--temp", "0.9", "--seed", "5", "--max-tokens", "12")
    runs = [chat(d, script(TURNS[0], "/retry", "/retry"), *flags) for _ in range(2)]
    assert runs[0][0] == 0 and runs[0][1] == runs[1][1]
    st = stats(runs[0][2])
    assert len(st) == 3 and st[1] == st[0] == st[2]


# ------------------------------------------------------------------ commands
def test_commands_and_multiline(tiny_model_dirs, chat, home):
    d = tiny_model_dirs["llama"]
    saved = home.parent / "copy.safetensors"
    rc, out, err = chat(
        d,
        script(
            "/help", '"""', "first line", "", "second line", '"""', "/show info", "/system",
            "/system Be kind.", "/set temp 0.5", "/set max_tokens 3", "/set top_p 2", "/nope",
            "//slash message", "/show stats", f"/save {saved}", "/clear", "/show template",
            f"/load {saved}", "/history", "/undo", "/undo", "/undo", "/show", "/bye", "never sent",
        ),
        "--session", "c", "--system-prompt", SYSTEM,
    )  # fmt: skip
    assert rc == 1  # scripted input with failed commands exits non-zero
    assert "/retry" in out and "multi-line" in out  # help
    assert "sampling:      temp=0.0" in out and SYSTEM in out
    assert "[temp = 0.5]" in err and "[max_tokens = 3]" in err
    assert "error: /set top_p: must be between 0 and 1" in err
    assert "error: unknown command '/nope'" in err
    assert "last turn: prompt:" in out and "reply: 3 tokens" in out
    assert "<|im_start|>" in out  # template
    assert "error: there is no exchange" in err
    assert "error: usage: /show info|cache|stats|template" in err
    # /save wrote both exchanges; /load continues them (the conversation after it)
    assert f"[loaded {saved}: 2 turns," in err
    history = out[out.index("system:\n    Be kind.\nuser [1]:"):]
    assert history.startswith("system:\n    Be kind.\nuser [1]:\n    first line\n    \n    second line\nassistant:")
    assert "user [2]:\n    /slash message\nassistant:" in history
    # /load switched the chat to the loaded file: two undos are saved there; the session
    # it left keeps what /clear saved
    assert read_cache_info(saved).messages == [{"role": "system", "content": "Be kind."}]
    final = read_cache_info(home / "sessions" / "c.safetensors")
    assert final.messages == [{"role": "system", "content": "Be kind."}]


def test_input_parsing_units():
    assert parse_command("/set temp 1") == ("set", "temp 1")
    assert parse_command("  /BYE ") == ("bye", "")
    assert parse_command("//x") is None and message_text("//x y") == "/x y"
    assert parse_command("hello /bye") is None
    r = StreamReader(io.StringIO('"""one\ntwo"""\n"""inline"""\n"""\n/bye\n'))
    assert read_input(r).text == "one\ntwo"
    assert read_input(r).text == "inline"
    last = read_input(r)  # unterminated block at EOF: what was typed, never a command
    assert last.multiline and last.text == "/bye"
    assert read_input(r) is None
    assert parse_setting("top-p 0.5") == ("top_p", 0.5)
    assert parse_setting("seed none") == ("seed", None)
    with pytest.raises(UsageError):
        parse_setting("max_tokens 0")


# ------------------------------------------------------------------ refusals
def test_session_of_another_model_is_refused(tiny_model_dirs, make_tiny_model_dir, chat):
    rc, _, _ = chat(tiny_model_dirs["llama"], script(TURNS[0]), "--session", "m")
    assert rc == 0
    rc, out, err = chat(make_tiny_model_dir("llama", seed=1), script(TURNS[1]), "--session", "m")
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("mlxcc: error: ")
    assert "session was made with model" in err and "differs from the loaded model" in err


@pytest.mark.parametrize("name", ["../x", "/tmp/abs", "a\x00b", "n" * 300, "..", ".x"])
def test_bad_session_names_are_refused(name, tiny_model_dirs, chat, home):
    rc, out, err = chat(tiny_model_dirs["llama"], "", "--session", name)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "invalid session name" in err
    assert not home.parent.joinpath("x.safetensors").exists()
    assert not list((home / "sessions").glob("*.safetensors")) if (home / "sessions").exists() else True


def test_second_process_on_the_same_session_is_refused(tiny_model_dirs, chat, home):
    d = tiny_model_dirs["llama"]
    env = {**os.environ, "MLXCC_HOME": str(home)}
    first = subprocess.Popen(
        [sys.executable, "-m", "mlx_chatcache", "chat", "--model", str(d), "--session", "busy", "--max-tokens", "4"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = first.stderr.readline()  # printed once the lock is held and the model loaded
        assert "new session 'busy'" in line
        rc, out, err = chat(d, script(TURNS[0]), "--session", "busy")
        assert rc == 1 and err.count("\n") == 1
        assert f"session 'busy' is already open in another mlxcc process (pid {first.pid})" in err
        out1, err1 = first.communicate(script(TURNS[0], "/bye"), timeout=60)
        assert first.returncode == 0, err1
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    rc, out, err = chat(d, script(TURNS[1]), "--session", "busy")  # free again
    assert rc == 0 and "resumed session 'busy': 1 turn," in err


# ------------------------------------------------------------------ crash safety
SAVER = textwrap.dedent(
    """
    import sys
    from mlx_chatcache.config import DEFAULTS
    from mlx_chatcache.models.loading import load
    from mlx_chatcache.chat.session import ChatSession

    model, tokenizer = load(sys.argv[1])
    s = ChatSession(model, tokenizer, config=DEFAULTS.updated(max_tokens=6))
    s.ask("Good morning!")
    s.save(sys.argv[2])
    print("ready", flush=True)
    i = 0
    while True:  # grow and shrink the session, saving all the time
        s.ask(f"Message number {i}.") if i % 3 < 2 else s.undo()
        for _ in range(3):
            s.save(sys.argv[2])
        i += 1
    """
)


def test_kill_during_save_leaves_a_loadable_session(tiny_model_dirs, chat, home, tmp_path):
    from mlx_chatcache.models.loading import load
    from mlx_chatcache.chat.session import ChatSession

    d = tiny_model_dirs["hybrid"]
    path = tmp_path / "killed.safetensors"
    rng = random.Random(1234)
    with ForkServer("mlx.core", "mlx_chatcache.models.loading", "mlx_chatcache.chat.session") as server:
        for _ in range(3):
            pid, first = server.start(SAVER, d, path)
            try:
                assert first == "ready\n", first
                time.sleep(rng.uniform(0.05, 0.5))
            finally:
                os.kill(pid, signal.SIGKILL)
                server.reap(pid)
            model, tokenizer = load(str(d))
            s = ChatSession.load(path, model, tokenizer)
            assert s.num_turns >= 1 and len(s.messages) == 2 * s.num_turns
            s.ask("Still there?")  # and it continues
    # the chat command removes temp files a killed save left behind
    rc, _, err = chat(d, "", "--session-file", str(path))
    assert rc == 0 and "resumed session" in err
    assert not list(tmp_path.glob(".killed.safetensors.*"))


def test_session_file_refusals(tiny_model_dirs, chat, tmp_path):
    d = tiny_model_dirs["llama"]
    rc, out, err = chat(d, "", "--session-file", str(tmp_path / "missing" / "s.safetensors"))
    assert rc == 1 and err.count("\n") == 1 and "does not exist" in err
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    rc, out, err = chat(d, "", "--session-file", str(junk))
    assert rc == 1 and err.count("\n") == 1 and err.startswith("mlxcc: error: ")
    with pytest.raises(SystemExit) as e:
        chat(d, "", "--session", "a", "--session-file", str(junk))
    assert e.value.code == 2


def test_session_file_keeps_its_window_for_mlxcc_generate(tiny_model_dirs, tmp_path, capsys, monkeypatch):
    """A session made with --max-kv-size, continued by `mlxcc generate --prompt-cache-file`,
    keeps its rotating window shape (max_kv_size and the pinned keep)."""
    from mlx_chatcache.models.loading import load
    from mlx_chatcache.files.prompt_cache import PromptCache

    model_dir = str(tiny_model_dirs["llama"])
    f = tmp_path / "s.safetensors"
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n/bye\n"))
    assert main(["chat", "--model", model_dir, "--session-file", str(f), "--max-kv-size", "48",
                 "--system-prompt", "Be brief.", "-m", "4"]) == 0
    model, _ = load(model_dir)
    stored = PromptCache.load(f, model)
    assert stored.shape.max_kv_size == 48 and stored.shape.keep > 4
    capsys.readouterr()
    assert main(["generate", "--model", model_dir, "-p", "more", "-m", "3", "--prompt-cache-file", str(f)]) == 0


# ------------------------------------------------------------------ from a prebuilt cache
def cache_prompt(model_dir, path: Path, *flags: str) -> None:
    assert main(["cache-prompt", "--model", str(model_dir), "--prompt-cache-file", str(path), *flags]) == 0


@pytest.mark.blas  # replies from the prebuilt cache and from a fresh chat compared
@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_chat_from_a_prebuilt_system_prompt_feeds_only_new_tokens(kind, tiny_model_dirs, chat, home, tmp_path):
    d = tiny_model_dirs[kind]
    f = tmp_path / "sys.safetensors"
    cache_prompt(d, f, "--system-prompt", SYSTEM)
    before = f.read_bytes()
    cached = len(read_cache_info(f).tokens)
    rc, fresh_out, fresh_err = chat(d, script(*TURNS[:2]), "--system-prompt", SYSTEM)
    assert rc == 0
    rc, out, err = chat(d, script(*TURNS[:2]), "--prompt-cache-file", str(f), "--session", "n")
    assert rc == 0, err
    assert out == fresh_out  # the same replies as a chat that computed the system prompt itself
    fresh, st = stats(fresh_err), stats(err)
    assert len(st) == 2 and fresh[0]["reused"] == 0
    # the first turn feeds only what follows the cached system prompt
    assert st[0]["reused"] == cached > 0 and st[0]["recomputed"] == 0
    assert st[0]["new"] == fresh[0]["new"] - cached
    assert st[1] == fresh[1]
    assert f.read_bytes() == before  # F is only read
    info = read_cache_info(home / "sessions" / "n.safetensors")
    assert [m["role"] for m in info.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert info.messages[0]["content"] == SYSTEM and info.messages[3]["content"] == TURNS[1]
    # and the new session resumes like any other
    rc, _, err = chat(d, script(TURNS[2]), "--session", "n")
    assert rc == 0 and "resumed session 'n': 2 turns," in err and stats(err)[0]["recomputed"] == 0


@pytest.mark.blas  # replies compared with a fresh session's
def test_chat_from_a_prebuilt_conversation_equals_a_fresh_session(llama_model, tiny_model_dirs, chat, tmp_path):
    from mlx_chatcache.chat.session import ChatSession
    from mlx_chatcache.config import DEFAULTS

    d = tiny_model_dirs["llama"]
    f = tmp_path / "conv.safetensors"
    cache_prompt(d, f, "--system-prompt", SYSTEM, "-p", TURNS[0], "--max-kv-size", "200")
    before = f.read_bytes()
    cached = len(read_cache_info(f).tokens)
    rc, out, err = chat(d, script(TURNS[1], TURNS[2]), "--prompt-cache-file", str(f))  # no session: unsaved
    assert rc == 0, err
    model, tokenizer = llama_model
    ref = ChatSession(model, tokenizer, system_prompt=SYSTEM, config=DEFAULTS.updated(max_tokens=8, max_kv_size=200))
    ref.messages.append({"role": "user", "content": TURNS[0]})
    replies = [ref.ask(TURNS[1]), ref.ask(TURNS[2])]
    assert out == "".join(r.text + "\n" for r in replies)
    st = stats(err)
    assert st[0]["reused"] == cached and st[0]["new"] == replies[0].stats.prompt_tokens - cached
    assert f.read_bytes() == before


@pytest.mark.blas  # the replies of two runs compared
def test_chat_from_a_kv_quantized_prebuilt_cache_takes_its_settings(tiny_model_dirs, chat, tmp_path):
    d = tiny_model_dirs["llama"]
    f = tmp_path / "q.safetensors"
    cache_prompt(d, f, "--system-prompt", SYSTEM, "--kv-bits", "8", "--quantized-kv-start", "0")
    before = f.read_bytes()
    rc, out, err = chat(d, script(TURNS[0], TURNS[1]), "--prompt-cache-file", str(f))
    assert rc == 0, err
    assert stats(err)[0]["reused"] == len(read_cache_info(f).tokens)
    rc, out2, err2 = chat(d, script(TURNS[0], TURNS[1]), "--prompt-cache-file", str(f), "--kv-bits", "8")
    assert rc == 0 and out2 == out
    assert f.read_bytes() == before


@pytest.mark.blas  # replies compared with a fresh chat's
def test_chat_from_a_prebuilt_cache_with_another_system_prompt_reads_it_again(tiny_model_dirs, chat, tmp_path):
    d = tiny_model_dirs["llama"]
    f = tmp_path / "sys.safetensors"
    cache_prompt(d, f, "--system-prompt", SYSTEM, "--max-kv-size", "64")
    before = f.read_bytes()
    rc, fresh_out, fresh_err = chat(d, script(TURNS[0]), "--system-prompt", "Be kind.", "--max-kv-size", "64")
    rc2, out, err = chat(d, script(TURNS[0]), "--prompt-cache-file", str(f), "--system-prompt", "Be kind.")
    # the same work as a fresh chat; the tokens F held that start the new prompt too are fed again
    # (the window pins another count, so the cache starts afresh): counted as recomputed
    from mlx_chatcache.files.tokens import common_prefix_len
    from mlx_chatcache.generation.templates import render_chat
    from mlx_chatcache.generation.text import as_tokenizer_wrapper
    from mlx_chatcache.models.loading import load_tokenizer

    prompt = render_chat(as_tokenizer_wrapper(load_tokenizer(str(d))), [{"role": "system", "content": "Be kind."},
                                                                        {"role": "user", "content": TURNS[0]}])
    again = common_prefix_len(read_cache_info(f).tokens, prompt)
    assert rc == rc2 == 0 and out == fresh_out and again > 0
    assert stats(err) == [{**st, "recomputed": again} for st in stats(fresh_err)]
    assert "[new system prompt: the cache of" in err and "[started from" not in err
    # the same system prompt is no change; a window pinning less than the system prompt is said
    rc, out, err = chat(d, script(TURNS[0]), "--prompt-cache-file", str(f), "--system-prompt", SYSTEM)
    assert rc == 0 and stats(err)[0]["reused"] == len(read_cache_info(f).tokens)
    assert "pins its first 4 tokens, not the whole system prompt" in err
    assert f.read_bytes() == before


def _refusal_files(d, other_model, tmp_path):
    """name -> (file, extra flags, words the one-line refusal must contain, refused before the model loads)."""
    from mlx_chatcache.files.mlxcc_format import save_prompt_cache
    from mlx_chatcache.files.prompt_cache import PromptCache
    from mlx_chatcache.models.loading import load
    from mlx_chatcache.store.disk import DiskTier
    from mlx_chatcache.store.store import PromptStore, make_scope

    sys_f = tmp_path / "sys.safetensors"
    cache_prompt(d, sys_f, "--system-prompt", SYSTEM)
    raw = tmp_path / "raw.safetensors"
    cache_prompt(d, raw, "-p", "Once upon a time", "--ignore-chat-template")
    win = tmp_path / "win.safetensors"
    cache_prompt(d, win, "--system-prompt", SYSTEM, "--max-kv-size", "64")
    q8 = tmp_path / "q8.safetensors"
    cache_prompt(d, q8, "--system-prompt", SYSTEM, "--kv-bits", "8")
    stored = PromptCache.load(sys_f, load(str(d))[0])
    entry = tmp_path / "entry.safetensors"
    save_prompt_cache(entry, stored.cache, tokens=stored.tokens, model=stored.fingerprint)
    store = PromptStore([DiskTier(tmp_path / "store", None)], block_tokens=4)  # blocks and a tail: store values
    assert store.put(make_scope(stored.fingerprint, {}), stored.tokens, stored.cache) == {"disk": True}
    block_entry = next((tmp_path / "store").glob("b*.safetensors"))
    mlxlm = tmp_path / "mlxlm.safetensors"
    save_prompt_cache(mlxlm, stored.cache, format="mlx-lm")
    notes = tmp_path / "notes.txt"
    notes.write_text("not a cache\n")
    return {
        "not a cache file": (notes, (), "is not a safetensors file", True),
        "raw text": (raw, (), "chat needs a chat cache", True),
        "mlx-lm file": (mlxlm, (), "does not say which tokens it holds", True),
        "store entry": (entry, (), "store entry", True),
        "block store value": (block_entry, (), "store entry", True),
        "other window": (win, ("--max-kv-size", "32"), "max_kv_size=64", True),
        "window on an unbounded file": (sys_f, ("--max-kv-size", "64"), "max_kv_size=None", True),
        "other kv bits": (q8, ("--kv-bits", "4"), "kv_bits=8", True),
        "missing file": (tmp_path / "nope.safetensors", (), "not found", True),
        "another model": (sys_f, ("--model", str(other_model)), "differs from the loaded model", False),
    }


def test_chat_from_a_prebuilt_cache_refusals(tiny_model_dirs, make_tiny_model_dir, chat, home, tmp_path):
    d = tiny_model_dirs["llama"]
    files = _refusal_files(d, make_tiny_model_dir("llama", seed=1), tmp_path)
    for name, (f, flags, words, early) in files.items():
        before = f.read_bytes() if f.exists() else None
        # early refusals come before the model loads: a model that does not exist is never reached
        model = ("--model", str(tmp_path / "no-model")) if early else ()
        rc, out, err = chat(d, script(TURNS[0]), "--prompt-cache-file", str(f), "--session", "x", *model, *flags)
        assert rc == 1 and out == "", name
        assert err.count("\n") == 1 and err.startswith("mlxcc: error: ") and words in err, (name, err)
        assert (f.read_bytes() if f.exists() else None) == before, name
        assert not (home / "sessions" / "x.safetensors").exists(), name
    # an existing session is resumed, never restarted from a prebuilt cache (nor is F itself a session)
    sys_f = files["another model"][0]
    assert chat(d, script(TURNS[0]), "--session", "old")[0] == 0
    for where, target in ((("--session", "old"), home / "sessions" / "old.safetensors"),
                          (("--session-file", str(sys_f)), sys_f)):  # fmt: skip
        before = target.read_bytes()
        rc, out, err = chat(d, script(TURNS[1]), "--prompt-cache-file", str(sys_f), "--model",
                            str(tmp_path / "no-model"), *where)  # fmt: skip
        assert rc == 1 and err.count("\n") == 1 and "exists: resume it without --prompt-cache-file" in err
        assert target.read_bytes() == before


def test_session_file_refusal_of_a_prebuilt_cache_names_the_right_command(tiny_model_dirs, chat, tmp_path):
    d = tiny_model_dirs["llama"]
    f = tmp_path / "sys.safetensors"
    cache_prompt(d, f, "--system-prompt", SYSTEM)
    rc, out, err = chat(d, script(TURNS[0]), "--session-file", str(f))
    assert rc == 1 and err.count("\n") == 1
    assert f"'mlxcc chat --prompt-cache-file {f}'" in err and f"'mlxcc generate --prompt-cache-file {f}'" in err
    # the command it names works
    rc, out, err = chat(d, script(TURNS[0]), "--prompt-cache-file", str(f))
    assert rc == 0 and stats(err)[0]["recomputed"] == 0


# ------------------------------------------------------------------ what the chat says
def test_help_descriptions_start_in_one_column(tiny_model_dirs, chat):
    rc, out, err = chat(tiny_model_dirs["llama"], script("/help"))
    assert rc == 0
    lines = [ln for ln in out.splitlines() if ln.startswith("  ")]
    named = [ln for ln in lines if ln[2] in '/"']
    assert len(named) >= 13 and any(ln.startswith('  """ ') for ln in named), out
    columns = set()
    for ln in lines:  # "  NAME  DESCRIPTION" or "  (spaces) MORE DESCRIPTION"
        m = re.match(r"  \S.*?\s{2,}(?=\S)", ln) if ln[2] != " " else re.match(r"\s+", ln)
        if m:  # (a name too long for the column has its description on the next line)
            columns.add(m.end())
    assert len(columns) == 1, out


def test_resume_recaps_the_last_exchange(tiny_model_dirs, chat, home):
    d = tiny_model_dirs["llama"]
    long_question = "Tell me about rivers.\n" + "Please be detailed. " * 20
    rc, _, err = chat(d, script("Good morning!", '"""', *long_question.split("\n"), '"""'), "--session", "r")
    assert rc == 0, err
    rc, _, again = chat(d, "", "--session", "r")
    assert rc == 0, again
    info = read_cache_info(home / "sessions" / "r.safetensors")
    question, reply = info.messages[-2]["content"], info.messages[-1]["content"]
    lines = again.splitlines()
    i = next(i for i, ln in enumerate(lines) if RESUMED.search(ln))
    you, model = lines[i + 1], lines[i + 2]
    assert you.startswith("  you:   Tell me about rivers. \u23ce Please be detailed.") and you.endswith("\u2026"), you
    assert len(you) <= 320 and "Good morning" not in again
    assert model.startswith("  model: ") and reply.strip()[:20].replace("\n", " \u23ce ") in model, (model, reply)
    assert question.startswith("Tell me about rivers.")
    # an empty session has nothing to recap
    rc, _, err = chat(d, script("Hello", "/undo"), "--session", "e")
    assert rc == 0, err
    rc, _, again = chat(d, "", "--session", "e")
    lines = again.splitlines()
    i = next(i for i, ln in enumerate(lines) if RESUMED.search(ln))
    assert not any(ln.startswith(("  you:", "  model:")) for ln in lines), again


def test_end_of_input_in_an_unsaved_chat_says_so(tiny_model_dirs, chat):
    d = tiny_model_dirs["llama"]
    note = "[not saved: start with --session NAME to keep a chat]"
    rc, out, err = chat(d, script("Hello"))
    assert rc == 0 and err.strip().splitlines()[-1] == note, err
    rc, out, err = chat(d, script("Hello", "/bye", "never sent"))
    assert rc == 0 and err.count(note) == 1 and err.count("[stats]") == 1, err
    rc, out, err = chat(d, script("/help"))  # nothing said: nothing to keep
    assert rc == 0 and note not in err
    rc, out, err = chat(d, script("Hello"), "--session", "kept")
    assert rc == 0 and "not saved" not in err, err
