"""``mlxcc serve`` with the official ``openai`` client against live servers on
127.0.0.1 (tiny random models): streaming and not, exact cached_tokens across
turns and across a restart, identical greedy output with and without the
store, stop strings, disconnects, queued concurrent requests, pinned
conversations, and OpenAI-shaped 4xx errors for malformed requests."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import openai

from server_process import ServerProcess  # noqa: E402

from mlx_chatcache.config import SERVER_DEFAULTS  # noqa: E402
from mlx_chatcache.files.tokens import common_prefix_len  # noqa: E402
from mlx_chatcache.generation.text import stream_generate  # noqa: E402
from mlx_chatcache.generation.templates import render_chat  # noqa: E402
from store_helpers import served, values_read  # noqa: E402

MAX_TOKENS = 12
FIRST = [{"role": "system", "content": "Keep your answers short."},
         {"role": "user", "content": "Good morning! Can you help me write a note?"}]  # fmt: skip


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=60, max_retries=0)


def chat(server, messages, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client(server).chat.completions.create(model=server.model_id, messages=messages, temperature=0, **kw)


def local_reply(llama_model, messages, max_tokens=MAX_TOKENS):
    """The same greedy reply computed in this process: (token ids, text)."""
    model, tokenizer = llama_model
    tokens, text = [], ""
    for r in stream_generate(model, tokenizer, render_chat(tokenizer, messages),
                             config=_config(max_tokens)):  # fmt: skip
        tokens.append(r.token)
        text += r.text
    return tokens, text


def _config(max_tokens):
    from mlx_chatcache.config import DEFAULTS

    return DEFAULTS.updated(max_tokens=max_tokens)


def expected_cached(llama_model, turn1, reply_ids, turn2) -> int:
    """What the store serves turn 2's prompt of what the server stored after turn 1: its
    prompt + reply but the reply's last token (never fed), and the prompt, and the prompt
    but its last token, served exactly (:func:`store_helpers.served`)."""
    _, tokenizer = llama_model
    prompt = render_chat(tokenizer, turn1)
    held = [prompt + reply_ids[:-1], prompt, prompt[:-1]]
    return served(held, render_chat(tokenizer, turn2)[:-1], SERVER_DEFAULTS.store_block_tokens)


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    with ServerProcess(tiny_model_dirs["llama"], tmp_path_factory.mktemp("cache"), "--max-tokens", "64",
                       "--context-length", "512") as s:  # fmt: skip
        yield s


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [server.model_id] == ["llama-seed0"]  # the folder's name
    health = server.health()
    assert health["status"] == "ok" and "memory" in health["store"] and "disk" in health["store"]


@pytest.mark.blas  # replies compared with the library's
def test_chat_stream_and_non_stream_agree_with_the_library(server, llama_model):
    messages = [{"role": "user", "content": "What is the capital of Italy?"}]
    full = chat(server, messages)
    ids, text = local_reply(llama_model, messages)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == text
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(render_chat(llama_model[1], messages))
    assert full.usage.completion_tokens == len(ids) == MAX_TOKENS
    timing = full.model_extra["mlxcc_timing"]  # our extra field: where the time went
    assert 0 <= timing["queued_s"] and 0 < timing["first_token_s"] <= timing["total_s"]
    chunks = list(chat(server, messages, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    # the same prompt again: everything but its last token comes from the store
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1


@pytest.mark.blas  # replies compared with the library's
def test_second_turn_reports_exact_cached_tokens(server, llama_model):
    first = chat(server, FIRST)
    assert first.usage.prompt_tokens_details.cached_tokens <= 2  # at most "<|im_start|>system" from earlier chats
    reply_ids, reply_text = local_reply(llama_model, FIRST)
    assert first.choices[0].message.content == reply_text
    turn2 = FIRST + [{"role": "assistant", "content": reply_text}, {"role": "user", "content": "Thank you!"}]
    second = chat(server, turn2)
    want = expected_cached(llama_model, FIRST, reply_ids, turn2)
    assert second.usage.prompt_tokens_details.cached_tokens == want
    if llama_model[1].encode(reply_text, add_special_tokens=False) == reply_ids:  # the reply re-encodes alike
        assert want == first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert want > first.usage.prompt_tokens
    assert second.choices[0].message.content == local_reply(llama_model, turn2)[1]


@pytest.mark.blas  # replies with and without the store compared
def test_restart_keeps_the_conversation_and_greedy_output(tiny_model_dirs, llama_model, tmp_path):
    msgs = [{"role": "user", "content": "Please summarise the following paragraph in two sentences."}]
    with ServerProcess(tiny_model_dirs["llama"], tmp_path) as a:
        first = chat(a, msgs)
    reply_ids, reply_text = local_reply(llama_model, msgs)
    assert first.choices[0].message.content == reply_text
    turn2 = msgs + [{"role": "assistant", "content": reply_text}, {"role": "user", "content": "Shorter, please."}]
    with ServerProcess(tiny_model_dirs["llama"], tmp_path) as b:  # a new process, same --cache-dir
        warm = chat(b, turn2, stream=True, stream_options={"include_usage": True})
        chunks = list(warm)
        cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
        assert b.health()["store"]["disk"]["hits"] == values_read(cached, SERVER_DEFAULTS.store_block_tokens) > 0
    assert cached == expected_cached(llama_model, msgs, reply_ids, turn2)
    warm_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with ServerProcess(tiny_model_dirs["llama"], None, "--cache-bytes", "0", "--disk-cache-bytes", "0") as cold:
        cold_reply = chat(cold, turn2)
    assert cold_reply.usage.prompt_tokens_details.cached_tokens == 0
    assert warm_text == cold_reply.choices[0].message.content  # identical with and without the store


def test_a_running_server_finds_entries_a_command_adds(tiny_model_dirs, llama_model, tmp_path):
    """``mlxcc generate --cache-dir`` writes an entry into a running server's folder;
    the server's next request with that prompt is served from it, without a restart."""
    import subprocess
    import sys

    msgs = [{"role": "user", "content": "Name three rivers of Europe, please."}]
    other = [{"role": "user", "content": "Something else entirely."}]
    _, tokenizer = llama_model
    own = common_prefix_len(render_chat(tokenizer, other), render_chat(tokenizer, msgs))  # the template's start
    with ServerProcess(tiny_model_dirs["llama"], tmp_path, "--cache-bytes", "0") as s:
        chat(s, other)  # the server has looked at its folder and stored an entry of its own
        assert s.health()["store"]["disk"]["hits"] == 0
        cmd = [sys.executable, "-m", "mlx_chatcache", "generate", "--model", str(tiny_model_dirs["llama"]),
               "-p", msgs[0]["content"], "-m", "4", "--cache-dir", str(tmp_path)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, env=s.env, timeout=120)
        time.sleep(1.2)  # the server looks again at most once per second
        reply = chat(s, msgs)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert cached > own  # more than its own entry serves
        assert s.health()["store"]["disk"]["hits"] == values_read(cached, SERVER_DEFAULTS.store_block_tokens)


