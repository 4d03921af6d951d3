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
every row's token in one model call. A row emits the events a job alone emits
(``start``, ``piece``, ``done``/``error``; :class:`~.worker.ChoiceOutput`; its
log-probabilities to float32 rounding, as a batch's products may round unlike
one row's), and leaves the batch at once when it ends (stop token, stop string,
``max_tokens``, cancelled): its cache, prompt and reply but the last token, goes
into the store under its ``prompt_cache_key``, as a job alone puts it.

A job with ``n`` > 1 choices is prefilled once; then each choice is a row on
its own copy of that cache (it waits while the batch has no room for all of
them). A row of a job with a ``seed`` draws from its own random stream, seeded
``seed + i`` for choice ``i``, as it draws alone. A job with more choices than
``max_batch`` runs alone once the batch has drained.

Speculative decoding: a job with a draft source (its config's ``prompt_lookup``, or a
model paired with a draft model; ``num_draft_tokens`` not 0; one choice; no grammar)
whose prompt is fed while no other job is active, prefilling or waiting decodes *alone*,
off the batch: each tick is one round of
:class:`~mlx_chatcache.generation.speculative.Speculator` (drafts verified in one model
call). When another job is about to join, the lone row joins the batch first (its cache
merged, its next token to feed) and decodes on without drafts, as every row in a batch
does: a batched call already reads the weights once for all rows. Greedy output is the
same either way (drafts never change a token). :meth:`BatchScheduler.report` is
``/health``'s ``batch``; its ``drafts`` says this, and counts the drafts.
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
from ..generation.run import Run
from ..generation.sample import make_distribution, make_logits_processors, make_sampler
from ..generation.speculative import Speculator, draft_source
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


@dataclass
class _Solo:
    """A job's one choice decoding alone with drafts: its speculator and the tokens to feed next."""

    a: _Active
    spec: Speculator
    pending: list[int]


