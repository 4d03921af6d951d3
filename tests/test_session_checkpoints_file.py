"""Checkpoint copies saved in a session file: after a resume, ``/undo``, ``/retry`` and
``/edit`` roll an untrimmable cache (SSM or convolution states, sliding windows) back
from them, feeding no history token again; the file keeps a bounded number of bytes
of them, and a damaged one is refused in one line."""

from __future__ import annotations

import json

import pytest

from test_chat_cli import SYSTEM, TURNS, chat, home, script, stats  # noqa: F401 (fixtures)

from mlx_chatcache.config import DEFAULT_MAX_CHECKPOINTS, SESSION_CHECKPOINT_BYTES
from mlx_chatcache.files.mlxcc_format import SNAPSHOTS_VERSION, read_cache_info
from mlx_chatcache.files.safetensors_file import read_header

SP = ("--system-prompt", SYSTEM)
NEW = "Tell me about Rome instead."
UNTRIMMABLE = ["hybrid", "ssm", "sliding"]


def session_file(home, name):
    return home / "sessions" / f"{name}.safetensors"


def snapshot_bytes(path) -> tuple[int, int]:
    """(snapshots, bytes of their tensors) a file holds."""
    h = read_header(path)
    n = int(h.metadata.get("mlxcc.snapshots", 0))
    return n, sum(t.end - t.begin for name, t in h.tensors.items() if name.startswith("snapshot."))


@pytest.mark.parametrize("kind", UNTRIMMABLE)
def test_undo_retry_and_edit_after_a_resume_feed_no_history(kind, tiny_model_dirs, chat, home):
    d = tiny_model_dirs[kind]
    rc, out, err = chat(d, script(*TURNS[:3]), "--session", "s", *SP)
    assert rc == 0, err
    first = stats(err)
    path = session_file(home, "s")
    info = read_cache_info(path)
    assert info.format_version == SNAPSHOTS_VERSION
    n, nbytes = snapshot_bytes(path)
    assert 1 <= n <= DEFAULT_MAX_CHECKPOINTS and 0 < nbytes <= SESSION_CHECKPOINT_BYTES
    saved = info.messages
    # undo, the same message again, retry: each as in the first run (reused: all history)
    rc, out, err = chat(d, script("/undo", TURNS[2], "/retry"), "--session", "s", *SP)
    assert rc == 0, err
    assert "[removed the last exchange; 2 turns left]" in err
    st = stats(err)
    assert st[0] == first[2] and st[1] == first[2]
    assert read_cache_info(path).messages == saved
    # an edit of message 2 in a new process: reuses everything up to the end of reply 1
    rc, out, err = chat(d, script("/edit 2", NEW), "--session", "s", *SP)
    assert rc == 0, err
    st = stats(err)
    assert st[0]["reused"] == first[0]["new"] + first[0]["reused"] + first[0]["generated"] - 1
    chat(d, script(TURNS[0], NEW), "--session", "f", *SP)
    assert read_cache_info(path).messages == read_cache_info(session_file(home, "f")).messages


def test_the_file_keeps_the_newest_copies_within_its_byte_bound(tiny_model_dirs, chat, home, monkeypatch):
    d = tiny_model_dirs["ssm"]
    assert chat(d, script(*TURNS[:3]), "--session", "s", *SP)[0] == 0
    n, nbytes = snapshot_bytes(session_file(home, "s"))
    assert n == 3  # one per turn (the first turn's at the end of the system prompt); SSM states: equal sizes
    import mlx_chatcache.chat.session_file as sf

    monkeypatch.setattr(sf, "SESSION_CHECKPOINT_BYTES", nbytes // n)  # room for one copy
    rc, out, err = chat(d, script(TURNS[3]), "--session", "s", *SP)
    assert rc == 0
    assert snapshot_bytes(session_file(home, "s")) == (1, nbytes // n)
    meta = json.loads(read_cache_info(session_file(home, "s")).metadata["session"])
    assert [c[4] for c in meta["checkpoints"]] == [-1, -1, -1, 0]  # the newest turn's
    # the first undo is free, the second goes past the copies kept: said
    rc, out, err = chat(d, script("/undo", "/undo"), "--session", "s", *SP)
    assert rc == 0
    lines = [x for x in err.splitlines() if x.startswith("[removed")]
    assert "recomputed" not in lines[0] and "tokens will be recomputed" in lines[1]


def test_a_damaged_checkpoint_copy_is_refused_in_one_line(tiny_model_dirs, chat, home):
    d = tiny_model_dirs["hybrid"]
    assert chat(d, script(*TURNS[:2]), "--session", "s", *SP)[0] == 0
    path = session_file(home, "s")
    h = read_header(path)
    t = next(t for name, t in sorted(h.tensors.items()) if name.startswith("snapshot."))
    data = bytearray(path.read_bytes())
    data[h.data_start + t.begin] ^= 0xFF
    path.write_bytes(bytes(data))
    rc, out, err = chat(d, script(TURNS[2]), "--session", "s", *SP)
    assert rc == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "damaged" in err, err
    assert path.read_bytes() == bytes(data)


@pytest.mark.parametrize("kind", UNTRIMMABLE)
def test_new_chats_share_the_stored_system_prompt(kind, tiny_model_dirs, chat, home, llama_model):
    d = tiny_model_dirs[kind]
    store = str(home.parent / "store")
    rc, _, err = chat(d, script(TURNS[0]), "--cache-dir", store, *SP)
    assert rc == 0, err
    rc, out, err = chat(d, script(TURNS[1], TURNS[2]), "--cache-dir", store, *SP)
    assert rc == 0, err
    tokenizer = llama_model[1]  # every tiny kind shares the tokenizer
    head = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=False)
    n_head = len(tokenizer.encode(head, add_special_tokens=False))
    assert stats(err)[0]["reused"] == n_head > 0
    rc, fresh, _ = chat(d, script(TURNS[1], TURNS[2]), *SP)
    assert out == fresh  # the same replies as a chat without the store
    # undo of the first turn keeps the system prompt: the same message again reuses it
    rc, out, err = chat(d, script(TURNS[1], "/undo", TURNS[1]), *SP)
    st = stats(err)
    assert st[1]["reused"] == n_head and st[1]["new"] == st[0]["new"] - n_head
