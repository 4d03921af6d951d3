"""Named cache files (``--prompt-cache-file``/``--save-prompt-cache``, a chat session) with real
caches: written by ``PromptCache.save`` through put_prompt, read strictly by ``PromptCache.load``
through checkout_prompt beside the store's shared tiers. What a named file serves (its prefix,
trimmed back only when its cache can be), that it is strict (errors instead of misses, whether
or not it serves), which source wins (the longer prefix; the named file on a tie; each read
only when it may win), what is written (an empty cache too, to the named file only) and how a
failing shared tier is reported."""

from __future__ import annotations

import numpy as np
import pytest

from loop_helpers import forward
from store_helpers import SETTINGS, filled_state, scope, tokens_of

from mlx_chatcache.cache import make_prompt_cache
from mlx_chatcache.config import CacheShape
from mlx_chatcache.errors import CacheFileError, CacheFormatError, ChatCacheError, ModelMismatchError, UsageError
from mlx_chatcache.files.mlxcc_format import read_cache_info, save_prompt_cache
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.files.tokens import common_prefix_len
from mlx_chatcache.generation.checkout import checkout_prompt, put_prompt
from mlx_chatcache.generation.prompt import reuse_prefix
from mlx_chatcache.models.loading import load
from mlx_chatcache.store.disk import DiskTier
from mlx_chatcache.store.store import PromptStore

MESSAGES = [{"role": "user", "content": "hello"}]


def no_warning(line: str) -> None:
    pytest.fail(f"unexpected warning: {line}")


def write(model, path, tokens, settings=SETTINGS, store=None, **kw):
    """Write a cache holding ``tokens`` to the named file ``path`` (and ``store``'s tiers)."""
    state = filled_state(model, tokens, **kw)
    state.messages, state.settings, state.metadata = MESSAGES, dict(settings), {"note": "kept"}
    put_prompt(store, scope(model, settings), state, no_warning, named=path)


def served(model, prompt, named=None, store=None, settings=SETTINGS):
    """``(state, tier, n)``: what checkout_prompt hands out for ``prompt`` and the prompt
    tokens (but the last) its tokens share; a miss is an empty state, tier None."""
    state, tier = checkout_prompt(store or PromptStore(), scope(model, settings), model, prompt,
                                  CacheShape(**settings), named)  # fmt: skip
    assert isinstance(state, PromptCache) and len(state.cache) == len(make_prompt_cache(model))
    if tier is None:
        assert state.tokens == [], "a miss hands out an empty cache"
    return state, tier, min(common_prefix_len(state.tokens, prompt), len(prompt) - 1)


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_named_file_serves_its_prefix_like_a_fresh_prefill(kind, tiny_model_dirs, tmp_path):
    model, _ = load(str(tiny_model_dirs[kind]))
    f = tmp_path / "c.safetensors"
    base = tokens_of(30)
    write(model, f, base)
    info = read_cache_info(f)
    assert info.tokens == base and info.messages == MESSAGES and info.metadata == {"note": "kept"}
    prompt = base + tokens_of(6, start=200)
    state, tier, n = served(model, prompt, f)
    assert tier == "file" and n == 30 and state.tokens == base
    reused = reuse_prefix(state, prompt, model)
    warm = forward(model, state.cache, prompt[reused:])
    cold = forward(model, make_prompt_cache(model), prompt)
    assert reused == 30
    np.testing.assert_allclose(np.array(warm), np.array(cold), atol=1e-4)
    # a prompt that leaves the file's tokens at 12: a trimmable cache serves 12, an SSM one nothing
    branch = base[:12] + tokens_of(8, start=250)
    state, tier, n = served(model, branch, f)
    if kind == "llama":
        assert tier == "file" and n == 12 and reuse_prefix(state, branch, model) == 12
    else:
        assert tier is None
    # nothing in common: a miss
    assert served(model, tokens_of(8, start=250), f)[1] is None


def test_a_shared_prefix_serves_when_the_named_file_cannot_be_trimmed_back(tiny_model_dirs, tmp_path):
    model, _ = load(str(tiny_model_dirs["hybrid"]))
    f, base = tmp_path / "c.safetensors", tokens_of(30)
    write(model, f, base)
    store = PromptStore([DiskTier(tmp_path / "dir", 1 << 30)])
    put_prompt(store, scope(model), filled_state(model, base[:10]), no_warning)
    branch = base[:12] + tokens_of(8, start=250)
    state, tier, n = served(model, branch, f, store)
    assert tier == "disk" and n == 10 and state.tokens == base[:10]


def test_the_longer_prefix_wins_and_the_named_file_a_tie(llama_model, tmp_path, monkeypatch):
    model, _ = llama_model
    f, base = tmp_path / "c.safetensors", tokens_of(20)
    store = PromptStore([DiskTier(tmp_path / "dir", 1 << 30)])
    write(model, f, base, store=store)  # the file and the shared tier hold the same tokens
    assert read_cache_info(f).tokens == base
    loads, checkouts = [], []
    real_load, real_checkout = PromptCache.load, store.checkout
    monkeypatch.setattr(PromptCache, "load", classmethod(lambda cls, *a, **k: loads.append(1) or real_load(*a, **k)))
    monkeypatch.setattr(store, "checkout", lambda *a, **k: checkouts.append(1) or real_checkout(*a, **k))
    prompt = base + [7, 8]
    state, tier, n = served(model, prompt, f, store)
    assert (tier, n, state.tokens) == ("file", 20, base) and (len(loads), len(checkouts)) == (1, 1)
    # the file serves every prompt token but the last: the shared tiers are not asked
    state, tier, n = served(model, base + [7], f, store)
    assert (tier, n) == ("file", 20) and (len(loads), len(checkouts)) == (2, 1)
    # a longer shared entry wins; the named file's header is checked, its layers are not read
    longer = base + tokens_of(10, start=120)
    put_prompt(store, scope(model), filled_state(model, longer), no_warning)
    state, tier, n = served(model, longer + [7], f, store)
    assert (tier, n, state.tokens) == ("disk", 30, longer) and (len(loads), len(checkouts)) == (2, 2)
    reused = reuse_prefix(state, longer + [7], model)
    warm = forward(model, state.cache, [7])
    cold = forward(model, make_prompt_cache(model), longer + [7])
    assert reused == 30
    np.testing.assert_allclose(np.array(warm), np.array(cold), atol=1e-4)


