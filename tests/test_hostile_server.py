"""Hostile requests against ``mlxcc serve`` (tiny random llama).

Over both ``/v1/chat/completions`` and ``/v1/completions``, with generated
bodies (wrong types, out-of-range numbers, token ids at and past the
vocabulary, huge and negative ids, lone surrogates, NULs, RTL marks, long
strings, missing and extra fields), raw bodies that are not JSON, truncated
JSON or not UTF-8, and streams the client cuts off mid-way, these hold:

- the server never answers 5xx and its process stays alive;
- every 4xx carries ``{"error": {"message", "type", "param", "code"}}`` with a
  one-line message;
- a 200 is a well-formed completion (a stream ends with ``data: [DONE]``
  and carries no error event);
- a normal request is answered correctly afterwards.

Each class of body is fuzzed twice: in-process, hundreds of bodies through every
check the server makes before a job is queued (``decode_body``, ``parse_chat`` /
``parse_completion``, ``Service.admit`` on the same tiny model and settings: the
prompt, the job's settings and hooks), where a body is taken or refused with a 4xx
``RequestError`` and nothing else may escape; and end to end, a few dozen bodies of
the same strategies through a real ``mlxcc serve`` process, so the whole path
(HTTP, admission, generation, the reply) is exercised too. Cut streams are end to
end only; token ids and seeds that once crashed the process run on a server of
their own.

Hypothesis runs derandomized with no example database: every run sends the same
bodies, so the run time is bounded and a failure reproduces on the next run
exactly. Generated bodies that would succeed ask for 1-4 tokens.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from server_process import ServerProcess
from tiny_models import VOCAB_SIZE

from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.server.jobs import decode_body
from mlx_chatcache.server.protocol import RequestError, parse_chat, parse_completion
from mlx_chatcache.server.service import Service
from mlx_chatcache.store.store import PromptStore


CONTEXT = 512
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=list(HealthCheck))  # fmt: skip
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
IN_PROCESS, END_TO_END = 400, 40  # bodies per class: through the checks in-process, through a real server
SERVER_FLAGS = ("--max-tokens", "3", "--context-length", str(CONTEXT))
PARSE = {CHAT: parse_chat, COMPLETIONS: parse_completion}


class Client:
    """One keep-alive HTTP connection to the server, reopened when the server closes it."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.conn = None

    def post(self, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=60)
            try:
                self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                                     **(headers or {})})  # fmt: skip
                r = self.conn.getresponse()
                data = r.read()
                if r.getheader("connection", "").lower() == "close":
                    self.close()
                return r.status, dict(r.getheaders()), data
            except (http.client.HTTPException, OSError):
                self.close()
                if attempt or self.server.proc.poll() is not None:
                    raise

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    with ServerProcess(tiny_model_dirs["llama"], tmp_path_factory.mktemp("cache"), *SERVER_FLAGS) as s:
        yield s
        assert s.proc.poll() is None, s.read_log()[-3000:]
        assert "Traceback" not in s.read_log(), s.read_log()[-3000:]  # no fault after a response started


@pytest.fixture(scope="module")
def client(server):
    c = Client(server)
    yield c
    c.close()


@pytest.fixture(scope="module")
def service(tiny_model_dirs, llama_model):
    """The server's service in-process (SERVER_FLAGS' settings), not started: only its checks run."""
    model, tokenizer = llama_model
    return Service(model, tokenizer, str(tiny_model_dirs["llama"]), PromptStore([]), DEFAULTS.updated(max_tokens=3),
                   max_queue=8, context_length=CONTEXT)  # fmt: skip


# ------------------------------------------------------------------ properties
def check_answer(server, status: int, headers: dict, data: bytes, stream: bool = False) -> None:
    """The properties every answer has (see the module docstring)."""
    assert server.proc.poll() is None, f"the server died:\n{server.read_log()[-3000:]}"
    assert status < 500, (status, data[:500], server.read_log()[-2000:])
    text = data.decode("utf-8")  # every answer is UTF-8 JSON or SSE
    if status >= 400:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"].strip(), err
        assert "\n" not in err["message"] and "Traceback" not in err["message"], err
        assert err["type"] == "invalid_request_error", err
        assert err["param"] is None or isinstance(err["param"], str), err
        assert err["code"] is None or isinstance(err["code"], str), err
        return
    assert status == 200, (status, text[:300])
    if not stream:
        reply = json.loads(text)
        assert 1 <= len(reply["choices"]) <= 2 and reply["usage"]["completion_tokens"] >= 0, reply
        return
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events and events[-1] == "[DONE]", text[-300:]
    for e in events[:-1]:
        assert "error" not in json.loads(e), e


