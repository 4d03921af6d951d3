"""Using a cache file that lists no token ids (mlx-lm's own files).

mlx-lm's ``cache_prompt`` stores only the cache: which tokens it holds is not
written down. Without them we cannot find a common prefix, so we take them from
the prompt the user passes: **the cache is assumed to hold the first N tokens
of the rendered prompt** (N = the cache's length), and the rest is fed. This
is mlxcc's usual contract (pass the whole prompt; what is cached is reused),
so with such a file the prompt must start with the text the cache was made
from and go past it.

What is verified, cheaply: the prompt is longer than the cache; the cached K/V
of plain ``KVCache`` layers for the first and the last few assumed tokens are
recomputed and compared (the last ones from the cache itself, trimmed and fed
again: this is where a wrong boundary or tokenization shows). Whatever was
assumed is said in one line on stderr. Caches whose layers cannot be trimmed
or hold no per-token K/V are used with the length check only (said so).
"""

from __future__ import annotations

import mlx.core as mx

from ..cache import can_trim_prompt_cache, cache_offset, make_prompt_cache, trim_prompt_cache
from ..config import CacheShape
from ..errors import CacheFileError, UsageError
from ..files.mlxcc_format import load_cache_file
from .model_call import call_model
from ..files.prompt_cache import PromptCache

CHECK_TOKENS = 8  # assumed tokens recomputed at each end of the cache
TOLERANCE = 0.05  # max |cached - recomputed| relative to max |recomputed|, per layer


def load_untokenized(path, model, raw: bool) -> PromptCache:
    """A cache file without token ids as a PromptCache whose ``tokens`` are
    still empty (:func:`adopt_prompt_prefix` fills them from the prompt)."""
    cache, info = load_cache_file(path, model=getattr(model, "fingerprint", None))
    max_kv, keep = info.settings.get("max_kv_size"), info.settings.get("keep")
    rotating = next((c for c in cache if type(c).__name__ == "RotatingKVCache"), None)
    if max_kv is None and rotating is not None:
        max_kv, keep = rotating.max_size, rotating.keep
    prompt = PromptCache.fitted(model, cache, [], CacheShape(max_kv, keep if type(keep) is int else CacheShape.keep), path)
    prompt.messages, prompt.text = (None, "") if raw else ([], None)
    prompt.settings = dict(info.settings)
    return prompt


def adopt_prompt_prefix(state: PromptCache, prompt_tokens: list[int], model, path) -> str:
    """Take the cache's tokens to be the first ones of ``prompt_tokens`` after
    checking what can be checked; returns the one-line note saying what was assumed."""
    n, m = cache_offset(state.cache), len(prompt_tokens)
    if m <= n:
        raise UsageError(
            f"{path} holds {n} tokens but not their ids (an mlx-lm cache): they are taken from your prompt, "
            f"which must start with the text the cache was made from and go on past it; this prompt has "
            f"only {m} tokens: pass the cached text followed by your continuation"
        )
    assumed = list(prompt_tokens[:n])
    checked = _check_head(model, state.cache, assumed, path) + _check_tail(model, state.cache, assumed, path)
    state.tokens[:] = assumed
    how = (f"its K/V for {checked} of them recomputed and matched" if checked
           else "only its length checked (its layers cannot be recomputed cheaply)")  # fmt: skip
    return (f"note: {path} lists no token ids (mlx-lm file): assuming it holds the first {n} of this "
            f"prompt's {m} tokens ({how})")  # fmt: skip


def _kv_layers(cache) -> list[int]:
    return [i for i, c in enumerate(cache) if type(c).__name__ == "KVCache" and c.keys is not None]


def _close(a: mx.array, b: mx.array) -> bool:
    if a.shape != b.shape:
        return False
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    scale = max(mx.max(mx.abs(b)).item(), 1e-6)
    return mx.max(mx.abs(a - b)).item() / scale <= TOLERANCE


def _mismatch(path, where: str) -> CacheFileError:
    return CacheFileError(
        f"{path} does not hold the {where} tokens of this prompt (its K/V differ from theirs); the cache "
        "lists no token ids, so the prompt must start with exactly the text it was made from"
    )


def _check_head(model, cache, tokens: list[int], path) -> int:
    """Recompute the first few tokens on a fresh cache; compare every plain K/V layer."""
    layers = _kv_layers(cache)
    k = min(CHECK_TOKENS, len(tokens))
    if not layers or k == 0:
        return 0
    fresh = make_prompt_cache(model)
    call_model(model, tokens[:k], fresh)
    for i in layers:
        for a, b in zip(cache[i].flat_state(), fresh[i].flat_state()):  # (B, H, T, D) each
            if not _close(a[..., :k, :], b):
                raise _mismatch(path, "first")
    return k


def _check_tail(model, cache, tokens: list[int], path) -> int:
    """Trim the last few tokens and feed them again: the cache ends up the same
    (recomputed) and its old K/V for them must match the new ones."""
    layers = _kv_layers(cache)
    n = len(tokens)
    w = min(CHECK_TOKENS, n - CHECK_TOKENS)  # not the ones the head check covered
    if not layers or w <= 0 or not can_trim_prompt_cache(cache):
        return 0
    old = {i: [a[..., n - w :, :] for a in cache[i].flat_state()] for i in layers}
    mx.eval(old)
    trim_prompt_cache(cache, w)
    call_model(model, tokens[n - w :], cache)
    for i in layers:
        for a, b in zip(old[i], cache[i].flat_state()):
            if not _close(a, b[..., n - w :, :]):
                raise _mismatch(path, "last")
    return w


__all__ = ["load_untokenized", "adopt_prompt_prefix"]
