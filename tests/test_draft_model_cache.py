"""A draft model's layers live in the same prompt cache as the model's (mlx-lm's layout: the
model's layers, then the draft's), so every place a cache is kept resumes with both, and a cache
kept with a draft model is never used without it (nor the reverse): one line each.

- a saved file (PromptCache.save/load), a chat session, a store entry (memory and disk tiers) and
  a rolling ``mlxcc generate`` cache file (``--prompt-cache-file F --save-prompt-cache F``);
- resumed with both, the next turn continues exactly as a run from scratch does (greedy tokens equal)
  and computes only its new tokens.
"""

from __future__ import annotations

import pytest
from cli_helpers import mlxcc, one_error_line

from mlx_chatcache.chat.session import ChatSession
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.errors import ModelMismatchError
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.checkout import prompt_scope
from mlx_chatcache.generation.text import stream_generate
from mlx_chatcache.models.draft_pair import DraftPair
from mlx_chatcache.models.loading import load
from mlx_chatcache.store.disk import DiskTier
from mlx_chatcache.store.store import PromptStore
from mlx_chatcache.store.tiers import MemoryTier

GREEDY = DEFAULTS.updated(temp=0.0, max_tokens=10)
TEXT = "Tell me about the sea, the wind and the ships that sail between the islands."


@pytest.fixture(scope="module")
def pair(tiny_model_dirs, make_tiny_model_dir):
    target, tok = load(str(tiny_model_dirs["llama"]))
    draft, _ = load(str(make_tiny_model_dir("llama", seed=1)))
    return DraftPair(target, draft), target, tok


def reply(model, tok, prompt, state=None):
    return [r.token for r in stream_generate(model, tok, prompt, state=state, config=GREEDY)]


def test_a_saved_file_resumes_with_both_models_and_is_refused_without_the_draft(pair, tmp_path):
    p, target, tok = pair
    prompt = tok.encode(TEXT)
    state = PromptCache.new(p)
    first = reply(p, tok, prompt, state)
    assert len(state.cache) == p.split * 2 and all(c.offset == len(state.tokens) for c in state.cache)
    state.save(tmp_path / "c.safetensors")
    loaded = PromptCache.load(tmp_path / "c.safetensors", p)
    more = prompt + first + tok.encode(" And then?")
    resumed = list(stream_generate(p, tok, more, state=loaded, config=GREEDY.updated(prompt_lookup="prompt")))
    assert [r.token for r in resumed] == reply(target, tok, more)
    assert resumed[0].reused_tokens == len(prompt) + len(first) - 1
    with pytest.raises(ModelMismatchError) as e:
        PromptCache.load(tmp_path / "c.safetensors", target)
    line = str(e.value)
    assert "--draft-model" in line and "saved with draft model" in line and "\n" not in line
    alone = PromptCache.new(target)
    reply(target, tok, prompt, alone)
    alone.save(tmp_path / "t.safetensors")
    with pytest.raises(ModelMismatchError) as e:
        PromptCache.load(tmp_path / "t.safetensors", p)
    assert "without a draft model" in str(e.value) and "\n" not in str(e.value)


def test_a_chat_session_resumes_with_both_models(pair, tmp_path):
    p, target, tok = pair
    s = ChatSession(p, tok, system_prompt="Be brief.", config=GREEDY)
    s.ask("Hello there!")
    s.save(tmp_path / "s.safetensors")
    resumed = ChatSession.load(tmp_path / "s.safetensors", p, tok)
    second = resumed.ask("What is the sea?")
    fresh = ChatSession(target, tok, system_prompt="Be brief.", config=GREEDY)
    fresh.ask("Hello there!")
    assert second.text == fresh.ask("What is the sea?").text
    assert second.stats.reused_tokens > 0
    with pytest.raises(ModelMismatchError) as e:
        ChatSession.load(tmp_path / "s.safetensors", target, tok)
    assert "--draft-model" in str(e.value)


def test_store_entries_of_a_pair_hold_both_models_and_are_apart_from_the_models(pair, tmp_path):
    p, target, tok = pair
    prompt = tok.encode(TEXT * 3)  # more than one block
    state = PromptCache.new(p)
    reply(p, tok, prompt, state)
    for tiers in ([MemoryTier(10**9)], [DiskTier(tmp_path / "d", None)]):
        store = PromptStore(tiers)
        store.put(prompt_scope(p, GREEDY), state.tokens, state.cache)
        back, tier = store.checkout(prompt_scope(p, GREEDY), p, state.tokens + [5])
        assert tier is not None and back.tokens == state.tokens and len(back.cache) == len(state.cache)
        assert all(c.offset == len(state.tokens) for c in back.cache)
        more = state.tokens + tok.encode(" More.")
        assert reply(p, tok, more, back) == reply(target, tok, more)
        miss, none = store.checkout(prompt_scope(target, GREEDY), target, state.tokens + [5])
        assert none is None and miss.tokens == []


def test_a_rolling_cache_file_resumes_with_both_models(tiny_model_dirs, make_tiny_model_dir, tmp_path):
    model, draft, f = tiny_model_dirs["llama"], make_tiny_model_dir("llama", seed=1), tmp_path / "roll.safetensors"
    base = ["generate", "--model", model, "-m", "6", "--temp", "0", "--prompt-cache-file", f, "--save-prompt-cache", f]
    first = mlxcc(*base[:-4], "--draft-model", draft, "-p", "Hello there", "--save-prompt-cache", f)
    assert first.returncode == 0, first.stderr
    second = mlxcc(*base, "--draft-model", draft, "-p", "And then?", "--verbose")
    assert second.returncode == 0, second.stderr
    assert "reused" in second.stderr and "Drafts:" in second.stderr
    refused = mlxcc(*base, "-p", "And then?")
    assert refused.returncode == 1 and "--draft-model" in one_error_line(refused)
    plain = mlxcc("generate", "--model", model, "-m", "6", "--temp", "0", "-p", "Hello there")
    assert first.stdout == plain.stdout


def test_cli_refuses_drafts_for_a_model_that_cannot_take_them_back(tiny_model_dirs):
    p = mlxcc("generate", "--model", tiny_model_dirs["ssm"], "-p", "Hi", "-m", "2", "--prompt-lookup")
    assert p.returncode == 1 and "ArraysCache" in one_error_line(p)
    p = mlxcc("generate", "--model", tiny_model_dirs["llama"], "-p", "Hi", "-m", "2", "--store-drafts")
    assert p.returncode == 1 and "--cache-dir" in one_error_line(p)


def test_mlxcc_chat_resumes_a_session_with_its_draft_model(tiny_model_dirs, make_tiny_model_dir, tmp_path):
    model, draft, s = tiny_model_dirs["llama"], make_tiny_model_dir("llama", seed=1), tmp_path / "s.safetensors"
    first = mlxcc("chat", "--model", model, "--draft-model", draft, "--session-file", s, "--temp", "0", "-m", "6",
                  "--verbose", stdin="Hello there!\n")  # fmt: skip
    assert first.returncode == 0, first.stderr
    again = mlxcc("chat", "--session-file", s, "-m", "6", "--verbose", stdin="And then?\n")  # model and draft recorded
    assert again.returncode == 0 and "resumed session" in again.stderr and "0 tokens recomputed" in again.stderr, again.stderr
    refused = mlxcc("chat", "--model", model, "--session-file", s, stdin="More?\n")
    assert refused.returncode == 1 and "--draft-model" in one_error_line(refused)