def admitted(service: Service, path: str, raw: bytes, session: str | None = None) -> int:
    """What the server answers ``raw`` with before any token is generated: 200 (the job would be
    queued) or the 4xx of the ``RequestError`` that refused it, whose fields are checked as
    ``check_answer`` checks an error body; any other exception escapes (a 5xx)."""
    try:
        service.admit(PARSE[path](decode_body(raw)), session)
    except RequestError as e:
        assert 400 <= e.status < 500, (e.status, e.message)
        assert isinstance(e.message, str) and e.message.strip(), e.message
        assert "\n" not in e.message and "Traceback" not in e.message, e.message
        assert e.param is None or isinstance(e.param, str), e.param
        assert e.code is None or isinstance(e.code, str), e.code
        return e.status
    return 200


def normal_request_works(client: Client) -> None:
    body = {"model": client.server.model_id, "messages": [{"role": "user", "content": "Good morning!"}],
            "max_tokens": 2, "temperature": 0}  # fmt: skip
    status, _, data = client.post(CHAT, json.dumps(body).encode())
    assert status == 200, data[:500]
    reply = json.loads(data)
    assert reply["usage"]["completion_tokens"] == 2 and isinstance(reply["choices"][0]["message"]["content"], str)
    assert client.server.health()["status"] == "ok"


def send(server, client: Client, path: str, body, headers: dict | None = None) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, h, data = client.post(path, raw, headers)
    stream = isinstance(body, dict) and body.get("stream") is True
    check_answer(server, status, h, data, stream)


# ------------------------------------------------------------------ strategies
SURROGATES = st.sampled_from(["\ud800", "\udfff", "\udc80", "a\ud83d", "\ud83d\ude00"])
ODD = st.sampled_from(["\x00", "\u202e", "\u200f", "\ufeff", "\u0301", "\U0010ffff", "\uffff", "\r\n",
                       "<|im_end|>", "<|im_start|>", "<|endoftext|>", "\\u0000", "🙂", "שלום", "\t"])  # fmt: skip
TEXT = st.one_of(
    st.text(max_size=40),
    st.lists(st.one_of(st.text(max_size=5), ODD, SURROGATES), max_size=8).map("".join),
    st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "\u202e", "🙂", "ab "]), st.integers(50, 400)),
)
# token ids at and past the vocabulary (once a SIGSEGV or a 5xx), seeds outside [0, 2**64) (once a 5xx)
PAST_VOCAB_IDS = st.one_of(st.integers(VOCAB_SIZE, 2**70), st.sampled_from([
    VOCAB_SIZE, VOCAB_SIZE + 1, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64, 10**30]))  # fmt: skip
IDS = st.one_of(  # in the vocabulary, or refused by the request checks (negative, at or past the vocabulary)
    st.integers(3, VOCAB_SIZE - 1),
    st.sampled_from([0, 1, 2, VOCAB_SIZE - 1, -1, -(2**31), -(2**63), -(10**30)]),
    st.integers(max_value=-1),
    PAST_VOCAB_IDS,
)
OUT_OF_RANGE_SEEDS = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64))
NUMBERS = st.one_of(
    st.integers(), st.floats(), st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63), 10**40, 1e308, -0.0]),
)
JSON_SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON_ANY = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                        st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=6)  # fmt: skip
MISSING = object()

