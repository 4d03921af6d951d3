"""Stopping ``mlxcc serve`` (real processes, tiny llama): a stream running at SIGTERM completes with
all its tokens while new requests get 503 and ``/health`` says draining; its store entry is
written to disk and Redis, so the conversation's next turn on a fresh server is a hit; the
process exits 0. A second signal exits at once; a drain whose time runs out stores what the
cut request fed. Also what the log says: JSON lines with the request's id and never the key,
and one warning for a non-loopback ``--host`` without a key."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.error
import urllib.request


import prometheus_client  # noqa: F401

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from redis_server import shared_redis  # noqa: E402,F401  (fixture)
from server_process import ServerProcess  # noqa: E402
from store_helpers import served  # noqa: E402

from mlx_chatcache.config import DEFAULTS, SERVER_DEFAULTS  # noqa: E402
from mlx_chatcache.generation.templates import render_chat  # noqa: E402
from mlx_chatcache.generation.text import as_tokenizer_wrapper, stop_token_ids, stream_generate  # noqa: E402


KEY = "drain-test-key-0123456789"
TURN1 = [{"role": "system", "content": "You tell long stories."},
         {"role": "user", "content": "Tell me the story of a river that ran to the sea, please."}]  # fmt: skip
LONG = 300  # tokens of the stream running at the signal (about a second on the tiny model)


def no_stop_bias(tokenizer) -> dict[str, float]:
    """A logit_bias that keeps the model from ending its reply before max_tokens."""
    return {str(t): -100.0 for t in stop_token_ids(as_tokenizer_wrapper(tokenizer))}


class Stream(threading.Thread):
    """A streamed chat request read on a thread: ``chunks`` (decoded events), ``done`` ([DONE] came)."""

    def __init__(self, server: ServerProcess, messages, max_tokens: int, bias: dict, key: str | None = None):
        super().__init__(daemon=True)
        body = {"model": server.model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "logit_bias": bias}  # fmt: skip
        self.server, self.body, self.key = server, json.dumps(body).encode(), key
        self.chunks: list[dict] = []
        self.done, self.request_id, self.error = False, None, None

    def run(self):
        headers = {"Content-Type": "application/json", "X-Request-Id": "the-long-stream"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", self.body, headers)
            r = conn.getresponse()
            self.request_id = r.getheader("x-request-id")
            for line in r:
                data = line.decode().strip().removeprefix("data: ")
                if data == "[DONE]":
                    self.done = True
                elif data:
                    self.chunks.append(json.loads(data))
        except (OSError, http.client.HTTPException) as e:
            self.error = e
        finally:
            conn.close()

    def text(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c["choices"])

    def wait_for_tokens(self, n: int = 3, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while sum(bool(c["choices"]) for c in self.chunks) < n + 1:  # the role chunk, then n pieces
            assert time.monotonic() < deadline and self.is_alive(), (self.error, self.chunks[:3])
            time.sleep(0.005)


def post_chat(server, messages, key: str | None = None, **body) -> tuple[int, "http.client.HTTPMessage", dict]:
    return post(server, "/v1/chat/completions", {"model": server.model_id, "messages": messages, "temperature": 0,
                                                 **body}, key)  # fmt: skip


def get(server, path: str, key: str | None = None) -> tuple[int, "http.client.HTTPMessage", bytes]:
    request = urllib.request.Request(server.root + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def post(server, path: str, body: dict, key: str | None = KEY) -> tuple[int, "http.client.HTTPMessage", dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(server.root + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def scrape(server, key: str | None = None) -> dict:
    status, _, data = get(server, "/metrics", key)
    assert status == 200, data
    return {s.name: s.value for f in text_string_to_metric_families(data.decode()) for s in f.samples if not s.labels}


def local_reply(llama_model, messages, max_tokens: int, bias: dict) -> tuple[list[int], str]:
    """The greedy reply computed in this process, with the same logit_bias: (token ids, text)."""
    model, tokenizer = llama_model
    config = DEFAULTS.updated(max_tokens=max_tokens, logit_bias=tuple(sorted((int(k), v) for k, v in bias.items())))
    tokens, text = [], ""
    for r in stream_generate(model, tokenizer, render_chat(tokenizer, messages), config=config):
        tokens.append(r.token)
        text += r.text
    return tokens, text


def log_records(server) -> list[dict]:
    lines = [line for line in server.read_log().splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every line is one JSON object


def test_sigterm_lets_a_running_stream_finish_and_its_next_turn_is_a_hit(tiny_model_dirs, llama_model, tmp_path,
                                                                         shared_redis):  # noqa: F811
    tok = llama_model[1]
    bias = no_stop_bias(tok)
    cache = tmp_path / "cache"
    flags, redis = ("--context-length", "4096", "--api-key", KEY), ("--cache-redis", shared_redis.url)
    with ServerProcess(tiny_model_dirs["llama"], cache, *flags, *redis, "--log-level", "info", "--log-format",
                       "json") as s:  # fmt: skip
        stream = Stream(s, TURN1, LONG, bias, KEY)
        stream.start()
        stream.wait_for_tokens()
        during = scrape(s, KEY)
        assert during["mlxcc_batch_rows_active"] == 1 and during["mlxcc_requests_running"] == 1, during
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (h := get(s, "/health"))[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, headers, data = h
        assert status == 503 and json.loads(data)["status"] == "draining" and headers["Retry-After"] == "1", h
        assert stream.is_alive() and not stream.done  # still streaming while the server drains
        status, headers, body = post_chat(s, TURN1, KEY, max_tokens=2)  # a new request is refused
        assert status == 503 and headers["Retry-After"] == str(SERVER_DEFAULTS.retry_after_s), body
        assert body["error"]["code"] == "server_shutting_down" and body["request_id"] == headers["x-request-id"]
        assert scrape(s, KEY)["mlxcc_draining"] == 1  # operators still see the drain
        stream.join(60)
        assert stream.done and stream.error is None, (stream.error, stream.chunks[-2:])
        usage = stream.chunks[-1]["usage"]
        assert usage["completion_tokens"] == LONG and stream.chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(60) == 0, s.read_log()[-3000:]
        records = log_records(s)
    logged = json.dumps(records)
    assert KEY not in logged and "Traceback" not in logged
    access = [r for r in records if r.get("request_id") == stream.request_id == "the-long-stream"
              and r["logger"] == "mlxcc.serve.access"]  # (its other lines: a busy machine's Redis timeouts)
    assert [(r["path"], r["status"]) for r in access] == [("/v1/chat/completions", 200)]
    assert sum("draining" in r["message"] for r in records) == 1

    ids, text = local_reply(llama_model, TURN1, LONG, bias)
    assert stream.text() == text  # all of its tokens, the ones it gets alone
    prompt = render_chat(tok, TURN1)
    held = [prompt + ids[:-1], prompt, prompt[:-1]]  # what the stream's request stored (its reply but the last token)
    turn2 = TURN1 + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    want = served(held, render_chat(tok, turn2)[:-1], SERVER_DEFAULTS.store_block_tokens)
    ahead = prompt + ids + [ids[0]]  # the same tokens as ids, whatever the reply's text re-encodes to
    assert served(held, ahead[:-1], SERVER_DEFAULTS.store_block_tokens) == len(prompt) + LONG - 1
    # a fresh server on the same folder (the disk tier was written before the process exited), then one on
    # another folder with the same Redis (the Redis writer was flushed too)
    for folder, tier, extra in ((cache, "disk", ()), (tmp_path / "other", "redis", redis)):
        with ServerProcess(tiny_model_dirs["llama"], folder, *flags, *extra) as fresh:
            status, _, body = post_chat(fresh, turn2, KEY, max_tokens=2)
            assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == want, body["usage"]
            assert body["mlxcc_cache"]["tier"] == tier and want >= len(prompt)
            status, _, body = post(fresh, "/v1/completions", {"prompt": ahead, "max_tokens": 1})
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert status == 200 and cached == len(prompt) + LONG - 1 and body["mlxcc_cache"]["tier"] == tier, body


def test_a_second_signal_exits_at_once(tiny_model_dirs, llama_model, tmp_path):
    with ServerProcess(tiny_model_dirs["llama"], tmp_path / "cache", "--context-length", "4096",
                       "--host", "0.0.0.0") as s:  # fmt: skip  (no key: the warning)
        stream = Stream(s, TURN1, 3000, no_stop_bias(llama_model[1]))
        stream.start()
        stream.wait_for_tokens()
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while get(s, "/health")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(10) == 128 + signal.SIGINT and time.monotonic() - start < 5
        stream.join(10)
        assert not stream.done and len(stream.chunks) < 3000  # cut off
        log = s.read_log()
    assert "SIGINT again: exiting now, 1 request(s) cut off" in log and "Traceback" not in log, log
    warnings = [line for line in log.splitlines() if "no API key" in line]
    assert len(warnings) == 1 and "--host 0.0.0.0 is not loopback" in warnings[0], log


def test_a_drain_whose_time_runs_out_stores_what_the_request_fed(tiny_model_dirs, llama_model, tmp_path):
    cache = tmp_path / "cache"
    bias = no_stop_bias(llama_model[1])
    with ServerProcess(tiny_model_dirs["llama"], cache, "--context-length", "4096", "--drain-seconds", "1",
                       "--api-key", KEY, "--host", "0.0.0.0") as s:  # fmt: skip
        stream = Stream(s, TURN1, 3000, bias, KEY)
        stream.start()
        stream.wait_for_tokens()
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        took = time.monotonic() - start
        stream.join(10)
        log = s.read_log()
    assert 1 <= took < 10, took
    assert not stream.done and "drain time is up: cancelling 1 request(s) (1 generating)" in log, log
    assert "no API key" not in log  # keys are set: no warning
    with ServerProcess(tiny_model_dirs["llama"], cache, "--context-length", "4096", "--api-key", KEY) as fresh:
        status, _, body = post_chat(fresh, TURN1, KEY, max_tokens=2)
    prompt = len(render_chat(llama_model[1], TURN1))
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1, body["usage"]
