"""The prompt-cache store: content-addressed values in tiers (memory, then disk,
then Redis) behind one checkout/put interface.

Contract
--------
``PromptStore(tiers, block_tokens)``; tiers are asked in order (fastest first).

- :meth:`PromptStore.checkout` ``(scope, model, prompt, shape)`` returns
  ``(state, tier)``: a :class:`~mlx_chatcache.files.prompt_cache.PromptCache` of
  ``model`` and ``shape`` the caller owns, holding the longest prefix of
  ``prompt[:-1]`` the store can serve (the last prompt token is always left to
  feed, so the model yields logits) and its exact token ids, and the name of the
  slowest tier it took values from; on a miss an empty one and None. For a cache of
  plain ``KVCache`` layers the lookup walks the prompt's chain of blocks
  (:mod:`.chain`) and takes the leading run of blocks every tier together holds,
  then the longest entry tail after them that the prompt starts with; any other
  cache is one whole value, served to a prompt it is a prefix of. A value that is
  missing is a miss, one that is damaged (or not what its key names) is dropped
  from its tier and counted ``corrupt``: a shorter hit, never an error or a wrong
  token. Values found in a slower tier are kept in the memory tier too.
- :meth:`PromptStore.put` ``(scope, tokens, cache, key)`` stores a cache holding
  ``tokens`` in every tier: its blocks no tier holds yet and its tail (or the whole
  cache) as values; ``cache`` stays the caller's. ``key`` (a conversation id)
  pins the entry in the memory and disk tiers (:class:`~.tiers.Pins`). With
  ``defer=True`` the writes to the disk and Redis tiers wait in
  :attr:`PromptStore.pending` until :meth:`PromptStore.flush`, so a server writes
  when it has nothing else to do (and before it exits); with ``memory_only=True``
  only the memory tier keeps it. With ``on_error``, a failing tier (a full shared
  disk) is reported to it, ``on_error(tier, error)``, and the others are still written.
  With ``hand_over=True`` the caller gives a cache kept in blocks up: a store with a memory
  tier keeps that one cache as it is (outside the budget, until the next such put), and the next
  checkout it serves at least as far as the tiers would takes it, trimmed to what its
  values would serve, instead of assembling a copy of them (a conversation's next turn on
  the same server): the same tokens and arrays, only sooner.
- :meth:`PromptStore.draft_index` ``(scope)`` is the scope's
  :class:`~mlx_chatcache.store.draft_index.DraftIndex` (speculative decoding's store
  drafts), when the store was made with ``draft_tokens`` > 0 (its capacity, per scope; at
  most ``draft_scopes`` indexes are kept, the least recently used scope's dropped): made
  on first use from the newest values of the scope in the disk tier, then fed every ``put``
  of the scope and every value a checkout reads from the disk or Redis tier.
- :meth:`PromptStore.stats` and :meth:`PromptStore.pins` may be read from another thread.
- What a hit returns holds the same tokens the prompt would otherwise have been fed
  with: results do not depend on whether there was a hit (up to the floating-point
  differences of feeding a prompt in other chunks).

All other calls come from one thread (the server's generation worker, or the one of
``mlxcc generate``/``mlxcc chat``, whose store is the disk tier of ``--cache-dir``).
Each tier evicts by itself: the memory tier an LRU by bytes, the disk tier a sweep
by modification time, Redis its ``maxmemory`` policy and TTL.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..cache import BaseCache, KVCache
from ..cache.cache_kv import hold_kv_in
from ..config import SERVER_DEFAULTS, CacheShape
from ..errors import ChatCacheError
from ..files.mlxcc_format import check_cache_fits_model
from ..files.prompt_cache import PromptCache
from ..models.fingerprint import ModelFingerprint
from ..files.registry import parse_tokens
from ..files.tokens import common_prefix_len
from .chain import Chain
from .disk import DiskTier
from .draft_index import DraftIndex
from .tiers import MemoryTier, Pin, Tier
from .values import Value, assemble, cut, decode, encode, in_parallel, splittable, whole


@dataclass(frozen=True)
class Scope:
    """Which model and cache shape values belong to: ``namespace`` keys them,
    ``fingerprint`` is written into and checked against values, ``settings``
    (max_kv_size, keep, KV quantization and, for a command's or server's scope,
    the weight policy) are hashed into the namespace and written with each value,
    so ``mlxcc cache info`` can say what made it."""

    namespace: str
    fingerprint: ModelFingerprint
    settings: dict = field(default_factory=dict, hash=False, compare=False)


def make_scope(fingerprint: ModelFingerprint, settings: dict) -> Scope:
    """The scope of ``fingerprint``'s caches made with ``settings`` (a draft model, whose
    layers the caches then hold too, is part of it)."""
    ident = {"weights": fingerprint.weights_hash, "tokenizer": fingerprint.tokenizer_hash, **settings}
    if fingerprint.draft is not None:
        ident["draft"] = [fingerprint.draft.weights_hash, fingerprint.draft.tokenizer_hash]
    ident = json.dumps(ident, sort_keys=True)
    return Scope(hashlib.sha256(ident.encode()).hexdigest()[:32], fingerprint, dict(settings))


def tenant_scope(scope: Scope, tenant: str) -> Scope:
    """``scope`` for the entries of one tenant alone: its id (never a secret) is hashed into
    the namespace and recorded with each value, so no other scope serves or finds them."""
    if not scope.namespace:
        return scope
    return make_scope(scope.fingerprint, {**scope.settings, "tenant": tenant})


class PromptStore:
    def __init__(self, tiers: Sequence[Tier] = (), block_tokens: int = SERVER_DEFAULTS.store_block_tokens,
                 draft_tokens: int = 0, draft_scopes: int = SERVER_DEFAULTS.draft_index_scopes):  # fmt: skip
        self.tiers = list(tiers)
        self.block_tokens = block_tokens
        self.draft_tokens, self.draft_scopes = draft_tokens, draft_scopes
        self._indexes: OrderedDict[str, DraftIndex] = OrderedDict()  # least recently used first
        self.memory = next((t for t in self.tiers if isinstance(t, MemoryTier)), None)
        self.pending: deque = deque()  # deferred writes: (tier, values, pin)
        fast = [t for t in self.tiers if t is self.memory]
        self._sources = fast + [_Pending(self.pending)] + [t for t in self.tiers if t is not self.memory]
        self.lookups = 0
        self.misses = 0
        self._kept: tuple[Scope, list[int], list[BaseCache], list[int]] | None = None  # put with hand_over

    def draft_index(self, scope: Scope) -> DraftIndex | None:
        """The scope's n-gram index of stored tokens (see the module docstring); None without
        ``draft_tokens`` or a namespace."""
        if self.draft_tokens <= 0 or not scope.namespace:
            return None
        index = self._indexes.get(scope.namespace)
        if index is None:
            while len(self._indexes) >= max(self.draft_scopes, 1):
                self._indexes.popitem(last=False)
            index = self._indexes[scope.namespace] = DraftIndex(self.draft_tokens, block=self.block_tokens)
            self._warm(scope, index)
        self._indexes.move_to_end(scope.namespace)
        return index

    def _warm(self, scope: Scope, index: DraftIndex) -> None:
        """Feed ``index`` the tokens of the scope's newest values in the disk tier, up to its capacity."""
        found, held = [], 0
        for tier in self.tiers:
            if not isinstance(tier, DiskTier):
                continue
            for _, header in tier.recent_headers():
                if held >= index.capacity:
                    break
                if header.metadata.get("user.store.namespace") != scope.namespace:
                    continue
                try:
                    tokens = parse_tokens(header.path, header.metadata.get("mlxcc.tokens"))
                except ChatCacheError:
                    continue
                if tokens:
                    found.append(tokens)
                    held += len(tokens)
        index.add_all(reversed(found))  # oldest first: the newest win the index's slots

    def _index(self, scope: Scope, tokens: Sequence[int], chain: Chain) -> None:
        index = self._indexes.get(scope.namespace)
        if index is not None:
            index.add(tokens, chain.blocks[: len(tokens) // self.block_tokens])

    def _splits(self, scope: Scope, kinds: Sequence[type]) -> bool:
        """Whether caches of these layer classes are kept in blocks in ``scope``."""
        return all(k is KVCache for k in kinds) and not scope.settings.get("kv_bits")

    # ------------------------------------------------------------------ checkout
    def checkout(self, scope: Scope, model, prompt: Sequence[int], shape: CacheShape | None = None,
                 ) -> tuple[PromptCache, str | None]:  # fmt: skip
        """``(state, tier)``: the longest stored prefix of ``prompt`` (see the module doc)."""
        state = PromptCache.new(model, shape)
        self.lookups += 1
        query = [int(t) for t in prompt[:-1]]
        if scope.namespace and query and self.tiers:
            chain = Chain(scope.namespace, query, self.block_tokens)
            if self._splits(scope, [type(c) for c in state.cache]):
                found = self._blocks(scope, chain, query, state.cache)
            else:
                found = self._whole(scope, chain, query, state.cache)
            if found is not None:
                cache, n, tier = found
                state.cache[:], state.tokens[:] = hold_kv_in(cache, state.shape.kv_dtype), query[:n]
                if tier not in ("memory", None):  # other replicas' and earlier runs' tokens
                    self._index(scope, query[:n], chain)
                return state, tier
        self.misses += 1
        return state, None

    def _blocks(self, scope, chain: Chain, query: list[int], expected: list[BaseCache]):
        b = self.block_tokens
        keys = chain.blocks
        where = self._locate(keys)
        run = next((i for i, t in enumerate(where) if t is None), len(keys))
        kept = self._take_kept(scope, chain, query, run * b)
        if kept is not None:
            return kept
        values = self._fetch(scope, keys[:run], where[:run], lambda i, v: v.start == i * b and v.tokens ==
                             query[i * b : (i + 1) * b])  # fmt: skip
        tiers = where[: len(values)]
        r = len(values) * b
        tails = [chain.entry(n) for n in range(min(len(query), r + b - 1), r, -1)]
        for k, t in zip(tails, self._locate(tails)):
            if t is not None:
                tail = self._fetch(scope, [k], [t], lambda _, v: v.start == r and v.tokens == query[r : v.end])
                if tail:
                    values, tiers = values + tail, tiers + [t]
                    break
        if not values:
            return None
        try:
            cache = assemble(values)
            check_cache_fits_model(cache, expected, f"store value {values[-1].key}")
        except ChatCacheError:  # values that passed their checks but do not fit together, or the model
            for v, t in zip(values, tiers):
                self._corrupt(t, v.key)
            return None
        return cache, values[-1].end, self._slowest(tiers)

    def _take_kept(self, scope: Scope, chain: Chain, query: list[int], blocks_end: int):
        """The kept cache, trimmed to the prefix of ``query`` its values serve (whole blocks,
        then a tail), when no block run (ending at ``blocks_end``) or tail the tiers hold
        serves more of ``query``."""
        if self._kept is None or self._kept[0] != scope:
            return None
        _, tokens, cache, ends = self._kept
        held = common_prefix_len(tokens, query)
        n = max([held - held % self.block_tokens] + [e for e in ends if e <= held])
        longer = range(min(len(query), blocks_end + self.block_tokens - 1), max(n, blocks_end), -1)
        if n == 0 or n < blocks_end or any(self._locate([chain.entry(e) for e in longer])):
            return None
        self._kept = None
        for c in cache:
            c.trim(c.offset - n)
        return cache, n, "memory"

    def _whole(self, scope, chain: Chain, query: list[int], expected: list[BaseCache]):
        keys = [chain.entry(n) for n in range(len(query), 0, -1)]
        for k, t in zip(keys, self._locate(keys)):
            if t is None:
                continue
            found = self._fetch(scope, [k], [t], lambda _, v: v.start == 0 and v.tokens == query[: v.end])
            if not found:
                continue
            try:
                cache = whole(found[0], scope.fingerprint)
                check_cache_fits_model(cache, expected, f"store value {k}")
            except ChatCacheError:
                self._corrupt(t, k)
                continue
            return cache, found[0].end, t.name
        return None

    def _locate(self, keys: list[str]) -> list[Tier | None]:
        """Per key, the first tier holding it (None: none does)."""
        where: list[Tier | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for tier in self._sources:
            if not todo:
                break
            for i, held in zip(todo, tier.has([keys[i] for i in todo])):
                if held:
                    where[i] = tier
            todo = [i for i in todo if where[i] is None]
        return where

    def _fetch(self, scope, keys: list[str], where: list[Tier], fits: Callable[[int, Value], bool]) -> list[Value]:
        """The values of ``keys`` from their tiers, up to the first that is missing or
        bad (``fits(i, value)`` False, or damaged: dropped and counted)."""
        got: dict[str, object] = {}
        for tier in {id(t): t for t in where}.values():
            mine = [k for k, t in zip(keys, where) if t is tier]
            got.update(zip(mine, tier.get(mine)))

        def checked(k: str) -> Value | bool:  # False: damaged, or not that value
            try:
                return decode(k, got[k], scope)
            except ChatCacheError:
                return False

        raw = [k for k in keys if isinstance(got[k], bytes)]
        got.update(zip(raw, in_parallel(checked, raw)))  # (the memory tier's values are checked already)
        out, found = [], {}
        for i, (k, t) in enumerate(zip(keys, where)):
            value = got[k]
            if value is None:
                break
            if value is False or not fits(i, value):
                self._corrupt(t, k)
                break
            out.append(value)
            if t is not self.memory:
                found[k] = value
        if found and self.memory is not None:
            self.memory.put(found)
        return out

    def _corrupt(self, tier: Tier, key: str) -> None:
        tier.drop(key)
        tier.counters["corrupt"] += 1

    def _slowest(self, tiers: list[Tier]) -> str:
        return max(tiers, key=self._sources.index).name

    # ------------------------------------------------------------------ put
    def put(self, scope: Scope, tokens: Sequence[int], cache: list[BaseCache], key: str | None = None,
            defer: bool = False, memory_only: bool = False,
            on_error: Callable[[Tier, Exception], None] | None = None, ends: Sequence[int] = (),
            hand_over: bool = False) -> dict:  # fmt: skip
        """Store ``cache`` (holding ``tokens``) in every tier (``memory_only``: in the memory
        tier alone); ``{tier: stored?}`` (None: a deferred write, still pending). ``ends``:
        shorter prefixes of ``tokens`` to serve exactly too (a prompt whose reply follows:
        the next turn starts with the prompt even where it spells the reply otherwise);
        a cache kept in blocks stores their tails, any other cache ignores them.
        ``hand_over``: ``cache`` is the store's from now on (see the module doc)."""
        tokens = [int(t) for t in tokens]
        targets = [t for t in self.tiers if t is self.memory or not memory_only]
        n = len(tokens)
        if not n or not scope.namespace or not targets:
            return {}
        chain, b = Chain(scope.namespace, tokens, self.block_tokens), self.block_tokens
        self._index(scope, tokens, chain)
        split = self._splits(scope, [type(c) for c in cache])
        if split and not splittable(cache, n):
            return {t.name: False for t in targets}
        if split:  # (key, first token, end) of each value
            ranges = [(k, i * b, (i + 1) * b) for i, k in enumerate(chain.blocks)]
            tails = sorted({e for e in (*ends, n) if 0 < e <= n and e % b})
            ranges += [(chain.entry(e), e - e % b, e) for e in tails]
        else:
            ranges = [(chain.entry(n), 0, n)]
        if split and hand_over and self.memory is not None:  # the values' ends: what it serves
            self._kept = (scope, tokens, list(cache), [e for _, _, e in ranges])
        values = self._values(scope, tokens, cache, split, ranges, targets)
        stored = {}
        for tier in targets:
            if defer and tier is not self.memory:
                self.pending.append((tier, values, (key, n)))
                stored[tier.name] = None
                continue
            try:
                self._write(tier, values, (key, n))
                stored[tier.name] = True
            except (ChatCacheError, OSError) as e:
                if on_error is None:
                    raise
                on_error(tier, e)
                stored[tier.name] = False
        return stored

    def _values(self, scope, tokens: list[int], cache, split: bool, ranges: list[tuple[str, int, int]],
                targets) -> dict[str, Value]:  # fmt: skip
        """The value of each ``(key, start, end)``: the memory tier's, or made from ``cache``
        (``split``: ``KVCache`` layers cut from it; else all of it) when a tier lacks it."""
        keys = [k for k, _, _ in ranges]
        held = dict(zip(keys, self.memory.get(keys))) if self.memory is not None else {}
        local = [t for t in targets if t is self.memory or isinstance(t, DiskTier)]
        needed = set(keys) if len(local) < len(targets) else set()  # a remote tier gets every value
        for t in local:
            needed.update(k for k, h in zip(keys, t.has(keys)) if not h)
        out = {}
        for k, start, end in ranges:
            if held.get(k) is not None:
                out[k] = held[k]
            elif k in needed:
                layers = cut(cache, start, end) if split else cache
                out[k] = decode(k, encode(scope, k, layers, tokens[start:end], start), scope, check=False)
        return out

    def _write(self, tier: Tier, values: dict[str, Value], pin: tuple[str | None, int]) -> None:
        name, n = pin
        if name is not None and values:
            tier.pin(name, n, list(values))
        tier.put(values)

    def flush(self, keep: int = 0, until=None) -> int:
        """Do pending writes, oldest first, until ``keep`` are left (or ``until()``
        says stop); returns how many were written."""
        done = 0
        while len(self.pending) > keep and not (until and until()):
            tier, values, pin = self.pending.popleft()
            self._write(tier, values, pin)
            done += 1
        return done

    # ------------------------------------------------------------------ state
    def stats(self) -> dict:
        out = {"lookups": self.lookups, "misses": self.misses, "pending_writes": len(self.pending),
               **{t.name: t.stats() for t in self.tiers}}  # fmt: skip
        if self.draft_tokens > 0:
            out["draft_index"] = [i.stats() for i in list(self._indexes.values())]
        return out

    def pins(self) -> dict[str, dict[str, Pin]]:
        """Per pinning key, what each tier holds for it (not the Redis tier: see its module doc)."""
        out: dict[str, dict[str, Pin]] = {}
        for tier in self.tiers:
            for key, pin in tier.pins().items():
                out.setdefault(key, {})[tier.name] = pin
        return out

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


class _Pending(Tier):
    """The values of deferred writes (``PromptStore.pending``), served as the memory tier
    serves its own until they are written."""

    name = "memory"

    def __init__(self, pending: deque):
        super().__init__(None)
        self._pending = pending

    def _held(self) -> dict[str, Value]:
        return {k: v for _, values, _ in self._pending for k, v in values.items()}

    def has(self, keys):
        held = self._held()
        return [k in held for k in keys]

    def get(self, keys):
        held = self._held()
        return [held.get(k) for k in keys]

    def drop(self, key):
        """(Values made here are never damaged.)"""


def build_store(memory_bytes: int, disk_bytes: int, cache_dir, redis_url: str | None = None,
                draft_tokens: int = 0) -> PromptStore:  # fmt: skip
    """A store with a memory tier (unless ``memory_bytes`` is 0), a disk tier
    in ``cache_dir`` (unless ``disk_bytes`` is 0 or ``cache_dir`` is None) and a
    Redis tier at ``redis_url`` (when given; needs the ``redis`` package); ``draft_tokens``:
    the capacity of each scope's draft index (0: none)."""
    tiers: list[Tier] = []
    if memory_bytes > 0:
        tiers.append(MemoryTier(memory_bytes))
    if disk_bytes > 0 and cache_dir is not None:
        tiers.append(DiskTier(cache_dir, disk_bytes))
    if redis_url:
        from .redis_tier import RedisTier  # the redis package is optional

        tiers.append(RedisTier(redis_url))
    return PromptStore(tiers, draft_tokens=draft_tokens)


__all__ = ["PromptStore", "Scope", "build_store", "make_scope", "tenant_scope"]