MAX_TOKENS = st.integers(1, 4)
GOOD = {  # values the server takes
    "max_tokens": MAX_TOKENS,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "seed": st.integers(0, 2**31),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "prompt_cache_key": TEXT,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "max_completion_tokens": MAX_TOKENS,
    "user": TEXT,
    "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB_SIZE - 1).map(str), st.floats(-100, 100), max_size=3),
    "n": st.integers(1, 2),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "boolean"}}}}}]),
    "tools": st.just([{"type": "function", "function": {"name": "add", "parameters": {"type": "object",
        "properties": {"a": {"type": "integer"}}}}}]),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "add"}}]),
}
BAD = {  # values it must refuse or survive: out of range, of the wrong type
    "max_tokens": st.one_of(NUMBERS, st.integers(5, 10**6)),
    "max_completion_tokens": st.one_of(NUMBERS, st.integers(5, 10**6)),
    "temperature": NUMBERS,
    "top_p": NUMBERS,
    "seed": st.one_of(st.integers(0, 2**64 - 1), OUT_OF_RANGE_SEEDS, NUMBERS.filter(lambda v: type(v) is not int), TEXT),
    "stop": st.lists(TEXT, min_size=5, max_size=8),
    "stream_options": st.fixed_dictionaries({"include_usage": JSON_ANY}),
    "top_k": NUMBERS,
    "min_p": NUMBERS,
    "repetition_penalty": NUMBERS,
    "presence_penalty": NUMBERS,
    "frequency_penalty": NUMBERS,
    "logit_bias": st.one_of(JSON_ANY, st.dictionaries(st.one_of(TEXT, st.integers().map(str)), NUMBERS, max_size=3)),
    "logprobs": NUMBERS,
    "top_logprobs": NUMBERS,
    "n": NUMBERS,
    "response_format": st.one_of(JSON_ANY, st.fixed_dictionaries({"type": st.just("json_schema"),
                                                                  "json_schema": st.fixed_dictionaries({"schema": JSON_ANY})})),
    "tools": st.one_of(JSON_ANY, st.lists(JSON_ANY, max_size=3)),
    "tool_choice": JSON_ANY,
}
ROLES = st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool"]), TEXT)
MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": st.one_of(
    TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3))},
    optional={"name": TEXT})  # fmt: skip
BAD_MESSAGE = st.one_of(JSON_ANY, st.fixed_dictionaries({}, optional={"role": JSON_ANY, "content": JSON_ANY,
                                                                      "extra": JSON_ANY}))  # fmt: skip
GOOD["messages"] = st.lists(MESSAGE, min_size=1, max_size=4)
BAD["messages"] = st.one_of(JSON_ANY, st.lists(st.one_of(MESSAGE, BAD_MESSAGE), max_size=4))
GOOD["prompt"] = st.one_of(TEXT, st.lists(IDS, min_size=1, max_size=12), st.lists(TEXT, min_size=1, max_size=1))
BAD["prompt"] = st.one_of(JSON_ANY, st.lists(st.one_of(IDS, TEXT, JSON_ANY), max_size=3))
GOOD["model"] = st.just("<served>")
BAD["model"] = st.one_of(TEXT, JSON_ANY)
SESSION = st.one_of(st.none(), st.text(st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"),
                                       max_size=30))  # fmt: skip


@st.composite
def bodies(draw, path: str):
    """A body the server would take for ``path`` (any text, any token ids, a few optional
    fields), then up to three fields dropped, made hostile or added."""
    own = "messages" if path == CHAT else "prompt"
    names = ["model", own, "max_tokens", *draw(st.lists(st.sampled_from(sorted(set(GOOD) - {"model", "messages",
                                                      "prompt", "max_tokens"})), max_size=4, unique=True))]  # fmt: skip
    body = {name: draw(GOOD[name]) for name in names}
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(sorted(GOOD)))
        action = draw(st.sampled_from(["drop", "bad", "any", "extra"]))
        if action == "drop":
            body.pop(name, None)
        elif action == "bad" and name in BAD:
            body[name] = draw(BAD[name])
        elif action == "any":
            body[name] = draw(JSON_ANY)
        else:
            body[draw(st.text(min_size=1, max_size=12))] = draw(JSON_ANY)
    return body


def _with_model(model_id: str, body: dict) -> dict:
    return {**body, "model": model_id} if body.get("model") == "<served>" else body


def _raw(body: dict) -> bytes:
    return json.dumps(body).encode()


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_hostile_bodies_are_taken_or_refused_in_one_line(service, path):
    @settings(FUZZ, max_examples=IN_PROCESS)
    @given(body=bodies(path), session=SESSION)
    def check(body, session):
        admitted(service, path, _raw(_with_model(service.model_id, body)), session)

    check()


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_hostile_bodies_end_to_end(server, client, path):
    @settings(FUZZ, max_examples=END_TO_END)
    @given(body=bodies(path), session=SESSION)
    def check(body, session):
        send(server, client, path, _with_model(server.model_id, body), {"X-Session-Id": session} if session else None)

    check()


def _valid(path: str) -> bytes:
    body = {"model": "<served>", "max_tokens": 2, "stream": True}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi there"})
    return json.dumps(body).encode()


