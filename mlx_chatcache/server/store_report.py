"""What ``GET /v1/store`` says about the server's prompt-cache store: read-only
statistics, never what an entry holds.

Contract
--------
:func:`store_report` is a JSON-ready dict:

- ``tiers``: per tier (fastest first) ``name``, ``bytes`` and ``budget`` (Redis:
  its own memory use and ``maxmemory``), ``entries`` (entry values: tails and whole
  caches), ``blocks`` (block values), ``pinned_entries`` (null where the tier cannot
  tell: Redis, which counts no values), ``hits`` (values read), ``evicted``,
  ``refused`` and ``served_tokens`` (prompt tokens it served, exact);
- ``lookups``, ``misses``, ``pending_writes`` (the store's), ``prompt_tokens``
  and ``cached_tokens`` (every job's, in total);
- ``pinned_keys`` and ``pins``: the keys pinning the most bytes (at most
  ``SERVER_DEFAULTS.store_report_pins``), each as ``key_sha256`` (the first 12
  hex digits of the SHA-256 of its UTF-8 bytes: keys may be user ids, so the
  key itself is never shown), ``entries``, ``tokens`` (its longest entry's),
  ``bytes`` and ``tiers`` (their names); for a ``tenant`` (:mod:`.auth`), only the
  keys its own requests pinned (``pinned_entries`` counts every key's);
- ``history``: the worker's :class:`~.history.StatsHistory` samples, after
  sampling the totals now (one sample per period at most).

No token ids, no text, no key. It reads counters the worker updates (plain
ints, as ``/health`` does) and may run on the HTTP thread.
"""

from __future__ import annotations

import hashlib

from ..config import SERVER_DEFAULTS
from .worker import GenerationWorker


def store_report(worker: GenerationWorker, tenant: str | None = None) -> dict:
    totals = worker.served.totals()
    worker.history.sample(totals)
    store = worker.store
    tiers, every = [], store.pins()
    held = every if tenant is None else {name[len(tenant) + 1 :]: pin for name, pin in every.items()
                                         if name.startswith(tenant + ":")}  # its own, by the key it gave (Job.pin)
    for tier in store.tiers:
        s = tier.stats()
        pinned = [by_tier[tier.name].entries for by_tier in every.values() if tier.name in by_tier]
        tiers.append({"name": tier.name, "bytes": s["bytes"], "budget": s["budget"], "entries": s["entries"],
                      "blocks": s["blocks"], "pinned_entries": sum(pinned) if s["entries"] is not None else None,
                      "hits": s["hits"], "evicted": s["evicted"], "refused": s["refused"],
                      "served_tokens": totals["by_tier"].get(tier.name, 0)})  # fmt: skip
    pins = [{"key_sha256": key_digest(key), "entries": sum(p.entries for p in by_tier.values()),
             "tokens": max(p.tokens for p in by_tier.values()), "bytes": sum(p.nbytes for p in by_tier.values()),
             "tiers": list(by_tier)} for key, by_tier in held.items()]  # fmt: skip
    pins.sort(key=lambda p: -p["bytes"])
    return {"tiers": tiers, "lookups": store.lookups, "misses": store.misses, "pending_writes": len(store.pending),
            "prompt_tokens": totals["prompt_tokens"], "cached_tokens": totals["cached_tokens"],
            "pinned_keys": len(pins), "pins": pins[: SERVER_DEFAULTS.store_report_pins],
            "history": worker.history.samples()}  # fmt: skip


def key_digest(key: str) -> str:
    """How a pinning key is shown: the first 12 hex digits of its SHA-256."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]


__all__ = ["store_report", "key_digest"]
