"""A radix trie over token-id sequences: which stored entry shares the longest
prefix with a query.

Contract
--------
:class:`TokenTrie` maps token sequences to values (at most one value per
sequence; adding the same sequence again replaces the value). Each value is
*trimmable* or not:

- a trimmable value holding ``t`` can serve any prefix of ``t`` (a K/V cache
  is trimmed back to the shared part);
- an untrimmable value (SSM/conv states, a rotating window that dropped
  tokens) can serve only a query that ``t`` itself is a prefix of.

:meth:`TokenTrie.longest` returns ``(value, length)``: the value that serves
the longest prefix of the query under these rules (``length`` tokens), or None
when nothing shares a token. Ties prefer an exact (untrimmed) value. Edges hold
token runs, so memory grows with the number of distinct branches, not with
tokens times entries. Token runs are compared with
:func:`mlx_chatcache.files.tokens.common_prefix_len`.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from ..files.tokens import common_prefix_len

_NO_VALUE = object()


class _Node:
    __slots__ = ("edge", "parent", "children", "value", "trimmable", "n_trim")

    def __init__(self, edge: tuple[int, ...], parent: "_Node | None"):
        self.edge = edge  # tokens from the parent to this node
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first token of the child's edge -> child
        self.value: Any = _NO_VALUE
        self.trimmable = False
        self.n_trim = 0  # trimmable values in this subtree (this node included)


class TokenTrie:
    def __init__(self):
        self._root = _Node((), None)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    # ------------------------------------------------------------------ update
    def add(self, tokens: Sequence[int], value: Any, trimmable: bool) -> None:
        """Store ``value`` for ``tokens`` (replacing a value stored for them)."""
        node = self._descend_creating(tuple(tokens))
        if node.value is not _NO_VALUE:
            self._set_trim(node, False)
            self._len -= 1
        node.value = value
        self._set_trim(node, trimmable)
        self._len += 1

    def remove(self, tokens: Sequence[int]) -> Any:
        """Remove and return the value stored for ``tokens`` (KeyError if none)."""
        node = self._find(tuple(tokens))
        if node is None or node.value is _NO_VALUE:
            raise KeyError("no value stored for these tokens")
        value = node.value
        self._set_trim(node, False)
        node.value = _NO_VALUE
        self._len -= 1
        self._prune(node)
        return value

    def get(self, tokens: Sequence[int], default: Any = None) -> Any:
        node = self._find(tuple(tokens))
        return default if node is None or node.value is _NO_VALUE else node.value

    # ------------------------------------------------------------------ queries
    def longest(self, query: Sequence[int]) -> tuple[Any, int] | None:
        """The value serving the longest prefix of ``query`` and that length."""
        best_exact: tuple[_Node, int] | None = None
        best_trim: tuple[_Node, int] | None = None  # subtree with a trimmable value, depth
        node, depth = self._root, 0
        while True:
            if node.value is not _NO_VALUE and depth > 0:
                best_exact = (node, depth)
            if depth == len(query):
                break
            child = node.children.get(query[depth])
            if child is None:
                break
            k = common_prefix_len(child.edge, query, depth)
            if child.n_trim:
                best_trim = (child, depth + k)
            if k < len(child.edge):
                break
            node, depth = child, depth + k
        exact_len = best_exact[1] if best_exact else 0
        if best_trim and best_trim[1] > exact_len:
            return self._any_trimmable(best_trim[0]).value, best_trim[1]
        return (best_exact[0].value, exact_len) if best_exact else None

    def prefixes(self, tokens: Sequence[int]) -> Iterator[tuple[Any, int]]:
        """``(value, length)`` for every stored sequence that is a prefix of
        ``tokens`` (``tokens`` itself included), shortest first."""
        node, depth = self._root, 0
        while True:
            if node.value is not _NO_VALUE and depth > 0:
                yield node.value, depth
            if depth == len(tokens):
                return
            child = node.children.get(tokens[depth])
            if child is None or common_prefix_len(child.edge, tokens, depth) < len(child.edge):
                return
            node, depth = child, depth + len(child.edge)

    # ------------------------------------------------------------------ internals
    def _find(self, tokens: tuple[int, ...]) -> _Node | None:
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or tokens[depth : depth + len(child.edge)] != child.edge:
                return None
            node, depth = child, depth + len(child.edge)
        return node

    def _descend_creating(self, tokens: tuple[int, ...]) -> _Node:
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                new = _Node(tokens[depth:], node)
                node.children[tokens[depth]] = new
                return new
            k = common_prefix_len(child.edge, tokens, depth)
            if k < len(child.edge):
                child = self._split(child, k)
            node, depth = child, depth + k
        return node

    @staticmethod
    def _split(child: _Node, k: int) -> _Node:
        """Put a node ``k`` tokens into ``child``'s edge; return it."""
        parent = child.parent
        mid = _Node(child.edge[:k], parent)
        parent.children[child.edge[0]] = mid
        child.edge = child.edge[k:]
        child.parent = mid
        mid.children[child.edge[0]] = child
        mid.n_trim = child.n_trim
        return mid

    @staticmethod
    def _set_trim(node: _Node, trimmable: bool) -> None:
        delta = int(trimmable) - int(node.trimmable)
        node.trimmable = trimmable
        while delta and node is not None:
            node.n_trim += delta
            node = node.parent

    def _prune(self, node: _Node) -> None:
        """Drop valueless leaves and merge valueless single-child nodes upward."""
        while node is not self._root and node.value is _NO_VALUE:
            parent = node.parent
            if not node.children:
                del parent.children[node.edge[0]]
            elif len(node.children) == 1:
                (only,) = node.children.values()
                only.edge = node.edge + only.edge
                only.parent = parent
                parent.children[node.edge[0]] = only
            else:
                return
            node = parent

    @staticmethod
    def _any_trimmable(node: _Node) -> _Node:
        while not (node.trimmable and node.value is not _NO_VALUE):
            node = next(c for c in node.children.values() if c.n_trim)
        return node
