"""Anthropic's Messages API and OpenAI's Responses API on a real ``mlxcc serve`` (tiny random llama with
a tool-call template), through the ``anthropic`` and ``openai`` SDKs and plain HTTP.

What must hold: usage adds up as each dialect defines it (Anthropic: cache read + cache creation +
input = the prompt's tokens, split at the last ``cache_control`` breakpoint; OpenAI: cached tokens
are the store's), the documented event sequences, tool calls parsed and forced by the same grammar,
stop sequences, errors in each dialect's shape, and stored responses: ``previous_response_id``
continues a conversation with its cache (only the new input computed, up to one block), ``GET`` and
``DELETE``, 404s, a restart (the disk tier's folder) and a second replica (Redis).
"""

from __future__ import annotations

import json

import pytest
import requests

from redis_server import RedisServer
from server_process import ServerProcess
from tiny_models import build_tiny_model

import anthropic
import openai
import jsonschema

BLOCK = 64
ADD = {"name": "add", "description": "Add two numbers.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}  # fmt: skip
FN_ADD = {"type": "function", "name": "add", "description": ADD["description"], "parameters": ADD["input_schema"]}
SYSTEM = "You are a careful assistant. " * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("agents-api") / "tools", tool_format="json_tools")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with ServerProcess(model_dir, tmp_path_factory.mktemp("cache"), "--max-tokens", "24") as s:
        yield s


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.root, api_key="local", max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base_url, api_key="local", max_retries=0)


def _count(claude, server, **body) -> int:
    return claude.messages.count_tokens(model=server.model_id, **body).input_tokens


def _adds_up(usage, prompt: int) -> None:
    assert usage.cache_read_input_tokens + usage.cache_creation_input_tokens + usage.input_tokens == prompt, usage


# ------------------------------------------------------------------ Messages
def test_messages_usage_splits_at_the_last_breakpoint(server, claude):
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    turn = [{"role": "user", "content": "Good morning! How are you today?"}]
    prompt = _count(claude, server, system=system, messages=turn)
    head = _count(claude, server, system=SYSTEM, messages=[{"role": "user", "content": "x"}])
    m = claude.messages.create(model=server.model_id, max_tokens=5, system=system, messages=turn)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5 and m.content[0].type == "text"
    _adds_up(m.usage, prompt)
    # written for reuse: the system prompt (its tokens are those of the one-word conversation's, less that turn)
    assert m.usage.cache_read_input_tokens == 0 and 0 < m.usage.cache_creation_input_tokens < head
    assert requests.get(server.base_url + "/store").json()["pinned_keys"] >= 1  # the breakpoint pins
    # another conversation with the same marked system prompt reads it from the store, exactly
    other = [{"role": "user", "content": "What is the capital of Italy?"}]
    m2 = claude.messages.create(model=server.model_id, max_tokens=3, system=system, messages=other)
    _adds_up(m2.usage, _count(claude, server, system=system, messages=other))
    assert m2.usage.cache_read_input_tokens >= m.usage.cache_creation_input_tokens
    assert m2.usage.cache_creation_input_tokens == 0
    # the next turn of the first conversation: its whole prompt was kept
    turn2 = turn + [{"role": "assistant", "content": m.content[0].text},
                    {"role": "user", "content": [{"type": "text", "text": "Thanks.", "cache_control": {"type": "ephemeral"}}]}]  # fmt: skip
    m3 = claude.messages.create(model=server.model_id, max_tokens=3, system=system, messages=turn2)
    prompt3 = _count(claude, server, system=system, messages=turn2)
    _adds_up(m3.usage, prompt3)
    assert m3.usage.cache_read_input_tokens >= prompt - 1 and m3.usage.cache_creation_input_tokens > 0
    assert m3.usage.input_tokens <= 10  # after the breakpoint: the generation prompt alone


def test_messages_stream_events_as_documented(server, claude):
    body = dict(model=server.model_id, max_tokens=6,
                messages=[{"role": "user", "content": "Write a list: apples, oranges"}])  # fmt: skip
    with claude.messages.stream(**body) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    plain = claude.messages.create(**body)
    assert final.content[0].text == plain.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 6
    raw = requests.post(server.root + "/v1/messages?beta=true", json={**body, "stream": True}).text
    events = [block.split("\n")[0].removeprefix("event: ") for block in raw.strip().split("\n\n")]
    assert events[:3] == ["message_start", "ping", "content_block_start"], events
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"], events


