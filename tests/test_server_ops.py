"""``mlxcc serve`` for operators, in-process (Starlette's TestClient, tiny llama): API keys on
every endpoint but ``/health``, ``HEAD /`` and the page's files, compared in constant time and
never logged; each key's store entries its own unless ``--shared-store``; ``GET /metrics``
parsed with prometheus_client's parser against what the requests did; request ids in headers,
error bodies and log lines (text and JSON); the new flags' ranges and one-line errors."""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
import threading
import time
import logging
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import starlette  # noqa: F401
import prometheus_client  # noqa: F401

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from mlx_chatcache.cli.main import main  # noqa: E402
from mlx_chatcache.cli.serve import server_setting  # noqa: E402
from mlx_chatcache.config import DEFAULTS, SERVER_RANGES, SettingError, check_setting  # noqa: E402
from mlx_chatcache.errors import UsageError  # noqa: E402
from mlx_chatcache.server.app import create_app  # noqa: E402
from mlx_chatcache.server.auth import ApiKeys, gather_keys, tenant_id  # noqa: E402
from mlx_chatcache.server.logs import JsonFormatter, RequestIdFilter  # noqa: E402
from mlx_chatcache.server.service import Service  # noqa: E402
from mlx_chatcache.store.store import PromptStore  # noqa: E402
from mlx_chatcache.store.tiers import MemoryTier  # noqa: E402

KEYS = ["alpha-key-0123456789", "beta-key-9876543210"]
PROMPT = "Once upon a time there was a small river that ran to the sea, and every morning"
GUARDED = [("GET", "/v1/models"), ("GET", "/v1/store"), ("GET", "/v1/ui"), ("GET", "/metrics"),
           ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/no/such/route"),
           ("DELETE", "/v1/models")]  # fmt: skip
PUBLIC = [("GET", "/health"), ("HEAD", "/"), ("GET", "/"), ("GET", "/store"), ("GET", "/static/chat.js")]


def make_client(llama_model, tiny_model_dirs, keys=None, shared_store=False, max_batch=4) -> TestClient:
    model, tok = llama_model
    service = Service(model, tok, str(tiny_model_dirs["llama"]), PromptStore([MemoryTier(1 << 30)]),
                      DEFAULTS.updated(max_tokens=4), max_queue=8, max_batch=max_batch)  # fmt: skip
    client = TestClient(create_app(service, keys=ApiKeys(keys, shared_store) if keys else None))
    client.service = service
    return client


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def complete(client, key: str | None, prompt: str = PROMPT, **body) -> dict:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, **body},
                    headers=bearer(key) if key else {})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def metrics(client, key: str | None = None) -> dict:
    """``{(name, labels as a sorted tuple): value}`` of every sample GET /metrics gives."""
    r = client.get("/metrics", headers=bearer(key) if key else {})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}  # fmt: skip


def idle(client, jobs: int) -> dict:
    """``/health`` once the worker has ended ``jobs`` jobs (it counts a job after its reply is sent)."""
    deadline = time.monotonic() + 10
    while (h := client.get("/health").json())["jobs"] < jobs and time.monotonic() < deadline:
        time.sleep(0.01)
    return h


