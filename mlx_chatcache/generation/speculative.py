"""Speculative decoding: draft several tokens, verify them in one call of the model.

Contract
--------
A :class:`Speculator` runs rounds on one sequence of a prompt cache. A round takes the
tokens still to feed (``pending``: the prompt's last tokens, then the token the model
sampled last), asks its draft source (:mod:`.drafts`) for up to ``k`` tokens, feeds
``pending`` and the drafts to the model in one call, and decides from the logits, position
by position, which drafts the model accepts; then the model's own token at the first
position not accepted (or after the last draft). The cache's target layers are trimmed to
hold exactly ``pending`` and the accepted drafts (``state.tokens`` records them); the
returned tokens are the accepted drafts and the model's token, which is not fed yet.

The output is the model's, whatever the drafts:

- Greedy (``temp`` 0), a sampler the caller gave (its distribution unknown), or drafts
  that were chosen rather than drawn (prompt lookup, store drafts): the model's sampler
  draws a token at every position from the processed logits; a draft is accepted while it
  equals that token. The token returned at each position is always the model's own draw,
  so greedy output is token-identical to plain decoding (up to the float rounding of
  feeding several tokens in one call) and sampled output has the model's distribution.
- Drafts drawn from a draft model's distribution ``q`` under the model's own sampling
  settings (``p``, after temperature and filters): the speculative-sampling rule (Leviathan
  et al., Chen et al.): draft ``x`` is accepted with probability ``min(1, p(x) / q(x))``; at
  the first rejection the token is drawn from ``max(p - q, 0)`` renormalised, after the
  last draft from ``p``. Each returned token then has exactly the distribution plain
  sampling gives it.

Logits processors see, at each position, the context up to it (drafts included); a
processor that keeps state (``keeps_state``, a grammar's constraint) cannot be shown
contexts out of order, so no tokens are drafted under it. A round asks for up to ``k`` drafts:
the length doubles after a round whose drafts were all accepted and halves (not below 2)
after one that had a rejection. Drafts are limited so that every
layer can take the unaccepted ones back (``can_take_back``): a rotating window that is full
gets no drafts (each round is then a plain decode step). A cache with layers that can never
take tokens back (SSM/convolution ``ArraysCache``) is refused before anything is fed:
:func:`speculation_refusal` says why in one line.

:func:`speculative_generate_step` is the generator (mlx-lm's name and arguments): it
yields ``(token, logprobs, from_draft)``; the last token it yields is never fed (as
:mod:`.loop` says for an owned state, for every cache here), and a consumer that stops
early finds the state holding the tokens before the last one it took. The model calls run
on :data:`~mlx_chatcache.generation.device.generation_stream`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterator, Sequence

import mlx.core as mx

from ..cache import ArraysCache, BaseCache, CacheList
from ..config import DRAFT_MODEL_TOKENS, LOOKUP_DRAFT_TOKENS, GenerationConfig
from ..errors import UsageError
from ..files.prompt_cache import PromptCache
from ..models.draft_pair import DraftPair
from .arguments import call_config
from .device import generation_stream
from .drafts import NO_DRAFTS, DraftModel, Drafts, PromptLookup
from .feed import Progress
from .model_call import call_model
from .run import Run, prepare_run
from .sample import LogitsProcessor, Sampler
from .token_ids import vocab_size


def speculation_refusal(model) -> str | None:
    """Why speculative decoding cannot run on ``model``'s cache (None: it can)."""
    def leaves(cs):
        for c in cs:
            yield from leaves(c.caches) if isinstance(c, CacheList) else (c,)

    from ..cache import make_prompt_cache

    if any(isinstance(c, ArraysCache) for c in leaves(make_prompt_cache(model))):
        return ("speculative decoding is off for this model: its SSM/convolution layers (ArraysCache) cannot take "
                "rejected drafts back; generate without --draft-model/--prompt-lookup")  # fmt: skip
    return None


