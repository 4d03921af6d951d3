"""Hostile requests against the agents' endpoints: ``/v1/messages`` (with ``count_tokens``) and
``/v1/responses`` (with ``GET``/``DELETE /v1/responses/{id}``).

Generated bodies (the strategies of tests/test_hostile_server.py: wrong types, out-of-range
numbers, lone surrogates, NULs, long strings, missing and extra fields; and each dialect's own
shapes: content blocks, tool_use / tool_result, input items, tools, tool_choice, text.format,
cache_control) run in-process, through the Starlette app on a real service and worker (tiny
llama with a tool-call template), hundreds of them; a few dozen of them, and bodies that are
not JSON, then go to a real ``mlxcc serve`` process. What holds:

- never a 5xx, the process stays alive and logs no traceback;
- every 4xx is in its dialect's shape with a one-line message (Anthropic's ``{"type": "error",
  "error": {"type", "message"}}``; OpenAI's ``{"error": {"message", "type", "param", "code"}}``);
- a 200 is a well-formed message or response (a stream ends with ``message_stop`` or
  ``response.completed`` / ``response.incomplete`` and carries no error event);
- a normal request is answered correctly afterwards.

Hypothesis runs derandomized with no example database, as in tests/test_hostile_server.py.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from server_process import ServerProcess
from test_hostile_server import FUZZ, JSON_ANY, NUMBERS, RAW, TEXT, Client
from tiny_models import build_tiny_model


MESSAGES, COUNT, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
CONTEXT = 512

# ------------------------------------------------------------------ strategies
CC = st.one_of(st.none(), st.just({"type": "ephemeral"}), st.just({"type": "ephemeral", "ttl": "1h"}), JSON_ANY)
TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}, optional={"cache_control": CC})
TOOL_USE = st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": st.sampled_from(["add", "x"]),
                                  "input": st.one_of(st.dictionaries(TEXT, JSON_ANY, max_size=2), JSON_ANY)})  # fmt: skip
TOOL_RESULT = st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT, "content": st.one_of(
    TEXT, st.lists(TEXT_BLOCK, max_size=2), JSON_ANY)}, optional={"is_error": st.one_of(st.booleans(), JSON_ANY)})  # fmt: skip
BLOCKS = st.lists(st.one_of(TEXT_BLOCK, TOOL_USE, TOOL_RESULT, st.fixed_dictionaries(
    {"type": st.sampled_from(["thinking", "image", "document", "redacted_thinking", "weird"])}), JSON_ANY), max_size=3)  # fmt: skip
TURN = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), TEXT),
                              "content": st.one_of(TEXT, BLOCKS)})  # fmt: skip
ANTHROPIC_TOOL = st.one_of(st.just({"name": "add", "description": "Add.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}), st.just({"type": "web_search_20250305", "name": "web"}),
    st.dictionaries(st.sampled_from(["name", "input_schema", "description", "cache_control", "type"]), JSON_ANY))  # fmt: skip
MESSAGES_FIELDS = {
    "model": st.one_of(st.just("<served>"), TEXT, JSON_ANY),
    "max_tokens": st.one_of(st.integers(1, 3), NUMBERS),
    "messages": st.one_of(st.lists(TURN, min_size=1, max_size=3), JSON_ANY),
    "system": st.one_of(TEXT, st.lists(TEXT_BLOCK, max_size=2), JSON_ANY),
    "tools": st.one_of(st.lists(ANTHROPIC_TOOL, max_size=2), JSON_ANY),
    "tool_choice": st.one_of(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                              {"type": "tool", "name": "add"}]), JSON_ANY),  # fmt: skip
    "stop_sequences": st.one_of(st.lists(TEXT, max_size=3), JSON_ANY),
    "temperature": st.one_of(st.floats(0, 1), NUMBERS), "top_p": NUMBERS, "top_k": NUMBERS,
    "stream": st.one_of(st.booleans(), JSON_ANY),
    "metadata": JSON_ANY, "thinking": JSON_ANY, "context_management": JSON_ANY, "output_config": JSON_ANY,
}
ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "developer"]), TEXT),
                           "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.sampled_from(
                               ["input_text", "output_text", "input_image", "refusal"]), "text": TEXT}), max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": TEXT, "name": st.sampled_from(["add", "y"]),
                           "arguments": st.one_of(st.just('{"a": 1}'), TEXT, JSON_ANY)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": st.one_of(TEXT, JSON_ANY)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "web_search_call"])}),
    JSON_ANY,
)  # fmt: skip
RESPONSES_FIELDS = {
    "model": st.one_of(st.just("<served>"), TEXT, JSON_ANY),
    "max_output_tokens": st.one_of(st.integers(1, 3), NUMBERS),
    "input": st.one_of(TEXT, st.lists(ITEM, min_size=1, max_size=3), JSON_ANY),
    "instructions": st.one_of(TEXT, JSON_ANY),
    "tools": st.one_of(st.just([{"type": "function", "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}}}]), st.lists(JSON_ANY, max_size=2)),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", {"type": "function", "name": "add"}]), JSON_ANY),
    "text": st.one_of(st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                                       {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
                                       {"format": {"type": "json_schema", "name": "s"}}]), JSON_ANY),
    "temperature": NUMBERS, "top_p": NUMBERS, "stream": st.one_of(st.booleans(), JSON_ANY),
    "store": st.one_of(st.booleans(), JSON_ANY), "metadata": JSON_ANY, "prompt_cache_key": st.one_of(TEXT, JSON_ANY),
    "previous_response_id": st.one_of(TEXT, st.just("resp_" + "0" * 32), JSON_ANY),
    "include": JSON_ANY, "reasoning": JSON_ANY, "parallel_tool_calls": JSON_ANY,
}  # fmt: skip
GOOD_MESSAGES = {"model": "<served>", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
GOOD_RESPONSES = {"model": "<served>", "max_output_tokens": 2, "input": "hi"}


@st.composite
def bodies(draw, path: str):
    """A body the endpoint takes, then up to four fields replaced by anything of the strategies."""
    fields = MESSAGES_FIELDS if path != RESPONSES else RESPONSES_FIELDS
    body = dict(GOOD_RESPONSES if path == RESPONSES else GOOD_MESSAGES)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.booleans()):
        body[draw(st.text(min_size=1, max_size=8))] = draw(JSON_ANY)
    return body


# ------------------------------------------------------------------ properties
def check(path: str, status: int, data: bytes, body) -> None:
    assert status < 500, (status, data[:500])
    text = data.decode("utf-8")
    if status >= 400:
        reply = json.loads(text)
        if path.startswith(MESSAGES):
            assert reply["type"] == "error" and set(reply["error"]) == {"type", "message"}, reply
            err = reply["error"]
            assert err["type"] in ("invalid_request_error", "not_found_error"), err
        else:
            err = reply["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
        assert err["message"].strip() and "\n" not in err["message"] and "Traceback" not in err["message"], err
        return
    assert status == 200, (status, text[:300])
    stream = isinstance(body, dict) and body.get("stream") is True and path != COUNT
    if not stream:
        reply = json.loads(text)
        if path == COUNT:
            assert reply["input_tokens"] > 0
        elif path == MESSAGES:
            u = reply["usage"]
            assert reply["type"] == "message" and min(u["input_tokens"], u["cache_read_input_tokens"],
                                                      u["cache_creation_input_tokens"]) >= 0, reply  # fmt: skip
        else:
            assert reply["object"] == "response" and reply["status"] in ("completed", "incomplete"), reply
        return
    events = [block for block in text.split("\n\n") if block.strip()]
    kinds = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert "error" not in kinds, text[-500:]
    assert kinds[-1] in ("message_stop", "response.completed", "response.incomplete"), kinds


def with_model(body, model_id: str):
    return {**body, "model": model_id} if isinstance(body, dict) and body.get("model") == "<served>" else body


# ------------------------------------------------------------------ in process
@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from starlette.testclient import TestClient

    from mlx_chatcache.config import GenerationConfig
    from mlx_chatcache.models.loading import load
    from mlx_chatcache.server.app import create_app
    from mlx_chatcache.server.service import Service
    from mlx_chatcache.store.store import PromptStore
    from mlx_chatcache.store.tiers import MemoryTier

    folder = build_tiny_model("llama", tmp_path_factory.mktemp("hostile-agents") / "tools", tool_format="json_tools")
    model, tok = load(str(folder))
    service = Service(model, tok, str(folder), PromptStore([MemoryTier(1 << 28)]), GenerationConfig(max_tokens=3),
                      max_queue=8, context_length=CONTEXT)  # fmt: skip
    with TestClient(create_app(service), raise_server_exceptions=False) as client:
        client.model_id = service.model_id
        yield client


def post(app, path: str, body) -> tuple[int, bytes]:
    raw = body if isinstance(body, bytes) else json.dumps(with_model(body, app.model_id)).encode()
    r = app.post(path, content=raw, headers={"Content-Type": "application/json"})
    return r.status_code, r.content


@settings(FUZZ, max_examples=300)
@given(body=bodies(MESSAGES), path=st.sampled_from([MESSAGES, MESSAGES + "?beta=true", COUNT]))
def test_hostile_messages_in_process(app, body, path):
    check(path.split("?")[0], *post(app, path, body), body)


@settings(FUZZ, max_examples=300)
@given(body=bodies(RESPONSES))
@example(body={**GOOD_RESPONSES, "text": {"format": {"type": "json_schema", "name": "s"}}})
def test_hostile_responses_in_process(app, body):
    check(RESPONSES, *post(app, RESPONSES, body), body)


@settings(FUZZ, max_examples=60)
@given(rid=st.one_of(TEXT, st.just("resp_" + "a" * 32), st.text(alphabet="resp_0123456789abcdef", max_size=40)),
       method=st.sampled_from(["GET", "DELETE"]))  # fmt: skip
def test_hostile_response_ids(app, rid, method):
    from urllib.parse import quote

    r = app.request(method, "/v1/responses/" + quote(rid.encode("utf-8", "surrogatepass"), safe=""))
    assert r.status_code in (404, 405) or (r.status_code == 200 and method == "GET"), r.text[:300]
    if r.status_code == 404:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_normal_requests_in_process(app):
    status, data = post(app, MESSAGES, GOOD_MESSAGES)
    assert status == 200 and json.loads(data)["usage"]["output_tokens"] == 2
    status, data = post(app, RESPONSES, GOOD_RESPONSES)
    assert status == 200 and json.loads(data)["usage"]["output_tokens"] == 2
    health = app.get("/health").json()
    assert health["errors"] == 0 and health["requests"]["messages"] > 0 and health["requests"]["responses"] > 0


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-agents-e2e")
    folder = build_tiny_model("llama", root / "tools", tool_format="json_tools")
    with ServerProcess(folder, root / "cache", "--max-tokens", "3", "--context-length", str(CONTEXT)) as s:
        yield s
        assert s.proc.poll() is None, s.read_log()[-3000:]
        assert "Traceback" not in s.read_log(), s.read_log()[-3000:]


@settings(FUZZ, max_examples=30)
@given(body=st.one_of(bodies(MESSAGES), bodies(RESPONSES)), raw=st.one_of(st.none(), RAW))
def test_hostile_bodies_end_to_end(server, body, raw):
    client = Client(server)
    path = RESPONSES if "input" in body or "max_output_tokens" in body else MESSAGES
    payload = raw if raw is not None else json.dumps(with_model(body, server.model_id)).encode()
    status, _, data = client.post(path, payload)
    client.close()
    assert server.proc.poll() is None, server.read_log()[-3000:]
    check(path, status, data, body if raw is None else None)


def test_normal_requests_end_to_end(server):
    client = Client(server)
    for path, body in ((MESSAGES, GOOD_MESSAGES), (RESPONSES, {**GOOD_RESPONSES, "stream": True})):
        status, _, data = client.post(path, json.dumps(with_model(body, server.model_id)).encode())
        check(path, status, data, body)
    client.close()


def test_refusals_before_and_around_the_endpoint_are_in_its_dialect(llama_model, tiny_model_dirs):
    """A missing key (401), a draining server (503), a path or method the routes lack
    (404/405) and a failure inside the handler (500) answer under /v1/messages in Anthropic's
    shape and under /v1/responses in OpenAI's, one line each."""
    from starlette.testclient import TestClient

    from mlx_chatcache.config import GenerationConfig
    from mlx_chatcache.server.app import create_app
    from mlx_chatcache.server.auth import ApiKeys
    from mlx_chatcache.server.drain import Drain
    from mlx_chatcache.server.service import Service
    from mlx_chatcache.store.store import PromptStore

    model, tok = llama_model
    key = "key-0123456789abcdef"

    def anthropic_shaped(r, status, kind):
        body = r.json()
        assert r.status_code == status and body["type"] == "error" and body["error"]["type"] == kind, body
        assert set(body["error"]) == {"type", "message"} and "\n" not in body["error"]["message"]

    def openai_shaped(r, status):
        err = r.json()["error"]
        assert r.status_code == status and set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]

    service = Service(model, tok, str(tiny_model_dirs["llama"]), PromptStore([]), GenerationConfig(max_tokens=2),
                      max_queue=4)  # fmt: skip
    drain = Drain(5.0)
    with TestClient(create_app(service, keys=ApiKeys([key]), drain=drain), raise_server_exceptions=False) as c:
        anthropic_shaped(c.post(MESSAGES, json=GOOD_MESSAGES), 401, "authentication_error")
        anthropic_shaped(c.post(COUNT, json=GOOD_MESSAGES), 401, "authentication_error")
        openai_shaped(c.post(RESPONSES, json=GOOD_RESPONSES), 401)
        auth = {"x-api-key": key}
        anthropic_shaped(c.post(MESSAGES + "/nope", json={}, headers=auth), 404, "not_found_error")
        anthropic_shaped(c.get(MESSAGES, headers=auth), 405, "api_error")
        openai_shaped(c.get(RESPONSES, headers=auth), 405)
        service.count_tokens = None  # the handler fails: logged, a 500 in the dialect
        anthropic_shaped(c.post(COUNT, json={**GOOD_MESSAGES, "model": service.model_id}, headers=auth), 500, "api_error")
        drain.begin()
        anthropic_shaped(c.post(MESSAGES, json=GOOD_MESSAGES, headers=auth), 503, "overloaded_error")
        openai_shaped(c.post(RESPONSES, json=GOOD_RESPONSES, headers=auth), 503)


def test_error_bodies_of_both_dialects_are_utf8_whatever_they_quote():
    """A lone surrogate a client sent, quoted in an error (a response, or a stream's error
    event), is shown escaped in either dialect's body, so the body always encodes."""
    from mlx_chatcache.server.messages_protocol import error_body as anthropic_body
    from mlx_chatcache.server.protocol import error_body

    quoted = "no stop string 'a\ud800b'"
    for body in (anthropic_body(500, quoted), error_body(quoted, 500, "stop\udfff")):
        text = json.dumps(body, ensure_ascii=False).encode("utf-8").decode("utf-8")
        assert "a\\\\ud800b" in text
