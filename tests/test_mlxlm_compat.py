"""Our caches are drop-in for mlx-lm 0.32's models and generate loop (issue 10).

Checked on tiny random models of the architectures that broke (each a few
layers, hidden <= 128, vocab 256) and on the cache classes alone:

- class identity: each class is an instance of mlx-lm's class of the same
  name (mamba and falcon_mamba store their state only in such a cache), and no
  public method of mlx-lm's class leaks into ours unless listed as harmless;
- ``to_quantized`` exists exactly where mlx-lm's generate loop may call it;
- mlx-lm's batch-only methods refuse with the reason;
- logits fed in chunks (7, 1, 12, then single tokens) with mlx-lm's own cache
  and with ``make_prompt_cache(model)`` are equal (float32, max abs diff 0.0)
  for mamba, falcon_mamba, afm7, gemma3n, plamo3, qwen3_next, llama;
- plamo3: one prefill through our cache equals the model run without a cache;
- ``keys_and_values()`` returns what the last ``update_and_fetch`` returned;
- masks: attention through our rotating cache equals attention through
  mlx-lm's (keep 0) for model windows below, at and above the cache size;
- mlx-lm's ``generate_step(kv_bits=8)`` with our cache list gives the tokens
  it gives with its own cache, and leaves quantized layers that our file
  format saves and loads;
- mamba: a cache saved and loaded mid-way continues exactly like the one in
  memory, and ``mlxcc chat`` resumed from its session file prints what one
  uninterrupted run prints.
"""

from __future__ import annotations

import importlib
import io
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as lm_generate_step
from mlx_lm.models import cache as lm

from mlx_chatcache.cache import (
    CACHE_CLASSES,
    UNSUPPORTED_METHODS,
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_chatcache.files.mlxcc_format import load_prompt_cache, read_cache_info, save_prompt_cache
from mlx_chatcache.cli.main import main
from mlx_chatcache.errors import UnsupportedCacheError

V = 256
ARCHS = {
    "mamba": dict(model_type="mamba", vocab_size=V, hidden_size=64, intermediate_size=128, state_size=8,
                  num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
                  time_step_rank="auto"),
    "falcon_mamba": dict(model_type="falcon_mamba", vocab_size=V, hidden_size=64, intermediate_size=128,
                         state_size=8, num_hidden_layers=2, conv_kernel=4, use_bias=False,
                         use_conv_bias=True, time_step_rank="auto"),
    "afm7": dict(model_type="afm7", vocab_size=V, hidden_dim=128, num_layers=4, num_kv_reuse_layers=2,
                 num_heads=4, num_kv_heads=2),
    "plamo3": dict(model_type="plamo3", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, window_size=8, sliding_window_pattern=2,
                   intermediate_size=128, vocab_size=V),
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                       num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                       shared_expert_intermediate_size=64, mlp_only_layers=[], moe_intermediate_size=32,
                       rms_norm_eps=1e-6, vocab_size=V, num_key_value_heads=2, rope_theta=10000.0,
                       partial_rotary_factor=0.5, max_position_embeddings=512, head_dim=32,
                       full_attention_interval=2),
    "gemma3n": dict(model_type="gemma3n", text_config=dict(
        model_type="gemma3n_text", hidden_size=64, num_hidden_layers=4, intermediate_size=[128] * 4,
        num_attention_heads=4, head_dim=32, rms_norm_eps=1e-6, vocab_size=V, num_key_value_heads=2,
        num_kv_shared_layers=2, vocab_size_per_layer_input=V, sliding_window=8,
        max_position_embeddings=512, rope_local_base_freq=10000.0, rope_theta=1000000.0,
        final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.0] * 4, hidden_size_per_layer_input=16, altup_num_inputs=2,
        altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0, laurel_rank=8)),
    "llama": dict(model_type="llama", vocab_size=V, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
                  rms_norm_eps=1e-5, rope_theta=10000.0),
}
MODULE = {"falcon_mamba": "mamba"}  # model_type -> mlx_lm.models module
IDS = [int(t) for t in np.random.default_rng(0).integers(3, V, 30)]  # 30 tokens: windows of 8 wrap
CHUNKS = [7, 1, 12]  # then single tokens


