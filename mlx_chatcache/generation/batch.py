"""Decoding several prompt caches together: one model call per token for all their rows.

Contract
--------
:func:`batch_refusal` says why a model and config cannot be decoded in a batch (None:
they can): only caches whose every layer is exactly our float
:class:`~mlx_chatcache.cache.KVCache` and no KV quantization (a rotating window, a
quantized, chunked, SSM or hybrid cache keeps its own per-row layout).

A :class:`DecodeBatch` holds rows, each a :class:`BatchRow`: a
:class:`~mlx_chatcache.files.prompt_cache.PromptCache` fed all of its prompt but
the last token (by :func:`~mlx_chatcache.generation.feed.prefill`), the token to
feed next, and its own sampler and logits processors.

- :meth:`DecodeBatch.join` adds a row; its layers move into the batch's layers (each
  layer's ``merge``: mlx-lm's ``BatchKVCache`` for our ``KVCache``, see
  :mod:`mlx_chatcache.cache.batch`; the row's state holds none while it is in the batch);
- :meth:`DecodeBatch.step` returns the results of one model call ``(B, 1)``: for
  each row it fed, its fed token is recorded in its ``state.tokens`` and its next
  token sampled with its processors (which see its own tokens as the context) and
  sampler, as :func:`~mlx_chatcache.generation.loop.sample_token` does for one. The
  result is ``(token, logprobs (V,))`` per row, in row order; in its place the
  exception a row's processors raised (that row should leave), or None for a row
  that joined after the call began (its first token comes with the next step);
- while no row has logits processors and every layer can take a token back, a step
  starts the next call (feeding the tokens just sampled, before they are read) before
  it reads the results, so the host's work between steps overlaps the model's, as one
  generation feeds ahead;
- :meth:`DecodeBatch.leave` removes rows; each gets back a cache of our one-sequence
  layers holding exactly its ``state.tokens``, so its last sampled token is not fed
  (the rule of :mod:`mlx_chatcache.generation.loop`; a token fed ahead is trimmed off).

``DecodeBatch(model, keep_fed=True)`` runs in mlx-lm's ``BatchGenerator`` order instead
(:mod:`mlx_chatcache.generation.batch_api`): every step starts the next call before
reading the results, processors or not (a row's processors see its context built on the
device), and a row that leaves keeps its last sampled token fed (fed then, when it was not).

Greedy rows give the tokens they give alone, up to float rounding of the
batched products. The model calls run on
:data:`~mlx_chatcache.generation.device.generation_stream`. A model call that raises leaves the batch unusable: its
rows' states are emptied (``state.reset``) by :meth:`DecodeBatch.fail`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from ..cache import BaseCache, KVCache, make_prompt_cache
from ..config import GenerationConfig
from ..files.prompt_cache import PromptCache
from .device import generation_stream
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
    context: mx.array | None = None  # keep_fed: every token fed, on the device (its processors' context)
    base: int = 0  # tokens its cache held before those in state.tokens (a cache given without its tokens)


@dataclass
class _Call:
    """A model call being computed: the rows it fed (the batch's first ``len(rows)``),
    each one's sampled token and logprobs, or the exception its processors raised."""

    rows: list[BatchRow]
    tokens: list  # (1,) arrays, or exceptions
    logprobs: list  # (1, V) arrays, or None


class DecodeBatch:
    def __init__(self, model, keep_fed: bool = False):
        self.model, self.keep_fed = model, keep_fed
        self.rows: list[BatchRow] = []
        self._layers: list | None = None  # a batch cache (cache/batch.py) per model layer
        self._ahead: _Call | None = None  # the call started by the last step, not read yet
        self._undoable = True  # every layer joined takes a token back at every fill (feeding ahead is undone)

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, row: BatchRow) -> BatchRow:
        """Move ``row``'s layers into the batch (see the module docstring)."""
        merged = [type(c).merge([c]) for c in row.state.cache]
        self._undoable = self._undoable and all(c.always_trimmable() for c in row.state.cache)
        if self._layers is None:
            self._layers = merged
        else:
            for layer, m in zip(self._layers, merged):
                layer.extend(m)
        row.state.cache[:] = []
        if self.keep_fed and row.processors:
            row.context = mx.array(row.state.tokens, dtype=mx.uint32)
        self.rows.append(row)
        return row

    def step(self) -> list[tuple[int, mx.array] | Exception | None]:
        """The results of one model call for every row (see the module docstring)."""
        with mx.stream(generation_stream):
            return self._step()

    def _step(self) -> list[tuple[int, mx.array] | Exception | None]:
        call = self._ahead or self._start(self.rows, mx.array([r.next_token for r in self.rows], dtype=mx.uint32))
        self._ahead = None
        ok = all(not isinstance(t, Exception) for t in call.tokens)
        ahead = self.keep_fed or (self._undoable and not any(r.processors for r in self.rows))
        if ok and ahead:
            late = mx.array([r.next_token for r in self.rows[len(call.rows) :]], dtype=mx.uint32)
            self._ahead = self._start(self.rows, mx.concatenate([*(t for t in call.tokens), late]))
        results: list = []
        for r, t, lp in zip(call.rows, call.tokens, call.logprobs):
            r.state.tokens.append(r.next_token)
            if isinstance(t, Exception):
                results.append(t)
                continue
            r.next_token = t.item()
            results.append((r.next_token, lp[0]))
        return results + [None] * (len(self.rows) - len(call.rows))

    def _start(self, rows: list[BatchRow], inputs: mx.array) -> _Call:
        """Feed ``inputs`` ``(B,)``, one token per row, and start sampling each row's next token."""
        logits = call_model(self.model, inputs[:, None], self._layers, sampled=True)[:, -1, :]  # (B, V)
        call = _Call(list(rows), [], [])
        for i, r in enumerate(rows):
            if r.processors and self.keep_fed:  # the token fed now, appended on the device
                context = r.context = mx.concatenate([r.context, inputs[i : i + 1].astype(mx.uint32)])
            else:
                context = [*r.state.tokens, r.next_token] if r.processors else ()  # with the token fed now
            try:
                token, lp = sample_token(logits[i : i + 1], context, r.sampler, r.processors)
            except Exception as e:  # this row's processor: the others go on
                token, lp = e, None
            call.tokens.append(token)
            call.logprobs.append(lp)
        mx.async_eval([t for t in call.tokens if not isinstance(t, Exception)],
                      [lp for lp in call.logprobs if lp is not None])  # fmt: skip
        return call

    def leave(self, rows: Sequence[BatchRow]) -> None:
        """Take ``rows`` out; each gets its own cache back, holding its ``state.tokens``
        (``keep_fed``: and its last sampled token, recorded there)."""
        gone = {id(r) for r in rows}
        for i, r in enumerate(self.rows):
            if id(r) in gone:
                n = r.base + len(r.state.tokens)
                r.state.cache[:] = [_own_layer(layer, i, n, self.keep_fed) for layer in self._layers]
                if self.keep_fed:
                    self._keep_last(r)
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        self.rows = [self.rows[i] for i in keep]
        if self._ahead is not None:
            a = self._ahead
            fed = [i for i, r in enumerate(a.rows) if id(r) not in gone]
            self._ahead = _Call([a.rows[i] for i in fed], [a.tokens[i] for i in fed], [a.logprobs[i] for i in fed])
        if not keep:
            self._layers = self._ahead = None
            self._undoable = True
            return
        for layer in self._layers:
            layer.filter(mx.array(keep))

    def row_cache(self, row: BatchRow) -> tuple[list[BaseCache], list[int]]:
        """A copy of ``row``'s cache as it is now (our one-sequence layers) and the tokens it
        holds that ``row.state.tokens`` knows (with its last sampled token when it was fed)."""
        i = next(i for i, r in enumerate(self.rows) if r is row)
        layers = [layer.extract(i) for layer in self._layers]
        fed = max(c.offset for c in layers) > row.base + len(row.state.tokens)
        return layers, [*row.state.tokens, *([row.next_token] if fed else [])]

    def _keep_last(self, r: BatchRow) -> None:
        """Record ``r``'s last sampled token as fed (feeding it now when no call did)."""
        n = r.base + len(r.state.tokens)
        if max(c.offset for c in r.state.cache) == n:
            with mx.stream(generation_stream):
                call_model(self.model, [r.next_token], r.state.cache)
                mx.eval([c.eval_arrays() for c in r.state.cache])
        r.state.tokens.append(r.next_token)

    def fail(self, model) -> list[BatchRow]:
        """Empty every row's state (after a model call raised) and the batch; the rows."""
        rows, self.rows, self._layers, self._ahead, self._undoable = self.rows, [], None, None, True
        for r in rows:
            r.state.reset(model)
        return rows


def _own_layer(layer, row: int, n: int, keep_fed: bool = False) -> BaseCache:
    """Row ``row`` of a batch ``layer``: our one-sequence cache holding its ``n`` tokens (a token
    fed ahead is trimmed; ``keep_fed``: kept, so ``n + 1``)."""
    one = layer.extract(row)
    if one.offset == n + 1 and not keep_fed:
        one.trim(1)
    if one.offset != n and not (keep_fed and one.offset == n + 1):
        raise RuntimeError(f"a batch row holds {one.offset} tokens but recorded {n}")
    return one


__all__ = ["batch_refusal", "BatchRow", "DecodeBatch"]
