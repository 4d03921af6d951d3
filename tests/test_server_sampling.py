"""Sampling fields of the server: the library, the worker's :class:`Job`, and over HTTP.

- ``logit_bias`` +100 on one id makes greedy decoding emit only that id; -100
  on the greedy first token changes it (library ``generate``/``stream_generate``).
- ``logprobs``: each sampled token's log-probability (and the top ones) equals
  ``mx.log_softmax`` of the model's own logits for the whole context, computed
  without a cache, within 1e-4; shown in both endpoints' shapes (full and streamed).
- ``n`` > 1: n choices, the prompt fed once (``prompt_tokens_computed`` is the
  prompt plus one token per extra choice), usage counts the prompt once, and
  choice ``i`` with seed ``s`` is the one-choice reply with seed ``s + i``.
- A job's ``processors`` hook is built afresh for each choice and its
  ``postprocess`` hook makes the content and tool calls.
- Every out-of-range value of a new field is refused by the range table, and
  by the service as a 400 naming the field.
- Over HTTP with the ``openai`` client, both endpoints, streamed and not: logprobs
  equal the model's log-softmax within 1e-4 (greedy), ``n`` = 3 gives three choices
  with the prompt fed and counted once, ``logit_bias`` +100 forces a token and -100
  bans the greedy one, presence and frequency penalties give the library's output.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_chatcache.config import DEFAULTS, SettingError, check_setting
from mlx_chatcache.generation.sample import logit_bias_processor
from mlx_chatcache.generation.text import generate, stream_generate
from mlx_chatcache.server.protocol import RequestError
from mlx_chatcache.server.responses import Reply
from mlx_chatcache.server.service import Service
from mlx_chatcache.server.worker import GenerationWorker, Job
from mlx_chatcache.store.store import PromptStore
from mlx_chatcache.store.tiers import MemoryTier

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps."


def cfg(**changes):
    return dataclasses.replace(DEFAULTS, **changes)


def prompt_of(tokenizer, n=12):
    return tokenizer.encode(TEXT, add_special_tokens=False)[:n]


def run(model, tokenizer, job_kw, config, worker=None):
    """Run one job on a fresh worker (or ``worker``), synchronously: (events, worker)."""
    worker = worker or GenerationWorker(model, tokenizer, PromptStore([MemoryTier(1 << 30)]), config, max_queue=1)
    events = []
    worker._run(Job(emit=events.append, config=config, **job_kw))
    assert events[-1][0] == "done", events[-1]
    return events, worker


def pieces(events):
    return [v for k, v in events if k == "piece"]


def choice_ids(events, index=0):
    return [t.id for p in pieces(events) if p.index == index for t in p.logprobs]


# ------------------------------------------------------------------ logit_bias
def test_logit_bias_forces_a_token_and_removes_the_argmax(llama_model):
    model, tok = llama_model
    prompt = prompt_of(tok)
    greedy = [r.token for r in stream_generate(model, tok, prompt, config=cfg(max_tokens=4))]
    target = next(t for t in range(greedy[0] + 5, 10**6) if t not in tok.eos_token_ids)
    steps = list(stream_generate(model, tok, prompt, config=cfg(max_tokens=4, logit_bias=((target, 100.0),))))
    assert [r.token for r in steps] == [target] * 4
    banned = cfg(max_tokens=1, logit_bias=((greedy[0], -100.0),))
    assert next(iter(stream_generate(model, tok, prompt, config=banned))).token != greedy[0]
    forced = generate(model, tok, prompt, config=cfg(max_tokens=4, logit_bias=((target, 100.0),)))
    assert forced == "".join(r.text for r in steps)


def test_logit_bias_past_the_vocabulary_is_one_line_before_generating(llama_model):
    from mlx_chatcache.errors import UsageError

    model, tok = llama_model
    with pytest.raises(UsageError, match="logit_bias: token id 99999"):
        generate(model, tok, prompt_of(tok), config=cfg(max_tokens=2, logit_bias=((99999, 1.0),)))


# ------------------------------------------------------------------ logprobs
def reference_logprobs(model, context):
    """log_softmax of the model's logits for the last token of ``context``, no cache."""
    logits = model(mx.array([context]))[0, -1].astype(mx.float32)
    return nn.log_softmax(logits)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_logprobs_are_the_models_log_softmax_in_both_shapes(llama_model, kind):
    model, tok = llama_model
    prompt = prompt_of(tok)
    events, _ = run(model, tok, {"prompt": prompt, "logprobs": True, "top_logprobs": 3}, cfg(max_tokens=6))
    done = events[-1][1]
    entries = [t for p in pieces(events) for t in p.logprobs]
    assert len(entries) == done["completion_tokens"] - (done["finish_reason"] == "stop") > 0
    context = list(prompt)
    for t in entries:
        ref = reference_logprobs(model, context)
        assert abs(t.logprob - ref[t.id].item()) < 1e-4
        assert t.id == int(mx.argmax(ref).item())  # greedy
        top_ids = sorted(range(ref.shape[0]), key=lambda i: -ref[i].item())[:3]
        assert [i for _, i, _ in t.top] == top_ids
        assert all(abs(lp - ref[i].item()) < 1e-4 for _, i, lp in t.top)
        assert t.token == tok.decode([t.id])
        context.append(t.id)

    reply = Reply(kind, "m", logprobs=True)
    body = reply.full(pieces(events), done)
    (choice,) = body["choices"]
    text = "".join(p.text for p in pieces(events))
    if kind == "chat":
        content = choice["logprobs"]["content"]
        assert [c["logprob"] for c in content] == [t.logprob for t in entries]
        assert [c["token"] for c in content] == [t.token for t in entries]
        assert all(c["bytes"] == list(c["token"].encode()) for c in content)
        tops = [[x["logprob"] for x in c["top_logprobs"]] for c in content]
        assert tops == [[lp for *_, lp in t.top] for t in entries]
        assert choice["message"]["content"] == text
        chunks = [reply.piece_chunk(p) for p in pieces(events)]
        streamed = [c for ch in chunks for c in (ch["choices"][0]["logprobs"] or {}).get("content", [])]
        assert streamed == content
    else:
        lp = choice["logprobs"]
        assert lp["token_logprobs"] == [t.logprob for t in entries] and lp["tokens"] == [t.token for t in entries]
        assert lp["text_offset"] == [sum(len(e.token) for e in entries[:i]) for i in range(len(entries))]
        assert [max(d.values()) for d in lp["top_logprobs"]] == pytest.approx([t.logprob for t in entries])
        assert choice["text"] == text
    assert Reply(kind, "m").full(pieces(events), done)["choices"][0]["logprobs"] is None


