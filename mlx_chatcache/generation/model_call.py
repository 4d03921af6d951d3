"""The one place this package runs a model on a prompt cache, and the check
that every layer's cache took the tokens it was handed.

Contract of :func:`call_model` ``(model, tokens, cache, *, sampled=False) -> model output``:

- ``tokens`` are token ids: a host sequence (fed as a ``(1, T)`` uint32
  array) or an array ``(B, T)`` (``B`` > 1: rows of mlx-lm's batch caches);
- before anything else, every id is checked to be below the model's
  embedding rows (:mod:`.token_ids`), so a bad id raises
  :class:`~mlx_chatcache.errors.TokenIdError` and the cache is untouched: a
  host sequence by its min and max (no MLX work); an array by a min/max
  reduction, which evaluates it, except with ``sampled=True`` (ids the
  package's own sampler drew from this model's logits) once the model's
  logits are known to be no wider than its embedding: then nothing is checked
  and decoding ahead does not wait for the token (its width is recorded
  from every call's output);
- it runs ``model(inputs, cache=cache)`` (with ``input_embeddings`` when given) and
  returns what the model returns;
- before the call it notes each layer's progress (for every cache inside a
  ``CacheList`` too): the ``offset`` int, and for an ``ArraysCache`` the slot
  arrays themselves (by identity; no array is evaluated or copied);
- after the call, a cache whose offset did not move and (``ArraysCache``)
  whose slots were not replaced did not take the ``T`` tokens: the model does
  not use it, so continuing would give wrong text from then on. That raises
  :class:`CacheNotUpdatedError` naming the model type and the layer;
- an ``ArraysCache`` whose slots were replaced but whose offset did not move
  (models that never call ``advance``: mamba, falcon_mamba, rwkv7) gets
  ``offset += T``, so that every layer's offset counts the tokens it has seen.

Every model call in this package (prefill, decode, feeding a whole prompt)
goes through here. Cost: a few attribute reads per layer per call, and
the id check above.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..cache import ArraysCache, BaseCache, CacheList
from ..errors import CacheNotUpdatedError
from .token_ids import check_token_ids, logits_fit, note_logits_width, vocab_size


def _leaves(cache: list[BaseCache]) -> list[BaseCache]:
    """Every per-layer cache, those inside a CacheList in its place."""
    out = []
    for c in cache:
        if isinstance(c, CacheList):
            out.extend(c.caches)
        else:
            out.append(c)
    return out


def _where(cache: list[BaseCache], leaf: BaseCache) -> str:
    """Which layer (and CacheList part) ``leaf`` serves, for the message."""
    for i, c in enumerate(cache):
        if c is leaf:
            return f"layer {i}"
        if isinstance(c, CacheList) and any(x is leaf for x in c.caches):
            j = next(j for j, x in enumerate(c.caches) if x is leaf)
            return f"layer {i} (part {j} of its CacheList)"
    return "a layer"


def _progress(c: BaseCache) -> int:
    """How far ``c`` has taken tokens: its ``offset``; for mlx-lm's batch caches (a
    per-row offset array) the batch's write position."""
    return c.offset if isinstance(c.offset, int) else c._idx


def _took_tokens(c: BaseCache, offset: int, slots) -> bool:
    """Whether ``c`` moved past ``offset`` or (an ArraysCache) replaced its ``slots``."""
    if _progress(c) != offset:
        return True
    if slots is None:
        return False
    return len(slots) != len(c.cache) or any(a is not b for a, b in zip(slots, c.cache))


def model_type(model) -> str:
    """The model's architecture name (mlx-lm's ``model_type``), for messages."""
    name = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)
    return str(name) if name else type(model).__name__


def _checked_inputs(model, tokens: Sequence[int] | mx.array, sampled: bool) -> mx.array:
    """``tokens`` as a ``(1, T)`` array, each id checked to be one the model has."""
    if not isinstance(tokens, mx.array):
        ids = [int(t) for t in tokens]
        check_token_ids(model, ids)
        return mx.array(ids, dtype=mx.uint32)[None]
    rows = vocab_size(model)
    if rows is None or tokens.size == 0 or (sampled and logits_fit(model)):
        return tokens
    low, high = mx.min(tokens), mx.max(tokens)
    mx.eval(low, high)
    if low.item() < 0 or high.item() >= rows:
        check_token_ids(model, tokens.reshape(-1).tolist())
    return tokens


def call_model(model, tokens: Sequence[int] | mx.array, cache: list[BaseCache], *, sampled: bool = False,
               input_embeddings: mx.array | None = None):  # fmt: skip
    """``model(tokens, cache=cache)``, checked: the ids must be the model's, every layer must take them.
    ``input_embeddings`` ``(1, T, D)``: passed to the model, which feeds them in place of the
    tokens' embeddings (``tokens`` then has ``T`` ids or none)."""
    inputs = _checked_inputs(model, tokens, sampled)
    n = inputs.shape[-1] if input_embeddings is None else input_embeddings.shape[-2]
    leaves = _leaves(cache)
    # (offset, the slot arrays of an ArraysCache): ints and references, nothing evaluated
    before = [(_progress(c), tuple(c.cache) if isinstance(c, ArraysCache) else None) for c in leaves]
    if input_embeddings is None:
        out = model(inputs, cache=cache)
    else:
        out = model(inputs, cache=cache, input_embeddings=input_embeddings)
    if isinstance(out, mx.array) and out.ndim == 3:
        note_logits_width(model, out.shape[-1])
    if n == 0:
        return out
    for c, (offset, slots) in zip(leaves, before):
        if not _took_tokens(c, offset, slots):
            raise CacheNotUpdatedError(
                f"the {model_type(model)} model was given {n} token(s) but did not store them in "
                f"{_where(cache, c)}'s cache ({type(c).__name__}, offset still {offset}), so its replies "
                "would be wrong; this architecture does not work with mlx_chatcache's caches yet: "
                "use mlx-lm for it and report the model type"
            )
        if slots is not None and c.offset == offset:  # an ArraysCache whose slots were replaced without advance()
            c.offset += n
    return out


__all__ = ["call_model", "model_type"]
