"""What ``GET /v1/store`` says about the server's prompt-cache store: read-only
statistics, never what an entry holds.

Contract
--------
:func:`store_report` is a JSON-ready dict:

- ``tiers``: per tier (fastest first) ``name``, ``bytes`` and ``budget``,
  ``entries``, ``pinned_entries`` (null when the tier cannot tell: Redis),
  ``blocks`` (null: not counted), ``hits``, ``evicted``, ``refused`` and
  ``served_tokens`` (prompt tokens it served, exact);
- ``lookups``, ``misses``, ``pending_writes`` (the store's), ``prompt_tokens``
  and ``cached_tokens`` (every job's, in total);
- ``pinned_keys`` and ``pins``: the keys pinning the most bytes (at most
  ``SERVER_DEFAULTS.store_report_pins``), each as ``key_sha256`` (the first 12
  hex digits of the SHA-256 of its UTF-8 bytes: keys may be user ids, so the
  key itself is never shown), ``entries``, ``tokens`` (its longest entry's),
  ``bytes`` and ``tiers`` (their names);
- ``history``: the worker's :class:`~.history.StatsHistory` samples, after
  sampling the totals now (one sample per period at most).

No token ids, no text, no key. It reads counters the worker updates (plain
ints, as ``/health`` does) and may run on the HTTP thread.
"""

from __future__ import annotations

import hashlib

from ..config import SERVER_DEFAULTS
from .worker import GenerationWorker


def store_report(worker: GenerationWorker) -> dict:
    totals = worker.served.totals()
    worker.history.sample(totals)
    store = worker.store
    tiers = []
    for tier in store.tiers:
        s = tier.stats()
        tiers.append({"name": tier.name, "bytes": s["bytes"], "budget": s["budget"], "entries": s["entries"],
                      "pinned_entries": s.get("pinned_entries"), "blocks": None, "hits": s["hits"],
                      "evicted": s["evicted"], "refused": s["refused"],
                      "served_tokens": totals["by_tier"].get(tier.name, 0)})  # fmt: skip
    pins = [{"key_sha256": key_digest(key), "entries": sum(p.entries for p in by_tier.values()),
             "tokens": max(p.tokens for p in by_tier.values()), "bytes": sum(p.nbytes for p in by_tier.values()),
             "tiers": list(by_tier)} for key, by_tier in store.pins().items()]  # fmt: skip
    pins.sort(key=lambda p: -p["bytes"])
    return {"tiers": tiers, "lookups": store.lookups, "misses": store.misses, "pending_writes": len(store.pending),
            "prompt_tokens": totals["prompt_tokens"], "cached_tokens": totals["cached_tokens"],
            "pinned_keys": len(pins), "pins": pins[: SERVER_DEFAULTS.store_report_pins],
            "history": worker.history.samples()}  # fmt: skip


def key_digest(key: str) -> str:
    """How a pinning key is shown: the first 12 hex digits of its SHA-256."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]


__all__ = ["store_report", "key_digest"]