@pytest.mark.blas  # streamed and whole replies compared
def test_completions_stream_and_non_stream(server):
    c = client(server)
    full = c.completions.create(model=server.model_id, prompt="The train leaves the station", max_tokens=8, temperature=0)
    assert full.object == "text_completion" and full.usage.completion_tokens == 8
    parts = list(c.completions.create(model=server.model_id, prompt="The train leaves the station", max_tokens=8,
                                      temperature=0, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(p.choices[0].text for p in parts if p.choices) == full.choices[0].text
    assert parts[-1].usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1


@pytest.mark.blas  # a cut reply compared with the whole one
def test_stop_strings_cut_the_reply(server):
    messages = [{"role": "user", "content": "Write a list: apples, oranges, pears."}]
    text = chat(server, messages, max_tokens=20).choices[0].message.content
    stop = text[6:9]
    assert stop and stop in text
    cut = chat(server, messages, max_tokens=20, stop=[stop, "zzzz-never"])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = chat(server, messages, max_tokens=20, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]


@pytest.mark.blas  # two seeded replies compared
def test_seeded_sampling_is_reproducible(server):
    messages = [{"role": "user", "content": "Tell me about the weather."}]
    kw = dict(max_tokens=10, seed=7, top_p=0.9)
    a = client(server).chat.completions.create(model=server.model_id, messages=messages, temperature=1.0, **kw)
    b = client(server).chat.completions.create(model=server.model_id, messages=messages, temperature=1.0, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content  # the second one was a store hit


def test_client_disconnect_stops_generation(server):
    before = server.health()["cancelled"]
    stream = chat(server, [{"role": "user", "content": "Count to a thousand."}], max_tokens=400, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        h = server.health()
        if h["cancelled"] > before and not h["busy"]:
            break
        time.sleep(0.1)
    assert h["cancelled"] > before and not h["busy"]
    assert chat(server, FIRST, max_tokens=2).usage.completion_tokens == 2  # still serving


@pytest.mark.blas  # replies compared with the library's
def test_concurrent_requests_are_queued_and_all_answered(server, llama_model):
    prompts = [[{"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}] for i in range(4)]
    results, errors = {}, []

    def ask(i):
        try:
            results[i] = chat(server, prompts[i]).choices[0].message.content
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 4
    for i, messages in enumerate(prompts):
        assert results[i] == local_reply(llama_model, messages)[1]


def test_pinned_conversation_survives_eviction(tiny_model_dirs, tmp_path):
    # memory tier only: room for the two pinned conversations and a few short others
    budget = 600_000
    with ServerProcess(tiny_model_dirs["llama"], None, "--cache-bytes", str(budget), "--disk-cache-bytes", "0") as s:
        convs = {"key": ({"prompt_cache_key": "conv-a"}, {}), "header": ({}, {"X-Session-Id": "conv-b"}),
                 "none": ({}, {})}  # fmt: skip
        firsts = {}
        for name, (kw, header) in convs.items():
            msgs = [{"role": "user", "content": f"Hi, {name} here."}]
            firsts[name] = (msgs, chat(s, msgs, extra_headers=header, **kw))
        for i in range(8):  # unpinned traffic, each entry larger than the unpinned conversation's
            chat(s, [{"role": "user", "content": f"Unrelated question {i}: why is bread baked in the evening?"}])
            assert s.health()["store"]["memory"]["bytes"] <= budget
        for name, (kw, header) in convs.items():
            msgs, first = firsts[name]
            turn2 = msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                            {"role": "user", "content": "And again?"}]  # fmt: skip
            cached = chat(s, turn2, extra_headers=header, **kw).usage.prompt_tokens_details.cached_tokens
            if name == "none":
                assert cached < first.usage.prompt_tokens  # evicted: the template's first tokens at most
            else:
                assert cached >= first.usage.prompt_tokens, name


def _raw(server, path, body: bytes | None, method="POST"):
    req = urllib.request.Request(server.root + path, data=body, method=method,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"model": 5, "messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
    (b'{"model": "", "messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
    (b'{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
    (b'{"model": "llama", "messages": "hi"}', 400, "messages"),
    (b'{"model": "llama", "messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
    (b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}', 400, "max_tokens"),
    (b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "temperature": true}', 400, "temperature"),
    (b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "n": "2"}', 400, "n"),
    (b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "stop": [1]}', 400, "stop"),
    (b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', 400, "stream"),
    (b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}', 400, "max_tokens"),
    (b'{"model": "llama", "prompt": ""}', 400, "prompt"),
    (b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "seed": -1}', 400, "seed"),
    (b'{"model": "llama", "prompt": "hi", "seed": 18446744073709551616}', 400, "seed"),
    (b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
    (b'{"model": "llama", "prompt": "hi", "top_p": -0.5}', 400, "top_p"),
])  # fmt: skip
def test_malformed_requests_get_openai_errors(server, body, status, param):
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    code, text = _raw(server, path, body.replace(b'"llama"', json.dumps(server.model_id).encode()))
    assert code == status, text
    err = json.loads(text)["error"]
    assert err["param"] == param and err["message"] and "Traceback" not in text
    assert err["type"] == "invalid_request_error"


def test_out_of_range_seed_is_a_400_naming_the_range(server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, FIRST, seed=-1, max_tokens=2)
    body = e.value.body
    assert body["param"] == "seed" and "between 0 and 18446744073709551615" in body["message"], body
    assert chat(server, FIRST, seed=2**64 - 1, max_tokens=2).choices[0].message.content is not None


def test_prompt_over_the_context_is_a_400(server):
    long = " ".join(["apples and oranges"] * 400)  # > 512 tokens
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, [{"role": "user", "content": long}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=FIRST)
    code, text = _raw(server, "/v1/nothing-here", None, method="GET")
    assert code == 404 and json.loads(text)["error"]["message"]


# ------------------------------------------------------------------ every field of the dialect
CHAT_HI = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
CALL = {"type": "function", "id": "c1", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def _chat_with(**fields) -> bytes:
    return json.dumps({**CHAT_HI, **fields}).encode()


def _history(call: dict, **assistant) -> list[dict]:
    return [{"role": "user", "content": "what is 2+3?"},
            {"role": "assistant", "content": None, "tool_calls": [call], **assistant},
            {"role": "tool", "content": "5", "tool_call_id": "c1"}]  # fmt: skip


@pytest.mark.parametrize("body,param", [
    (_chat_with(presence_penalty=3), "presence_penalty"),
    (_chat_with(presence_penalty="abc"), "presence_penalty"),
    (_chat_with(frequency_penalty=-2.5), "frequency_penalty"),
    (_chat_with(logit_bias={"x": 1}), "logit_bias"),
    (_chat_with(logit_bias={"5": 101}), "logit_bias"),
    (_chat_with(logit_bias=[5]), "logit_bias"),
    (_chat_with(logit_bias={"999999": 1}), "logit_bias"),  # past the vocabulary
    (_chat_with(logprobs=True, top_logprobs=21), "top_logprobs"),
    (_chat_with(top_logprobs=2), "top_logprobs"),  # without logprobs
    (_chat_with(logprobs=3), "logprobs"),
    (json.dumps({"model": "llama", "prompt": "hi", "logprobs": 6}).encode(), "logprobs"),
    (_chat_with(n=0), "n"),
    (_chat_with(n=9), "n"),
    (_chat_with(top_k=-1), "top_k"),
    (_chat_with(top_k=1.5), "top_k"),
    (_chat_with(min_p=1.5), "min_p"),
    (_chat_with(repetition_penalty=-1), "repetition_penalty"),
    (_chat_with(repetition_context_size=0), "repetition_context_size"),
    (_chat_with(tools="add"), "tools"),
    (_chat_with(tools=[{"type": "function"}]), "tools[0].function"),
    (_chat_with(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
    (_chat_with(tools=[ADD], tool_choice="sometimes"), "tool_choice"),
    (_chat_with(tool_choice="required"), "tool_choice"),
    (_chat_with(tools=[ADD], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
    (_chat_with(response_format={"type": "xml"}), "response_format.type"),
    (_chat_with(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (_chat_with(response_format="json"), "response_format"),
    (_chat_with(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (_chat_with(messages=[{"role": "user", "content": None}]), "messages[0].content"),
    (_chat_with(messages=_history({**CALL, "function": {"name": "add", "arguments": "{"}})),
     "messages[1].tool_calls[0].function.arguments"),
    (_chat_with(messages=_history({**CALL, "function": {"name": "add", "arguments": "[1]"}})),
     "messages[1].tool_calls[0].function.arguments"),
    (_chat_with(messages=_history({**CALL, "type": "code"})), "messages[1].tool_calls[0].type"),
    (_chat_with(messages=_history(CALL)[:2] + [{"role": "tool", "content": "5", "tool_call_id": 7}]),
     "messages[2].tool_call_id"),
])  # fmt: skip
def test_every_field_is_checked_and_a_bad_value_named(server, body, param):
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    code, text = _raw(server, path, body.replace(b'"llama"', json.dumps(server.model_id).encode()))
    err = json.loads(text)["error"]
    assert code == 400 and err["param"] == param and err["code"] != "unsupported_parameter", text
    assert "\n" not in err["message"]


def test_tools_for_a_model_without_a_tool_format_are_refused_by_name(server):
    code, text = _raw(server, "/v1/chat/completions", _chat_with(model=server.model_id, tools=[ADD]))
    err = json.loads(text)["error"]
    assert code == 400 and err["param"] == "tools" and "tool-call format" in err["message"], text


def test_response_format_constrains_the_reply(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    code, text = _raw(server, "/v1/chat/completions", _chat_with(model=server.model_id, response_format=fmt))
    choice = json.loads(text)["choices"][0]
    assert code == 200 and choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"])["ok"], bool)


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"5": 10}), ("logprobs", True), ("n", 2),
])  # fmt: skip
def test_the_sampling_fields_are_honoured_not_refused(server, field, value):
    """Each is a 200 whose reply shows it where it shows (tests/test_server_sampling.py checks the values)."""
    code, text = _raw(server, "/v1/chat/completions", _chat_with(model=server.model_id, max_tokens=3, **{field: value}))
    assert code == 200, text
    choices = json.loads(text)["choices"]
    assert len(choices) == (value if field == "n" else 1)
    assert (choices[0]["logprobs"] is not None) == (field == "logprobs")


@pytest.mark.blas  # replies with and without the fields compared
def test_fields_honoured_as_given(server):
    """``response_format`` text, tools with ``tool_choice`` "none" and ``repetition_penalty``
    0 (none, as in mlx-lm) change nothing."""
    plain = json.loads(_raw(server, "/v1/chat/completions", _chat_with(model=server.model_id, max_tokens=4,
                                                                        temperature=0))[1])  # fmt: skip
    for extra in ({"response_format": {"type": "text"}}, {"tools": [ADD], "tool_choice": "none"},
                  {"repetition_penalty": 0}):  # fmt: skip
        code, text = _raw(server, "/v1/chat/completions", _chat_with(model=server.model_id, max_tokens=4,
                                                                     temperature=0, **extra))  # fmt: skip
        assert code == 200 and json.loads(text)["choices"] == plain["choices"], text


@pytest.mark.blas  # replies compared with the library's
def test_top_k_min_p_and_repetition_penalty_reach_the_sampler(server, llama_model):
    """top_k 1 and min_p 1 leave only the most likely token (a hot, seeded request turns
    greedy); a repetition penalty changes the greedy reply as the library's does."""
    messages = [{"role": "user", "content": "Count to a thousand."}]
    greedy = local_reply(llama_model, messages, 24)[1]
    hot = {"model": server.model_id, "messages": messages, "temperature": 2.0, "seed": 7, "max_tokens": 24}
    assert client(server).chat.completions.create(**hot).choices[0].message.content != greedy  # the test can fail
    for keep_one in ({"top_k": 1}, {"min_p": 1.0}):
        reply = client(server).chat.completions.create(extra_body=keep_one, **hot)
        assert reply.choices[0].message.content == greedy, keep_one
    model, tokenizer = llama_model
    penalty = {"repetition_penalty": 1.5, "repetition_context_size": 8}
    want = "".join(r.text for r in stream_generate(model, tokenizer, render_chat(tokenizer, messages),
                                                   config=_config(24).updated(**penalty)))  # fmt: skip
    assert want != greedy
    got = chat(server, messages, max_tokens=24, extra_body=penalty).choices[0].message.content
    assert got == want


def test_a_tool_call_history_reaches_the_chat_template(server, llama_model):
    """An assistant message of tool calls (content null, arguments as text or as an
    object) and a tool result render as mlx-lm's server renders them."""
    from mlx_chatcache.server.protocol import parse_chat

    _, tokenizer = llama_model
    for call in (CALL, {**CALL, "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}):
        messages = _history(call)
        parsed = parse_chat({"messages": messages}).messages
        assert parsed[1] == {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
        assert parsed[2] == {"role": "tool", "content": "5", "tool_call_id": "c1"}
        reply = chat(server, messages, max_tokens=2)
        assert reply.usage.prompt_tokens == len(render_chat(tokenizer, parsed))
    assert parse_chat({"messages": [{"role": "developer", "content": "x"}]}).messages == [
        {"role": "system", "content": "x"}]


# ------------------------------------------------------------------ names, disconnects, a full queue
def _send(server, path: str, body: dict) -> socket.socket:
    """A raw HTTP request left open: the caller reads or closes its socket."""
    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)  # fmt: skip
    return s


def _wait_idle(server, cancelled_before: int, seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        h = server.health()
        if h["cancelled"] > cancelled_before and not h["busy"] and h["queued"] == 0:
            break
        time.sleep(0.1)
    return h


LONG = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 9000}


@pytest.fixture(scope="module")
def named_server(tiny_model_dirs, tmp_path_factory):
    # --max-batch 1: one request generating fills the worker, so the next one waits in the queue
    with ServerProcess(tiny_model_dirs["llama"], None, "--disk-cache-bytes", "0", "--max-queue", "1",
                       "--max-batch", "1", "--context-length", "10000", "--served-model-name", "gpt-4o-mini",
                       "--served-model-name", "local") as s:  # fmt: skip
        yield s


def test_default_model_an_omitted_model_and_served_names_mean_the_model(named_server):
    s = named_server
    assert [m.id for m in client(s).models.list().data] == [s.model_id, "gpt-4o-mini", "local"]
    for name in (s.model_id, "default_model", "gpt-4o-mini", "local", None):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **({"model": name} if name else {})}
        code, text = _raw(s, "/v1/chat/completions", json.dumps(body).encode())
        assert code == 200 and json.loads(text)["model"] == s.model_id, (name, text)
    code, text = _raw(s, "/v1/completions", json.dumps({"model": "gpt-4", "prompt": "hi"}).encode())
    assert code == 404 and json.loads(text)["error"]["param"] == "model"


def test_a_non_streamed_request_is_cancelled_when_its_client_goes(named_server):
    before = named_server.health()["cancelled"]
    sock = _send(named_server, "/v1/chat/completions", LONG)  # ~20 s of generation
    time.sleep(1.0)
    assert named_server.health()["busy"]
    sock.close()
    h = _wait_idle(named_server, before, 5)
    assert h["cancelled"] > before and not h["busy"], h


def test_a_full_queue_is_a_503_with_retry_after(named_server):
    before = named_server.health()["cancelled"]
    busy = [_send(named_server, "/v1/chat/completions", LONG)]  # generating
    time.sleep(0.5)
    busy.append(_send(named_server, "/v1/completions", {"prompt": "hi", "max_tokens": 9000}))  # queued
    time.sleep(0.5)
    try:
        req = urllib.request.Request(named_server.base_url + "/completions", method="POST",
                                     data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 503 and int(e.value.headers["Retry-After"]) >= 1
        assert json.loads(e.value.read())["error"]["code"] == "server_busy"
    finally:
        for sock in busy:
            sock.close()
    h = _wait_idle(named_server, before + 1, 10)
    assert h["cancelled"] >= before + 2 and not h["busy"], h
