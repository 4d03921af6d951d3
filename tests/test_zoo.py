"""The model-zoo sweep: every architecture in the installed ``mlx_lm.models``.

Each architecture module (one with ``Model`` and ``ModelArgs``) is built from a
tiny random config (``zoo_configs.config``), float32, ``mx.random.seed(0)``;
weight matrices mlx-lm initialises to all zeros (e.g. talkie's ``lm_head``) get
random values so no output is constant. On the same 30 token ids (``TOKENS``):

- ``logits``: fed in chunks ``CHUNKS`` (7, 1, 12, then single tokens), our
  ``make_prompt_cache(model)`` gives exactly (max |diff| 0.0) the logits of
  mlx-lm's own cache (``model.make_cache()``, else mlx-lm's
  ``make_prompt_cache``); the model's output depends on the context;
- ``save_load``: our cache saved (``save_prompt_cache``) after 20 tokens,
  loaded and continued token by token gives exactly the logits of the same
  cache continued in memory;
- ``rotating``: with ``make_prompt_cache(model, max_kv_size=16, keep=4)``, the
  window wrapped by single tokens, the logits equal mlx-lm's own
  ``RotatingKVCache(16, keep=4)`` put in place of each plain ``KVCache`` layer
  (exact); saved after 24 tokens, loaded (and copied): the same buffers slot
  for slot as the live cache, and continued: exactly the live cache's logits
  (a wrapped ring keeps its slot order through files and copies: models whose
  sparse indexers select keys by slot need it). Then the same save/load after
  a 12-token chunk overflowed the window (not compared with mlx-lm there: its
  window mask drops the ``keep`` tokens inside such a chunk, ours pins them);
- ``generate`` / ``generate_kv8``: mlx-lm's ``generate_step`` (greedy,
  ``GEN_TOKENS`` tokens, a 20-token prompt) with our cache list gives the
  tokens and log-probabilities of mlx-lm's own cache, without and with
  ``kv_bits=8`` (group 32, ``quantized_kv_start=0``). Where mlx-lm's own cache
  refuses ``kv_bits`` (``RotatingKVCache`` layers: "Quantization NYI") the
  ``generate_kv8`` check is skipped with mlx-lm's message.

All comparisons are exact (``np.array_equal``): both sides run the same mlx
operations on the same arrays, so any difference is a cache bug.

Architectures that cannot run here are in ``SKIPPED`` (reason), helper modules
in ``HELPERS``; ``test_every_module_is_swept_or_explained`` fails on a module
that is neither, so a new mlx-lm architecture cannot be missed silently.
Known failures would be strict xfails in ``KNOWN_LIMITS``, each with the
reason; there are none (mlx-lm 0.32.2).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil

import mlx.core as mx
import mlx_lm.models
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as lm
from mlx_lm.utils import MODEL_REMAPPING

from mlx_chatcache.cache import CacheList, KVCache, copy_prompt_cache, make_prompt_cache
from mlx_chatcache.cache.cache_base import kv_slice
from mlx_chatcache.files.mlxcc_format import load_prompt_cache, save_prompt_cache
from mlx_chatcache.errors import UnsupportedCacheError
from zoo_configs import VOCAB, config

CHUNKS = [7, 1, 12] + [1] * 10
TOKENS = np.random.default_rng(0).integers(3, VOCAB, size=sum(CHUNKS)).tolist()
SAVE_AT = 20  # save_load: after the 7, 1, 12 chunks
MAX_KV, KEEP = 16, 4
ROT_SAVE_AT = 24  # rotating: past the 16-token window
GEN_PROMPT, GEN_TOKENS = 20, 8

# Modules of mlx_lm.models that are not architectures (no Model / ModelArgs).
HELPERS: dict[str, str] = {
    "activations": "activation functions",
    "base": "BaseModelArgs, masks, attention helpers",
    "bitlinear_layers": "BitLinear layers for bitnet",
    "cache": "mlx-lm's cache classes",
    "gated_delta": "gated delta-rule kernels (qwen3_next, qwen3_5, kimi_linear, ...)",
    "mla": "multi-head latent attention helpers",
    "pipeline": "pipeline-parallel mixin",
    "rope_utils": "RoPE variants",
    "ssm": "state-space update helpers (mamba2, nemotron_h, ...)",
    "switch_layers": "mixture-of-experts layers",
}

# Architectures that cannot be swept here, with the reason.
SKIPPED: dict[str, str] = {
    "olmo": "needs the ai2-olmo package (the module exits at import without it)",
    "bitnet": "BitLinear uses a Metal-only kernel (mx.fast.metal_kernel): no Metal back-end here",
    "muse_spark": "uses Metal-only fused kernels (mlx_lm.kernels qk_norm_rope, ...): no Metal "
    "back-end here",
    "prism_hadamard_qwen35": "ModelArgs accepts only a 2-bit Hadamard-packed quantized checkpoint "
    "(schema/namespace/quantization checks); no tiny random config is possible",
    "phi3small": "needs vocab_size >= 100352: Model writes -inf into hard-coded token ids "
    "100256-100351 of the logits; with a tiny vocab that scatter is out of bounds and mlx "
    "crashes (segfault / 'corrupted double-linked list')",
}

# Architectures whose cache we knowingly refuse: make_prompt_cache must raise.
REFUSED: dict[str, str] = {
    "deepseek_v41": "LayerCache (compressed attention) is listed in mlx_chatcache.cache.UNSUPPORTED",
}

# Known failures: (architecture, check) -> reason, run as strict xfails. Empty:
# the last three (the rotating check of deepseek_v32, glm_moe_dsa and
# minimax_m3_vl: a loaded window lost the live ring's slot order) are fixed.
KNOWN_LIMITS: dict[tuple[str, str], str] = {}


# ----------------------------------------------------------------- module lists
def model_modules() -> list[str]:
    """Every module in the installed mlx_lm.models (without importing them)."""
    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__))


# model_type spellings mlx-lm maps onto another module whose code branches on
# them (mlx_lm.utils.MODEL_REMAPPING): swept as architectures of their own.
ALIASES: dict[str, str] = {"falcon_mamba": "mamba"}

SWEPT = sorted(
    [m for m in model_modules() if m not in HELPERS and m not in SKIPPED and m not in REFUSED]
    + list(ALIASES)
)


def arch_params(check: str) -> list:
    """``SWEPT`` as pytest params (same order for every check, so pytest builds
    each model once), with the ``KNOWN_LIMITS`` strict xfails for ``check``."""
    params = []
    for arch in SWEPT:
        reason = KNOWN_LIMITS.get((arch, check))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        params.append(pytest.param(arch, marks=marks, id=arch))
    return params


# ----------------------------------------------------------------- building
def build(arch: str):
    """The tiny float32 ``Model`` of ``arch`` (seed 0), parameters evaluated."""
    mod = importlib.import_module(f"mlx_lm.models.{ALIASES.get(arch, arch)}")
    wrapped = any(f.name == "text_config" for f in dataclasses.fields(mod.ModelArgs))
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(config(arch, wrapped)))
    rng = np.random.default_rng(1)
    zero = [
        (name, mx.array(rng.normal(0.0, 1.0 / math.sqrt(v.shape[-1]), v.shape).astype(np.float32)))
        for name, v in tree_flatten(model.parameters())
        if v.ndim >= 2 and v.dtype == mx.float32 and not mx.any(v).item()
    ]
    if zero:
        model.load_weights(zero, strict=False)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def zoo(request):
    return request.param, build(request.param)


def their_cache(model) -> list:
    return model.make_cache() if hasattr(model, "make_cache") else lm.make_prompt_cache(model)


def their_rotating_cache(model) -> list:
    """mlx-lm's own caches, each plain KVCache replaced by RotatingKVCache(MAX_KV, KEEP):
    what our make_prompt_cache(model, max_kv_size=MAX_KV, keep=KEEP) mirrors."""

    def bound(c):
        if type(c) is lm.KVCache:
            return lm.RotatingKVCache(max_size=MAX_KV, keep=KEEP)
        if type(c) is lm.CacheList:
            return lm.CacheList(*(bound(x) for x in c.caches))
        return c

    return [bound(c) for c in their_cache(model)]


def feed(model, cache, tokens, sizes) -> np.ndarray:
    """Logits (positions, vocab) of ``tokens`` fed in chunks of ``sizes``."""
    assert sum(sizes) == len(tokens)
    out, i = [], 0
    for n in sizes:
        logits = model(mx.array(tokens[i : i + n])[None], cache=cache)
        mx.eval(logits)
        out.append(np.array(logits[0].astype(mx.float32)))
        i += n
    return np.concatenate(out)


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


def assert_same(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.shape == b.shape, what
    assert np.array_equal(a, b), f"{what}: max |diff| {max_diff(a, b):.3g}"


def used_slots(c) -> list:
    """A layer's buffers as they are laid out (not ``state``): for a K/V cache the
    slots in use (``[0, size())``; a live cache may also have zeroed room), so a
    ring shows its slot order; for other layers their arrays; CacheLists recurse."""
    if isinstance(c, CacheList):
        return [a for child in c.caches for a in used_slots(child)]
    if isinstance(c, KVCache):
        return [] if c.keys is None else [kv_slice(b, 0, c.size()) for b in (c.keys, c.values)]
    return c.eval_arrays()


def assert_same_slots(a: list, b: list, what: str) -> None:
    """Every layer holds the same arrays in the same buffer slots."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        xs, ys = tree_flatten(used_slots(x)), tree_flatten(used_slots(y))
        assert len(xs) == len(ys), f"{what}: layer {i}"
        for (_, s), (_, t) in zip(xs, ys):
            assert s.shape == t.shape and mx.array_equal(s, t).item(), f"{what}: layer {i} slots differ"


