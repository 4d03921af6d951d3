"""Text generation on a prompt cache that is reused from one call to the next.

Layers, each usable on its own (lowest first):

1. :class:`~mlx_chatcache.files.prompt_cache.PromptCache` holds a prompt cache
   (one cache per layer) and ``tokens``, the token ids that cache has been fed,
   in order; :func:`~mlx_chatcache.generation.prompt.reuse_prefix` reduces it to
   the longest part of a new prompt it already holds (both in
   :mod:`mlx_chatcache.generation.prompt`).
2. :func:`prefill` feeds all prompt tokens but the last few, in chunks, and
   records them in the state; :func:`final_call_size` says how many to leave:
   the last chunk, fed in the model call that samples the first token (one call
   instead of two), or the last token for a quantized model. It is the one
   prompt feeder (generation, chat turns, ``cache-prompt``, the server's
   checkpoints): a pacer sizes the calls to a time budget so Ctrl-C is acted
   upon (:mod:`mlx_chatcache.generation.pacing`; results equal within float
   tolerance), and a stop check is polled between calls.
   :func:`consistent_on_error` is the one recovery from a model call that raises.
3. :func:`generate_step` yields ``(token, logprobs)`` pairs. While decoding
   it computes one token ahead (see below).
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
  with :func:`trim_state` to get the usual ``prompt + r1..r(k-1)``), and the
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
(:func:`consistent_on_error` with ``trim_back=False``).

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

import contextlib
import weakref
from typing import Callable, Collection, Iterator, Sequence

import mlx.core as mx

from ..cache import BaseCache, quantize_prompt_cache
from ..config import GenerationConfig, SettingError, check_config
from ..errors import TokenIdError, UsageError
from .arguments import call_config, call_state, refuse_unsupported
from .model_call import call_model
from .pacing import CallPacer
from ..files.prompt_cache import PromptCache
from .prompt import ensure_state, reuse_prefix, trim_state
from .sample import LogitsProcessor, Sampler, make_logits_processors, make_sampler
from .token_ids import check_token_ids

Progress = Callable[[int, int], None]  # (tokens done, tokens to do)

KVQuantizer = Callable[[list[BaseCache]], None]


# ------------------------------------------------------------------ errors
class PrefillStopped(Exception):
    """:func:`prefill`'s stop check said stop; the state holds the chunks fed so far."""


@contextlib.contextmanager
def consistent_on_error(state: PromptCache, model, *, trim_back: bool = True):
    """Model calls inside that raise (KeyboardInterrupt included) leave ``state``
    consistent, never half-updated: every layer trimmed back to ``len(state.tokens)``
    when every layer can be (with ``trim_back``), else an empty cache of the same shape."""
    try:
        yield
    except BaseException:
        if not (trim_back and _trimmed_back(state)):
            state.reset(model)
        raise


def _trimmed_back(state: PromptCache) -> bool:
    """Trim every layer that moved past ``len(state.tokens)`` back to it; False
    when one cannot be (some layers may have been trimmed)."""
    n = len(state.tokens)
    for c in state.cache:
        extra = c.offset - n
        if extra < 0 or (extra > 0 and not (c.is_trimmable() and c.trim(extra) == extra and c.offset == n)):
            return False
    return True


# ------------------------------------------------------------------ feeding
def make_kv_quantizer(config: GenerationConfig) -> KVQuantizer | None:
    """The in-place KV quantization step ``config`` asks for (None: none)."""
    if config.kv_bits is None:
        return None

    def quantize(cache: list[BaseCache]) -> None:
        quantize_prompt_cache(cache, config.kv_group_size, config.kv_bits, config.quantized_kv_start)

    return quantize


