"""Tests of :mod:`mlx_chatcache.chat.session` on the tiny models (greedy unless said).

What "no re-prefill" means here: a turn's reported ``reused_tokens`` equals the
tokens the cache held before it, ``recomputed_tokens`` is 0, and
``new_tokens`` is exactly the held-back last reply token plus the encoding of
the text the template adds after the held text.
"""

from __future__ import annotations

import json

import pytest

from mlx_chatcache.cache import KVCache, RotatingKVCache, cache_offset
from mlx_chatcache.files.mlxcc_format import read_cache_info, save_prompt_cache as save_cache
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.errors import ModelMismatchError, SessionError, UsageError
from mlx_chatcache.generation.text import stream_generate
from mlx_chatcache.chat.session import ChatSession
from mlx_chatcache.chat.session_file import session_path
from mlx_chatcache.files.lock import SessionLock

CFG = DEFAULTS.updated(max_tokens=8)
SYSTEM = "Keep your answers short."
QUESTIONS = ["Good morning!", "What is the capital of Italy?", "Thank you very much."]


def new_session(model, tokenizer, **cfg):
    return ChatSession(model, tokenizer, system_prompt=SYSTEM, config=CFG.updated(**cfg))


def uncached_reply(model, tokenizer, prompt_ids, config) -> list[int]:
    """The reply to ``prompt_ids`` from a fresh cache (the reference)."""
    return [r.token for r in stream_generate(model, tokenizer, prompt_ids, config=config)]


# ------------------------------------------------------------------ turns
def test_each_turn_feeds_only_new_tokens(tiny_model):
    kind, model, tokenizer = tiny_model
    s = new_session(model, tokenizer)
    for i, q in enumerate(QUESTIONS):
        held_before = s.cached_tokens
        history, held_text = s.tokens, s.text
        prompt_text = s.render(s.messages + [{"role": "user", "content": q}])
        expected_prompt = s.prompt_tokens(prompt_text)
        r = s.ask(q)
        st = r.stats
        assert st.recomputed_tokens == 0
        assert st.reused_tokens == held_before
        assert st.prompt_tokens == len(expected_prompt)
        if i:
            assert expected_prompt[: len(history)] == history  # history kept as generated
            assert st.new_tokens == len(expected_prompt) - held_before
            # the held-back last reply token + the text the template adds after it
            assert prompt_text.startswith(held_text)
            assert st.new_tokens == 1 + len(s.encode(prompt_text[len(held_text) :]))
        # the reply's tokens stay in the cache exactly as generated (all but the last)
        reply = uncached_reply(model, tokenizer, expected_prompt, s.config)
        assert s.tokens == expected_prompt + reply, kind
        assert s.state.tokens == expected_prompt + reply[:-1]
        assert cache_offset(s.state.cache) in (0, len(s.state.tokens))
    assert s.num_turns == 3 and [m["role"] for m in s.messages] == [
        "system", "user", "assistant", "user", "assistant", "user", "assistant"
    ]  # fmt: skip


def test_undo_then_same_message_gives_same_reply_without_prefill(tiny_model):
    kind, model, tokenizer = tiny_model
    s = new_session(model, tokenizer)
    s.ask(QUESTIONS[0])
    held = s.cached_tokens
    first = s.ask(QUESTIONS[1])
    r = s.undo()
    assert r.how == ("trim" if kind == "llama" else "checkpoint")
    assert s.cached_tokens == held and s.num_turns == 1
    again = s.ask(QUESTIONS[1])
    assert again.text == first.text
    assert (again.stats.new_tokens, again.stats.reused_tokens) == (first.stats.new_tokens, held)
    assert again.stats.recomputed_tokens == 0


