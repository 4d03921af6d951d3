"""Continuous batching in ``mlxcc serve`` (mlx_chatcache/server/batch.py, generation/batch.py).

Invariants: a job decoded in a batch gives the tokens, text, events and store entry it
gives alone (greedy and seeded: token for token; log-probabilities within 1e-4, as a
batch's products may round unlike one row's); a cancelled row leaves without changing the
others; a model whose cache cannot be batched runs jobs one at a time and /health says why.
"""

from __future__ import annotations

import dataclasses
import threading

import mlx.core as mx
import pytest

from cli_helpers import mlxcc, one_error_line
from mlx_chatcache.config import DEFAULTS, SERVER_DEFAULTS
from mlx_chatcache.models.loading import load
from mlx_chatcache.server.batch import BatchScheduler
from mlx_chatcache.server.worker import GenerationWorker, Job
from mlx_chatcache.store.chain import Chain
from mlx_chatcache.store.disk import DiskTier
from mlx_chatcache.store.store import PromptStore
from mlx_chatcache.store.tiers import MemoryTier

B = SERVER_DEFAULTS.store_block_tokens

TIMEOUT = 120
TEXTS = ["The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
         "Once upon a time",
         "A list of things to buy: apples, bread, milk, eggs, butter, cheese, rice, beans and tea for the week ahead.",
         "Hello there, how are you?"]  # fmt: skip


def cfg(**changes):
    return dataclasses.replace(DEFAULTS, **{"temp": 0.0, "max_tokens": 12, "prefill_step_size": 8, **changes})


def make_worker(model, tok, config, max_batch, store=None):
    """A worker with its scheduler (on ``store``, a memory tier by default); ``scheduler.widths``
    records the rows of every batched model call."""
    worker = GenerationWorker(model, tok, store or PromptStore([MemoryTier(1 << 30)]), config, max_queue=16)
    scheduler = BatchScheduler(worker, max_batch)
    step, scheduler.widths = scheduler.decode.step, []

    def recorded():
        scheduler.widths.append(len(scheduler.decode))
        return step()

    scheduler.decode.step = recorded
    return worker, scheduler


class Recorder:
    """A job's events; ``done`` is set on its last one (or when it is cancelled, by the test)."""

    def __init__(self, cancel_after: int | None = None):
        self.events, self.done, self.cancel_after, self.job = [], threading.Event(), cancel_after, None

    def __call__(self, event):
        self.events.append(event)
        if event[0] in ("done", "error"):
            self.done.set()
        elif event[0] == "piece" and self.cancel_after is not None and len(self.ids()) >= self.cancel_after:
            self.job.cancel()
            self.done.set()

    def ids(self, index=0):
        return [lp.id for kind, p in self.events if kind == "piece" and p.index == index for lp in p.logprobs]

    def text(self):
        return "".join(p.text for kind, p in self.events if kind == "piece")

    def last(self):
        return self.events[-1]


def job_for(prompt, config, rec, key=None, n=1, processors=None):
    rec.job = Job(prompt=list(prompt), config=config, emit=rec, logprobs=True, key=key, n=n, processors=processors)
    return rec.job


def solo(model, tok, prompt, config, worker=None, key=None, n=1):
    """``prompt`` run alone (the one-at-a-time path): (recorder, worker)."""
    worker = worker or make_worker(model, tok, config, 1)[0]
    rec = Recorder()
    worker._run(job_for(prompt, config, rec, key, n=n))
    assert rec.last()[0] == "done", rec.last()
    return rec, worker


def batched(worker, jobs):
    """Submit every (prompt, config, recorder, key) at once (before the worker starts,
    when it has not) and wait for all."""
    for prompt, config, rec, key in jobs:
        worker.submit(job_for(prompt, config, rec, key))
    if not worker._thread.is_alive():
        worker.start()
    for *_, rec, _ in jobs:
        assert rec.done.wait(TIMEOUT), "a batched job did not finish"


def batch_of(model, tok, config, prompts, max_batch=4):
    """``prompts`` submitted at once to a new batched worker, run to the end: (recorders, worker, scheduler)."""
    worker, sched = make_worker(model, tok, config, max_batch)
    try:
        recs = [Recorder() for _ in prompts]
        batched(worker, [(p, config, r, None) for p, r in zip(prompts, recs)])
    finally:
        worker.stop()
    return recs, worker, sched


@pytest.fixture
def llama(llama_model):
    model, tok = llama_model
    prompts = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts) and max(len(p) for p in prompts) > 3 * 8
    return model, tok, prompts


