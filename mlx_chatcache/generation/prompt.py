"""Reusing a prompt cache (:class:`~mlx_chatcache.files.prompt_cache.PromptCache`:
a cache and the exact token ids it has been fed) for a new prompt.

Contract: the functions here keep the pairing of ``cache`` and ``tokens``:
:func:`ensure_state` gives a run its cache (a new one, or the caller's when its
window agrees with the one asked), :func:`reuse_prefix` reduces a state to the
longest part of a prompt it already holds, :func:`trim_state` trims it back to a
given length when every layer can be trimmed. Feeding and sampling live in
:mod:`mlx_chatcache.generation.loop`. All defaults come from
:data:`~mlx_chatcache.config.DEFAULTS`.
"""

from __future__ import annotations

from typing import Sequence

from ..cache import cache_offset, can_trim_prompt_cache, trim_prompt_cache
from ..config import GenerationConfig
from ..errors import CacheFormatError, UsageError
from ..files.prompt_cache import PromptCache
from ..files.tokens import common_prefix_len


def ensure_state(model, state: PromptCache | None, config: GenerationConfig) -> PromptCache:
    """``state``, or a new one shaped by ``config``; rejects a conflicting shape."""
    if state is None:
        return PromptCache.new(model, config.shape)
    made = state.shape
    if not made.agrees(config.max_kv_size, config.keep):
        raise UsageError(
            f"the prompt cache was made with max_kv_size={made.max_kv_size}, keep={made.keep} "
            f"but max_kv_size={config.max_kv_size}, keep={config.keep} was asked; "
            "use the same values or start a new cache"
        )
    return state


# ------------------------------------------------------------------ reuse
def reuse_prefix(state: PromptCache, prompt_tokens: Sequence[int], model) -> int:
    """Make ``state`` hold a prefix of ``prompt_tokens``; return its length.

    The reused prefix is the longest common prefix of ``state.tokens`` and the
    prompt, capped at ``len(prompt) - 1`` (at least one token must be fed for
    the model to produce logits). Tokens the cache holds beyond it are trimmed
    when every layer can be trimmed; otherwise the state is reset (``model``
    builds the fresh cache) and 0 is returned. Calling it again with the same
    prompt changes nothing.
    """
    if not prompt_tokens:
        raise UsageError("the prompt is empty; give at least one token")
    held = len(state.tokens)
    offset = cache_offset(state.cache)
    # mlx-lm models that never call advance() (mamba, rwkv7) leave offset 0 in caches fed
    # outside generation.model_call.call_model (older files, mlx-lm's own loop): 0 is not checked
    if offset != held and offset != 0:
        raise CacheFormatError(
            f"the prompt cache has seen {offset} tokens but its token list has {held}; "
            "the cache is inconsistent: start a new one"
        )
    reuse = min(common_prefix_len(state.tokens, prompt_tokens), len(prompt_tokens) - 1)
    if trim_state(state, reuse):
        return reuse
    state.reset(model)
    return 0


def trim_state(state: PromptCache, n: int) -> bool:
    """Trim ``state`` back to its first ``n`` tokens (``n <= len(state.tokens)``).

    Returns False when trimming cannot get there (a layer that cannot be
    trimmed, or one left holding another count); trimmable layers may then
    have been trimmed, so the caller must restore or reset the state.
    """
    excess = len(state.tokens) - n
    if excess == 0:
        return True
    if can_trim_prompt_cache(state.cache):
        trim_prompt_cache(state.cache, excess)
        if cache_offset(state.cache) == n:
            del state.tokens[n:]
            return True
    return False


__all__ = ["ensure_state", "reuse_prefix", "trim_state"]
