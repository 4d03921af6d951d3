"""mlx-lm's call signatures on our functions, so mlx-lm code ports by changing one import.

- ``save_prompt_cache(file_name, cache, metadata)`` / ``load_prompt_cache(file_name,
  return_metadata)`` take mlx-lm's arguments with its meaning (metadata positional, the
  metadata dict back); our extras are keyword-only after them.
- A cache of mlx-lm's batch classes (``BatchKVCache``, ``BatchRotatingKVCache``) saves in
  mlx-lm's layout and loads back as those classes (ours, subclasses of mlx-lm's).
- ``generate_step``/``stream_generate``/``generate`` take mlx-lm's keywords: each gives the
  tokens the equivalent ``config=`` gives, an explicit value wins over ``config``, and a
  ``prompt_cache`` list has mlx-lm's meaning (what it holds is kept, every yielded token is
  fed). Unsupported keywords are refused in one line.
"""

from __future__ import annotations

import inspect
import itertools

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate as lm_generate_text
from mlx_lm.generate import generate_step as lm_generate_step
from mlx_lm.generate import stream_generate as lm_stream_generate
from mlx_lm.models import cache as lm

from mlx_chatcache import load_prompt_cache, save_prompt_cache
from mlx_chatcache.cache import KVCache, RotatingKVCache, cache_offset, make_prompt_cache
from mlx_chatcache.config import DEFAULTS, CacheShape
from mlx_chatcache.errors import CacheFormatError, ChatCacheError, UnsupportedCacheError, UsageError
from mlx_chatcache.files.mlxcc_format import load_cache_file
from mlx_chatcache.generation.loop import generate_step
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.text import generate, stream_generate

TEXT = "The weather was cold and windy, so we stayed inside and read our books."
GREEDY = DEFAULTS.updated(temp=0.0)


def filled_kv(n_layers=2, tokens=6, seed=0) -> list[KVCache]:
    mx.random.seed(seed)
    cache = [KVCache() for _ in range(n_layers)]
    for c in cache:
        kv = mx.random.normal((1, 2, tokens, 8))
        c.update_and_fetch(kv, kv)
    return cache


def same_state(a, b) -> bool:
    """Equal ``state`` entries (arrays compared by value, scalars and None as they are)."""
    if len(a.state) != len(b.state):
        return False
    for x, y in zip(a.state, b.state):
        if isinstance(x, mx.array) or isinstance(y, mx.array):
            if not (isinstance(x, mx.array) and isinstance(y, mx.array) and x.shape == y.shape
                    and mx.array_equal(x, y).item()):  # fmt: skip
                return False
        elif x != y:
            return False
    return True


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


# ----------------------------------------------------------------- save / load signatures
def test_save_and_load_take_mlx_lms_parameters_first_and_ours_keyword_only():
    for ours, theirs in ((save_prompt_cache, lm.save_prompt_cache), (load_prompt_cache, lm.load_prompt_cache)):
        mine = list(inspect.signature(ours).parameters.values())
        lms = list(inspect.signature(theirs).parameters.values())
        assert [(p.name, p.kind, p.default) for p in mine[: len(lms)]] == [(p.name, p.kind, p.default) for p in lms]
        assert all(p.kind is p.KEYWORD_ONLY for p in mine[len(lms) :])


def test_metadata_saved_positionally_comes_back_as_the_dict(tmp_path):
    cache, meta = filled_kv(), {"a": "b", "c": "d"}
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, cache, meta)
    loaded, got = load_prompt_cache(path, return_metadata=True)
    assert got == meta and isinstance(got, dict)
    assert all(same_state(x, y) for x, y in zip(cache, loaded))
    assert [type(c) for c in load_prompt_cache(str(path))] == [KVCache, KVCache]  # the cache alone


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(meta=st.dictionaries(st.text(st.characters(exclude_categories=("Cs",)), max_size=12),
                            st.text(st.characters(exclude_categories=("Cs",)), max_size=40), max_size=6))
def test_any_string_metadata_round_trips(tmp_path, meta):
    path = tmp_path / "m.safetensors"
    save_prompt_cache(path, filled_kv(1, 2), meta, tokens=[5, 6])
    _, got = load_prompt_cache(path, return_metadata=True)
    assert got == meta
    assert load_cache_file(path)[1].tokens == [5, 6]  # our extras still recorded beside it


def test_metadata_of_a_file_mlx_lm_wrote_is_the_dict_it_was_given(tmp_path):
    theirs = [lm.KVCache() for _ in range(2)]
    for c in theirs:
        kv = mx.random.normal((1, 2, 5, 8))
        c.update_and_fetch(kv, kv)
    path = str(tmp_path / "lm.safetensors")
    lm.save_prompt_cache(path, theirs, {"model": "x", "k": "v"})
    cache, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"model": "x", "k": "v"}
    assert [c.offset for c in cache] == [5, 5]


