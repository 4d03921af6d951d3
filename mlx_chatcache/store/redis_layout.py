"""Key layout, hash chain and manifest of the Redis tier (no network here).

Keys (``P`` = key prefix, ``ns`` = the scope's namespace: model fingerprint +
cache settings, so entries of another model or cache shape are never found):

- ``P:b:{ns}:{h_i}`` -> ``"{n}:{eid}"``: block index of trimmable entries. The
  entry last published whose tokens start with the ``i`` blocks whose chain
  hash is ``h_i``; it holds ``n`` tokens and has entry id ``eid``.
- ``P:x:{ns}:{h_i}`` -> ``"{n}:{eid}"``: the same for untrimmable entries, only
  at their last full block (they serve nothing shorter than themselves).
- ``P:m:{ns}:{eid}`` -> manifest (JSON, :class:`Manifest`): which version's
  chunks make the value, their sizes and checksums, the token ids.
- ``P:c:{ns}:{eid}:{version}:{j}`` -> chunk ``j`` of the value: one cache file
  in our format (``mlxcc_format.prompt_cache_bytes``) for an entry stored
  whole; for an entry stored in blocks, its tail (:mod:`.redis_blocks`).
- ``P:k:{ns}:{h_i}`` -> block value (:mod:`.redis_blocks`): the K/V of the
  ``i``-th block of tokens whose chain hash is ``h_i``, one value however many
  entries (of any replica) hold it; ``P:r:{ns}:{h_i}`` (hash) -> ``crc``: the
  value's crc32 (set with it in one transaction) and ``n``: how many manifests
  list it (changed in the transaction that publishes or deletes a manifest; the
  value is deleted when it reaches 0). Both expire with the last entry using them;
  a reconcile pass recounts ``n`` when Redis dropped a manifest by itself.
- ``P:lru`` (sorted set) ``"{ns}:{eid}"`` -> last use (unix time), and
  ``P:meta`` (hash) ``"{ns}:{eid}"`` -> ``"{own}:{pinned}:{whole}"``: the bytes
  the entry holds alone (a whole value, or a tail), whether it is pinned and
  its size with its blocks; ``P:kbytes`` -> the bytes of all block values,
  each counted once. The byte budget counts the owns plus ``P:kbytes``.
- ``P:reconcile`` -> set (expiring) by the replica running a reconcile pass
  (:mod:`.redis_reconcile`), so replicas take turns.

Hash chain over token-id blocks of ``B`` tokens (uint32 little endian):
``h_0 = sha256("mlxcc-chain" ns)``, ``h_i = sha256(h_{i-1} || block_i)``; an
entry's id hashes its last full block's ``h`` with the remaining tokens and the
count, so ``eid(tokens[:n])`` is computable from any longer sequence's chain:
a lookup checks "is this entry a prefix of my query?" without reading it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..files.checksum import crc32
from .chain import Chain
from .redis_blocks import Layout

MANIFEST_FORMAT = 1
GRACE = 60  # seconds a replaced or deleted version's chunks stay readable for readers in flight


@dataclass(frozen=True)
class Keys:
    prefix: str

    def block(self, ns: str, h: str) -> str:
        return f"{self.prefix}:b:{ns}:{h}"

    def end(self, ns: str, h: str) -> str:
        return f"{self.prefix}:x:{ns}:{h}"

    def manifest(self, ns: str, eid: str) -> str:
        return f"{self.prefix}:m:{ns}:{eid}"

    def chunk(self, ns: str, eid: str, version: str, j: int) -> str:
        return f"{self.prefix}:c:{ns}:{eid}:{version}:{j}"

    def chunks(self, m: "Manifest") -> list[str]:
        return [self.chunk(m.namespace, m.eid, m.version, j) for j in range(len(m.chunk_sizes))]

    def value(self, ns: str, h: str) -> str:
        return f"{self.prefix}:k:{ns}:{h}"

    def refs(self, ns: str, h: str) -> str:
        return f"{self.prefix}:r:{ns}:{h}"

    def pattern(self, kind: str) -> str:
        """SCAN pattern matching every key of ``kind`` (``"m"``, ``"k"``, ``"r"``, ...)."""
        return "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + f":{kind}:*"

    def split(self, kind: str, key) -> tuple[str, str] | None:
        """``(namespace, last part)`` of a key of ``kind``, None for another key."""
        head = f"{self.prefix}:{kind}:"
        key = key.decode(errors="replace") if isinstance(key, bytes) else key
        return split_member(key[len(head) :]) if key.startswith(head) else None

    def chunk_owner(self, key) -> tuple[str, str, str] | None:
        """``(namespace, eid, version)`` of a chunk key, None for another key."""
        parts = self.split("c", key)
        head = parts[0].rsplit(":", 2) if parts else ()
        return (head[0], head[1], head[2]) if len(head) == 3 else None

    @property
    def reconcile(self) -> str:
        return f"{self.prefix}:reconcile"

    @property
    def block_bytes(self) -> str:
        return f"{self.prefix}:kbytes"

    @property
    def lru(self) -> str:
        return f"{self.prefix}:lru"

    @property
    def meta(self) -> str:
        return f"{self.prefix}:meta"


def member(ns: str, eid: str) -> str:
    """An entry's name in the LRU set and the size hash."""
    return f"{ns}:{eid}"


