"""How the generation functions read their arguments: mlx-lm's keywords next to ours.

:func:`call_config` applies mlx-lm's cache and length keywords, when given, over a
:class:`~mlx_chatcache.config.GenerationConfig`; :func:`call_state` says what a call
works on when it is given ``prompt_cache`` (mlx-lm's name) or ``state``.
"""

from __future__ import annotations

from ..cache import BaseCache
from ..config import DEFAULTS, GenerationConfig
from ..errors import UsageError
from ..files.prompt_cache import PromptCache


def call_config(
    config: GenerationConfig | None,
    *,
    max_tokens: int | None = None,
    max_kv_size: int | None = None,
    prefill_step_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
) -> GenerationConfig:
    """``config`` (:data:`DEFAULTS` when None) with mlx-lm's keywords that are given (not None) applied."""
    return (config or DEFAULTS).updated(
        max_tokens=max_tokens, max_kv_size=max_kv_size, prefill_step_size=prefill_step_size,
        kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
    )  # fmt: skip


def call_state(prompt_cache, state: PromptCache | None) -> tuple[PromptCache | None, bool]:
    """The state a call works on, and whether it is borrowed: ``prompt_cache`` given as a
    list of layers (mlx-lm's meaning: the prompt is appended to what they hold, in place).
    A :class:`PromptCache` as ``prompt_cache`` is the same as ``state=``."""
    if prompt_cache is None:
        return state, False
    if state is not None:
        raise UsageError("pass the cache as prompt_cache or as state, not both")
    if isinstance(prompt_cache, PromptCache):
        return prompt_cache, False
    layers = prompt_cache if isinstance(prompt_cache, list) else list(prompt_cache)
    for i, c in enumerate(layers):
        if not isinstance(c, BaseCache):
            raise UsageError(
                f"prompt_cache layer {i} is a {type(c).__module__}.{type(c).__name__}, not an mlx_chatcache "
                "cache; make the cache with mlx_chatcache.make_prompt_cache(model)"
            )
    return PromptCache(layers), True


__all__ = ["call_config", "call_state"]
