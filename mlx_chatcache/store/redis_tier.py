"""A store tier in Redis (or Valkey), shared by several ``mlxcc serve`` replicas.

``RedisTier(url, budget)`` implements the :class:`~.tiers.Tier` contract over
values in Redis (key layout: :mod:`.redis_layout`):

- ``find`` hashes the query's token blocks (a hash chain, so every prefix has
  its own key), reads the block index keys in one MGET and picks the entry
  serving the longest prefix, then reads its manifest (one GET). Prefixes are
  found at multiples of ``block`` tokens and up to where the entry and the
  query diverge inside the next block; sequences shorter than one block are
  never stored.
- ``fetch`` reads the manifest's chunks (and blocks) and uses the value only when every
  check passes: chunk count, sizes and crc32 checksums, the safetensors header
  (validated by the same parser as files), the model fingerprint, the scope's
  namespace, the token ids (manifest == header == index entry) and the layer
  kinds. A value failing any of them is counted in ``corrupt``, skipped and
  deleted from Redis (if still that version); one whose chunks vanished
  (replaced, evicted) counts in ``missing``. The caller then gets a shorter hit
  or none.
- ``add`` serializes the cache (on the calling thread: MLX work stays on the
  generation worker): a cache of plain KV layers as block values of ``block``
  tokens, addressed by chain hash and shared by every entry (of any replica)
  starting with those tokens, plus its tail (:mod:`.redis_blocks`); any other
  cache (rotating windows, SSM state, ...) whole, in our file format
  (``prompt_cache_bytes``). It queues the value for the background writer
  (:mod:`.redis_writer`), which keeps the byte budget (each block counted
  once) and the TTL and publishes versioned manifests. It returns at once:
  True when queued, False when the queue is full (``dropped``), the entry is
  too short, or Redis is down.
- A block entry's ``fetch`` also checks every block value's checksum and
  size: a damaged one counts in ``corrupt`` and is deleted with the entry
  (other entries listing it then miss); a block gone counts in ``missing``, the
  entry is deleted and a reconcile pass is called for (as when a lookup finds
  a manifest gone: :mod:`.redis_reconcile`; ``reconciles``, ``reclaimed`` and
  ``reclaimed_chunks`` count passes, the block values and the chunks of gone
  manifests they freed). The cache is assembled from
  the block values and the tail's chunks as received: each byte copied once,
  into the cache's own buffers.

When Redis is down, slow or restarting (:mod:`.redis_link`), every call
returns "no hit"/"not stored" at once without touching the network until the
backoff delay passes: requests are served from the other tiers, only slower.
Entries of the same tokens are shared by every replica with the same model and
cache settings; conversation keys (``key``) pin entries under the budget but do
not change which entry a lookup finds. Replicas must trust the Redis server:
a value is verified for integrity and fit, not for who wrote it.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from typing import Sequence

from ..cache import can_trim_prompt_cache
from ..files.checksum import crc32
from ..files.mlxcc_format import check_cache_fits_model, load_prompt_cache_bytes, prompt_cache_bytes
from ..config import SERVER_DEFAULTS
from ..errors import ChatCacheError
from .index import Entry
from .redis_blocks import assemble, block_ok, split, splittable
from .redis_layout import Chain, Keys, Manifest, decode_manifest, parse_index_value
from .redis_link import RedisLink, Unavailable, connect
from .redis_writer import RedisWriter
from .tiers import Tier

_CANDIDATES = 3  # manifests read at most per lookup
_RECENT = 1024  # entries this process knows are in Redis (not serialized again)
_FETCH_GROUP = 4  # one MGET reads at most this many chunks' worth of bytes


class RedisTier(Tier):
    name = "redis"

    def __init__(self, url: str, budget: int | None = None, *, ttl: int | None = None,
                 chunk_bytes: int | None = None, block: int | None = None, prefix: str | None = None,
                 queue_size: int | None = None, socket_timeout: float | None = None,
                 backoff: tuple[float, float] | None = None, share_blocks: bool | None = None,
                 reconcile_seconds: float | None = None, client=None):  # fmt: skip
        d = SERVER_DEFAULTS
        super().__init__(d.redis_cache_bytes if budget is None else budget)
        self.counters.update({"missing": 0, "dropped": 0, "write_errors": 0, "lookup_errors": 0,
                              "reconciles": 0, "reclaimed": 0, "reclaimed_chunks": 0})
        self.url = url
        self.ttl = int(ttl or d.redis_ttl_seconds)
        self.chunk_bytes = int(chunk_bytes or d.redis_chunk_bytes)
        self.block = int(block or d.store_block_tokens)
        self.keys = Keys(prefix or d.redis_key_prefix)
        self.share_blocks = d.redis_share_blocks if share_blocks is None else share_blocks
        if client is None:
            timeout = d.redis_socket_timeout if socket_timeout is None else socket_timeout
            client = connect(url, timeout, min(timeout, d.redis_connect_timeout))
        self.link = RedisLink(client, url, backoff or d.redis_backoff_seconds)
        self._bad: set[tuple[str, str]] = set()  # (eid, version) found unusable here
        self._recent: OrderedDict[str, None] = OrderedDict()  # eids known to be stored
        self._recent_lock = threading.Lock()  # the writer forgets eids it finds gone
        queue_size = d.redis_write_queue if queue_size is None else queue_size
        every = d.redis_reconcile_seconds if reconcile_seconds is None else reconcile_seconds
        self.writer = RedisWriter(self.link, self.keys, self.index.budget, self.ttl, self.block, queue_size,
                                  self._count, every)  # fmt: skip

    def _count(self, name: str, n: int) -> None:
        self.counters[name] += n  # the writer thread and the worker touch distinct counters

    # ------------------------------------------------------------------ lookup
    def find(self, scope, query, key):
        if len(query) < self.block or not self.link.available():
            return None
        ns, chain = scope.namespace, Chain(scope.namespace, query, self.block)
        keys = [self.keys.block(ns, h) for h in chain.hashes] + [self.keys.end(ns, h) for h in chain.hashes]
        try:
            raw = self.link.run(lambda r: r.mget(keys))
            for n, eid in self._candidates(chain, query, raw):
                got = self._entry(scope, eid, query)
                if got is not None:
                    return got
        except Unavailable:
            self.counters["lookup_errors"] += 1
        return None

    def _candidates(self, chain: Chain, query: Sequence[int], raw: list) -> list[tuple[int, str]]:
        """Entries worth reading, best first: the trimmable one at the longest
        block hit, then untrimmable ones that are a prefix of the query (by hash)."""
        k = len(chain.hashes)
        found: list[tuple[int, str]] = []
        for i in range(k - 1, -1, -1):  # trimmable: the longest block hit serves at least (i+1) blocks
            got = parse_index_value(raw[i])
            if got:
                found.append(((i + 1) * self.block, got[1]))
        for i in range(k):
            got = parse_index_value(raw[k + i])
            if got and got[0] <= len(query) and chain.entry_id(got[0]) == got[1]:
                found.append(got)
        found.sort(key=lambda c: -c[0])
        seen, out = set(), []
        for n, eid in found:
            if eid not in seen:
                seen.add(eid)
                out.append((n, eid))
        return out[:_CANDIDATES]

    def _entry(self, scope, eid: str, query) -> tuple[Entry, int] | None:
        raw = self.link.run(lambda r: r.get(self.keys.manifest(scope.namespace, eid)))
        if raw is None:  # evicted or expired (its index keys expire too): its blocks may still be held
            self.writer.reconcile_soon()
            return None
        m = decode_manifest(raw, scope.namespace, eid)
        chain = Chain(scope.namespace, m.tokens, self.block) if m is not None else None
        if m is None or chain.entry_id(len(m.tokens)) != eid or (m.blocks and m.blocks != tuple(chain.hashes)):
            self.counters["corrupt"] += 1
            return None
        if (eid, m.version) in self._bad:
            return None
        entry = Entry(scope.namespace, m.tokens, m.nbytes, m.trimmable, m.key, m)
        served = entry.serves(query)
        return (entry, served) if served else None

    # ------------------------------------------------------------------ fetch
    def fetch(self, entry, scope, expected):
        m: Manifest = entry.payload
        names = self.keys.chunks(m) + [self.keys.value(m.namespace, h) for h in m.blocks]
        sizes = list(m.chunk_sizes) + [m.layout.payload_bytes(self.block)] * len(m.blocks) if m.blocks else []
        try:
            parts = []
            for group in _groups(names, sizes, _FETCH_GROUP * self.chunk_bytes):
                parts += self.link.run(lambda r: r.mget(group))
            checksums = self.link.run(lambda r: self._checksums(r, m)) if m.blocks else []
        except Unavailable:
            self.counters["lookup_errors"] += 1
            return None
        parts, values = parts[: len(m.chunk_sizes)], parts[len(m.chunk_sizes) :]
        if any(p is None for p in parts + values):
            self.counters["missing"] += 1  # replaced or evicted since the manifest was read
            self._bad.add((m.eid, m.version))
            if any(v is None for v in values):  # a block it needs is gone: it can never be served
                self.writer.submit(lambda: self.writer.discard(m))
                self.writer.reconcile_soon()
            return None
        damaged = tuple(h for h, v, c in zip(m.blocks, values, checksums) if not block_ok(v, c, m.layout, self.block))
        cache = None if damaged else self._verified(m, parts, values, scope, expected)
        if cache is None:
            self.counters["corrupt"] += 1
            self._bad.add((m.eid, m.version))
            self.writer.submit(lambda: self.writer.discard(m, damaged))
            return None
        self.counters["hits"] += 1
        self.counters["hit_tokens"] += len(m.tokens)
        self._remember(m.eid)
        self.writer.submit(lambda: self.writer.touch(m))
        return cache

    def _checksums(self, r, m: Manifest) -> list:
        pipe = r.pipeline(transaction=False)
        for h in m.blocks:
            pipe.hget(self.keys.refs(m.namespace, h), "crc")
        return pipe.execute()

    def _verified(self, m: Manifest, parts: list[bytes], values: list[bytes], scope, expected):
        sizes = tuple(len(p) for p in parts)
        if sizes != m.chunk_sizes or tuple(crc32(p) for p in parts) != m.checksums:
            return None
        name = f"redis:{self.keys.manifest(m.namespace, m.eid)}"
        if m.layout is not None:  # blocks (checked) and a tail
            cache = assemble(m.layout, values, parts, self.block)
            if cache is None or cache[0].offset != len(m.tokens):
                return None
            try:
                check_cache_fits_model(cache, expected, name)
            except ChatCacheError:
                return None
            return cache
        try:
            cache, info = load_prompt_cache_bytes(b"".join(parts), name, model=scope.fingerprint)
            check_cache_fits_model(cache, expected, name)
        except ChatCacheError:
            return None
        if tuple(info.tokens or ()) != m.tokens or info.metadata.get("store.namespace") != scope.namespace:
            return None
        return cache

    # ------------------------------------------------------------------ add
    def add(self, scope, tokens, cache, key):
        tokens = tuple(int(t) for t in tokens)
        if len(tokens) < self.block or not self.link.available():
            return False
        chain = Chain(scope.namespace, tokens, self.block)
        eid = chain.entry_id(len(tokens))
        if self._known(eid):
            return self.writer.submit(lambda: self._touch_known(scope.namespace, eid))
        if not self.writer.has_room():
            self.counters["dropped"] += 1
            return False
        version = secrets.token_hex(8)
        if self.share_blocks and splittable(cache, len(tokens)):
            values, tail, layout = split(cache, chain)
            m, chunks = Manifest.for_value(scope.namespace, eid, version, tail, self.chunk_bytes, tokens, True, key,
                                           tuple(chain.hashes), layout)  # fmt: skip
            return self.writer.submit(lambda: self.writer.publish(m, chunks, values) and self._remember(eid))
        trimmable = can_trim_prompt_cache(cache)
        meta = {"store.namespace": scope.namespace, "store.trimmable": "1" if trimmable else "0"}
        if key is not None:
            meta["store.key"] = key
        data = prompt_cache_bytes(cache, tokens=tokens, model=scope.fingerprint, settings=scope.settings, metadata=meta)
        m, chunks = Manifest.for_value(scope.namespace, eid, version, data, self.chunk_bytes,
                                       tokens, trimmable, key)  # fmt: skip
        return self.writer.submit(lambda: self.writer.publish(m, chunks) and self._remember(eid))

    def _touch_known(self, ns: str, eid: str) -> None:
        raw = self.link.run(lambda r: r.get(self.keys.manifest(ns, eid)))
        m = decode_manifest(raw, ns, eid) if raw else None
        if m is None:
            with self._recent_lock:  # gone (evicted, expired, Redis restarted): write it next time
                self._recent.pop(eid, None)
            self.writer.reconcile_soon()
        else:
            self.writer.touch(m)

    def _known(self, eid: str) -> bool:
        with self._recent_lock:
            return eid in self._recent

    def _remember(self, eid: str) -> None:
        with self._recent_lock:
            self._recent[eid] = None
            self._recent.move_to_end(eid)
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)

    # ------------------------------------------------------------------ state
    def stats(self) -> dict:
        return {
            "entries": self.writer.known_entries, "bytes": self.writer.known_bytes, "budget": self.index.budget,
            **self.counters, "pending_writes": self.writer.pending(), "connected": not self.link.down,
            "outages": self.link.outages,
        }  # fmt: skip

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued writes (tests, benchmarks, shutdown)."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        """Let queued writes finish (a few seconds at most), then stop."""
        self.writer.flush(5.0)
        self.writer.close()
        self.link.close()


def _groups(names: list[str], sizes: list[int], limit: int) -> list[list[str]]:
    """``names`` in runs of at most ``limit`` bytes (by ``sizes``; at least one
    name each); without sizes, runs of ``_FETCH_GROUP`` names."""
    if not sizes:
        return [names[g : g + _FETCH_GROUP] for g in range(0, len(names), _FETCH_GROUP)]
    out, run, total = [], [], 0
    for name, size in zip(names, sizes):
        if run and total + size > limit:
            out.append(run)
            run, total = [], 0
        run.append(name)
        total += size
    return out + [run] if run else out


__all__ = ["RedisTier"]
