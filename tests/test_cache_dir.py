"""The disk tier's folder (``--cache-dir``, ``mlxcc serve --cache-dir``) is the store's own:
a folder holding other files is refused (one line, before the model loads, nothing
touched), a folder of store values alone is adopted, only store values are ever deleted,
and a command deletes none that is whole (a damaged one it reads is dropped:
tests/test_cache_dir_report.py) (tiny models)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys

import numpy as np
import pytest
from store_helpers import arrays, checked_out, filled, scope, tokens_of

from mlx_chatcache.cli.main import main
from mlx_chatcache.errors import UsageError
from mlx_chatcache.store.disk import MARKER, DiskTier
from mlx_chatcache.store.store import PromptStore


def put(tier, model, tokens):
    return PromptStore([tier]).put(scope(model), tokens, filled(model, tokens))


def values(folder):
    return sorted(p.name for p in folder.glob("[be]*.safetensors"))


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def user_files(tiny_model_dirs, llama_model, tmp_path):
    """A folder holding model weights and a chat session (no store entries, no marker)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    shutil.copy(tiny_model_dirs["llama"] / "model.safetensors", folder / "model.safetensors")
    model, _ = llama_model
    from mlx_chatcache.files.mlxcc_format import save_prompt_cache

    save_prompt_cache(folder / "s.safetensors", filled(model, tokens_of(12)), tokens=tokens_of(12))
    return folder


def test_a_folder_holding_other_files_is_refused_and_untouched(user_files):
    before = snapshot(user_files)
    with pytest.raises(UsageError) as e:
        DiskTier(user_files, 1 << 30)
    msg = str(e.value)
    assert "\n" not in msg and "not an mlxcc cache folder" in msg and "empty or new folder" in msg
    assert snapshot(user_files) == before  # nothing deleted, no marker written


def test_unusable_paths_are_one_line(tmp_path):
    a_file = tmp_path / "q.safetensors"
    a_file.write_bytes(b"x")
    for bad, what in ((a_file, "is a file"), (a_file / "sub", "cannot use")):
        with pytest.raises(UsageError) as e:
            DiskTier(bad, 1 << 30)
        assert what in str(e.value) and "\n" not in str(e.value)
    assert a_file.read_bytes() == b"x"


def test_a_folder_of_store_values_alone_is_adopted(llama_model, tmp_path):
    model, _ = llama_model
    folder, base = tmp_path / "server", tokens_of(30)
    want = arrays(filled(model, base))
    put(DiskTier(folder, 1 << 30), model, base)
    assert (folder / MARKER).exists()
    (folder / MARKER).unlink()  # someone deleted the marker
    (folder / ".x.safetensors.abc123-1.abcdefgh.tmp.safetensors").write_bytes(b"")  # a killed write's temp file
    restarted = DiskTier(folder, 1 << 30)
    assert (folder / MARKER).exists() and restarted.stats()["entries"] == 1
    got = checked_out(PromptStore([restarted]), scope(model), model, base + [7])
    assert got.tier == "disk" and got.served == 30
    np.testing.assert_array_equal([a[:, :, :30] for a in arrays(got.cache)], want)


