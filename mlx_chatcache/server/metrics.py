"""``GET /metrics``: the server's state and history in the Prometheus text format.

Contract
--------
A :class:`ServerMetrics` has a registry of its own (several servers may run in one
process). Observed by the HTTP layer:

- ``mlxcc_requests_total{endpoint, status}``: every HTTP request, refused ones too
  (``endpoint``: the route's path, ``other`` for no route);
- ``mlxcc_request_duration_seconds{endpoint}``: arrival to the response's end;
- ``mlxcc_time_to_first_token_seconds``: arrival to the first generated token;
- ``mlxcc_inter_token_latency_seconds``: between consecutive tokens of a choice.

Read from the worker, the batch and the store when scraped:

- ``mlxcc_prompt_tokens_total{source}``: prompt tokens fed to the model
  (``computed``) and those each tier served (``memory``, ``disk``, ``redis``);
- :data:`WORKER_COUNTERS` (jobs, cancelled, failed, tokens generated, ...);
- ``mlxcc_queue_depth``, ``mlxcc_batch_rows_active``, ``mlxcc_batch_rows_max``,
  ``mlxcc_requests_running``, ``mlxcc_draining``;
- per tier: ``mlxcc_store_bytes``, ``mlxcc_store_budget_bytes`` (when it has one),
  ``mlxcc_store_entries``, ``mlxcc_store_blocks`` (when it counts them),
  ``mlxcc_store_hits_total``, ``mlxcc_store_evictions_total``,
  ``mlxcc_store_refused_total``, ``mlxcc_store_corrupt_total``; and
  ``mlxcc_store_pending_writes``.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .drain import Drain
from .worker import GenerationWorker

CONTENT_TYPE = CONTENT_TYPE_LATEST
TIERS = ("memory", "disk", "redis")
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_GAP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)
# the worker's counters (its ``stats``) exposed, one row each: (key, metric name, help)
WORKER_COUNTERS = (
    ("jobs", "mlxcc_jobs", "Generation jobs ended (done, cancelled or failed)"),
    ("cancelled", "mlxcc_jobs_cancelled", "Jobs cancelled (the client went away, or the server stopped)"),
    ("errors", "mlxcc_jobs_failed", "Jobs that failed"),
    ("tokens_generated", "mlxcc_generated_tokens", "Tokens generated, every choice's"),
    ("store_errors", "mlxcc_store_write_errors", "Store writes that failed (a full disk)"),
)
# per-tier statistics of the store (``tier.stats()``): (key, metric name, help, counter?)
TIER_STATS = (
    ("bytes", "mlxcc_store_bytes", "Bytes the tier holds", False),
    ("budget", "mlxcc_store_budget_bytes", "The tier's byte budget", False),
    ("entries", "mlxcc_store_entries", "Entries (tails and whole caches) the tier holds", False),
    ("blocks", "mlxcc_store_blocks", "Blocks the tier holds", False),
    ("hits", "mlxcc_store_hits", "Values read from the tier", True),
    ("evicted", "mlxcc_store_evictions", "Values the tier evicted", True),
    ("refused", "mlxcc_store_refused", "Values the tier refused to keep", True),
    ("corrupt", "mlxcc_store_corrupt", "Damaged values found in the tier and dropped", True),
)


class ServerMetrics:
    def __init__(self, worker: GenerationWorker, drain: Drain):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxcc_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)  # fmt: skip
        self.duration = Histogram("mlxcc_request_duration_seconds", "HTTP request duration, arrival to the "
                                  "response's end", ["endpoint"], buckets=SECONDS, registry=r)  # fmt: skip
        self.ttft = Histogram("mlxcc_time_to_first_token_seconds", "Arrival of a request to its first token",
                              buckets=SECONDS, registry=r)  # fmt: skip
        self.token_gap = Histogram("mlxcc_inter_token_latency_seconds", "Time between consecutive tokens of a "
                                   "choice", buckets=TOKEN_GAP_SECONDS, registry=r)  # fmt: skip
        r.register(_State(worker, drain))

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.duration.labels(endpoint).observe(seconds)

    def reply(self, first_token_s: float | None, token_gaps: list[float]) -> None:
        """A job that is done (:mod:`.worker`): its time to the first token (None: no
        token) and the gaps between consecutive tokens of its choices."""
        if first_token_s is not None:
            self.ttft.observe(first_token_s)
        for gap in token_gaps:
            self.token_gap.observe(gap)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _State:
    """The collector of what is read when scraped (module docstring)."""

    def __init__(self, worker: GenerationWorker, drain: Drain):
        self.worker, self.drain = worker, drain

    def collect(self):
        w = self.worker
        served = w.served.totals()["by_tier"]
        prompt = CounterMetricFamily("mlxcc_prompt_tokens", "Prompt tokens fed to the model (computed) or served "
                                     "by a store tier", labels=["source"])  # fmt: skip
        prompt.add_metric(["computed"], w.stats["prompt_tokens_computed"])
        for tier in (*TIERS, *sorted(set(served) - set(TIERS))):
            prompt.add_metric([tier], served.get(tier, 0))
        yield prompt
        for key, name, text in WORKER_COUNTERS:
            yield CounterMetricFamily(name, text, value=w.stats.get(key, 0))
        report = w.batch.report() if w.batch is not None else None
        rows = report["active_rows"] if report and report["enabled"] else int(bool(w.stats["busy"]))
        gauges = (("mlxcc_queue_depth", "Requests waiting for the generator", report["waiting"] if report
                   else w.waiting()),
                  ("mlxcc_batch_rows_active", "Rows decoding now", rows),
                  ("mlxcc_batch_rows_max", "Rows decoded together at most (1: not batched)",
                   report["max_batch"] if report and report["enabled"] else 1),
                  ("mlxcc_requests_running", "HTTP requests being handled", self.drain.count),
                  ("mlxcc_draining", "1 while the server drains before it stops", int(self.drain.draining)),
                  ("mlxcc_store_pending_writes", "Store writes waiting for an idle moment", len(w.store.pending)))  # fmt: skip
        for name, text, value in gauges:
            yield GaugeMetricFamily(name, text, value=value)
        stats = [(t.name, t.stats()) for t in w.store.tiers]
        for key, name, text, counter in TIER_STATS:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, text, labels=["tier"])
            for tier, s in stats:
                if s.get(key) is not None:
                    family.add_metric([tier], s[key])
            yield family


__all__ = ["ServerMetrics", "CONTENT_TYPE", "WORKER_COUNTERS", "TIER_STATS"]