# ----------------------------------------------------------------- mlx-lm's own classes
def batch_caches():
    mx.random.seed(1)
    kv = lm.BatchKVCache(left_padding=[1, 2])
    rot = lm.BatchRotatingKVCache(max_size=4, left_padding=[0, 3])
    for c, steps in ((kv, (5,)), (rot, (3, 1, 1, 1))):  # the window wraps
        for t in steps:
            x = mx.random.normal((2, 2, t, 8))
            c.update_and_fetch(x, x)
    return [kv, rot]


def test_batch_caches_of_mlx_lm_save_and_load_as_their_classes_with_our_rows(tmp_path):
    from mlx_chatcache.cache import BatchKVCache, BatchRotatingKVCache

    cache = batch_caches() + filled_kv(1, 5)
    path = tmp_path / "b.safetensors"
    save_prompt_cache(path, cache, {"k": "v"})
    back, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"k": "v"}
    # mlx-lm's batch classes (ours subclass them), whose rows extract as our classes
    assert [type(c) for c in back] == [BatchKVCache, BatchRotatingKVCache, KVCache]
    assert isinstance(back[0], lm.BatchKVCache) and isinstance(back[1], lm.BatchRotatingKVCache)
    assert type(back[0].extract(1)) is KVCache and type(back[1].extract(1)) is RotatingKVCache
    assert all(same_state(x, y) for x, y in zip(cache, back))
    x = mx.random.normal((2, 2, 1, 8))  # they go on as the originals do
    for a, b in zip(cache[:2], back[:2]):
        ka, kb = a.update_and_fetch(x, x)[0], b.update_and_fetch(x, x)[0]
        assert mx.array_equal(ka, kb).item() and mx.array_equal(a.offset, b.offset).item()
    again, _ = lm.load_prompt_cache(str(path), return_metadata=True)  # and mlx-lm reads the file
    assert [type(c) for c in again] == [lm.BatchKVCache, lm.BatchRotatingKVCache, lm.KVCache]


def test_commands_refuse_a_file_of_batch_caches_in_one_line(tmp_path):
    path = tmp_path / "b.safetensors"
    save_prompt_cache(path, batch_caches())
    with pytest.raises(UnsupportedCacheError) as e:
        load_cache_file(path)
    assert "BatchKVCache" in one_line(e)


def test_what_the_mlx_lm_layout_cannot_hold_is_refused_not_dropped(tmp_path):
    path = tmp_path / "b.safetensors"
    with pytest.raises(UnsupportedCacheError) as e:
        save_prompt_cache(path, batch_caches(), tokens=[1, 2])
    assert "tokens" in one_line(e) and not path.exists()
    with pytest.raises(UnsupportedCacheError) as e:
        save_prompt_cache(path, filled_kv(), tokens=list(range(6)), format="mlx-lm")
    assert "tokens" in one_line(e) and not path.exists()

    class NotACache:
        state = []

    with pytest.raises(UnsupportedCacheError) as e:
        save_prompt_cache(path, [NotACache()])
    assert "NotACache" in one_line(e) and not path.exists()


def test_damaged_batch_cache_state_is_refused(tmp_path):
    kv = lm.BatchKVCache(left_padding=[1])
    x = mx.zeros((1, 1, 3, 4))
    kv.update_and_fetch(x, x)
    kv._idx = 300  # past its 256 slots
    path = tmp_path / "d.safetensors"
    save_prompt_cache(path, [kv])
    with pytest.raises(CacheFormatError) as e:
        load_prompt_cache(path)
    assert "300" in one_line(e)


# ----------------------------------------------------------------- generation keywords
MLX_LM_STEP_KEYWORDS = ("max_tokens", "sampler", "logits_processors", "max_kv_size", "prompt_cache",
                        "prefill_step_size", "kv_bits", "kv_group_size", "quantized_kv_start",
                        "prompt_progress_callback", "input_embeddings")  # fmt: skip