def test_named_file_is_strict(tiny_model_dirs, make_tiny_model, tmp_path):
    model, _ = load(str(tiny_model_dirs["llama"]))
    f = tmp_path / "c.safetensors"
    base = tokens_of(20)
    write(model, f, base)
    prompt = base + [7, 8]

    def checkout(path, m=model, settings=SETTINGS, p=prompt, store=None):
        return served(m, p, path, store, settings)

    other, _ = make_tiny_model("llama", seed=1)
    with pytest.raises(ModelMismatchError, match="another|differ"):
        checkout(f, other)
    with pytest.raises(ModelMismatchError, match="another|differ"):  # also when it shares no token
        checkout(f, other, p=tokens_of(8, start=250))
    with pytest.raises(UsageError, match="was made with max_kv_size=None"):
        checkout(f, settings={"max_kv_size": 64, "keep": 4})
    # a file made with a window: the window must agree (keep too), and then it serves
    w = tmp_path / "w.safetensors"
    write(model, w, base, settings={"max_kv_size": 64, "keep": 6}, max_kv_size=64, keep=6)
    with pytest.raises(UsageError, match="keep=6"):
        checkout(w, settings={"max_kv_size": 64, "keep": 4})
    assert checkout(w, settings={"max_kv_size": 64, "keep": 6})[2] == 20
    # strict also when a shared tier serves more
    wide = {"max_kv_size": 64, "keep": 4}
    store = PromptStore([DiskTier(tmp_path / "dir", 1 << 30)])
    put_prompt(store, scope(model, wide), filled_state(model, prompt[:-1], max_kv_size=64, keep=4), no_warning)
    assert served(model, prompt, None, store, wide)[2] == 21
    with pytest.raises(UsageError, match="was made with max_kv_size=None"):
        checkout(f, settings=wide, store=store)
    # damaged, missing, and a file that does not list its tokens: errors, never a silent miss
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(f.read_bytes()[:-100])
    for path in (bad, tmp_path / "missing.safetensors"):
        with pytest.raises(ChatCacheError) as e:
            checkout(path)
        assert "\n" not in str(e.value)
    bare = tmp_path / "bare.safetensors"
    save_prompt_cache(bare, filled_state(model, base).cache, model=model.fingerprint)
    with pytest.raises(CacheFormatError, match="does not say which tokens"):
        checkout(bare)
    with pytest.raises(CacheFormatError, match="does not say which tokens"):
        PromptCache.load(bare, model)


def test_put_writes_the_named_file_first_and_reports_shared_failures(llama_model, tmp_path):
    model, _ = llama_model
    f = tmp_path / "c.safetensors"

    class FullDisk(DiskTier):
        def put(self, values):
            raise ChatCacheError("no space left on device")

    base = tokens_of(16)
    state = filled_state(model, base)
    state.messages = MESSAGES
    store = PromptStore([FullDisk(tmp_path / "dir", 1 << 30)])
    warnings = []
    put_prompt(store, scope(model), state, warnings.append, named=f)
    assert warnings == ["the prompt cache was not stored in the disk tier: no space left on device"]
    assert read_cache_info(f).tokens == base and read_cache_info(f).messages == MESSAGES
    with pytest.raises(ChatCacheError):  # without on_error the shared tier's error is raised
        store.put(scope(model), base, state.cache)
    # the named file's errors are raised, before any shared tier is written
    disk = DiskTier(tmp_path / "dir2", 1 << 30)
    with pytest.raises(CacheFileError) as e:
        put_prompt(PromptStore([disk]), scope(model), state, no_warning, named=tmp_path / "no" / "c.safetensors")
    assert "\n" not in str(e.value)
    assert served(model, base + [7], store=PromptStore([disk]))[1] is None


def test_an_empty_cache_is_written_to_the_named_file_only(llama_model, tmp_path):
    model, _ = llama_model
    f, folder = tmp_path / "c.safetensors", tmp_path / "dir"
    write(model, f, tokens_of(10))
    store = PromptStore([DiskTier(folder, 1 << 30)])
    empty = PromptCache.new(model)
    empty.messages = [{"role": "system", "content": "x"}]
    put_prompt(store, scope(model), empty, no_warning, named=f)
    info = read_cache_info(f)
    assert info.tokens == [] and info.messages == [{"role": "system", "content": "x"}]
    assert not list(folder.glob("*.safetensors"))
    # read again now that it changed: nothing to serve, and it loads as an empty cache
    assert served(model, tokens_of(10), f, store)[1] is None
    back = PromptCache.load(f, model)
    assert back.tokens == [] and back.messages == [{"role": "system", "content": "x"}]