# ------------------------------------------------------------------ n > 1
def test_n_choices_share_one_prefill_and_choice_i_is_seed_plus_i(llama_model):
    model, tok = llama_model
    prompt = prompt_of(tok)
    config = cfg(max_tokens=5, temp=1.5, seed=1234)
    events, worker = run(model, tok, {"prompt": prompt, "n": 3, "logprobs": True}, config)
    done = events[-1][1]
    assert [c["index"] for c in done["choices"]] == [0, 1, 2]
    assert worker.stats["prompt_tokens_computed"] == len(prompt) + 2  # once, then each choice's last token
    assert done["prompt_tokens"] == len(prompt)
    assert done["completion_tokens"] == sum(c["completion_tokens"] for c in done["choices"])
    outs = [choice_ids(events, i) for i in range(3)]
    for i in range(3):
        single, w = run(model, tok, {"prompt": prompt, "logprobs": True}, cfg(max_tokens=5, temp=1.5, seed=1234 + i))
        assert choice_ids(single) == outs[i]
        assert w.stats["prompt_tokens_computed"] == len(prompt)
    assert len({tuple(o) for o in outs}) > 1  # the seeds differ, so do the samples
    body = Reply("chat", "m").full(pieces(events), done)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert [c["message"]["content"] for c in body["choices"]] == [
        "".join(p.text for p in pieces(events) if p.index == i) for i in range(3)]  # fmt: skip