RAW = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda b, cut: b[:cut], st.sampled_from([_valid(CHAT), _valid(COMPLETIONS)]), st.integers(0, 120)),
    st.builds(lambda d: d * b"[" + d * b"]", st.integers(1, 200_000)),
    st.builds(lambda d: d * b'{"a":' + b"1" + d * b"}", st.integers(1, 200_000)),
    st.sampled_from([b"", b"null", b"NaN", b"Infinity", b"-Infinity", b"1e999", b'"\\ud800"', b"\xff\xfe{}",
                     b'{"model": "\xff"}', b"\xef\xbb\xbf{}", b"9" * 5000, b'{"model": 1' + b"0" * 5000 + b"}",
                     b'{"max_tokens": 1e999}', b"[]" * 10, b'{"a": 1}{"b": 2}', b'{"model": "x", "model": 1}']),
)  # fmt: skip


def _complete_body(raw: bytes, path: str, model_id: str) -> tuple[bytes, bool]:
    """``raw`` with the served model's name, and whether it is the complete valid body."""
    raw = raw.replace(b'"<served>"', json.dumps(model_id).encode())
    return raw, raw == _valid(path).replace(b'"<served>"', json.dumps(model_id).encode())


@settings(FUZZ, max_examples=IN_PROCESS)
@given(raw=RAW, path=st.sampled_from([CHAT, COMPLETIONS]))
@example(raw=b"[" * 100_000, path=CHAT)
@example(raw=b'{"a":' * 100_000, path=COMPLETIONS)
def test_bodies_that_are_not_json_are_refused_in_one_line(service, raw, path):
    raw, complete = _complete_body(raw, path, service.model_id)
    assert admitted(service, path, raw) == (200 if complete else 400)


@settings(FUZZ, max_examples=END_TO_END)
@given(raw=RAW, path=st.sampled_from([CHAT, COMPLETIONS]))
@example(raw=b"[" * 100_000, path=CHAT)
@example(raw=b'{"a":' * 100_000, path=COMPLETIONS)
def test_bodies_that_are_not_json_end_to_end(server, client, raw, path):
    raw, complete = _complete_body(raw, path, server.model_id)
    status, headers, data = client.post(path, raw)
    check_answer(server, status, headers, data, stream=complete)
    assert status == (200 if complete else 400), data[:300]


@settings(FUZZ, max_examples=END_TO_END)
@given(path=st.sampled_from([CHAT, COMPLETIONS]), read=st.integers(0, 600), max_tokens=st.integers(1, 64),
       half_request=st.booleans())  # fmt: skip
