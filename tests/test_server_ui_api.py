"""What ``mlxcc serve`` tells a page about its cache: per turn, which tier served
the cached tokens (``mlxcc_cache``, streamed and not, across a restart), and
``GET /v1/store`` (tiers within budget, pins shown only as key digests, a hit
history sampled without a thread). Live servers on 127.0.0.1, tiny llama."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_process import ServerProcess

from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.server.history import ServedTokens, StatsHistory
from mlx_chatcache.server.worker import GenerationWorker, Job
from mlx_chatcache.store.tiers import PINNED_ENTRIES, Pin, Pins
from mlx_chatcache.store.store import PromptStore
from mlx_chatcache.store.disk import DiskTier

KEY = "user-4711@example.org conversation"  # a key that could identify someone
FIRST = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three rivers, please."}]


def _get(server, path: str) -> tuple[dict, str]:
    with urllib.request.urlopen(server.root + path, timeout=30) as r:
        raw = r.read().decode()
    return json.loads(raw), raw


def _post(server, body: dict) -> dict | list[dict]:
    """The response object, or a stream's chunks (without ``[DONE]``)."""
    body = {"model": server.model_id, "max_tokens": 8, "temperature": 0, **body}
    req = urllib.request.Request(server.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read().decode()
    if not body.get("stream"):
        return json.loads(raw)
    events = [line[len("data: "):] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _turn(server, messages, stream: bool) -> tuple[str, dict]:
    """One chat turn pinned by KEY: (reply text, the object carrying usage and mlxcc_cache)."""
    body = {"messages": messages, "prompt_cache_key": KEY, "stream": stream}
    if not stream:
        full = _post(server, body)
        return full["choices"][0]["message"]["content"], full
    chunks = _post(server, {**body, "stream_options": {"include_usage": True}})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert all("mlxcc_cache" not in c for c in chunks[:-1])  # only on the usage chunk
    return text, chunks[-1]


def _cache(obj: dict) -> tuple[int, str | None]:
    """(mlxcc_cache tokens, tier), checked against usage, which stays OpenAI's."""
    assert set(obj["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert set(obj["mlxcc_cache"]) == {"tokens", "tier"} and obj["mlxcc_cache"]["tokens"] == cached
    return cached, obj["mlxcc_cache"]["tier"]


def _settled_report(server) -> tuple[dict, str, dict]:
    """/v1/store (parsed and raw) and /health, read once the worker has stored the
    last reply (it does so after the client has its response) and nothing changed between."""
    deadline = time.monotonic() + 20
    while True:
        before = server.health()
        assert before["ui"] == "on"  # a loopback server shows the page
        report, raw = _get(server, "/v1/store")
        after = server.health()
        idle = not after["busy"] and after["store"]["pending_writes"] == 0
        if idle and before["store"] == after["store"] and before["jobs"] == after["jobs"]:
            return report, raw, after
        assert time.monotonic() < deadline, "the server did not settle"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def runs(tiny_model_dirs, tmp_path_factory):
    """Two turns of one conversation, then a restart on the same --cache-dir and a
    third turn; what each server said, and its /v1/store and /health after."""
    cache_dir = tmp_path_factory.mktemp("cache")
    out = {}
    with ServerProcess(tiny_model_dirs["llama"], cache_dir) as a:
        reply1, out["turn1"] = _turn(a, FIRST, stream=True)
        turn2 = FIRST + [{"role": "assistant", "content": reply1}, {"role": "user", "content": "And three lakes?"}]
        reply2, out["turn2"] = _turn(a, turn2, stream=True)
        _, out["turn2_full"] = _turn(a, turn2, stream=False)
        out["store_a"], out["store_a_raw"], out["health_a"] = _settled_report(a)
    turn3 = turn2 + [{"role": "assistant", "content": reply2}, {"role": "user", "content": "Thanks!"}]
    with ServerProcess(tiny_model_dirs["llama"], cache_dir) as b:
        _, out["turn3"] = _turn(b, turn3, stream=True)
        out["store_b"], out["store_b_raw"], out["health_b"] = _settled_report(b)
    return out


def test_each_turn_says_which_tier_served_its_cached_tokens(runs):
    assert _cache(runs["turn1"]) == (0, None)  # a new server, an empty --cache-dir
    cached, tier = _cache(runs["turn2"])
    assert tier == "memory" and cached >= runs["turn1"]["usage"]["prompt_tokens"] > 0
    cached_full, tier_full = _cache(runs["turn2_full"])  # the same prompt again, not streamed
    assert tier_full == "memory" and cached_full == runs["turn2_full"]["usage"]["prompt_tokens"] - 1
    cached3, tier3 = _cache(runs["turn3"])  # a new process: only the disk tier holds the conversation
    assert tier3 == "disk" and cached3 >= runs["turn2"]["usage"]["prompt_tokens"]
    for name in ("turn2", "turn2_full", "turn3"):
        assert set(runs[name]["mlxcc_timing"]) == {"queued_s", "first_token_s", "total_s"}


def test_store_report_matches_health_and_stays_within_budgets(runs):
    for report, health in ((runs["store_a"], runs["health_a"]), (runs["store_b"], runs["health_b"])):
        assert [t["name"] for t in report["tiers"]] == ["memory", "disk"]
        for t in report["tiers"]:
            h = health["store"][t["name"]]
            assert 0 <= t["bytes"] <= t["budget"] == h["budget"]
            assert t["entries"] == h["entries"] and t["hits"] == h["hits"] and t["evicted"] == h["evicted"]
            assert 0 <= t["pinned_entries"] <= t["entries"]
        assert report["lookups"] == health["store"]["lookups"] and report["misses"] == health["store"]["misses"]
        assert 0 <= report["cached_tokens"] <= report["prompt_tokens"]
        assert sum(t["served_tokens"] for t in report["tiers"]) == report["cached_tokens"]
    a, b = runs["store_a"], runs["store_b"]
    served = {t["name"]: t["served_tokens"] for t in a["tiers"]}
    assert served == {"memory": _cache(runs["turn2"])[0] + _cache(runs["turn2_full"])[0], "disk": 0}
    assert {t["name"]: t["served_tokens"] for t in b["tiers"]} == {"memory": 0, "disk": _cache(runs["turn3"])[0]}


def test_store_report_shows_pins_as_digests_never_keys_or_tokens(runs):
    digest = hashlib.sha256(KEY.encode()).hexdigest()[:12]
    for report, raw in ((runs["store_a"], runs["store_a_raw"]), (runs["store_b"], runs["store_b_raw"])):
        assert KEY not in raw and "user-4711" not in raw
        (pin,) = report["pins"]  # one conversation, pinned by KEY
        assert pin["key_sha256"] == digest and report["pinned_keys"] == 1
        assert pin["entries"] >= 1 and pin["tokens"] > 0 and pin["bytes"] > 0
        assert set(pin["tiers"]) <= {"memory", "disk"} and "memory" in pin["tiers"]
        assert not _int_lists(report)  # no token ids anywhere


def _int_lists(obj) -> list:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _int_lists(v)]
    if isinstance(obj, list):
        own = [obj] if any(isinstance(v, int) for v in obj) else []
        return own + [x for v in obj for x in _int_lists(v)]
    return []


def test_store_report_history_has_a_sample_after_a_job(runs):
    for name in ("store_a", "store_b"):
        history = runs[name]["history"]
        assert history, name  # sampled as the first job started
        assert [s["t"] for s in history] == sorted(s["t"] for s in history)
        for s in history:
            assert 0 <= s["cached_tokens"] <= s["prompt_tokens"] and sum(s["by_tier"].values()) == s["cached_tokens"]
    # the first job's sample: its prompt, and nothing cached yet in the second process
    assert runs["store_b"]["history"][0]["prompt_tokens"] == runs["turn3"]["usage"]["prompt_tokens"]


# ------------------------------------------------------------------ in process
def _run(worker: GenerationWorker, prompt: list[int]) -> dict:
    """One job run on this thread: its "start" and "done" events."""
    events = {}
    worker._run(Job(list(prompt), DEFAULTS.updated(max_tokens=4, temp=0.0), lambda e: events.setdefault(*e)))
    assert events["start"]["cached_tier"] == events["done"]["cached_tier"]
    assert events["start"]["cached_tokens"] == events["done"]["cached_tokens"]
    return events["done"]


def test_a_cache_still_waiting_for_its_file_is_served_from_memory(llama_model, tmp_path):
    model, tokenizer = llama_model
    prompt = list(range(5, 45))
    worker = GenerationWorker(model, tokenizer, PromptStore([DiskTier(tmp_path, 10**9)]), DEFAULTS, 4)
    first = _run(worker, prompt)
    assert (first["cached_tokens"], first["cached_tier"]) == (0, None)
    assert worker.store.pending  # the file is not written yet (the worker thread writes when idle)
    again = _run(worker, prompt)
    assert (again["cached_tokens"], again["cached_tier"]) == (len(prompt) - 1, "memory")
    worker.store.flush()
    last = _run(worker, prompt)
    assert (last["cached_tokens"], last["cached_tier"]) == (len(prompt) - 1, "disk")
    n = len(prompt) - 1
    assert worker.served.totals() == {"prompt_tokens": 3 * len(prompt), "cached_tokens": 2 * n,
                                      "by_tier": {"memory": n, "disk": n}}  # fmt: skip
    assert len(worker.history.samples()) == 1  # within one period


def test_redis_served_tokens_are_reported_as_redis(llama_model):
    import fakeredis
    from mlx_chatcache.server.store_report import store_report
    from mlx_chatcache.store.redis_tier import RedisTier

    model, tokenizer = llama_model
    prompt = list(range(5, 45))
    tier = RedisTier("redis://fake", client=fakeredis.FakeRedis(server=fakeredis.FakeServer()))
    worker = GenerationWorker(model, tokenizer, PromptStore([tier], block_tokens=16), DEFAULTS, 4)
    try:
        assert _run(worker, prompt)["cached_tier"] is None
        worker.store.flush()
        assert tier.flush(10)
        again = _run(worker, prompt)
        assert again["cached_tier"] == "redis" and again["cached_tokens"] >= 32  # whole 16-token blocks at least
        report = store_report(worker)
        (row,) = report["tiers"]
        assert row["name"] == "redis" and row["served_tokens"] == again["cached_tokens"] == report["cached_tokens"]
        assert row["pinned_entries"] is None and report["pins"] == []  # Redis's pins are the replicas' together
    finally:
        tier.close()


def test_pins_per_key_follow_puts():
    """A key pins the values of the last PINNED_ENTRIES entries it put; a value two keys
    pin stays pinned until neither does."""
    pins = Pins()
    pins.pin("a", 3, ["b1", "e1"])
    pins.pin("a", 5, ["b1", "b2", "e2"])
    pins.pin("b", 2, ["b1", "e3"])
    sizes = {"b1": 100, "b2": 100, "e1": 10, "e2": 20, "e3": 30}
    assert pins.report(sizes.get) == {"a": Pin(2, 5, 230), "b": Pin(1, 2, 130)}
    for i in range(PINNED_ENTRIES):
        pins.pin("a", 1, [f"x{i}"])
    assert "e1" not in pins and "e2" not in pins and "b2" not in pins and "b1" in pins  # "b" still pins b1
    assert pins.report(lambda k: 1)["a"] == Pin(PINNED_ENTRIES, 1, PINNED_ENTRIES)


def test_stats_history_keeps_one_sample_per_period_in_a_bounded_ring():
    now = [1000.0]
    history = StatsHistory(period_s=10, size=3, clock=lambda: now[0])
    served = ServedTokens()
    kept = []
    for step in range(60):  # a sample offered every 2.5 s for 150 s
        served.count(10, step % 10, "memory" if step % 2 else None)
        kept.append(history.sample(served.totals()))
        now[0] += 2.5
    assert sum(kept) == 15 and kept[:5] == [True, False, False, False, True]
    samples = history.samples()
    assert len(samples) == 3  # the ring keeps the newest
    assert [s["t"] for s in samples] == [1120.0, 1130.0, 1140.0]
    assert all(later["t"] - earlier["t"] >= 10 for earlier, later in zip(samples, samples[1:]))
    assert samples[-1]["prompt_tokens"] == 10 * 57  # cumulative, as offered at that time
    now[0] = 500.0  # the clock went back (a changed wall clock): a sample is kept at once
    assert history.sample(served.totals()) and history.samples()[-1]["t"] == 500.0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 30), st.integers(0, 100), st.integers(0, 100),
                          st.sampled_from([None, "memory", "disk", "redis"])), max_size=40),  # fmt: skip
       st.floats(0.5, 20), st.integers(1, 8))
def test_stats_history_invariants(steps, period, size):
    now = [0.0]
    history = StatsHistory(period_s=period, size=size, clock=lambda: now[0])
    served = ServedTokens()
    for dt, prompt, cached, tier in steps:
        now[0] += dt
        served.count(prompt, min(cached, prompt), tier)
        history.sample(served.totals())
    samples = history.samples()
    assert len(samples) <= size and (samples or not steps)
    assert all(b["t"] - a["t"] >= period for a, b in zip(samples, samples[1:]))
    assert all(a["prompt_tokens"] <= b["prompt_tokens"] and a["cached_tokens"] <= b["cached_tokens"]
               for a, b in zip(samples, samples[1:]))  # fmt: skip
    for s in samples:
        assert s["cached_tokens"] <= s["prompt_tokens"] and sum(s["by_tier"].values()) <= s["cached_tokens"]