def test_n_choices_after_a_cached_prefix_feed_only_the_rest(llama_model):
    model, tok = llama_model
    prompt = prompt_of(tok, 12)
    config = cfg(max_tokens=3)
    _, worker = run(model, tok, {"prompt": prompt[:8]}, config)
    before = worker.stats["prompt_tokens_computed"]
    events, _ = run(model, tok, {"prompt": prompt, "n": 2}, config, worker)
    cached = events[0][1]["cached_tokens"]
    assert cached >= 7 and events[-1][1]["cached_tokens"] == cached
    assert worker.stats["prompt_tokens_computed"] - before == len(prompt) - cached + 1  # + 1 for the 2nd choice
    texts = ["".join(p.text for p in pieces(events) if p.index == i) for i in (0, 1)]
    assert texts[0] == texts[1]  # greedy: the same reply on each copy


def test_job_hooks_processors_per_choice_and_postprocess(llama_model):
    model, tok = llama_model
    made = []

    def processors():
        made.append(1)
        return [logit_bias_processor(((7, 100.0),))]

    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    events, _ = run(model, tok, {"prompt": prompt_of(tok), "n": 2, "logprobs": True, "processors": processors,
                                 "postprocess": lambda text: (None, calls)}, cfg(max_tokens=3))  # fmt: skip
    assert len(made) == 2 and choice_ids(events, 0) == choice_ids(events, 1) == [7, 7, 7]
    done = events[-1][1]
    assert [c["finish_reason"] for c in done["choices"]] == ["tool_calls", "tool_calls"]
    body = Reply("chat", "m").full(pieces(events), done)
    assert body["choices"][1]["message"] == {"role": "assistant", "content": None, "tool_calls": calls}


def test_streamed_chunks_carry_the_choice_index_and_finish(llama_model):
    model, tok = llama_model
    events, _ = run(model, tok, {"prompt": prompt_of(tok), "n": 2}, cfg(max_tokens=3))
    reply = Reply("completion", "m")
    chunks = [reply.piece_chunk(v) for k, v in events if k == "piece"] + reply.finish_chunks(events[-1][1])
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert [c["choices"][0]["finish_reason"] for c in chunks[-2:]] == ["length", "length"]
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)


# ------------------------------------------------------------------ ranges
BAD = [("presence_penalty", 3), ("presence_penalty", "abc"), ("frequency_penalty", -2.5),
       ("frequency_penalty", float("inf")), ("logit_bias", {"x": 1}), ("logit_bias", {"1": 100.5}),
       ("logit_bias", {"-1": 1}), ("logit_bias", [1, 2]), ("logit_bias", {"1": True}), ("top_logprobs", 21),
       ("top_logprobs", -1), ("n", 0), ("n", 9), ("n", 2.0)]  # fmt: skip


@pytest.mark.parametrize("name,value", BAD)
def test_every_invalid_value_is_refused_by_the_range_table(name, value):
    with pytest.raises(SettingError, match="^must be .*, got "):
        check_setting(name, value)


def test_valid_values_pass_the_table():
    assert check_setting("logit_bias", {"5": 100, 3: -1.5}) == ((3, -1.5), (5, 100.0))
    assert check_setting("presence_penalty", -2) == -2.0 and check_setting("n", 8) == 8
    assert check_setting("top_logprobs", 0) == 0


@pytest.mark.parametrize("name,value", [b for b in BAD if b[0] not in ("n", "top_logprobs")]
                         + [("logit_bias", {"99999": 1}), ("top_k", -1), ("repetition_penalty", -1)])  # fmt: skip
def test_the_service_refuses_bad_sampling_fields_naming_them(llama_model, name, value):
    model, tok = llama_model
    service = Service(model, tok, "tiny", PromptStore([]), DEFAULTS, max_queue=1, context_length=512)
    req = SimpleNamespace(kind="completion", max_tokens=4, temperature=None, seed=None, top_p=None, **{name: value})
    with pytest.raises(RequestError) as got:
        service.job_config(req, 10)
    assert got.value.status == 400 and got.value.param == name and "\n" not in got.value.message


