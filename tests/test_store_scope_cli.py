"""What may reach the shared tiers (``--cache-dir``) of ``mlxcc generate``/``chat``,
and under which scope: KV-quantized caches only under their own KV settings
(recorded in every named file, read off the layers of older files), the weight
policy is part of a shared entry's scope, caches of mlx-lm files (tokens only
assumed) are never shared, and a store entry given as ``--prompt-cache-file``
is refused in one line (tiny models). The invariant throughout: greedy output
with ``--cache-dir`` equals the output without it."""

from __future__ import annotations

import json

import pytest

from store_helpers import filled, tokens_of
from test_store_cli import SYSTEM, generate_args, reused_of, run_cli

from mlx_chatcache.cache import QuantizedKVCache, kv_quantization_mismatch, quantize_prompt_cache
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.files.mlxcc_format import load_cache_file, read_cache_info, save_prompt_cache
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.templates import render_chat
from mlx_chatcache.generation.checkout import prompt_scope, put_prompt
from mlx_chatcache.models.loading import load
from mlx_chatcache.files.named_file import recorded_shape
from mlx_chatcache.store.store import PromptStore
from mlx_chatcache.store.disk import DiskTier


def entries(folder):
    """The store's values in ``folder``."""
    return sorted(folder.glob("[be]*.safetensors"))


# ------------------------------------------------------------------ P1-2: KV quantization
def test_kv_quantized_file_does_not_poison_the_unquantized_scope(tiny_model_dirs, tmp_path, capsys):
    """The reviewer's repro: a --kv-bits 8 file continued with --cache-dir D; a plain run
    with --cache-dir D then answers exactly as without it."""
    d, q, folder = tiny_model_dirs["llama"], str(tmp_path / "q.safetensors"), tmp_path / "D"
    code, _, err = run_cli(capsys, *generate_args(d, "Tell me about rivers", "--kv-bits", "8",
                                                  "--save-prompt-cache", q))  # fmt: skip
    assert code == 0, err
    assert recorded_shape(read_cache_info(q))["kv_bits"] == 8
    assert read_cache_info(q).settings["kv_group_size"] == DEFAULTS.kv_group_size
    code, _, err = run_cli(capsys, *generate_args(d, "And mountains", "--prompt-cache-file", q,
                                                  "--cache-dir", str(folder)))  # fmt: skip
    assert code == 0, err
    (entry,) = entries(folder)
    info = read_cache_info(entry)
    assert "QuantizedKVCache" in info.classes and info.settings["kv_bits"] == 8  # under its own scope
    prompt = "Tell me about rivers and lakes"
    code, warm, err = run_cli(capsys, *generate_args(d, prompt, "--cache-dir", str(folder), "-v"))
    assert code == 0, err
    code, cold, _ = run_cli(capsys, *generate_args(d, prompt))
    assert code == 0
    assert reused_of(err) == 0 and warm == cold and warm.strip()


def test_kv_settings_of_a_file_are_enforced_and_adopted(tiny_model_dirs, tmp_path, capsys):
    d, q = tiny_model_dirs["llama"], str(tmp_path / "q.safetensors")
    assert run_cli(capsys, *generate_args(d, "hi", "--kv-bits", "8", "--save-prompt-cache", q))[0] == 0
    code, out, err = run_cli(capsys, *generate_args(d, "more", "--kv-bits", "4", "--prompt-cache-file", q))
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "kv_bits=8" in err and "kv_bits=4" in err
    # no flag: the file's kv_bits are used, and recorded again
    code, _, err = run_cli(capsys, *generate_args(d, "more", "--prompt-cache-file", q, "--save-prompt-cache", q))
    assert code == 0, err
    assert read_cache_info(q).settings["kv_bits"] == 8


