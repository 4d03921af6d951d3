"""The keys of the store: a hash chain over blocks of token ids.

Blocks of ``B`` tokens (uint32 little endian): ``h_0 = sha256("mlxcc-chain" ns B)``,
``h_i = sha256(h_{i-1} || block_i)`` (the first 16 bytes), so ``h_i`` names the
first ``i * B`` tokens within namespace ``ns``; two sequences share ``h_i``
exactly when they share those tokens. A *block* value is keyed ``"b" + h_i``;
an *entry* value holding ``n`` tokens is keyed ``"e" + sha256(h_k || the
tokens after block k || n)`` with ``k = n // B``, so the key of every prefix of a
sequence is computable from that sequence alone.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

_HASH_BYTES = 16


class Chain:
    """The keys of ``tokens``' prefixes in namespace ``namespace``, for blocks of ``block`` tokens."""

    def __init__(self, namespace: str, tokens: Sequence[int], block: int):
        self.block = block
        self._raw = np.asarray(tokens, dtype="<u4").tobytes()  # 4 bytes per token
        digests = [hashlib.sha256(f"mlxcc-chain\0{namespace}\0{block}".encode()).digest()[:_HASH_BYTES]]
        step = 4 * block
        for i in range(len(tokens) // block):
            digests.append(hashlib.sha256(digests[-1] + self._raw[i * step : (i + 1) * step]).digest()[:_HASH_BYTES])
        self._digests = digests

    @property
    def blocks(self) -> list[str]:
        """The key of every full block, in order."""
        return ["b" + d.hex() for d in self._digests[1:]]

    def entry(self, n: int) -> str:
        """The key of an entry holding the first ``n`` tokens."""
        full = n // self.block
        tail = self._raw[4 * full * self.block : 4 * n]
        return "e" + hashlib.sha256(self._digests[full] + tail + n.to_bytes(8, "little")).hexdigest()[:32]


def is_key(name: str) -> bool:
    """Whether ``name`` is a key :class:`Chain` makes."""
    return len(name) == 33 and name[0] in "be" and all(c in "0123456789abcdef" for c in name[1:])


__all__ = ["Chain", "is_key"]