def save_load(cache, tokens, tmp_path):
    path = tmp_path / "zoo.safetensors"
    save_prompt_cache(path, cache, tokens=tokens)
    return load_prompt_cache(path)


# ----------------------------------------------------------------- the sweep
zoo_sweep = pytest.mark.zoo  # the sweep proper: make zoo runs it, make test leaves it out


@zoo_sweep
@pytest.mark.parametrize("zoo", arch_params("logits"), indirect=True)
def test_logits_match_mlx_lm_cache(zoo):
    arch, model = zoo
    floats = [v for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    assert all(v.dtype == mx.float32 for v in floats)
    theirs = feed(model, their_cache(model), TOKENS, CHUNKS)
    assert np.isfinite(theirs).all() and theirs.std() > 1e-3, f"{arch}: degenerate logits"
    # the output depends on the context: another early token changes later logits
    other = list(TOKENS)
    other[SAVE_AT - 3] = (other[SAVE_AT - 3] + 1) % VOCAB
    changed = feed(model, their_cache(model), other, CHUNKS)
    assert max_diff(changed[SAVE_AT:], theirs[SAVE_AT:]) > 1e-4, f"{arch}: context is ignored"
    ours = feed(model, make_prompt_cache(model), TOKENS, CHUNKS)
    assert_same(ours, theirs, f"{arch}: our cache vs mlx-lm's")


@zoo_sweep
@pytest.mark.parametrize("zoo", arch_params("save_load"), indirect=True)
def test_save_load_continue(zoo, tmp_path):
    arch, model = zoo
    cache = make_prompt_cache(model)
    feed(model, cache, TOKENS[:SAVE_AT], CHUNKS[:3])
    loaded = save_load(cache, TOKENS[:SAVE_AT], tmp_path)
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    rest = TOKENS[SAVE_AT:]
    from_file = feed(model, loaded, rest, [1] * len(rest))
    in_memory = feed(model, cache, rest, [1] * len(rest))
    assert_same(from_file, in_memory, f"{arch}: loaded vs in-memory")


@zoo_sweep
@pytest.mark.parametrize("zoo", arch_params("rotating"), indirect=True)
def test_rotating_window_save_load(zoo, tmp_path):
    arch, model = zoo
    # 1. vs mlx-lm's RotatingKVCache: the window wraps by single tokens
    sizes = [7, 1, 8] + [1] * (ROT_SAVE_AT - 16)
    cache = make_prompt_cache(model, max_kv_size=MAX_KV, keep=KEEP)
    ours = feed(model, cache, TOKENS[:ROT_SAVE_AT], sizes)
    theirs_cache = their_rotating_cache(model)
    theirs = feed(model, theirs_cache, TOKENS[:ROT_SAVE_AT], sizes)
    assert_same(ours, theirs, f"{arch}: our rotating cache vs mlx-lm's")
    rest = TOKENS[ROT_SAVE_AT:]
    loaded = save_load(cache, TOKENS[:ROT_SAVE_AT], tmp_path)
    copied = copy_prompt_cache(cache)
    assert_same_slots(loaded, cache, f"{arch}: loaded vs live (window wrapped)")
    assert_same_slots(copied, cache, f"{arch}: copy vs live (window wrapped)")
    from_file = feed(model, loaded, rest, [1] * len(rest))
    assert_same(
        from_file,
        feed(model, copied, rest, [1] * len(rest)),
        f"{arch}: loaded vs in-memory copy (window wrapped)",
    )
    in_memory = feed(model, cache, rest, [1] * len(rest))
    assert_same(in_memory, feed(model, theirs_cache, rest, [1] * len(rest)), f"{arch}: continued")
    assert_same(from_file, in_memory, f"{arch}: loaded vs live")
    # 2. a 12-token chunk overflows the window (our semantics: keep stays pinned)
    cache = make_prompt_cache(model, max_kv_size=MAX_KV, keep=KEEP)
    feed(model, cache, TOKENS[:ROT_SAVE_AT], [7, 1, 12] + [1] * (ROT_SAVE_AT - SAVE_AT))
    loaded = save_load(cache, TOKENS[:ROT_SAVE_AT], tmp_path)
    copied = copy_prompt_cache(cache)
    assert_same_slots(loaded, cache, f"{arch}: loaded vs live (chunk overflowed)")
    assert_same_slots(copied, cache, f"{arch}: copy vs live (chunk overflowed)")
    from_file = feed(model, loaded, rest, [1] * len(rest))
    assert_same(from_file, feed(model, copied, rest, [1] * len(rest)), f"{arch}: loaded vs copy")
    live = feed(model, cache, rest, [1] * len(rest))
    assert_same(from_file, live, f"{arch}: loaded vs live (chunk overflowed)")


def generate(model, cache, **quant) -> tuple[list[int], np.ndarray]:
    prompt = mx.array(TOKENS[:GEN_PROMPT])
    tokens, logprobs = [], []
    for token, lp in generate_step(prompt, model, prompt_cache=cache, max_tokens=GEN_TOKENS, **quant):
        tokens.append(int(token))
        logprobs.append(np.array(lp.astype(mx.float32)))
    return tokens, np.stack(logprobs)


@zoo_sweep
@pytest.mark.parametrize("zoo", arch_params("generate"), indirect=True)
def test_generate_step_with_our_cache(zoo):
    arch, model = zoo
    want_tokens, want_lp = generate(model, their_cache(model))
    tokens, lp = generate(model, make_prompt_cache(model))
    assert tokens == want_tokens, arch
    assert_same(lp, want_lp, f"{arch}: generate_step log-probabilities")


KV8 = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0)


