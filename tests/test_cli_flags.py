"""Flags a mlx-lm or llama.cpp user types (issue 11 item 7), through ``mlxcc``'s entry point
(in-process, the ``cli`` fixture).

``--verbose True/False`` and ``-v``, ``-f/--prompt-file``, ``-n``, ``--trust-remote-code``,
``--adapter-path`` (a tiny LoRA adapter made here, loaded as mlx-lm loads it;
the fingerprint keeps base-model caches and adapted-model caches apart),
mlx-lm's ``--prefill-step-size`` default, and no abbreviated long flags.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_chatcache.files.mlxcc_format import read_cache_info
from mlx_chatcache.config import DEFAULTS


PROMPT = "Name a river in Africa."


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dirs, tmp_path_factory):
    """A LoRA adapter for the tiny llama, written as mlx_lm.lora writes one (random, non-zero B)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, _ = load(str(tiny_model_dirs["llama"]))
    params = {"rank": 4, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}
    model.freeze()
    linear_to_lora_layers(model, 2, params)
    weights = dict(tree_flatten(model.trainable_parameters()))
    assert weights and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k in weights)
    mx.random.seed(7)
    weights = {k: mx.random.normal(v.shape) * 0.5 for k, v in weights.items()}
    folder = tmp_path_factory.mktemp("adapter")
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}))  # fmt: skip
    return folder


@pytest.mark.blas  # the replies of three runs compared
def test_verbose_takes_mlx_lm_booleans_and_v_everywhere(tiny_model_dirs, tmp_path, cli):
    d = str(tiny_model_dirs["llama"])
    base = ("generate", "--model", d, "-p", PROMPT, "-n", "6")
    quiet = cli(*base, "--verbose", "False")
    loud = cli(*base, "--verbose", "True")
    short = cli(*base, "-v")
    for r in (quiet, loud, short):
        assert r.returncode == 0, r.stderr
    assert quiet.stdout == loud.stdout == short.stdout and quiet.stdout.strip()
    assert "Prompt:" not in quiet.stderr
    assert "Prompt:" in loud.stderr and "Prompt:" in short.stderr
    bad = cli(*base, "--verbose", "maybe")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "True or False" in bad.stderr
    # -v on every command that has a --verbose: cache-prompt and chat too
    f = tmp_path / "c.safetensors"
    cp = cli("cache-prompt", "--model", d, "-p", PROMPT, "--prompt-cache-file", str(f), "-v")
    assert cp.returncode == 0 and "Peak memory" in cp.stderr, cp.stderr
    chat = cli("chat", "--model", d, "-n", "3", "-v", stdin="Hi\n", env={"MLXCC_HOME": tmp_path})
    assert chat.returncode == 0 and "[stats]" in chat.stderr, chat.stderr


@pytest.mark.blas  # the replies of two runs compared
def test_prompt_file_and_n_alias(tiny_model_dirs, tmp_path, cli):
    d = str(tiny_model_dirs["llama"])
    pf = tmp_path / "prompt.txt"
    pf.write_text(PROMPT)
    from_file = cli("generate", "--model", d, "-f", str(pf), "-n", "5", "-v")
    inline = cli("generate", "--model", d, "--prompt", PROMPT, "--max-tokens", "5")
    assert from_file.returncode == 0 and inline.returncode == 0, from_file.stderr
    assert from_file.stdout == inline.stdout
    assert "Generation: 5 tokens" in from_file.stderr
    both = cli("generate", "--model", d, "-f", str(pf), "-p", "x")
    assert both.returncode == 1 and "not both" in both.stderr
    none = cli("generate", "--model", d)
    assert none.returncode == 1 and "--prompt-file" in none.stderr and "Traceback" not in none.stderr