def test_retry_greedy_reproduces_and_seeded_retry_is_reproducible(tiny_model):
    kind, model, tokenizer = tiny_model
    s = new_session(model, tokenizer)
    s.ask(QUESTIONS[0])
    held = s.cached_tokens
    first = s.ask(QUESTIONS[1])
    again = s.retry()
    assert again.text == first.text and again.stats.reused_tokens == held
    assert again.stats.recomputed_tokens == 0 and s.num_turns == 2

    runs = []
    for _ in range(2):
        s = new_session(model, tokenizer, temp=1.0, seed=7)
        a = s.ask(QUESTIONS[0]).text
        b = s.retry().text
        c = s.retry().text
        runs.append((a, b, c))
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # a retry is a new draw (seed + retry count)


def test_interrupted_reply_keeps_partial_text_and_cache(llama_model):
    model, tokenizer = llama_model
    s = new_session(model, tokenizer, max_tokens=50)
    seen = []
    r = s.ask(QUESTIONS[0], on_text=seen.append, should_stop=lambda: len(seen) >= 3)
    assert r.stats.finish_reason == "interrupted"
    assert r.stats.generated_tokens < 50
    assert s.messages[-1] == {"role": "assistant", "content": r.text}
    assert "".join(seen) == r.text
    held = s.cached_tokens
    nxt = s.ask(QUESTIONS[1])
    assert nxt.stats.reused_tokens == held and nxt.stats.recomputed_tokens == 0


def stop_after(n: int, exc: type[BaseException] | None = None):
    """A ``should_stop`` that answers True (or raises ``exc``) from its n-th call on."""
    calls = []

    def check() -> bool:
        calls.append(1)
        if len(calls) >= n and exc is not None:
            raise exc
        return len(calls) >= n

    return check


@pytest.mark.parametrize("exc", [None, KeyboardInterrupt], ids=["stop", "second-ctrl-c"])
def test_stop_while_reading_the_prompt_cancels_the_turn(exc, tiny_model):
    kind, model, tokenizer = tiny_model
    s = new_session(model, tokenizer, prefill_step_size=4)
    s.ask(QUESTIONS[0])
    before = (list(s.messages), s.tokens, s.text, s.cached_tokens)
    if exc is None:
        r = s.ask(QUESTIONS[1], should_stop=stop_after(3))  # during the 3rd of ~7 chunks
        assert r.stats.finish_reason == "cancelled" and r.text == ""
    else:
        with pytest.raises(KeyboardInterrupt):
            s.ask(QUESTIONS[1], should_stop=stop_after(3, exc))
    assert (s.messages, s.tokens, s.text, s.cached_tokens) == before
    r = s.ask(QUESTIONS[1])
    assert r.stats.reused_tokens == before[3] and r.stats.recomputed_tokens == 0
    ref = new_session(model, tokenizer, prefill_step_size=4)
    ref.ask(QUESTIONS[0])
    assert ref.ask(QUESTIONS[1]).text == r.text


def test_failed_turn_rolls_back(llama_model):
    model, tokenizer = llama_model
    s = new_session(model, tokenizer)
    s.ask(QUESTIONS[0])
    before = (list(s.messages), s.tokens, s.text)

    def boom(_text):
        raise RuntimeError("broken pipe")

    with pytest.raises(RuntimeError):
        s.ask(QUESTIONS[1], on_text=boom)
    assert (s.messages, s.tokens, s.text) == before
    r = s.ask(QUESTIONS[1])
    assert r.stats.recomputed_tokens == 0 and r.stats.reused_tokens == s.checkpoints[-1].state_len


