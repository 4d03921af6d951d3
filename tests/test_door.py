"""The door (mlx_chatcache.files.cache_file): claim() applies the lock and the
overwrite rules before any work, write() is the one writer. Units, no model."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_chatcache.cache import KVCache
from mlx_chatcache.errors import CacheFileError, ChatCacheError, SessionError
from mlx_chatcache.files import cache_file
from mlx_chatcache.files.cache_file import SESSION_KEY, claim, hold, write
from mlx_chatcache.files.mlxcc_format import read_cache_info, save_prompt_cache
from mlx_chatcache.files.lock import SessionLock


def layers(n: int = 3) -> list[KVCache]:
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))
    return [c]


def plain_cache(path: Path) -> Path:
    save_prompt_cache(path, layers(), tokens=[1, 2, 3], messages=[{"role": "user", "content": "hi"}])
    return path


def session(path: Path) -> Path:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    save_prompt_cache(path, layers(), tokens=[1, 2, 3], messages=msgs, metadata={SESSION_KEY: json.dumps({"format": 1})})
    return path


@pytest.fixture
def held(tmp_path):
    """A session file whose lock another holder (an open chat) has."""
    f = session(tmp_path / "open.safetensors")
    lock = SessionLock(f, "'open'").acquire()
    yield f
    lock.release()


def spellings(f: Path) -> dict[str, Path]:
    link = f.parent / "link.safetensors"
    link.symlink_to(f)
    (f.parent / "sub").mkdir(exist_ok=True)
    return {"as is": f, "symlink": link, "../ spelling": f.parent / "sub" / ".." / f.name}


@pytest.mark.parametrize("how", ["as is", "symlink", "../ spelling"])
@pytest.mark.parametrize("force", [False, True])
def test_claim_refuses_a_file_another_holder_has_in_any_spelling_even_with_force(held, how, force):
    before, path = held.read_bytes(), spellings(held)[how]
    with pytest.raises(SessionError, match="already open in another mlxcc process") as e:
        claim(path, force=force, mine=True)
    assert "\n" not in str(e.value)
    with pytest.raises(SessionError, match="already open"):
        hold(path)
    assert held.read_bytes() == before


@pytest.mark.parametrize("content", [b"my notes\n", b"\x00" * 40, b"{}"])
def test_claim_refuses_a_non_cache_file_and_keeps_its_bytes(tmp_path, content):
    f = tmp_path / "notes.txt"
    f.write_bytes(content)
    for mine in (False, True):
        with pytest.raises(CacheFileError, match=f"refusing to overwrite {f}: it is not a prompt cache file"):
            claim(f, mine=mine)
    assert f.read_bytes() == content
    assert not (tmp_path / "notes.txt.lock").exists()  # released on refusal
    with claim(f, force=True) as c:
        write(c, layers(), tokens=[1, 2, 3])
    assert read_cache_info(f).tokens == [1, 2, 3]


def test_claim_refuses_a_session_unless_mine_or_force(tmp_path):
    f = session(tmp_path / "s.safetensors")
    before = f.read_bytes()
    with pytest.raises(CacheFileError, match=r"it is a chat session \(1 turn\); continue it with 'mlxcc chat") as e:
        claim(f)
    assert "--force" in str(e.value) and f.read_bytes() == before
    link = tmp_path / "l.safetensors"
    link.symlink_to(f)
    with pytest.raises(CacheFileError, match=f"refusing to overwrite {link}: it is a chat session"):
        claim(link)
    for kw in ({"mine": True}, {"force": True}):
        with claim(f, **kw):
            pass
    assert f.read_bytes() == before


@pytest.mark.parametrize("kind", ["missing", "empty", "plain cache"])
def test_claim_accepts_a_missing_or_empty_file_and_a_plain_cache(tmp_path, kind):
    f = tmp_path / "c.safetensors"
    if kind == "empty":
        f.touch()
    elif kind == "plain cache":
        plain_cache(f)
    with claim(f) as c:
        assert c.active and (tmp_path / "c.lock").exists()
        write(c, layers(5), tokens=[9] * 5)
    assert not c.active and not (tmp_path / "c.lock").exists()
    assert read_cache_info(f).tokens == [9] * 5


def test_a_held_claim_keeps_others_out_until_released(tmp_path):
    f = tmp_path / "c.safetensors"
    with claim(f):
        with pytest.raises(SessionError, match="already open"):
            claim(f)
        with pytest.raises(SessionError, match="already open"):
            write(f, layers())  # a path is claimed for the write: the holder keeps it out
    write(f, layers())
    assert f.exists()


def test_write_refuses_a_released_or_read_only_claim(tmp_path):
    f = tmp_path / "c.safetensors"
    c = claim(f)
    c.release()
    with pytest.raises(SessionError, match="not claimed for writing"):
        write(c, layers())
    with hold(f) as h, pytest.raises(SessionError, match="not claimed for writing"):
        write(h, layers())
    assert not f.exists()


def test_write_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    f = plain_cache(tmp_path / "real.safetensors")
    link = tmp_path / "link.safetensors"
    link.symlink_to(f)
    with claim(link) as c:
        assert c.covers(f) and c.covers(tmp_path / "." / "link.safetensors") and not c.covers(tmp_path / "x")
        write(c, layers(4), tokens=[7] * 4)
    assert link.is_symlink() and read_cache_info(f).tokens == [7] * 4


def test_a_path_write_applies_the_rules(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(CacheFileError, match="refusing to overwrite"):
        write(notes, layers())
    assert notes.read_text() == "keep me"
    write(notes, layers(), force=True)
    assert read_cache_info(notes).num_tokens is None  # no token ids given


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=300))
def test_random_bytes_are_refused_untouched_or_a_cache(tmp_path, data):
    f = tmp_path / "x.safetensors"
    f.write_bytes(data)
    try:
        c = claim(f)
    except ChatCacheError as e:
        assert "\n" not in str(e) and "refusing to overwrite" in str(e)
        assert f.read_bytes() == data
        return
    c.release()
    assert cache_file.cache_file_kind(f) is not None
