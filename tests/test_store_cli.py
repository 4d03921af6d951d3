"""``mlxcc generate`` and ``mlxcc chat`` through the prompt-cache store: ``--cache-dir``
shares the disk tier with other processes and with ``mlxcc serve`` (greedy
output identical with and without it), named files stay strict, resumed
sessions recompute nothing (tiny models)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from mlx_chatcache.cli.main import main
from mlx_chatcache.generation.templates import render_chat
from mlx_chatcache.generation.text import stream_generate
from mlx_chatcache.config import DEFAULTS, SERVER_DEFAULTS
from mlx_chatcache.models.loading import load
from store_helpers import served as store_served
from store_helpers import values_read

SYSTEM = "You are a terse assistant who answers about rivers and mountains of the world."
STATS = re.compile(r"\[stats\] prompt: (\d+) new \+ (\d+) reused tokens \((\d+) recomputed\)")
RESUMED = re.compile(r"resumed session '(\w+)': (\d+) turns?, (\d+) tokens in the cache, 0 tokens recomputed")


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def reused_of(stderr: str) -> int:
    m = re.search(r"(\d+) reused", stderr)
    assert m, f"no reused count in: {stderr!r}"
    return int(m.group(1))


def generate_args(model_dir, prompt, *flags):
    return ["generate", "--model", str(model_dir), "--system-prompt", SYSTEM, "-p", prompt, "-m", "12", *flags]


def system_tokens(model_dir) -> int:
    """Tokens of the rendered system message: what every prompt with SYSTEM starts with, and
    what the store serves them exactly (the user header after it is a block's part at most)."""
    _, tok = load(str(model_dir))
    head = render_chat(tok, [{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    a = render_chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A"}])
    assert a[: len(head)] == head
    return len(head)


def test_generate_reuses_a_prefix_another_process_stored(tiny_model_dirs, tmp_path, capsys):
    d, folder = tiny_model_dirs["llama"], tmp_path / "shared"
    first = subprocess.run([sys.executable, "-m", "mlx_chatcache", *generate_args(d, "Name a river.", "--cache-dir",
                            str(folder))], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert first.returncode == 0, first.stderr
    stored = set(folder.glob("[be]*.safetensors"))  # the run's values: its blocks and tails
    assert stored
    code, warm, err = run_cli(capsys, *generate_args(d, "Name a mountain.", "--cache-dir", str(folder), "-v"))
    assert code == 0, err
    code, cold, cold_err = run_cli(capsys, *generate_args(d, "Name a mountain.", "-v"))
    assert code == 0
    assert reused_of(cold_err) == 0
    assert reused_of(err) >= system_tokens(d) > 0 and "prefix from the disk tier" in err
    assert warm == cold and warm.strip()
    # the second call's values went into the folder too, beside the first call's
    assert stored < set(folder.glob("[be]*.safetensors"))


def test_rolling_file_and_cache_dir_together(tiny_model_dirs, tmp_path, capsys):
    """The named file wins ties and keeps its messages; the folder changes no output."""
    from mlx_chatcache.files.mlxcc_format import read_cache_info

    d, folder = tiny_model_dirs["llama"], str(tmp_path / "shared")
    runs = {}
    for name, extra in (("with", ["--cache-dir", folder]), ("without", [])):
        f = str(tmp_path / f"{name}.safetensors")
        for i, q in enumerate(["Hello, who are you?", "Tell me about the Nile."]):
            again = ["--prompt-cache-file", f] if i else []
            code, out, err = run_cli(capsys, *generate_args(d, q, "--save-prompt-cache", f, "-v", *extra, *again))
            assert code == 0, err
            runs.setdefault(name, []).append((out, reused_of(err)))
        if extra:
            assert "prefix from the file tier" in err
        runs[name].append(read_cache_info(f).messages)
    assert runs["with"] == runs["without"]
    assert [m["role"] for m in runs["with"][-1]] == ["system", "user", "assistant", "user", "assistant"]


def test_generate_window_mismatch_is_one_line(tiny_model_dirs, tmp_path, capsys):
    d, f = tiny_model_dirs["llama"], str(tmp_path / "w.safetensors")
    code, _, err = run_cli(capsys, *generate_args(d, "hi", "--max-kv-size", "64", "--save-prompt-cache", f))
    assert code == 0, err
    code, out, err = run_cli(capsys, *generate_args(d, "more", "--max-kv-size", "32", "--prompt-cache-file", f))
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "was made with max_kv_size=64" in err


def test_wrong_model_file_with_cache_dir_is_one_line(tiny_model_dirs, make_tiny_model_dir, tmp_path, capsys):
    d, f, folder = tiny_model_dirs["llama"], str(tmp_path / "c.safetensors"), str(tmp_path / "shared")
    assert run_cli(capsys, *generate_args(d, "hi", "--save-prompt-cache", f))[0] == 0
    other = str(make_tiny_model_dir("llama", seed=1))
    code, out, err = run_cli(capsys, *generate_args(other, "hi", "--prompt-cache-file", f, "--cache-dir", folder))
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "differ" in err


# ------------------------------------------------------------------ mlxcc serve's disk tier
def test_generate_and_serve_share_the_disk_tier(tiny_model_dirs, llama_model, tmp_path, capsys):
    import openai
    from server_process import ServerProcess

    d = tiny_model_dirs["llama"]
    served = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which river is longest?"}]
    # a server stores a conversation; a later generate call with the same system prompt reuses it
    folder = tmp_path / "server"
    with ServerProcess(d, folder) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", timeout=60, max_retries=0)
        c.chat.completions.create(model=s.model_id, messages=served, temperature=0, max_tokens=8)
    code, warm, err = run_cli(capsys, *generate_args(d, "Name a mountain.", "--cache-dir", str(folder), "-v"))
    assert code == 0, err
    code, cold, _ = run_cli(capsys, *generate_args(d, "Name a mountain.", "-v"))
    assert reused_of(err) >= system_tokens(d) and warm == cold
    # the other way: what generate stored, a server started on the same folder finds
    folder2 = tmp_path / "cli"
    assert run_cli(capsys, *generate_args(d, "Name a mountain.", "--cache-dir", str(folder2)))[0] == 0
    model, tok = llama_model
    mine = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a mountain."}]
    reply = [r.token for r in stream_generate(model, tok, render_chat(tok, mine), config=DEFAULTS.updated(max_tokens=12))]
    held = render_chat(tok, mine) + reply[:-1]
    with ServerProcess(d, folder2) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", timeout=60, max_retries=0)
        r = c.chat.completions.create(model=s.model_id, messages=served, temperature=0, max_tokens=8)
        hits = s.health()["store"]["disk"]["hits"]
    prompt = render_chat(tok, mine)  # generate stored it all, its prompt (but the last token) and system prompt
    entries = [held, prompt, prompt[:-1], prompt[: system_tokens(d)]]
    want = store_served(entries, render_chat(tok, served)[:-1], SERVER_DEFAULTS.store_block_tokens)
    assert r.usage.prompt_tokens_details.cached_tokens == want >= system_tokens(d) > 0
    assert hits == values_read(want, SERVER_DEFAULTS.store_block_tokens)  # each value read once, from the disk


# ------------------------------------------------------------------ mlxcc chat
@pytest.fixture
def chat(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLXCC_HOME", str(tmp_path / "home"))

    def run(model_dir, stdin: str, *flags: str):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        rc = main(["chat", "--model", str(model_dir), "--max-tokens", "8", "-v", "--system-prompt", SYSTEM, *flags])
        cap = capsys.readouterr()
        return rc, cap.out, cap.err

    return run


def stats(err):
    return [tuple(map(int, m.groups())) for m in STATS.finditer(err)]


def test_new_chat_reuses_what_another_chat_put_in_the_cache_dir(tiny_model_dirs, chat, tmp_path):
    d, folder = tiny_model_dirs["llama"], str(tmp_path / "shared")
    rc, _, err = chat(d, "Good morning!\n", "--cache-dir", folder)  # no --session: the folder still gets it
    assert rc == 0 and stats(err)[0][1] == 0
    assert list((tmp_path / "shared").glob("[be]*.safetensors"))  # the chat's values
    turns = "What is the capital of Italy?\nAnd of France?\n"
    rc, warm, err = chat(d, turns, "--cache-dir", folder, "--session", "s")
    assert rc == 0, err
    rc, cold, cold_err = chat(d, turns)
    assert rc == 0
    (new, reused, _), second = stats(err)
    (cold_new, cold_reused, _), _ = stats(cold_err)
    assert reused >= system_tokens(d) and cold_reused == 0
    assert new + reused == cold_new  # the same first prompt: the shared prefix is fed no more
    assert warm == cold  # the same replies, with and without the shared prefix
    assert stats(cold_err)[1][1:] == second[1:]  # the next turn reuses the session's own cache either way
    # resumed with --cache-dir: the session file serves all of it, nothing recomputed
    rc, _, err = chat(d, "Thanks!\n", "--cache-dir", folder, "--session", "s")
    assert rc == 0, err
    m = RESUMED.search(err)
    assert m and int(m.group(2)) == 2
    _, reused, recomputed = stats(err)[0]
    assert recomputed == 0 and reused == int(m.group(3))


def test_chat_without_cache_dir_writes_no_folder(tiny_model_dirs, chat, tmp_path):
    rc, _, err = chat(tiny_model_dirs["llama"], "Hi\n", "--session", "x")
    assert rc == 0, err
    assert not (tmp_path / "home" / "server-cache").exists()
    assert not [p for p in os.listdir(tmp_path) if p not in ("home",)]


def test_ctrl_c_while_a_no_session_chat_writes_the_cache_dir_keeps_the_chat(tiny_model_dirs, chat, tmp_path,
                                                                             monkeypatch):  # fmt: skip
    """A Ctrl-C that arrives while the cache goes into --cache-dir (no --session) is held
    off like one during a session file's write: the chat goes on to its next turn."""
    import signal

    from mlx_chatcache.chat.session import ChatSession

    original, calls = ChatSession.save, []

    def save_with_ctrl_c(self, path):
        calls.append(path)
        os.kill(os.getpid(), signal.SIGINT)  # as a user's Ctrl-C, during the write
        return original(self, path)

    monkeypatch.setattr(ChatSession, "save", save_with_ctrl_c)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite run in the background ignores it
    try:
        rc, _, err = chat(tiny_model_dirs["llama"], "Hi\nAnd again?\n", "--cache-dir", str(tmp_path / "shared"))
    finally:
        signal.signal(signal.SIGINT, old)
    assert rc == 0, err
    assert calls == [None, None] and len(stats(err)) == 2  # both turns ran and were put into the folder
    assert len(list((tmp_path / "shared").glob("*.safetensors"))) >= 1
