"""Hostile API-key and request-id headers against ``mlxcc serve`` with keys (tiny llama).

Headers missing, wrong, repeated, huge, not ASCII, not UTF-8, with control characters, a key
with one character changed or cut: in-process through the whole app (its gate, hundreds of
header sets), then a few dozen through a real ``mlxcc serve`` process. These hold:

- a request carrying no valid key is a 401 (on the wire: a 400 from the HTTP parser for a
  value with control characters, before the app sees it) whose body is the OpenAI error shape with one of
  the two fixed messages (never what it sent) and the id of its ``X-Request-Id`` header;
- a request carrying a valid key (beside any garbage) is answered;
- nothing escapes as a 5xx, the process stays alive, its log holds no traceback and no key;
- a normal request is answered afterwards.
"""

from __future__ import annotations

import http.client
import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from server_process import ServerProcess  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from mlx_chatcache.config import DEFAULTS  # noqa: E402
from mlx_chatcache.server.app import create_app  # noqa: E402
from mlx_chatcache.server.auth import ApiKeys  # noqa: E402
from mlx_chatcache.server.service import Service  # noqa: E402
from mlx_chatcache.store.store import PromptStore  # noqa: E402


KEY = "hostile-test-key-0123456789"
FUZZ = settings(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
IN_PROCESS, END_TO_END = 400, 30
MESSAGES = {"this server needs an API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
            "the API key is not valid; check the key you were given"}  # fmt: skip

# header values as bytes: anything but CR, LF and NUL (which no HTTP client sends in a header)
RAW = st.binary(max_size=60).map(lambda b: bytes(c for c in b if c not in b"\r\n\x00"))
NEAR = st.one_of(  # the key changed a little: cut, one character changed, padded, another case
    st.integers(0, len(KEY) - 1).map(lambda n: KEY[:n].encode()),
    st.tuples(st.integers(0, len(KEY) - 1), st.sampled_from("aZ0-_~é")).map(
        lambda t: (KEY[: t[0]] + t[1] + KEY[t[0] + 1 :]).encode("utf-8")),
    st.sampled_from([KEY.upper().encode(), (KEY + "x").encode(), ("x" + KEY).encode(), KEY.encode() * 2,
                     KEY.encode("utf-16"), "é".encode() + KEY.encode()]),
)  # fmt: skip
HUGE = st.sampled_from([b"a" * 8_000, b"Bearer " + b"k" * 12_000, b"\xff" * 4_000, "é".encode() * 3_000])
VALUE = st.one_of(RAW, NEAR, HUGE, st.just(KEY.encode()), st.text(max_size=30).map(lambda t: t.encode("utf-8")))
SCHEMES = st.sampled_from([b"Bearer ", b"bearer ", b"BEARER  ", b"Basic ", b"Token ", b"", b"Bearer", b"Bearer\t"])
HEADER = st.one_of(
    st.tuples(st.just(b"authorization"), st.tuples(SCHEMES, VALUE).map(b"".join)),
    st.tuples(st.just(b"x-api-key"), VALUE),
    st.tuples(st.just(b"x-request-id"), st.one_of(RAW, HUGE)),
)
HEADERS = st.lists(HEADER, max_size=4)


def holds_the_key(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a header offers KEY exactly (what the server must accept)."""
    for name, value in headers:
        if name == b"x-api-key" and value.strip() == KEY.encode():
            return True
        scheme, _, rest = value.strip().partition(b" ")
        if name == b"authorization" and scheme.lower() == b"bearer" and rest.strip() == KEY.encode():
            return True
    return False


def control_characters(sent: list[tuple[bytes, bytes]]) -> bool:
    """Whether a header value holds control characters (other than tab), which the HTTP parser
    (h11) may refuse before the app sees them."""
    return any(c < 0x20 and c != 0x09 or c == 0x7F for _, v in sent for c in v)


def check(status: int, headers: dict, body: bytes, sent: list[tuple[bytes, bytes]], wire: bool = False) -> None:
    assert status < 500, (status, body[:300])
    if wire and status == 400 and body == b"Invalid HTTP request received.":
        assert control_characters(sent), sent  # refused by the parser, and only for these
        return
    if holds_the_key(sent):
        assert status == 200, (status, body[:300])
        assert json.loads(body)["object"] == "list"
        return
    assert status == 401, (status, body[:300], sent)
    payload = json.loads(body.decode("utf-8"))
    err = payload["error"]
    assert err["message"] in MESSAGES and err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    rid = headers["x-request-id"]
    assert payload["request_id"] == rid and re.fullmatch(r"[A-Za-z0-9._:/+=-]{1,128}", rid)
    offered = [v for n, v in sent if n == b"x-request-id"]
    if offered and re.fullmatch(rb"[A-Za-z0-9._:/+=-]{1,128}", offered[0]):
        assert rid == offered[0].decode()  # the client's own id, when it is one


@pytest.fixture(scope="module")
def client(llama_model, tiny_model_dirs):
    model, tok = llama_model
    service = Service(model, tok, str(tiny_model_dirs["llama"]), PromptStore([]), DEFAULTS.updated(max_tokens=2),
                      max_queue=8)  # fmt: skip
    with TestClient(create_app(service, keys=ApiKeys([KEY, "another-key-9876543210"])),
                    raise_server_exceptions=True) as c:  # fmt: skip
        yield c


def test_hostile_key_headers_in_process(client):
    @settings(FUZZ, max_examples=IN_PROCESS)
    @given(headers=HEADERS)
    @example(headers=[])
    @example(headers=[(b"authorization", b"Bearer " + KEY.encode())])
    @example(headers=[(b"x-api-key", b"\xe9\xff"), (b"x-api-key", KEY.encode())])
    @example(headers=[(b"authorization", b"Bearer " + b"k" * 100_000)])
    def run(headers):
        # raw ASGI headers: what any client could put on the wire, byte for byte
        r = client.get("/v1/models", headers=headers)
        check(r.status_code, r.headers, r.content, headers)

    run()


def test_hostile_key_headers_end_to_end(tiny_model_dirs, tmp_path):
    with ServerProcess(tiny_model_dirs["llama"], tmp_path, "--api-key", KEY, "--max-tokens", "2") as s:

        @settings(FUZZ, max_examples=END_TO_END)
        @given(headers=HEADERS)
        @example(headers=[])
        @example(headers=[(b"authorization", b"Bearer wrong")])
        @example(headers=[(b"x-api-key", "ключ".encode())])
        @example(headers=[(b"x-api-key", b"\xff\xfe")])
        @example(headers=[(b"authorization", b"Bearer " + b"k" * 12_000)])
        @example(headers=[(b"x-api-key", b"k" * 100_000), (b"x-request-id", b"r" * 10_000)])
        def run(headers):
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
            try:
                conn.putrequest("GET", "/v1/models")
                for name, value in headers:
                    conn.putheader(name, value)
                conn.endheaders()
                r = conn.getresponse()
                check(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read(), headers, wire=True)
            finally:
                conn.close()
            assert s.proc.poll() is None, s.read_log()[-2000:]

        run()
        body = json.dumps({"model": s.model_id, "prompt": "hello", "max_tokens": 2}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", "x-api-key": KEY})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
        conn.close()
        assert s.proc.poll() is None
        log = s.read_log()
    assert "Traceback" not in log and KEY not in log, log[-3000:]