def test_generation_functions_take_mlx_lms_keywords_explicitly():
    theirs = inspect.signature(lm_generate_step).parameters
    assert set(MLX_LM_STEP_KEYWORDS) == {n for n, p in theirs.items() if p.kind is p.KEYWORD_ONLY}
    for fn in (generate_step, stream_generate, generate):
        params = inspect.signature(fn).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
        assert set(MLX_LM_STEP_KEYWORDS) <= set(params)
    # mlx-lm's positional slots: stream_generate(model, tokenizer, prompt, max_tokens, draft_model, stream),
    # generate_step(prompt, model, stream) and generate(model, tokenizer, prompt, verbose)
    assert list(inspect.signature(stream_generate).parameters)[:6] == \
        list(inspect.signature(lm_stream_generate).parameters)[:6]
    assert list(inspect.signature(generate_step).parameters)[:3] == \
        list(inspect.signature(lm_generate_step).parameters)[:3]
    assert list(inspect.signature(generate).parameters)[:4] == \
        list(inspect.signature(lm_generate_text).parameters)[:4]


def prompt_of(tokenizer, n=12) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)[:n]


def tokens_of(steps) -> list[int]:
    return [t for t, _ in steps]


@pytest.mark.parametrize("shape", [
    dict(max_tokens=7),
    dict(max_tokens=6, prefill_step_size=3),
    dict(max_tokens=6, kv_bits=8, kv_group_size=32, quantized_kv_start=4),
    dict(max_tokens=6, max_kv_size=8),
])  # fmt: skip
def test_mlx_lm_keywords_give_the_tokens_config_gives(llama_model, shape):
    model, tokenizer = llama_model
    prompt = prompt_of(tokenizer)
    by_config = tokens_of(generate_step(prompt, model, config=GREEDY.updated(**shape)))
    assert len(by_config) == shape["max_tokens"]
    assert tokens_of(generate_step(mx.array(prompt), model, config=GREEDY, **shape)) == by_config
    streamed = [r.token for r in stream_generate(model, tokenizer, prompt, config=GREEDY, **shape)]
    assert streamed == by_config
    text = generate(model, tokenizer, prompt, False, config=GREEDY, **shape)
    assert text == generate(model, tokenizer, prompt, config=GREEDY.updated(**shape))


def test_explicit_keywords_win_over_config(llama_model):
    model, tokenizer = llama_model
    prompt = prompt_of(tokenizer)
    assert len(tokens_of(generate_step(prompt, model, config=GREEDY.updated(max_tokens=3), max_tokens=5))) == 5
    responses = list(stream_generate(model, tokenizer, prompt, 4, config=GREEDY.updated(max_tokens=9)))
    assert len(responses) == 4 and responses[-1].finish_reason == "length"
    assert not any(r.from_draft for r in responses)
    state = PromptCache.new(model)
    list(generate_step(prompt, model, state=state, config=GREEDY.updated(max_tokens=2), max_kv_size=None))
    assert all(type(c) is KVCache for c in state.cache)  # None: not given, the config's value stays
    windowed = PromptCache.new(model, CacheShape(16))
    with pytest.raises(UsageError):  # a shape the given cache does not have
        list(generate_step(prompt, model, state=windowed, max_kv_size=8))


def test_prompt_progress_callback_is_progress(llama_model):
    model, tokenizer = llama_model
    prompt = prompt_of(tokenizer)
    theirs, ours = [], []
    list(generate_step(prompt, model, max_tokens=2, prefill_step_size=4, prompt_progress_callback=lambda *a: theirs.append(a)))
    list(generate_step(prompt, model, max_tokens=2, prefill_step_size=4, progress=lambda *a: ours.append(a)))
    assert theirs == ours and theirs[-1] == (len(prompt), len(prompt))
    with pytest.raises(UsageError) as e:
        list(generate_step(prompt, model, progress=print, prompt_progress_callback=print))
    one_line(e)


def test_prompt_cache_list_keeps_what_it_holds_and_feeds_every_yielded_token(llama_model):
    model, tokenizer = llama_model
    prompt = prompt_of(tokenizer)
    whole = tokens_of(generate_step(prompt, model, max_tokens=5))
    layers = make_prompt_cache(model)
    first = tokens_of(generate_step(mx.array(prompt), model, prompt_cache=layers, max_tokens=2))
    assert first == whole[:2]
    assert cache_offset(layers) == len(prompt) + 2  # mlx-lm's order: the 2nd token was fed too
    # the next call appends to what the layers hold (no prefix matching): feed token 3, get token 4
    assert tokens_of(generate_step([whole[2]], model, prompt_cache=layers, max_tokens=1)) == [whole[3]]
    assert cache_offset(layers) == len(prompt) + 4


