"""Commands that run no model start without importing mlx-lm or transformers (seconds of imports).

Each command runs in a fresh interpreter (``sys.executable -c`` calling ``cli.main.main``), on real
files made here (a cache file in our layout, the same cache converted to mlx-lm's, a chat session
saved by :class:`ChatSession`); the command must succeed with its normal output, and afterwards
``mlx_lm`` and ``transformers`` must not be in ``sys.modules``. Deterministic, unlike a timing test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_chatcache import __version__
from mlx_chatcache.cache import CACHE_CLASSES, KVCache
from mlx_chatcache.chat.session import ChatSession
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.files.mlxcc_format import CACHE_CLASS_NAMES, read_cache_info, save_prompt_cache
from mlx_chatcache.files.convert import convert_cache_file

HEAVY = ("mlx_lm", "transformers")  # seconds of imports
OPTIONAL = ("mlx.core",)  # 0.2 s; see test_header_only_commands_do_not_load_mlx
REPO = Path(__file__).resolve().parent.parent
PROBE = """
import json, sys
from mlx_chatcache.cli.main import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as e:  # --help, --version and bad flags exit through argparse
    code = e.code
sys.stdout.flush()
sys.stderr.write("\\n@@" + json.dumps({"code": code, "loaded": [m for m in %r if m in sys.modules]}) + "\\n")
""" % (HEAVY + OPTIONAL,)


def mlxcc_light(*args, home: Path, banned=HEAVY) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``mlxcc ARGS``; asserts none of ``banned`` was imported."""
    env = {**os.environ, "MLXCC_HOME": str(home), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps([str(a) for a in args])], capture_output=True,
                       text=True, env=env, timeout=120, cwd=REPO)  # fmt: skip
    err, _, probe = r.stderr.rpartition("\n@@")
    assert probe, f"mlxcc {' '.join(map(str, args))} did not finish: {r.stderr}"
    result = json.loads(probe)
    loaded = [m for m in result["loaded"] if m in banned]
    assert loaded == [], f"mlxcc {' '.join(map(str, args))} imported {loaded}"
    return result["code"], r.stdout, err.strip()


@pytest.fixture(scope="module")
def files(tmp_path_factory, llama_model) -> dict[str, Path]:
    """A cache file (ours), its mlx-lm conversion, and a home with one saved chat session."""
    root = tmp_path_factory.mktemp("startup")
    layers = []
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, 6, 8)), mx.random.normal((1, 2, 6, 8)))  # (B, heads, seq, dim)
        layers.append(c)
    ours = root / "prompt.safetensors"
    messages = [{"role": "user", "content": "What is a river?"}, {"role": "assistant", "content": "Water."}]
    save_prompt_cache(ours, layers, tokens=[5, 6, 7, 8, 9, 10], messages=messages, metadata={"note": "startup"})
    other = root / "other.safetensors"
    save_prompt_cache(other, layers, tokens=[5, 6, 7, 1, 2, 3])
    lm = root / "mlx-lm.safetensors"
    convert_cache_file(ours, lm, "mlx-lm")
    home = root / "home"
    model, tokenizer = llama_model
    session = ChatSession(model, tokenizer, config=DEFAULTS.updated(max_tokens=3))
    session.ask("Hello there")
    (home / "sessions").mkdir(parents=True)
    session.save(home / "sessions" / "alpha.safetensors")
    return {"ours": ours, "other": other, "mlx-lm": lm, "home": home}


def test_the_header_check_knows_every_cache_class():
    # read_cache_info checks class names against this list without importing the classes
    assert CACHE_CLASS_NAMES == set(CACHE_CLASSES)


def test_help_and_version(files):
    code, out, _ = mlxcc_light("--help", home=files["home"])
    assert code == 0 and out.startswith("usage: mlxcc") and "sessions" in out
    code, out, _ = mlxcc_light("--version", home=files["home"])
    assert (code, out.strip()) == (0, f"mlxcc {__version__}")


