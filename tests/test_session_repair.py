"""A session whose cache is damaged (bytes of its arrays changed) is listed as damaged, the chat
names the command that repairs it, that command computes the cache again from the conversation
the file still holds, and the session continues exactly: the next turn reuses the repaired cache
and answers as a cache computed from nothing does. Through the real command (subprocesses)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys


from mlx_chatcache.files.mlxcc_format import read_cache_info


STATS = re.compile(r"\[stats\] prompt: (\d+) new \+ (\d+) reused tokens \((\d+) recomputed\)")


def mlxcc(*args, home, input="") -> subprocess.CompletedProcess:
    env = {**os.environ, "MLXCC_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "mlx_chatcache", *map(str, args)], capture_output=True, text=True,
                          env=env, input=input, timeout=180)  # fmt: skip


def damage_arrays(path) -> None:
    """Flip one byte of the last tensor's data (the header, and so the conversation, stays whole)."""
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_damaged_session_is_listed_repaired_and_continues(tiny_model_dirs, tmp_path):
    d, home = tiny_model_dirs["llama"], tmp_path
    turns = "Good morning!\nWhat is the capital of Italy?\n"
    assert mlxcc("chat", "--model", d, "--session", "s", "-n", "4", input=turns, home=home).returncode == 0
    f = home / "sessions" / "s.safetensors"
    messages = read_cache_info(f).messages
    damage_arrays(f)

    listed = mlxcc("sessions", home=home)
    assert listed.returncode == 0 and listed.stdout.splitlines()[1].split()[:2] == ["s", "(damaged)"]
    assert listed.stderr.strip().endswith("its conversation is intact: repair it with 'mlxcc sessions repair s'")
    assert "rm" not in listed.stderr and "delete" not in listed.stderr
    (row,) = json.loads(mlxcc("sessions", "--json", home=home).stdout)
    assert row["repairable"] is True and "mlxcc sessions repair s" in row["problem"]

    # the chat refuses it in one line that names the repair, never deletion or cache-prompt
    p = mlxcc("chat", "--session", "s", "-n", "4", input="Hi\n", home=home)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("mlxcc: error:")]
    assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "delete" not in lines[0] and "cache-prompt" not in lines[0] and "4 messages are intact" in lines[0]
    hinted = re.search(r"'(mlxcc sessions repair [^']+)'", lines[0]).group(1)

    # the hinted command repairs it: the conversation is kept, the cache computed again
    fixed = mlxcc(*shlex.split(hinted)[1:], home=home)
    assert fixed.returncode == 0 and "repaired session 's'" in fixed.stdout, fixed.stderr
    assert "mlxcc chat --session s" in fixed.stdout
    info = read_cache_info(f)
    assert info.messages == messages and info.tokens
    assert mlxcc("sessions", "--json", home=home).stdout.count('"problem": null') == 1
    repaired = f.read_bytes()
    again = mlxcc(*shlex.split(hinted)[1:], home=home)
    assert again.returncode == 0 and "is not damaged: nothing to repair" in again.stdout
    assert f.read_bytes() == repaired  # a session that is not damaged is left as it is

    # it continues: the next turn reuses every repaired token, and answers as a fresh cache does
    p = mlxcc("chat", "--session", "s", "-n", "4", "-v", input="And France?\n", home=home)
    assert p.returncode == 0, p.stderr
    new, reused, recomputed = map(int, STATS.search(p.stderr).groups())
    assert reused == len(info.tokens) and recomputed == 0
    after = read_cache_info(f)
    assert after.tokens[:reused] == info.tokens
    from mlx_chatcache.config import DEFAULTS
    from mlx_chatcache.generation.text import stream_generate
    from mlx_chatcache.models.loading import load

    model, tokenizer = load(str(d))
    prompt = after.tokens[: reused + new]
    reference = [r.token for r in stream_generate(model, tokenizer, prompt, config=DEFAULTS.updated(max_tokens=4))]
    assert after.tokens[reused + new :] == reference[:-1]  # the cache holds the reply but its last token


def test_a_session_that_cannot_be_repaired_says_why_in_one_line(tiny_model_dirs, tmp_path):
    d, home = tiny_model_dirs["llama"], tmp_path
    (home / "sessions").mkdir(parents=True)
    (home / "sessions" / "notes.safetensors").write_text("my notes\n")
    p = mlxcc("sessions", "repair", "notes", "--model", d, home=home)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "not a prompt cache file" in p.stderr, p.stderr
    assert (home / "sessions" / "notes.safetensors").read_text() == "my notes\n"
    p = mlxcc("sessions", "repair", "nothing", home=home)
    assert p.returncode == 1 and "no session named 'nothing'" in p.stderr
