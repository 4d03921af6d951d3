"""Reference model steps for tests: one forward pass, one synchronous decode step."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from mlx_chatcache.cache import BaseCache
from mlx_chatcache.generation.feed import KVQuantizer
from mlx_chatcache.generation.loop import sample_token
from mlx_chatcache.generation.model_call import call_model
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.sample import LogitsProcessor, Sampler


def forward(model, cache: list[BaseCache], tokens: Sequence[int]) -> mx.array:
    """Feed ``tokens`` (updating ``cache``); logits of the last one ``(1, V)``."""
    return call_model(model, tokens, cache)[:, -1, :]  # (1, T, V) -> (1, V)


def decode_one_token(
    model,
    state: PromptCache,
    tokens: Sequence[int],
    sampler: Sampler,
    processors: Sequence[LogitsProcessor] = (),
    kv_quantizer: KVQuantizer | None = None,
) -> tuple[int, mx.array]:
    """Feed ``tokens`` (recorded in ``state.tokens``); sample the next token.

    Returns ``(token, logprobs)`` with ``logprobs`` of shape ``(V,)``.
    """
    logits = forward(model, state.cache, tokens)  # (1, V)
    if kv_quantizer:
        kv_quantizer(state.cache)
    state.tokens.extend(tokens)
    token, logprobs = sample_token(logits, state.tokens, sampler, processors)
    mx.eval(token, logprobs, [c.eval_arrays() for c in state.cache])
    return token.item(), logprobs[0]