@pytest.mark.parametrize("sub", [["generate"], ["cache-prompt"], ["chat"], ["cache"], ["cache", "info"],
                                 ["cache", "diff"], ["cache", "convert"], ["sessions"], ["sessions", "rm"], ["doctor"]])
def test_subcommand_help(files, sub):
    code, out, _ = mlxcc_light(*sub, "--help", home=files["home"])
    assert code == 0 and out.startswith(f"usage: mlxcc {' '.join(sub)}"), out


def test_sessions_list_show(files):
    info = read_cache_info(files["home"] / "sessions" / "alpha.safetensors")
    code, out, err = mlxcc_light("sessions", home=files["home"])
    assert code == 0, err
    header, row = out.strip().splitlines()
    assert header.split()[:5] == ["NAME", "MODEL", "TURNS", "TOKENS", "SIZE"]
    assert row.split()[0] == "alpha" and row.split()[2:4] == ["1", str(info.num_tokens)]
    code, out, err = mlxcc_light("sessions", "show", "alpha", "--json", home=files["home"])
    assert code == 0 and json.loads(out) == info.messages, err


def test_sessions_rm(files, tmp_path):
    home = tmp_path / "home"
    (home / "sessions").mkdir(parents=True)
    victim = home / "sessions" / "beta.safetensors"
    victim.write_bytes((files["home"] / "sessions" / "alpha.safetensors").read_bytes())
    code, out, err = mlxcc_light("sessions", "rm", "beta", home=home)
    assert code == 0 and "removed session 'beta'" in out and not victim.exists(), err


@pytest.mark.parametrize("which", ["ours", "mlx-lm"])
def test_cache_info(files, which):
    path = files[which]
    code, out, err = mlxcc_light("cache", "info", path, home=files["home"])
    assert code == 0, err
    assert f"file:        {path}" in out and "cache types: 2 × KVCache (2 layers)" in out
    assert "tokens:      6" in out and "messages:    2 (user, assistant)" in out
    code, out, err = mlxcc_light("cache", "info", path, "--json", home=files["home"])
    s = json.loads(out)
    assert code == 0 and (s["num_tokens"], s["messages"]) == (6, read_cache_info(path).messages)
    assert s["metadata"]["note"] == "startup"  # a conversion to mlx-lm's layout adds mlx-lm's own keys


def test_cache_diff(files):
    code, out, err = mlxcc_light("cache", "diff", files["ours"], files["other"], "--json", home=files["home"])
    d = json.loads(out)
    assert code == 0 and (d["common_prefix"], d["diverge_at"], d["layer_differences"]) == (3, 3, []), err


def test_error_paths_stay_light(files, tmp_path):
    missing = tmp_path / "missing.safetensors"
    code, out, err = mlxcc_light("cache", "info", missing, home=files["home"])
    assert (code, out, err) == (1, "", f"mlxcc: error: cache file not found: {missing}; check the path")
    text = tmp_path / "notes.txt"
    text.write_text("not a cache\n")
    code, _, err = mlxcc_light("cache", "info", text, home=files["home"])
    assert code == 1 and err.startswith("mlxcc: error:") and "is not a safetensors file" in err
    code, _, err = mlxcc_light("sessions", "show", "nobody", home=files["home"])
    assert code == 1 and "no session named 'nobody'" in err
    code, _, err = mlxcc_light("cache", "info", home=files["home"])
    assert code == 2 and "the following arguments are required: file" in err


def test_header_only_commands_do_not_load_mlx(files):
    """Not even mlx.core: help, listing sessions and reading headers touch no array."""
    for args in (["--help"], ["sessions"], ["cache", "info", files["ours"]], ["cache", "info", files["mlx-lm"]],
                 ["cache", "diff", files["ours"], files["other"]]):  # fmt: skip
        code, _, err = mlxcc_light(*args, home=files["home"], banned=HEAVY + OPTIONAL)
        assert code == 0, err
