"""What a command does in its ``--cache-dir`` beyond reading and adding entries is said with
``--verbose``: a damaged entry it read is removed from the folder (the disk tier drops it) and a
temp file of an interrupted write too; files that are not store entries are skipped, never read
nor deleted. Through the real command on the tiny llama."""

from __future__ import annotations

import os
import re
import time

from cli_helpers import mlxcc

from mlx_chatcache.files.mlxcc_format import verify_cache_file


PROMPT = "Tell me about the rivers of Europe, the longest first, then the others."


def test_verbose_says_what_a_command_removed_or_skipped(tiny_model_dirs, tmp_path):
    d, folder = tiny_model_dirs["llama"], tmp_path / "store"
    run = ["generate", "--model", d, "-p", PROMPT, "-m", "2", "--cache-dir", folder]
    first = mlxcc(*run, "-v")
    assert first.returncode == 0 and "--cache-dir" not in first.stderr, first.stderr  # it only added entries
    values = sorted(p for p in folder.iterdir() if p.name.endswith(".safetensors"))
    assert values
    damaged = {}
    for value in values:  # every entry damaged: the next lookup reads one, drops it, and is a miss
        raw = bytearray(value.read_bytes())
        raw[-3] ^= 0xFF
        value.write_bytes(bytes(raw))
        damaged[value] = bytes(raw)
    temp = folder / f".{values[0].name}.abcdef-99999999.x1y2z3w4.tmp.safetensors"  # a writer killed long ago
    temp.write_bytes(b"half a write")
    os.utime(temp, (time.time() - 86400, time.time() - 86400))
    p = mlxcc(*run, "-v")
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith(f"--cache-dir {folder}: ")]
    assert len(lines) == 1, p.stderr
    assert "removed 1 temp file of interrupted writes" in lines[0]
    m = re.search(r"removed (\d+) damaged entr(y|ies) \(its checksums did not match\)", lines[0])
    assert m and int(m.group(1)) >= 1, lines[0]
    assert "0 reused" in p.stderr  # the damaged entries served nothing
    gone = [v for v, raw in damaged.items() if not v.exists() or v.read_bytes() != raw]
    assert len(gone) >= int(m.group(1))  # each removed (this run may have written it again, whole)
    assert all(verify_cache_file(v) for v in gone if v.exists())
    (folder / "notes.txt").write_text("mine\n")  # not a store file: a new folder refuses it, this one keeps it
    p = mlxcc(*run, "-v")
    assert p.returncode == 0 and "skipped 1 file that is not a store entry (never read nor deleted)" in p.stderr
    assert (folder / "notes.txt").read_text() == "mine\n" and not temp.exists()
