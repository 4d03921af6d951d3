"""mlx-lm's batched generation API over our caches: :class:`BatchGenerator` and :func:`batch_generate`.

Contract
--------
The signatures and results are mlx-lm's (``mlx_lm.generate.BatchGenerator``,
``batch_generate``, ``StopSequences``); the machinery is the server's:
:class:`~mlx_chatcache.generation.batch.DecodeBatch` in mlx-lm's order (``keep_fed``)
decodes every generating sequence in one model call per step, and each prompt is fed
alone by :func:`~mlx_chatcache.generation.feed.prefill`, one chunk of at most
``prefill_step_size`` tokens per :meth:`BatchGenerator.next`, never across the end of a
segment (:meth:`BatchGenerator.insert_segments`).

- :meth:`BatchGenerator.insert` queues prompts (token ids), each with its ``max_tokens``,
  cache (a list of layers: copied, never updated in place; default a new one, with
  ``max_kv_size`` a window pinning no tokens, as mlx-lm's batch window pins none), the
  ``all_tokens`` that cache holds (its processors' context), sampler, logits processors and
  stop sequences; it checks them all before queueing any (ValueError) and returns the uids.
- :meth:`BatchGenerator.next` runs one step: a decode call for the generating sequences,
  then (while fewer than ``completion_batch_size`` generate) up to ``prefill_batch_size``
  queued prompts start, prompts fed to their last token join the decoding, and each prompt
  being fed gets one chunk. It returns ``(prompt responses, generation responses)``;
  :meth:`BatchGenerator.next_generated` steps until there are generation responses (or
  nothing is left: ``[]``).
- A generation response (:class:`GenerationStep`) carries the token, the log-probabilities it
  was sampled from (after the processors), and when the sequence ends (``"length"``, or
  ``"stop"``: its stop sequences matched) its ``prompt_cache`` (our one-sequence layers
  holding every token, the last one too, as mlx-lm's) and ``all_tokens`` (the tokens it holds
  that are known: ``all_tokens`` given, prompt, reply).
- :meth:`BatchGenerator.remove` drops sequences (their caches returned when asked);
  :meth:`BatchGenerator.stats` is a context manager whose :class:`BatchStats` counts the
  work done inside it (``prompt_time + decode_time + overhead_time == wall_time``).

Greedy sequences decode the tokens they decode alone (up to float rounding of batched
products). Model calls run on the generator's ``stream``
(:data:`~mlx_chatcache.generation.device.generation_stream` by default); on Metal the
wired-memory limit is raised until :meth:`BatchGenerator.close`.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx

from ..cache import BaseCache, copy_prompt_cache, make_prompt_cache
from ..files.prompt_cache import PromptCache
from .batch import BatchRow, DecodeBatch
from .device import generation_stream, wired_limit
from .feed import prefill
from .sample import LogitsProcessor, Sampler, greedy


class StopSequences:
    """Token sequences that end a generation (mlx-lm's class): ``matcher()`` gives one
    sequence's matcher, whose ``advance(token)`` is True when a stop sequence ends with it.
    An entry may be one token id; empty sequences are ignored."""

    class Matcher:
        def __init__(self, sequences: list[tuple[int, ...]]):
            self.sequences, self.recent = sequences, deque(maxlen=max((len(s) for s in sequences), default=1))

        def advance(self, token: int) -> bool:
            self.recent.append(int(token))
            tail = tuple(self.recent)
            return any(tail[len(tail) - len(s) :] == s for s in self.sequences if len(s) <= len(tail))

    def __init__(self, stop_sequences=None):
        seqs = [(s,) if isinstance(s, int) else tuple(int(t) for t in s) for s in (stop_sequences or ())]
        self.sequences = [s for s in seqs if s]

    def matcher(self) -> "StopSequences.Matcher":
        return self.Matcher(self.sequences)


@dataclass
class GenerationStep:
    """One sequence's token of a step (mlx-lm's ``GenerationBatch.Response``)."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    prompt_cache: list[BaseCache] | None
    all_tokens: list[int] | None


@dataclass
class PromptStep:
    """One prompt's progress in a step (mlx-lm's ``PromptProcessingBatch.Response``)."""

    uid: int
    progress: tuple[int, int]
    end_of_segment: bool
    end_of_prompt: bool


@dataclass
class BatchStats:
    """The work a :class:`BatchGenerator` did over an interval (mlx-lm's names)."""

    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_steps: int = 0
    decode_time: float = 0.0
    wall_time: float = 0.0
    peak_memory: float = 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generation_tokens / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def generation_time(self) -> float:
        return max(0.0, self.wall_time - self.prompt_time)

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_time if self.generation_time > 0 else 0.0

    @property
    def overhead_time(self) -> float:
        return self.wall_time - self.prompt_time - self.decode_time


