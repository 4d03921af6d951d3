"""Runs of token ids, as caches hold them: how much of a prompt a cache already has.

:func:`common_prefix_len` is the one common-prefix length of the package (what a named file
serves, prefix reuse, chat, ``mlxcc cache diff``). Standard library only,
so code that reads only file headers can use it without loading MLX.
"""

from __future__ import annotations

from typing import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int], start_b: int = 0) -> int:
    """How many leading tokens ``a`` and ``b[start_b:]`` share: how much of a
    prompt ``b`` a cache holding ``a`` already has."""
    n, limit = 0, min(len(a), len(b) - start_b)
    while n < limit and a[n] == b[start_b + n]:
        n += 1
    return n


__all__ = ["common_prefix_len"]
