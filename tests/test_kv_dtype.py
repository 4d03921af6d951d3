"""A cache's K/V dtype (``kv_dtype``, --kv-dtype): the cache holds its keys/values
in it in every path (prefill, decode, trim, save and load, a rotating window's wrap,
quantized scales), so reusing a cache gives exactly the logits of a run without it that
feeds the same chunks; files record it, store scopes hash it, a bad value is one line."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings, strategies as st

from cli_helpers import mlxcc, one_error_line
from mlx_chatcache.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    copy_prompt_cache,
    hold_kv_in,
    make_prompt_cache,
    quantize_prompt_cache,
)
from mlx_chatcache.config import DEFAULTS, KV_DTYPES, CacheShape
from mlx_chatcache.errors import CacheFormatError, UsageError
from mlx_chatcache.files.mlxcc_format import read_cache_info
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.checkout import prompt_scope
from mlx_chatcache.generation.templates import feed_all
from mlx_chatcache.store.store import PromptStore
from mlx_chatcache.store.disk import DiskTier
from mlx_chatcache.cache import compact_copy
from mlx_chatcache.store.tiers import MemoryTier
from store_helpers import tokens_of


def kv_dtypes(cache) -> set:
    """The dtypes of every float array the K/V layers of ``cache`` hold (quantized: scales, biases)."""
    return {a.dtype for c in cache if isinstance(c, KVCache) for a in c.flat_state() if a.dtype != mx.uint32}


def feed(model, cache, tokens):
    logits = model(mx.array([tokens]), cache=cache)
    mx.eval(logits)
    return logits


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_cache_holds_its_kv_dtype_after_prefill_decode_trim_and_load(kv_dtype, llama_model, tmp_path):
    model, _ = llama_model
    want = getattr(mx, kv_dtype)
    state = PromptCache.new(model, CacheShape(kv_dtype=kv_dtype))
    feed_all(model, state, tokens_of(40), 16)  # prefill in chunks
    assert kv_dtypes(state.cache) == {want}
    for t in tokens_of(3, start=5):  # decode
        feed(model, state.cache, [t])
        state.tokens.append(t)
    assert kv_dtypes(state.cache) == {want}
    for c in state.cache:
        c.trim(5)
    del state.tokens[-5:]
    feed(model, state.cache, [7, 8])
    state.tokens += [7, 8]
    assert kv_dtypes(state.cache) == {want}
    state.save(tmp_path / "c.safetensors")
    assert read_cache_info(tmp_path / "c.safetensors").settings["kv_dtype"] == kv_dtype
    back = PromptCache.load(tmp_path / "c.safetensors", model)
    assert back.shape.kv_dtype == kv_dtype and kv_dtypes(back.cache) == {want}
    feed(model, back.cache, tokens_of(300, start=9))  # past the loaded buffers: they grow
    assert kv_dtypes(back.cache) == {want}


def test_the_activation_dtype_is_kept_by_auto_and_float32(llama_model):
    model, _ = llama_model
    act = feed(model, make_prompt_cache(model), [1, 2]).dtype
    for kv_dtype, want in (("auto", act), ("float32", mx.float32)):
        cache = make_prompt_cache(model, kv_dtype=kv_dtype)
        feed(model, cache, tokens_of(10))
        assert kv_dtypes(cache) == {want}


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=8), st.integers(4, 12))
def test_a_rotating_window_holds_float16_through_its_wrap(chunks, window):
    cache = RotatingKVCache(window, keep=2)
    cache.kv_dtype = mx.float16
    for n in chunks:  # one token: the ring; several past the window: the overflow path
        k = mx.random.normal((1, 2, n, 8))
        out_k, out_v = cache.update_and_fetch(k, k)
        assert out_k.dtype == out_v.dtype == mx.float16
    assert kv_dtypes([cache]) == {mx.float16}


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_quantized_kv_scales_take_the_kv_dtype(kv_dtype, llama_model):
    model, _ = llama_model
    want = getattr(mx, kv_dtype)
    cache = make_prompt_cache(model, kv_dtype=kv_dtype)
    feed(model, cache, tokens_of(20))
    quantize_prompt_cache(cache, 32, 4)  # the float layers become quantized ones
    assert all(isinstance(c, QuantizedKVCache) for c in cache)
    feed(model, cache, tokens_of(3))  # new tokens: cast, then quantized
    assert kv_dtypes(cache) == {want}
    rot = make_prompt_cache(model, max_kv_size=8, keep=2, kv_dtype=kv_dtype)
    feed(model, rot, tokens_of(12))
    quantize_prompt_cache(rot, 32, 4)
    for t in tokens_of(5):
        feed(model, rot, [t])
    assert kv_dtypes(rot) == {want}


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "float32"])
def test_a_reused_cache_gives_exactly_the_logits_of_a_run_without_it(kv_dtype, llama_model, tmp_path):
    model, _ = llama_model
    prompt, more = tokens_of(30), tokens_of(6, start=11)

    def prefilled(kv_dtype):  # both runs prefill alike: equal shapes give equal bits on any BLAS
        state = PromptCache.new(model, CacheShape(kv_dtype=kv_dtype))
        feed_all(model, state, prompt, 2048)
        return state

    want = feed(model, prefilled(kv_dtype).cache, more)
    prefilled(kv_dtype).save(tmp_path / "c.safetensors")
    back = PromptCache.load(tmp_path / "c.safetensors", model)
    got = feed(model, back.cache, more)
    assert got.dtype == want.dtype and mx.array_equal(got, want).item()
    if kv_dtype != "float32":  # the dtype took effect: float32 K/V give other logits
        assert not mx.array_equal(feed(model, prefilled("float32").cache, more), want).item()


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_stored_cache_is_served_only_to_its_kv_dtype(tier, llama_model, tmp_path):
    model, _ = llama_model
    store = PromptStore([MemoryTier(1 << 30) if tier == "memory" else DiskTier(tmp_path / "d", 1 << 30)])
    tokens = tokens_of(20)
    f32 = DEFAULTS.updated(kv_dtype="float32")
    state = PromptCache.new(model, f32.shape)
    feed_all(model, state, tokens, 2048)
    store.put(prompt_scope(model, f32), state.tokens, state.cache)
    f16 = DEFAULTS.updated(kv_dtype="float16")
    got, where = store.checkout(prompt_scope(model, f16), model, tokens + [1], f16.shape)
    assert where is None and got.tokens == []
    got, where = store.checkout(prompt_scope(model, f32), model, tokens + [1], f32.shape)
    assert where == tier and got.tokens == tokens
    f16_state = PromptCache.new(model, f16.shape)
    feed_all(model, f16_state, tokens, 2048)
    store.put(prompt_scope(model, f16), f16_state.tokens, f16_state.cache)
    got, where = store.checkout(prompt_scope(model, f16), model, tokens + [1], f16.shape)
    assert where == tier and got.tokens == tokens
    feed(model, got.cache, [3])  # served layers keep holding float16
    assert kv_dtypes(got.cache) == {mx.float16}


def test_a_file_without_kv_dtype_reads_as_auto_and_a_bad_one_is_refused():
    assert CacheShape.recorded({"kv_bits": None}, "f").kv_dtype == "auto"
    assert CacheShape.recorded({"kv_dtype": "bfloat16"}, "f").kv_dtype == "bfloat16"
    with pytest.raises(CacheFormatError, match="kv_dtype .*the file is damaged"):
        CacheShape.recorded({"kv_dtype": "float8"}, "f")
    with pytest.raises(UsageError, match="kv_dtype must be one of"):
        make_prompt_cache(type("M", (), {"layers": [0]})(), kv_dtype="int8")


@pytest.mark.parametrize("command", ["generate", "cache-prompt", "chat", "serve"])
def test_a_bad_kv_dtype_flag_is_one_line(command):
    p = mlxcc(command, "--kv-dtype", "float8")
    line = one_error_line(p)
    assert p.returncode == 2 and "--kv-dtype" in line and ", ".join(KV_DTYPES) in line and "'float8'" in line


def run_main(capsys, *argv):
    from mlx_chatcache.cli.main import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_cache_prompt_and_generate_with_kv_dtype(kind, tiny_model_dirs, tmp_path, capsys):
    d, f = str(tiny_model_dirs[kind]), str(tmp_path / "sys.safetensors")
    system = "You are a terse assistant who answers about rivers."
    code, _, _ = run_main(capsys, "cache-prompt", "--model", d, "--system-prompt", system,
                          "--prompt-cache-file", f, "--kv-dtype", "float16")  # fmt: skip
    assert code == 0 and read_cache_info(f).settings["kv_dtype"] == "float16"
    from mlx_chatcache.files.mlxcc_format import load_prompt_cache

    cache = load_prompt_cache(f)
    assert kv_dtypes(cache) == {mx.float16}
    if kind == "hybrid":  # SSM state is not cast
        assert any(a.dtype == mx.float32 for c in cache if not isinstance(c, KVCache) for a in c.flat_state())
    ask = ("generate", "--model", d, "-p", "Name a river.", "-m", "8")
    code, cached, _ = run_main(capsys, *ask, "--prompt-cache-file", f)  # the file's kv_dtype is used
    assert code == 0
    code, uncached, _ = run_main(capsys, *ask, "--system-prompt", system, "--kv-dtype", "float16")
    assert code == 0 and cached == uncached
    before = open(f, "rb").read()
    code, out, err = run_main(capsys, *ask, "--prompt-cache-file", f, "--kv-dtype", "bfloat16")
    assert code != 0 and out == "" and err.strip().count("\n") == 0
    assert "kv_dtype=float16 but kv_dtype=bfloat16" in err and open(f, "rb").read() == before


def test_a_copied_cache_keeps_its_kv_dtype_through_a_wrap():
    cache = RotatingKVCache(8, keep=2)
    cache.kv_dtype = mx.float16
    cache.update_and_fetch(*(mx.random.normal((1, 2, 6, 8)),) * 2)
    (copy,) = copy_prompt_cache([cache])  # a chat checkpoint, a memory-tier entry
    k, v = copy.update_and_fetch(*(mx.random.normal((1, 2, 5, 8)),) * 2)  # past the window: concatenated
    assert k.dtype == v.dtype == mx.float16 and kv_dtypes([copy]) == {mx.float16}


EMPTY_LAYERS = {
    "kv": KVCache,
    "quantized": lambda: QuantizedKVCache(group_size=32, bits=4),
    "rotating": lambda: RotatingKVCache(8, keep=2),
    "list": lambda: CacheList(ArraysCache(2), KVCache()),
}


@pytest.mark.parametrize("copy", [compact_copy, copy_prompt_cache], ids=["compact_copy", "copy_prompt_cache"])
@pytest.mark.parametrize("layer", list(EMPTY_LAYERS))
def test_a_copy_of_an_empty_float16_layer_holds_what_it_is_fed_in_float16(copy, layer):
    """An empty layer has no arrays to tell its dtype: the copy (n choices' rows, a
    store entry, a checkpoint) keeps the source's ``kv_dtype`` itself."""
    (made,) = copy(copy(hold_kv_in([EMPTY_LAYERS[layer]()], "float16")))
    kv = made.caches[1] if isinstance(made, CacheList) else made
    assert kv.empty() and kv.kv_dtype == mx.float16
    kv.update_and_fetch(*(mx.random.normal((1, 2, 3, 64)),) * 2)  # computed in float32
    assert kv_dtypes([kv]) == {mx.float16}


def test_a_file_from_before_kv_dtype_serves_auto_and_is_refused_for_float16(llama_model, tmp_path, capsys):
    from mlx_chatcache.files.mlxcc_format import save_prompt_cache

    model, tokenizer = llama_model
    state = PromptCache.new(model)
    feed_all(model, state, tokens_of(12), 2048)
    f = tmp_path / "old.safetensors"
    save_prompt_cache(f, state.cache, tokens=state.tokens, model=model.fingerprint, text="x",
                      settings={"max_kv_size": None, "keep": 4})  # fmt: skip
    assert "kv_dtype" not in read_cache_info(f).settings
    back = PromptCache.load(f, model)
    assert back.shape.kv_dtype == "auto" and all(c.kv_dtype is None for c in back.cache)
    f16 = DEFAULTS.updated(kv_dtype="float16")
    with pytest.raises(UsageError, match="was made with kv_dtype=auto but kv_dtype=float16 was asked"):
        PromptCache.load(f, model, f16.shape)
    got = PromptCache.load(f, model, DEFAULTS.shape)
    assert got.tokens == state.tokens and got.shape == DEFAULTS.shape
