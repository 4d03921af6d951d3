"""The generation worker: one thread that does all MLX work, fed by a queue.

Contract
--------
:class:`GenerationWorker` owns the model, the tokenizer's detokenizer use and
the :class:`~mlx_chatcache.store.PromptStore`. ``submit(job)`` enqueues a
:class:`Job` and returns at once (``QueueFull`` when ``max_queue`` jobs
wait); jobs run one at a time, in order, unless a :class:`~.batch.BatchScheduler`
is attached and enabled: then its loop runs the jobs, several rows decoded together.
A job reports through ``job.emit(event)``, called on the worker thread, with:

- ``("start", {"cached_tokens": n, "cached_tier": t, "queued_s": s})`` once its
  prompt is ready to generate from (``n``: prompt tokens taken from the store,
  exact; ``t``: the tier they came from, "memory", "disk" or "redis", None when
  ``n`` is 0; a cache still waiting for its file write counts as "memory");
- ``("piece", Piece)`` for each piece of a choice's reply text (stop strings held
  back until they can no longer match, and cut off when they do), with the
  :class:`TokenLogprob` of the tokens sampled since the last piece when
  ``job.logprobs`` (the stop token itself has none);
- ``("done", {"finish_reason", "prompt_tokens", "completion_tokens",
  "cached_tokens", "cached_tier", "timing", "choices"})`` at the end (``finish_reason``: choice
  0's; ``completion_tokens``: all choices'; ``choices``: per choice ``index``,
  ``finish_reason``, ``completion_tokens``, the ``stop_sequence`` it stopped at (when one
  did), and with ``job.postprocess`` its
  ``content`` and ``tool_calls``; ``timing``: seconds queued, from leaving the
  queue to the first token, and in all), or ``("error", message)``. By then
  ``job.token_gaps`` holds the seconds between consecutive tokens of each choice.

With ``job.n`` > 1 the prompt is fed once (all but its last token) and each
choice ``i`` generates on its own copy of that cache, with seed ``seed + i``
when the config has a seed: choice ``i`` is what a one-choice job with that
seed gives (up to float rounding of the prompt's last token).
``stats["prompt_tokens_computed"]`` counts the prompt tokens the model was fed,
``stats["tokens_generated"]`` the tokens sampled (every choice's, cancelled jobs' too).

A job of a ``tenant`` (:mod:`.auth`) checks out and puts entries in that tenant's
scope alone (:meth:`GenerationWorker.scope_of`), pinned under ``tenant:key``.

``job.cancel()`` (a client that went away) stops the job before it starts,
during its prompt (between prefill chunks) or between tokens. Whatever a job
fed is then put into the store, so the work is not lost.

Per job: the store's longest cached prefix is checked out and trimmed to the
prompt (``reuse_prefix``); for a chat whose cache cannot be trimmed back (SSM
or convolution layers, rotating windows) a checkpoint is taken at the end of
the last message, so the conversation's next turn or a retry finds its
prefix; the reply is generated with :func:`~mlx_chatcache.generate.stream_generate`
(speculatively when the job's config asks for a draft source, unless the model's cache
cannot take drafts back: ``speculation_refusal``; ``drafts`` counts what they gave);
afterwards the cache (prompt + reply) goes into the store, after the client
has its last event: into memory at once, into files (disk, remote) while no
other request waits, at most ``MAX_PENDING`` writes behind, all of them
before the worker stops. ``served`` and ``history`` (:mod:`.history`) count
every job's prompt tokens and the cached ones, by tier, as it starts.

The worker's thread runs on its own generation stream and holds the wired-memory limit
for as long as it serves (:mod:`~mlx_chatcache.generation.device`: a Metal GPU keeps the
weights resident; elsewhere nothing changes), one job at a time or batched alike.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..config import SEED_LIMIT, GenerationConfig
from ..errors import ChatCacheError
from ..generation.device import generation_stream, wired_limit
from ..generation.feed import PrefillStopped, consistent_on_error, make_kv_quantizer, prefill
from ..files.prompt_cache import PromptCache
from ..generation.prompt import reuse_prefix
from ..generation.checkout import prompt_scope
from ..generation.sample import LogitsProcessor, make_logits_processors
from ..generation.stops import StopMatcher
from ..generation.speculative import speculation_refusal
from ..generation.text import stream_generate
from ..store.store import PromptStore
from ..cache import compact_copy
from ..store.store import Scope, tenant_scope
from .history import ServedTokens, StatsHistory

log = logging.getLogger("mlxcc.serve")
MAX_PENDING = 4  # cache files whose writing may wait for an idle moment


class QueueFull(Exception):
    pass


class _Cancelled(Exception):
    pass


@dataclass
class TokenLogprob:
    """A sampled token's log-probability in the distribution it was drawn from (the
    log-softmax after the logits processors), and the ``top`` most likely tokens there."""

    token: str  # the token's text, decoded alone
    id: int
    logprob: float
    top: list[tuple[str, int, float]]  # (text, id, logprob), most likely first
    offset: int  # characters of the choice's earlier tokens' texts


@dataclass
class Piece:
    """A piece of choice ``index``'s reply: its text and the logprobs of the tokens behind it."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Job:
    """One request for the worker. ``processors`` (when given) makes fresh extra logits
    processors for each choice, applied after the config's (a grammar's constraint);
    ``postprocess`` maps a choice's whole text to ``(content, tool_calls)`` (a tool-call
    parser; non-empty tool calls make the choice's finish reason "tool_calls")."""

    prompt: list[int]
    config: GenerationConfig
    emit: Callable[[tuple], None]
    stop: list[str] = field(default_factory=list)
    boundary: int | None = None  # prompt tokens up to the end of the last message (chat)
    key: str | None = None
    n: int = 1  # choices, each sampled on its own copy of the prompt's cache
    logprobs: bool = False  # emit each sampled token's TokenLogprob
    top_logprobs: int = 0  # with logprobs: how many of the most likely tokens each carries
    processors: Callable[[], list[LogitsProcessor]] | None = None
    postprocess: Callable[[str], tuple[str | None, list]] | None = None
    system_end: int | None = None  # prompt tokens of its leading system messages (chat; None: none)
    tenant: str | None = None  # whose store entries it uses (:mod:`.auth`; None: the shared ones)
    request_id: str | None = None  # the HTTP request's id, in the log lines about the job
    token_gaps: list[float] = field(default_factory=list)  # seconds between consecutive tokens of a choice
    marks: tuple[int, ...] = ()  # more prompt prefixes to serve exactly (cache breakpoints)
    submitted: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def pin(self) -> str | None:
        """The name its entries are pinned under: its key, within its tenant's."""
        if self.key is None or self.tenant is None:
            return self.key
        return f"{self.tenant}:{self.key}"

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