def test_prompt_cache_list_gives_mlx_lms_tokens(llama_model):
    model, tokenizer = llama_model
    prompt = mx.array(prompt_of(tokenizer))
    ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
    mine = tokens_of(generate_step(prompt, model, prompt_cache=ours, max_tokens=4))
    lms = tokens_of(lm_generate_step(prompt, model, prompt_cache=theirs, max_tokens=4))
    assert mine == lms and cache_offset(ours) == cache_offset(theirs)
    more = mx.array(prompt_of(tokenizer, 3))
    assert tokens_of(generate_step(more, model, prompt_cache=ours, max_tokens=3)) == \
        tokens_of(lm_generate_step(more, model, prompt_cache=theirs, max_tokens=3))


def test_prompt_cache_as_a_prompt_cache_is_state(llama_model):
    model, tokenizer = llama_model
    prompt = prompt_of(tokenizer)
    a, b = PromptCache.new(model), PromptCache.new(model)
    assert tokens_of(generate_step(prompt, model, prompt_cache=a, max_tokens=4)) == \
        tokens_of(generate_step(prompt, model, state=b, max_tokens=4))
    assert a.tokens == b.tokens and len(a.tokens) == len(prompt) + 3  # our rule: the last one not fed
    reply = list(stream_generate(model, tokenizer, prompt + [9], max_tokens=2, prompt_cache=a))
    assert reply[-1].reused_tokens == len(prompt)


def test_no_limit_with_minus_one(llama_model):
    model, tokenizer = llama_model
    steps = generate_step(prompt_of(tokenizer), model, max_tokens=-1)
    assert len(list(itertools.islice(steps, DEFAULTS.max_tokens + 5))) == DEFAULTS.max_tokens + 5


@pytest.mark.parametrize("bad, words", [
    (dict(draft_model=object()), "draft_model"),
    (dict(input_embeddings=mx.zeros((3, 8))), "input_embeddings"),
    (dict(prompt_cache=[lm.KVCache()]), "make_prompt_cache"),
    (dict(prompt_cache=[], state="x"), "not both"),
])  # fmt: skip
def test_bad_values_of_mlx_lm_keywords_are_refused_in_one_line(llama_model, bad, words):
    """A draft model that is not a model, embeddings that do not match the prompt, mlx-lm's own
    cache objects, two caches."""
    model, tokenizer = llama_model
    calls = [lambda: list(stream_generate(model, tokenizer, "hi", **bad)),
             lambda: generate(model, tokenizer, "hi", **bad)]
    if "draft_model" not in bad:
        calls.append(lambda: list(generate_step([1, 2], model, **bad)))
    for call in calls:
        with pytest.raises(UsageError) as e:
            call()
        assert words in one_line(e)


def hostile_entry():
    """Anything a file may hold for one entry of a batch cache's state."""
    arrays = st.tuples(st.lists(st.integers(0, 3), min_size=0, max_size=4),
                       st.sampled_from([mx.int32, mx.float32, mx.uint8])).map(lambda a: mx.zeros(a[0], a[1]))
    return st.one_of(st.none(), st.integers(-3, 600), st.booleans(), arrays)


KV = st.sampled_from([(1, 2, 4, 8), (2, 1, 3, 4)]).map(lambda s: mx.zeros(s))
PER_SEQ = st.integers(1, 3).map(lambda n: mx.zeros((n,), mx.int32))
VALID = {  # what mlx-lm writes at each position of the state
    "BatchKVCache": (KV, KV, PER_SEQ, PER_SEQ, st.integers(0, 4)),
    "BatchRotatingKVCache": (KV, KV, PER_SEQ, PER_SEQ, st.integers(1, 8), st.integers(0, 9),
                             st.integers(0, 4), st.booleans()),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rotating=st.booleans(), data=st.data())
def test_hostile_batch_cache_state_loads_consistent_or_is_refused_in_one_line(tmp_path, rotating, data):
    name = "BatchRotatingKVCache" if rotating else "BatchKVCache"
    damaged = data.draw(st.sets(st.integers(0, len(VALID[name]) - 1), max_size=2))
    state = tuple(data.draw(hostile_entry() if i in damaged else valid) for i, valid in enumerate(VALID[name]))
    forged = type(name, (), {"state": state})()  # mlx-lm's writer takes any object by its class name
    path = str(tmp_path / "h.safetensors")
    lm.save_prompt_cache(path, [forged])
    try:
        (c,) = load_prompt_cache(path)
    except ChatCacheError as e:
        assert str(e) and "\n" not in str(e)
        event("refused")
        return
    event("loaded")
    assert type(c).__name__ == name
    for a in (c.offset, c.left_padding):
        assert isinstance(a, mx.array) and a.ndim == 1
    slots = 0 if c.keys is None else c.keys.shape[2]
    assert c.keys is None or (c.keys.ndim == 4 and c.keys.shape[:3] == c.values.shape[:3])
    assert 0 <= c._idx <= slots