def build(name: str, seed: int = 0):
    """A tiny random mlx-lm model; weights N(0, 0.2) so every layer matters."""
    cfg = ARCHS[name]
    arch = importlib.import_module(f"mlx_lm.models.{MODULE.get(name, name)}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(cfg))
    params = [(k, mx.random.normal(v.shape) * 0.2) for k, v in _flat(model.parameters())]
    model.load_weights(params)
    mx.eval(model.parameters())
    return model


def _flat(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def feed(model, cache, ids, chunks=CHUNKS):
    """Logits (1, len(ids), V) of ``ids`` fed in ``chunks``, then one at a time."""
    out, i = [], 0
    sizes = list(chunks) + [1] * len(ids)
    while i < len(ids):
        n = sizes.pop(0)
        out.append(model(mx.array(ids[i : i + n])[None], cache=cache))
        i += n
    return mx.concatenate(out, axis=1)


def max_diff(a, b) -> float:
    return mx.abs(a - b).max().item()


# ------------------------------------------------------------------ classes
MLX_LM_TWIN = {
    KVCache: lm.KVCache,
    QuantizedKVCache: lm.QuantizedKVCache,
    RotatingKVCache: lm.RotatingKVCache,
    QuantizedRotatingKVCache: lm.QuantizedKVCache,  # mlx-lm has no quantized window cache
    ChunkedKVCache: lm.ChunkedKVCache,
    ArraysCache: lm.ArraysCache,
    CacheList: lm.CacheList,
}
# mlx-lm methods our classes may inherit (none: ArraysCache.batch_size is ours, right for batches)
HARMLESS: set[str] = set()


def test_every_class_is_an_instance_of_its_mlx_lm_twin():
    assert set(MLX_LM_TWIN) == set(CACHE_CLASSES.values())
    for ours, theirs in MLX_LM_TWIN.items():
        assert issubclass(ours, theirs), ours


@pytest.mark.parametrize("ours", sorted(MLX_LM_TWIN, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_no_mlx_lm_method_leaks_into_ours(ours):
    """Whatever a model or mlx-lm's loop calls on a cache is our code (or absent)."""
    lm_names = {n for k in ours.__mro__ if k.__module__.startswith("mlx_lm") for n in vars(k)}
    for name in sorted(n for n in lm_names if not n.startswith("_")):
        owner = next(k for k in ours.__mro__ if name in vars(k))
        assert owner.__module__.startswith("mlx_chatcache") or name in HARMLESS, (
            f"{ours.__name__}.{name} comes from {owner.__module__}.{owner.__name__}"
        )


def _instances():
    return [KVCache(), QuantizedKVCache(32, 8), RotatingKVCache(8, 2), QuantizedRotatingKVCache(8, 2, 32, 8),
            ChunkedKVCache(8), ArraysCache(2), CacheList(KVCache(), ArraysCache(1))]


def test_to_quantized_exists_where_mlx_lm_has_it():
    """mlx-lm's generate loop calls ``to_quantized`` on every layer that has it."""
    has = {type(c).__name__: hasattr(c, "to_quantized") for c in _instances()}
    assert has == {"KVCache": True, "QuantizedKVCache": False, "RotatingKVCache": True,
                   "QuantizedRotatingKVCache": False, "ChunkedKVCache": False, "ArraysCache": False,
                   "CacheList": False}
    # where mlx-lm has one, so do we (its RotatingKVCache's raises NotImplementedError; ours works)
    for c, theirs in [(KVCache(), lm.KVCache()), (RotatingKVCache(8), lm.RotatingKVCache(8))]:
        assert hasattr(theirs, "to_quantized") and hasattr(c, "to_quantized")


# the batch methods each class refuses: one-sequence K/V caches have no row methods, and the
# classes mlx-lm has no batch form of do not merge
ROW_METHODS = {"extract", "filter", "extend", "prepare", "finalize"}
REFUSED = {"KVCache": ROW_METHODS, "RotatingKVCache": ROW_METHODS,
           "QuantizedKVCache": ROW_METHODS | {"merge"}, "QuantizedRotatingKVCache": ROW_METHODS | {"merge"},
           "ChunkedKVCache": ROW_METHODS | {"merge"}, "ArraysCache": set(), "CacheList": set()}  # fmt: skip


@pytest.mark.parametrize("method", sorted(UNSUPPORTED_METHODS))
def test_batch_methods_a_class_lacks_refuse_with_the_reason(method):
    assert set(UNSUPPORTED_METHODS) == ROW_METHODS | {"merge"}
    for c in _instances():
        if method not in REFUSED[type(c).__name__]:
            continue
        with pytest.raises(UnsupportedCacheError, match=f"{type(c).__name__}.{method} is not supported: .*"):
            getattr(c, method)([c] if method == "merge" else [0])


def test_mlx_lm_batch_generator_merges_our_caches_and_refuses_quantized_ones():
    from mlx_lm.generate import _merge_caches

    batch = _merge_caches([[KVCache(), RotatingKVCache(8)], [KVCache(), RotatingKVCache(8)]])
    assert isinstance(batch[0], lm.BatchKVCache) and isinstance(batch[1], lm.BatchRotatingKVCache)
    with pytest.raises(UnsupportedCacheError, match="QuantizedKVCache.merge is not supported"):
        _merge_caches([[QuantizedKVCache(32, 8)], [QuantizedKVCache(32, 8)]])


# ------------------------------------------------------------------ keys_and_values, masks
def _kv(rng, n, d=32):
    return mx.array(rng.standard_normal((1, 2, n, d)).astype(np.float32))


@pytest.mark.parametrize("make", [KVCache, lambda: QuantizedKVCache(32, 8), lambda: RotatingKVCache(8, 0),
                                  lambda: RotatingKVCache(8, 3), lambda: QuantizedRotatingKVCache(8, 2, 32, 8),
                                  lambda: ChunkedKVCache(64)])
def test_keys_and_values_is_what_the_last_update_returned(make):
    rng, c = np.random.default_rng(1), make()
    assert c.keys_and_values() == (None, None)
    for n in [5, 1, 1, 7, 1, 12, 1, 20, 1, 3]:
        got = c.update_and_fetch(_kv(rng, n), _kv(rng, n))
        again = c.keys_and_values()
        flat = [a for x in got for a in (x if isinstance(x, tuple) else (x,))]
        flat2 = [a for x in again for a in (x if isinstance(x, tuple) else (x,))]
        assert len(flat) == len(flat2) and all(mx.array_equal(a, b).item() for a, b in zip(flat, flat2))


def _attend(c, q, k, v, window):
    mask = c.make_mask(q.shape[2], window_size=window)
    K, V = c.update_and_fetch(k, v)
    return mx.fast.scaled_dot_product_attention(q, K, V, scale=0.2, mask=mask)


@pytest.mark.parametrize("window", [None, 3, 8, 9, 12])
def test_rotating_attention_equals_mlx_lm_for_every_model_window(window):
    """keep 0 (what models make): our window cache attends as mlx-lm's, whether
    the model's window is below, at or above the cache size (plamo3: size + 1)."""
    rng, ours, theirs = np.random.default_rng(2), RotatingKVCache(8, 0), lm.RotatingKVCache(8, 0)
    for n in [5, 1, 1, 7, 1, 12, 1, 20, 1, 3, 1, 1, 9, 1]:
        q, k, v = (mx.array(rng.standard_normal((1, 2, n, 32)).astype(np.float32)) for _ in range(3))
        a, b = _attend(ours, q, k, v, window), _attend(theirs, q, k, v, window)
        assert max_diff(a, b) <= 1e-6, (n, ours.offset)


@pytest.mark.parametrize("window", [None, 3, 8, 9])
@pytest.mark.parametrize("return_array", [False, True])
def test_rotating_mask_kinds_are_mlx_lm_s(window, return_array):
    """None / "causal" / an array exactly when mlx-lm's cache gives one (models
    branch on it: deepseek_v32's sparse indexer takes a mask array apart), and
    for several tokens the same values."""
    rng, ours, theirs = np.random.default_rng(3), RotatingKVCache(8, 0), lm.RotatingKVCache(8, 0)
    for n in [5, 1, 1, 1, 7, 1, 12, 1, 1, 20, 1, 3, 1]:
        a = ours.make_mask(n, return_array=return_array, window_size=window)
        b = theirs.make_mask(n, return_array=return_array, window_size=window)
        assert type(a) is type(b), (n, ours.offset, a, b)
        if isinstance(a, mx.array):
            assert a.shape == b.shape
            if n > 1:
                assert mx.array_equal(a, b).item()
        k = _kv(rng, n)
        ours.update_and_fetch(k, k)
        theirs.update_and_fetch(k, k)


# ------------------------------------------------------------------ models
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_chunked_logits_equal_mlx_lm_cache(name):
    model = build(name)
    theirs = feed(model, lm.make_prompt_cache(model), IDS)
    ours_cache = make_prompt_cache(model)
    ours = feed(model, ours_cache, IDS)
    assert max_diff(theirs, ours) == 0.0
    if name in ("mamba", "falcon_mamba"):  # the state is there, not zeros
        assert all(mx.abs(a).max().item() > 0 for c in ours_cache for a in c.state)


def test_plamo3_one_prefill_equals_the_model_without_cache():
    model = build("plamo3")
    ids = mx.array(IDS)[None]  # 30 tokens, window 8: the mask is one wider than the cache
    assert max_diff(model(ids, cache=make_prompt_cache(model)), model(ids)) == 0.0


@pytest.mark.parametrize("name", ["mamba", "gemma3n", "plamo3"])
def test_saved_and_loaded_mid_way_continues_exactly(name, tmp_path):
    model = build(name)
    cache = make_prompt_cache(model)
    feed(model, cache, IDS[:20])
    save_prompt_cache(tmp_path / "c.safetensors", cache, tokens=IDS[:20])
    loaded = load_prompt_cache(tmp_path / "c.safetensors")
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    rest = IDS[20:]
    assert max_diff(feed(model, cache, rest, [3]), feed(model, loaded, rest, [3])) == 0.0


def test_mlx_lm_generate_step_with_kv_bits_on_our_cache_list(tmp_path):
    model = build("llama")
    prompt = mx.array(IDS[:12])

    def run(cache):
        steps = lm_generate_step(prompt, model, max_tokens=10, prompt_cache=cache, kv_bits=8, kv_group_size=32,
                                 quantized_kv_start=0, prefill_step_size=5)
        return [int(t) for t, _ in steps]

    theirs, ours_cache = run(lm.make_prompt_cache(model)), make_prompt_cache(model)
    assert run(ours_cache) == theirs
    assert {type(c) for c in ours_cache} == {QuantizedKVCache}
    save_prompt_cache(tmp_path / "q.safetensors", ours_cache)
    assert read_cache_info(tmp_path / "q.safetensors").classes == ["QuantizedKVCache"] * 2


# ------------------------------------------------------------------ mamba chat
def _chat(home, model_dir, stdin, *flags, subprocess_run=False, monkeypatch=None, capsys=None):
    args = ["chat", "--model", str(model_dir), "--max-tokens", "8", "-v", "--session", *flags]
    if subprocess_run:
        env = {**os.environ, "MLXCC_HOME": str(home)}
        p = subprocess.run([sys.executable, "-m", "mlx_chatcache", *args], input=stdin, capture_output=True,
                           text=True, env=env, timeout=120)
        return p.returncode, p.stdout, p.stderr
    monkeypatch.setenv("MLXCC_HOME", str(home))
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    rc = main(args)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_mamba_chat_resumed_continues_as_one_run(make_tiny_model_dir, tmp_path, monkeypatch, capsys):
    d = make_tiny_model_dir("mamba", seed=0)
    turns = ["Good morning!", "What is the capital of Italy?", "Write a list: apples, oranges.", "Thank you."]
    script = "".join(t + "\n" for t in turns)
    home = tmp_path / "home"
    rc, full_out, full_err = _chat(home, d, script, "full", monkeypatch=monkeypatch, capsys=capsys)
    assert rc == 0 and full_out.count("\n") >= 4, full_err
    rc, out1, err1 = _chat(home, d, "".join(t + "\n" for t in turns[:2]), "s", monkeypatch=monkeypatch,
                           capsys=capsys)
    assert rc == 0, err1
    info = read_cache_info(home / "sessions" / "s.safetensors")
    assert info.classes == ["ArraysCache", "ArraysCache"]
    saved = load_prompt_cache(home / "sessions" / "s.safetensors")
    assert all(c.offset == len(info.tokens) for c in saved)  # offsets count the tokens (no advance() in mamba)
    assert all(mx.abs(a).max().item() > 0 for c in saved for a in c.state)  # the state was stored
    rc, out2, err2 = _chat(home, d, "".join(t + "\n" for t in turns[2:]), "s", subprocess_run=True)
    assert rc == 0, err2
    assert "0 tokens recomputed" in err2 and "resumed session 's': 2 turns" in err2
    assert out1 + out2 == full_out
