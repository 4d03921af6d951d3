"""mlx-lm's batched generation API over our caches (generation/batch_api.py), beyond what mlx-lm's
own tests/test_generate.py checks (tests/test_mlxlm_generate_suite.py runs that):

- every sequence gives the tokens it gives alone (greedy), for full-attention, sliding-window,
  hybrid and SSM models, prompts of several chunks and segments;
- the caches it returns are our one-sequence classes holding every token (the last too, in
  mlx-lm's order), continue as a solo cache does, and save and load as ours;
- a model paired with a draft model batches too (both models' layers);
- ``batch_generate`` copies the caches it is given (they are not updated in place).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_models import KINDS

from mlx_chatcache import batch_generate
from mlx_chatcache.cache import BaseCache, copy_prompt_cache, make_prompt_cache
from mlx_chatcache.files.mlxcc_format import load_prompt_cache, save_prompt_cache
from mlx_chatcache.generation.batch_api import BatchGenerator
from mlx_chatcache.generation.loop import generate_step
from mlx_chatcache.models.draft_pair import DraftPair
from mlx_chatcache.models.loading import load

TEXTS = ["Write a story about the sea and the ships", "Hi", "What time is it in Lisbon now?",
         "A list: apples, bread, milk, eggs, butter, cheese, rice, beans and tea."]  # fmt: skip


def solo(model, prompt, n, cache=None):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache)]


def run_all(gen: BatchGenerator, uids):
    tokens, ends = {u: [] for u in uids}, {}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
            if r.finish_reason:
                ends[r.uid] = r
    return tokens, ends


@pytest.mark.parametrize("kind", KINDS)
def test_batched_sequences_give_their_solo_tokens_and_caches(tiny_model_dirs, kind):
    model, tok = load(str(tiny_model_dirs[kind]))
    prompts = [tok.encode(t) for t in TEXTS]
    gen = BatchGenerator(model, max_tokens=8, prefill_batch_size=2, prefill_step_size=5, completion_batch_size=3)
    uids = gen.insert(prompts)
    tokens, ends = run_all(gen, uids)
    for u, p in zip(uids, prompts):
        assert tokens[u] == solo(model, p, 8), kind
        r = ends[u]
        assert r.all_tokens == p + tokens[u]  # every token, the last one too (mlx-lm's order)
        assert all(isinstance(c, BaseCache) and c.offset == len(r.all_tokens) for c in r.prompt_cache)
        # it continues as the cache of a solo run does
        layers = make_prompt_cache(model)
        solo(model, p + tokens[u][:-1], 1, layers)  # feeds p and all but the last, then the last
        more = tok.encode(" And then?")
        assert solo(model, more, 4, copy_prompt_cache(r.prompt_cache)) == solo(model, more, 4, layers), kind
    gen.close()


def test_segments_prefixes_and_returned_caches_save_as_ours(llama_model, tmp_path):
    model, tok = llama_model
    a, b = tok.encode(TEXTS[0]), tok.encode(TEXTS[2])
    gen = BatchGenerator(model, max_tokens=5, prefill_step_size=64)
    (uid,) = gen.insert_segments([[a, b]])
    seen = []
    while True:
        prompts, generated = gen.next()
        seen += [p.progress for p in prompts if not p.end_of_prompt]
        if not prompts and not generated:
            break
    assert seen[0] == (len(a), len(a) + len(b))  # a chunk never crosses a segment's end
    cache = load_prompt_cache(_saved(tmp_path, gen, model, tok))
    assert all(type(c).__module__.startswith("mlx_chatcache") for c in cache)


def _saved(tmp_path, gen, model, tok):
    (uid,) = gen.insert([tok.encode(TEXTS[1])])
    _, ends = run_all(gen, [uid])
    path = tmp_path / "row.safetensors"
    save_prompt_cache(path, ends[uid].prompt_cache)
    return path


def test_a_model_with_a_draft_model_batches_with_both_models_layers(llama_model, make_tiny_model):
    model, tok = llama_model
    draft, _ = make_tiny_model("llama", seed=1)
    pair = DraftPair(model, draft)
    prompts = [tok.encode(t) for t in TEXTS[:3]]
    gen = BatchGenerator(pair, max_tokens=6)
    uids = gen.insert(prompts)
    tokens, ends = run_all(gen, uids)
    for u, p in zip(uids, prompts):
        assert tokens[u] == solo(model, p, 6)
        assert len(ends[u].prompt_cache) == 2 * len(model.layers)


def test_batch_generate_copies_the_caches_it_is_given(llama_model):
    model, tok = llama_model
    prompts = [tok.encode(t) for t in TEXTS[:2]]
    caches = [make_prompt_cache(model) for _ in prompts]
    for c, p in zip(caches, prompts):
        solo(model, p, 1, c)
    offsets = [[c.offset for c in layers] for layers in caches]
    more = [tok.encode(" Go on.") for _ in prompts]
    out = batch_generate(model, tok, more, prompt_caches=caches, max_tokens=4, return_prompt_caches=True,
                         return_token_ids=True)  # fmt: skip
    assert [[c.offset for c in layers] for layers in caches] == offsets
    for layers, m, ids in zip(caches, more, out.token_ids):
        assert ids == solo(model, m, 4, copy_prompt_cache(layers))
    assert all(c.offset == o[0] + len(m) + 4 for layers, o, m in zip(out.caches, offsets, more) for c in layers)