def test_the_service_maps_the_sampling_fields(llama_model):
    model, tok = llama_model
    service = Service(model, tok, "tiny", PromptStore([]), DEFAULTS, max_queue=1, context_length=512)
    req = SimpleNamespace(kind="completion", max_tokens=4, temperature=None, seed=None, top_p=None, top_k=5,
                          min_p=0.1, repetition_penalty=1.1, repetition_context_size=30, presence_penalty=0.5,
                          frequency_penalty=-0.5, logit_bias={"3": -100})  # fmt: skip
    c = service.job_config(req, 10)
    assert (c.top_k, c.min_p, c.repetition_penalty, c.repetition_context_size) == (5, 0.1, 1.1, 30)
    assert (c.presence_penalty, c.frequency_penalty, c.logit_bias) == (0.5, -0.5, ((3, -100.0),))
    req.repetition_penalty = 0  # mlx-lm's "off"
    assert service.job_config(req, 10).repetition_penalty is None


def test_a_chat_session_keeps_the_new_settings_across_save_and_load(llama_model, tmp_path):
    from mlx_chatcache.chat.session import ChatSession

    model, tok = llama_model
    config = cfg(max_tokens=3, presence_penalty=0.5, frequency_penalty=-1.0, logit_bias=((3, -100.0), (9, 2.5)))
    s = ChatSession(model, tok, config=config)
    s.ask("Good morning!")
    s.save(tmp_path / "s.safetensors")
    loaded = ChatSession.load(tmp_path / "s.safetensors", model, tok)
    assert (loaded.config.presence_penalty, loaded.config.frequency_penalty, loaded.config.logit_bias) == (
        0.5, -1.0, ((3, -100.0), (9, 2.5)))  # fmt: skip


# ------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    import openai
    from server_process import ServerProcess

    with ServerProcess(tiny_model_dirs["llama"], tmp_path_factory.mktemp("cache"), "--max-tokens", "64",
                       "--context-length", "512") as s:  # fmt: skip
        s.client = openai.OpenAI(base_url=s.base_url, api_key="unused", timeout=60, max_retries=0)
        yield s


MESSAGES = [{"role": "user", "content": "Name three rivers of Europe."}]


def greedy_reference(model, context, steps):
    """The greedy continuation of ``context``: per step (token id, log_softmax of the logits), no cache."""
    out, context = [], list(context)
    for _ in range(steps):
        ref = reference_logprobs(model, context)
        out.append((int(mx.argmax(ref).item()), ref))
        context.append(out[-1][0])
    return out


