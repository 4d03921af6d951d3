"""Stored responses (``/v1/responses`` with ``store``): records kept in the store's tiers.

Contract
--------
:class:`StoredResponses` keeps one record per response (:mod:`~mlx_chatcache.store.records`,
key ``"r" + the response id's hex``) holding ``{"response": the response object,
"history": the conversation's messages up to and with its reply}``. It has tiers
of its own over the same places as the server's store (:meth:`StoredResponses.beside`):
the Redis tier (so every replica finds them; its TTL ends them), asked first, and the
disk tier's folder (so a restarted server finds them; the folder's sweep ages them out
as it ages any value, least recently used first); its own memory tier only when the
store has neither. A delete removes the record from this server's tiers and leaves a
*tombstone* record in Redis, so a replica whose own folder still holds it answers 404
too (and drops its copy). ``put``, ``get`` and ``delete`` run on one thread of their own, off the
event loop and off the generation worker (which owns the store's tiers). A damaged
record is dropped and is a miss. Response ids are ``resp_`` + 32 hex digits; any
other id is simply not found.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

from ..errors import ChatCacheError
from ..store.chain import record_key
from ..store.disk import DiskTier
from ..store.records import Record, decode_record, encode_record
from ..store.store import PromptStore
from ..store.tiers import MemoryTier, Tier

_ID = re.compile(r"resp_([0-9a-f]{32})")
MEMORY_BYTES = 64 << 20  # the records' own memory tier, when the store has no shared tier
TOMBSTONE = "deleted"  # the document of a deleted response's record in Redis


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


class StoredResponses:
    def __init__(self, tiers: list[Tier]):
        self.tiers = tiers
        self.counters = {"stored": 0, "found": 0, "missing": 0, "deleted": 0, "errors": 0}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mlxcc-responses")

    @classmethod
    def beside(cls, store: PromptStore) -> "StoredResponses":
        """Records in the places ``store`` keeps values (see the module doc)."""
        tiers: list[Tier] = []
        for t in store.tiers:
            if t.name == "redis":
                from ..store.redis_tier import RedisTier

                tiers.insert(0, RedisTier(t.url, ttl=t.ttl, prefix=t.prefix))
            elif isinstance(t, DiskTier):
                tiers.append(DiskTier(t.folder, None))  # the server's own tier sweeps the folder
        return cls(tiers or [MemoryTier(MEMORY_BYTES)])

    # ------------------------------------------------------------------ async doors
    async def put(self, response_id: str, document: dict) -> None:
        await self._run(self._put, response_id, document)

    async def get(self, response_id: str) -> dict | None:
        return await self._run(self._get, response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._run(self._delete, response_id)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # ------------------------------------------------------------------ on the records' thread
    def _put(self, response_id: str, document: dict, tiers=None) -> None:
        key = _key(response_id)
        record = Record(key, encode_record(key, document), document)
        for tier in self.tiers if tiers is None else tiers:
            try:
                tier.put({key: record})
                flush = getattr(tier, "flush", None)
                if flush is not None:  # Redis writes on its own thread: let other replicas find it now
                    flush(5.0)
            except (ChatCacheError, OSError):
                self.counters["errors"] += 1
        self.counters["stored"] += 1

    def _get(self, response_id: str) -> dict | None:
        key = _key(response_id)
        if key is not None:
            for tier in self.tiers:
                try:
                    item = tier.get([key])[0]
                except (ChatCacheError, OSError):
                    item = None
                if item is None:
                    continue
                try:
                    record = item if isinstance(item, Record) else decode_record(key, item)
                except ChatCacheError:
                    tier.drop(key)
                    tier.counters["corrupt"] += 1
                    continue
                if record.document.get(TOMBSTONE):  # deleted through another replica
                    for t in self.tiers[self.tiers.index(tier) + 1 :]:
                        t.drop(key)
                    break
                self.counters["found"] += 1
                return record.document
        self.counters["missing"] += 1
        return None

    def _delete(self, response_id: str) -> bool:
        if self._get(response_id) is None:
            return False
        key = _key(response_id)
        for tier in self.tiers:
            tier.drop(key)
        self._put(response_id, {TOMBSTONE: True}, [t for t in self.tiers if t.name == "redis"])
        self.counters["deleted"] += 1
        return True

    def stats(self) -> dict:
        return dict(self.counters)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()


def _key(response_id: str) -> str | None:
    m = _ID.fullmatch(response_id) if isinstance(response_id, str) else None
    return None if m is None else record_key(m.group(1))


__all__ = ["StoredResponses", "new_response_id"]