_COUNTED = ("prompt_tokens", "prompt_time", "generation_tokens", "generation_steps", "decode_time")


@dataclass
class _Sequence:
    """A prompt from its insert to its end: what is left to feed, and how it generates."""

    uid: int
    segments: list[list[int]]  # prompt tokens not fed yet; the last segment is the last token alone
    max_tokens: int
    state: PromptCache
    base: int  # cache tokens not in state.tokens (a cache given without all its tokens)
    sampler: Sampler
    processors: tuple
    matcher: object
    total: int
    done: int = 0
    generated: int = 0
    row: BatchRow | None = field(default=None, repr=False)


class BatchGenerator:
    """Continuous batching with mlx-lm's signature (see the module docstring)."""

    def __init__(
        self,
        model,
        *,
        max_tokens: int = 128,
        stop_tokens=None,
        sampler: Sampler | None = None,
        logits_processors: Sequence[LogitsProcessor] | None = None,
        completion_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 2048,
        max_kv_size: int | None = None,
        stream=None,
    ):
        self.model, self.max_tokens, self.max_kv_size = model, max_tokens, max_kv_size
        self.sampler = sampler or greedy
        self.logits_processors = list(logits_processors or [])
        self.prefill_step_size, self.prefill_batch_size = prefill_step_size, prefill_batch_size
        self.completion_batch_size = max(completion_batch_size, prefill_batch_size)
        self._stream = stream or generation_stream
        self._stops = StopSequences(stop_tokens if stop_tokens else None)
        self._uid_count = 0
        self._unprocessed_sequences: deque[_Sequence] = deque()
        self._prompt_batch: list[_Sequence] = []
        self._batch = DecodeBatch(model, keep_fed=True)
        self._counters = BatchStats()
        self._wired = wired_limit(model)
        self._wired.__enter__()

    @property
    def stream(self):
        return self._stream

    @property
    def _currently_processing(self) -> list:
        """The prompts being fed: ``[segments left, tokens fed, tokens in all]`` each (mlx-lm's)."""
        return [[s.segments, s.done, s.total] for s in self._prompt_batch]

    def close(self) -> None:
        """Give back the wired-memory limit (Metal); the generator takes no more calls after."""
        if self._wired is not None:
            wired, self._wired = self._wired, None
            wired.__exit__(None, None, None)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    @contextlib.contextmanager
    def stats(self):
        """A :class:`BatchStats` of the work done while the block runs."""
        out = BatchStats()
        before, t0 = {k: getattr(self._counters, k) for k in _COUNTED}, time.perf_counter()
        try:
            yield out
        finally:
            for k in _COUNTED:
                setattr(out, k, getattr(self._counters, k) - before[k])
            out.wall_time = time.perf_counter() - t0
            out.peak_memory = mx.get_peak_memory() / 1e9

    # ------------------------------------------------------------------ queueing
    def insert(self, prompts, max_tokens=None, caches=None, all_tokens=None, samplers=None, logits_processors=None,
               stop_sequences=None) -> list[int]:  # fmt: skip
        """Queue ``prompts`` (lists of token ids); their uids (see the module docstring)."""
        return self.insert_segments([[p] for p in prompts], max_tokens, caches, all_tokens, samplers,
                                    logits_processors, stop_sequences)  # fmt: skip

    def insert_segments(self, segments, max_tokens=None, caches=None, all_tokens=None, samplers=None,
                        logits_processors=None, stop_sequences=None) -> list[int]:  # fmt: skip
        """Queue prompts given as segments: a prompt chunk never crosses a segment's end."""
        n = len(segments)
        options = {
            "max_tokens": max_tokens or [self.max_tokens] * n, "caches": caches or [None] * n,
            "all_tokens": all_tokens or [[] for _ in range(n)], "samplers": samplers or [None] * n,
            "logits_processors": logits_processors or [self.logits_processors] * n,
            "stop_sequences": stop_sequences or [self._stops] * n,
        }  # fmt: skip
        for name, values in options.items():
            if len(values) != n:
                raise ValueError(f"Option {name} must have one entry per segment: expected {n}, got {len(values)}.")
        made = []
        for i, (seq, m, cache, held, sampler, procs, stops) in enumerate(zip(segments, *options.values())):
            uid = self._uid_count + i
            seq = [[int(t) for t in s] for s in seq if len(s)]
            if not seq:
                raise ValueError(f"Sequence {uid} has an empty prompt.")
            if m <= 0:
                raise ValueError(f"Sequence {uid}'s max_tokens must be > 0.")
            if len(seq[-1]) != 1:
                seq = [*seq[:-1], *([seq[-1][:-1]] if len(seq[-1]) > 1 else []), seq[-1][-1:]]
            layers = copy_prompt_cache(cache) if cache is not None else make_prompt_cache(self.model, self.max_kv_size, 0)
            held = [int(t) for t in held]
            offset = max((c.offset for c in layers), default=0)
            state = PromptCache(layers, held[-offset:] if offset else [])
            made.append(_Sequence(uid, seq, m, state, offset - len(state.tokens), sampler or self.sampler,
                                  tuple(procs or ()), stops.matcher(), sum(len(s) for s in seq)))  # fmt: skip
        self._unprocessed_sequences.extend(made)
        self._uid_count += n
        return [s.uid for s in made]

    # ------------------------------------------------------------------ where sequences are
    def _find_uids(self, uids) -> dict[int, tuple[int, int]]:
        """``{uid: (stage, index)}``: stage 0 queued, 1 being fed its prompt, 2 generating."""
        uids, out = set(uids), {}
        for i, r in enumerate(self._batch.rows):
            if r.owner.uid in uids:
                out[r.owner.uid] = (2, i)
        for i, s in enumerate(self._prompt_batch):
            if s.uid in uids:
                out[s.uid] = (1, i)
        for i, s in enumerate(self._unprocessed_sequences):
            if s.uid in uids:
                out[s.uid] = (0, i)
        return out

    def extract_cache(self, uids) -> dict[int, tuple[list[BaseCache], list[int]]]:
        """``{uid: (layers, tokens)}``: copies of the sequences' caches as they are now."""
        out = {}
        for uid, (stage, i) in self._find_uids(uids).items():
            if stage < 2:
                s = (self._unprocessed_sequences[i] if stage == 0 else self._prompt_batch[i])
                out[uid] = (copy_prompt_cache(s.state.cache), list(s.state.tokens))
            else:
                out[uid] = self._batch.row_cache(self._batch.rows[i])
        return out

    def remove(self, uids, return_prompt_caches: bool = False) -> dict:
        """Drop the sequences ``uids``; their caches (as :meth:`extract_cache`) when asked."""
        found = self._find_uids(uids)
        caches = self.extract_cache(uids) if return_prompt_caches else {}
        gone = set(found)
        self._unprocessed_sequences = deque(s for s in self._unprocessed_sequences if s.uid not in gone)
        self._prompt_batch = [s for s in self._prompt_batch if s.uid not in gone]
        leaving = [r for r in self._batch.rows if r.owner.uid in gone]
        if leaving:
            self._batch.leave(leaving)
        return caches

    @property
    def prompt_cache_nbytes(self) -> int:
        queued = sum(c.nbytes for s in [*self._unprocessed_sequences, *self._prompt_batch] for c in s.state.cache)
        return queued + sum(c.nbytes for c in self._batch._layers or [])

    # ------------------------------------------------------------------ steps
    def next(self) -> tuple[list[PromptStep], list[GenerationStep]]:
        """One step (see the module docstring)."""
        with mx.stream(self._stream):
            return self._next()

    def next_generated(self) -> list[GenerationStep]:
        """Steps until some sequence generated a token; [] when nothing is left to do."""
        with mx.stream(self._stream):
            while True:
                prompts, generated = self._next()
                if generated or not prompts:
                    return generated

    def _next(self) -> tuple[list[PromptStep], list[GenerationStep]]:
        generated = self._decode() if self._batch.rows else []
        if len(self._batch) >= self.completion_batch_size:
            return [], generated
        room = min(self.prefill_batch_size - len(self._prompt_batch),
                   self.completion_batch_size - len(self._batch), len(self._unprocessed_sequences))  # fmt: skip
        for _ in range(max(room, 0)):
            self._prompt_batch.append(self._unprocessed_sequences.popleft())
        prompts = []
        for s in [s for s in self._prompt_batch if len(s.segments) == 1]:  # only its last token is left
            self._prompt_batch.remove(s)
            s.row = BatchRow(s.state, s.segments[0][0], s.sampler, s.processors, owner=s, base=s.base)
            self._batch.join(s.row)
            prompts.append(PromptStep(s.uid, (s.total, s.total), True, True))
        t = time.perf_counter()
        for s in self._prompt_batch:
            chunk = s.segments[0][: self.prefill_step_size]
            prefill(self.model, s.state, chunk, len(chunk), leave=0)
            s.segments[0] = s.segments[0][len(chunk) :]
            end = not s.segments[0]
            if end:
                s.segments.pop(0)
            s.done += len(chunk)
            self._counters.prompt_tokens += len(chunk)
            prompts.append(PromptStep(s.uid, (s.done, s.total), end, False))
        self._counters.prompt_time += time.perf_counter() - t
        return prompts, generated

    def _decode(self) -> list[GenerationStep]:
        t = time.perf_counter()
        rows = list(self._batch.rows)
        results = self._batch.step()
        out, ended = [], []
        for r, result in zip(rows, results):
            if result is None:  # joined after this step's call began
                continue
            if isinstance(result, Exception):
                raise result
            s, (token, logprobs) = r.owner, result
            s.generated += 1
            finish = "length" if s.generated >= s.max_tokens else None
            if s.matcher.advance(token):
                finish = "stop"
            out.append(GenerationStep(s.uid, token, logprobs, finish, None, None))
            if finish:
                ended.append((r, out[-1]))
        if ended:
            self._batch.leave([r for r, _ in ended])
            for r, step in ended:
                step.prompt_cache, step.all_tokens = r.state.cache, r.state.tokens
        self._counters.decode_time += time.perf_counter() - t
        self._counters.generation_tokens += len(out)
        self._counters.generation_steps += 1
        if self._counters.generation_steps % 512 == 0:
            mx.clear_cache()
        return out


