"""Every generation setting has one range (``config.RANGES``), checked where a value
enters: flags, ``/set``, session files, the library; a rotating window holds more
than the tokens it pins; a prompt past the model's context is refused before any
prompt token is processed (``mlxcc``'s entry point in-process, the ``cli`` fixture, where
exit codes and the absence of a traceback matter)."""

from __future__ import annotations

import io
import json
import math
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_chatcache.cli.chat_input import SETTINGS, parse_setting
from mlx_chatcache.cli.common import setting_type
from mlx_chatcache.cli.main import main
from mlx_chatcache.config import DEFAULTS, CacheShape, RANGES, SEED_LIMIT, SettingError, check_setting
from mlx_chatcache.errors import UsageError
from mlx_chatcache.files.checksum import seal_bytes
from mlx_chatcache.files.mlxcc_format import read_cache_info


SEED_RANGE = "must be an integer between 0 and 18446744073709551615"
LONG = " ".join(["apples and oranges"] * 40)  # ~330 tokens for the tiny tokenizer


def one_error_line(p) -> str:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode != 0 and "Traceback" not in p.stderr and len(lines) == 1, p.stderr
    return lines[0]


@pytest.fixture(scope="module")
def short_context_model(tiny_model_dirs, tmp_path_factory) -> Path:
    """The tiny llama with a context of 64 tokens."""
    d = tmp_path_factory.mktemp("ctx") / "llama-ctx64"
    shutil.copytree(tiny_model_dirs["llama"], d)
    config = json.loads((d / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (d / "config.json").write_text(json.dumps(config))
    return d


# ------------------------------------------------------------------ one table, every entry point
def _text(v) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def _accepted_by_table(name: str, text: str) -> bool:
    r = RANGES[name]
    try:
        check_setting(name, int(text) if r.integer else float(text))
    except (SettingError, ValueError):
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(RANGES)),
       value=st.one_of(st.integers(-(2**66), 2**66), st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([0, 1, -1, 0.0, 1.0, 2**64 - 1, 2**64, 2**31 - 1, 2**31, 8, 32, 128])))  # fmt: skip
def test_flags_and_set_accept_exactly_what_the_table_accepts(name, value):
    text = _text(value)
    ok = _accepted_by_table(name, text)
    try:
        setting_type(name)(text)
        flag_ok = True
    except Exception as e:  # argparse.ArgumentTypeError: one line naming the range
        flag_ok = False
        assert "\n" not in str(e) and ("must be" in str(e) or "invalid" in str(e)), e
    assert flag_ok == ok
    if name in SETTINGS:
        try:
            parse_setting(f"{name} {text}")
            set_ok = True
        except UsageError as e:
            set_ok = False
            assert str(e).startswith(f"/set {name}: ") and "\n" not in str(e)
        assert set_ok == ok


def test_every_default_is_in_its_range_and_ranges_are_stated():
    for name, r in RANGES.items():
        assert check_setting(name, getattr(DEFAULTS, name)) == getattr(DEFAULTS, name)
        assert r.describe()
    for bad in (-1, SEED_LIMIT, 1.0, True, "1"):
        with pytest.raises(SettingError, match="between 0 and 18446744073709551615"):
            check_setting("seed", bad)
    for name in ("top_p", "repetition_penalty"):  # 0 would leave the sampler nothing / divide by 0
        with pytest.raises(SettingError):
            check_setting(name, 0.0)
    for name in ("temp", "top_p", "min_p", "repetition_penalty"):
        for v in (math.nan, math.inf, -math.inf):
            with pytest.raises(SettingError):
                check_setting(name, v)


# ------------------------------------------------------------------ flags
@pytest.mark.parametrize("seed", ["-1", "99999999999999999999"])
def test_out_of_range_seed_flag_is_one_line_naming_the_range(tiny_model_dirs, seed, cli):
    p = cli("generate", "--model", tiny_model_dirs["llama"], "-p", "hi", "-m", "2", "--seed", seed)
    line = one_error_line(p)
    assert p.returncode == 2 and "--seed" in line and SEED_RANGE in line, line