class Lines(logging.Handler):
    """Every record of the ``mlxcc`` loggers, formatted as ``--log-format json`` writes it."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.addFilter(RequestIdFilter())
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


@pytest.fixture
def log_lines():
    handler, logger = Lines(), logging.getLogger("mlxcc")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


# ------------------------------------------------------------------ keys
def test_every_endpoint_but_health_and_the_page_needs_a_key(llama_model, tiny_model_dirs, log_lines):
    with make_client(llama_model, tiny_model_dirs, KEYS) as c:
        for method, path in GUARDED:
            for headers in ({}, bearer("wrong-key"), {"x-api-key": KEYS[0] + "x"}, {"Authorization": KEYS[0]},
                            {"Authorization": f"Basic {KEYS[0]}"}):  # fmt: skip
                r = c.request(method, path, headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (method, path, r.text)
                if path == "/metrics":  # its own dialect: text
                    assert r.headers["content-type"].startswith("text/plain") and "API key" in r.text
                    continue
                body = r.json()
                assert set(body["error"]) == {"message", "type", "param", "code"}, body
                assert body["error"]["code"] == "invalid_api_key" and "\n" not in body["error"]["message"]
                assert body["request_id"] == r.headers["x-request-id"]
                sent = "x-api-key" in headers or headers.get("Authorization", "").startswith("Bearer ")
                assert ("needs an API key" in body["error"]["message"]) == (not sent), (headers, body)
        for method, path in PUBLIC:  # no key needed
            assert c.request(method, path).status_code == 200, (method, path)
        for key, headers in ((KEYS[0], bearer(KEYS[0])), (KEYS[1], {"x-api-key": KEYS[1]}),
                             (KEYS[0], {"authorization": f"bearer   {KEYS[0]} "})):  # fmt: skip
            for method, path in GUARDED:
                r = c.request(method, path, headers=headers, json={"prompt": "hi", "messages": [
                    {"role": "user", "content": "hi"}], "max_tokens": 1} if method == "POST" else None)  # fmt: skip
                assert r.status_code != 401, (method, path, r.text)
                assert key not in r.text
            assert c.get("/v1/models", headers=headers).json()["data"][0]["id"] == "llama-seed0"
    logged = "\n".join(log_lines)
    assert log_lines and not any(k in logged for k in KEYS)  # access lines of every request, never a key
    assert "wrong-key" not in logged and "Bearer" not in logged


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counted(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counted)
    keys = ApiKeys(["k" * 40, "short1", "m" * 1024])
    for offered in ([(b"authorization", b"Bearer short1")], [(b"x-api-key", b"k" * 41)], [],
                    [(b"x-api-key", b"nope"), (b"authorization", b"Bearer " + b"m" * 1024)]):  # fmt: skip
        calls.clear()
        keys.tenant(offered)
        n = sum(1 for k, v in offered if k == b"x-api-key" or v.startswith(b"Bearer "))
        assert len(calls) == 3 * n  # every key, for every key offered: no early exit
        assert all(a == b == 32 for a, b in calls)  # digests: the lengths of the keys are not compared
    assert keys.tenant([(b"x-api-key", b"short1")]) == tenant_id("short1") != tenant_id("short2")
    assert ApiKeys(["short1"], shared_store=True).tenant([(b"x-api-key", b"short1")]) == ""
    assert keys.tenant([(b"x-api-key", b"short")]) is None


def test_each_key_has_its_own_store_entries_unless_shared(llama_model, tiny_model_dirs):
    with make_client(llama_model, tiny_model_dirs, KEYS) as c:
        first = complete(c, KEYS[0], prompt_cache_key="chat-1")
        n = first["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = complete(c, KEYS[0], prompt_cache_key="chat-1")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1  # the key's own entry serves it
        other = complete(c, KEYS[1], prompt_cache_key="chat-1")  # the same prompt and conversation key
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and other["mlxcc_cache"]["tier"] is None
        assert other["choices"][0]["text"] == first["choices"][0]["text"]  # a miss changes no answer
        assert complete(c, KEYS[1])["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1  # its own now
        # the store page lists each key's own pins; both pinned "chat-1", each sees one entry of its own
        for key in KEYS:
            pins = c.get("/v1/store", headers=bearer(key)).json()["pins"]
            assert len(pins) == 1 and pins[0]["key_sha256"] == hashlib.sha256(b"chat-1").hexdigest()[:12]
    with make_client(llama_model, tiny_model_dirs, KEYS, shared_store=True) as c:
        complete(c, KEYS[0])
        shared = complete(c, KEYS[1])
        assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] == shared["usage"]["prompt_tokens"] - 1
        assert shared["mlxcc_cache"]["tier"] == "memory"


def test_gather_keys_from_flags_environment_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\n\n  k-from-file-1  \nk-from-file-2\nk-flag\n")
    assert gather_keys(["k-flag"], str(f), {"MLXCC_API_KEY": "k-env"}) == ["k-flag", "k-env", "k-from-file-1",
                                                                            "k-from-file-2"]  # fmt: skip
    assert gather_keys([], None, {"MLXCC_API_KEY": ""}) == []
    secret = "s3cret with space"
    cases = [(["a b"], None, {}, "--api-key"), ([""], None, {}, "--api-key"), (["x" * 1025], None, {}, "1025"),
             (["é-key"], None, {}, "ASCII"), ([], None, {"MLXCC_API_KEY": secret}, "MLXCC_API_KEY"),
             ([], str(tmp_path / "missing"), {}, "cannot read"), ([], str(tmp_path / "empty"), {}, "holds no key"),
             ([], str(tmp_path / "bad"), {}, "line 2"), ([], str(tmp_path / "binary"), {}, "not UTF-8")]  # fmt: skip
    (tmp_path / "empty").write_text("# nothing\n\n")
    (tmp_path / "bad").write_text(f"good-key\n{secret}\n")
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    for flags, path, env, said in cases:
        with pytest.raises(UsageError) as e:
            gather_keys(flags, path, env)
        line = str(e.value)
        assert said in line and "\n" not in line and secret not in line and "x" * 1025 not in line, line


@pytest.mark.parametrize("flags, said", [
    (["--api-key", "a b"], "printable ASCII characters without spaces"),
    (["--api-key-file", "/no/such/file"], "cannot read --api-key-file"),
    (["--drain-seconds", "-1"], "--drain-seconds: must be between 0 and 3600, got -1.0"),
    (["--drain-seconds", "3601"], "must be between 0 and 3600"),
    (["--drain-seconds", "soon"], "invalid number: 'soon'"),
    (["--log-format", "xml"], "invalid choice: 'xml'"),
])  # fmt: skip
def test_bad_flags_are_one_line_before_the_model_loads(flags, said, capsys, tmp_path):
    try:
        rc = main(["serve", "--model", str(tmp_path / "no-model"), "--port", "1", *flags])
    except SystemExit as e:  # argparse's errors
        rc = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc != 0 and len(lines) == 1 and said in lines[0] and "Traceback" not in err, err


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**6),
                       st.sampled_from([0, 0.0, 3600, 3600.0, 3600.5, -0.0, 1e-9])))  # fmt: skip
def test_drain_seconds_flag_takes_exactly_its_stated_range(value):
    r = SERVER_RANGES["drain_seconds"]
    text = repr(value) if isinstance(value, float) else str(value)
    try:
        check_setting("drain_seconds", float(text))
        ok = True
    except SettingError:
        ok = False
    assert ok == (r.low <= float(text) <= r.high)
    try:
        assert server_setting("drain_seconds")(text) == float(text)
        assert ok
    except Exception as e:  # argparse.ArgumentTypeError: one line stating the range
        assert not ok and "must be between 0 and 3600" in str(e) and "\n" not in str(e), e
    assert r.describe() == "between 0 and 3600"


# ------------------------------------------------------------------ metrics
def test_metrics_count_what_the_requests_did(llama_model, tiny_model_dirs):
    with make_client(llama_model, tiny_model_dirs, KEYS[:1]) as c:
        before = metrics(c, KEYS[0])
        assert before[("mlxcc_prompt_tokens_total", (("source", "computed"),))] == 0
        a = complete(c, KEYS[0])
        b = complete(c, KEYS[0])  # the same prompt: all but its last token from memory
        r = c.post("/v1/completions", json={"prompt": PROMPT + " again", "max_tokens": 4, "stream": True,
                                            "stream_options": {"include_usage": True}}, headers=bearer(KEYS[0]))
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        s = json.loads(r.text.split("\n\n")[-3].removeprefix("data: "))  # the usage chunk
        assert c.get("/v1/models").status_code == 401
        store = idle(c, 3)["store"]
        m = metrics(c, KEYS[0])
    n = a["usage"]["prompt_tokens"]
    got = {k: v for k, v in m.items() if k[0] == "mlxcc_requests_total"}
    assert got[("mlxcc_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 3
    assert got[("mlxcc_requests_total", (("endpoint", "/v1/models"), ("status", "401")))] == 1
    assert got[("mlxcc_requests_total", (("endpoint", "/metrics"), ("status", "200")))] == 1  # the first scrape
    prompt = {dict(k[1])["source"]: v for k, v in m.items() if k[0] == "mlxcc_prompt_tokens_total"}
    assert set(prompt) == {"computed", "memory", "disk", "redis"}
    usages = [x["usage"] for x in (a, b, s)]
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1 and s["mlxcc_cache"]["tier"] == "memory"
    assert prompt["memory"] == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert prompt["computed"] == sum(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert prompt["disk"] == prompt["redis"] == 0
    tokens = 4 * 3
    assert m[("mlxcc_generated_tokens_total", ())] == tokens
    assert m[("mlxcc_time_to_first_token_seconds_count", ())] == 3
    assert m[("mlxcc_inter_token_latency_seconds_count", ())] == tokens - 3  # gaps: tokens - 1 per reply
    assert 0 < m[("mlxcc_time_to_first_token_seconds_sum", ())] < 60
    assert m[("mlxcc_request_duration_seconds_count", (("endpoint", "/v1/completions"),))] == 3
    assert m[("mlxcc_jobs_total", ())] == 3 and m[("mlxcc_jobs_failed_total", ())] == 0
    assert m[("mlxcc_queue_depth", ())] == 0 and m[("mlxcc_batch_rows_active", ())] == 0
    assert m[("mlxcc_batch_rows_max", ())] == 4 and m[("mlxcc_draining", ())] == 0
    assert m[("mlxcc_requests_running", ())] == 0
    mem = store["memory"]
    assert m[("mlxcc_store_budget_bytes", (("tier", "memory"),))] == mem["budget"] == 1 << 30
    assert m[("mlxcc_store_bytes", (("tier", "memory"),))] == mem["bytes"] > 0
    assert m[("mlxcc_store_entries", (("tier", "memory"),))] == mem["entries"] > 0
    assert m[("mlxcc_store_evictions_total", (("tier", "memory"),))] == mem["evicted"]


def test_metrics_show_the_requests_waiting_for_the_worker(llama_model, tiny_model_dirs):
    c = make_client(llama_model, tiny_model_dirs, max_batch=1)  # not entered: the worker has not started
    replies = []
    threads = [threading.Thread(target=lambda i=i: replies.append(complete(c, None, prompt=f"{i} {PROMPT}")))
               for i in range(3)]  # fmt: skip
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while (m := metrics(c))[("mlxcc_queue_depth", ())] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m[("mlxcc_queue_depth", ())] == 3 and m[("mlxcc_requests_running", ())] == 3
    assert m[("mlxcc_batch_rows_active", ())] == 0
    c.service.start()
    try:
        for t in threads:
            t.join(60)
        assert len(replies) == 3 and metrics(c)[("mlxcc_queue_depth", ())] == 0
    finally:
        c.service.stop()


def test_metrics_count_evictions_against_the_budget(llama_model, tiny_model_dirs):
    model, tok = llama_model
    service = Service(model, tok, str(tiny_model_dirs["llama"]), PromptStore([MemoryTier(200_000)]),
                      DEFAULTS.updated(max_tokens=2), max_queue=8, max_batch=1)  # fmt: skip
    with TestClient(create_app(service)) as c:
        for i in range(6):
            complete(c, None, prompt=f"{i} {PROMPT} {i}")
        mem = idle(c, 6)["store"]["memory"]
        m = metrics(c)
    assert m[("mlxcc_store_budget_bytes", (("tier", "memory"),))] == 200_000 >= mem["bytes"]
    assert m[("mlxcc_store_evictions_total", (("tier", "memory"),))] == mem["evicted"] > 0
    assert m[("mlxcc_batch_rows_max", ())] == 1  # one at a time


def test_two_servers_in_one_process_keep_their_own_metrics(llama_model, tiny_model_dirs):
    with make_client(llama_model, tiny_model_dirs) as one, make_client(llama_model, tiny_model_dirs) as two:
        complete(one, None)
        assert metrics(one)[("mlxcc_generated_tokens_total", ())] == 4
        assert metrics(two)[("mlxcc_generated_tokens_total", ())] == 0
        assert ("mlxcc_requests_total", (("endpoint", "/v1/completions"), ("status", "200"))) not in metrics(two)


# ------------------------------------------------------------------ request ids and logs
def test_request_ids_in_headers_error_bodies_and_log_lines(llama_model, tiny_model_dirs, log_lines):
    ids = []  # each response's X-Request-Id, in order
    with make_client(llama_model, tiny_model_dirs) as c:
        for _ in range(2):
            ids.append(c.get("/v1/models").headers["x-request-id"])
        assert all(re.fullmatch(r"req_[0-9a-f]{24}", i) for i in ids) and ids[0] != ids[1]
        mine = "trace-42.abc:def/1+2=3"
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}, headers={"X-Request-Id": mine})
        assert r.status_code == 400 and r.headers["x-request-id"] == mine == r.json()["request_id"]
        ids.append(mine)
        for bad in ("has space", "x" * 129, "é", "a\tb", ""):  # replaced, never echoed
            r = c.get("/v1/nothing", headers={"X-Request-Id": bad.encode("utf-8")})
            ids.append(r.headers["x-request-id"])
            assert r.status_code == 404 and re.fullmatch(r"req_[0-9a-f]{24}", ids[-1]) and r.json()["request_id"] == ids[-1]
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "ok-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "ok-1" and "request_id" not in r.json()
        ids.append("ok-1")
    access = [x for x in map(json.loads, log_lines) if x["logger"] == "mlxcc.serve.access"]
    assert [x["request_id"] for x in access] == ids  # one line per request, with its id
    assert [x["status"] for x in access] == [200, 200, 400] + [404] * 5 + [200]
    last = access[-1]
    assert (last["method"], last["path"], last["message"][:21]) == ("POST", "/v1/completions", "POST /v1/completions ")
    assert last["duration_s"] >= 0 and last["client"] == "testclient"


def test_the_workers_log_lines_carry_the_request_id(llama_model, tiny_model_dirs, log_lines, monkeypatch):
    with make_client(llama_model, tiny_model_dirs) as c:
        def broken():
            raise RuntimeError("a fault in the model call")

        monkeypatch.setattr(c.service.batch.decode, "step", broken)
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "fails-1"})
    assert r.status_code == 500 and r.json()["request_id"] == "fails-1" and r.headers["x-request-id"] == "fails-1"
    failed = [x for x in map(json.loads, log_lines) if x["message"] == "generation failed"]
    assert len(failed) == 1 and failed[0]["request_id"] == "fails-1" and "a fault" in failed[0]["exception"]


def test_an_internal_error_is_logged_once_with_the_request_id(llama_model, tiny_model_dirs, log_lines, monkeypatch):
    with make_client(llama_model, tiny_model_dirs) as c:  # the test client raises what escapes the app
        def broken(name):
            raise RuntimeError("a fault while checking the model")

        monkeypatch.setattr(c.service, "check_model", broken)
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "fails-2"})
    assert r.status_code == 500 and r.json()["request_id"] == "fails-2" and "see the server log" in r.text
    errors = [x for x in map(json.loads, log_lines) if x["level"] == "error"]
    assert len(errors) == 1 and errors[0]["request_id"] == "fails-2" and "a fault" in errors[0]["exception"]


def test_json_log_lines_carry_the_request_id_of_work_on_other_threads():
    rec = logging.LogRecord("mlxcc.serve", logging.ERROR, __file__, 1, "generation failed", (), None)
    rec.request_id = "req_abc"
    RequestIdFilter().filter(rec)
    out = json.loads(JsonFormatter().format(rec))
    assert out["request_id"] == "req_abc" and out["level"] == "error" and out["message"] == "generation failed"
    plain = logging.LogRecord("mlxcc.serve", logging.INFO, __file__, 1, "started", (), None)
    RequestIdFilter().filter(plain)
    assert "request_id" not in json.loads(JsonFormatter().format(plain)) and plain.request_id == "-"
    try:
        raise ValueError("boom\nline two")
    except ValueError:
        bad = logging.LogRecord("mlxcc.serve", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = JsonFormatter().format(bad)  # one line, whatever the record holds
    assert "\n" not in line and "boom\nline two" in json.loads(line)["exception"]