def check_entries(tok, reference, entries):
    """``entries`` (token text, logprob, top logprobs) are the greedy reference's, within 1e-4."""
    assert 0 < len(entries) <= len(reference)
    for (text, logprob, top), (token, ref) in zip(entries, reference):
        assert text == tok.decode([token]) and abs(logprob - ref[token].item()) < 1e-4
        best = sorted(ref.tolist(), reverse=True)[:3]
        assert len(top) >= 1 and all(min(abs(lp - b) for b in best) < 1e-4 for lp in top)
        assert abs(max(top) - best[0]) < 1e-4


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_over_http_are_the_models_log_softmax(server, llama_model, stream):
    from mlx_chatcache.generation.templates import render_chat

    model, tok = llama_model
    reference = greedy_reference(model, render_chat(tok, MESSAGES), 6)
    kw = dict(model=server.model_id, messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    if stream:
        chunks = list(server.client.chat.completions.create(stream=True, **kw))
        content = [c for ch in chunks for c in ((ch.choices[0].logprobs.content or []) if ch.choices[0].logprobs
                                                else [])]  # fmt: skip
    else:
        content = server.client.chat.completions.create(**kw).choices[0].logprobs.content
    check_entries(tok, reference, [(c.token, c.logprob, [t.logprob for t in c.top_logprobs]) for c in content])
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_over_http_are_the_models_log_softmax(server, llama_model, stream):
    model, tok = llama_model
    prompt = prompt_of(tok)
    reference = greedy_reference(model, prompt, 6)
    kw = dict(model=server.model_id, prompt=prompt, temperature=0, max_tokens=6, logprobs=3)
    if stream:
        parts = [ch.choices[0].logprobs for ch in server.client.completions.create(stream=True, **kw)
                 if ch.choices and ch.choices[0].logprobs]  # fmt: skip
        tokens = [t for p in parts for t in p.tokens]
        lps = [x for p in parts for x in p.token_logprobs]
        tops = [x for p in parts for x in p.top_logprobs]
    else:
        lp = server.client.completions.create(**kw).choices[0].logprobs
        tokens, lps, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    check_entries(tok, reference, [(t, x, list(top.values())) for t, x, top in zip(tokens, lps, tops, strict=True)])


def test_n_choices_over_http_count_the_prompt_once(server, llama_model):
    from mlx_chatcache.generation.templates import render_chat

    _, tok = llama_model
    messages = [{"role": "user", "content": "Give me three different first lines of a poem."}]
    kw = dict(model=server.model_id, messages=messages, temperature=1.5, seed=11, max_tokens=5, n=3, logprobs=True)
    before = server.health()["prompt_tokens_computed"]
    r = server.client.chat.completions.create(**kw)
    computed = server.health()["prompt_tokens_computed"] - before
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(render_chat(tok, messages))
    assert computed == r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens + 2  # fed once
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) + (c.finish_reason == "stop") for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1  # each choice samples on its own
    chunks = [ch for ch in server.client.chat.completions.create(stream=True, **kw)]
    roles = [ch.choices[0].index for ch in chunks if ch.choices[0].delta.role == "assistant"]
    finishes = [ch.choices[0].index for ch in chunks if ch.choices[0].finish_reason]
    assert sorted(roles) == sorted(finishes) == [0, 1, 2]
    texts = ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices[0].index == i) for i in range(3)]
    assert texts == [c.message.content for c in r.choices]  # the same seeds: the same choices


def test_logit_bias_over_http_forces_a_token_and_bans_the_greedy_one(server, llama_model):
    model, tok = llama_model
    prompt = prompt_of(tok)
    first = greedy_reference(model, prompt, 1)[0][0]
    target = next(t for t in range(first + 5, 10**6) if t not in tok.eos_token_ids)
    kw = dict(model=server.model_id, prompt=prompt, temperature=0, max_tokens=4, logprobs=0)
    forced = server.client.completions.create(logit_bias={str(target): 100}, **kw).choices[0].logprobs
    assert forced.tokens == [tok.decode([target])] * 4 and all(x > -1e-3 for x in forced.token_logprobs)
    banned = server.client.completions.create(logit_bias={str(first): -100}, **kw).choices[0].logprobs
    assert banned.tokens[0] != tok.decode([first])
    chat = server.client.chat.completions.create(model=server.model_id, messages=MESSAGES, temperature=0, max_tokens=3,
                                                 logprobs=True, logit_bias={str(target): 100})  # fmt: skip
    assert [c.token for c in chat.choices[0].logprobs.content] == [tok.decode([target])] * 3


def test_presence_and_frequency_penalties_over_http_are_the_librarys(server, llama_model):
    model, tok = llama_model
    prompt = prompt_of(tok)
    texts = {}
    for name in ("plain", "presence_penalty", "frequency_penalty"):
        penalty = {} if name == "plain" else {name: 2.0}
        got = server.client.completions.create(model=server.model_id, prompt=prompt, temperature=0, max_tokens=24,
                                               **penalty).choices[0].text  # fmt: skip
        assert got == generate(model, tok, prompt, config=cfg(max_tokens=24, **penalty))
        texts[name] = got
    assert texts["presence_penalty"] != texts["plain"] or texts["frequency_penalty"] != texts["plain"]
    negative = {"presence_penalty": -2, "frequency_penalty": -1.5}
    assert server.client.completions.create(model=server.model_id, prompt=prompt, max_tokens=3, **negative).choices
