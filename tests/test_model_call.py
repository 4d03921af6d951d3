"""The safety net of issue 10: a layer cache that was handed tokens but did not
take them raises CacheNotUpdatedError (naming the model type and the layer)
instead of producing wrong text.

Stubs wrap the tiny llama and mamba models: one ignores the cache altogether,
one runs its last layer without a cache. Checked through the library's
generate path (prefill chunks and the first-token call), feeding a whole
prompt (``cache-prompt``), and ``mlxcc chat`` (one error line, no traceback).
Also: offsets count tokens for an mlx-lm model that never calls ``advance``
(mamba), and a model that does (mamba2) is not advanced twice.
"""

from __future__ import annotations

import io
import sys
import timeit

import mlx.core as mx
import pytest

import mlx_chatcache.models.loading as loading
from mlx_chatcache.cache import ArraysCache, CacheList, KVCache, cache_offset
from mlx_chatcache.cli.main import main
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.errors import CacheNotUpdatedError, UnsupportedCacheError
from mlx_chatcache.generation.model_call import call_model
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.templates import feed_all
from mlx_chatcache.generation.text import generate


class CacheIgnoringModel:
    """A model that does not use the cache it is given (``skip``: which layers;
    None = all: the cache is not passed on at all)."""

    model_type = "stub_ignores_cache"

    def __init__(self, inner, skip: set[int] | None = None):
        self.inner, self.skip = inner, skip
        self.layers, self.fingerprint = inner.layers, inner.fingerprint

    def make_cache(self):
        return self.inner.make_cache()

    def __call__(self, inputs, cache=None):
        if self.skip is None or cache is None:
            return self.inner(inputs)
        return self.inner(inputs, cache=[None if i in self.skip else c for i, c in enumerate(cache)])


@pytest.mark.parametrize("kind", ["llama", "mamba"])
def test_generate_refuses_a_model_that_ignores_its_cache(kind, make_tiny_model):
    model, tokenizer = make_tiny_model(kind, seed=0)
    state = PromptCache.new(model)
    config = DEFAULTS.updated(max_tokens=4, prefill_step_size=8)
    with pytest.raises(CacheNotUpdatedError, match=r"the stub_ignores_cache model .* in layer 0's cache"):
        generate(CacheIgnoringModel(model), tokenizer, "Good morning! How are you today?", state=state,
                 config=config)
    assert state.tokens == [] and cache_offset(state.cache) == 0  # nothing half-fed is kept
    assert issubclass(CacheNotUpdatedError, UnsupportedCacheError)


@pytest.mark.parametrize("prefill_step_size", [4, 512])  # the error in a prefill chunk / the first-token call
def test_one_layer_without_cache_is_named(prefill_step_size, make_tiny_model):
    model, tokenizer = make_tiny_model("llama", seed=0)
    last = len(model.layers) - 1
    config = DEFAULTS.updated(max_tokens=4, prefill_step_size=prefill_step_size)
    with pytest.raises(CacheNotUpdatedError, match=rf"in layer {last}'s cache \(KVCache, offset still 0\)"):
        generate(CacheIgnoringModel(model, skip={last}), tokenizer, "What is the capital of Italy?",
                 config=config)


def test_feeding_a_whole_prompt_is_checked(make_tiny_model):
    model, tokenizer = make_tiny_model("llama", seed=0)
    stub = CacheIgnoringModel(model)
    with pytest.raises(CacheNotUpdatedError):
        feed_all(stub, PromptCache.new(stub), tokenizer.encode("Good morning!"), 4)


def test_a_cache_list_part_is_named():
    class HalfUpdates:
        model_type = "halves"

        def __call__(self, inputs, cache):
            k = mx.zeros((1, 1, inputs.shape[1], 8))
            cache[0].caches[0].update_and_fetch(k, k)  # part 1 (the ArraysCache) is left alone
            return mx.zeros((1, inputs.shape[1], 4))

    cache = [CacheList(KVCache(), ArraysCache(1))]
    with pytest.raises(CacheNotUpdatedError, match=r"the halves model .* layer 0 \(part 1 of its CacheList\)"):
        call_model(HalfUpdates(), mx.array([[1, 2, 3]]), cache)


@pytest.mark.parametrize("kind", ["mamba", "ssm"])  # mamba never calls advance(); mamba2 ("ssm") does
def test_offsets_count_the_tokens_fed(kind, make_tiny_model):
    model, tokenizer = make_tiny_model(kind, seed=0)
    state = PromptCache.new(model)
    generate(model, tokenizer, "Good morning! How are you today?", state=state,
             config=DEFAULTS.updated(max_tokens=5, prefill_step_size=4))
    assert [c.offset for c in state.cache] == [len(state.tokens)] * len(state.cache)


def test_the_check_is_cheap():
    """Markers of 64 layers, checked: well under a millisecond per model call."""
    cache = [KVCache() for _ in range(32)] + [ArraysCache(2) for _ in range(32)]

    class Touches:
        def __call__(self, inputs, cache):
            for c in cache:
                if isinstance(c, ArraysCache):
                    c[0] = inputs + 0  # a new array, as a model stores
                else:
                    c.offset += inputs.shape[1]
            return inputs

    x = mx.array([[1]])
    per_call = min(timeit.repeat(lambda: call_model(Touches(), x, cache), number=200, repeat=3)) / 200
    assert per_call < 1e-3, per_call


def test_mlxcc_chat_prints_one_error_line(tiny_model_dirs, tmp_path, monkeypatch, capsys):
    real_load = loading.load
    monkeypatch.setattr(
        loading, "load",
        lambda ref=None, **options: _wrapped(real_load(ref, **options)),  # whatever load() takes
    )
    monkeypatch.setenv("MLXCC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Good morning!\n"))
    capsys.readouterr()
    rc = main(["chat", "--model", str(tiny_model_dirs["llama"]), "--max-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: the stub_ignores_cache model") and "layer 0" in lines[0]


def _wrapped(loaded):
    model, tokenizer = loaded
    return CacheIgnoringModel(model), tokenizer


def test_a_batch_call_is_checked_like_one_row(make_tiny_model):
    """Rows of mlx-lm's batch caches go through the same door: their ids are checked and
    a layer that did not take the batch's tokens is named."""
    from mlx_lm.models.cache import BatchKVCache

    from mlx_chatcache.errors import TokenIdError

    model, _ = make_tiny_model("llama", seed=0)
    rows = []
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8]):
        state = PromptCache.new(model)
        call_model(model, prompt, state.cache)
        rows.append(state.cache)
    batch = [BatchKVCache.merge([r[i] for r in rows]) for i in range(len(model.layers))]
    out = call_model(model, mx.array([[9], [10]], dtype=mx.uint32), batch)  # (B, 1)
    assert out.shape[:2] == (2, 1) and all(layer._idx == 6 for layer in batch)
    with pytest.raises(TokenIdError):
        call_model(model, mx.array([[9], [10**6]], dtype=mx.uint32), batch)
    assert all(layer._idx == 6 for layer in batch)  # nothing fed
    with pytest.raises(CacheNotUpdatedError, match=r"layer 0's cache \(BatchKVCache, offset still 6\)"):
        call_model(CacheIgnoringModel(model, skip={0}), mx.array([[9], [10]], dtype=mx.uint32), batch)