def test_window_smaller_than_keep_is_one_line_before_the_model_loads(tiny_model_dirs, tmp_path, cli):
    for model in (tiny_model_dirs["llama"], tmp_path / "no-such-model"):
        p = cli("generate", "--model", model, "-p", "hi", "-m", "2", "--max-kv-size", "2")
        line = one_error_line(p)
        assert "max_kv_size (2)" in line and "keep (4)" in line and p.stdout == "", line
    p = cli("cache-prompt", "--model", tmp_path / "no-such-model", "-p", "hi", "--max-kv-size", "4",
            "--prompt-cache-file", tmp_path / "c.safetensors")  # fmt: skip
    assert "max_kv_size (4)" in one_error_line(p) and not (tmp_path / "c.safetensors").exists()
    import uvicorn  # noqa: F401
    p = cli("serve", "--model", tmp_path / "no-such-model", "--max-kv-size", "3", "--port", "1")
    assert "max_kv_size (3)" in one_error_line(p)


def test_library_refuses_a_window_that_does_not_hold_more_than_keep(llama_model):
    from mlx_chatcache.files.prompt_cache import PromptCache

    with pytest.raises(UsageError, match=r"max_kv_size \(4\) must be larger than keep \(4\)"):
        PromptCache.new(llama_model[0], CacheShape(4, 4))
    assert PromptCache.new(llama_model[0], CacheShape(5, 4)).shape.max_kv_size == 5


def test_library_generation_refuses_an_out_of_range_seed(llama_model):
    from mlx_chatcache.generation.loop import generate_step

    model, tok = llama_model
    with pytest.raises(UsageError, match=SEED_RANGE):
        next(generate_step([1, 2, 3], model, config=DEFAULTS.updated(seed=-1, max_tokens=2)))


# ------------------------------------------------------------------ the model's context
def test_prompt_past_the_context_is_refused_before_prefill(short_context_model, tmp_path, cli):
    prompt = tmp_path / "huge.txt"
    prompt.write_text(LONG)
    start = time.perf_counter()
    p = cli("generate", "--model", short_context_model, "-f", prompt, "-m", "2")
    line = one_error_line(p)
    assert "context holds 64" in line and "--max-kv-size" in line and p.stdout == "", line
    assert time.perf_counter() - start < 60
    out = tmp_path / "c.safetensors"
    p = cli("cache-prompt", "--model", short_context_model, "-f", prompt, "--prompt-cache-file", out)
    assert "context holds 64" in one_error_line(p) and not out.exists()
    # a rotating window makes it legal: a warning naming the window, and the reply
    p = cli("generate", "--model", short_context_model, "-f", prompt, "-m", "2", "--max-kv-size", "32")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    warnings = [line for line in p.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "latest 32" in warnings[0] and "context of 64" in warnings[0], p.stderr


def test_chat_turn_past_the_context_is_refused_and_the_chat_goes_on(short_context_model, tmp_path, cli):
    p = cli("chat", "--model", short_context_model, "-m", "3", "-v", "--session", "ctx",
            env={"MLXCC_HOME": tmp_path}, stdin=f"{LONG}\nHi\n")  # fmt: skip
    assert "Traceback" not in p.stderr, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "context holds 64" in errors[0] and "nothing was sent" in errors[0], p.stderr
    assert p.stderr.count("[stats]") == 1  # "Hi" was answered
    info = read_cache_info(tmp_path / "sessions" / "ctx.safetensors")
    assert [m["content"] for m in info.messages if m["role"] == "user"] == ["Hi"]


# ------------------------------------------------------------------ /set and sessions
@pytest.fixture
def chat(tmp_path, monkeypatch, capsys):
    """``chat(model_dir, stdin, *flags) -> (rc, stdout, stderr)`` in-process, MLXCC_HOME in tmp_path."""
    monkeypatch.setenv("MLXCC_HOME", str(tmp_path / "home"))

    def run(model_dir, stdin: str, *flags: str):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        rc = main(["chat", "--model", str(model_dir), "--max-tokens", "4", "-v", *flags])
        cap = capsys.readouterr()
        return rc, cap.out, cap.err

    return run


def saved_settings(path: Path) -> dict:
    return json.loads(read_cache_info(path).metadata["session"])["settings"]


def test_set_refuses_out_of_range_values_when_set(tiny_model_dirs, chat, tmp_path):
    rc, out, err = chat(tiny_model_dirs["llama"], "/set seed -1\n/set top_p 0\n/set repetition_penalty 0\n"
                        "/set temp nan\n/set temp inf\nHello\n", "--session", "s")  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: /set seed: {SEED_RANGE} (or none), got -1",
        "error: /set top_p: must be between 0 and 1 (0 excluded), got 0",
        "error: /set repetition_penalty: must be a finite number > 0 (or none), got 0",
        "error: /set temp: must be a finite number >= 0, got nan",
        "error: /set temp: must be a finite number >= 0, got inf",
    ], err
    assert err.count("[stats]") == 1  # the turn ran
    s = saved_settings(tmp_path / "home" / "sessions" / "s.safetensors")
    assert s["seed"] is None and s["top_p"] == DEFAULTS.top_p and s["temp"] == DEFAULTS.temp


