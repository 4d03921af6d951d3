"""PromptCache, the one value type for a cache and what it holds: save -> load round trips exactly,
and a loaded cache continues a generation exactly as the one that was saved (tiny llama, float32)."""

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx_chatcache
from mlx_chatcache import PromptCache, generate
from mlx_chatcache.config import DEFAULTS, SHAPE_KEYS, CacheShape, shape_differences
from mlx_chatcache.errors import CacheFormatError, ModelMismatchError, UsageError
from mlx_chatcache.files import mlxcc_format
from mlx_chatcache.generation import prompt as prompt_module
from mlx_chatcache.generation.templates import feed_all

GREEDY = DEFAULTS.updated(temp=0.0, max_tokens=6)


def _filled(model, tokenizer, **shape) -> PromptCache:
    prompt = PromptCache.new(model, CacheShape(**shape))
    ids = tokenizer.encode("The weather was cold and windy, so we stayed inside.", add_special_tokens=False)
    feed_all(model, prompt, ids, prefill_step_size=4)
    prompt.messages = [{"role": "user", "content": "The weather was cold"}]
    prompt.settings = {"note": "kept"}
    return prompt


@pytest.mark.parametrize("shape", [{}, {"max_kv_size": 32, "keep": 4}])
def test_save_load_round_trip(llama_model, tmp_path, shape):
    model, tokenizer = llama_model
    prompt = _filled(model, tokenizer, **shape)
    path = tmp_path / "p.safetensors"
    prompt.save(path)
    back = PromptCache.load(path, model)
    assert back.tokens == prompt.tokens and back.messages == prompt.messages and back.text is None
    assert (back.shape.max_kv_size, back.shape.keep) == (prompt.shape.max_kv_size, prompt.shape.keep)
    assert back.settings["note"] == "kept" and back.fingerprint == model.fingerprint
    for a, b in zip(prompt.cache, back.cache):
        assert a.offset == b.offset
        for x, y in zip(a.flat_state(), b.flat_state()):
            assert mx.array_equal(x, y)


def test_loaded_cache_continues_as_the_saved_one(llama_model, tmp_path):
    model, tokenizer = llama_model
    prompt = _filled(model, tokenizer)
    prompt.save(tmp_path / "p.safetensors")
    back = PromptCache.load(tmp_path / "p.safetensors", model)
    more = prompt.tokens + tokenizer.encode(" Then", add_special_tokens=False)
    assert generate(model, tokenizer, more, state=back, config=GREEDY) == generate(
        model, tokenizer, more, state=prompt, config=GREEDY
    )
    assert back.tokens == prompt.tokens


def test_load_refuses_another_model_and_a_file_without_tokens(llama_model, make_tiny_model, tmp_path):
    model, tokenizer = llama_model
    _filled(model, tokenizer).save(tmp_path / "p.safetensors")
    other, _ = make_tiny_model("llama", seed=7)
    with pytest.raises(ModelMismatchError):
        PromptCache.load(tmp_path / "p.safetensors", other)
    mlxcc_format.save_prompt_cache(tmp_path / "bare.safetensors", PromptCache.new(model).cache)  # no tokens listed
    with pytest.raises(CacheFormatError, match="does not say which tokens"):
        PromptCache.load(tmp_path / "bare.safetensors", model)


def test_flat_api_names_are_the_library_functions():
    assert mlx_chatcache.save_prompt_cache is mlxcc_format.save_prompt_cache
    assert mlx_chatcache.load_prompt_cache is mlxcc_format.load_prompt_cache
    assert mlx_chatcache.PromptCache is prompt_module.PromptCache


windows = st.one_of(st.none(), st.integers(1, 40))
dtypes = st.sampled_from(["auto", "float16", "bfloat16", "float32"])
shapes = st.builds(CacheShape, windows, st.integers(0, 6), st.sampled_from([None, 4, 8]), st.sampled_from([32, 64]),
                   st.integers(0, 3), dtypes)  # fmt: skip
configs = st.builds(lambda w, k, b, g, s, d: DEFAULTS.updated(max_kv_size=w, keep=k, kv_bits=b, kv_group_size=g,
                                                                quantized_kv_start=s, kv_dtype=d),
                    windows, st.integers(0, 6), st.sampled_from([None, 4, 8]), st.sampled_from([32, 64]),
                    st.integers(0, 3), dtypes)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(made=shapes, config=configs)
def test_one_rule_says_whether_a_cache_window_agrees(made, config):
    """Whether a run may use a cache (ensure_state) and whether a file's shape takes flags
    (CacheShape.adopted) follow one rule, CacheShape.agrees: no window asked, or the cache's."""
    state = PromptCache([], [], made)  # ensure_state reads only the shape of a state it is given
    same = config.max_kv_size is None or (config.max_kv_size, config.keep) == (made.max_kv_size, made.keep)
    assert made.agrees(config.max_kv_size, config.keep) == same
    if same:
        assert prompt_module.ensure_state(None, state, config) is state
    else:
        with pytest.raises(UsageError, match="the prompt cache was made with max_kv_size"):
            prompt_module.ensure_state(None, state, config)
    flags = {"max_kv_size": config.max_kv_size, "kv_bits": config.kv_bits}
    adopted = made.adopted(flags)
    assert (adopted is None) == (not made.agrees(config.max_kv_size))
    if adopted is not None:
        assert (adopted.max_kv_size, adopted.keep) == (made.max_kv_size, made.keep)


@settings(max_examples=200, deadline=None)
@given(made=shapes, config=configs, note=st.text(max_size=5))
def test_a_file_records_the_window_it_was_made_with_and_the_kv_it_runs_with(made, config, note):
    """The settings a file records (CacheShape.recording: PromptCache.save, mlxcc generate,
    cache-prompt, session files) read back as the shape a run of ``config`` on the cache has."""
    config = config.updated(kv_dtype=made.kv_dtype)  # a run on a cache holds its K/V dtype (another is refused)
    before = {"note": note, "weights": "bf16", "max_kv_size": 999}
    run = made.recording(before, config)
    assert CacheShape.recorded(run, "f") == config.windowed(made).shape
    assert (run["note"], run["weights"]) == (note, "bf16")
    saved = made.recording(before)  # no run: the window and K/V dtype alone, nothing else changed
    assert saved == {**before, "max_kv_size": made.max_kv_size, "keep": made.keep, "kv_dtype": made.kv_dtype}
    assert made.recording(run) == run and made.recording(run, config) == run


@settings(max_examples=200, deadline=None)
@given(a=shapes, b=shapes, drop=st.sets(st.sampled_from(SHAPE_KEYS)))
def test_one_rule_says_which_recorded_shape_keys_differ(a, b, drop):
    """A file's recorded shape and a run's differ exactly in the keys both record with other
    values; ``keep`` counts only when both have a window (it means nothing without one)."""
    theirs = {k: v for k, v in a.settings().items() if k not in drop}
    ours = b.settings()
    differ = shape_differences(theirs, ours)
    for k in SHAPE_KEYS:
        both = k in theirs and (k != "keep" or (theirs.get("max_kv_size") is not None
                                                 and ours.get("max_kv_size") is not None))
        assert (k in differ) == (both and theirs[k] != ours[k]), k
