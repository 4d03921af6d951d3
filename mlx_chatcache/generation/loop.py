"""Text generation on a prompt cache that is reused from one call to the next.

Layers, each usable on its own (lowest first):

1. :class:`~mlx_chatcache.files.prompt_cache.PromptCache` holds a prompt cache
   (one cache per layer) and ``tokens``, the token ids that cache has been fed,
   in order; :func:`~mlx_chatcache.generation.prompt.reuse_prefix` reduces it to
   the longest part of a new prompt it already holds (both in
   :mod:`mlx_chatcache.generation.prompt`).
2. :func:`~mlx_chatcache.generation.feed.prefill` feeds all prompt tokens but
   the last few, in chunks, and records them in the state (see
   :mod:`mlx_chatcache.generation.feed`, also for
   :func:`~mlx_chatcache.generation.feed.consistent_on_error`);
   :func:`~mlx_chatcache.generation.run.prepare_run` sets a call up with it.
3. :func:`generate_step` yields ``(token, logprobs)`` pairs. While decoding
   it computes one token ahead (see below).
   :func:`~mlx_chatcache.generation.speculative.speculative_generate_step`
   yields ``(token, logprobs, from_draft)``, verifying drafted tokens several
   at a time (see :mod:`mlx_chatcache.generation.speculative`).
4. :func:`~mlx_chatcache.generation.text.stream_generate` yields
   ``GenerationResponse`` text segments with statistics, and
   :func:`~mlx_chatcache.generation.text.generate` returns the whole text (both
   in :mod:`mlx_chatcache.generation.text`).

What ``state.tokens`` holds
---------------------------
After a call (and at every point a call yields), ``state.tokens`` is exactly
the sequence the cache has been fed, so ``len(state.tokens)`` equals the cache
offset. A rotating cache holds only its window of that sequence, but its
content is still determined by the whole sequence. **The last token a call
yields is never fed**: after a reply ``r1..rn`` (``rn`` may be the EOS token)
to prompt ``p``, ``state.tokens == p + r1..r(n-1)``. Why:

- The next turn's prompt repeats ``p + r1..rn`` and then adds more, so it
  extends ``state.tokens``. Everything is reused without trimming, which
  matters for caches that cannot be trimmed (a rotating cache past its window,
  SSM/conv ``ArraysCache`` layers). ``rn`` then becomes the first token of the
  next turn to feed, and a turn always has at least one token to feed, which
  the model needs to produce logits.
- Feeding ``rn`` now would cost a forward pass whose logits nobody uses.

Feeding ahead
-------------
To keep the machine busy while the consumer handles token ``k``,
:func:`generate_step` feeds token ``k`` and starts computing token ``k+1``
*before* it yields token ``k`` (as mlx-lm does), without knowing yet whether
``k`` ends the reply. It does so only when this can be undone: every layer can
take the token back (``can_take_back(1)``, see :mod:`mlx_chatcache.cache.cache_base`:
not an ``ArraysCache``/SSM layer, not a rotating window about to drop a token), and there are no logits processors
(they would see a context that is not known yet). Not for the first token
either: with MLX on the CPU, reading a token while the next step is queued
waits for much of that step, which would add about one decode step to the
time to the first token. Then (``k >= 2``):

- Token ``k`` is recorded in ``state.tokens`` before it is yielded, so at
  every yield ``state.tokens`` is still exactly what the cache has been fed.
- Token ``k`` is never fed ahead when it is the ``max_tokens``-th. When it is
  a stop token it is trimmed back off before it is yielded, and MLX's random
  key is put back to what it was, so a call that ends normally leaves the
  state, and the random generator, as the synchronous loop would: the reply's
  tokens and the state above do not depend on whether tokens were fed ahead.
- A consumer that stops early (a stop string, Ctrl-C between tokens) after
  token ``k`` finds ``k`` fed and recorded (``prompt + r1..rk``; trim it off
  with :func:`~mlx_chatcache.generation.prompt.trim_state` to get the usual
  ``prompt + r1..r(k-1)``), and the
  random key advanced by the draw of token ``k+1``.

Otherwise (untrimmable layers, processors) the loop is synchronous: token
``k`` is fed only when the consumer asks for token ``k+1``, and a consumer
that stops early leaves a state holding only tokens it accepted, minus the
last one.

Every model call goes through :func:`~mlx_chatcache.generation.model_call.call_model`,
which raises :class:`~mlx_chatcache.errors.CacheNotUpdatedError` when a layer's
cache did not take the tokens (a model that does not use our cache: its
replies would be wrong) and :class:`~mlx_chatcache.errors.TokenIdError` for an
id the model does not have (the prompt's are checked before the state is
touched; a token fed ahead is not waited for when the config's sampler drew it).

If a model call raises (KeyboardInterrupt included), some layers may have been
updated and others not. :func:`generate_step` then resets the state to an empty
cache of the same shape (``tokens == []``) before the exception propagates
(:func:`~mlx_chatcache.generation.feed.consistent_on_error` with ``trim_back=False``).

The loop's model calls and sampling run on
:data:`~mlx_chatcache.generation.device.generation_stream` (``stream``), as mlx-lm's do.

Cache shape and settings
------------------------
A state keeps the window it was made with (``state.shape``: ``max_kv_size``
and ``keep``). ``GenerationConfig.max_kv_size``/``keep`` are used only to
make a new state. A non-None ``config.max_kv_size`` that differs from the
shape of a given state raises :class:`UsageError`. KV quantization
(``kv_bits``, ``kv_group_size``, ``quantized_kv_start``) follows the config of
each call. Float K/V layers are converted in place once they hold
``quantized_kv_start`` tokens. ``config.seed`` (when not None) seeds MLX's
random generator at the start of each call. All defaults come from
:data:`DEFAULTS`.
"""