def test_four_concurrent_greedy_jobs_give_their_solo_tokens(llama):
    model, tok, prompts = llama
    config = cfg(max_tokens=30)  # the first rows still decode when the longest prompt joins
    alone = [solo(model, tok, p, config)[0] for p in prompts]
    worker, sched = make_worker(model, tok, config, 4)
    assert sched.enabled and sched.reason is None
    try:
        recs = [Recorder() for _ in prompts]
        batched(worker, [(p, config, r, None) for p, r in zip(prompts, recs)])
        rows_seen = sched.report()
    finally:
        worker.stop()
    for a, b in zip(alone, recs):
        assert b.events[0][0] == "start" and b.events[0][1]["cached_tokens"] == 0
        assert b.ids() == a.ids() and len(b.ids()) == config.max_tokens
        assert b.text() == a.text()
        da, db = a.last()[1], b.last()[1]
        for k in ("finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "choices"):
            assert db[k] == da[k], k
        lp_a = [lp.logprob for kind, p in a.events if kind == "piece" for lp in p.logprobs]
        lp_b = [lp.logprob for kind, p in b.events if kind == "piece" for lp in p.logprobs]
        assert lp_b == pytest.approx(lp_a, abs=1e-4)
    assert worker.stats["jobs"] == len(prompts) and worker.stats["errors"] == 0
    assert rows_seen["active_rows"] == 0 and rows_seen["decode_tok_s"] > 0
    assert max(sched.widths) == 4  # the four rows did decode together
    assert sched.widths[0] == 1  # and the first decoded while the others' prompts were being fed
    # every prompt token was computed once: all but the last by prefill, the last in the batch
    assert worker.stats["prompt_tokens_computed"] == sum(len(p) for p in prompts)


def test_concurrent_prompts_sharing_a_system_prompt_compute_it_once_and_give_their_solo_tokens(llama):
    model, tok, prompts = llama
    config = cfg(max_tokens=10)
    system = tok.encode(" ".join(TEXTS[:3]), add_special_tokens=False)  # longer than 3 prefill chunks
    users = [system + p for p in prompts]
    alone = [solo(model, tok, p, config)[0] for p in users]
    recs, worker, sched = batch_of(model, tok, config, users)
    cached = [r.events[0][1]["cached_tokens"] for r in recs]
    shared = len(system) // B * B  # the system prompt's whole blocks (the rest is fed again)
    assert cached[0] == 0 and shared > 0 and all(c >= shared for c in cached[1:]), cached
    for a, b in zip(alone, recs):
        assert b.ids() == a.ids() and b.text() == a.text()
    # the shared blocks were fed once: the later prompts fed only what follows their cached part
    assert worker.stats["prompt_tokens_computed"] == sum(len(p) - c for p, c in zip(users, cached))
    assert worker.stats["prompt_tokens_computed"] <= sum(len(p) for p in users) - 3 * shared


def test_fed_prompts_serve_concurrent_requests_from_memory_and_files_get_only_final_entries(llama, tmp_path):
    model, tok, prompts = llama
    config = cfg(max_tokens=6)
    system = tok.encode(" ".join(TEXTS[:3]), add_special_tokens=False)
    users = [system + p for p in prompts]
    store = PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)])
    worker, sched = make_worker(model, tok, config, 4, store)
    try:
        recs = [Recorder() for _ in users]
        batched(worker, [(p, config, r, None) for p, r in zip(users, recs)])
    finally:
        worker.stop()  # writes every deferred file
    cached = [r.events[0][1]["cached_tokens"] for r in recs]
    assert cached[0] == 0 and all(c >= len(system) // B * B > 0 for c in cached[1:]), cached
    assert {r.events[0][1]["cached_tier"] for r in recs[1:]} == {"memory"}
    # the files hold the requests' final entries (prompt and reply, and their prompts' ends), nothing else
    want = set()
    for p, r in zip(users, recs):
        chain, held = Chain(worker.scope.namespace, p + r.ids()[:-1], B), len(p) + len(r.ids()) - 1
        want |= {*chain.blocks, *(chain.entry(e) for e in (len(p) - 1, len(p), held) if e % B)}
    assert {f.name[: -len(".safetensors")] for f in tmp_path.glob("[be]*.safetensors")} == want


def test_a_batched_jobs_store_entry_is_the_solo_ones_and_the_next_turn_continues_alike(llama):
    model, tok, prompts = llama
    config = cfg()
    worker, sched = make_worker(model, tok, config, 4)
    try:
        recs = [Recorder() for _ in prompts]
        batched(worker, [(p, config, r, f"key{i}") for i, (p, r) in enumerate(zip(prompts, recs))])
        for i, (p, rec) in enumerate(zip(prompts, recs)):
            a, solo_worker = solo(model, tok, p, config, key=f"key{i}")
            reply = rec.ids()
            assert reply == a.ids()
            follow = p + reply + tok.encode(" And then?", add_special_tokens=False)
            for w in (worker, solo_worker):  # the entry each put: prompt + reply but its last token
                state, tier = w.store.checkout(w.scope, model, follow, config.shape)
                assert tier == "memory" and state.tokens == p + reply[:-1]
                assert state.cache[0].offset == len(state.tokens)
            nxt_batch = Recorder()
            batched(worker, [(follow, config, nxt_batch, f"key{i}")])
            nxt_solo, _ = solo(model, tok, follow, config, worker=solo_worker, key=f"key{i}")
            cached = [nxt_batch.events[0][1]["cached_tokens"], nxt_solo.events[0][1]["cached_tokens"]]
            assert cached == [len(p + reply) - 1] * 2
            assert nxt_batch.ids() == nxt_solo.ids()
    finally:
        worker.stop()


def test_cancelling_one_of_three_streams_mid_decode_leaves_the_others_their_solo_tokens(llama):
    model, tok, prompts = llama
    config = cfg(max_tokens=20)
    prompts = [prompts[1], prompts[3], prompts[0]]  # the longest last: it joins while the others decode
    alone = [solo(model, tok, p, config)[0] for p in prompts]
    worker, sched = make_worker(model, tok, config, 4)
    try:
        recs = [Recorder(), Recorder(cancel_after=10), Recorder()]
        batched(worker, [(p, config, r, "k") for p, r in zip(prompts, recs)])
        for r in (recs[0], recs[2]):
            assert r.done.wait(TIMEOUT)
        for _ in range(100):  # the cancelled row leaves at the next token
            if worker.stats["cancelled"] == 1 and not sched.report()["active_rows"]:
                break
            threading.Event().wait(0.05)
    finally:
        worker.stop()
    assert worker.stats["cancelled"] == 1 and worker.stats["errors"] == 0 and max(sched.widths) == 3
    assert recs[0].ids() == alone[0].ids() and recs[2].ids() == alone[2].ids()
    assert recs[0].last()[0] == recs[2].last()[0] == "done"
    cut = recs[1]
    assert not any(kind in ("done", "error") for kind, _ in cut.events)
    assert 10 <= len(cut.ids()) < config.max_tokens and cut.ids() == alone[1].ids()[: len(cut.ids())]


def test_stop_strings_and_top_logprobs_in_a_batch_are_the_solo_ones(llama):
    model, tok, prompts = llama
    config = cfg(max_tokens=16)
    plain = [solo(model, tok, p, config)[0] for p in prompts[1:4:2]]
    stops = [[a.text()[5:8]] for a in plain]  # cut each reply after a few characters

    def events_of(worker, run_alone):
        recs = []
        for p, stop in zip(prompts[1:4:2], stops):
            rec = Recorder()
            rec.job = Job(prompt=list(p), config=config, emit=rec, logprobs=True, top_logprobs=3, stop=stop, key="s")
            recs.append(rec)
            if run_alone:
                worker._run(rec.job)
            else:
                worker.submit(rec.job)
        if not run_alone:
            worker.start()
            assert all(r.done.wait(TIMEOUT) for r in recs)
        return recs

    alone = events_of(make_worker(model, tok, config, 1)[0], True)
    worker, sched = make_worker(model, tok, config, 4)
    try:
        together = events_of(worker, False)
    finally:
        worker.stop()
    assert max(sched.widths) == 2
    for a, b in zip(alone, together):
        assert b.last()[1]["finish_reason"] == a.last()[1]["finish_reason"] == "stop"
        assert b.text() == a.text() and b.ids() == a.ids()
        tops_a = [[t[1] for t in lp.top] for k, p in a.events if k == "piece" for lp in p.logprobs]
        tops_b = [[t[1] for t in lp.top] for k, p in b.events if k == "piece" for lp in p.logprobs]
        assert tops_b == tops_a and all(len(t) == 3 for t in tops_a)


def test_n_choices_are_rows_of_one_prefill_and_give_the_solo_choices(llama):
    model, tok, prompts = llama
    config = cfg(max_tokens=16)
    alone, worker1 = solo(model, tok, prompts[0], config, n=3)
    other_alone = solo(model, tok, prompts[1], config)[0]
    worker, sched = make_worker(model, tok, config, 4)
    try:
        many, other = Recorder(), Recorder()
        for p, r, n in ((prompts[0], many, 3), (prompts[1], other, 1)):
            worker.submit(job_for(p, config, r, n=n))
        worker.start()
        assert many.done.wait(TIMEOUT) and other.done.wait(TIMEOUT)
    finally:
        worker.stop()
    assert max(sched.widths) == 4  # three choices and the other job in one call
    for i in range(3):
        assert many.ids(i) == alone.ids(i) and len(many.ids(i)) == 16
    assert many.last()[1]["choices"] == alone.last()[1]["choices"]
    assert many.last()[1]["completion_tokens"] == alone.last()[1]["completion_tokens"] == 48
    assert other.ids() == other_alone.ids()
    # the prompt was fed once, its last token once per choice (as alone)
    assert worker.stats["prompt_tokens_computed"] == worker1.stats["prompt_tokens_computed"] + len(prompts[1])


def test_seeded_sampled_jobs_decode_in_the_batch_with_their_solo_draws(llama):
    model, tok, prompts = llama
    seeded = cfg(temp=0.8, seed=7, max_tokens=10)
    alone = solo(model, tok, prompts[1], seeded)[0]
    choices_alone = solo(model, tok, prompts[2], seeded.updated(seed=11, max_tokens=8), n=2)[0]
    worker, sched = make_worker(model, tok, seeded, 4)
    try:
        recs = [Recorder(), Recorder(), Recorder()]
        worker.submit(job_for(prompts[0], cfg(temp=0.9, max_tokens=16), recs[0]))  # unseeded: draws in between
        worker.submit(job_for(prompts[1], seeded, recs[1]))
        worker.submit(job_for(prompts[2], seeded.updated(seed=11, max_tokens=8), recs[2], n=2))
        worker.start()
        assert all(r.done.wait(TIMEOUT) for r in recs)
    finally:
        worker.stop()
    assert max(sched.widths) == 4  # the seeded rows decoded with the others
    assert recs[1].ids() == alone.ids() and len(alone.ids()) == 10
    assert [recs[2].ids(i) for i in range(2)] == [choices_alone.ids(i) for i in range(2)]
    assert recs[2].ids(0) != recs[2].ids(1)  # choice 1 is seeded 12, not 11
    assert worker.stats["jobs"] == 3 and worker.stats["errors"] == 0


def test_a_job_with_more_choices_than_rows_runs_alone_with_its_solo_tokens(llama):
    model, tok, prompts = llama
    config = cfg(max_tokens=6)
    wide_alone = solo(model, tok, prompts[3], config, n=3)[0]
    worker, sched = make_worker(model, tok, config, 2)
    try:
        recs = [Recorder(), Recorder()]
        worker.submit(job_for(prompts[0], cfg(), recs[0]))
        worker.submit(job_for(prompts[3], config, recs[1], n=3))  # more choices than max_batch
        worker.start()
        assert all(r.done.wait(TIMEOUT) for r in recs)
    finally:
        worker.stop()
    assert [recs[1].ids(i) for i in range(3)] == [wide_alone.ids(i) for i in range(3)]
    assert max(sched.widths) == 1 and worker.stats["jobs"] == 2 and worker.stats["errors"] == 0


def test_a_row_whose_processor_raises_fails_alone(llama):
    model, tok, prompts = llama
    config = cfg(max_tokens=20)
    alone = [solo(model, tok, p, config)[0] for p in prompts[1:3]]

    def breaks_at_twelve():
        def process(context, logits):
            if len(context) >= len(prompts[3]) + 12:
                raise RuntimeError("a broken processor")
            return logits

        return [process]

    worker, sched = make_worker(model, tok, config, 4)
    try:
        recs = [Recorder(), Recorder(), Recorder()]
        worker.submit(job_for(prompts[1], config, recs[0]))
        worker.submit(job_for(prompts[3], config, recs[1], key="broken", n=2, processors=breaks_at_twelve))
        worker.submit(job_for(prompts[2], config, recs[2]))
        worker.start()
        assert all(r.done.wait(TIMEOUT) for r in recs)
    finally:
        worker.stop()
    assert recs[1].last() == ("error", "internal error while generating; see the server log")
    assert [kind for kind, _ in recs[1].events].count("error") == 1 and max(sched.widths) == 4
    assert recs[0].ids() == alone[0].ids() and recs[2].ids() == alone[1].ids()
    assert worker.stats["errors"] == 1 and worker.stats["jobs"] == 3
    state, tier = worker.store.checkout(worker.scope, model, prompts[3] + recs[1].ids(), config.shape)
    assert state.tokens == prompts[3][:-1]  # its prompt was stored when fed; nothing of its failed reply


def test_the_queue_holds_the_jobs_past_the_batchs_rows(llama):
    from mlx_chatcache.server.worker import QueueFull

    model, tok, prompts = llama
    config = cfg(max_tokens=100000)
    worker = GenerationWorker(model, tok, PromptStore([MemoryTier(1 << 30)]), config, max_queue=1)
    sched = BatchScheduler(worker, 2)
    recs = [Recorder() for _ in range(4)]
    worker.start()
    try:
        for p, r in zip(prompts[:2], recs):
            worker.submit(job_for(p, config, r))
            for _ in range(200):  # admitted: the queue is free again
                if not worker.waiting():
                    break
                threading.Event().wait(0.05)
        for _ in range(200):
            if sched.report()["active_rows"] == 2:
                break
            threading.Event().wait(0.05)
        assert sched.report()["active_rows"] == 2
        worker.submit(job_for(prompts[2], config, recs[2]))  # waits in the queue
        with pytest.raises(QueueFull):
            worker.submit(job_for(prompts[3], config, recs[3]))
        assert sched.report()["waiting"] == 1
    finally:
        for r in recs[:3]:
            r.job.cancel()
        worker.stop()


def test_a_rotating_window_falls_back_to_one_at_a_time_and_health_says_why(llama_model, tiny_model_dirs, caplog):
    import logging

    from starlette.testclient import TestClient

    from mlx_chatcache.server.app import create_app
    from mlx_chatcache.server.service import Service

    model, tok = llama_model
    window = cfg(max_kv_size=64)
    with caplog.at_level(logging.INFO, logger="mlxcc.serve"):
        worker, sched = make_worker(model, tok, window, 4)
    assert not sched.enabled and "rotating window" in sched.reason
    assert [r.getMessage() for r in caplog.records] == [f"requests are generated one at a time: {sched.reason}"]
    sliding, stok = load(str(tiny_model_dirs["sliding"]))
    service = Service(sliding, stok, str(tiny_model_dirs["sliding"]), PromptStore([MemoryTier(1 << 30)]), cfg(),
                      max_queue=4, max_batch=4)  # fmt: skip
    with TestClient(create_app(service)) as client:
        batch = client.get("/health").json()["batch"]
        assert batch["enabled"] is False and "RotatingKVCache" in batch["reason"] and batch["max_batch"] == 4
        r = client.post("/v1/completions", json={"prompt": TEXTS[1], "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    one = make_worker(model, tok, cfg(), 1)[1]
    assert not one.enabled and "--max-batch is 1" in one.reason


def test_health_reports_an_enabled_batch(llama_model, tiny_model_dirs):
    from starlette.testclient import TestClient

    from mlx_chatcache.server.app import create_app
    from mlx_chatcache.server.service import Service

    model, tok = llama_model
    service = Service(model, tok, str(tiny_model_dirs["llama"]), PromptStore([MemoryTier(1 << 30)]), cfg(),
                      max_queue=4, max_batch=3)  # fmt: skip
    with TestClient(create_app(service)) as client:
        r = client.post("/v1/completions", json={"prompt": TEXTS[1], "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        batch = client.get("/health").json()["batch"]
    assert batch["enabled"] is True and batch["reason"] is None and batch["max_batch"] == 3
    assert {"active_rows", "prefilling", "waiting", "decode_tok_s"} <= set(batch)


@pytest.mark.parametrize("value", ["0", "65", "x"])
def test_max_batch_out_of_range_is_one_line(value):
    line = one_error_line(mlxcc("serve", "--max-batch", value))
    assert "--max-batch" in line and (value in line)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_every_choice_of_a_one_token_prompt_holds_the_kv_dtype_asked(llama, max_batch):
    """The copies n choices generate on (here of an empty cache) hold K/V in the dtype asked."""
    model, tok, prompts = llama
    config = cfg(max_tokens=4, kv_dtype="float16")
    worker, _ = make_worker(model, tok, config, max_batch)
    put, dtypes = worker._put, []

    def recorded(job, tokens, cache, **how):
        dtypes.append({a.dtype for c in cache for a in c.flat_state()})
        put(job, tokens, cache, **how)

    worker._put = recorded
    try:
        rec = Recorder()
        worker.submit(job_for(prompts[1][:1], config, rec, n=3))
        worker.start()
        assert rec.done.wait(TIMEOUT) and rec.last()[0] == "done", rec.last()
    finally:
        worker.stop()
    assert len(dtypes) == 3 and all(d == {mx.float16} for d in dtypes), dtypes


def test_float16_kv_rows_give_their_solo_float16_tokens(llama):
    """A batch holds K/V in the dtype asked, as each row alone does (else its tokens drift)."""
    model, tok, prompts = llama
    config = cfg(max_tokens=20, kv_dtype="float16")
    alone = [solo(model, tok, p, config)[0] for p in prompts[:3]]
    recs, worker, sched = batch_of(model, tok, config, prompts[: len(alone)])
    assert max(sched.widths) >= 2
    for a, b in zip(alone, recs):
        assert b.ids() == a.ids() and len(b.ids()) == 20
        lp_a = [lp.logprob for kind, p in a.events if kind == "piece" for lp in p.logprobs]
        lp_b = [lp.logprob for kind, p in b.events if kind == "piece" for lp in p.logprobs]
        assert lp_b == pytest.approx(lp_a, abs=1e-3)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_the_worker_serves_on_a_generation_stream_holding_the_wired_limit(llama, monkeypatch, max_batch):
    """One at a time or batched, the worker's model calls run on its thread's generation
    stream (not the default one), inside the wired-memory limit held while it serves."""
    import contextlib

    import mlx_chatcache.server.worker as worker_module

    model, tok, prompts = llama
    held = []

    @contextlib.contextmanager
    def wired(m):
        held.append(("in", m))
        yield
        held.append(("out", m))

    monkeypatch.setattr(worker_module, "wired_limit", wired)
    main, seen = mx.default_stream(mx.default_device()), []

    def spy(tokens, logits):
        seen.append(mx.default_stream(mx.default_device()))
        return logits

    worker, _ = make_worker(model, tok, cfg(max_tokens=3), max_batch)
    rec = Recorder()
    worker.submit(job_for(prompts[0], cfg(max_tokens=3), rec, processors=lambda: [spy]))
    worker.start()
    assert rec.done.wait(TIMEOUT) and rec.last()[0] == "done"
    assert held == [("in", model)]
    worker.stop()
    assert held == [("in", model), ("out", model)]
    assert seen and all(s != main for s in seen)


def test_messages_and_responses_requests_decode_in_one_batch_with_their_solo_replies(llama_model, tiny_model_dirs):
    """Anthropic Messages and OpenAI Responses requests are jobs like chat completions: sent
    together, their rows share model calls, and each reply is the one it gets alone."""
    import concurrent.futures

    from starlette.testclient import TestClient

    from mlx_chatcache.server.app import create_app
    from mlx_chatcache.server.service import Service

    model, tok = llama_model
    service = Service(model, tok, str(tiny_model_dirs["llama"]), PromptStore([]), cfg(max_tokens=10),
                      max_queue=8, max_batch=4)  # fmt: skip
    step, widths = service.batch.decode.step, []

    def recorded():
        widths.append(len(service.batch.decode))
        return step()

    service.batch.decode.step = recorded
    sent = [("/v1/messages", {"model": service.model_id, "max_tokens": 10, "temperature": 0,
                              "messages": [{"role": "user", "content": TEXTS[0]}]}),
            ("/v1/responses", {"model": service.model_id, "max_output_tokens": 10, "temperature": 0, "input": TEXTS[2]}),
            ("/v1/messages", {"model": service.model_id, "max_tokens": 10, "temperature": 0, "system": TEXTS[3],
                              "messages": [{"role": "user", "content": TEXTS[1]}]})]  # fmt: skip

    def reply(client, path, body):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["content"][0]["text"] if path == "/v1/messages" else out["output"][0]["content"][0]["text"]

    with TestClient(create_app(service)) as client:
        alone = [reply(client, *s) for s in sent]
        assert max(widths) == 1
        widths.clear()
        with concurrent.futures.ThreadPoolExecutor(len(sent)) as pool:
            together = list(pool.map(lambda s: reply(client, *s), sent))
    assert together == alone and all(alone)
    assert max(widths) >= 2  # rows of different dialects in one model call
