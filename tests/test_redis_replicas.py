"""Two ``mlxcc serve`` processes sharing one real redis-server (``--cache-redis``),
each with its own --cache-dir and a small memory tier, driven with the
official ``openai`` client: a conversation started on one replica continues on
the other with the cached tokens the store's rules give and the greedy output of
a cold run; a corrupted value in Redis is rejected (counted, output still right);
a Redis too slow to answer only delays a request by the socket timeout; Redis
killed mid-run (even mid-stream) changes nothing a client sees, and the tier
reconnects once Redis is back. The same two replicas on a real 3-master Redis
Cluster move a conversation between them, and a killed master is only misses."""

from __future__ import annotations

import time

import pytest

import openai
import redis  # noqa: F401

from redis_server import redis_cluster, shared_redis  # noqa: E402,F401  (fixtures)
from server_process import ServerProcess  # noqa: E402
from test_server import chat, expected_cached, local_reply  # noqa: E402

from mlx_chatcache.generation.templates import render_chat  # noqa: E402

FAILED = "/0 failed ("  # in the one warning line of an outage: "Redis cache tier at URL failed (...)"


def conversation(topic: str) -> list[dict]:
    system = (f"{topic.capitalize()} are your subject: you are a careful assistant for questions about them. "
              f"Answer in plain words, keep every answer short, and say so when you do not know.")  # fmt: skip
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Tell me one fact about {topic}."}]


def next_turn(messages, reply: str, text: str) -> list[dict]:
    return messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": text}]


def redis_stats(server) -> dict:
    return server.health()["store"]["redis"]


