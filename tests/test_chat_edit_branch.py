"""``/edit`` and ``/branch`` in ``mlxcc chat``: transcript tests on the real command
(a scripted conversation piped in) and the session-level contracts behind them.

"Exact" means: the replies after an edit (or in a branch) are those of a new chat
typing the same user messages (greedy), and the edited turn feeds only the tokens
after the edit point (``[stats]``: 0 recomputed, the history before it reused).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from test_chat_cli import SYSTEM, TURNS, chat, home, script, stats  # noqa: F401 (fixtures)

from mlx_chatcache.chat.session import ChatSession
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.errors import SessionError, UsageError
from mlx_chatcache.files.mlxcc_format import read_cache_info

SP = ("--system-prompt", SYSTEM)
NEW = "Tell me about Rome instead."
KINDS = ["llama", "hybrid", "ssm"]  # trimmable, then untrimmable (ArraysCache layers)


def messages(home, name: str) -> list[dict]:
    return read_cache_info(home / "sessions" / f"{name}.safetensors").messages


# ------------------------------------------------------------------ /edit
@pytest.mark.parametrize("kind,flags", [(k, ()) for k in KINDS] + [("llama", ("--max-kv-size", "40"))],
                         ids=[*KINDS, "sliding-wrapped"])  # fmt: skip
def test_edit_equals_a_fresh_chat_and_feeds_only_the_new_tokens(kind, flags, tiny_model_dirs, chat, home):
    d = tiny_model_dirs[kind]
    rc, out, err = chat(d, script(*TURNS[:3], "/edit 2", NEW, TURNS[3]), "--session", "e", *SP, *flags)
    assert rc == 0, err
    rc, fresh_out, fresh_err = chat(d, script(TURNS[0], NEW, TURNS[3]), "--session", "f", *SP, *flags)
    assert rc == 0, fresh_err
    assert messages(home, "e") == messages(home, "f")
    assert [m["content"] for m in messages(home, "e") if m["role"] == "user"] == [TURNS[0], NEW, TURNS[3]]
    st_e, st_f = stats(err), stats(fresh_err)
    assert len(st_e) == 5 and len(st_f) == 3
    # the edited turn reuses everything up to the end of reply 1 (all but its held-back last token)
    first = st_e[0]
    assert st_e[3]["recomputed"] == 0
    assert st_e[3]["reused"] == first["new"] + first["reused"] + first["generated"] - 1
    assert st_e[3:] == st_f[1:]
    replies_f = [m["content"] for m in messages(home, "f") if m["role"] == "assistant"]
    assert out.endswith(replies_f[1] + "\n" + replies_f[2] + "\n")  # what the user saw


def test_edit_without_n_replaces_the_last_message(tiny_model_dirs, chat, home):
    d = tiny_model_dirs["hybrid"]
    rc, _, err = chat(d, script(*TURNS[:2], "/edit", NEW), "--session", "e", *SP)
    assert rc == 0, err
    chat(d, script(TURNS[0], NEW), "--session", "f", *SP)
    assert messages(home, "e") == messages(home, "f")
    assert stats(err)[2]["recomputed"] == 0


@pytest.mark.parametrize("line,said", [
    ("/edit 3", "there is no user message 3: this chat has 2"),
    ("/edit 0", "there is no user message 0"),
    ("/edit x", "usage: /edit [N]"),
    ("/edit 99999999999999999999", "usage: /edit [N]"),
    ("/edit -1", "usage: /edit [N]"),
])  # fmt: skip
def test_edit_refusals_change_nothing(line, said, tiny_model_dirs, chat, home):
    d = tiny_model_dirs["llama"]
    assert chat(d, script(*TURNS[:2]), "--session", "e", *SP)[0] == 0
    path = home / "sessions" / "e.safetensors"
    before = path.read_bytes()
    rc, out, err = chat(d, script(line), "--session", "e", *SP)
    assert rc == 1
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and said in errors[0], err
    assert path.read_bytes() == before


def test_edit_in_a_new_chat_and_empty_text_cancel(tiny_model_dirs, chat, home):
    d = tiny_model_dirs["llama"]
    rc, out, err = chat(d, script("/edit"), *SP)
    assert rc == 1 and "error: there is no message to edit yet" in err
    assert chat(d, script(*TURNS[:2]), "--session", "e", *SP)[0] == 0
    path = home / "sessions" / "e.safetensors"
    before = path.read_bytes()
    rc, out, err = chat(d, script("/edit 1", "", "/edit 1"), "--session", "e", *SP)
    assert rc == 0 and out == ""
    assert err.count("[edit cancelled; nothing changed]") == 2  # an empty line, then the end of input
    assert path.read_bytes() == before


def _session(model, tokenizer, turns) -> ChatSession:
    s = ChatSession(model, tokenizer, system_prompt=SYSTEM, config=DEFAULTS.updated(max_tokens=8,
                                                                                    prefill_step_size=4))
    for t in turns:
        s.ask(t)
    return s


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3), how=st.sampled_from(["cancel", "raise"]))
def test_a_cancelled_or_failed_edit_keeps_the_conversation(n, how, tiny_model):
    kind, model, tokenizer = tiny_model
    s = _session(model, tokenizer, TURNS[:3])
    before = [dict(m) for m in s.messages]
    long = " ".join([NEW] * 8)  # several prompt chunks: a stop is seen while it is read
    if how == "cancel":
        r = s.edit(n, long, should_stop=lambda: True)
        assert r.stats.finish_reason == "cancelled"
    else:
        def boom(_text):
            raise RuntimeError("broken pipe")

        with pytest.raises(RuntimeError):
            s.edit(n, long, on_text=boom)
    assert s.messages == before
    # the conversation goes on as if the edit had never been typed
    ref = _session(model, tokenizer, TURNS[:3])
    assert s.ask(TURNS[3]).text == ref.ask(TURNS[3]).text


def test_edit_index_errors(llama_model):
    model, tokenizer = llama_model
    s = _session(model, tokenizer, [])
    with pytest.raises(SessionError, match="no message to edit"):
        s.edit(None, NEW)
    s.ask(TURNS[0])
    for n in (0, 2, -1, True):
        with pytest.raises(UsageError, match="there is no user message"):
            s.edit(n, NEW)


# ------------------------------------------------------------------ /branch
@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_branch_forks_a_saved_session_and_both_go_on_exactly(kind, tiny_model_dirs, chat, home, capsys):
    d = tiny_model_dirs[kind]
    other = "Tell me a joke instead."
    rc, out, err = chat(d, script(*TURNS[:2], "/branch b", TURNS[2]), "--session", "a", *SP)
    assert rc == 0, err
    assert "[branched: this chat continues in 'b'; 'a' stays at turn 2 (resume it with 'mlxcc chat --session a')]" in err
    assert stats(err)[2]["recomputed"] == 0
    chat(d, script(*TURNS[:3]), "--session", "f3", *SP)
    assert messages(home, "b") == messages(home, "f3")
    assert len(messages(home, "a")) == 5  # system + 2 exchanges: as it was at the branch
    # the parent goes on from turn 2, with nothing recomputed
    rc, out, err = chat(d, script(other), "--session", "a", *SP)
    assert rc == 0 and stats(err)[0]["recomputed"] == 0
    chat(d, script(*TURNS[:2], other), "--session", "f3b", *SP)
    assert messages(home, "a") == messages(home, "f3b")
    # the branch file stands alone: the parent's removal does not break it
    capsys.readouterr()
    from mlx_chatcache.cli.main import main

    assert main(["sessions", "show", "a"]) == 0
    shown = capsys.readouterr().out
    assert "branches: b (at turn 2)" in shown
    assert main(["sessions", "rm", "a"]) == 0
    rc, out, err = chat(d, script(TURNS[3]), "--session", "b", *SP)
    assert rc == 0 and stats(err)[0]["recomputed"] == 0, err


def test_branch_of_an_unsaved_chat_saves_it(tiny_model_dirs, chat, home):
    d = tiny_model_dirs["llama"]
    rc, out, err = chat(d, script(TURNS[0], "/branch b", TURNS[1]), *SP)
    assert rc == 0 and "[saved as session 'b': this chat continues there]" in err
    assert len(messages(home, "b")) == 5
    assert "branch_of" not in read_cache_info(home / "sessions" / "b.safetensors").metadata["session"]


@pytest.mark.parametrize("line,said", [
    ("/branch a", "this chat is session 'a' already"),
    ("/branch c", "session 'c' exists"),
    ("/branch ../x", "invalid session name"),
    ("/branch", "usage: /branch NAME"),
])  # fmt: skip
def test_branch_refusals_write_nothing(line, said, tiny_model_dirs, chat, home):
    d = tiny_model_dirs["llama"]
    for name in ("a", "c"):
        assert chat(d, script(TURNS[0]), "--session", name, *SP)[0] == 0
    folder = home / "sessions"
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".safetensors"}
    rc, out, err = chat(d, script(line), "--session", "a", *SP)
    assert rc == 1
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and said in errors[0], err
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".safetensors"} == before