def draft_source(run: Run, draft_index=None, num_draft_tokens: int | None = None):
    """``(source, k)``: the draft source ``run`` asks for and how many tokens it drafts per
    round, or ``(None, 0)``: a model paired with a draft model drafts with it; else
    ``config.prompt_lookup`` ("prompt": the request's tokens; "store": then ``draft_index``,
    the store's index for the model); ``num_draft_tokens`` (default the config's, then the
    source's) 0 turns drafting off."""
    config = run.config
    k = config.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    if k == 0:
        return None, 0
    if isinstance(run.model, DraftPair):
        return DraftModel(run.model, run.state, run.sampler, run.distribution), k or DRAFT_MODEL_TOKENS
    if config.prompt_lookup == "off":
        return None, 0
    source = PromptLookup(config.lookup_ngram, index=draft_index if config.prompt_lookup == "store" else None)
    return source, k or LOOKUP_DRAFT_TOKENS


def next_length(length: int, k: int, accepted: int, drafted: int) -> int:
    """The next round's draft length after a round of ``drafted`` drafts, ``accepted`` of them:
    doubled (up to ``k``) when all were accepted, halved (down to 2) when one was not, so a source
    that keeps missing costs little more than plain decoding (``benchmarks/speculative.py --tune``)."""
    return min(k, 2 * length) if accepted == drafted else max(min(2, k), length // 2)


@dataclass
class Round:
    """What a round gave: ``tokens`` (the accepted drafts, then the model's own token),
    each one's ``logprobs`` ``(V,)``, ``accepted``, how many of them were drafts, and
    ``drafted``, how many tokens were drafted."""

    tokens: list[int]
    logprobs: list[mx.array]
    accepted: int
    drafted: int = 0


class Speculator:
    """Rounds of drafting and verifying on ``run``'s state (see the module docstring)."""

    def __init__(self, run: Run, source, k: int):
        self.run, self.source, self.k = run, source, k
        self.length = k  # drafts asked for next (next_length)
        model = run.model
        self.target = model.target if isinstance(model, DraftPair) else model
        self.split = model.split if isinstance(model, DraftPair) else len(run.state.cache)
        self.draft_layers = isinstance(model, DraftPair)
        self.stateful = any(getattr(p, "keeps_state", False) for p in run.processors)

    def _budget(self, pending: int, limit: int | None) -> int:
        """Drafts this round may have: at most ``k`` and ``limit``, and no more than every
        layer can take back after ``pending`` more tokens."""
        if self.source is None or self.stateful:
            return 0
        k = self.length if limit is None else min(self.length, limit)
        cache = self.run.state.cache
        if all(c.always_trimmable() for c in cache):
            return k
        behind = self.source.behind() if isinstance(self.source, DraftModel) else 0
        target, draft = cache[: self.split], cache[self.split :]
        while k > 0 and not (all(c.can_take_back(pending + k) for c in target)
                             and all(c.can_take_back(behind + k) for c in draft)):  # fmt: skip
            k -= 1
        return k

    def round(self, pending: list[int], limit: int | None) -> Round:
        """Feed ``pending`` and the drafts; the accepted tokens (see the module docstring). At
        most ``limit`` drafts (None: no limit); the calls run on the generation stream."""
        with mx.stream(generation_stream):
            return self._round(pending, limit)

    def _round(self, pending: list[int], limit: int | None) -> Round:
        run, state = self.run, self.run.state
        k = self._budget(len(pending), limit)
        drafts = self.source.propose(k) if k else NO_DRAFTS
        n = len(drafts)
        if drafts.tokens is not None:
            drafts = Drafts(drafts.tokens[:k])
            n = len(drafts.tokens)
            inputs: Sequence[int] | mx.array = list(pending) + drafts.tokens
        else:
            inputs = mx.concatenate([mx.array(pending, dtype=mx.uint32), drafts.array])[None]
        layers = state.cache[: self.split]
        logits = call_model(self.target, inputs, layers, sampled=drafts.tokens is None)[0, -(n + 1) :, :]
        if run.quantizer:
            run.quantizer(state.cache)
        draft_ids = drafts.tokens
        if draft_ids is None and run.processors:  # the processors' contexts need them on the host
            draft_ids = drafts.array.tolist()
        logprobs = self._processed(logits, list(pending), draft_ids or [])
        accepted, token, draft_ids = self._accept(logprobs, drafts, draft_ids)
        for c in state.cache[: self.split]:
            if n - accepted:
                c.trim(n - accepted)
        state.tokens.extend(pending)
        state.tokens.extend(draft_ids[:accepted])
        tokens = draft_ids[:accepted] + [token]
        if self.source is not None:
            self.source.advance(tokens, accepted)
        if n:
            self.length = next_length(self.length, self.k, accepted, n)
        return Round(tokens, [logprobs[i] for i in range(accepted + 1)], accepted, n)

    def _processed(self, logits: mx.array, pending: list[int], drafts: list[int]) -> mx.array:
        """Log-probabilities ``(n+1, V)`` after the processors, each position seeing its context."""
        processors = self.run.processors
        if processors:
            base = self.run.state.tokens + pending
            rows = []
            for i in range(logits.shape[0]):
                row, ctx = logits[i : i + 1], mx.array(base + drafts[:i], dtype=mx.uint32)
                for process in processors:
                    row = process(ctx, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _accept(self, logprobs: mx.array, drafts: Drafts, draft_ids: list[int] | None):
        """``(accepted, token, draft ids)`` by the rule the module docstring gives."""
        run, n = self.run, len(drafts)
        if n and drafts.logprobs is not None and run.distribution is not None:
            return self._accept_ratio(logprobs, drafts, draft_ids)
        drawn = run.sampler(logprobs)  # (n+1,): the model's own token at every position
        if draft_ids is None and n:
            mx.eval(drawn, drafts.array)
            draft_ids = drafts.array.tolist()
        drawn_ids, draft_ids = drawn.tolist(), draft_ids or []
        accepted = next((i for i in range(n) if draft_ids[i] != drawn_ids[i]), n)
        return accepted, drawn_ids[accepted], draft_ids

    def _accept_ratio(self, logprobs: mx.array, drafts: Drafts, draft_ids: list[int] | None):
        n = len(drafts)
        p = self.run.distribution(logprobs)  # (n+1, V) log-probabilities
        q = drafts.logprobs  # (n, V)
        ids = drafts.array if drafts.array is not None else mx.array(draft_ids, dtype=mx.uint32)
        idx = ids.astype(mx.int32)[:, None]
        p_x = mx.take_along_axis(p[:n], idx, axis=-1)[:, 0]
        q_x = mx.take_along_axis(q, idx, axis=-1)[:, 0]
        accept = mx.log(mx.random.uniform(shape=(n,))) < p_x - q_x  # u < p(x) / q(x)
        residual = mx.log(mx.maximum(mx.exp(p[:n]) - mx.exp(q), 0.0))  # -inf where q >= p
        fixes = mx.random.categorical(residual, axis=-1)  # (n,)
        bonus = mx.random.categorical(p[n:], axis=-1)  # (1,)
        mx.eval(accept, fixes, bonus, ids)
        accept, fixes, ids = accept.tolist(), fixes.tolist(), ids.tolist()
        accepted = next((i for i in range(n) if not accept[i]), n)
        return accepted, (fixes[accepted] if accepted < n else bonus.item()), ids

    def trim_to(self, n: int) -> None:
        """Make the state hold its first ``n`` tokens (``n`` at most what it holds)."""
        state = self.run.state
        extra = len(state.tokens) - n
        if extra > 0:
            for c in state.cache[: self.split]:
                c.trim(extra)
            del state.tokens[n:]

    def finish(self) -> None:
        """Make every layer hold exactly ``state.tokens`` (a draft model's layers catch up)."""
        if self.source is not None:
            self.source.finish(len(self.run.state.tokens))


def speculative_generate_step(
    prompt: Sequence[int] | mx.array,
    model,
    draft_model=None,
    stream=generation_stream,
    *,
    num_draft_tokens: int | None = None,
    max_tokens: int | None = None,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    prompt_cache: list[BaseCache] | PromptCache | None = None,
    prefill_step_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
    state: PromptCache | None = None,
    config: GenerationConfig | None = None,
    stop_tokens: Collection[int] = (),
    progress: Progress | None = None,
    max_call_seconds: float | None = None,
    draft_index=None,
    draft_stats: dict | None = None,
    drafts=None,
) -> Iterator[tuple[int, mx.array, bool]]:
    """Yield ``(token, logprobs (V,), from_draft)`` for up to ``max_tokens`` tokens, verifying
    drafted tokens several per model call (see the module docstring). ``draft_stats``: a dict
    that gets ``rounds`` (model calls after the prompt), ``drafted`` (tokens proposed) and
    ``accepted`` (drafts the model accepted), kept up to date as tokens are yielded.

    mlx-lm's arguments with its meaning: ``draft_model`` (its layers follow the model's in
    ``prompt_cache``: ``make_prompt_cache(model) + make_prompt_cache(draft_model)``; ``model``
    may instead be a :class:`~mlx_chatcache.models.draft_pair.DraftPair`), ``num_draft_tokens``
    (drafts per model call; 0: none), and those of
    :func:`~mlx_chatcache.generation.loop.generate_step`. Without a draft model, drafts come
    from ``config.prompt_lookup`` (``draft_index``: the store's index, for "store"); ``drafts``: a
    draft source of one's own (the protocol of :mod:`~mlx_chatcache.generation.drafts`), used
    instead, ``num_draft_tokens`` (default ``LOOKUP_DRAFT_TOKENS``) at a time.
    """
    config = call_config(
        config, max_tokens=max_tokens, prefill_step_size=prefill_step_size,
        kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
    )  # fmt: skip
    if draft_model is not None:
        model = DraftPair(model, draft_model)
    with mx.stream(stream):
        refusal = speculation_refusal(model)
        if refusal:
            raise UsageError(refusal)
        _check_pair(model)
        _check_layers(model, prompt_cache, state)
        run = prepare_run(prompt, model, config, sampler=sampler, logits_processors=logits_processors,
                          prompt_cache=prompt_cache, state=state, progress=progress,
                          max_call_seconds=max_call_seconds)  # fmt: skip
        if drafts is not None:
            source, k = drafts, num_draft_tokens or LOOKUP_DRAFT_TOKENS
        else:
            source, k = draft_source(run, draft_index, num_draft_tokens)
        stats = draft_stats if draft_stats is not None else {}
        stats.update(rounds=0, drafted=0, accepted=0)
        yield from _rounds(run, Speculator(run, source, k), stop_tokens, stats)


def _rounds(run: Run, spec: Speculator, stop_tokens: Collection[int], stats: dict) -> Iterator[tuple[int, mx.array, bool]]:
    state, limit = run.state, run.config.max_tokens
    if spec.source is not None:
        spec.source.start(state.tokens + run.rest)
    pending, n, keep = run.rest, 0, None
    try:
        while True:
            with run.guard():
                r = spec.round(pending, None if limit == -1 else limit - n)
            stats["rounds"] += 1
            stats["drafted"] += r.drafted
            stats["accepted"] += r.accepted
            base = len(state.tokens) - r.accepted  # the state holds base tokens before the first returned
            for i, (token, logprobs) in enumerate(zip(r.tokens, r.logprobs)):
                n += 1
                keep = base + i  # what the state holds while this token is the last one taken
                if n == 1 and run.progress:
                    run.progress(run.todo, run.todo)
                yield token, logprobs, i < r.accepted
                if token in stop_tokens or n == limit:
                    return
            keep = None
            pending = r.tokens[-1:]
            if n % 256 < len(r.tokens):
                mx.clear_cache()
    finally:
        if keep is not None:
            spec.trim_to(keep)
        spec.finish()


def _check_pair(model) -> None:
    if not isinstance(model, DraftPair):
        return
    t, d = vocab_size(model.target), vocab_size(model.draft)
    if t is not None and d is not None and d > t:
        raise UsageError(f"the draft model's vocabulary ({d} tokens) is larger than the model's ({t}); "
                         "use a draft model with the same tokenizer")  # fmt: skip


def _check_layers(model, prompt_cache, state) -> None:
    """UsageError when a given cache does not hold the layers ``model`` makes (a draft model's too)."""
    given = state if state is not None else prompt_cache
    if given is None:
        return
    layers = given.cache if isinstance(given, PromptCache) else list(given)
    want = len(model.make_cache()) if hasattr(model, "make_cache") else len(model.layers)
    if len(layers) != want:
        hint = (" (make_prompt_cache(model) + make_prompt_cache(draft_model))" if isinstance(model, DraftPair)
                else "")  # fmt: skip
        raise UsageError(f"the prompt cache holds {len(layers)} layers but the model makes {want}{hint}; "
                         "make the cache for the model and its draft model")  # fmt: skip


__all__ = ["Speculator", "Round", "next_length", "speculation_refusal", "draft_source", "speculative_generate_step"]
