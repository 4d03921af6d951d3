"""The CPU weight policy (mlx_chatcache.models.weights): same answers within float32
rounding, stated memory, fingerprint unchanged, caches of one policy continue
under another.

Tolerances (measured; asserted with margin):
- tiny 4-bit llama (group 32, float16 scales like a GGUF): float32 and q
  logits vs the model as loaded: max |diff| 3.2e-3 x max |logit| (asserted
  <= 1e-2). The difference is the as-loaded quantized embedding, which
  returns float16 (its scales' dtype): the policies keep float32. Against
  the as-loaded model with float32 scales (today's arithmetic without that
  rounding) and against each other: <= 1e-4 x max |logit| (the same
  dequantized values, another summation order).
- SmolLM2 Q4_1, 12 prompt tokens + 1 decode step: max |diff| vs as loaded
  0.05 on logits up to ~35 (asserted < 0.2), the same argmax everywhere.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_chatcache.models import weights as W
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.errors import UsageError
from mlx_chatcache.files.mlxcc_format import read_cache_info
from mlx_chatcache.generation.text import generate
from mlx_chatcache.models.loading import load
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.templates import feed_all

PROMPT = [3, 17, 42, 99, 5, 8, 61, 23, 77, 14, 2, 31]  # 12 tokens: the prefill path (>= 8 rows)


def quantized_tiny(folder, policy: str, scales=mx.float16):
    """The tiny llama quantized to 4 bits (group 32, float16 scales and biases,
    float32 norms: as a Q4 GGUF loads), then ``policy``."""
    model, tok = load(str(folder), weights="loaded")
    nn.quantize(model, group_size=32, bits=4)
    for _, layer in W._quantized_modules(model):
        for name in ("scales", "biases"):  # float16 values, held as ``scales`` dtype
            layer[name] = layer[name].astype(mx.float16).astype(scales)
    W.apply_weight_policy(model, policy)
    return model, tok


def logits_of(model, tokens=PROMPT):
    """Prefill logits (1, T, V) and one decode step's (1, 1, V), float32."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prefill = model(mx.array([tokens]), cache=cache)
    step = model(mx.array([[7]]), cache=cache)
    return prefill.astype(mx.float32), step.astype(mx.float32)


def rel_err(a, b) -> float:
    return (mx.abs(a - b).max() / mx.abs(a).max()).item()


@pytest.fixture(scope="module")
def tiny_policies(tiny_model_dirs):
    models = {p: quantized_tiny(tiny_model_dirs["llama"], p)[0] for p in ("loaded", "float32", "q")}
    models["loaded, float32 scales"] = quantized_tiny(tiny_model_dirs["llama"], "loaded", mx.float32)[0]
    return models


def test_policies_agree_with_the_model_as_loaded(tiny_policies):
    ref = logits_of(tiny_policies["loaded"])
    ref32 = logits_of(tiny_policies["loaded, float32 scales"])
    f32, q = logits_of(tiny_policies["float32"]), logits_of(tiny_policies["q"])
    for got in (f32, q):
        for r, r32, g in zip(ref, ref32, got):
            assert rel_err(r, g) <= 1e-2
            assert rel_err(r32, g) <= 1e-4
            assert mx.array_equal(r32.argmax(-1), g.argmax(-1))
    for a, b in zip(f32, q):
        assert rel_err(a, b) <= 1e-4


def test_float32_policy_dequantizes_everything(tiny_policies, tiny_model_dirs):
    model = tiny_policies["float32"]
    assert not W._quantized_modules(model)
    floats = [v.dtype for _, v in tree_flatten(model.parameters())]
    assert set(floats) == {mx.float32}
    report = model.weight_report
    assert report.policy == "float32" and report.bytes_after == W.parameter_bytes(model)
    fresh = quantized_tiny(tiny_model_dirs["llama"], "loaded")[0]
    assert W.float32_bytes(fresh) == report.bytes_after  # the memory cost stated before applying
    assert report.bytes_after > 3 * report.bytes_before  # 4-bit + f16 scales -> float32


def test_q_policy_keeps_layers_quantized_with_float32_activations(tiny_policies):
    model = tiny_policies["q"]
    layers = W._quantized_modules(model)
    assert layers and all(isinstance(m, (W.PrefillQuantizedLinear, W.PrefillQuantizedEmbedding)) for _, m in layers)
    assert {v.dtype for _, v in tree_flatten(model.parameters())} <= {mx.float32, mx.uint32}
    assert logits_of(model)[0].dtype == mx.float32
    # decode rows use MLX's quantized kernel, prompt chunks the dequantized weight
    layer = model.model.layers[0].mlp.up_proj
    x1, x8 = mx.random.normal((1, 1, layer.weight.shape[1] * 8)), mx.random.normal((1, 8, layer.weight.shape[1] * 8))
    kernel = mx.quantized_matmul(x1, layer.weight, layer.scales, layer.biases, True, 32, 4)
    assert mx.array_equal(layer(x1), kernel)
    dense = x8 @ W._dequantized(layer).T
    assert mx.array_equal(layer(x8), dense)