def test_older_file_without_kv_settings_adopts_its_layers_quantization(tiny_model_dirs, tmp_path, capsys):
    """A file written before kv_bits was recorded: its QuantizedKVCache layers say kv_bits=8, so
    the run quantizes as the file did and the shared entry goes under the kv_bits=8 scope."""
    d, q, folder = tiny_model_dirs["llama"], tmp_path / "q.safetensors", tmp_path / "D"
    made = generate_args(d, "Tell me about rivers", "--kv-bits", "8", "--save-prompt-cache", str(q))
    assert run_cli(capsys, *made)[0] == 0
    cache, info = load_cache_file(q)
    old = {k: v for k, v in info.settings.items() if k not in ("kv_bits", "kv_group_size", "quantized_kv_start")}
    save_prompt_cache(q, cache, tokens=info.tokens, model=info.model, messages=info.messages, settings=old)
    assert "kv_bits" not in read_cache_info(q).settings
    assert recorded_shape(read_cache_info(q))["kv_bits"] == 8
    code, _, err = run_cli(capsys, *generate_args(d, "And mountains", "--prompt-cache-file", str(q),
                                                  "--cache-dir", str(folder)))  # fmt: skip
    assert code == 0, err
    (entry,) = entries(folder)
    assert read_cache_info(entry).settings["kv_bits"] == 8
    code, _, err = run_cli(capsys, *generate_args(d, "more", "--kv-bits", "4", "--prompt-cache-file", str(q)))
    assert code != 0 and "kv_bits=8" in err  # enforced as if recorded


def test_put_prompt_keeps_disagreeing_layers_out_of_shared_tiers(llama_model, tmp_path):
    model, _ = llama_model
    tokens = tokens_of(20)
    state = PromptCache.new(model)
    state.cache[:], state.tokens[:] = filled(model, tokens), tokens
    quantize_prompt_cache(state.cache, 64, 8)
    store, named = PromptStore([DiskTier(tmp_path / "D", 10**9)]), tmp_path / "f.safetensors"
    warnings = []
    state.messages, state.settings = [], {}  # what the named file records
    put_prompt(store, prompt_scope(model, DEFAULTS), state, warnings.append, named=named)
    assert entries(tmp_path / "D") == [] and len(warnings) == 1 and "kv_bits=None" in warnings[0]
    assert named.exists()  # the named file is what the user asked for
    # under its own settings it is shared
    put_prompt(store, prompt_scope(model, DEFAULTS.updated(kv_bits=8)), state, warnings.append, named=named)
    assert len(entries(tmp_path / "D")) == 1 and len(warnings) == 1


def test_kv_quantization_mismatch_rules(llama_model):
    model, _ = llama_model
    fl = filled(model, tokens_of(10))
    assert kv_quantization_mismatch(fl, None, 64) is None
    assert "float K/V layer holds 10 tokens" in kv_quantization_mismatch(fl, 8, 64, 0)
    assert kv_quantization_mismatch(fl, 8, 64, 11) is None  # not yet quantized: as quantize_prompt_cache does
    q = quantize_prompt_cache(filled(model, tokens_of(10)), 64, 8)
    assert all(isinstance(c, QuantizedKVCache) for c in q)
    assert kv_quantization_mismatch(q, 8, 64) is None
    assert "kv_bits=None" in kv_quantization_mismatch(q, None, 64)
    assert "kv_bits=4" in kv_quantization_mismatch(q, 4, 64)
    assert kv_quantization_mismatch(PromptCache.new(model).cache, 8, 64, 0) is None  # empty


