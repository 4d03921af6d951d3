"""The hash chain over token-id blocks that the block-sharing tiers address by.

Blocks of ``B`` tokens (uint32 little endian): ``h_0 = sha256("mlxcc-chain" ns)``,
``h_i = sha256(h_{i-1} || block_i)`` (the first 16 bytes), so ``h_i`` names the
first ``i * B`` tokens within namespace ``ns``; two sequences share ``h_i``
exactly when they share those tokens. An entry's id hashes its last full
block's ``h`` with the remaining tokens and the count, so ``entry_id(n)`` is
computable from any longer sequence's chain.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

_HASH_BYTES = 16


class Chain:
    """Block hashes of ``tokens``: ``hashes[i-1]`` is ``h_i`` (hex), for every full block."""

    def __init__(self, namespace: str, tokens: Sequence[int], block: int):
        self.namespace, self.block = namespace, block
        self.tokens = tokens
        self._raw = np.asarray(tokens, dtype="<u4").tobytes()  # 4 bytes per token
        digests = [hashlib.sha256(b"mlxcc-chain\0" + namespace.encode()).digest()[:_HASH_BYTES]]
        step = 4 * block
        for i in range(len(tokens) // block):
            digests.append(hashlib.sha256(digests[-1] + self._raw[i * step : (i + 1) * step]).digest()[:_HASH_BYTES])
        self._digests = digests
        self.hashes = [d.hex() for d in digests[1:]]

    def entry_id(self, n: int) -> str:
        """The id of an entry holding ``tokens[:n]``."""
        full = n // self.block
        tail = self._raw[4 * full * self.block : 4 * n]
        return hashlib.sha256(self._digests[full] + b"\0tail" + tail + n.to_bytes(8, "little")).hexdigest()[:32]


__all__ = ["Chain"]