@zoo_sweep
@pytest.mark.parametrize("zoo", arch_params("generate_kv8"), indirect=True)
def test_generate_step_kv_bits_with_our_cache(zoo):
    arch, model = zoo
    try:
        want_tokens, want_lp = generate(model, their_cache(model), **KV8)
    except Exception as e:  # mlx-lm's own cache refuses kv_bits for this model
        pytest.skip(f"mlx-lm's own cache does not support kv_bits: {type(e).__name__}: {e}")
    tokens, lp = generate(model, make_prompt_cache(model), **KV8)
    assert tokens == want_tokens, arch
    assert_same(lp, want_lp, f"{arch}: generate_step(kv_bits=8) log-probabilities")


# ----------------------------------------------------------------- coverage guard
def test_every_module_is_swept_or_explained():
    """Each module of mlx_lm.models is swept, or a helper / skipped / refused
    with a reason; helpers really have no Model, swept ones have a config."""
    modules = set(model_modules())
    explained = {**HELPERS, **SKIPPED, **REFUSED}
    assert not set(explained) - modules, "stale entries: remove them"
    assert not set(HELPERS) & set(SKIPPED) and not set(SKIPPED) & set(REFUSED)
    for name, reason in explained.items():
        assert isinstance(reason, str) and len(reason) >= 10, name
    for name in HELPERS:
        mod = importlib.import_module(f"mlx_lm.models.{name}")
        assert not (hasattr(mod, "Model") and hasattr(mod, "ModelArgs")), f"{name} is an architecture"
    for alias, target in ALIASES.items():
        assert MODEL_REMAPPING.get(alias) == target, alias
    for name in SWEPT:
        mod = importlib.import_module(f"mlx_lm.models.{ALIASES.get(name, name)}")
        assert hasattr(mod, "Model") and hasattr(mod, "ModelArgs"), (
            f"mlx_lm.models.{name} is new and not an architecture: add it to HELPERS with a reason"
        )
    assert len(SWEPT) >= 100  # mlx-lm 0.32.2: 122 swept
    stale = {key for key in KNOWN_LIMITS if key[0] not in SWEPT}
    assert not stale, stale


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_refused_architectures_fail_loudly(arch):
    model = build(arch)
    their_cache(model)  # mlx-lm itself builds its cache
    with pytest.raises(UnsupportedCacheError, match="LayerCache"):
        make_prompt_cache(model)