def test_a_marked_folder_keeps_what_is_not_a_store_value(llama_model, user_files, tmp_path):
    """Even over budget, a sweep deletes only store values (least recently used first)."""
    model, _ = llama_model
    folder = tmp_path / "store"
    seqs = [tokens_of(20, start=s) for s in (10, 60, 110)]
    disk = DiskTier(folder, 1 << 30)
    for s in seqs:
        put(disk, model, s)
    for name in ("model.safetensors", "s.safetensors"):  # the user put them there later
        shutil.copy(user_files / name, folder / name)
    (folder / "gone.safetensors").symlink_to(tmp_path / "missing")  # stat fails: skipped, no error
    foreign = {n: b for n, b in snapshot(folder).items() if n in ("model.safetensors", "s.safetensors")}
    size = max(p.stat().st_size for p in folder.glob("e*.safetensors"))
    small = DiskTier(folder, size + size // 2)  # a server restarted with a smaller budget
    assert len(values(folder)) == 1 and small.stats()["evicted"] == 2 and small.stats()["foreign"] == 3
    assert {n: b for n, b in snapshot(folder).items() if n in foreign} == foreign
    assert (folder / "gone.safetensors").is_symlink()


def test_a_command_tier_evicts_nothing(llama_model, tmp_path):
    """Budget None (a command on a server's folder): opening and adding keep every value; the
    same folder under a server's small budget would lose some."""
    model, _ = llama_model
    folder = tmp_path / "server"
    seqs = [tokens_of(20, start=s) for s in (10, 60, 110, 160)]
    server = DiskTier(folder, 1 << 30)
    for s in seqs[:3]:
        put(server, model, s)
    size = max(p.stat().st_size for p in folder.glob("e*.safetensors"))
    before = set(snapshot(folder))
    command = DiskTier(folder, None)
    assert command.stats()["entries"] == 3 and command.stats()["evicted"] == 0
    assert put(command, model, seqs[3]) == {"disk": True}
    assert before < set(snapshot(folder)) and len(values(folder)) == 4
    DiskTier(folder, size + size // 2)  # a server's budget does evict
    assert len(values(folder)) == 1


# ------------------------------------------------------------------ the commands
@pytest.fixture
def chat(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLXCC_HOME", str(tmp_path / "home"))

    def run(model_dir, stdin: str, *flags: str):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        rc = main(["chat", "--model", str(model_dir), "--max-tokens", "6", *flags])
        cap = capsys.readouterr()
        return rc, cap.out, cap.err

    return run


def test_chat_with_a_session_in_a_user_folder_is_refused(tiny_model_dirs, chat, user_files):
    """The review's repro: the saved chat is neither replaced nor deleted."""
    before = snapshot(user_files)
    session = str(user_files / "s.safetensors")
    rc, out, err = chat(tiny_model_dirs["llama"], "Hi\n", "--session-file", session, "--cache-dir", str(user_files))
    assert rc != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "not an mlxcc cache folder" in err
    assert snapshot(user_files) == before


def test_chat_session_in_a_new_cache_dir_survives(tiny_model_dirs, chat, tmp_path):
    """A session saved inside a (new) store folder is not the store's: kept, resumed."""
    folder = tmp_path / "both"
    flags = ("--session-file", str(folder / "s.safetensors"), "--cache-dir", str(folder))
    folder.mkdir()
    rc, _, err = chat(tiny_model_dirs["llama"], "Hi\n", *flags)
    assert rc == 0, err
    rc, _, err = chat(tiny_model_dirs["llama"], "Again\n", *flags)
    assert rc == 0 and "resumed session" in err, err


def test_cache_dir_errors_come_before_the_model_loads(tmp_path, capsys):
    a_file = tmp_path / "q.safetensors"
    a_file.write_bytes(b"x")
    missing_model = str(tmp_path / "no-such-model")
    for argv in (["generate", "--model", missing_model, "-p", "hi", "--cache-dir", str(a_file)],
                 ["chat", "--model", missing_model, "--cache-dir", str(a_file)],
                 ["serve", "--model", missing_model, "--cache-dir", str(a_file)]):  # fmt: skip
        if argv[0] == "serve":
            import uvicorn  # noqa: F401
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "is a file" in err and "no-such-model" not in err, err
    assert a_file.read_bytes() == b"x"
    # in a real process: one line, no traceback
    p = subprocess.run([sys.executable, "-m", "mlx_chatcache", "generate", "--model", missing_model, "-p", "hi",
                        "--cache-dir", str(a_file)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "is a file" in p.stderr


def test_a_command_on_a_server_folder_deletes_nothing(tiny_model_dirs, llama_model, tmp_path, capsys, monkeypatch):
    """Also when the folder is larger than the server default budget (made tiny here: a
    command once used it and evicted a bigger server's entries)."""
    import dataclasses

    from mlx_chatcache import config
    from mlx_chatcache.generation import checkout

    tiny = dataclasses.replace(config.SERVER_DEFAULTS, disk_cache_bytes=1000)
    monkeypatch.setattr(config, "SERVER_DEFAULTS", tiny)
    monkeypatch.setattr(checkout, "SERVER_DEFAULTS", tiny, raising=False)
    model, _ = llama_model
    folder = tmp_path / "server"
    server = DiskTier(folder, 1 << 30)
    for s in (10, 60, 110):
        put(server, model, tokens_of(20, start=s))
    before = snapshot(folder)
    argv = ["generate", "--model", str(tiny_model_dirs["llama"]), "-p", "Name a river.", "-m", "6",
            "--cache-dir", str(folder)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    after = snapshot(folder)
    assert all(after.get(n) == b for n, b in before.items()) and len(after) > len(before)  # and its own values
