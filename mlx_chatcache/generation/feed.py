"""Feeding a prompt cache: the one prompt feeder and the one recovery from a failed model call.

Contract
--------
- :func:`prefill` feeds all prompt tokens but the last few, in chunks, and records them
  in the state; :func:`final_call_size` says how many to leave: the last chunk, fed in
  the model call that samples the first token (one call instead of two), or the last
  token for a quantized model. It is the one prompt feeder (generation, chat turns,
  ``cache-prompt``, the server's checkpoints and batch): a pacer sizes the calls to a
  time budget so Ctrl-C is acted upon (:mod:`mlx_chatcache.generation.pacing`; results
  equal within float tolerance), and a stop check is polled between calls.
- :func:`consistent_on_error` is the one recovery from a model call that raises.
- :func:`make_kv_quantizer` is the in-place KV quantization a config asks for, applied
  after each model call.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Sequence

import mlx.core as mx

from ..cache import BaseCache, quantize_prompt_cache
from ..config import GenerationConfig
from ..errors import UsageError
from ..files.prompt_cache import PromptCache
from .model_call import call_model
from .pacing import CallPacer

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


__all__ = [
    "Progress",
    "KVQuantizer",
    "PrefillStopped",
    "consistent_on_error",
    "make_kv_quantizer",
    "prefill",
    "final_call_size",
]
