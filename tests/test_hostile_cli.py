"""Hostile numeric values for the CLI's flags and the chat REPL's ``/set``.

- ``mlxcc generate`` with one generated value (negative, huge, NaN, inf,
  subnormal, not a number, non-ASCII digits, empty) for each numeric flag:
  hundreds through the real parser (a value is taken, and then in its setting's
  range, or refused in one line naming the flag, exit 2), a few dozen through the
  whole command in-process on the tiny llama (it either works, exit 0, or prints
  exactly one line on stderr and exits 1 or 2; never a traceback), and a few as
  subprocesses.
- ``serve --max-batch`` and ``--kv-dtype`` (generate, cache-prompt, chat, serve) with
  one generated value (the same odd numbers and text, the dtype names and near
  misses): an accepted value works (serve reaches its cache folder, a file: one
  line about it), any other is one line naming the flag, exit 2.
- ``mlxcc chat`` scripted with generated ``/set NAME VALUE`` lines, each
  followed by a message: no traceback, each ``/set`` is either applied or one
  error line, every message gets its reply (an accepted value never breaks the
  next turn), and the session file never holds a setting out of range.

Hypothesis runs derandomized with no example database (same values on every
run: bounded time, exact reproduction).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mlx_chatcache.cli.main import build_parser, main
from mlx_chatcache.config import DEFAULTS, KV_DTYPES, SERVER_RANGES, check_setting
from mlx_chatcache.files.cache_file import SESSION_KEY
from mlx_chatcache.files.mlxcc_format import read_cache_info
from mlx_chatcache.generation.sample import make_logits_processors, make_sampler


FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=list(HealthCheck))  # fmt: skip
FLAGS = ("--seed", "--temp", "--top-p", "--top-k", "--min-p", "--max-tokens", "--max-kv-size", "--repetition-penalty",
         "--prefill-step-size", "--kv-bits", "--kv-group-size", "--quantized-kv-start")  # fmt: skip
ODD_NUMBERS = ["0", "1", "-1", "-0", "-0.0", "2", "1.5", "0.5", "1e308", "1e-320", "5e-324", "1e400", "-1e400",
               "nan", "NaN", "-nan", "inf", "-inf", "Infinity", "infinity", str(2**31), str(2**32), str(2**63),
               str(2**64 - 1), str(-(2**63)), "9" * 30, "9" * 5000, "1_000", " 7 ", "0x10", "0b1", "1e3",
               "+3", "\u0663", "\u0661\u0662", "\uff13", "", " ", "abc", "None", "off", "true", "1,5", "--",
               "\x00"]  # fmt: skip
SEEDS_OUT_OF_RANGE = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64)).map(str)


VALUES = st.one_of(st.sampled_from(ODD_NUMBERS), st.integers(-(2**70), 2**70).map(str),
                   st.floats().map(repr), st.text(max_size=8))  # fmt: skip
MAX_TOKENS_RUN = 8  # accepted --max-tokens above this are parsed and checked, not run (bounded time)


def one_line_or_success(rc: int, err: str) -> None:
    assert "Traceback" not in err, err
    if rc == 0:
        return
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc in (1, 2) and len(lines) == 1, (rc, err)


@pytest.fixture
def command(tiny_model_dirs, tmp_path, monkeypatch, capsys):
    """``command(name, *flags) -> (rc, stderr)``: ``mlxcc NAME`` in-process on the tiny llama
    (a file of its own for cache-prompt and chat; chat says one message, then /bye); serve
    with a cache folder that is a file: one line, before it binds a port or loads a model."""
    monkeypatch.setenv("MLXCC_HOME", str(tmp_path / "home"))
    model, runs = str(tiny_model_dirs["llama"]), iter(range(10**9))
    not_a_folder = tmp_path / "cache-dir"
    not_a_folder.touch()

    def run(name: str, *flags: str) -> tuple[int, str]:
        f = str(tmp_path / f"f{next(runs)}.safetensors")
        args = {"generate": ["--model", model, "--prompt", "hi", "--max-tokens", "2"],
                "cache-prompt": ["--model", model, "--prompt", "hi", "--prompt-cache-file", f],
                "chat": ["--model", model, "--max-tokens", "2", "--session-file", f],
                "serve": ["--model", model, "--cache-dir", str(not_a_folder)]}[name]  # fmt: skip
        monkeypatch.setattr(sys, "stdin", io.StringIO("Good morning!\n/bye\n"))
        capsys.readouterr()
        try:
            rc = main([name, *args, *flags])
        except SystemExit as e:  # argparse's errors
            rc = e.code
        return rc, capsys.readouterr().err

    return run


@pytest.fixture
def generate(command):
    """``generate(*flags) -> (rc, stderr)``: ``mlxcc generate`` in-process on the tiny llama."""
    return lambda *flags: command("generate", *flags)


def _runs_long(name: str, value: str) -> bool:
    """A ``--max-tokens`` or ``/set max_tokens`` that would make the tiny model write long."""
    try:
        return name.strip("-").replace("-", "_") in ("max_tokens", "maxtokens") and int(value) > MAX_TOKENS_RUN
    except ValueError:
        return False


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def _flag_args(flag: str, value: str, equals: bool) -> list[str]:
    return [f"{flag}={value}"] if equals else [flag, value]


@settings(FUZZ, max_examples=400)
@given(flag=st.sampled_from(FLAGS), value=VALUES, equals=st.booleans())
@example(flag="--max-tokens", value="--", equals=True)
def test_numeric_flags_parse_into_their_range_or_are_one_line(parser, capsys, flag, value, equals):
    capsys.readouterr()
    try:
        args = parser.parse_args(["generate", "--model", "m", "-p", "hi", *_flag_args(flag, value, equals)])
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 2 and len(err.strip().splitlines()) == 1 and flag in err, (e.code, err)
        return
    name = flag.removeprefix("--").replace("-", "_")
    check_setting(name, getattr(args, name))  # taken: in its setting's range


@settings(FUZZ, max_examples=40)
@given(flag=st.sampled_from(FLAGS), value=VALUES, equals=st.booleans())
@example(flag="--temp", value="1e-320", equals=True)
@example(flag="--repetition-penalty", value="inf", equals=True)
@example(flag="--top-k", value="9" * 30, equals=True)
@example(flag="--max-kv-size", value="9" * 30, equals=True)
@example(flag="--max-tokens", value="--", equals=True)  # argparse's end of options, as a value
def test_numeric_flags_work_or_are_one_line(generate, flag, value, equals):
    if _runs_long(flag, value):
        value = str(MAX_TOKENS_RUN)
    one_line_or_success(*generate(*_flag_args(flag, value, equals)))


@pytest.mark.parametrize("flag,value", [("--temp", "nan"), ("--top-p", "-1"), ("--max-tokens", "1e9"),
                                        ("--min-p", "inf"), ("--kv-bits", "7")])  # fmt: skip
def test_numeric_flags_as_subprocesses(tiny_model_dirs, flag, value):
    r = subprocess.run([sys.executable, "-m", "mlx_chatcache", "generate", "--model", str(tiny_model_dirs["llama"]),
                        "--prompt", "hi", "--max-tokens", "2", f"{flag}={value}"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert flag in r.stderr and "Traceback" not in r.stderr


@settings(FUZZ, max_examples=20)
@given(value=SEEDS_OUT_OF_RANGE)
@example(value="-1")
@example(value=str(2**64))
def test_out_of_range_seed_flags(generate, value):
    one_line_or_success(*generate(f"--seed={value}"))


# ------------------------------------------------------------------ the server's and the K/V dtype's flags
# (command, flag): serve's integer range (config.SERVER_RANGES) and the K/V dtype's names, on every command taking it
MORE_FLAGS = (("serve", "--max-batch"),
              *((name, "--kv-dtype") for name in ("generate", "cache-prompt", "chat", "serve")))  # fmt: skip
NAMES = st.sampled_from([*KV_DTYPES, " auto", "float16 ", "Float16", "FLOAT32", "float8", "fp16", "half", "float64",
                         "int8", "auto,float16", "float16\x00", "bfloat"])  # fmt: skip


def _accepts(flag: str, value: str) -> bool:
    """The flag's contract: --kv-dtype one of KV_DTYPES (spaces around it dropped), --max-batch
    an integer in its SERVER_RANGES range."""
    if flag == "--kv-dtype":
        return value.strip() in KV_DTYPES
    try:
        return SERVER_RANGES["max_batch"].holds(int(value))
    except ValueError:
        return False


@settings(FUZZ, max_examples=150)
@given(pair=st.sampled_from(MORE_FLAGS), value=st.one_of(VALUES, NAMES), equals=st.booleans())
@example(pair=("serve", "--max-batch"), value="65", equals=False)
@example(pair=("serve", "--max-batch"), value="64", equals=True)
@example(pair=("serve", "--max-batch"), value="--", equals=True)
@example(pair=("chat", "--kv-dtype"), value="float16", equals=False)
@example(pair=("cache-prompt", "--kv-dtype"), value="Float16", equals=True)
def test_server_and_kv_dtype_flags_work_or_are_one_line_naming_the_flag(command, pair, value, equals):
    name, flag = pair
    rc, err = command(name, f"{flag}={value}") if equals else command(name, flag, value)
    one_line_or_success(rc, err)
    if _accepts(flag, value):  # serve goes on to its cache folder, a file: one line, not about the flag
        assert rc == (1 if name == "serve" else 0) and flag not in err, (rc, err)
    else:
        assert rc == 2 and flag in err, (rc, err)


# ------------------------------------------------------------------ /set in the REPL
SET_NAMES = ("temp", "temperature", "top_p", "top-p", "top_k", "min_p", "max_tokens", "seed", "repetition_penalty",
             "nope", "")  # fmt: skip
SET = re.compile(r"^\[(\w+) = (.*)\]$", re.M)
SET_ERROR = re.compile(r"^.*error: (/set|usage: /set).*$", re.M)
STATS = re.compile(r"^\[stats\] ", re.M)
SET_VALUES = VALUES.filter(lambda v: v.strip() and not set(v) & set("\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"))


def saved_settings_in_range(s: dict) -> None:
    """What a session file may hold: settings the sampler and the library take."""
    make_sampler(s["temp"], s["top_p"], s["top_k"], s["min_p"], s["min_tokens_to_keep"])
    make_logits_processors(dataclasses.replace(DEFAULTS, repetition_penalty=s["repetition_penalty"],
                                               repetition_context_size=s["repetition_context_size"]))
    assert s["seed"] is None or (type(s["seed"]) is int and 0 <= s["seed"] < 2**64), s
    assert type(s["max_tokens"]) is int and s["max_tokens"] >= 1, s
    assert all(not isinstance(v, float) or math.isfinite(v) for v in s.values()), s


@pytest.fixture
def chat(tiny_model_dirs, tmp_path, monkeypatch, capsys):
    """``chat(lines) -> (rc, stderr, session settings)``: a scripted ``mlxcc chat`` in-process."""
    monkeypatch.setenv("MLXCC_HOME", str(tmp_path / "home"))
    runs = iter(range(10**9))

    def run(lines: list[str]) -> tuple[int, str, dict]:
        path = tmp_path / f"s{next(runs)}.safetensors"
        monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
        capsys.readouterr()
        rc = main(["chat", "--model", str(tiny_model_dirs["llama"]), "--max-tokens", "2", "-v",
                   "--session-file", str(path)])  # fmt: skip
        err = capsys.readouterr().err
        meta = read_cache_info(path).metadata if path.exists() else {}
        return rc, err, json.loads(meta[SESSION_KEY])["settings"] if SESSION_KEY in meta else {}

    return run


def _check_chat(chat, pairs) -> None:
    lines = [line for name, value in pairs for line in (f"/set {name} {value}", "Good morning!")]
    rc, err, saved = chat([*lines, "/bye"])
    assert "Traceback" not in err, err
    applied, refused = SET.findall(err), SET_ERROR.findall(err)
    assert len(applied) + len(refused) == len(pairs), err
    assert len(STATS.findall(err)) == len(pairs), err  # every message got its reply
    assert rc == (1 if refused else 0), (rc, err)
    if saved:
        saved_settings_in_range(saved)


@settings(FUZZ, max_examples=40)
@given(pairs=st.lists(st.tuples(st.sampled_from(SET_NAMES), SET_VALUES), min_size=1, max_size=5))
@example(pairs=[("temp", "1e-320"), ("top_k", "9" * 30), ("repetition_penalty", "nan")])
def test_set_values_are_applied_or_refused(chat, pairs):
    pairs = [(n, str(MAX_TOKENS_RUN) if _runs_long(n, v) else v) for n, v in pairs]
    if pairs:
        _check_chat(chat, pairs)


@pytest.mark.parametrize("name,value", [("top_p", "0"), ("seed", "-1"), ("seed", str(2**64)), ("temp", "inf"),
                                        ("repetition_penalty", "inf"), ("repetition_penalty", "0"),
                                        ("temp", "1e400")])  # fmt: skip
def test_set_out_of_range_values_are_refused(chat, name, value):
    _check_chat(chat, [(name, value)])