def test_no_abbreviated_long_flags_on_any_parser(tiny_model_dirs, tmp_path, cli):
    from mlx_chatcache.cli.main import build_parser

    def parsers(p):
        yield p
        for a in p._actions:
            for sub in getattr(a, "choices", None) or {}:
                if isinstance(a.choices, dict):
                    yield from parsers(a.choices[sub])

    found = list(parsers(build_parser()))
    assert len(found) >= 10 and all(not p.allow_abbrev for p in found)
    d = str(tiny_model_dirs["llama"])
    r = cli("generate", "--model", d, "-p", PROMPT, "--prompt-cache", str(tmp_path / "x.safetensors"))
    assert r.returncode == 2 and "unrecognized arguments: --prompt-cache" in r.stderr
    assert not (tmp_path / "x.safetensors").exists()
    r = cli("cache", "info", str(tmp_path / "x.safetensors"), "--js")
    assert r.returncode == 2 and "--js" in r.stderr


def test_prefill_step_size_default_is_mlx_lm_s(cli):
    from mlx_lm.generate import DEFAULT_PREFILL_STEP_SIZE, setup_arg_parser

    assert DEFAULTS.prefill_step_size == DEFAULT_PREFILL_STEP_SIZE
    assert setup_arg_parser().get_default("prefill_step_size") == DEFAULT_PREFILL_STEP_SIZE
    help_text = cli("generate", "--help").stdout
    assert f"(default {DEFAULT_PREFILL_STEP_SIZE})" in " ".join(help_text.split())


def test_trust_remote_code_reaches_the_tokenizer(tiny_model_dirs, monkeypatch, capsys):
    import mlx_lm.utils

    from mlx_chatcache.cli.main import main

    seen = []
    real = mlx_lm.utils.load_tokenizer

    def spy(path, extra=None, eos_token_ids=None):
        seen.append(extra)
        return real(path, extra, eos_token_ids=eos_token_ids)

    monkeypatch.setattr(mlx_lm.utils, "load_tokenizer", spy)
    d = str(tiny_model_dirs["llama"])
    assert main(["generate", "--model", d, "-p", PROMPT, "-n", "2", "--trust-remote-code"]) == 0
    assert main(["generate", "--model", d, "-p", PROMPT, "-n", "2"]) == 0
    assert seen == [{"trust_remote_code": True}, None]


@pytest.mark.blas  # the reply compared with mlx-lm's
def test_adapter_path_loads_like_mlx_lm_and_keeps_caches_apart(tiny_model_dirs, adapter_dir, tmp_path, cli):
    from mlx_lm.generate import generate as lm_generate
    from mlx_lm.utils import load as lm_load

    d = str(tiny_model_dirs["llama"])
    raw = ("generate", "--model", d, "-p", PROMPT, "-n", "12", "--ignore-chat-template")
    base = cli(*raw)
    adapted = cli(*raw, "--adapter-path", str(adapter_dir))
    assert base.returncode == 0 and adapted.returncode == 0, adapted.stderr
    assert adapted.stdout != base.stdout  # the adapter changes the model
    model, tokenizer = lm_load(d, adapter_path=str(adapter_dir))
    ids = tokenizer.encode(PROMPT)  # what --ignore-chat-template feeds (special tokens added)
    expected = lm_generate(model, tokenizer, ids, max_tokens=12)
    assert adapted.stdout == expected + "\n"

    # a cache made with the base model does not pair with the adapted one, nor the other way
    fb, fa = tmp_path / "base.safetensors", tmp_path / "adapted.safetensors"
    for f, extra in ((fb, ()), (fa, ("--adapter-path", str(adapter_dir)))):
        r = cli("cache-prompt", "--model", d, "--system-prompt", "Be brief.", "--prompt-cache-file", str(f), *extra)
        assert r.returncode == 0, r.stderr
    assert read_cache_info(fb).model.weights_hash != read_cache_info(fa).model.weights_hash
    for f, extra in ((fb, ("--adapter-path", str(adapter_dir))), (fa, ())):
        r = cli("generate", "--model", d, "-p", PROMPT, "--prompt-cache-file", str(f), *extra)
        assert r.returncode == 1 and "differ" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    ok = cli("generate", "--model", d, "-p", PROMPT, "--prompt-cache-file", str(fa), "--adapter-path", str(adapter_dir))
    assert ok.returncode == 0, ok.stderr
    bad = cli("generate", "--model", d, "-p", PROMPT, "--adapter-path", str(tmp_path))
    assert bad.returncode == 1 and "not an adapter folder" in bad.stderr