@dataclass
class BatchResponse:
    """What :func:`batch_generate` returns (mlx-lm's)."""

    texts: list[str]
    stats: BatchStats
    caches: list[list[BaseCache]] | None
    token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None


def batch_generate(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    prompt_caches: Sequence[Sequence[BaseCache]] | None = None,
    max_tokens: int | Sequence[int] = 128,
    verbose: bool = False,
    return_prompt_caches: bool = False,
    return_token_ids: bool = False,
    return_logprobs: bool = False,
    *,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    completion_batch_size: int = 32,
    prefill_batch_size: int = 8,
    prefill_step_size: int = 2048,
    max_kv_size: int | None = None,
    stream=None,
) -> BatchResponse:
    """Generate a reply to each of ``prompts`` (token ids) together, as mlx-lm's ``batch_generate``:
    replies end at the tokenizer's EOS tokens (not in their text) or ``max_tokens`` (one for all,
    or one per prompt); ``prompt_caches`` are copied, not updated in place; the keyword-only
    arguments are :class:`BatchGenerator`'s."""
    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids], sampler=sampler,
                         logits_processors=logits_processors, completion_batch_size=completion_batch_size,
                         prefill_batch_size=prefill_batch_size, prefill_step_size=prefill_step_size,
                         max_kv_size=max_kv_size, stream=stream)  # fmt: skip
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    uids = gen.insert(prompts, limits, caches=prompt_caches)
    tokens = {u: [] for u in uids}
    logprobs = {u: [] for u in uids}
    caches, finished = {}, 0
    try:
        with gen.stats() as stats:
            while responses := gen.next_generated():
                for r in responses:
                    if r.finish_reason is not None:
                        caches[r.uid] = r.prompt_cache
                        finished += 1
                        if verbose:
                            print(f"[batch_generate] Finished processing {finished}/{len(uids)} ...", end="\r")
                    if r.finish_reason != "stop":
                        tokens[r.uid].append(r.token)
                        if return_logprobs:
                            logprobs[r.uid].append(r.logprobs[r.token].item())
    finally:
        gen.close()
    if verbose:
        print(f"[batch_generate] Finished processing {finished}/{len(uids)}")
        print(f"[batch_generate] Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec")
        print(f"[batch_generate] Generation: {stats.generation_tokens} tokens, "
              f"{stats.generation_tps:.3f} tokens-per-sec")  # fmt: skip
        print(f"[batch_generate] Peak memory: {stats.peak_memory:.3f} GB")
    return BatchResponse(
        [tokenizer.decode(tokens[u]) for u in uids], stats,
        [caches[u] for u in uids] if return_prompt_caches else None,
        [tokens[u] for u in uids] if return_token_ids else None,
        [logprobs[u] for u in uids] if return_logprobs else None,
    )  # fmt: skip


__all__ = ["StopSequences", "GenerationStep", "PromptStep", "BatchStats", "BatchGenerator", "BatchResponse",
           "batch_generate"]  # fmt: skip