def test_messages_forced_tool_call_and_its_result(server, claude):
    question = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    m = claude.messages.create(model=server.model_id, max_tokens=60, tools=[ADD], messages=question,
                               tool_choice={"type": "tool", "name": "add"}, extra_body={"temperature": 1.0})  # fmt: skip
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "add" and use[0].id.startswith("toolu_")
    jsonschema.validate(use[0].input, ADD["input_schema"])
    with claude.messages.stream(model=server.model_id, max_tokens=60, tools=[ADD], messages=question,
                                tool_choice={"type": "any"}, extra_body={"temperature": 1.0}) as stream:  # fmt: skip
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas and final.stop_reason == "tool_use"
    jsonschema.validate(final.content[-1].input, ADD["input_schema"])
    follow = question + [{"role": "assistant", "content": m.content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "5"}]}]  # fmt: skip
    m2 = claude.messages.create(model=server.model_id, max_tokens=4, tools=[ADD], messages=follow)
    assert m2.usage.cache_read_input_tokens >= m.usage.input_tokens + m.usage.cache_read_input_tokens - 1
    _adds_up(m2.usage, _count(claude, server, tools=[ADD], messages=follow))


def test_messages_stop_sequence(server, claude):
    body = dict(model=server.model_id, max_tokens=12,
                messages=[{"role": "user", "content": "The train leaves the station"}])  # fmt: skip
    text = claude.messages.create(**body).content[0].text
    stop = text[4:6]
    m = claude.messages.create(**body, stop_sequences=["zzzz-never", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


def test_messages_ignores_unknown_fields_and_refuses_images(server, claude):
    extra = {"thinking": {"type": "adaptive"}, "context_management": {"edits": []}, "output_config": {"effort": "high"},
             "metadata": {"user_id": "u1"}, "some_future_field": [1, 2]}  # fmt: skip
    m = claude.messages.create(model=server.model_id, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               extra_body=extra)  # fmt: skip
    assert m.usage.output_tokens == 2
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=server.model_id, max_tokens=2, messages=[{"role": "user", "content": [image]}])
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "text only" in body["error"]["message"] and "messages[0].content[0]" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-nope", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    r = requests.post(server.root + "/v1/messages", data=b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_probes_and_counts(server):
    assert requests.head(server.root + "/").status_code == 200
    assert requests.get(server.root + "/").status_code == 200
    counts = server.health()["requests"]
    assert counts["messages"] >= 1 and requests.get(server.base_url + "/store").json()["requests"] == counts


# ------------------------------------------------------------------ Responses
def test_responses_previous_response_id_computes_only_the_new_input(server, oai):
    r1 = oai.responses.create(model=server.model_id, instructions=SYSTEM, input="Good morning!", max_output_tokens=8,
                              temperature=0)  # fmt: skip
    assert r1.id.startswith("resp_") and r1.output[0].id.startswith("msg_") and r1.output[0].type == "message"
    assert r1.status == "incomplete" and r1.incomplete_details.reason == "max_output_tokens"
    assert r1.usage.output_tokens == 8
    r2 = oai.responses.create(model=server.model_id, instructions=SYSTEM, input="And you?", max_output_tokens=4,
                              previous_response_id=r1.id)  # fmt: skip
    new = r2.usage.input_tokens - r1.usage.input_tokens  # the reply and the new input, as rendered
    computed = r2.usage.input_tokens - r2.usage.input_tokens_details.cached_tokens
    assert 0 < computed <= new + BLOCK, (r1.usage, r2.usage)
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens - 1
    got = oai.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == r2.output_text and got.previous_response_id == r1.id


def test_responses_stream_events_as_documented(server, oai):
    events = list(oai.responses.create(model=server.model_id, input="Hello", max_output_tokens=5, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"], kinds  # fmt: skip
    assert kinds[-5:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"][-5:] or kinds[-4:] == ["response.output_text.done",
                          "response.content_part.done", "response.output_item.done", "response.incomplete"], kinds  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == 5


def test_responses_forced_function_call(server, oai):
    r = oai.responses.create(model=server.model_id, input="What is 2 + 3?", tools=[FN_ADD], temperature=1.0,
                             tool_choice={"type": "function", "name": "add"}, max_output_tokens=60)  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "add"
    assert calls[0].id.startswith("fc_") and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), FN_ADD["parameters"])
    r2 = oai.responses.create(model=server.model_id, previous_response_id=r.id, tools=[FN_ADD],
                              input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}],
                              max_output_tokens=3)  # fmt: skip
    assert r2.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 1
    streamed = list(oai.responses.create(model=server.model_id, input="2 + 3?", tools=[FN_ADD], tool_choice="required",
                                         max_output_tokens=60, stream=True, temperature=1.0))  # fmt: skip
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds[-1] == "response.completed"