def choice_config(config: GenerationConfig, index: int) -> GenerationConfig:
    """The settings choice ``index`` generates with: a seed becomes ``seed + index``."""
    if index and config.seed is not None:
        return config.updated(seed=(config.seed + index) % SEED_LIMIT)
    return config


class GenerationWorker:
    def __init__(self, model, tokenizer, store: PromptStore, config: GenerationConfig, max_queue: int):
        self.model, self.tokenizer, self.store, self.config = model, tokenizer, store, config
        self.scope: Scope = prompt_scope(model, config)  # model, cache settings, weight policy
        self._scopes: dict[str, Scope] = {}  # per tenant
        self._queue: queue.Queue[Job | None] = queue.Queue(max_queue)
        self._thread = threading.Thread(target=self._loop, name="mlxcc-generation", daemon=True)
        self.batch = None  # a .batch.BatchScheduler, when one was attached
        self.served, self.history = ServedTokens(), StatsHistory()  # every job's prompt tokens and cached ones
        self.stats = {"jobs": 0, "cancelled": 0, "errors": 0, "busy": False, "peak_memory": 0,
                      "active_memory": 0, "queue_wait_s_total": 0.0, "queue_wait_s_max": 0.0,
                      "prompt_tokens_computed": 0, "tokens_generated": 0}  # fmt: skip
        # speculative decoding: why this model's cache cannot (None: it can), and what it gave
        self.speculation_refusal = speculation_refusal(model)
        self.drafts = {"rounds": 0, "drafted": 0, "accepted": 0}

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the running job, drop the waiting ones, stop the thread."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.emit(("error", "the server is shutting down"))
        self._queue.put(None)
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def waiting(self) -> int:
        return self._queue.qsize()

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        with wired_limit(self.model), mx.stream(generation_stream):
            self._serve_queue()

    def _serve_queue(self) -> None:
        if self.batch is not None and self.batch.enabled:
            self.batch.run()  # many jobs at a time (.batch)
            return
        while True:
            job = self._queue.get()
            if job is None:
                self._flush(0)  # every deferred cache file, before the process ends
                return
            self._serve(job)
            # cache files are written while no request waits; at most MAX_PENDING stay behind
            self._flush(0, until=lambda: not self._queue.empty())
            self._flush(MAX_PENDING)

    def _serve(self, job: Job) -> None:
        """Run one job alone, reporting its failure to its client."""
        if job.cancelled:
            self.stats["cancelled"] += 1
            return
        self.stats["busy"] = True
        try:
            self._run(job)
        except ChatCacheError as e:
            self.stats["errors"] += 1
            job.emit(("error", str(e)))
        except Exception:  # logged here, never shown to the client
            self.stats["errors"] += 1
            log.exception("generation failed", extra={"request_id": job.request_id})
            job.emit(("error", "internal error while generating; see the server log"))
        finally:
            self.stats.update(busy=False, jobs=self.stats["jobs"] + 1,
                              peak_memory=mx.get_peak_memory(), active_memory=mx.get_active_memory())  # fmt: skip

    def _flush(self, keep: int, until=None) -> None:
        try:
            self.store.flush(keep, until)
        except (ChatCacheError, OSError) as e:  # a full disk: logged, serving goes on
            self.stats["store_errors"] = self.stats.get("store_errors", 0) + 1
            log.warning("could not write a prompt cache file: %s", e)

    def _run(self, job: Job) -> None:
        waited = time.perf_counter() - job.submitted  # in the queue, behind other requests
        self.stats["queue_wait_s_total"] += waited
        self.stats["queue_wait_s_max"] = max(self.stats["queue_wait_s_max"], waited)
        t0 = time.perf_counter()
        state, cached, tier = self._checkout(job)
        self._account(job, cached, tier)
        checkpoint, timing, states, choices = None, {}, [state], []
        try:
            checkpoint = self._checkpoint(job, state)
            job.emit(("start", {"cached_tokens": cached, "cached_tier": tier, "queued_s": waited}))
            states = self._choice_states(job, state)
            for i, st in enumerate(states):
                choices.append(self._generate(job, st, timing, i))
                if choices[-1]["finish_reason"] == "cancelled":
                    break
            finish = "cancelled" if choices[-1]["finish_reason"] == "cancelled" else choices[0]["finish_reason"]
        except _Cancelled:
            finish = "cancelled"
        n = sum(c["completion_tokens"] for c in choices)
        timing = {"queued_s": round(waited, 4), "first_token_s": round(timing.get("first", t0) - t0, 4),
                  "total_s": round(time.perf_counter() - t0, 4)}  # fmt: skip
        self.stats["last_job"] = {**timing, "cached_tokens": cached, "prompt_tokens": len(job.prompt)}
        if finish == "cancelled":
            self.stats["cancelled"] += 1
        else:
            job.emit(("done", {"finish_reason": finish, "prompt_tokens": len(job.prompt), "completion_tokens": n,
                               "cached_tokens": cached, "cached_tier": tier, "timing": timing,
                               "choices": choices}))  # fmt: skip
        if checkpoint is not None:
            self._put(job, job.prompt[: job.boundary], checkpoint)
        for st in states[: max(len(choices), 1)]:  # the copies of choices never started hold nothing new
            if st.tokens:
                self._put(job, st.tokens, st.cache, ends=prompt_ends(job), hand_over=True)

    def _choice_states(self, job: Job, state: PromptCache) -> list[PromptCache]:
        """The state each choice generates on: ``state`` itself for one choice; for more,
        ``state`` fed all of the prompt but its last token, then copies of it."""
        if job.n == 1:
            return [state]
        before = len(state.tokens)  # a prefix of the prompt (checkout, checkpoint)
        try:
            with consistent_on_error(state, self.model):
                prefill(self.model, state, job.prompt[before:], job.config.prefill_step_size, leave=1,
                        kv_quantizer=make_kv_quantizer(job.config), should_stop=lambda: job.cancelled)  # fmt: skip
        except PrefillStopped:  # the chunks fed so far are in the state
            raise _Cancelled from None
        finally:
            self.stats["prompt_tokens_computed"] += max(len(state.tokens) - before, 0)
        base = compact_copy(state.cache)
        copies = [compact_copy(base) for _ in range(job.n - 2)] + [base]
        return [state] + [PromptCache(c, list(state.tokens), state.shape) for c in copies]

    def scope_of(self, job: Job) -> Scope:
        """The store scope of ``job``'s entries: its tenant's, or the shared one."""
        if job.tenant is None:
            return self.scope
        if job.tenant not in self._scopes:
            self._scopes[job.tenant] = tenant_scope(self.scope, job.tenant)
        return self._scopes[job.tenant]

    def _put(self, job: Job, tokens, cache, memory_only: bool = False, ends=(), hand_over: bool = False) -> None:
        """Store a cache of ``job`` in its scope, pinned under its key unless ``memory_only``
        (then in the memory tier alone; ``ends``: shorter prefixes served exactly too;
        ``hand_over``: the job is done with ``cache``, the store may serve it as it is); a
        failing tier (a full disk) is logged, the client has its reply."""
        try:
            self.store.put(self.scope_of(job), tokens, cache, None if memory_only else job.pin, defer=True,
                           memory_only=memory_only, ends=ends, hand_over=hand_over)  # fmt: skip
        except (ChatCacheError, OSError) as e:
            self.stats["store_errors"] = self.stats.get("store_errors", 0) + 1
            log.warning("could not store a prompt cache: %s", e, extra={"request_id": job.request_id})

    def _checkout(self, job: Job) -> tuple[PromptCache, int, str | None]:
        """The longest stored prefix of the prompt, trimmed to it, its length and
        the tier it came from (None: no token did)."""
        state, tier = self.store.checkout(self.scope_of(job), self.model, job.prompt, self.config.shape)
        cached = 0 if tier is None else reuse_prefix(state, job.prompt, self.model)
        return state, cached, ("memory" if tier == "pending" else tier) if cached else None

    def _account(self, job: Job, cached: int, tier: str | None) -> None:
        """Count the job's prompt tokens and the cached ones; sample the totals (GET /v1/store)."""
        self.served.count(len(job.prompt), cached, tier)
        self.history.sample(self.served.totals())

    def _checkpoint(self, job: Job, state: PromptCache):
        """Feed the prompt up to the end of its last message and copy the cache
        there, when the cache could not be trimmed back to it later."""
        b = job.boundary
        if b is None or not 0 < b < len(job.prompt) or len(state.tokens) >= b:
            return None
        if all(c.always_trimmable() for c in state.cache):
            return None
        todo = job.prompt[len(state.tokens) : b]
        try:
            with consistent_on_error(state, self.model):
                prefill(self.model, state, todo, self.config.prefill_step_size, leave=0,
                        kv_quantizer=make_kv_quantizer(job.config), should_stop=lambda: job.cancelled)  # fmt: skip
        except PrefillStopped:  # the chunks fed so far are in the state
            raise _Cancelled from None
        finally:
            self.stats["prompt_tokens_computed"] += max(len(state.tokens) - (b - len(todo)), 0)
        return compact_copy(state.cache)

    def _progress(self, job: Job):
        def check(done: int, total: int) -> None:
            if job.cancelled:
                raise _Cancelled

        return check

    def _generate(self, job: Job, state: PromptCache, timing: dict, index: int) -> dict:
        """Generate choice ``index`` on ``state``, emitting its pieces; its entry of ``done["choices"]``."""
        config = choice_config(job.config, index)
        processors = make_logits_processors(config) + (job.processors() if job.processors else [])
        drafts: dict = {}
        steps = stream_generate(self.model, self.tokenizer, job.prompt, state=state, config=config,
                                logits_processors=processors, progress=self._progress(job),
                                num_draft_tokens=0 if self.speculation_refusal else None,
                                draft_index=self.store.draft_index(self.scope_of(job)), draft_stats=drafts)  # fmt: skip
        out, finish = ChoiceOutput(self, job, index), "length"
        try:
            for r in steps:
                if out.n == 0:
                    self.stats["prompt_tokens_computed"] += r.prompt_tokens - r.reused_tokens
                timing.setdefault("first", time.perf_counter())
                end = out.token(r.text, r.token, r.logprobs, r.finish_reason)
                if end:
                    finish = end
                    break
        finally:
            steps.close()
            self.count_drafts(drafts)
        return out.close(finish)

    def count_drafts(self, drafts: dict) -> None:
        """Add one generation's ``draft_stats`` to :attr:`drafts` (``/health``'s)."""
        for k, v in drafts.items():
            self.drafts[k] += v

    def _logprob(self, token: int, logprobs: mx.array, top: int, offset: int) -> TokenLogprob:
        """``token``'s :class:`TokenLogprob` in ``logprobs`` ``(V,)``, with the ``top`` most likely tokens."""
        best = []
        if top > 0:
            k = min(top, logprobs.shape[-1])
            ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
            pairs = sorted(zip(logprobs[ids].tolist(), ids.tolist()), key=lambda p: (-p[0], p[1]))
            best = [(self.tokenizer.decode([i]), i, lp) for lp, i in pairs]
        return TokenLogprob(self.tokenizer.decode([token]), token, logprobs[token].item(), best, offset)