# ------------------------------------------------------------------ bounded memory
def test_rotating_window_pins_system_prompt_and_rolls_back_after_wrap(llama_model):
    model, tokenizer = llama_model
    s = new_session(model, tokenizer, max_kv_size=48)
    system_tokens = len(s.encode(s.render(s.messages[:1], add_generation_prompt=False)))
    assert s.state.shape.keep == system_tokens
    assert all(isinstance(c, RotatingKVCache) and c.keep == system_tokens for c in s.state.cache)
    for q in QUESTIONS * 2:
        last = s.ask(q)
        assert last.stats.recomputed_tokens == 0
    assert s.cached_tokens > 2 * 48  # wrapped long ago: the cache stays bounded
    assert all(c.size() <= 48 for c in s.state.cache)
    assert not s.cache_info()["trimmable"]
    held = s.checkpoints[-1].state_len
    r = s.undo()
    assert r.how == "checkpoint"
    again = s.ask(QUESTIONS[-1])
    assert again.text == last.text and again.stats.reused_tokens == held
    retry = s.retry()
    assert retry.text == last.text and retry.stats.recomputed_tokens == 0


def test_window_too_small_for_system_prompt(llama_model):
    model, tokenizer = llama_model
    with pytest.raises(SessionError, match="max-kv-size"):
        ChatSession(model, tokenizer, system_prompt=SYSTEM * 5, config=CFG.updated(max_kv_size=20))


def test_checkpoint_copies_are_bounded(tiny_model):
    kind, model, tokenizer = tiny_model
    s = ChatSession(model, tokenizer, config=CFG.updated(max_tokens=2), max_checkpoints=2)
    for q in QUESTIONS * 2:
        s.ask(q)
    copies = s.cache_info()["checkpoint_copies"]
    assert copies == (0 if kind == "llama" else 2)
    for ck in s.checkpoints[-2:]:
        if ck.cache is not None:  # plain K/V layers are trimmed back, never copied
            assert [x is None for x in ck.cache] == [type(c) is KVCache for c in s.state.cache]
    for _ in range(2):
        s.undo()
    # past the kept copies, an untrimmable cache says it must recompute
    r = s.undo()
    assert r.how == ("trim" if kind == "llama" else "recompute")
    nxt = s.ask(QUESTIONS[0])
    if kind == "llama":
        assert nxt.stats.reused_tokens == s.checkpoints[-1].state_len and nxt.stats.recomputed_tokens == 0
    else:  # the history is fed again, as the undo said
        assert r.recompute_tokens > 0 and nxt.stats.reused_tokens == 0


# ------------------------------------------------------------------ settings
def test_system_prompt_change_and_clear(llama_model):
    model, tokenizer = llama_model
    s = new_session(model, tokenizer)
    s.ask(QUESTIONS[0])
    before = s.state.tokens[:]
    s.set_system_prompt("Answer in French.")
    assert s.messages[0]["content"] == "Answer in French." and s.num_turns == 1
    prompt_text = s.render(s.messages + [{"role": "user", "content": QUESTIONS[1]}])
    r = s.ask(QUESTIONS[1])
    prompt = s.state.tokens[: r.stats.prompt_tokens]
    # the cache kept its common start with the new prompt; the history was read again behind the
    # new system prompt (counted as recomputed), and the reply is the one a fresh cache gives
    common = next(i for i, (a, b) in enumerate(zip(before, prompt)) if a != b)
    assert r.stats.reused_tokens == common > 0
    assert 0 < r.stats.recomputed_tokens < r.stats.new_tokens == len(prompt) - common
    assert s.tokenizer.decode(prompt) == prompt_text
    assert s.tokens == prompt + uncached_reply(model, tokenizer, prompt, s.config)
    s.clear()
    head = s.encode(s.render(s.messages[:1], add_generation_prompt=False))
    assert s.messages == [{"role": "system", "content": "Answer in French."}]
    assert s.state.tokens == head and s.pending == []  # the system prompt stays in the cache
    with pytest.raises(SessionError, match="no exchange"):
        s.undo()
    s.update_settings({"temp": 0.5, "max_tokens": 3})
    assert s.ask("Hi").stats.generated_tokens == 3
    with pytest.raises(UsageError):
        s.update_settings({"top_p": 2.0})
    with pytest.raises(UsageError):
        s.update_settings({"max_kv_size": 10})


