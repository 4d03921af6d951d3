"""Store drafts: the n-gram index over the tokens the store holds for a scope
(store/draft_index.py) and how the store keeps it (store/store.py).

Invariants: its memory is fixed when it is made, whatever it is fed; it forgets the oldest tokens
first; a lookup returns only tokens that followed the looked-up n-gram in what it holds (never a
hash collision's); a conversation put again after each turn adds only its new tokens; every put,
every value a checkout reads from the disk tier and, when the index is made, the disk tier's
newest values of the scope feed it, and nothing of another scope; a reply drafted from it is the
plain reply.
"""

from __future__ import annotations

import numpy as np

from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.checkout import prompt_scope
from mlx_chatcache.generation.text import stream_generate
from mlx_chatcache.store.chain import Chain
from mlx_chatcache.store.disk import DiskTier
from mlx_chatcache.store.draft_index import DraftIndex
from mlx_chatcache.store.store import PromptStore
from mlx_chatcache.store.tiers import MemoryTier

GREEDY = DEFAULTS.updated(temp=0.0, max_tokens=16)
TEXT = "Tell me about the sea, the wind and the ships that sail between the islands at night."
LONG = (TEXT + " Then say how the lighthouse keeper, an old man with a grey beard, counted the boats coming home"
        " before the storm, and what he wrote in his logbook when the last one was late.")


def occurs_after(held: list[list[int]], gram: list[int], follow: list[int]) -> bool:
    """Whether ``follow`` came right after ``gram`` in one of the ``held`` sequences."""
    n, k = len(gram), len(follow)
    return any(s[i : i + n] == gram and s[i + n : i + n + k] == follow for s in held for i in range(len(s) - n))


def test_its_memory_is_fixed_and_it_forgets_the_oldest_tokens_first():
    index = DraftIndex(2000)
    size = index.nbytes
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50_000, 300).tolist() for _ in range(40)]  # 6x its capacity
    for s in seqs:
        index.add(s)
        assert index.nbytes == size and index.stats()["tokens"] <= 2000
    assert index.lookup(seqs[-1][100:103], 5) == seqs[-1][103:108]
    assert index.lookup(seqs[0][100:103], 5) == []  # long gone


def test_a_lookup_returns_only_what_followed_the_ngram():
    """A small vocabulary and a small table: many n-grams share a slot, none is mistaken for another."""
    rng = np.random.default_rng(1)
    index = DraftIndex(3000)
    held = [rng.integers(0, 6, int(rng.integers(5, 80))).tolist() for _ in range(60)]
    for s in held:
        index.add(s)
    hits = 0
    for _ in range(500):
        gram = rng.integers(0, 6, int(rng.integers(2, 5))).tolist()
        follow = index.lookup(gram, 6)
        if follow:
            hits += 1
            assert any(occurs_after(held, gram[-n:], follow) for n in index.sizes if n <= len(gram))
    assert hits > 100


def test_a_conversation_put_again_adds_only_its_new_tokens(llama_model):
    model, tok = llama_model
    store = PromptStore([MemoryTier(1 << 30)], draft_tokens=10_000)
    scope = prompt_scope(model, GREEDY)
    index = store.draft_index(scope)
    first = tok.encode(TEXT * 4)
    state = PromptCache.new(model)
    list(stream_generate(model, tok, first, state=state, config=GREEDY))
    store.put(scope, state.tokens, state.cache)
    added = index.counters["added"]
    assert added == len(state.tokens)
    more = state.tokens + tok.encode(" And the harbour?")
    list(stream_generate(model, tok, more, state=state, config=GREEDY))
    store.put(scope, state.tokens, state.cache)
    b = store.block_tokens
    new = len(state.tokens) - len(first) // b * b  # from its first block the index had not seen
    assert index.counters["added"] - added <= new + max(index.sizes)


def test_puts_checkouts_and_the_disk_tier_feed_it_and_a_drafted_reply_is_the_plain_one(llama_model, tmp_path):
    model, tok = llama_model
    scope, other = prompt_scope(model, GREEDY), prompt_scope(model, GREEDY.updated(max_kv_size=512, keep=4))
    prompt = tok.encode(LONG)
    assert len(prompt) > 64 and len(set(zip(prompt, prompt[1:], prompt[2:]))) == len(prompt) - 2  # no 3-gram twice
    state = PromptCache.new(model)
    reply = [r.token for r in stream_generate(model, tok, prompt, state=state, config=GREEDY)]
    writer = PromptStore([DiskTier(tmp_path, None)], draft_tokens=10_000)
    writer.put(scope, state.tokens, state.cache)  # (no index made: nothing asked for one)
    # another process: its index is warmed from the disk tier's values of this scope, and of no other
    reader = PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, None)], draft_tokens=10_000)
    assert reader.draft_index(other).stats()["added"] == 0
    index = reader.draft_index(scope)
    assert index.stats()["added"] >= len(state.tokens) - 64
    gram = prompt[-3:]
    assert index.lookup(gram, 4) == reply[:4]
    # a checkout that reads the disk tier feeds a fresh index too
    fresh = PromptStore([MemoryTier(1 << 30), DiskTier(tmp_path, None)], draft_tokens=10_000)
    fresh._indexes[scope.namespace] = DraftIndex(10_000)
    _, tier = fresh.checkout(scope, model, state.tokens + [7])
    assert tier == "disk" and fresh._indexes[scope.namespace].lookup(gram, 4) == reply[:4]
    # the same prompt in a conversation that does not reuse the cache: drafted from the store, the plain reply
    stats = {}
    drafted = [r for r in stream_generate(model, tok, prompt, config=GREEDY.updated(prompt_lookup="store"),
                                          draft_index=index, draft_stats=stats)]  # fmt: skip
    assert [r.token for r in drafted] == reply
    assert stats["accepted"] >= len(reply) // 2 and sum(r.from_draft for r in drafted) == stats["accepted"]


def test_block_keys_are_the_stores():
    """The keys the index skips by are the store's chain keys of the sequence's full blocks."""
    tokens = list(range(200))
    chain = Chain("ns", tokens, 64)
    index = DraftIndex(1000)
    assert index.add(tokens, chain.blocks[:3]) == 200
    assert index.add(tokens + [7, 8, 9], chain.blocks[:3]) == 203 - 3 * 64 + max(index.sizes)


def test_indexes_are_kept_for_a_bounded_number_of_scopes_the_least_recently_used_dropped():
    """Memory is bounded across scopes (tenants, cache shapes) too: at most ``draft_scopes``
    indexes of ``draft_tokens`` each; a scope used again is kept, the least recently used
    goes (and is made anew, empty, when it comes back)."""
    from mlx_chatcache.store.store import make_scope
    from mlx_chatcache.models.fingerprint import ModelFingerprint

    fp = ModelFingerprint("stub", "1" * 16, "2" * 16)
    scopes = [make_scope(fp, {"tenant": str(i)}) for i in range(4)]
    store = PromptStore([MemoryTier(1 << 20)], draft_tokens=1000, draft_scopes=2)
    a, b = store.draft_index(scopes[0]), store.draft_index(scopes[1])
    a.add(list(range(50)))
    assert store.draft_index(scopes[0]) is a  # used again: now the most recent
    store.draft_index(scopes[2])  # a third scope: b, the least recently used, goes
    assert len(store._indexes) == 2 and sum(i.nbytes for i in store._indexes.values()) == 2 * a.nbytes
    assert store.draft_index(scopes[0]) is a and a.lookup([3, 4], 3) == [5, 6, 7]
    again = store.draft_index(scopes[1])
    assert again is not b and again.stats()["added"] == 0
