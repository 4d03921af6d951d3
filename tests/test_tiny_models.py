"""The tiny test models: loaded through the real path, and fit for cache tests."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from scripted_model import build_scripted_model
from tiny_models import (
    IM_END,
    KINDS,
    SLIDING_WINDOW,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_tiny_model,
)

from mlx_chatcache.models.fingerprint import ModelFingerprint, folder_fingerprint
from mlx_chatcache.models.loading import load

IM_END_ID = SPECIAL_TOKENS.index(IM_END)

EXPECTED_CACHES = {
    "llama": [KVCache, KVCache],
    "sliding": [RotatingKVCache, KVCache, RotatingKVCache],
    "hybrid": [ArraysCache, KVCache, ArraysCache],
    "ssm": [ArraysCache, ArraysCache],
}
EXPECTED_MODEL_TYPES = {"llama": "llama", "sliding": "llama", "hybrid": "lfm2", "ssm": "mamba2"}


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def greedy(model, prompt: list[int], n: int = 24) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def test_loads_through_real_path(tiny_model, tiny_model_dirs):
    kind, model, tokenizer = tiny_model
    assert model.model_type == EXPECTED_MODEL_TYPES[kind]
    assert isinstance(model.fingerprint, ModelFingerprint)
    assert model.fingerprint.model_id == str(tiny_model_dirs[kind])
    assert type(tokenizer).__name__ == "TokenizerWrapper"
    assert len(tokenizer) == VOCAB_SIZE
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(model.parameters()))


def test_make_cache_types(tiny_model):
    kind, model, _ = tiny_model
    caches = model.make_cache()
    assert [type(c) for c in caches] == EXPECTED_CACHES[kind]
    for cache in caches:
        if isinstance(cache, RotatingKVCache):
            assert cache.max_size == SLIDING_WINDOW


def test_special_tokens_are_single_tokens(tiny_model):
    _, _, tokenizer = tiny_model
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert token in tokenizer.all_special_tokens
    assert tokenizer.eos_token == IM_END
    assert tokenizer.eos_token_ids == {SPECIAL_TOKENS.index(IM_END)}


def test_any_text_round_trips(tiny_model):
    _, _, tokenizer = tiny_model
    text = "Grüße, 東京! 3.14 <tag> 🙂\n\tend"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert max(ids) < VOCAB_SIZE


def test_chat_template_renders_chatml(llama_model):
    _, tokenizer = llama_model
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )
    render = tokenizer.apply_chat_template
    assert render(messages, tokenize=False) == expected
    prompt = render(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == expected + "<|im_start|>assistant\n"
    ids = render(messages, add_generation_prompt=True)
    assert ids == tokenizer.encode(prompt, add_special_tokens=False)
    assert ids.count(SPECIAL_TOKENS.index("<|im_start|>")) == 5


def test_greedy_continuations_are_not_degenerate(tiny_model):
    _, model, tokenizer = tiny_model
    first = greedy(model, chat_ids(tokenizer, "Hello, how are you?"))
    second = greedy(model, chat_ids(tokenizer, "What is the capital of Italy?"))
    assert len(set(first)) >= 4 and len(set(second)) >= 4
    assert first != second
    assert not set(first + second) & set(range(len(SPECIAL_TOKENS)))


def test_continuation_depends_on_far_context(tiny_model):
    """Changing only a prompt's first word (~40 tokens back) changes the output."""
    _, model, tokenizer = tiny_model
    story = " please tell me a short story about a cat who lives in a big old house by the sea"
    prompts = [chat_ids(tokenizer, word + story) for word in ("Alpha", "Bravo", "Charlie", "Delta")]
    assert min(len(p) for p in prompts) > 2 * SLIDING_WINDOW
    continuations = {tuple(greedy(model, p)) for p in prompts}
    assert len(continuations) >= 2


def test_cached_prefill_matches_uncached(tiny_model):
    """Prefill in two chunks through ``make_cache()`` gives the uncached logits."""
    _, model, tokenizer = tiny_model
    ids = mx.array(chat_ids(tokenizer, "The weather was cold and windy, so we stayed inside."))[None]
    split = SLIDING_WINDOW + 3
    cache = model.make_cache()
    model(ids[:, :split], cache=cache)
    cached = model(ids[:, split:], cache=cache)[0, -1]
    uncached = model(ids)[0, -1]
    assert mx.allclose(cached, uncached, atol=1e-4).item()
    assert mx.std(uncached).item() > 0.5  # logits have spread, sampling is not uniform


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_gives_identical_files(kind, tmp_path):
    first = build_tiny_model(kind, tmp_path / "a", seed=3)
    again = build_tiny_model(kind, tmp_path / "b", seed=3)
    other = build_tiny_model(kind, tmp_path / "c", seed=4)
    names = sorted(p.name for p in first.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert folder_fingerprint("a", first).matches(folder_fingerprint("b", again))


def test_other_seed_is_a_different_model(tiny_model, make_tiny_model):
    kind, model, tokenizer = tiny_model
    other, other_tokenizer = make_tiny_model(kind, seed=1)
    assert not model.fingerprint.matches(other.fingerprint)
    assert model.fingerprint.tokenizer_hash == other.fingerprint.tokenizer_hash
    assert model.fingerprint.weights_hash != other.fingerprint.weights_hash
    prompt = chat_ids(tokenizer, "Hello, how are you?")
    assert prompt == chat_ids(other_tokenizer, "Hello, how are you?")
    assert greedy(model, prompt) != greedy(other, prompt)


def test_kv_caches_and_weights_quantize_in_32_and_64_groups(make_tiny_model):
    model, tokenizer = make_tiny_model("llama", seed=0)  # private copy: quantized below
    ids = mx.array(chat_ids(tokenizer, "Hello"))[None]
    for group_size in (32, 64):
        cache = model.make_cache()
        model(ids, cache=cache)
        quantized = [c.to_quantized(group_size=group_size, bits=8) for c in cache]
        assert all(q.offset == ids.shape[1] for q in quantized)
    nn.quantize(model, group_size=64, bits=4)
    assert model(ids).shape == (1, ids.shape[1], VOCAB_SIZE)



def test_a_scripted_model_says_its_first_reply_until_the_marker_is_in_the_prompt(tmp_path):
    first, then = '<tool_call>{"name": "add"}</tool_call>', "Done: 5."
    model, tokenizer = load(str(build_scripted_model(tmp_path / "s", first, then, "</tool_call>")))

    def reply(text: str) -> str:
        ids = greedy(model, chat_ids(tokenizer, text), n=8)
        assert IM_END_ID in ids
        return tokenizer.decode(ids[: ids.index(IM_END_ID)])

    long = " and".join(["a short story about a cat"] * 60)  # the marker ~500 tokens back
    assert reply("Hello, how are you?") == reply(long) == first
    assert reply("It said </tool_call> 5") == reply("</tool_call>" + long) == then