def wait_for(server, what, check, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = redis_stats(server)
        if check(stats):
            return stats
        time.sleep(0.05)
    raise AssertionError(f"{what}: {redis_stats(server)}")


def keys(redis_server) -> set[bytes]:
    return set(redis_server.client().scan_iter("mlxcc:*"))


def written(server, before: int) -> None:
    """Wait until ``server`` has written the values of the request it answered last into
    Redis (``before``: its Redis tier's ``written`` count before that request)."""

    def done(stats) -> bool:
        store = server.health()["store"]
        return not store["pending_writes"] and not stats["pending_writes"] and stats["written"] > before

    wait_for(server, "the request's values did not reach Redis", done)


@pytest.fixture(scope="module")
def replicas(shared_redis, tiny_model_dirs, tmp_path_factory):  # noqa: F811
    flags = ("--cache-redis", shared_redis.url, "--cache-bytes", "3MB", "--max-tokens", "64",
             "--context-length", "1024")  # fmt: skip
    model = tiny_model_dirs["llama"]
    with ServerProcess(model, tmp_path_factory.mktemp("a"), *flags) as a, \
            ServerProcess(model, tmp_path_factory.mktemp("b"), *flags) as b:  # fmt: skip
        yield a, b


def test_conversation_moves_between_replicas(replicas, shared_redis, llama_model):  # noqa: F811
    a, b = replicas
    turn1 = conversation("rivers")
    assert len(render_chat(llama_model[1], turn1)) > 64  # longer than one hash-chain block
    before = redis_stats(a)["written"]
    first = chat(a, turn1)
    reply_ids, reply_text = local_reply(llama_model, turn1)
    assert first.choices[0].message.content == reply_text
    written(a, before)
    turn2 = next_turn(turn1, reply_text, "And one more, please.")
    hits = redis_stats(b)["hits"]
    second = chat(b, turn2)  # the other replica: its memory and disk have never seen this chat
    want = expected_cached(llama_model, turn1, reply_ids, turn2)
    assert second.usage.prompt_tokens_details.cached_tokens == want >= first.usage.prompt_tokens
    assert redis_stats(b)["hits"] > hits
    reply2_ids, reply2_text = local_reply(llama_model, turn2)  # a cold run, in this process
    assert second.choices[0].message.content == reply2_text
    # and back: A's own memory holds turn 1 only, Redis holds B's longer entry
    written(b, 0)
    turn3 = next_turn(turn2, reply2_text, "Thanks, that is all.")
    third = chat(a, turn3, stream=True, stream_options={"include_usage": True})
    chunks = list(third)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected_cached(llama_model, turn2, reply2_ids, turn3)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == local_reply(llama_model, turn3)[1]


def test_corrupted_value_is_rejected(replicas, shared_redis, llama_model):  # noqa: F811
    a, b = replicas
    turn1 = conversation("volcanoes")
    held, before = keys(shared_redis), redis_stats(a)["written"]
    first = chat(a, turn1)
    written(a, before)
    r = shared_redis.client()
    mine = keys(shared_redis) - held  # this conversation's values: damage their array bytes
    assert mine
    for k in mine:
        value = bytearray(r.get(k))
        value[-100] ^= 0x55
        r.set(k, bytes(value), keepttl=True)
    turn2 = next_turn(turn1, first.choices[0].message.content, "Where is the largest one?")
    corrupt = redis_stats(b)["corrupt"]
    second = chat(b, turn2)
    assert redis_stats(b)["corrupt"] == corrupt + 1  # counted at the first damaged value, not used:
    assert second.usage.prompt_tokens_details.cached_tokens < 16  # the template's first tokens at most
    assert second.choices[0].message.content == local_reply(llama_model, turn2)[1]


def test_slow_redis_only_slows_requests(replicas, shared_redis, llama_model):  # noqa: F811
    a, b = replicas
    turn1 = conversation("glaciers")
    before = redis_stats(a)["written"]
    first = chat(a, turn1)
    written(a, before)
    turn2 = next_turn(turn1, first.choices[0].message.content, "How fast do they move?")
    outages = redis_stats(b)["outages"]
    paused = time.monotonic()
    shared_redis.client().execute_command("CLIENT", "PAUSE", "6000", "ALL")  # Redis answers nobody for 6 s
    reply = chat(b, turn2)  # B's lookup times out (1 s): served without Redis, right all the same
    took = time.monotonic() - paused
    assert reply.choices[0].message.content == local_reply(llama_model, turn2)[1]
    assert took < 4.5, took  # the socket timeout, not the pause, bounds the wait
    stats = redis_stats(b)  # no Redis call can succeed during the pause
    assert stats["outages"] == outages + 1 and stats["connected"] is False and stats["lookup_errors"] >= 1
    time.sleep(max(0.0, 6.1 - (time.monotonic() - paused)))
    deadline = time.monotonic() + 60
    while not redis_stats(b)["connected"]:
        assert time.monotonic() < deadline, redis_stats(b)
        chat(b, conversation("deserts"), max_tokens=2)
        time.sleep(0.3)


def test_redis_killed_mid_run_then_restarted(replicas, shared_redis, llama_model):  # noqa: F811
    a, b = replicas
    turn1 = conversation("lighthouses")
    before = redis_stats(a)["written"]
    first = chat(a, turn1)
    written(a, before)
    outages = {s.port: redis_stats(s)["outages"] for s in (a, b)}
    logged = {s.port: s.read_log().count(FAILED) for s in (a, b)}
    turn2 = next_turn(turn1, first.choices[0].message.content, "Who keeps them?")
    stream = chat(a, turn2, stream=True, max_tokens=40)
    pieces = [next(iter(stream))]
    shared_redis.kill()  # mid-stream
    pieces += list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == local_reply(llama_model, turn2, 40)[1]
    for server in (b, a, b):  # everything still answers, with the greedy output of a cold run
        reply = chat(server, turn2)
        assert reply.choices[0].message.content == local_reply(llama_model, turn2)[1]
    assert chat(a, turn2).usage.prompt_tokens_details.cached_tokens > 0  # A's memory tier still serves
    for server in (a, b):
        stats = wait_for(server, "the outage was not noticed", lambda s: s["connected"] is False)
        assert stats["outages"] == outages[server.port] + 1
        assert server.read_log().count(FAILED) == logged[server.port] + 1, server.read_log()  # logged once
    shared_redis.start()  # the same port, empty
    turn1b = conversation("bridges")
    deadline = time.monotonic() + 60
    while not (redis_stats(a)["connected"] and redis_stats(b)["connected"]):  # requests make the tier retry
        assert time.monotonic() < deadline, (redis_stats(a), redis_stats(b))
        chat(a, turn1b, max_tokens=2)
        chat(b, turn1b, max_tokens=2)
        time.sleep(0.5)
    for server in (a, b):
        assert server.read_log().count("reachable again") == server.read_log().count(FAILED)
    before = redis_stats(a)["written"]
    first = chat(a, conversation("tunnels"))
    written(a, before)
    again = next_turn(conversation("tunnels"), first.choices[0].message.content, "How long is the longest?")
    assert chat(b, again).usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


@pytest.fixture(scope="module")
def cluster_replicas(redis_cluster, tiny_model_dirs, tmp_path_factory):  # noqa: F811
    flags = ("--cache-redis", redis_cluster.nodes[1].url, "--cache-bytes", "3MB", "--max-tokens", "64",
             "--context-length", "1024", "--disk-cache-bytes", "0")  # fmt: skip
    model = tiny_model_dirs["llama"]
    with ServerProcess(model, tmp_path_factory.mktemp("ca"), *flags) as a, \
            ServerProcess(model, tmp_path_factory.mktemp("cb"), *flags[:1], redis_cluster.nodes[2].url,
                          *flags[2:]) as b:  # fmt: skip
        yield a, b


def test_a_conversation_moves_between_replicas_through_a_redis_cluster(cluster_replicas, redis_cluster, llama_model):  # noqa: F811
    a, b = cluster_replicas
    turn1 = conversation("canals")
    before = redis_stats(a)["written"]
    first = chat(a, turn1)
    reply_ids, reply_text = local_reply(llama_model, turn1)
    written(a, before)
    assert redis_stats(a)["cluster"] is True and redis_stats(a)["write_errors"] == 0
    turn2 = next_turn(turn1, reply_text, "And one more, please.")
    second = chat(b, turn2)  # the other replica: only the cluster holds this chat
    assert redis_stats(b)["cluster"] is True and redis_stats(b)["lookup_errors"] == 0
    assert second.usage.prompt_tokens_details.cached_tokens == expected_cached(llama_model, turn1, reply_ids, turn2)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.choices[0].message.content == local_reply(llama_model, turn2)[1]
    redis_cluster.nodes[0].kill()  # a master and its slots gone: misses, never a failed request
    for server in (a, b, a):
        turn = next_turn(turn2, second.choices[0].message.content, "Thanks!")
        assert chat(server, turn).choices[0].message.content == local_reply(llama_model, turn)[1]