def prompt_ends(job: Job) -> tuple[int, ...]:
    """The prefixes of a job's stored cache served exactly besides all of it: its prompt
    (the next turn starts with it, however it spells this reply), its prompt but the last
    token (what the same prompt asked again reuses), its system prompt (what other
    conversations share) and its marks (a client's cache breakpoints)."""
    return tuple(e for e in (job.system_end, *job.marks, len(job.prompt) - 1, len(job.prompt)) if e)


class ChoiceOutput:
    """Choice ``index`` of ``job`` as its tokens come (one job alone or a batch row): its
    logprobs, stop strings and pieces, emitted as the module docstring says."""

    def __init__(self, worker: GenerationWorker, job: Job, index: int):
        self.worker, self.job, self.index = worker, job, index
        self.stops, self.n, self.text, self.offset, self.pending = StopMatcher(job.stop), 0, [], 0, []
        self._last: float | None = None  # when its last token came

    def token(self, text: str, token: int, logprobs: mx.array, finish_reason: str | None) -> str | None:
        """Take a sampled token, its text and ``logprobs`` ``(V,)``; the reason the choice ends
        here ("stop", "length", "cancelled"), None when it goes on."""
        self.n += 1
        self.worker.stats["tokens_generated"] += 1
        now = time.perf_counter()
        if self._last is not None:
            self.job.token_gaps.append(now - self._last)
        self._last = now
        job = self.job
        if job.logprobs and finish_reason != "stop":  # the stop token is no part of the reply
            self.pending.append(self.worker._logprob(token, logprobs, job.top_logprobs, self.offset))
            self.offset += len(self.pending[-1].token)
        piece, hit = self.stops.feed(text)
        self._send(piece)
        if hit:
            return "stop"
        if job.cancelled:
            return "cancelled"
        return finish_reason

    def close(self, finish: str) -> dict:
        """The choice's entry of ``done["choices"]`` (text held back is sent first, unless cancelled)."""
        if finish != "cancelled":
            self._send(self.stops.flush())
        choice = {"index": self.index, "finish_reason": finish, "completion_tokens": self.n}
        if self.stops.matched is not None:
            choice["stop_sequence"] = self.stops.matched
        if self.job.postprocess is not None and finish != "cancelled":
            choice["content"], choice["tool_calls"] = self.job.postprocess("".join(self.text))
            if choice["tool_calls"]:
                choice["finish_reason"] = "tool_calls"
        return choice

    def _send(self, piece: str) -> None:
        if piece or self.pending:
            self.job.emit(("piece", Piece(self.index, piece, list(self.pending))))
            self.pending.clear()
        if piece:
            self.text.append(piece)
