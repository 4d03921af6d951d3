"""Speculative decoding in ``mlxcc serve`` (server/batch.py, server/worker.py).

Invariants: a request with a draft source gives the tokens, text and events it gives without one
(greedy), whether it decodes alone with drafts, joins a batch part way (its row then decodes
without drafts) or runs on the one-at-a-time path; ``num_draft_tokens: 0`` turns drafting off;
``/health`` says how rows with drafts run and counts the drafts; bad values are a 400.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from server_process import ServerProcess
from test_server_batch import Recorder, batched, cfg, job_for, make_worker

from mlx_chatcache.models.draft_pair import DraftPair
from mlx_chatcache.server.batch import SOLO_POLICY
from mlx_chatcache.server.protocol import RequestError, parse_chat

TEXTS = ["The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
         "Once upon a time",
         "A list of things to buy: apples, bread, milk, eggs, butter, cheese, rice, beans and tea.",
         "Hello there, how are you?"]  # fmt: skip


@pytest.fixture(scope="module")
def self_drafting(llama_model):
    """The tiny model paired with itself: its drafts are always right (every path is exercised)."""
    model, tok = llama_model
    return DraftPair(model, model), model, tok, [tok.encode(t, add_special_tokens=False) for t in TEXTS]


def plain_ids(model, tok, prompt, config):
    worker, _ = make_worker(model, tok, config, 1)
    rec = Recorder()
    worker._run(job_for(prompt, config, rec))
    return rec


def test_a_lone_request_decodes_with_drafts_and_gives_its_plain_tokens(self_drafting):
    pair, model, tok, prompts = self_drafting
    config = cfg(max_tokens=20, num_draft_tokens=3)
    want = plain_ids(model, tok, prompts[0], config.updated(num_draft_tokens=0))
    for max_batch in (1, 4):  # the one-at-a-time path, and alone in the scheduler
        worker, sched = make_worker(pair, tok, config, max_batch)
        try:
            rec = Recorder()
            batched(worker, [(prompts[0], config, rec, None)])
            report = sched.report()
        finally:
            worker.stop()
        assert rec.ids() == want.ids() and rec.text() == want.text()
        assert rec.last()[1]["finish_reason"] == want.last()[1]["finish_reason"] == "length"
        assert worker.drafts["accepted"] == worker.drafts["drafted"] > 0
        assert report["drafts"]["policy"] == SOLO_POLICY and report["drafts"]["acceptance"] == 1.0
        assert max(sched.widths, default=0) == 0  # no batched call: every token came from a solo round


def test_requests_arriving_while_one_drafts_join_the_batch_and_all_give_their_plain_tokens(self_drafting):
    pair, model, tok, prompts = self_drafting
    config = cfg(max_tokens=24, num_draft_tokens=3)
    want = [plain_ids(model, tok, p, config.updated(num_draft_tokens=0)) for p in prompts]
    worker, sched = make_worker(pair, tok, config, 4)
    try:
        first = Recorder()
        worker.submit(job_for(prompts[0], config, first))
        worker.start()
        while len(first.ids()) < 4:  # the first decodes alone with drafts
            assert not first.done.is_set()
            first.done.wait(0.005)
        rest = [Recorder() for _ in prompts[1:]]
        batched(worker, [(p, config, r, None) for p, r in zip(prompts[1:], rest)])
        assert first.done.wait(60)
    finally:
        worker.stop()
    for w, r in zip(want, [first, *rest]):
        assert r.ids() == w.ids() and r.text() == w.text()
    assert worker.drafts["accepted"] > 0 and max(sched.widths) >= 2  # drafted alone, then batched


def test_num_draft_tokens_zero_turns_drafting_off(self_drafting):
    pair, model, tok, prompts = self_drafting
    config = cfg(max_tokens=8, num_draft_tokens=0)
    worker, sched = make_worker(pair, tok, config, 4)
    try:
        rec = Recorder()
        batched(worker, [(prompts[1], config, rec, None)])
    finally:
        worker.stop()
    assert rec.ids() == plain_ids(model, tok, prompts[1], config).ids()
    assert worker.drafts == {"rounds": 0, "drafted": 0, "accepted": 0} and len(sched.widths) == 8


def test_request_fields_of_speculative_decoding_are_checked():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat({**body, "num_draft_tokens": 0, "prompt_lookup": "off"}).num_draft_tokens == 0
    for bad in ({"num_draft_tokens": -1}, {"num_draft_tokens": 1.5}, {"prompt_lookup": "yes"}):
        with pytest.raises(RequestError) as e:
            parse_chat({**body, **bad})
        assert e.value.status == 400 and e.value.param == next(iter(bad))


def test_serve_with_a_draft_model_answers_as_without_and_reports_drafts(tiny_model_dirs, tmp_path):
    def chat(server, **extra):
        body = {"messages": [{"role": "user", "content": TEXTS[0]}], "max_tokens": 12, "temperature": 0, **extra}
        req = urllib.request.Request(server.base_url + "/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]

    model = tiny_model_dirs["llama"]
    with ServerProcess(model, tmp_path / "c", "--draft-model", model, "--num-draft-tokens", "4") as server:
        drafted = chat(server)
        plain = chat(server, num_draft_tokens=0, prompt_lookup="off")
        health = server.health()
    assert drafted == plain
    drafts = health["batch"]["drafts"]
    assert drafts["policy"] == SOLO_POLICY and drafts["refusal"] is None and drafts["accepted"] > 0