def prefill(
    model,
    state: PromptCache,
    tokens: Sequence[int],
    prefill_step_size: int,
    progress: Progress | None = None,
    *,
    kv_quantizer: KVQuantizer | None = None,
    leave: int = 1,
    pacer: CallPacer | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[int]:
    """Feed all of ``tokens`` but the last ``leave``, ``prefill_step_size`` at a time,
    recording each chunk in ``state.tokens`` once it is evaluated (bounded memory).

    Returns the tokens left to feed (see :func:`final_call_size`). ``progress`` gets
    ``(fed, len(tokens))`` before the first chunk and after each. ``should_stop`` is
    polled before every call and before returning more than one token (a call that
    may take long); when it says so, :class:`PrefillStopped` is raised with the state
    holding the chunks fed so far. With a ``pacer`` every call is sized to take about
    its ``max_seconds`` at most (:class:`~mlx_chatcache.generation.pacing.CallPacer`),
    so that Ctrl-C or a stop request is acted upon between calls; more than ``leave``
    tokens are fed when the ones left would take longer (at least one is always left
    when ``leave`` >= 1). A model call that raises leaves the layers holding more than
    ``state.tokens``: callers wrap it in :func:`consistent_on_error`.
    """
    if prefill_step_size < 1:
        raise UsageError(f"prefill step size must be >= 1, got {prefill_step_size}")
    tokens = list(tokens)
    todo = max(len(tokens) - leave, 0)
    if progress:
        progress(0, len(tokens))
    start, since_clear = 0, 0
    while start < todo or (pacer is not None and not pacer.fits(len(tokens) - start)):
        if should_stop is not None and should_stop():
            raise PrefillStopped
        end = todo if start < todo else len(tokens) - 1
        n = min(prefill_step_size, end - start)
        if pacer is not None:
            n = pacer.size(n)
            pacer.start()
        chunk = tokens[start : start + n]
        call_model(model, chunk, state.cache)
        if kv_quantizer:
            kv_quantizer(state.cache)
        mx.eval([c.eval_arrays() for c in state.cache])
        if pacer is not None:
            pacer.record(n)
        state.tokens.extend(chunk)
        start, since_clear = start + n, since_clear + n
        if since_clear >= prefill_step_size or pacer is None:
            mx.clear_cache()
            since_clear = 0
        if progress:
            progress(start, len(tokens))
    if len(tokens) - start > 1 and should_stop is not None and should_stop():
        raise PrefillStopped
    return tokens[start:]


def final_call_size(model, n: int, prefill_step_size: int) -> int:
    """How many of ``n`` prompt tokens to feed in the model call that samples
    the first reply token (the others are fed by :func:`prefill` first).

    The last chunk (1 to ``prefill_step_size`` tokens, chunks starting at
    the first token), which saves a model call, unless the model has
    quantized layers: then 1, as mlx-lm does. Feeding ``T`` tokens in one
    call computes the output layer (the logits) for all ``T``. That costs
    less than the saved call when products of many tokens are much cheaper
    per token than of one (an optimized BLAS, a GPU), and more when they
    are not: MLX's quantized CPU products, float32 on the mlx-cpu wheel's
    reference BLAS. SmolLM2-135M, 24 new tokens, one call vs two: float32
    with OpenBLAS 164 vs 199 ms, Q4_1 2.9 vs 2.3 s, float32 with the
    reference BLAS 2.7 vs 2.2 s. Decided once per model object.
    """
    if n < 1:
        return 0
    if _has_quantized_layers(model):
        return 1
    return n - (n - 1) // prefill_step_size * prefill_step_size


_QUANTIZED: dict[int, tuple[weakref.ref, bool]] = {}  # id(model) -> (model, has quantized layers)


def _has_quantized_layers(model) -> bool:
    key = id(model)
    known = _QUANTIZED.get(key)
    if known is not None and known[0]() is model:
        return known[1]
    modules = model.named_modules() if hasattr(model, "named_modules") else []
    quantized = any(getattr(m, "bits", None) is not None for _, m in modules)
    with contextlib.suppress(TypeError):  # not weak-referenceable: not remembered
        _QUANTIZED[key] = (weakref.ref(model, lambda _: _QUANTIZED.pop(key, None)), quantized)
    return quantized


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
) -> tuple[mx.array, mx.array]:
    """Feed ``inputs`` (ids, or an array ``(1, T)``; ``sampled``: see
    :func:`~mlx_chatcache.generation.model_call.call_model`) and start computing the next token.

    Returns the token ``(1,)`` and its log-probabilities ``(1, V)``, being
    evaluated in the background. The caller records the fed tokens in
    ``state.tokens`` (the processors see them there as the context).
    """
    logits = call_model(model, inputs, state.cache, sampled=sampled)[:, -1, :]  # (1, V)
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
    input_embeddings=None,
    state: PromptCache | None = None,
    config: GenerationConfig | None = None,
    stop_tokens: Collection[int] = (),
    progress: Progress | None = None,
    max_call_seconds: float | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Yield ``(token, logprobs (V,))`` for up to ``config.max_tokens`` tokens (-1: no limit).

    A prompt id the model does not have raises
    :class:`~mlx_chatcache.errors.TokenIdError` before ``state`` is touched.
    Reuses what ``state`` holds of the prompt (a fresh state when None), feeds
    the rest, then samples. It stops after yielding a token in
    ``stop_tokens`` or the ``max_tokens``-th token; that last token is not fed
    (see the module docstring, also for when a token is fed ahead).
    ``sampler``/``logits_processors`` default to those the config describes.
    ``progress`` gets ``(done, total)`` over the prompt tokens that are not
    reused, ending with ``(total, total)``. ``max_call_seconds``: the prompt's
    calls are paced to take about that long at most, so Ctrl-C is acted upon (see :func:`prefill`).

    mlx-lm's keywords are accepted with its meaning: ``max_tokens``, ``max_kv_size``,
    ``prefill_step_size``, ``kv_bits``, ``kv_group_size``, ``quantized_kv_start``
    override ``config`` when given; ``prompt_progress_callback`` is ``progress``;
    ``prompt_cache`` is ``state`` when a :class:`PromptCache`, and when a list of
    layers (made by :func:`~mlx_chatcache.cache.make_prompt_cache`) the prompt is
    appended to what they hold, no prefix is reused, every token yielded is fed
    (the ``max_tokens``-th and stop tokens too) and an error leaves the layers as
    the model left them, as mlx-lm does. ``input_embeddings`` is refused.
    """
    refuse_unsupported(input_embeddings=input_embeddings)
    config = call_config(
        config, max_tokens=max_tokens, max_kv_size=max_kv_size, prefill_step_size=prefill_step_size,
        kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
    )  # fmt: skip
    if progress is not None and prompt_progress_callback is not None:
        raise UsageError("pass progress or prompt_progress_callback, not both")
    progress = progress or prompt_progress_callback
    prompt = prompt.reshape(-1).tolist() if isinstance(prompt, mx.array) else [int(t) for t in prompt]
    if config.max_tokens < 1 and config.max_tokens != -1:
        raise UsageError(f"max_tokens must be >= 1 (or -1: no limit), got {config.max_tokens}")
    try:  # every field in its range (a seed MLX takes, a top_p that leaves a token)
        check_config(config.updated(max_tokens=1) if config.max_tokens == -1 else config)
    except SettingError as e:
        raise UsageError(e.named) from None
    check_token_ids(model, prompt)  # before the state is trimmed to the prompt
    if config.logit_bias:
        try:
            check_token_ids(model, [t for t, _ in config.logit_bias])
        except TokenIdError as e:
            raise UsageError(f"logit_bias: {e}") from None
    state, borrowed = call_state(prompt_cache, state)
    if not borrowed:
        state = ensure_state(model, state, config)
    elif not prompt:
        raise UsageError("the prompt is empty; give at least one token")

    def guard():  # an owned state is reset when a call fails; borrowed layers are left as they are
        return contextlib.nullcontext() if borrowed else consistent_on_error(state, model, trim_back=False)

    own_sampler = sampler is None  # draws indices of the logits
    sampler = sampler or make_sampler(
        config.temp, config.top_p, config.top_k, config.min_p, config.min_tokens_to_keep
    )
    if logits_processors is None:
        logits_processors = make_logits_processors(config)
    quantizer = make_kv_quantizer(config)
    if config.seed is not None:
        mx.random.seed(config.seed)

    reused = 0 if borrowed else reuse_prefix(state, prompt, model)
    todo = prompt[reused:]
    with guard():
        rest = prefill(
            model, state, todo, config.prefill_step_size, progress, kv_quantizer=quantizer,
            leave=final_call_size(model, len(todo), config.prefill_step_size),
            pacer=CallPacer(model, max_call_seconds) if max_call_seconds else None,
        )  # fmt: skip
        state.tokens.extend(rest)
        token_arr, logprobs = _start_step(model, state, rest, sampler, logits_processors, quantizer)

    always_undoable = all(c.always_trimmable() for c in state.cache)
    n = 0
    while True:
        n += 1
        last = n == config.max_tokens
        with guard():
            if borrowed:  # mlx-lm's order: every token is fed before it is yielded
                ahead = True
                token = token_arr.item()
                state.tokens.append(token)
                following = _start_step(model, state, token_arr[None], sampler, logits_processors, quantizer,
                                        own_sampler)  # fmt: skip
            else:
                # feed token n before it is known (not the first: see the module doc)
                ahead = (1 < n and not last and not logits_processors
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
        if n == 1 and progress:
            progress(len(todo), len(todo))
        yield token, logprobs[0]
        if token in stop_tokens or last:
            return
        if n % 256 == 0:
            mx.clear_cache()
        if ahead:
            token_arr, logprobs = following
        else:
            with guard():
                state.tokens.append(token)
                token_arr, logprobs = _start_step(
                    model, state, [token], sampler, logits_processors, quantizer
                )


__all__ = [
    "Progress",
    "KVQuantizer",
    "PrefillStopped",
    "consistent_on_error",
    "make_kv_quantizer",
    "prefill",
    "final_call_size",
    "sample_token",
    "generate_step",
]