# ------------------------------------------------------------------ files
@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_save_load_continues_exactly(kind, tiny_model_dirs, tmp_path):
    from mlx_chatcache.models.loading import load

    model, tokenizer = load(str(tiny_model_dirs[kind]))
    a = new_session(model, tokenizer, temp=0.8, seed=3)
    for q in QUESTIONS[:2]:
        a.ask(q)
    path = tmp_path / "s.safetensors"
    a.save(path)
    b = ChatSession.load(path, model, tokenizer)
    assert b.messages == a.messages and b.tokens == a.tokens and b.text == a.text
    assert b.config == a.config and b.cached_tokens == a.cached_tokens
    ra, rb = a.ask(QUESTIONS[2]), b.ask(QUESTIONS[2])
    assert ra.text == rb.text
    assert rb.stats.reused_tokens == b.checkpoints[-1].state_len and rb.stats.recomputed_tokens == 0
    info = read_cache_info(path)
    meta = json.loads(info.metadata["session"])
    assert meta["settings"]["temp"] == 0.8 and info.messages == a.messages[:-2]
    # undo after loading: trimmable caches trim back, others restore the copy the file keeps
    c = ChatSession.load(path, model, tokenizer)
    assert c.undo().how == ("trim" if kind == "llama" else "checkpoint")


def test_load_refuses_another_model_and_non_sessions(llama_model, make_tiny_model, tmp_path):
    model, tokenizer = llama_model
    s = new_session(model, tokenizer)
    s.ask(QUESTIONS[0])
    path = tmp_path / "s.safetensors"
    s.save(path)
    other, other_tok = make_tiny_model("llama", seed=1)
    with pytest.raises(ModelMismatchError, match="session was made with model") as e:
        ChatSession.load(path, other, other_tok)
    assert "\n" not in str(e.value)
    plain = tmp_path / "plain.safetensors"
    save_cache(plain, s.state.cache, tokens=s.state.tokens, model=model.fingerprint)
    with pytest.raises(SessionError, match="not a chat session"):
        ChatSession.load(plain, model, tokenizer)
    with pytest.raises(SessionError, match="max_kv_size"):
        ChatSession.load(path, model, tokenizer, overrides={"max_kv_size": 64})
    loaded = ChatSession.load(path, model, tokenizer, overrides={"temp": 0.3})
    assert loaded.config.temp == 0.3


# ------------------------------------------------------------------ from a prebuilt cache
def _prebuilt(model, tokens: list[int], messages: list[dict]):
    """A prompt cache fed ``tokens`` that says it holds ``messages`` (as cache-prompt makes one)."""
    from mlx_chatcache.files.prompt_cache import PromptCache
    from mlx_chatcache.generation.templates import feed_all

    prompt = PromptCache.new(model)
    feed_all(model, prompt, tokens, 512)
    prompt.messages = [dict(m) for m in messages]
    return prompt


@pytest.mark.parametrize("held", ["exact", "system only", "other system prompt"])
def test_from_prompt_cache_continues_like_a_fresh_session(held, tiny_model):
    """Whatever tokens the prebuilt cache holds, the chat answers as a fresh session on the
    same messages; the held tokens are reused exactly as far as they match."""
    from mlx_chatcache.generation.templates import render_chat

    kind, model, tokenizer = tiny_model
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    fed = {"exact": msgs, "system only": msgs[:1], "other system prompt": [{"role": "system", "content": "Be rude."}]}
    tokens = render_chat(tokenizer, fed[held], add_generation_prompt=False)
    prompt = _prebuilt(model, tokens, msgs)
    s = ChatSession.from_prompt_cache(model, tokenizer, prompt, config=CFG)
    ref = new_session(model, tokenizer)
    ref.messages.append(dict(msgs[1]))
    for i, q in enumerate(QUESTIONS[1:]):
        r, want = s.ask(q), ref.ask(q)
        assert r.text == want.text and r.stats.prompt_tokens == want.stats.prompt_tokens, kind
        assert s.tokens == ref.tokens
        if i == 0 and held == "other system prompt":
            assert r.stats.reused_tokens < len(tokens)
        elif i == 0:  # every held token reused: only the new ones fed
            assert r.stats.reused_tokens == len(tokens) and r.stats.recomputed_tokens == 0
            assert r.stats.new_tokens == r.stats.prompt_tokens - len(tokens)
    assert prompt.messages == msgs  # the session works on its own copy of the messages