def index_value(n: int, eid: str) -> str:
    return f"{n}:{eid}"


def parse_index_value(raw) -> tuple[int, str] | None:
    """``(n, eid)`` of a block index value, None if absent or malformed."""
    try:
        n, eid = (raw.decode() if isinstance(raw, bytes) else raw).split(":")
        return (int(n), eid) if len(eid) == 32 and int(n) > 0 else None
    except (AttributeError, ValueError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class Manifest:
    """What makes one entry's value: ``version`` names its chunks (unique per
    write, so two writers of one entry never mix chunks)."""

    namespace: str
    eid: str
    version: str
    chunk_sizes: tuple[int, ...]
    checksums: tuple[int, ...]  # crc32 of each chunk
    tokens: tuple[int, ...]
    trimmable: bool
    key: str | None
    blocks: tuple[str, ...] = ()  # chain hashes of its block values (empty: stored whole)
    layout: Layout | None = None  # how its blocks and tail make the cache (None: stored whole)

    @property
    def nbytes(self) -> int:
        """Bytes this entry holds alone (its value, or its tail)."""
        return sum(self.chunk_sizes)

    def whole_bytes(self, block: int) -> int:
        """Its size with its blocks of ``block`` tokens."""
        return self.nbytes + (len(self.blocks) * self.layout.payload_bytes(block) if self.layout else 0)

    def encode(self) -> bytes:
        return json.dumps({
            "format": MANIFEST_FORMAT, "namespace": self.namespace, "eid": self.eid, "version": self.version,
            "chunk_sizes": list(self.chunk_sizes), "checksums": list(self.checksums),
            "tokens": list(self.tokens), "trimmable": self.trimmable, "key": self.key,
            **({"blocks": list(self.blocks), "layout": self.layout.to_json()} if self.layout else {}),
        }).encode()  # fmt: skip

    @classmethod
    def for_value(cls, namespace, eid, version, data: bytes, chunk_bytes: int, tokens, trimmable, key,
                  blocks: tuple[str, ...] = (), layout: Layout | None = None):  # fmt: skip
        """The manifest of ``data`` (a whole value, or the tail of ``blocks``) cut
        into chunks of ``chunk_bytes``; also returns the chunks."""
        chunks = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
        m = cls(namespace, eid, version, tuple(len(c) for c in chunks), tuple(crc32(c) for c in chunks),
                tuple(int(t) for t in tokens), bool(trimmable), key, tuple(blocks), layout)  # fmt: skip
        return m, chunks


def decode_manifest(raw, namespace: str, eid: str) -> Manifest | None:
    """The manifest stored under ``(namespace, eid)``, or None when it is
    malformed or names another entry (a foreign or damaged value)."""
    try:
        d = json.loads(raw)
        m = Manifest(
            d["namespace"], d["eid"], d["version"], tuple(d["chunk_sizes"]), tuple(d["checksums"]),
            tuple(d["tokens"]), d["trimmable"], d["key"], tuple(d.get("blocks", ())),
            Layout.from_json(d["layout"]) if "layout" in d else None,
        )  # fmt: skip
    except (TypeError, ValueError, KeyError, RecursionError, UnicodeDecodeError):
        return None
    if ("layout" in d) != (m.layout is not None) or (m.layout is not None) != bool(m.blocks):
        return None  # a damaged layout, or blocks without one
    ints = [*m.chunk_sizes, *m.checksums, *m.tokens]
    ok = (
        d.get("format") == MANIFEST_FORMAT and (m.namespace, m.eid) == (namespace, eid)
        and isinstance(m.version, str) and m.version.isalnum() and len(m.chunk_sizes) == len(m.checksums) > 0
        and all(type(v) is int and v >= 0 for v in ints) and type(m.trimmable) is bool
        and (m.key is None or isinstance(m.key, str)) and m.tokens
        and all(isinstance(h, str) and len(h) == 32 and h.isalnum() for h in m.blocks)
    )  # fmt: skip
    return m if ok else None


def split_member(name) -> tuple[str, str] | None:
    try:
        ns, eid = (name.decode() if isinstance(name, bytes) else name).rsplit(":", 1)
        return ns, eid
    except (ValueError, UnicodeDecodeError):
        return None


__all__ = ["Chain", "Keys", "Manifest", "decode_manifest", "member", "index_value", "parse_index_value"]
