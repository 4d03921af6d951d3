"""``input_embeddings`` (generation/run.py) and where generation runs (generation/device.py).

- Embeddings equal to the prompt's token embeddings give the prompt's tokens and logprobs (within
  ATOL), in chunks of ``prefill_step_size`` with a progress call per chunk, and the tokens
  mlx-lm's own ``generate_step`` gives with the same embeddings; an embeddings-only prompt works.
  What cannot work is one line: a cache that records token ids, rows that do not match the
  prompt, a model that takes no embeddings, speculative decoding.
- The loops' model calls run on the generation stream (not the default one), from any thread;
  the wired limit is raised and put back on Metal only.
"""

from __future__ import annotations

import concurrent.futures

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as lm_generate_step

from mlx_chatcache.backend import blas
from mlx_chatcache.cache import make_prompt_cache
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.errors import UsageError
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation import device
from mlx_chatcache.generation.batch_api import BatchGenerator
from mlx_chatcache.generation.loop import generate_step
from mlx_chatcache.generation.text import stream_generate
from mlx_chatcache.models.draft_pair import DraftPair

ATOL = 1e-4 if blas.STATUS.active else 1e-5
TEXT = "The weather was cold and windy, so we stayed inside and read our books."


def steps(gen):
    return [(t, lp) for t, lp in gen]


def test_embeddings_of_the_prompt_give_the_prompts_tokens_in_chunks(llama_model):
    model, tok = llama_model
    prompt = tok.encode(TEXT)
    emb = model.model.embed_tokens(mx.array(prompt))
    plain = steps(generate_step(prompt, model, max_tokens=6))
    calls = []
    embedded = steps(generate_step(prompt, model, max_tokens=6, input_embeddings=emb, prefill_step_size=5,
                                   prompt_progress_callback=lambda d, t: calls.append((d, t))))  # fmt: skip
    assert [t for t, _ in embedded] == [t for t, _ in plain]
    assert max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(plain, embedded)) <= ATOL
    assert len(calls) > len(prompt) / 5 and calls[0] == (0, len(prompt)) and calls[-1] == (len(prompt),) * 2
    theirs = [t for t, _ in lm_generate_step(mx.array(prompt), model, max_tokens=6, input_embeddings=emb)]
    assert [t for t, _ in embedded] == theirs
    only = steps(generate_step([], model, max_tokens=6, input_embeddings=emb))
    assert [t for t, _ in only] == [t for t, _ in plain]
    text = [r.token for r in stream_generate(model, tok, prompt, max_tokens=6, input_embeddings=emb)]
    assert text == [t for t, _ in plain]


def test_what_embeddings_cannot_do_is_one_line(llama_model, make_tiny_model):
    model, tok = llama_model
    prompt = tok.encode(TEXT)
    emb = model.model.embed_tokens(mx.array(prompt))
    draft, _ = make_tiny_model("llama", seed=1)
    bad = [
        (dict(state=PromptCache.new(model)), "list of layers"),
        (dict(input_embeddings=emb[:-1]), "one row per prompt token"),
        (dict(input_embeddings=mx.zeros((0, emb.shape[1]))), "empty"),
    ]
    for kw, words in bad:
        with pytest.raises(UsageError) as e:
            steps(generate_step(prompt, model, max_tokens=2, **{"input_embeddings": emb, **kw}))
        assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError) as e:
        steps(generate_step(prompt, DraftPair(model, draft), max_tokens=2, input_embeddings=emb))
    assert "does not take input embeddings" in str(e.value)
    with pytest.raises(UsageError) as e:
        list(stream_generate(model, tok, prompt, max_tokens=2, draft_model=draft, input_embeddings=emb))
    assert "speculative decoding does not take input_embeddings" in str(e.value)


def test_the_loops_run_on_the_generation_stream_from_any_thread(llama_model):
    model, tok = llama_model
    main = mx.default_stream(mx.default_device())
    seen = []

    def spy(tokens, logits):
        seen.append(mx.default_stream(mx.default_device()))
        return logits

    def generate():
        return [t for t, _ in generate_step(tok.encode(TEXT), model, max_tokens=3, logits_processors=[spy])]

    here = generate()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(generate).result(timeout=60) == here
    assert seen and all(s != main for s in seen)
    gen = BatchGenerator(model, max_tokens=2, logits_processors=[spy])
    gen.insert([tok.encode(TEXT)])
    seen.clear()
    while gen.next_generated():
        pass
    assert seen and all(s != main for s in seen)


def test_the_wired_limit_is_raised_on_metal_only(llama_model, monkeypatch):
    model, _ = llama_model
    calls = []
    monkeypatch.setattr(device, "_metal", lambda: False)
    with device.wired_limit(model):
        pass
    assert calls == []
    monkeypatch.setattr(device, "_metal", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 1 << 30}, raising=False)
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: calls.append(n) or 7)
    monkeypatch.setattr(mx, "synchronize", lambda *a: calls.append("sync"))
    with device.wired_limit(model):
        assert calls == [1 << 30]
    assert calls == [1 << 30, "sync", 7]
    assert make_prompt_cache(model)  # (nothing else touched)
    assert DEFAULTS.max_tokens > 0
