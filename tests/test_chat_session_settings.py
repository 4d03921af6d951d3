"""Settings a chat session keeps: the cache shape it was made with (``--kv-bits``,
``--max-kv-size``...) is refused in one line when a resume asks for another, as
``mlxcc generate`` refuses a cache file's; stop strings and chat template arguments
are saved with it. Transcript tests on the real command, and the session-level
contract of a reply cut at a stop string."""

from __future__ import annotations

import json
import shutil

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from test_chat_cli import RESUMED, SYSTEM, TURNS, chat, home, script, stats  # noqa: F401 (fixtures)

from mlx_chatcache.chat.session import ChatSession
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.files.mlxcc_format import read_cache_info
from mlx_chatcache.generation.text import stream_generate


@pytest.mark.parametrize("made,asked,said", [
    ((), ("--kv-bits", "8"), "was made with kv_bits=None but kv_bits=8 was asked"),
    ((), ("--max-kv-size", "64"), "was made with max_kv_size=None but max_kv_size=64 was asked"),
    (("--kv-bits", "8"), ("--kv-bits", "4"), "was made with kv_bits=8 but kv_bits=4 was asked"),
    (("--max-kv-size", "64"), ("--max-kv-size", "80"), "was made with max_kv_size=64 but max_kv_size=80"),
    (("--kv-bits", "8"), ("--kv-group-size", "32"), "was made with kv_group_size=64 but kv_group_size=32"),
    ((), ("--kv-dtype", "float16"), "was made with kv_dtype=auto but kv_dtype=float16 was asked"),
    (("--kv-dtype", "float16"), ("--kv-dtype", "bfloat16"), "was made with kv_dtype=float16 but kv_dtype=bfloat16"),
])  # fmt: skip
def test_a_session_refuses_other_cache_settings_in_one_line(made, asked, said, tiny_model_dirs, chat, home):
    d = tiny_model_dirs["llama"]
    assert chat(d, script(TURNS[0]), "--session", "s", *made)[0] == 0
    path = home / "sessions" / "s.safetensors"
    before = path.read_bytes()
    rc, out, err = chat(d, script(TURNS[1]), "--session", "s", *asked)
    assert rc == 1 and out == ""
    assert err.strip().count("\n") == 0 and said in err and "use the same settings" in err, err
    assert path.read_bytes() == before
    # the same settings (or none: the session's) resume it with nothing recomputed
    for flags in (made, ()):
        rc, out, err = chat(d, script(), "--session", "s", *flags)
        assert rc == 0 and RESUMED.search(err), err
    rc, out, err = chat(d, script(TURNS[1]), "--session", "s", *made)
    assert rc == 0 and stats(err)[0]["recomputed"] == 0


# ------------------------------------------------------------------ stop strings and template arguments
def session_json(home, name: str) -> dict:
    return json.loads(read_cache_info(home / "sessions" / f"{name}.safetensors").metadata["session"])


def replies(home, name: str) -> list[str]:
    return [m["content"] for m in read_cache_info(home / "sessions" / f"{name}.safetensors").messages
            if m["role"] == "assistant"]  # fmt: skip


