"""Continuous batching: the generation worker's loop when several jobs decode together.

Contract
--------
A :class:`BatchScheduler` attaches itself to a
:class:`~mlx_chatcache.server.worker.GenerationWorker` (``worker.batch``). It is
``enabled`` when ``max_batch`` > 1 and the model's cache can be batched
(:func:`~mlx_chatcache.generation.batch.batch_refusal`); otherwise ``reason`` says
why (logged once) and the worker runs jobs one at a time.

Enabled, :meth:`BatchScheduler.run` is the worker thread's loop (all MLX work
stays on it). Up to ``max_batch`` jobs are active at once. Each job is checked
out of the store and its uncached prompt, all but its last token, is fed by
:func:`~mlx_chatcache.generation.loop.prefill`, one chunk of
``prefill_step_size`` per tick, the first waiting prompt first; then its row
joins the :class:`~mlx_chatcache.generation.batch.DecodeBatch`. Each tick feeds
every row's token in one model call. A row emits exactly the events a job alone
emits (``start``, ``piece``, ``done``/``error``; :class:`~.worker.ChoiceOutput`),
and leaves the batch at once when it ends (stop token, stop string,
``max_tokens``, cancelled): its cache, prompt and reply but the last token, goes
into the store under its ``prompt_cache_key``, as a job alone puts it.

A job the batch cannot reproduce runs alone, as today, once the batch has
drained: ``n`` > 1 (its choices share one prefill), and a ``seed`` with a
temperature above 0 (a batch's rows draw from one random stream).
:meth:`BatchScheduler.report` is ``/health``'s ``batch``.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import ChatCacheError
from ..files.prompt_cache import PromptCache
from ..generation.batch import BatchRow, DecodeBatch, batch_refusal
from ..generation.loop import consistent_on_error, prefill
from ..generation.sample import make_logits_processors, make_sampler
from ..generation.text import as_tokenizer_wrapper, next_segment, stop_token_ids
from .worker import MAX_PENDING, ChoiceOutput, GenerationWorker, Job

log = logging.getLogger("mlxcc.serve")


@dataclass
class _Active:
    """A job in the batch: prefilling (``row`` None) or decoding."""

    job: Job
    state: PromptCache
    cached: int
    tier: str | None
    waited: float
    started: float
    out: ChoiceOutput
    detokenizer: object = None
    row: BatchRow | None = None
    first: float | None = None
    finish: str = "length"
    timing: dict = field(default_factory=dict)


class BatchScheduler:
    def __init__(self, worker: GenerationWorker, max_batch: int):
        self.worker, self.max_batch = worker, max_batch
        self.reason = "--max-batch is 1" if max_batch == 1 else batch_refusal(worker.model, worker.config)
        self.enabled = self.reason is None
        if not self.enabled:
            log.info("requests are generated one at a time: %s", self.reason)
        self.decode = DecodeBatch(worker.model)
        self.prefilling: list[_Active] = []
        self.decode_tok_s = 0.0
        self._held: Job | None = None  # a job that runs alone once the batch is empty
        self._stopping = False
        self._stops = stop_token_ids(as_tokenizer_wrapper(worker.tokenizer))
        worker.batch = self

    def report(self) -> dict:
        """``/health``'s ``batch``: whether rows are batched, why not, and what is active."""
        return {"enabled": self.enabled, "reason": self.reason, "max_batch": self.max_batch,
                "active_rows": len(self.decode), "prefilling": len(self.prefilling),
                "waiting": self.worker.waiting() + (self._held is not None),
                "decode_tok_s": round(self.decode_tok_s, 1)}  # fmt: skip

    @staticmethod
    def batchable(job: Job) -> bool:
        """Whether ``job`` gives in a batch what it gives alone (see the module docstring)."""
        return job.n == 1 and not (job.config.seed is not None and job.config.temp > 0)

    def _busy(self) -> bool:
        return bool(self.prefilling or self.decode.rows)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        w = self.worker
        while True:
            if not self._busy():
                w.stats["busy"] = False
                if self._held is not None:
                    job, self._held = self._held, None
                    w._serve(job)
                    w._flush(MAX_PENDING)
                    continue
                if self._stopping:
                    w._flush(0)  # every deferred cache file, before the process ends
                    return
                w._flush(0, until=lambda: not w._queue.empty())  # files, while no request waits
            self._admit()
            if self._busy():
                w.stats["busy"] = True
                self._prefill_tick()
                self._decode_tick()

    def _admit(self) -> None:
        """Start waiting jobs while there is room (wait for one when nothing is active)."""
        w = self.worker
        while self._held is None and not self._stopping and len(self.prefilling) + len(self.decode) < self.max_batch:
            try:
                job = w._queue.get_nowait() if self._busy() else w._queue.get()
            except queue.Empty:
                return
            if job is None:
                self._stopping = True
            elif job.cancelled:
                w.stats["cancelled"] += 1
            elif not self.batchable(job):
                self._held = job
            else:
                self._start(job)

    def _start(self, job: Job) -> None:
        w = self.worker
        waited = time.perf_counter() - job.submitted
        w.stats["queue_wait_s_total"] += waited
        w.stats["queue_wait_s_max"] = max(w.stats["queue_wait_s_max"], waited)
        started = time.perf_counter()
        try:
            state, cached, tier = w._checkout(job)
        except ChatCacheError as e:
            self._failed(job, e)
            return
        w._account(job, cached, tier)
        job.emit(("start", {"cached_tokens": cached, "cached_tier": tier, "queued_s": waited}))
        self.prefilling.append(_Active(job, state, cached, tier, waited, started, ChoiceOutput(w, job, 0)))

    # ------------------------------------------------------------------ ticks
    def _prefill_tick(self) -> None:
        """One prefill chunk of the first waiting prompt; its row joins the batch when it is fed."""
        if not self.prefilling:
            return
        a, w = self.prefilling[0], self.worker
        if a.job.cancelled:
            self.prefilling.pop(0)
            self._end(a, "cancelled")
            return
        todo = a.job.prompt[len(a.state.tokens) :]
        step = a.job.config.prefill_step_size
        last = len(todo) <= step + 1
        before = len(a.state.tokens)
        try:
            with consistent_on_error(a.state, w.model):
                prefill(w.model, a.state, todo if last else todo[:step], step, leave=1 if last else 0)
        except Exception as e:
            self.prefilling.pop(0)
            self._failed(a.job, e)
            return
        finally:
            w.stats["prompt_tokens_computed"] += max(len(a.state.tokens) - before, 0)
        if last:
            self.prefilling.pop(0)
            self._join(a)

    def _join(self, a: _Active) -> None:
        config, job = a.job.config, a.job
        processors = make_logits_processors(config) + (job.processors() if job.processors else [])
        sampler = make_sampler(config.temp, config.top_p, config.top_k, config.min_p, config.min_tokens_to_keep)
        a.detokenizer = as_tokenizer_wrapper(self.worker.tokenizer).detokenizer
        a.row = self.decode.join(BatchRow(a.state, job.prompt[-1], sampler, processors, owner=a))
        self.worker.stats["prompt_tokens_computed"] += 1  # the last prompt token, fed with the batch

    def _decode_tick(self) -> None:
        """One model call for every row; rows that end leave the batch and are stored."""
        if not self.decode.rows:
            return
        t = time.perf_counter()
        try:
            results = self.decode.step()
        except Exception as e:
            for row in self.decode.fail(self.worker.model):
                self._failed(row.owner.job, e)
            return
        now = time.perf_counter()
        rate = len(results) / max(now - t, 1e-9)
        self.decode_tok_s = rate if not self.decode_tok_s else 0.8 * self.decode_tok_s + 0.2 * rate
        ended = []
        for row, (token, logprobs) in zip(list(self.decode.rows), results):
            a = row.owner
            a.timing.setdefault("first", now)
            n = a.out.n + 1
            finish = "stop" if token in self._stops else "length" if n == a.job.config.max_tokens else None
            end = a.out.token(next_segment(a.detokenizer, token, self._stops, finish), token, logprobs, finish)
            if end:
                a.finish = end
                ended.append(row)
        if ended:
            self.decode.leave(ended)
            for row in ended:
                self._end(row.owner, row.owner.finish)

    # ------------------------------------------------------------------ endings
    def _end(self, a: _Active, finish: str) -> None:
        """Report a job's end to its client, then store its cache."""
        w, job = self.worker, a.job
        choice = a.out.close(finish)
        timing = {"queued_s": round(a.waited, 4), "first_token_s": round(a.timing.get("first", a.started) - a.started, 4),
                  "total_s": round(time.perf_counter() - a.started, 4)}  # fmt: skip
        w.stats["last_job"] = {**timing, "cached_tokens": a.cached, "prompt_tokens": len(job.prompt)}
        if finish == "cancelled":
            w.stats["cancelled"] += 1
        else:
            job.emit(("done", {"finish_reason": choice["finish_reason"], "prompt_tokens": len(job.prompt),
                               "completion_tokens": choice["completion_tokens"], "cached_tokens": a.cached,
                               "cached_tier": a.tier, "timing": timing, "choices": [choice]}))  # fmt: skip
        if a.state.tokens:
            w._put(a.state.tokens, a.state.cache, job.key)
        self._counted()
        w._flush(MAX_PENDING)

    def _failed(self, job: Job, e: Exception) -> None:
        w = self.worker
        w.stats["errors"] += 1
        if isinstance(e, ChatCacheError):
            job.emit(("error", str(e)))
        else:  # logged here, never shown to the client
            log.error("generation failed", exc_info=e)
            job.emit(("error", "internal error while generating; see the server log"))
        self._counted()

    def _counted(self) -> None:
        self.worker.stats.update(jobs=self.worker.stats["jobs"] + 1, peak_memory=mx.get_peak_memory(),
                                 active_memory=mx.get_active_memory())  # fmt: skip


__all__ = ["BatchScheduler"]