def test_from_prompt_cache_refuses_raw_text(llama_model):
    from mlx_chatcache.files.prompt_cache import PromptCache

    model, tokenizer = llama_model
    prompt = PromptCache.new(model)
    prompt.text = "Once upon a time"
    with pytest.raises(UsageError, match="chat cache"):
        ChatSession.from_prompt_cache(model, tokenizer, prompt)


# ------------------------------------------------------------------ names and locks
@pytest.mark.parametrize(
    "name", ["../x", "a/../../b", "/etc/passwd", "a\x00b", "x" * 300, "", ".hidden", "-x", "a b", "..", "a..b"]
)
def test_bad_session_names(name, monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCC_HOME", str(tmp_path))
    with pytest.raises(SessionError, match="invalid session name"):
        session_path(name)


def test_session_path_and_lock(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCC_HOME", str(tmp_path))
    p = session_path("my-chat_1.v2")
    assert p == tmp_path / "sessions" / "my-chat_1.v2.safetensors"
    with SessionLock(p, "'my-chat_1.v2'") as lock:
        assert lock.path == tmp_path / "sessions" / "my-chat_1.v2.lock"
        with pytest.raises(SessionError, match="already open in another mlxcc process"):
            SessionLock(p, "'my-chat_1.v2'").acquire()
    SessionLock(p).acquire().release()  # free again once released


# ------------------------------------------------------------------ templates that rewrite history
# Like ChatML, but earlier replies are shortened to 4 characters (as templates that
# drop an earlier reply's reasoning do): each turn changes the previous reply.
REWRITING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'][:4] if message['role'] == "
    "'assistant' else message['content']) + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_template_rewriting_history_reuses_less_but_stays_exact(kind, tiny_model_dirs):
    from mlx_chatcache.models.loading import load

    model, tokenizer = load(str(tiny_model_dirs[kind]))  # a private copy: its template changes
    tokenizer._tokenizer.chat_template = REWRITING_TEMPLATE
    s = new_session(model, tokenizer)
    for i, q in enumerate(QUESTIONS + ["Explain why the sky looks blue."]):
        start_checkpoint = s.checkpoints[-1].state_len if s.checkpoints else 0
        prompt_text = s.render(s.messages + [{"role": "user", "content": q}])
        r = s.ask(q)
        expected = s.encode(prompt_text) if i == 0 else None
        prompt = s.state.tokens[: r.stats.prompt_tokens]
        # the prompt is exactly the rendered text, and the reply is what a fresh cache gives
        assert s.tokenizer.decode(prompt) == prompt_text
        reply = uncached_reply(model, tokenizer, prompt, s.config)
        assert s.tokens == prompt + reply
        if i == 0:
            assert prompt == expected
            continue
        if kind == "llama":  # trimmed back to where the rewrite starts: nothing recomputed
            assert r.stats.recomputed_tokens == 0 and r.stats.reused_tokens > start_checkpoint
        else:  # restarted from the previous turn's checkpoint copy
            # (the first turn's is at the end of the system prompt): the previous message and a few
            # reply tokens are fed again
            assert r.stats.reused_tokens == start_checkpoint > 0
            assert 0 < r.stats.recomputed_tokens < r.stats.new_tokens
    held = s.checkpoints[-1].state_len
    last = s.messages[-1]["content"]
    assert s.undo().how == ("trim" if kind == "llama" else "checkpoint")
    assert s.cached_tokens == held
    assert s.ask("Explain why the sky looks blue.").text == last