@pytest.mark.blas  # cut replies compared with uncut ones
def test_stop_cuts_every_reply_and_is_kept_with_the_session(tiny_model_dirs, chat, home):
    d = tiny_model_dirs["llama"]
    assert chat(d, script(*TURNS[:2]), "--session", "plain", "--max-tokens", "12")[0] == 0
    r1 = replies(home, "plain")[0]
    stop = next(c for c in r1[len(r1) // 2 :] + r1 if c != "\ufffd")  # a character the first reply has
    rc, out, err = chat(d, script(*TURNS[:2]), "--session", "s", "--max-tokens", "12", "--stop", stop)
    assert rc == 0, err
    got = replies(home, "s")
    assert got[0] == r1[: r1.index(stop)]
    assert all(stop not in r for r in got)
    assert "(stop)" in err.splitlines()[[i for i, x in enumerate(err.splitlines()) if "[stats]" in x][0]]
    assert session_json(home, "s")["stop"] == [stop]
    # resumed without --stop: the session's stop strings still apply; a new --stop replaces them
    rc, out, err = chat(d, script(TURNS[2]), "--session", "s", "--max-tokens", "12")
    assert rc == 0 and stats(err)[0]["recomputed"] == 0
    assert session_json(home, "s")["stop"] == [stop] and stop not in replies(home, "s")[2]
    rc, out, err = chat(d, script(TURNS[3]), "--session", "s", "--stop", "zz", "--stop", "q")
    assert rc == 0 and session_json(home, "s")["stop"] == ["zz", "q"]
    rc, out, err = chat(d, script(), "--session", "s2", "--stop", "")
    assert rc != 0 and "--stop needs a non-empty text" in err


@pytest.fixture(scope="module")
def template_model_dir(tmp_path_factory, tiny_model_dirs):
    """The tiny llama with a chat template that prints its argument ``x``."""
    d = tmp_path_factory.mktemp("xtemplate") / "llama-x"
    shutil.copytree(tiny_model_dirs["llama"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{%- if x is defined %}{{ 'x=' ~ x ~ '\\n' }}{%- endif %}" + cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_chat_template_arguments_are_used_and_kept_with_the_session(template_model_dir, chat, home):
    d = template_model_dir
    rc, out, err = chat(d, script(TURNS[0]), "--session", "t", "--chat-template-args", '{"x": 7}')
    assert rc == 0, err
    meta = session_json(home, "t")
    assert meta["template_args"] == {"x": 7} and meta["text"].startswith("x=7\n")
    rc, out, err = chat(d, script(TURNS[1]), "--session", "t")  # kept
    assert rc == 0 and stats(err)[0]["recomputed"] == 0 and session_json(home, "t")["text"].startswith("x=7\n")
    rc, out, err = chat(d, script(TURNS[2]), "--session", "t", "--chat-template-config", '{"x": 8}')
    assert rc == 0 and "[new chat template arguments: the conversation will be re-read on the next turn]" in err
    meta = session_json(home, "t")
    assert meta["template_args"] == {"x": 8} and meta["text"].startswith("x=8\n")
    rc, out, err = chat(d, script(TURNS[0]), "--chat-template-args", "[1]")
    assert rc != 0 and "must be a JSON object" in err


def _session(model, tokenizer, stop=()):
    return ChatSession(model, tokenizer, system_prompt=SYSTEM, config=DEFAULTS.updated(max_tokens=12), stop=stop)


@pytest.mark.blas  # the cut reply and the cache compared with fresh runs
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_reply_cut_at_a_stop_string_leaves_an_exact_cache(data, tiny_model):
    kind, model, tokenizer = tiny_model
    r1 = _session(model, tokenizer).ask(TURNS[0]).text
    i = data.draw(st.integers(0, len(r1) - 1))
    stop = r1[i : i + data.draw(st.integers(1, 3))]
    s = _session(model, tokenizer, (stop,))
    a1 = s.ask(TURNS[0])
    assert a1.text == r1[: r1.index(stop)] and a1.stats.finish_reason == "stop"
    for q in TURNS[1:3]:
        prompt = s.prompt_tokens(s.render(s.messages + [{"role": "user", "content": q}]))
        a = s.ask(q)
        assert stop not in a.text
        # the cache is what the model computes for this prompt from nothing: same reply tokens
        n = a.stats.generated_tokens
        assert s.tokens[: len(prompt)] == prompt
        ref = [r.token for r in stream_generate(model, tokenizer, prompt, config=s.config)]
        assert s.tokens[len(prompt):] == ref[:n]


# ------------------------------------------------------------------ the context warning
@pytest.fixture(scope="module")
def short_context_dir(tmp_path_factory, tiny_model_dirs):
    """The tiny llama with a context of 160 tokens."""
    d = tmp_path_factory.mktemp("short") / "llama-160"
    shutil.copytree(tiny_model_dirs["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 160
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("flags,limit,said", [
    ((), 160, "of the model's 160-token context: at 160 the next message is refused"),
    (("--max-kv-size", "96"), 96, "tokens of the 96-token window: past it the oldest turns leave the window"),
])  # fmt: skip
def test_the_context_warning_comes_once_when_a_turn_may_fill_80_percent(flags, limit, said, short_context_dir,
                                                                         chat):  # fmt: skip
    turns = [TURNS[i % 2] for i in range(5)]
    rc, out, err = chat(short_context_dir, script(*turns), *flags)
    lines = err.splitlines()
    warned = [i for i, x in enumerate(lines) if said in x]
    assert len(warned) == 1, err
    at = [i for i, x in enumerate(lines) if "[stats]" in x]
    reach = [s["new"] + s["reused"] + 8 for s in stats(err)]  # prompt + --max-tokens
    first = next(t for t, r in enumerate(reach) if r >= 0.8 * limit)
    assert warned[0] == at[first] + 1  # right after that turn's statistics, never before
    assert first >= 2 and all(r < 0.8 * limit for r in reach[:first])


@pytest.mark.parametrize("saved", [True, False], ids=["session", "no-session"])
def test_a_failed_edit_keeps_the_conversation_and_its_cache(saved, short_context_dir, chat, home):
    """An edit whose turn is refused (its prompt is past the context) changes nothing:
    the session file is loaded again (nothing recomputed) or, without one, the tokens
    after the edit point are fed again; the next reply is the one without the edit."""
    d = short_context_dir
    where = ("--session", "s") if saved else ()
    too_long = " ".join(["word"] * 200)
    rc, out, err = chat(d, script(TURNS[0], TURNS[1], "/edit 1", too_long, TURNS[2]), *where)
    assert "the conversation has" in err and "but the model's context holds 160" in err, err
    st_ = stats(err)
    assert len(st_) == 3
    if saved:
        assert "[edit not made; the conversation is as before (0 tokens recomputed)]" in err
        assert st_[2]["reused"] == st_[1]["new"] + st_[1]["reused"] + st_[1]["generated"] - 1
    else:
        assert "[edit not made; the conversation is as before: " in err
    rc, ref_out, ref_err = chat(d, script(TURNS[0], TURNS[1], TURNS[2]))
    assert out == ref_out


def test_the_context_warning_comes_again_after_the_conversation_shrinks(short_context_dir, chat):
    turns = [TURNS[i % 2] for i in range(5)]
    rc, out, err = chat(short_context_dir, script(*turns, "/clear", *turns))
    said = "of the model's 160-token context"
    assert err.count(said) == 2, err
    lines = err.splitlines()
    cleared = next(i for i, x in enumerate(lines) if "[conversation cleared]" in x)
    assert [i < cleared for i, x in enumerate(lines) if said in x] == [True, False]