def test_every_named_file_records_the_kv_settings(tiny_model_dirs, tmp_path, capsys, monkeypatch):
    import io
    import sys

    from mlx_chatcache.cli.main import main

    d = tiny_model_dirs["llama"]
    cp = tmp_path / "cp.safetensors"
    code, _, err = run_cli(capsys, "cache-prompt", "--model", str(d), "-p", "Hello", "--kv-bits", "4",
                           "--kv-group-size", "32", "--prompt-cache-file", str(cp))  # fmt: skip
    assert code == 0, err
    s = read_cache_info(cp).settings
    assert (s["kv_bits"], s["kv_group_size"], s["quantized_kv_start"]) == (4, 32, 0)
    monkeypatch.setenv("MLXCC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    session = tmp_path / "s.safetensors"
    assert main(["chat", "--model", str(d), "-m", "4", "--kv-bits", "8", "--session-file", str(session)]) == 0
    s = read_cache_info(session).settings
    assert (s["kv_bits"], s["kv_group_size"], s["max_kv_size"]) == (8, DEFAULTS.kv_group_size, None)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Again\n"))  # resumed: the file's settings agree with its own
    assert main(["chat", "--model", str(d), "-m", "4", "--session-file", str(session)]) == 0
    assert "resumed" in capsys.readouterr().err
    assert [m["role"] for m in read_cache_info(session).messages] == ["user", "assistant"] * 2


# ------------------------------------------------------------------ P2-5: weight policy
def test_a_float32_policy_entry_is_not_served_to_a_q_run(tiny_model_dirs, tmp_path, capsys):
    d, folder = tiny_model_dirs["llama"], str(tmp_path / "D")
    f32 = ["--weights", "float32", "--cache-dir", folder]
    assert run_cli(capsys, *generate_args(d, "Name a river.", *f32))[0] == 0
    assert read_cache_info(entries(tmp_path / "D")[0]).settings["weights"] == "float32"
    code, warm, err = run_cli(capsys, *generate_args(d, "Name a mountain.", "--weights", "q", "--cache-dir", folder,
                                                     "-v"))  # fmt: skip
    assert code == 0, err
    assert reused_of(err) == 0
    assert warm == run_cli(capsys, *generate_args(d, "Name a mountain.", "--weights", "q"))[1]
    # the control: the same policy is served
    code, _, err = run_cli(capsys, *generate_args(d, "Name a mountain.", *f32, "-v"))
    assert code == 0 and reused_of(err) > 0 and "prefix from the disk tier" in err


# ------------------------------------------------------------------ P2-6: mlx-lm files
def test_mlx_lm_file_cache_is_not_shared(tiny_model_dirs, tmp_path, capsys):
    d, folder = tiny_model_dirs["llama"], tmp_path / "D"
    model, tok = load(str(d))
    prompt = render_chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a lake."}])
    lm, out = tmp_path / "lm.safetensors", tmp_path / "out.safetensors"
    save_prompt_cache(lm, filled(model, prompt[:20]), metadata={"model": str(d)}, format="mlx-lm")
    assert read_cache_info(lm).tokens is None
    code, _, err = run_cli(capsys, *generate_args(d, "Name a lake.", "--prompt-cache-file", str(lm), "--cache-dir",
                                                  str(folder), "--save-prompt-cache", str(out)))  # fmt: skip
    assert code == 0, err
    assert read_cache_info(out).tokens[:20] == prompt[:20]  # the named file is written
    assert folder.is_dir() and entries(folder) == []  # the assumed tokens are never shared


# ------------------------------------------------------------------ P2-2: a store entry as --prompt-cache-file
def test_store_entry_as_prompt_cache_file_is_refused(tiny_model_dirs, tmp_path, capsys):
    d, folder = tiny_model_dirs["llama"], tmp_path / "D"
    assert run_cli(capsys, *generate_args(d, "Tell me about rivers", "--cache-dir", str(folder)))[0] == 0
    for entry in entries(folder):  # blocks and tails alike
        info = read_cache_info(entry)
        assert info.metadata["store.key"] == entry.stem and info.tokens and info.messages is None and info.text is None
        code, out, err = run_cli(capsys, *generate_args(d, "And lakes?", "--prompt-cache-file", str(entry)))
        assert code != 0 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "store entry" in lines[0] and "--cache-dir" in lines[0], err


@pytest.mark.parametrize("flag", ["--ignore-chat-template", None])
def test_files_with_messages_or_text_still_continue(flag, tiny_model_dirs, tmp_path, capsys):
    d, f = tiny_model_dirs["llama"], str(tmp_path / "f.safetensors")
    extra = [flag] if flag else []
    assert run_cli(capsys, *generate_args(d, "Hello", "--save-prompt-cache", f, *extra))[0] == 0
    code, _, err = run_cli(capsys, *generate_args(d, "More", "--prompt-cache-file", f, "-v", *extra))
    assert code == 0 and reused_of(err) > 0, err
    assert json.loads(json.dumps(read_cache_info(f).settings))["kv_bits"] is None
