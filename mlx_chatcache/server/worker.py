"""The generation worker: one thread that does all MLX work, fed by a queue.

Contract
--------
:class:`GenerationWorker` owns the model, the tokenizer's detokenizer use and
the :class:`~mlx_chatcache.store.PromptStore`. ``submit(job)`` enqueues a
:class:`Job` and returns at once (``QueueFull`` when ``max_queue`` jobs
wait); jobs run one at a time, in order (requests are queued, not batched).
A job reports through ``job.emit(event)``, called on the worker thread, with:

- ``("start", {"cached_tokens": n, "queued_s": s})`` once its prompt is
  ready to generate from (``n``: prompt tokens taken from the store, exact);
- ``("text", str)`` for each piece of reply text (stop strings held back
  until they can no longer match, and cut off when they do);
- ``("done", {"finish_reason", "prompt_tokens", "completion_tokens",
  "cached_tokens", "timing"})`` at the end (``timing``: seconds queued, from
  leaving the queue to the first token, and in all), or ``("error", message)``.

``job.cancel()`` (a client that went away) stops the job before it starts,
during its prompt (between prefill chunks) or between tokens. Whatever a job
fed is then put into the store, so the work is not lost.

Per job: the store's longest cached prefix is checked out and trimmed to the
prompt (``reuse_prefix``); for a chat whose cache cannot be trimmed back (SSM
or convolution layers, rotating windows) a checkpoint is taken at the end of
the last message, so the conversation's next turn or a retry finds its
prefix; the reply is generated with :func:`~mlx_chatcache.generate.stream_generate`;
afterwards the cache (prompt + reply) goes into the store, after the client
has its last event: into memory at once, into files (disk, remote) while no
other request waits, at most ``MAX_PENDING`` writes behind, all of them
before the worker stops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..config import GenerationConfig
from ..errors import ChatCacheError
from ..generation.loop import PrefillStopped, consistent_on_error, make_kv_quantizer, prefill
from ..generation.prompt import PromptCache, reuse_prefix
from ..generation.checkout import checkout_prompt, prompt_scope
from ..generation.stops import StopMatcher
from ..generation.text import stream_generate
from ..store.store import PromptStore
from ..store.tiers import Scope, compact_copy

log = logging.getLogger("mlxcc.serve")
MAX_PENDING = 4  # cache files whose writing may wait for an idle moment


class QueueFull(Exception):
    pass


class _Cancelled(Exception):
    pass


@dataclass
class Job:
    prompt: list[int]
    config: GenerationConfig
    emit: Callable[[tuple], None]
    stop: list[str] = field(default_factory=list)
    boundary: int | None = None  # prompt tokens up to the end of the last message (chat)
    key: str | None = None
    submitted: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class GenerationWorker:
    def __init__(self, model, tokenizer, store: PromptStore, config: GenerationConfig, max_queue: int):
        self.model, self.tokenizer, self.store, self.config = model, tokenizer, store, config
        self.scope: Scope = prompt_scope(model, config)  # model, cache settings, weight policy
        self._queue: queue.Queue[Job | None] = queue.Queue(max_queue)
        self._thread = threading.Thread(target=self._loop, name="mlxcc-generation", daemon=True)
        self.stats = {"jobs": 0, "cancelled": 0, "errors": 0, "busy": False, "peak_memory": 0,
                      "active_memory": 0, "queue_wait_s_total": 0.0, "queue_wait_s_max": 0.0}  # fmt: skip

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
        while True:
            job = self._queue.get()
            if job is None:
                self._flush(0)  # every deferred cache file, before the process ends
                return
            if job.cancelled:
                self.stats["cancelled"] += 1
                continue
            self.stats["busy"] = True
            try:
                self._run(job)
            except ChatCacheError as e:
                self.stats["errors"] += 1
                job.emit(("error", str(e)))
            except Exception:  # logged here, never shown to the client
                self.stats["errors"] += 1
                log.exception("generation failed")
                job.emit(("error", "internal error while generating; see the server log"))
            finally:
                self.stats.update(busy=False, jobs=self.stats["jobs"] + 1,
                                  peak_memory=mx.get_peak_memory(), active_memory=mx.get_active_memory())  # fmt: skip
            # cache files are written while no request waits; at most MAX_PENDING stay behind
            self._flush(0, until=lambda: not self._queue.empty())
            self._flush(MAX_PENDING)

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
        state, cached = self._checkout(job)
        checkpoint, timing = None, {}
        try:
            checkpoint = self._checkpoint(job, state)
            job.emit(("start", {"cached_tokens": cached, "queued_s": waited}))
            finish, n = self._generate(job, state, timing)
        except _Cancelled:
            finish, n = "cancelled", 0
        timing = {"queued_s": round(waited, 4), "first_token_s": round(timing.get("first", t0) - t0, 4),
                  "total_s": round(time.perf_counter() - t0, 4)}  # fmt: skip
        self.stats["last_job"] = {**timing, "cached_tokens": cached, "prompt_tokens": len(job.prompt)}
        if finish == "cancelled":
            self.stats["cancelled"] += 1
        else:
            job.emit(("done", {"finish_reason": finish, "prompt_tokens": len(job.prompt),
                               "completion_tokens": n, "cached_tokens": cached, "timing": timing}))  # fmt: skip
        if checkpoint is not None:
            self._put(job.prompt[: job.boundary], checkpoint, job.key)
        if state.tokens:
            self._put(state.tokens, state.cache, job.key)

    def _put(self, tokens, cache, key) -> None:
        """Store a cache; a failing tier (a full disk) is logged, the client has its reply."""
        try:
            self.store.put(self.scope, tokens, cache, key, defer=True)
        except (ChatCacheError, OSError) as e:
            self.stats["store_errors"] = self.stats.get("store_errors", 0) + 1
            log.warning("could not store a prompt cache: %s", e)

    def _checkout(self, job: Job) -> tuple[PromptCache, int]:
        """The longest stored prefix of the prompt, trimmed to it, and its length."""
        state, tier = checkout_prompt(self.store, self.scope, self.model, job.prompt, self.config.shape, job.key)
        return state, 0 if tier is None else reuse_prefix(state, job.prompt, self.model)

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
        return compact_copy(state.cache)

    def _progress(self, job: Job):
        def check(done: int, total: int) -> None:
            if job.cancelled:
                raise _Cancelled

        return check

    def _generate(self, job: Job, state: PromptCache, timing: dict) -> tuple[str, int]:
        stops = StopMatcher(job.stop)
        steps = stream_generate(self.model, self.tokenizer, job.prompt, state=state, config=job.config,
                                progress=self._progress(job))  # fmt: skip
        n, finish = 0, "length"
        try:
            for r in steps:
                n = r.generation_tokens
                timing.setdefault("first", time.perf_counter())
                text, hit = stops.feed(r.text)
                if text:
                    job.emit(("text", text))
                if hit:
                    return "stop", n
                if job.cancelled:
                    return "cancelled", n
                if r.finish_reason:
                    finish = r.finish_reason
                    break
        finally:
            steps.close()
        rest = stops.flush()
        if rest:
            job.emit(("text", rest))
        return finish, n
