"""Decoding several prompt caches together: one model call per token for all their rows.

Contract
--------
:func:`batch_refusal` says why a model and config cannot be decoded in a batch (None:
they can): only caches whose every layer is exactly our float
:class:`~mlx_chatcache.cache.KVCache` and no KV quantization (a rotating window, a
quantized, chunked, SSM or hybrid cache keeps its own per-row layout).

A :class:`DecodeBatch` holds rows, each a :class:`BatchRow`: a
:class:`~mlx_chatcache.files.prompt_cache.PromptCache` fed all of its prompt but
the last token (by :func:`~mlx_chatcache.generation.loop.prefill`), the token to
feed next, and its own sampler and logits processors.

- :meth:`DecodeBatch.join` adds a row; its layers move into the batch's mlx-lm
  ``BatchKVCache`` layers (``KVCache.merge``; the row's state holds none while it is in the batch);
- :meth:`DecodeBatch.step` makes one model call ``(B, 1)`` for every row, records
  each row's fed token in its ``state.tokens``, and samples each row's next token
  with its processors (which see its own tokens as the context) and sampler, as
  :func:`~mlx_chatcache.generation.loop.sample_token` does for one: it returns
  ``(token, logprobs (V,))`` per row, in row order (the exception a row's processors
  raised in its place: that row should leave);
- :meth:`DecodeBatch.leave` removes rows; each gets back a cache of our
  ``KVCache`` layers holding exactly its ``state.tokens``, so its last sampled
  token is not fed (the rule of :mod:`mlx_chatcache.generation.loop`).

Greedy rows give the tokens they give alone, up to float rounding of the
batched products. A model call that raises leaves the batch unusable: its
rows' states are emptied (``state.reset``) by :meth:`DecodeBatch.fail`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from ..cache import KVCache, make_prompt_cache
from ..config import GenerationConfig
from ..files.prompt_cache import PromptCache
from .loop import sample_token
from .model_call import call_model
from .sample import LogitsProcessor, Sampler


def batch_refusal(model, config: GenerationConfig) -> str | None:
    """Why ``model`` under ``config`` cannot be decoded in a batch (None: it can)."""
    if config.kv_bits is not None:
        return "the KV cache is quantized (--kv-bits)"
    if config.max_kv_size is not None:
        return "the KV cache is a rotating window (--max-kv-size)"
    kinds = {type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache}
    if kinds:
        return f"the model's cache has {', '.join(sorted(kinds))} layers, not only full-attention KVCache"
    return None


@dataclass
class BatchRow:
    """One row: its state (all fed tokens in ``state.tokens``), the token to feed next,
    and how its tokens are drawn."""

    state: PromptCache
    next_token: int
    sampler: Sampler
    processors: Sequence[LogitsProcessor] = ()
    owner: object = None  # what the caller keeps with the row


class DecodeBatch:
    def __init__(self, model):
        self.model = model
        self.rows: list[BatchRow] = []
        self._layers: list | None = None  # a BatchKVCache (cache/batch.py) per model layer

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, row: BatchRow) -> BatchRow:
        """Move ``row``'s layers into the batch (see the module docstring)."""
        merged = [KVCache.merge([c]) for c in row.state.cache]
        if self._layers is None:
            self._layers = merged
        else:
            for layer, m in zip(self._layers, merged):
                layer.extend(m)
        row.state.cache[:] = []
        self.rows.append(row)
        return row

    def step(self) -> list[tuple[int, mx.array] | Exception]:
        """Feed every row's next token in one model call; each row's ``(token, logprobs (V,))``,
        or the exception its logits processors or sampler raised (the row's state then holds its
        fed tokens, and the row should leave)."""
        inputs = mx.array([r.next_token for r in self.rows], dtype=mx.uint32)[:, None]  # (B, 1)
        logits = call_model(self.model, inputs, self._layers, sampled=True)[:, -1, :]  # (B, V)
        out: list = []
        for i, r in enumerate(self.rows):
            r.state.tokens.append(r.next_token)
            try:
                out.append(sample_token(logits[i : i + 1], r.state.tokens, r.sampler, r.processors))
            except Exception as e:  # this row's processor: the others go on
                out.append(e)
        mx.eval([o for o in out if not isinstance(o, Exception)], [(layer.keys, layer.values) for layer in self._layers])
        results: list = []
        for r, o in zip(self.rows, out):
            if isinstance(o, Exception):
                results.append(o)
                continue
            r.next_token = o[0].item()
            results.append((r.next_token, o[1][0]))
        return results

    def leave(self, rows: Sequence[BatchRow]) -> None:
        """Take ``rows`` out; each gets its own cache back, holding its ``state.tokens``."""
        gone = {id(r) for r in rows}
        for i, r in enumerate(self.rows):
            if id(r) in gone:
                r.state.cache[:] = [_own_layer(layer, i, len(r.state.tokens)) for layer in self._layers]
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._layers = None
            return
        for layer in self._layers:
            layer.filter(mx.array(keep))

    def fail(self, model) -> list[BatchRow]:
        """Empty every row's state (after a model call raised) and the batch; the rows."""
        rows, self.rows, self._layers = self.rows, [], None
        for r in rows:
            r.state.reset(model)
        return rows


def _own_layer(layer, row: int, n: int) -> KVCache:
    """Row ``row`` of a batch ``layer``: our KVCache holding its ``n`` tokens."""
    one = layer.extract(row)
    if one.offset != n:
        raise RuntimeError(f"a batch row holds {one.offset} tokens but recorded {n}")
    return one


__all__ = ["batch_refusal", "BatchRow", "DecodeBatch"]