def test_streams_cut_by_the_client(server, client, path, read, max_tokens, half_request):
    """The client sends a (possibly partial) streaming request, reads a few bytes, hangs up."""
    body = json.loads(_valid(path).replace(b'"<served>"', json.dumps(server.model_id).encode()))
    body["max_tokens"] = max_tokens
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head + (raw[: len(raw) // 2] if half_request else raw))
        got = b""
        while not half_request and len(got) < read:
            chunk = s.recv(read - len(got))
            if not chunk:
                break
            got += chunk
        s.shutdown(socket.SHUT_RDWR)
    assert server.proc.poll() is None, server.read_log()[-3000:]
    if not half_request and got:
        assert got[:12] == b"HTTP/1.1 200"[: len(got)], got[:200]


def test_normal_request_after_the_storm(server, client):
    normal_request_works(client)
    # streamed, too, on the same keep-alive connection
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    status, headers, data = client.post(CHAT, json.dumps(body).encode())
    check_answer(server, status, headers, data, stream=True)
    events = [json.loads(e.removeprefix("data: ")) for e in data.decode().split("\n\n")[:-2] if e]
    assert events[-1]["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 5  # the reply is sent before the worker stores the conversation's cache
    while (h := server.health())["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h["errors"] == 0 and not h["busy"], h


# ------------------------------------------------------------------ focused checks of the HTTP layer
def test_json_nested_past_the_recursion_limit_is_a_400(server, client):
    for raw in (b"[" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000):
        status, _, data = client.post(CHAT, raw)
        assert status == 400 and json.loads(data)["error"]["code"] == "invalid_json", data[:300]


def test_a_body_cut_off_by_the_client_is_not_a_server_fault(server):
    raw = json.dumps({"model": server.model_id, "prompt": "hi", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw[:5])
        s.shutdown(socket.SHUT_WR)  # the rest of the body never comes
        s.recv(100)
    assert "internal error" not in server.read_log() and server.proc.poll() is None, server.read_log()[-2000:]


def test_an_error_quoting_a_lone_surrogate_is_a_4xx(server, client):
    status, _, data = client.post(CHAT, json.dumps({"model": "a\ud800b", "messages": [{"role": "user",
                                                                                      "content": "hi"}]}).encode())
    err = json.loads(data)["error"]
    assert status == 400 and err["param"] == "model" and "lone surrogate" in err["message"], data[:300]


def test_a_completion_prompt_over_the_context_names_the_prompt(server, client):
    body = {"model": server.model_id, "prompt": [3 + i % 300 for i in range(CONTEXT)], "max_tokens": 1}
    status, _, data = client.post(COMPLETIONS, json.dumps(body).encode())
    err = json.loads(data)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    body = {"model": server.model_id, "prompt": "a\ud800b", "max_tokens": 1}  # text the tokenizer refuses
    status, _, data = client.post(COMPLETIONS, json.dumps(body).encode())
    assert status == 400 and json.loads(data)["error"]["param"] == "prompt", data
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "apples " * CONTEXT}]}
    status, _, data = client.post(CHAT, json.dumps(body).encode())
    assert status == 400 and json.loads(data)["error"]["param"] == "messages", data


# ------------------------------------------------------------------ ids and seeds that once crashed it, on a server of their own
def _own_server(tiny_model_dirs, tmp_path):
    return ServerProcess(tiny_model_dirs["llama"], tmp_path, *SERVER_FLAGS)


ID_LISTS = st.lists(st.one_of(IDS.filter(lambda t: t >= 0), PAST_VOCAB_IDS), min_size=1, max_size=6)


def _ids_body(model_id: str, ids: list[int], stream: bool) -> dict:
    return {"model": model_id, "prompt": ids, "max_tokens": 1, "stream": stream}


def _seed_body(model_id: str, seed: int, temperature: int, path: str) -> dict:
    body = {"model": model_id, "max_tokens": 1, "seed": seed, "temperature": temperature}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})
    return body


@settings(FUZZ, max_examples=200)
@given(ids=ID_LISTS, stream=st.booleans())
@example(ids=[VOCAB_SIZE], stream=False)
@example(ids=[16173], stream=False)
def test_token_ids_past_the_vocabulary_are_refused_before_the_model(service, ids, stream):
    status = admitted(service, COMPLETIONS, _raw(_ids_body(service.model_id, ids, stream)))
    assert status == (200 if max(ids) < VOCAB_SIZE else 400), ids


@settings(FUZZ, max_examples=200)
@given(seed=OUT_OF_RANGE_SEEDS, temperature=st.sampled_from([0, 1]), path=st.sampled_from([CHAT, COMPLETIONS]))
def test_out_of_range_seeds_are_refused_naming_the_seed(service, seed, temperature, path):
    with pytest.raises(RequestError) as e:
        service.admit(PARSE[path](_seed_body(service.model_id, seed, temperature, path)))
    assert e.value.status == 400 and e.value.param == "seed", e.value.message


def test_token_ids_at_and_past_the_vocabulary(tiny_model_dirs, tmp_path):
    with _own_server(tiny_model_dirs, tmp_path) as s:
        c = Client(s)

        @settings(FUZZ, max_examples=END_TO_END)
        @given(ids=ID_LISTS, stream=st.booleans())
        @example(ids=[VOCAB_SIZE], stream=False)
        @example(ids=[16173], stream=False)  # the process dies (SIGSEGV)
        @example(ids=[2**63], stream=False)
        def run(ids, stream):
            send(s, c, COMPLETIONS, _ids_body(s.model_id, ids, stream))

        run()
        normal_request_works(c)


def test_out_of_range_seeds(tiny_model_dirs, tmp_path):
    with _own_server(tiny_model_dirs, tmp_path) as s:
        c = Client(s)

        @settings(FUZZ, max_examples=END_TO_END // 2)
        @given(seed=OUT_OF_RANGE_SEEDS, temperature=st.sampled_from([0, 1]), path=st.sampled_from([CHAT, COMPLETIONS]))
        @example(seed=-1, temperature=0, path=CHAT)
        @example(seed=2**64, temperature=1, path=COMPLETIONS)
        def run(seed, temperature, path):
            send(s, c, path, _seed_body(s.model_id, seed, temperature, path))

        run()
        normal_request_works(c)
