"""Continuous batching: the generation worker's loop when several jobs decode together.

Contract
--------
A :class:`BatchScheduler` attaches itself to a
:class:`~mlx_chatcache.server.worker.GenerationWorker` (``worker.batch``). It is
``enabled`` when ``max_batch`` > 1 and the model's cache can be batched
(:func:`~mlx_chatcache.generation.batch.batch_refusal`); otherwise ``reason`` says
why (logged once) and the worker runs jobs one at a time.

Enabled, :meth:`BatchScheduler.run` is the worker thread's loop (all MLX work
stays on it). Up to ``max_batch`` jobs are active at once. Prompts are fed
one at a time, the first waiting prompt first: a job is checked out of the store
when its turn comes (so it reuses what the prompts fed before it stored), and its
uncached prompt, all but its last token, is fed by
:func:`~mlx_chatcache.generation.feed.prefill`, one chunk of
``prefill_step_size`` per tick. Its cache then goes into the store's memory
tier (concurrent requests sharing a system prompt pay for it once; files and
Redis get the request's final entry) and its row joins the
:class:`~mlx_chatcache.generation.batch.DecodeBatch`. Each tick feeds
every row's token in one model call. A row emits exactly the events a job alone
emits (``start``, ``piece``, ``done``/``error``; :class:`~.worker.ChoiceOutput`),
and leaves the batch at once when it ends (stop token, stop string,
``max_tokens``, cancelled): its cache, prompt and reply but the last token, goes
into the store under its ``prompt_cache_key``, as a job alone puts it.

A job with ``n`` > 1 choices is prefilled once; then each choice is a row on
its own copy of that cache (it waits while the batch has no room for all of
them). A row of a job with a ``seed`` draws from its own random stream, seeded
``seed + i`` for choice ``i``, as it draws alone. A job with more choices than
``max_batch`` runs alone once the batch has drained.
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
from ..generation.feed import consistent_on_error, prefill
from ..generation.sample import make_logits_processors, make_sampler
from ..generation.text import as_tokenizer_wrapper, next_segment, stop_token_ids
from ..cache import compact_copy
from .worker import MAX_PENDING, ChoiceOutput, GenerationWorker, Job, prompt_ends, choice_config

log = logging.getLogger("mlxcc.serve")


@dataclass
class _Active:
    """A job in the batch: waiting for its prompt's turn (``state`` None), prefilling, or decoding."""

    job: Job
    waited: float
    started: float
    state: PromptCache | None = None
    cached: int = 0
    tier: str | None = None
    states: list[PromptCache] = field(default_factory=list)  # one per choice, once decoding
    outs: list[ChoiceOutput] = field(default_factory=list)
    detokenizers: list = field(default_factory=list)
    finishes: dict[int, str] = field(default_factory=dict)  # the choices that ended
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
        self.decode_tok_s, self._ticks = 0.0, 0
        self._held: Job | None = None  # a job that runs alone once the batch is empty
        self._fed: list[tuple[list[int], list]] = []  # prompts that joined, to store: (tokens, layers)
        self._stopping = False
        self._stops = stop_token_ids(as_tokenizer_wrapper(worker.tokenizer))
        worker.batch = self

    def report(self) -> dict:
        """``/health``'s ``batch``: whether rows are batched, why not, and what is active."""
        return {"enabled": self.enabled, "reason": self.reason, "max_batch": self.max_batch,
                "active_rows": len(self.decode), "prefilling": len(self.prefilling),
                "waiting": self.worker.waiting() + (self._held is not None),
                "decode_tok_s": round(self.decode_tok_s, 1)}  # fmt: skip

    def _alone(self, job: Job) -> bool:
        """Whether ``job`` runs alone: more choices than ``max_batch``."""
        return job.n > self.max_batch

    def _busy(self) -> bool:
        return bool(self.prefilling or self.decode.rows)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        w = self.worker
        while True:
            if not self._busy():
                w.stats["busy"] = False
                if self._held is not None and self._alone(self._held):
                    job, self._held = self._held, None
                    w._serve(job)
                    w._flush(MAX_PENDING)
                    continue
                if self._stopping and self._held is None:
                    w._flush(0)  # every deferred cache file, before the process ends
                    return
                w._flush(0, until=lambda: not w._queue.empty() or self._held is not None)  # while none waits
            self._admit()
            if self._busy():
                w.stats["busy"] = True
                self._prefill_tick()
                self._decode_tick()

    def _admit(self) -> None:
        """Start waiting jobs while there is room (wait for one when nothing is active)."""
        w = self.worker
        if self._held is not None and not self._alone(self._held) and self._held.n <= self.max_batch - self._rows():
            job, self._held = self._held, None
            self._start(job)
        while self._held is None and not self._stopping and self._rows() < self.max_batch:
            try:
                job = w._queue.get_nowait() if self._busy() else w._queue.get()
            except queue.Empty:
                return
            if job is None:
                self._stopping = True
            elif job.cancelled:
                w.stats["cancelled"] += 1
            elif self._alone(job) or job.n > self.max_batch - self._rows():
                self._held = job  # alone once the batch drains, or when it has room for all its choices
            else:
                self._start(job)

    def _start(self, job: Job) -> None:
        w = self.worker
        waited = time.perf_counter() - job.submitted
        w.stats["queue_wait_s_total"] += waited
        w.stats["queue_wait_s_max"] = max(w.stats["queue_wait_s_max"], waited)
        self.prefilling.append(_Active(job, waited, time.perf_counter()))

    def _checkout(self, a: _Active) -> bool:
        """Check ``a``'s prompt out of the store and tell its client; False: it failed."""
        w = self.worker
        try:
            a.state, a.cached, a.tier = w._checkout(a.job)
        except ChatCacheError as e:
            self._failed(a.job, e)
            return False
        w._account(a.job, a.cached, a.tier)
        a.job.emit(("start", {"cached_tokens": a.cached, "cached_tier": a.tier, "queued_s": a.waited}))
        return True

    def _rows(self) -> int:
        """Rows decoding, and those the prefilling jobs' choices will take."""
        return len(self.decode) + sum(a.job.n for a in self.prefilling)

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
        if a.state is None and not self._checkout(a):
            self.prefilling.pop(0)
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
        """The job's choices join the batch: one row each, on copies of its prompt's cache."""
        config, job, w = a.job.config, a.job, self.worker
        if len(a.state.tokens) > a.cached:  # stored once the next decode call runs (see _decode_tick)
            self._fed.append((list(a.state.tokens), list(a.state.cache)))
        base = compact_copy(a.state.cache) if job.n > 1 else None
        copies = [PromptCache(compact_copy(base), list(a.state.tokens), a.state.shape) for _ in range(job.n - 1)]
        a.states = [a.state, *copies]
        for i, st in enumerate(a.states):
            processors = make_logits_processors(config) + (job.processors() if job.processors else [])
            c = choice_config(config, i)  # its own random stream, as choice i alone is seeded
            sampler = make_sampler(c.temp, c.top_p, c.top_k, c.min_p, c.min_tokens_to_keep, c.seed)
            a.outs.append(ChoiceOutput(w, job, i))
            a.detokenizers.append(as_tokenizer_wrapper(w.tokenizer).detokenizer)
            self.decode.join(BatchRow(st, job.prompt[-1], sampler, processors, owner=(a, i)))
            w.stats["prompt_tokens_computed"] += 1  # the last prompt token, fed with the batch

    def _decode_tick(self) -> None:
        """One model call for every row; rows that end leave the batch and are stored."""
        if not self.decode.rows:
            return
        t = time.perf_counter()
        try:
            results = self.decode.step()
        except Exception as e:
            for a in {id(row.owner[0]): row.owner[0] for row in self.decode.fail(self.worker.model)}.values():
                self._failed(a.job, e)
            return
        now = time.perf_counter()
        for tokens, cache in self._fed:  # prompts fed since the last tick: for the prompts after them
            self.worker._put(tokens, cache, None, memory_only=True)
        self._fed.clear()
        self._ticks += 1
        if self._ticks % 256 == 0:  # as a job alone does every 256 tokens
            mx.clear_cache()
        rate = sum(r is not None for r in results) / max(now - t, 1e-9)
        self.decode_tok_s = rate if not self.decode_tok_s else 0.8 * self.decode_tok_s + 0.2 * rate
        ended, failed = [], {}
        for row, result in zip(list(self.decode.rows), results):
            a, i = row.owner
            if result is None:  # joined after this step's call began
                continue
            if isinstance(result, Exception):
                failed[id(a)] = (a, result)
                continue
            token, logprobs = result
            a.timing.setdefault("first", now)
            out, n = a.outs[i], a.outs[i].n + 1
            finish = "stop" if token in self._stops else "length" if n == a.job.config.max_tokens else None
            end = out.token(next_segment(a.detokenizers[i], token, self._stops, finish), token, logprobs, finish)
            if end:
                a.finishes[i] = end
                ended.append(row)
        if failed:  # every row of a failed job leaves; nothing of it is stored
            ended = [r for r in ended if id(r.owner[0]) not in failed]
            self.decode.leave([r for r in self.decode.rows if id(r.owner[0]) in failed])
            for a, e in failed.values():
                self._failed(a.job, e)
        if ended:
            self.decode.leave(ended)
            for a in {id(row.owner[0]): row.owner[0] for row in ended}.values():
                if len(a.finishes) == len(a.states):
                    self._end(a, "cancelled" if "cancelled" in a.finishes.values() else None)

    # ------------------------------------------------------------------ endings
    def _end(self, a: _Active, finish: str | None) -> None:
        """Report a job's end to its client (``finish``: "cancelled", None: its choices'),
        then store its choices' caches."""
        w, job = self.worker, a.job
        choices = [out.close(finish or a.finishes[i]) for i, out in enumerate(a.outs)]
        first = a.timing.get("first", a.started) - a.started
        timing = {"queued_s": round(a.waited, 4), "first_token_s": round(first, 4),
                  "total_s": round(time.perf_counter() - a.started, 4)}  # fmt: skip
        w.stats["last_job"] = {**timing, "cached_tokens": a.cached, "prompt_tokens": len(job.prompt)}
        if finish == "cancelled":
            w.stats["cancelled"] += 1
        else:
            job.emit(("done", {"finish_reason": choices[0]["finish_reason"], "prompt_tokens": len(job.prompt),
                               "completion_tokens": sum(c["completion_tokens"] for c in choices),
                               "cached_tokens": a.cached, "cached_tier": a.tier, "timing": timing,
                               "choices": choices}))  # fmt: skip
        for st in a.states or ([a.state] if a.state else []):
            if st.tokens:
                w._put(st.tokens, st.cache, job.key, ends=prompt_ends(job))
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