def test_responses_json_schema_and_refusals(server, oai):
    person = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["age"], "additionalProperties": False}  # fmt: skip
    r = oai.responses.create(model=server.model_id, input="Invent a person.", max_output_tokens=40, temperature=1.0,
                             text={"format": {"type": "json_schema", "name": "p", "schema": person}})  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), person)
    bad = requests.post(server.base_url + "/responses", json={"input": "x", "text": {"format": {"type": "json_schema",
                                                                                             "name": "p"}}})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format.schema"
    missing = requests.post(server.base_url + "/responses", json={"input": "x", "previous_response_id": "resp_" + "0" * 32})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "previous_response_not_found"
    image = requests.post(server.base_url + "/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:,"}]}]})  # fmt: skip
    assert image.status_code == 400 and set(image.json()["error"]) == {"message", "type", "param", "code"}


def test_stored_responses_get_delete_and_store_false(server, oai):
    r = oai.responses.create(model=server.model_id, input="Keep me", max_output_tokens=2)
    assert oai.responses.retrieve(r.id).id == r.id
    oai.responses.delete(r.id)
    for call in (lambda: oai.responses.retrieve(r.id), lambda: oai.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["message"] == f"Response with id '{r.id}' not found."
    unstored = oai.responses.create(model=server.model_id, input="Forget me", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    assert requests.get(server.base_url + "/responses/not-an-id").status_code == 404
    assert server.health()["stored_responses"]["deleted"] >= 1


def test_stored_responses_survive_a_restart_and_reach_replicas(model_dir, tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    try:
        flags = ("--max-tokens", "4", "--cache-redis", redis.url)
        with ServerProcess(model_dir, tmp_path / "a", *flags) as a:
            first = openai.OpenAI(base_url=a.base_url, api_key="-").responses.create(
                model=a.model_id, instructions=SYSTEM, input="Good morning!", max_output_tokens=6)  # fmt: skip
        with ServerProcess(model_dir, tmp_path / "a", *flags) as again:  # the same disk folder
            client = openai.OpenAI(base_url=again.base_url, api_key="-")
            assert client.responses.retrieve(first.id).output_text == first.output_text
            more = client.responses.create(model=again.model_id, instructions=SYSTEM, input="And you?",
                                           previous_response_id=first.id, max_output_tokens=2)  # fmt: skip
            assert more.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1  # from the disk
        with ServerProcess(model_dir, tmp_path / "b", *flags) as b:  # another replica: only Redis is shared
            client = openai.OpenAI(base_url=b.base_url, api_key="-")
            assert client.responses.retrieve(more.id).previous_response_id == first.id
            third = client.responses.create(model=b.model_id, instructions=SYSTEM, input="Bye.",
                                            previous_response_id=more.id, max_output_tokens=2)  # fmt: skip
            assert third.usage.input_tokens_details.cached_tokens >= more.usage.input_tokens - 1  # from Redis
            client.responses.delete(first.id)
        with ServerProcess(model_dir, tmp_path / "a", *flags) as a2:
            with pytest.raises(openai.NotFoundError):
                openai.OpenAI(base_url=a2.base_url, api_key="-").responses.retrieve(first.id)
    finally:
        redis.stop()


def test_store_page_counts_the_agents_requests(server, claude, oai):
    from webdriver import Browser

    claude.messages.create(model=server.model_id, max_tokens=1, messages=[{"role": "user", "content": "page"}])
    oai.responses.create(model=server.model_id, input="page", max_output_tokens=1)
    with Browser() as browser:
        browser.get(server.root + "/store?every=1")
        browser.wait_for("return Number(document.body.dataset.polls || 0) >= 1", timeout=10, what="a first poll")
        rows = browser.execute("return [...document.querySelectorAll('#requests tbody tr')].map("
                               "r => [r.dataset.endpoint, r.children[1].textContent])")  # fmt: skip
    counts = server.health()["requests"]
    shown = dict(rows)
    assert set(shown) == {"chat", "completion", "messages", "responses"}
    assert int(shown["messages"]) == counts["messages"] > 0 and int(shown["responses"]) == counts["responses"] > 0
