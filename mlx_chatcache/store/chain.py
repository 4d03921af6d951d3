"""The keys of the store: a hash chain over blocks of token ids.

Blocks of ``B`` tokens (uint32 little endian): ``h_0 = sha256("mlxcc-chain" ns B)``,
``h_i = sha256(h_{i-1} || block_i)`` (the first 16 bytes), so ``h_i`` names the
first ``i * B`` tokens within namespace ``ns``; two sequences share ``h_i``
exactly when they share those tokens. A *block* value is keyed ``"b" + h_i``;
an *entry* value holding ``n`` tokens is keyed ``"e" + sha256(h_k || the
tokens after block k || n)`` with ``k = n // B``, so the key of every prefix of a
sequence is computable from that sequence alone. A *record* value (a document, such
as a stored response, :mod:`.records`) is keyed ``"r" + its id`` (32 hex digits).
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


def record_key(ident: str) -> str:
    """The key of the record whose id is ``ident`` (32 lowercase hex digits; ValueError else)."""
    key = "r" + ident
    if not is_key(key):
        raise ValueError(f"a record id is 32 lowercase hex digits, got {ident[:40]!r}")
    return key


def is_key(name: str) -> bool:
    """Whether ``name`` is a store key: a block's or an entry's (:class:`Chain`) or a record's."""
    return len(name) == 33 and name[0] in "ber" and all(c in "0123456789abcdef" for c in name[1:])


def kinds(keys) -> dict[str, int]:
    """How many of ``keys`` are ``entries``, ``blocks`` and ``records`` (the tiers' stats)."""
    counts = {"entries": 0, "blocks": 0, "records": 0}
    for k in list(keys):
        counts[_KINDS[k[0]]] += 1
    return counts


_KINDS = {"e": "entries", "b": "blocks", "r": "records"}

__all__ = ["Chain", "is_key", "kinds", "record_key"]
