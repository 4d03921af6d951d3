"""What a generate call sets up before its first token: :func:`prepare_run`.

Contract
--------
:func:`prepare_run` reads a call's arguments (mlx-lm's keywords over a
:class:`~mlx_chatcache.config.GenerationConfig`, see :mod:`.arguments`), checks them (one
line each, :class:`~mlx_chatcache.errors.UsageError`; a prompt id the model does not have
is :class:`~mlx_chatcache.errors.TokenIdError` before the state is touched), takes the
cache the call works on, reuses what it holds of the prompt, feeds all of the rest but the
last few tokens (:func:`~mlx_chatcache.generation.feed.prefill`, paced when
``max_call_seconds``), and returns a :class:`Run` holding what the decode loops
(:func:`~mlx_chatcache.generation.loop.generate_step`,
:func:`~mlx_chatcache.generation.speculative.speculative_generate_step`) need.

The cache: ``state`` (or a :class:`PromptCache` as ``prompt_cache``) is owned: its longest
prefix of the prompt is reused and a failing model call resets it
(:func:`~mlx_chatcache.generation.feed.consistent_on_error`). A list of layers as
``prompt_cache`` is borrowed, as mlx-lm uses it: the prompt is appended to what they hold
and an error leaves them as the model left them. With neither, a fresh cache nobody else
sees is borrowed too (so the loop runs in mlx-lm's order: see ``Run.borrowed``).

``input_embeddings`` ``(T, D)``: fed in place of the prompt's token embeddings, as mlx-lm
feeds them (a model whose ``__call__`` takes ``input_embeddings``; else UsageError), with a
prompt of the same ``T`` ids or none; the cache is then never owned (the embeddings are not
the token ids a cache records).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from ..config import GenerationConfig, SettingError, check_config
from ..errors import TokenIdError, UsageError
from ..files.prompt_cache import PromptCache
from .arguments import call_state
from .feed import KVQuantizer, Progress, consistent_on_error, final_call_size, make_kv_quantizer, prefill
from .model_call import call_model
from .pacing import CallPacer
from .prompt import ensure_state, reuse_prefix
from .sample import LogitsProcessor, Sampler, make_distribution, make_logits_processors, make_sampler
from .token_ids import check_token_ids


@dataclass
class Run:
    """A generate call ready to decode: ``state`` has been fed the prompt but ``rest``
    (``rest_embeddings``: their embeddings, with ``input_embeddings``), which the first
    decode call feeds. ``borrowed``: every token yielded is fed before it is yielded and
    errors leave the layers as they are (mlx-lm's order); else the last token yielded is
    never fed and an error resets ``state``. ``distribution``: what ``sampler`` draws from
    (None: greedy, or a sampler the caller gave). ``todo``: prompt tokens not reused."""

    model: object
    config: GenerationConfig
    prompt: list[int]
    state: PromptCache
    borrowed: bool
    sampler: Sampler
    own_sampler: bool
    distribution: Callable[[mx.array], mx.array] | None
    processors: list[LogitsProcessor]
    quantizer: KVQuantizer | None
    rest: list[int]
    rest_embeddings: mx.array | None
    todo: int
    progress: Progress | None

    def guard(self):
        """A model call inside leaves an owned ``state`` consistent (or empty); borrowed layers as they are."""
        return contextlib.nullcontext() if self.borrowed else consistent_on_error(self.state, self.model, trim_back=False)


def takes_embeddings(model) -> bool:
    """Whether ``model``'s ``__call__`` takes ``input_embeddings`` (mlx-lm's test)."""
    try:
        return "input_embeddings" in inspect.signature(model.__call__).parameters
    except (TypeError, ValueError):
        return False


def prepare_run(
    prompt: Sequence[int] | mx.array,
    model,
    config: GenerationConfig,
    *,
    sampler: Sampler | None,
    logits_processors: Sequence[LogitsProcessor] | None,
    prompt_cache,
    state: PromptCache | None,
    progress: Progress | None,
    max_call_seconds: float | None,
    input_embeddings: mx.array | None = None,
) -> Run:
    """A :class:`Run` of ``prompt`` on ``model`` (see the module docstring)."""
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
    _check_embeddings(model, prompt, input_embeddings, prompt_cache, state)
    state, borrowed = call_state(prompt_cache, state)
    if state is None:  # a throw-away cache: borrowed, so the loop runs in mlx-lm's order
        state, borrowed = PromptCache.new(model, config.shape), True
    elif not borrowed:
        state = ensure_state(model, state, config)
    if borrowed and not prompt and input_embeddings is None:
        raise UsageError("the prompt is empty; give at least one token")

    own_sampler = sampler is None
    c = config
    sampler = sampler or make_sampler(c.temp, c.top_p, c.top_k, c.min_p, c.min_tokens_to_keep)
    distribution = make_distribution(c.temp, c.top_p, c.top_k, c.min_p, c.min_tokens_to_keep) if own_sampler else None
    processors = list(make_logits_processors(config) if logits_processors is None else logits_processors)
    quantizer = make_kv_quantizer(config)
    if config.seed is not None:
        mx.random.seed(config.seed)
    run = Run(model, config, prompt, state, borrowed, sampler, own_sampler, distribution, processors, quantizer,
              [], None, 0, progress)  # fmt: skip

    if input_embeddings is not None:
        _prefill_embeddings(run, input_embeddings)
        return run
    reused = 0 if borrowed else reuse_prefix(state, prompt, model)
    todo = prompt[reused:]
    run.todo = len(todo)
    with run.guard():
        run.rest = prefill(
            model, state, todo, config.prefill_step_size, progress, kv_quantizer=quantizer,
            leave=final_call_size(model, len(todo), config.prefill_step_size),
            pacer=CallPacer(model, max_call_seconds) if max_call_seconds else None,
        )  # fmt: skip
    return run


def _check_embeddings(model, prompt: list[int], embeddings, prompt_cache, state) -> None:
    if embeddings is None:
        return
    if not takes_embeddings(model):
        raise UsageError(f"input_embeddings: the {type(model).__name__} model does not take input embeddings; "
                         "pass the prompt as token ids")  # fmt: skip
    if not isinstance(embeddings, mx.array) or embeddings.ndim != 2:
        raise UsageError("input_embeddings must be an mx.array of shape (prompt tokens, hidden size)")
    if prompt and len(prompt) != embeddings.shape[0]:
        raise UsageError(f"input_embeddings has {embeddings.shape[0]} rows but the prompt {len(prompt)} tokens; "
                         "give one row per prompt token, or an empty prompt")  # fmt: skip
    if embeddings.shape[0] == 0:
        raise UsageError("input_embeddings is empty; give at least one row")
    if state is not None or isinstance(prompt_cache, PromptCache):
        raise UsageError("input_embeddings cannot be cached as token ids: pass prompt_cache as a list of layers "
                         "(make_prompt_cache(model)) or no cache")  # fmt: skip


def _prefill_embeddings(run: Run, embeddings: mx.array) -> None:
    """Feed all rows of ``embeddings`` but the last, ``prefill_step_size`` at a time, as mlx-lm does."""
    total, step, done = embeddings.shape[0], run.config.prefill_step_size, 0
    ids = run.prompt or None
    if run.progress:
        run.progress(0, total)
    while total - done > 1:
        n = min(step, total - done - 1)
        chunk = ids[done : done + n] if ids else []
        call_model(run.model, chunk, run.state.cache, input_embeddings=embeddings[done : done + n][None])
        if run.quantizer:
            run.quantizer(run.state.cache)
        mx.eval([c.eval_arrays() for c in run.state.cache])
        run.state.tokens.extend(chunk)
        done += n
        if run.progress:
            run.progress(done, total)
        mx.clear_cache()
    run.rest = ids[done:] if ids else []
    run.rest_embeddings = embeddings[done:]
    run.todo = total


__all__ = ["Run", "prepare_run", "takes_embeddings"]
