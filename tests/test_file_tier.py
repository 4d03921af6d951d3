"""The store's named file tier (store/named_file.py) with real caches: what it serves,
that it is strict (errors instead of misses), what it writes, and how
PromptStore.put treats named and shared tiers."""

from __future__ import annotations

import numpy as np
import pytest

from loop_helpers import forward
from store_helpers import SETTINGS, checked_out, filled_state, scope, tokens_of

from mlx_chatcache.cache import make_prompt_cache
from mlx_chatcache.errors import CacheFormatError, ChatCacheError, ModelMismatchError, UsageError
from mlx_chatcache.files.mlxcc_format import read_cache_info, save_prompt_cache
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.prompt import reuse_prefix
from mlx_chatcache.models.loading import load
from mlx_chatcache.store.named_file import CacheFileTier
from mlx_chatcache.store.store import PromptStore
from mlx_chatcache.store.disk import DiskTier

MESSAGES = [{"role": "user", "content": "hello"}]


def _chat(messages):
    """A prompt cache value saying only that its tokens are ``messages`` (what a named file records)."""
    return PromptCache([], messages=messages)


def write(model, path, tokens, settings=SETTINGS, **kw):
    store = PromptStore([CacheFileTier(None, path)])
    state = filled_state(model, tokens, **kw)
    state.messages, state.settings, state.metadata = MESSAGES, dict(settings), {"note": "kept"}
    store.put(scope(model, settings), tokens, state.cache, prompt=state)


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_named_file_serves_its_prefix_like_a_fresh_prefill(kind, tiny_model_dirs, tmp_path):
    model, _ = load(str(tiny_model_dirs[kind]))
    f = tmp_path / "c.safetensors"
    base = tokens_of(30)
    write(model, f, base)
    info = read_cache_info(f)
    assert info.tokens == base and info.messages == MESSAGES and info.metadata == {"note": "kept"}
    store = PromptStore([CacheFileTier(f)])
    prompt = base + tokens_of(6, start=200)
    got = checked_out(store, scope(model), model, prompt)
    assert got.tier == "file" and got.served == 30 and got.tokens == base
    state = PromptCache(got.cache, got.tokens)
    reused = reuse_prefix(state, prompt, model)
    warm = forward(model, state.cache, prompt[reused:])
    cold = forward(model, make_prompt_cache(model), prompt)
    assert reused == 30
    np.testing.assert_allclose(np.array(warm), np.array(cold), atol=1e-4)
    # a prompt that leaves the file's tokens at 12: a trimmable cache serves 12, an SSM one nothing
    branch = base[:12] + tokens_of(8, start=250)
    got = checked_out(PromptStore([CacheFileTier(f)]), scope(model), model, branch)
    if kind == "llama":
        assert got is not None and got.served == 12
    else:
        assert got is None


def test_named_file_is_strict(tiny_model_dirs, make_tiny_model, tmp_path):
    model, _ = load(str(tiny_model_dirs["llama"]))
    f = tmp_path / "c.safetensors"
    base = tokens_of(20)
    write(model, f, base)
    prompt = base + [7, 8]

    def checkout(path, m=model, settings=SETTINGS):
        return checked_out(PromptStore([CacheFileTier(path)]), scope(m, settings), m, prompt)

    other, _ = make_tiny_model("llama", seed=1)
    with pytest.raises(ModelMismatchError, match="another|differ"):
        checkout(f, other)
    with pytest.raises(UsageError, match="was made with max_kv_size=None"):
        checkout(f, settings={"max_kv_size": 64, "keep": 4})
    # a file made with a window: the window must agree (keep too), and then it serves
    w = tmp_path / "w.safetensors"
    write(model, w, base, settings={"max_kv_size": 64, "keep": 6}, max_kv_size=64, keep=6)
    with pytest.raises(UsageError, match="keep=6"):
        checkout(w, settings={"max_kv_size": 64, "keep": 4})
    assert checkout(w, settings={"max_kv_size": 64, "keep": 6}).served == 20
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


def test_put_writes_the_named_file_first_and_reports_shared_failures(llama_model, tmp_path):
    model, _ = llama_model
    f = tmp_path / "c.safetensors"

    class FullDisk(DiskTier):
        def add(self, scope, tokens, cache, key):
            raise ChatCacheError("no space left on device")

    base = tokens_of(16)
    store = PromptStore([CacheFileTier(None, f), FullDisk(tmp_path / "dir", 1 << 30)])
    failed = []
    stored = store.put(scope(model), base, filled_state(model, base).cache, prompt=_chat(MESSAGES),
                       on_error=lambda tier, e: failed.append((tier.name, str(e))))
    assert stored == {"file": True, "disk": False}
    assert failed == [("disk", "no space left on device")]
    assert read_cache_info(f).tokens == base
    with pytest.raises(ChatCacheError):  # without on_error the shared tier's error is raised
        store.put(scope(model), base, filled_state(model, base).cache, prompt=_chat(MESSAGES))


def test_an_empty_cache_is_written_to_the_named_file_only(llama_model, tmp_path):
    model, _ = llama_model
    f, folder = tmp_path / "c.safetensors", tmp_path / "dir"
    write(model, f, tokens_of(10))
    disk = DiskTier(folder, 1 << 30)
    store = PromptStore([CacheFileTier(f, f), disk])
    store.put(scope(model), [], make_prompt_cache(model), prompt=_chat([{"role": "system", "content": "x"}]))
    info = read_cache_info(f)
    assert info.tokens == [] and info.messages == [{"role": "system", "content": "x"}]
    assert len(disk.index) == 0 and not list(folder.glob("*.safetensors"))
    # the tier reads the file again once it changed: nothing to serve now
    assert checked_out(store, scope(model), model, tokens_of(10)) is None