from __future__ import annotations

from typing import Collection, Iterator, Sequence

import mlx.core as mx

from ..cache import BaseCache
from ..config import GenerationConfig
from ..files.prompt_cache import PromptCache
from .arguments import call_config
from .device import generation_stream
from .feed import KVQuantizer, Progress
from .model_call import call_model
from .prompt import trim_state
from .run import Run, prepare_run
from .sample import LogitsProcessor, Sampler


def sample_token(
    logits: mx.array, context: Sequence[int], sampler: Sampler, processors: Sequence[LogitsProcessor]
) -> tuple[mx.array, mx.array]:
    """Process ``logits`` ``(1, V)`` given the ``context``; sample one token.

    Returns the token ``(1,)`` and the log-probabilities ``(1, V)`` it was
    drawn from (after the processors).
    """
    if processors:
        ctx = mx.array(context, dtype=mx.uint32)  # (T,)
        for process in processors:
            logits = process(ctx, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (1, V)
    return sampler(logprobs), logprobs


# ------------------------------------------------------------------ generate_step
def _start_step(
    model,
    state: PromptCache,
    inputs: Sequence[int] | mx.array,
    sampler: Sampler,
    processors: Sequence[LogitsProcessor],
    kv_quantizer: KVQuantizer | None,
    sampled: bool = False,
    embeddings: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Feed ``inputs`` (ids, or an array ``(1, T)``; ``sampled``: see
    :func:`~mlx_chatcache.generation.model_call.call_model`; ``embeddings`` ``(T, D)``: fed in
    place of their embeddings) and start computing the next token.

    Returns the token ``(1,)`` and its log-probabilities ``(1, V)``, being
    evaluated in the background. The caller records the fed tokens in
    ``state.tokens`` (the processors see them there as the context).
    """
    emb = None if embeddings is None else embeddings[None]
    logits = call_model(model, inputs, state.cache, sampled=sampled, input_embeddings=emb)[:, -1, :]  # (1, V)
    if kv_quantizer:
        kv_quantizer(state.cache)
    token, logprobs = sample_token(logits, state.tokens, sampler, processors)
    # the fed K/V are inputs of the logits, so computed with them; quantized
    # layers replaced after the forward pass are not, and are evaluated too
    mx.async_eval(token, logprobs, [c.eval_arrays() for c in state.cache] if kv_quantizer else [])
    return token, logprobs


def _take_back_one(state: PromptCache, model, layers: list[BaseCache]) -> None:
    """Unfeed the last token (checked possible by ``can_take_back``).

    ``layers`` are the cache's layers before that token was fed: the model
    updated them in place, but KV quantization may have replaced some since;
    the float layers are put back, so the state is what it was, token aside.
    """
    state.cache[:] = layers
    if not trim_state(state, len(state.tokens) - 1):
        state.reset(model)  # not reached with this package's caches


def _restore_random_key(key: mx.array) -> None:
    """Make ``key`` (an earlier ``mx.random.state[0]``) MLX's random key again."""
    hi, lo = key.tolist()
    mx.random.seed((hi << 32) | lo)  # mx.random.key(s) is [s >> 32, s & 0xffffffff]


def generate_step(
    prompt: Sequence[int] | mx.array,
    model,
    stream=generation_stream,
    *,
    max_tokens: int | None = None,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    max_kv_size: int | None = None,
    prompt_cache: list[BaseCache] | PromptCache | None = None,
    prefill_step_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
    prompt_progress_callback: Progress | None = None,
    input_embeddings: mx.array | None = None,
    state: PromptCache | None = None,
    config: GenerationConfig | None = None,
    stop_tokens: Collection[int] = (),
    progress: Progress | None = None,
    max_call_seconds: float | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Yield ``(token, logprobs (V,))`` for up to ``config.max_tokens`` tokens (-1: no limit).

    A prompt id the model does not have raises
    :class:`~mlx_chatcache.errors.TokenIdError` before ``state`` is touched.
    Reuses what ``state`` holds of the prompt (see :func:`~mlx_chatcache.generation.run.prepare_run`
    for the cache a call works on), feeds the rest, then samples. It stops after yielding a token in
    ``stop_tokens`` or the ``max_tokens``-th token; that last token is not fed
    (see the module docstring, also for when a token is fed ahead).
    ``sampler``/``logits_processors`` default to those the config describes.
    ``progress`` gets ``(done, total)`` over the prompt tokens that are not
    reused, ending with ``(total, total)``. ``max_call_seconds``: the prompt's
    calls are paced to take about that long at most, so Ctrl-C is acted upon (see
    :func:`~mlx_chatcache.generation.feed.prefill`).

    mlx-lm's arguments are accepted with its meaning: ``stream`` (the stream model calls run
    on), ``max_tokens``, ``max_kv_size``, ``prefill_step_size``, ``kv_bits``, ``kv_group_size``,
    ``quantized_kv_start`` override ``config`` when given; ``prompt_progress_callback`` is
    ``progress``; ``prompt_cache`` is ``state`` when a :class:`PromptCache`, and when a list of
    layers (made by :func:`~mlx_chatcache.cache.make_prompt_cache`) the prompt is
    appended to what they hold, no prefix is reused, every token yielded is fed
    (the ``max_tokens``-th and stop tokens too) and an error leaves the layers as
    the model left them, as mlx-lm does; with no cache at all a fresh one is used that way.
    ``input_embeddings`` ``(T, D)`` are fed in place of the prompt's token embeddings
    (see :func:`~mlx_chatcache.generation.run.prepare_run`).
    """
    config = call_config(
        config, max_tokens=max_tokens, max_kv_size=max_kv_size, prefill_step_size=prefill_step_size,
        kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
    )  # fmt: skip
    progress = _one_progress(progress, prompt_progress_callback)
    with mx.stream(stream):
        run = prepare_run(prompt, model, config, sampler=sampler, logits_processors=logits_processors,
                          prompt_cache=prompt_cache, state=state, progress=progress,
                          max_call_seconds=max_call_seconds, input_embeddings=input_embeddings)  # fmt: skip
        yield from _decode(run, stop_tokens)


def _one_progress(progress: Progress | None, prompt_progress_callback: Progress | None) -> Progress | None:
    """``progress`` or mlx-lm's ``prompt_progress_callback`` (UsageError for both)."""
    if progress is not None and prompt_progress_callback is not None:
        from ..errors import UsageError

        raise UsageError("pass progress or prompt_progress_callback, not both")
    return progress or prompt_progress_callback


def _decode(run: Run, stop_tokens: Collection[int]) -> Iterator[tuple[int, mx.array]]:
    """The decode loop of :func:`generate_step` on a prepared run (see the module docstring)."""
    model, state, config, processors, quantizer = run.model, run.state, run.config, run.processors, run.quantizer
    borrowed, own_sampler, sampler = run.borrowed, run.own_sampler, run.sampler
    with run.guard():
        state.tokens.extend(run.rest)
        token_arr, logprobs = _start_step(model, state, run.rest, sampler, processors, quantizer,
                                          embeddings=run.rest_embeddings)  # fmt: skip

    always_undoable = all(c.always_trimmable() for c in state.cache)
    n = 0
    while True:
        n += 1
        last = n == config.max_tokens
        with run.guard():
            if borrowed:  # mlx-lm's order: every token is fed before it is yielded
                ahead = True
                token = token_arr.item()
                state.tokens.append(token)
                after = () if token in stop_tokens else processors  # nothing is sampled after a stop token
                following = _start_step(model, state, token_arr[None], sampler, after, quantizer, own_sampler)
            else:
                # feed token n before it is known (not the first: see the module doc)
                ahead = (1 < n and not last and not processors
                         and (always_undoable or all(c.can_take_back(1) for c in state.cache)))  # fmt: skip
                if ahead:
                    key, layers = mx.random.state[0], list(state.cache)
                    following = _start_step(model, state, token_arr[None], sampler, (), quantizer, own_sampler)
                token = token_arr.item()
                if ahead:
                    state.tokens.append(token)
                    if token in stop_tokens:  # fed for nothing: take it back
                        _take_back_one(state, model, layers)
                        _restore_random_key(key)
        if n == 1 and run.progress:
            run.progress(run.todo, run.todo)
        yield token, logprobs[0]
        if token in stop_tokens or last:
            return
        if n % 256 == 0:
            mx.clear_cache()
        if ahead:
            token_arr, logprobs = following
        else:
            with run.guard():
                state.tokens.append(token)
                token_arr, logprobs = _start_step(model, state, [token], sampler, processors, quantizer)


__all__ = ["sample_token", "generate_step"]
