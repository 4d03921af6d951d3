"""The store's bookkeeping without MLX: the token trie's longest prefix against
a brute-force answer, and the byte budget / LRU / eviction rule of EntryIndex."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_chatcache.files.tokens import common_prefix_len
from mlx_chatcache.store.index import Entry, EntryIndex
from mlx_chatcache.store.trie import TokenTrie


def brute_longest(stored: dict[tuple, bool], query: tuple) -> int:
    best = 0
    for tokens, trimmable in stored.items():
        n = 0
        while n < min(len(tokens), len(query)) and tokens[n] == query[n]:
            n += 1
        if trimmable or n == len(tokens):
            best = max(best, n)
    return best


seqs = st.lists(st.integers(0, 3), min_size=1, max_size=12).map(tuple)
ops = st.lists(st.tuples(st.sampled_from(["add", "remove"]), seqs, st.booleans()), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(st.lists(st.integers(0, 3), max_size=14).map(tuple), min_size=1, max_size=6))
def test_trie_longest_matches_brute_force(operations, queries):
    trie, stored = TokenTrie(), {}
    for op, tokens, trimmable in operations:
        if op == "add":
            trie.add(tokens, tokens, trimmable)
            stored[tokens] = trimmable
        elif tokens in stored:
            assert trie.remove(tokens) == tokens
            del stored[tokens]
        assert len(trie) == len(stored)
    for q in queries:
        found = trie.longest(q)
        want = brute_longest(stored, q)
        if want == 0:
            assert found is None or found[1] == 0
            continue
        value, n = found
        assert n == want
        # the value really serves n tokens of the query
        shared = 0
        while shared < min(len(value), len(q)) and value[shared] == q[shared]:
            shared += 1
        assert shared >= n and (stored[value] or len(value) == n)
    for tokens in stored:  # every stored prefix of a sequence is listed, shortest first
        listed = [n for _, n in trie.prefixes(tokens)]
        assert listed == sorted(len(t) for t in stored if tokens[: len(t)] == t)


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12), st.integers(0, 14))
def test_common_prefix_len_is_the_longest_shared_start(a, b, start):
    n = common_prefix_len(a, b, start)
    rest = b[start:]
    assert a[:n] == rest[:n] and (n == min(len(a), len(rest)) or a[n] != rest[n])
    assert common_prefix_len(tuple(a), b, start) == n == common_prefix_len(rest, a[:n] + [9])


def test_trie_untrimmable_serves_only_its_own_prefix():
    trie = TokenTrie()
    trie.add((1, 2, 3, 4), "ssm", trimmable=False)
    assert trie.longest((1, 2, 3, 9)) is None  # would need trimming back to 3
    assert trie.longest((1, 2, 3, 4, 5)) == ("ssm", 4)
    trie.add((1, 2, 3, 4, 5, 6), "kv", trimmable=True)
    assert trie.longest((1, 2, 3, 4, 5, 7)) == ("kv", 5)
    assert trie.longest((1, 2, 3, 4)) == ("ssm", 4)  # tie: the exact entry
    trie.remove((1, 2, 3, 4, 5, 6))
    assert trie.longest((1, 2, 3, 4, 5, 7)) == ("ssm", 4)


def entry(tokens, nbytes, key=None, trimmable=True, ns="m"):
    return Entry(ns, tuple(tokens), nbytes, trimmable, key)


def add(index, e):
    victims = index.plan(e.nbytes, e.pinned)
    if victims is None:
        return False
    index.add(e, victims)
    return True


def test_lru_within_budget():
    index = EntryIndex(100)
    a, b, c = entry([1], 40), entry([2], 40), entry([3], 40)
    assert add(index, a) and add(index, b)
    index.touch(a)  # b is now the least recently used
    assert add(index, c)
    assert {e.tokens for e in index.entries()} == {(1,), (3,)}
    assert index.nbytes == 80 <= index.budget


def test_entry_larger_than_budget_evicts_nothing():
    index = EntryIndex(100)
    small = [entry([i], 10) for i in range(9)]
    for e in small:
        assert add(index, e)
    assert not add(index, entry([99], 101))
    assert len(index) == 9 and index.nbytes == 90


def test_no_entry_evicts_more_than_its_own_size():
    index = EntryIndex(100)
    big, small1, small2, rest = entry([1], 60), entry([2], 15), entry([3], 15), entry([9], 10)
    for e in (big, small1, small2, rest):
        assert add(index, e)
    # 30 bytes need 30 freed: evicting the (oldest) 60-byte entry would free twice its size,
    # so the two 15-byte ones go instead (and the newer 10-byte one stays)
    assert add(index, entry([4], 30))
    assert {e.tokens for e in index.entries()} == {(1,), (9,), (4,)}
    assert index.nbytes == 100
    # 50 bytes need 50 freed: the 60-byte entry may not go (more than 50), the 40-byte one is not
    # enough: refused, and nothing is evicted
    index2 = EntryIndex(100)
    add(index2, entry([1], 60))
    add(index2, entry([2], 40))
    assert not add(index2, entry([3], 50))
    assert len(index2) == 2 and index2.nbytes == 100


def test_pinned_entries_survive_unpinned_pressure():
    index = EntryIndex(100)
    pinned = entry([1], 50, key="conv-a")
    assert add(index, pinned)
    assert add(index, entry([2], 50))
    assert add(index, entry([3], 50))  # evicts the unpinned [2], not the older pinned [1]
    assert {e.tokens for e in index.entries()} == {(1,), (3,)}
    assert not add(index, entry([4], 60))  # only the 50-byte unpinned entry may go: not enough
    assert add(index, entry([5], 50, key="conv-b"))  # a pinned entry may evict unpinned ones first
    assert {e.tokens for e in index.entries()} == {(1,), (5,)}


def test_keyed_lookup_prefers_the_conversation():
    index = EntryIndex(1000)
    add(index, entry([1, 2, 3, 4], 10))
    mine = entry([1, 2, 3, 5], 10, key="k")
    add(index, mine)
    found, n = index.longest("m", (1, 2, 3, 7), key="k")
    assert found is mine and n == 3
    assert index.longest("other", (1, 2, 3, 7), key="k") is None  # namespaces never mix


def test_superseded_prefixes():
    index = EntryIndex(1000)
    p1, p2 = entry([1, 2], 10), entry([1, 2, 3], 10)
    other = entry([1, 2, 3, 4], 10, key="someone-else")
    for e in (p1, p2, other):
        add(index, e)
    longer = entry([1, 2, 3, 4, 5], 10)
    assert set(map(id, index.superseded(longer))) == {id(p1), id(p2)}
    assert index.superseded(entry([1, 2, 3, 4, 5], 10, trimmable=False)) == []
