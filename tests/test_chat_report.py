"""What the chat shows is what the model gets: ``/system`` and ``/show info`` show the system
prompt the chat template writes when the conversation sets none (marked as its default), and
``/show info`` the stop strings and template arguments in force, saved ones after a resume too.
On a copy of the tiny llama whose template writes a default system prompt, as SmolLM2's does."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from mlx_chatcache.files.mlxcc_format import read_cache_info


DEFAULT = "You are a tiny test model."
TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + DEFAULT + "' + (' Be terse.' if terse else '') + '<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("default-system") / "llama"
    shutil.copytree(tiny_model_dirs["llama"], d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def chat(model_dir, home, lines, *flags):
    env = {**os.environ, "MLXCC_HOME": str(home)}
    p = subprocess.run([sys.executable, "-m", "mlx_chatcache", "chat", "--model", str(model_dir), "-m", "3", *flags],
                       input="".join(x + "\n" for x in lines), capture_output=True, text=True, env=env,
                       timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p.stdout


def info(out: str) -> dict:
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines() if ":" in ln)}


def test_the_template_default_stop_strings_and_template_arguments_are_shown(model_dir, tmp_path):
    f = tmp_path / "s.safetensors"
    out = chat(model_dir, tmp_path, ["/system", "/show info", "Hello", "/bye"], "--session-file", str(f),
               "--stop", "zz", "--stop", "\n\n", "--chat-template-config", '{"terse": true}', "--max-kv-size", "200")
    shown = out.split("\n(the chat template's default")[0]
    assert shown == f"{DEFAULT} Be terse."  # /system: what the model gets, with the template's arguments
    i = info(out)
    assert i["system prompt"] == f"{DEFAULT} Be terse. (the chat template's default)"
    assert i["stop"] == '"zz", "\\n\\n"' and i["template args"] == '{"terse": true}'
    # the model got it: the session's tokens start with the default, and the window pins it
    from mlx_chatcache.generation.text import as_tokenizer_wrapper
    from mlx_chatcache.models.loading import load_tokenizer

    tokenizer = as_tokenizer_wrapper(load_tokenizer(str(model_dir)))
    head = f"<|im_start|>system\n{DEFAULT} Be terse.<|im_end|>\n"
    tokens = read_cache_info(f).tokens
    assert tokenizer.decode(tokens).startswith(head)
    pinned = int(re.match(r"max_kv_size=200 \(first (\d+) tokens pinned\)", i["cache"]).group(1))
    assert pinned >= len(tokenizer.encode(head, add_special_tokens=False))  # the default is never dropped

    # resumed without the flags: the saved stop strings and template arguments are in force and shown
    out = chat(model_dir, tmp_path, ["/show info", "/system Be kind.", "/show info", "/system"], "--session-file", str(f))
    before, after = out.split("system prompt: ", 2)[1:]
    assert before.startswith(f"{DEFAULT} Be terse. (the chat template's default)")
    assert info("system prompt: " + before)["stop"] == '"zz", "\\n\\n"'
    assert info("system prompt: " + after)["template args"] == '{"terse": true}'
    assert after.startswith("Be kind.\n") and out.rstrip().endswith("Be kind.")  # set: no default any more


def test_without_a_default_the_system_prompt_is_none(tiny_model_dirs, tmp_path):
    out = chat(tiny_model_dirs["llama"], tmp_path, ["/system", "/show info"])
    assert out.startswith("(no system prompt)\n") and info(out)["system prompt"] == "(none)"
    assert info(out)["stop"] == "(none)" and info(out)["template args"] == "(none)"


def test_show_cache_after_a_cancelled_first_prompt_holds_nothing(llama_model):
    """A prompt cancelled while it is read (Ctrl-C) leaves the cache as it was: empty, with no
    arrays kept for it (``/show cache`` says 0 tokens and 0 bytes, not the cancelled prompt's room)."""
    from mlx_chatcache.chat.session import ChatSession
    from mlx_chatcache.cli.chat_report import cache_text
    from mlx_chatcache.config import DEFAULTS

    model, tokenizer = llama_model
    s = ChatSession(model, tokenizer, config=DEFAULTS.updated(max_tokens=3, prefill_step_size=16))
    calls = []
    r = s.ask("word " * 400, should_stop=lambda: calls.append(1) or len(calls) > 3)
    assert r.stats.finish_reason == "cancelled" and s.messages == []
    lines = cache_text(s).splitlines()
    assert lines[0].startswith("tokens:      0 in the cache") and lines[1] == "bytes:       0 B of arrays"
    assert s.ask("Hello").stats.reused_tokens == 0  # and the next turn starts from nothing, as said
