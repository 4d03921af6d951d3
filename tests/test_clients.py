"""OpenAI clients against a real ``mlxcc serve`` (tests/server_process.py) on tiny models
with tool templates: a two-turn conversation with a tool call (turn 1 forced by
``tool_choice``, so deterministic even with random weights; a next turn with the tools
reuses turn 1's prompt), structured output, and the refusals. llm cannot send ``tool_choice``:
its two turns run in ``auto`` on a tiny model built to say them (tests/scripted_model.py).
langchain-openai, llm and litellm run when installed (``pip install -e '.[clients]'``)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from scripted_model import build_scripted_model
from server_process import ServerProcess
from tiny_models import build_tiny_model

import openai
import jsonschema

ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"]}}}  # fmt: skip
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
QUESTION = {"role": "user", "content": "What is 2 + 3? Use the add tool."}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("clients")
    folder = build_tiny_model("llama", root / "tools-json", tool_format="json_tools")
    with ServerProcess(folder, root / "cache", "--max-tokens", "200") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0)


def _forced(name="add"):
    return {"type": "function", "function": {"name": name}}


def test_openai_two_turns_with_a_tool_call(server, client):
    messages = [QUESTION]
    r = client.chat.completions.create(model=server.model_id, messages=messages, tools=[ADD],
                                       tool_choice=_forced(), temperature=1.0)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "add" and call.id
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]  # fmt: skip
    r2 = client.chat.completions.create(model=server.model_id, messages=messages, tools=[ADD], tool_choice="none",
                                        max_tokens=20)  # fmt: skip
    assert r2.choices[0].finish_reason in ("stop", "length") and isinstance(r2.choices[0].message.content, str)
    assert not r2.choices[0].message.tool_calls
    # tool_choice "none" leaves the tools out of the prompt; with them, the next turn starts with turn 1's
    # whole prompt, which the store serves exactly
    r3 = client.chat.completions.create(model=server.model_id, messages=messages, tools=[ADD], max_tokens=2)
    assert r3.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens > 0


def test_a_forced_call_streams_as_delta_tool_calls(server, client):
    stream = client.chat.completions.create(model=server.model_id, messages=[QUESTION], tools=[ADD],
                                            tool_choice="required", stream=True, seed=3, temperature=1.0)  # fmt: skip
    calls, content, finish = [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "" and "<tool_call>" not in content
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "add"
    jsonschema.validate(json.loads(calls[0].function.arguments), ADD["function"]["parameters"])


def test_the_same_forced_call_streamed_and_not(server, client):
    args = dict(model=server.model_id, messages=[QUESTION], tools=[ADD], tool_choice=_forced(), seed=7,
                temperature=1.0)  # fmt: skip
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls[0].function
    streamed = [c for ch in client.chat.completions.create(stream=True, **args) for c in ch.choices[0].delta.tool_calls or []]
    assert (streamed[0].function.name, json.loads(streamed[0].function.arguments)) == (whole.name, json.loads(whole.arguments))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_response_format_validates(server, client, seed):
    r = client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "A person?"}],
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": PERSON, "strict": True}},
                                       seed=seed, temperature=1.0)  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_response_format_is_an_object_when_it_ends(server, client):
    r = client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "JSON?"}],
                                       response_format={"type": "json_object"}, temperature=0.0)  # fmt: skip
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_without_constraints_the_random_model_writes_prose(server, client):
    r = client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "A person?"}],
                                       max_tokens=30)  # fmt: skip
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


def test_refusals_name_the_field(server, client):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, messages=[QUESTION], response_format=bad_schema)
    assert e.value.body["param"] == "response_format.json_schema.schema" and "strin" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, messages=[QUESTION], tools=[ADD], tool_choice=_forced(),
                                       response_format={"type": "json_object"})  # fmt: skip
    assert e.value.body["param"] == "response_format"


def test_another_format_forces_calls_and_refuses_what_it_cannot_write(tmp_path):
    folder = build_tiny_model("llama", tmp_path / "minimax", tool_format="minimax_m2")
    only_null = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "enum": ["null"]}}, "required": ["s"]}}}  # fmt: skip
    with ServerProcess(folder, None) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="-", max_retries=0)
        r = c.chat.completions.create(model=s.model_id, messages=[QUESTION], tools=[ADD], tool_choice="required",
                                      temperature=1.0, seed=5)  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
        with pytest.raises(openai.BadRequestError) as e:  # minimax_m2 reads the text null as None
            c.chat.completions.create(model=s.model_id, messages=[QUESTION], tools=[only_null], tool_choice="required")
        assert e.value.body["param"] == "tool_choice" and "null" in e.value.body["message"]
        r = c.chat.completions.create(model=s.model_id, messages=[QUESTION], tools=[ADD], max_tokens=10)
        assert r.choices[0].finish_reason in ("stop", "length")


def test_langchain_openai_bind_tools_two_turns(server):
    import langchain_openai as lc
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = lc.ChatOpenAI(base_url=server.base_url, api_key="-", model=server.model_id, temperature=1.0,
                        max_retries=0)  # fmt: skip
    bound = llm.bind_tools([ADD], tool_choice="add")
    history = [HumanMessage(QUESTION["content"])]
    ai = bound.invoke(history)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "add"
    jsonschema.validate(ai.tool_calls[0]["args"], ADD["function"]["parameters"])
    history += [ai, ToolMessage("5", tool_call_id=ai.tool_calls[0]["id"])]
    answer = llm.bind_tools([ADD], tool_choice="none").invoke(history, max_tokens=20)
    assert isinstance(answer.content, str) and not answer.tool_calls
    assert answer.usage_metadata["input_token_details"].get("cache_read", 0) > 0


def test_langchain_openai_with_structured_output(server):
    import langchain_openai as lc
    llm = lc.ChatOpenAI(base_url=server.base_url, api_key="-", model=server.model_id, temperature=1.0, max_retries=0)
    person = llm.with_structured_output({"title": "person", **PERSON}, method="json_schema", strict=True)
    out = person.invoke("Invent a person.")
    jsonschema.validate(out, PERSON)


def _llm_model(tmp_path, monkeypatch, server):
    monkeypatch.setenv("LLM_LOAD_PLUGINS", "")  # only llm's own OpenAI models, no installed plugins
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    import llm
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: tiny\n  model_name: {server.model_id}\n  api_base: {server.base_url}\n"
        "  supports_tools: true\n  supports_schema: true\n")  # fmt: skip
    model = llm.get_model("tiny")
    model.key = "-"
    return model


def test_llm_schema_and_tools(server, tmp_path, monkeypatch):
    """llm sends tools but no tool_choice: on the random model its turn is checked to run
    with the tools (the two turns with a call: the scripted model below). Its schema prompt validates."""
    model = _llm_model(tmp_path, monkeypatch, server)
    person = model.prompt("Invent a person.", schema=PERSON, temperature=1.0)
    jsonschema.validate(json.loads(person.text()), PERSON)

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    chain = model.chain(QUESTION["content"], tools=[add], options={"max_tokens": 20})
    assert isinstance(chain.text(), str)


CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ANSWER = "2 + 3 = 5."


def test_llm_two_turns_with_a_tool_call(tmp_path, monkeypatch):
    """A model built to call add and then, once its context holds the call, to answer:
    llm's own tool chain runs both turns in ``auto``; the reply is parsed by the model's
    mlx-lm parser, and turn 2 reuses turn 1's cache."""
    if importlib.util.find_spec("llm") is None:  # imported later, once its plugins are switched off
        pytest.skip("llm is not installed")
    folder = build_scripted_model(tmp_path / "scripted", CALL_TEXT, ANSWER, "</tool_call>")
    with ServerProcess(folder, tmp_path / "cache", "--max-tokens", "60") as server:
        model = _llm_model(tmp_path, monkeypatch, server)
        seen = []

        def add(a: int, b: int) -> int:
            """Add two numbers."""
            seen.append((a, b))
            return a + b

        first, second = model.chain(QUESTION["content"], tools=[add], options={"temperature": 0}).responses()
        assert second.text().strip() == ANSWER
        assert seen == [(2, 3)] and [c.name for c in first.tool_calls()] == ["add"]
        assert first.response_json["finish_reason"] == "tool_calls"
        assert second.response_json["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # turn 1 reused


def test_litellm_two_turns_with_a_tool_call(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download when it is imported
    import litellm
    where = dict(model=f"openai/{server.model_id}", api_base=server.base_url, api_key="-")
    r = litellm.completion(**where, messages=[QUESTION], tools=[ADD], tool_choice=_forced(), temperature=1.0)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "add"
    call = r.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    messages = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"}]  # fmt: skip
    r2 = litellm.completion(**where, messages=messages, tools=[ADD], tool_choice="none", max_tokens=20)
    assert isinstance(r2.choices[0].message.content, str) and not r2.choices[0].message.tool_calls
    assert r2.usage.prompt_tokens_details.cached_tokens > 0  # turn 1 is reused