def test_auto_policy_follows_the_size_cap(tiny_model_dirs, monkeypatch):
    folder = tiny_model_dirs["llama"]
    assert quantized_tiny(folder, "auto")[0].weight_report.policy == "float32"
    monkeypatch.setattr(W, "FLOAT32_MAX_BYTES", 1000)
    model = quantized_tiny(folder, "auto")[0]
    assert model.weight_report.policy == "q" and "auto" in model.weight_report.reason
    float_model, _ = load(str(folder), weights="auto")  # nothing quantized, too big: as loaded
    assert float_model.weight_report.policy == "loaded"


def test_unknown_policy_is_one_clear_error(tiny_model_dirs):
    with pytest.raises(UsageError, match="unknown weight policy 'f16'.*q, float32, auto"):
        load(str(tiny_model_dirs["llama"]), weights="f16")


def test_fingerprint_does_not_depend_on_the_policy(tiny_model_dirs):
    prints = {load(str(tiny_model_dirs["llama"]), weights=p)[0].fingerprint for p in W.LIBRARY_POLICIES}
    assert len(prints) == 1


def test_cache_of_one_policy_continues_under_another(tiny_policies, tmp_path):
    """A cache computed with float32 weights, saved, loaded by the q-policy model:
    the next logits are the q model's uncached logits within the policy tolerance,
    and the file records the policy it was computed with."""
    f32, q = tiny_policies["float32"], tiny_policies["q"]
    state = PromptCache.new(f32)
    feed_all(f32, state, PROMPT, 512)
    path = tmp_path / "f32.safetensors"
    state.text = ""
    state.save(path)
    assert read_cache_info(path).settings["weights"] == "float32"
    f32.fingerprint = q.fingerprint  # same folder, same fingerprint (checked above)
    stored = PromptCache.load(path, q)
    assert stored.settings["weights"] == "q"  # saved again, it names the policy that continued it
    cont = q(mx.array([[7]]), cache=stored.cache)
    uncached = q(mx.array([PROMPT + [7]]))[:, -1:]
    assert rel_err(uncached, cont) <= 1e-3


@pytest.mark.real_model
def test_smollm2_policies_keep_the_answer(demo_gguf):
    """Greedy demo answer unchanged; logits within 0.2 of the GGUF as loaded."""
    ref_model, tok = load(demo_gguf, weights="loaded")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True)
    ref = logits_of(ref_model, ids)
    del ref_model
    for policy in ("float32", "q"):
        model, _ = load(demo_gguf, weights=policy)
        got = logits_of(model, ids)
        for r, g in zip(ref, got):
            assert mx.abs(r - g).max().item() < 0.2
            assert mx.array_equal(r.argmax(-1), g.argmax(-1))
        text = generate(model, tok, ids, config=DEFAULTS.updated(max_tokens=12))
        assert text.strip() == "The capital of France is Paris.", (policy, text)


# ------------------------------------------------------------------ CLI
def test_cli_weights_flag_verbose_and_cache_info(tiny_model_dirs, tmp_path, capsys):
    from mlx_chatcache.cli.main import main

    folder, cache = str(tiny_model_dirs["llama"]), str(tmp_path / "c.safetensors")
    argv = ["generate", "--model", folder, "-p", "hi", "-m", "2", "--verbose", "--save-prompt-cache", cache]
    assert main([*argv, "--weights", "float32"]) == 0
    err = capsys.readouterr().err
    assert "\nBLAS: " in err and "\nWeights: float32 (as requested" in err
    assert main(["cache", "info", cache]) == 0
    assert "weights:     float32" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main([*argv, "--weights", "f16"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--weights: invalid choice: 'f16'" in err


def test_doctor_reports_the_blas_in_effect(capsys):
    import json

    from mlx_chatcache.backend import blas
    from mlx_chatcache.cli.main import main

    assert main(["doctor", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["blas_active"] == blas.STATUS.active and r["blas"] == blas.describe()
    assert r["blas_in_effect"] == (blas.STATUS.active and r["cblas_sgemm_from"] == blas.STATUS.library)
    if blas.STATUS.active:  # the swap took effect in this process: cblas_sgemm is ours
        assert r["blas_in_effect"] and r["blas_threads"] >= 1
    assert r["sgemm_512_gflops"] > 0 and r["weights_default"] == "auto"