def test_retry_keeps_the_largest_seed_in_range(tiny_model_dirs, chat):
    rc, out, err = chat(tiny_model_dirs["llama"], f"/set seed {SEED_LIMIT - 1}\n/set temp 1\nHello\n/retry\n/retry\n")
    assert rc == 0 and err.count("[stats]") == 3 and "error" not in err, err


def rewrite_session_settings(path: Path, **changes) -> None:
    """Write ``changes`` into the session settings of the file at ``path`` (as an older
    version of mlxcc might have saved them), keeping the rest of the file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["user.session"])
    meta["settings"].update(changes)
    header["__metadata__"]["user.session"] = json.dumps(meta)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(seal_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :]))  # the header sum made again


def test_session_holding_out_of_range_settings_resumes_with_them_dropped(tiny_model_dirs, chat, tmp_path):
    d = tiny_model_dirs["llama"]
    rc, _, _ = chat(d, "Hello\n", "--session", "old")
    assert rc == 0
    path = tmp_path / "home" / "sessions" / "old.safetensors"
    rewrite_session_settings(path, seed=-1, top_p=0.0)
    assert read_cache_info(path).metadata  # still a readable cache file
    for _ in range(2):  # every resume works; the bad values are not saved again
        rc, out, err = chat(d, "How are you?\n/show info\n", "--session", "old")
        assert rc == 0 and "Traceback" not in err, err
        assert "resumed session 'old'" in err and err.count("[stats]") == 1, err
        assert "seed=None" in out and "top_p=1.0" in out
        s = saved_settings(path)
        assert s["seed"] is None and s["top_p"] == DEFAULTS.top_p
    # the first resume said so, one line each; the second had nothing to drop
    assert "error" not in err and "dropped" not in err


def test_resume_says_what_it_dropped_in_one_line_each(tiny_model_dirs, chat, tmp_path):
    d = tiny_model_dirs["llama"]
    chat(d, "Hello\n", "--session", "old2")
    path = tmp_path / "home" / "sessions" / "old2.safetensors"
    rewrite_session_settings(path, seed=-1, top_p=0.0, temp=0.7)
    rc, out, err = chat(d, "/show info\n", "--session", "old2")
    dropped = [line for line in err.splitlines() if "dropped" in line]
    assert len(dropped) == 2 and rc == 0, err
    seed, = (line for line in dropped if "setting seed" in line)
    top_p, = (line for line in dropped if "setting top_p" in line)
    assert SEED_RANGE in seed and "got -1" in seed and "got 0.0" in top_p
    assert "temp=0.7" in out  # the values in range are kept
