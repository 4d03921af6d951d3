"""PromptCache, the one value type for a cache and what it holds: save -> load round trips exactly,
and a loaded cache continues a generation exactly as the one that was saved (tiny llama, float32)."""

import mlx.core as mx
import pytest

import mlx_chatcache
from mlx_chatcache import PromptCache, generate
from mlx_chatcache.config import DEFAULTS, CacheShape
from mlx_chatcache.errors import CacheFormatError, ModelMismatchError
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