SOLO_POLICY = ("a request with a draft source decodes alone, verifying its drafts, while no other request is "
               "active or waiting; in a batch it decodes without drafts")  # fmt: skip


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
        self._fed: list[tuple[Job, list[int], list]] = []  # prompts that joined, to store: (job, tokens, layers)
        self._stopping = False
        self._stops = stop_token_ids(as_tokenizer_wrapper(worker.tokenizer))
        self.solo: _Solo | None = None  # the job decoding alone with drafts
        worker.batch = self

    def report(self) -> dict:
        """``/health``'s ``batch``: whether rows are batched, why not, and what is active."""
        w = self.worker
        d = dict(w.drafts)
        drafts = {"policy": SOLO_POLICY, "refusal": w.speculation_refusal, "alone": self.solo is not None, **d,
                  "acceptance": round(d["accepted"] / d["drafted"], 3) if d["drafted"] else None}  # fmt: skip
        return {"enabled": self.enabled, "reason": self.reason, "max_batch": self.max_batch,
                "active_rows": len(self.decode) + (self.solo is not None), "prefilling": len(self.prefilling),
                "waiting": self.worker.waiting() + (self._held is not None),
                "decode_tok_s": round(self.decode_tok_s, 1), "drafts": drafts}  # fmt: skip

    def _alone(self, job: Job) -> bool:
        """Whether ``job`` runs alone: more choices than ``max_batch``."""
        return job.n > self.max_batch

    def _busy(self) -> bool:
        return bool(self.prefilling or self.decode.rows or self.solo)

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
        return len(self.decode) + (self.solo is not None) + sum(a.job.n for a in self.prefilling)

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
        """The job's choices join the batch: one row each, on copies of its prompt's cache
        (or its one choice decodes alone with drafts: see the module docstring)."""
        config, job, w = a.job.config, a.job, self.worker
        if len(a.state.tokens) > a.cached:  # stored once the next decode call runs (see _decode_tick)
            self._fed.append((job, list(a.state.tokens), list(a.state.cache)))
        if self.solo is not None:
            self._solo_joins()
        elif self._alone_with_drafts(a):
            return
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

    # ------------------------------------------------------------------ alone with drafts
    def _alone_with_drafts(self, a: _Active) -> bool:
        """Start ``a``'s one choice decoding alone with drafts when nothing else is active or waiting."""
        job, w = a.job, self.worker
        if (job.n != 1 or w.speculation_refusal or self.decode.rows or self.prefilling or self._held is not None
                or w.waiting()):  # fmt: skip
            return False
        c = job.config
        processors = make_logits_processors(c) + (job.processors() if job.processors else [])
        sampler = make_sampler(c.temp, c.top_p, c.top_k, c.min_p, c.min_tokens_to_keep, c.seed)
        distribution = make_distribution(c.temp, c.top_p, c.top_k, c.min_p, c.min_tokens_to_keep)
        run = Run(w.model, c, job.prompt, a.state, False, sampler, True, distribution, processors, None,
                  job.prompt[-1:], None, 0, None)  # fmt: skip
        source, k = draft_source(run, w.store.draft_index(w.scope_of(job)))
        spec = Speculator(run, source, k)
        if source is None or spec.stateful:
            return False
        source.start(a.state.tokens + run.rest)
        if c.seed is not None:  # the draws of the speculative-sampling rule, as a job alone seeds them
            mx.random.seed(c.seed)
        a.states = [a.state]
        a.outs.append(ChoiceOutput(w, job, 0))
        a.detokenizers.append(as_tokenizer_wrapper(w.tokenizer).detokenizer)
        w.stats["prompt_tokens_computed"] += 1  # the last prompt token, fed with the first drafts
        self.solo = _Solo(a, spec, list(run.rest))
        return True

    def _solo_joins(self) -> None:
        """The lone row joins the batch (before another job's rows do) and decodes on without drafts."""
        s, self.solo = self.solo, None
        s.spec.finish()  # a draft model's layers hold every token the model's do
        run = s.spec.run
        self.decode.join(BatchRow(s.a.state, s.pending[0], run.sampler, run.processors, owner=(s.a, 0)))

    def _solo_tick(self) -> None:
        """One round of the lone row: drafts verified in one model call; its tokens emitted."""
        s, w = self.solo, self.worker
        a, out, limit = s.a, s.a.outs[0], s.a.job.config.max_tokens
        t = time.perf_counter()
        stats: dict = {}
        try:
            with consistent_on_error(a.state, w.model):
                r = s.spec.round(s.pending, limit - out.n)
        except Exception as e:
            self.solo = None
            self._failed(a.job, e)
            return
        now = time.perf_counter()
        self._store_fed()
        stats.update(rounds=1, drafted=r.drafted, accepted=r.accepted)
        w.count_drafts(stats)
        rate = len(r.tokens) / max(now - t, 1e-9)
        self.decode_tok_s = rate if not self.decode_tok_s else 0.8 * self.decode_tok_s + 0.2 * rate
        a.timing.setdefault("first", now)
        base = len(a.state.tokens) - r.accepted
        for i, (token, logprobs) in enumerate(zip(r.tokens, r.logprobs)):
            n = out.n + 1
            finish = "stop" if token in self._stops else "length" if n == limit else None
            end = out.token(next_segment(a.detokenizers[0], token, self._stops, finish), token, logprobs, finish)
            if end:
                s.spec.trim_to(base + i)  # the state holds the tokens before this one
                s.spec.finish()
                self.solo, a.finishes[0] = None, end
                self._end(a, "cancelled" if end == "cancelled" else None)
                return
        s.pending = r.tokens[-1:]

    def _store_fed(self) -> None:
        """Prompts fed since the last model call: into the memory tier, for the prompts after them."""
        for job, tokens, cache in self._fed:
            self.worker._put(job, tokens, cache, memory_only=True)
        self._fed.clear()

    def _decode_tick(self) -> None:
        """One model call for every row; rows that end leave the batch and are stored."""
        if self.solo is not None:
            self._solo_tick()
            return
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
        self._store_fed()
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
                w._put(job, st.tokens, st.cache, ends=prompt_ends(job), hand_over=True)
        self._counted()
        w._flush(MAX_PENDING)

    def _failed(self, job: Job, e: Exception) -> None:
        w = self.worker
        w.stats["errors"] += 1
        if isinstance(e, ChatCacheError):
            job.emit(("error", str(e)))
        else:  # logged here, never shown to the client
            log.error("generation failed", exc_info=e, extra={"request_id": job.request_id})
            job.emit(("error", "internal error while generating; see the server log"))
        self._counted()

    def _counted(self) -> None:
        self.worker.stats.update(jobs=self.worker.stats["jobs"] + 1, peak_memory=mx.get_peak_memory(),
                                 active_memory=mx.get_active_memory())  # fmt: skip


__all__ = ["BatchScheduler"]
