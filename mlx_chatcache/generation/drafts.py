"""Where speculative decoding's drafts come from: a draft model, the request's own tokens
(prompt lookup), the tokens the store holds for the model (store drafts).

Contract of a draft source (used by :mod:`.speculative`, one per generation):

- ``start(context)``: the sequence the generation continues (every token fed so far and
  the ones still to feed), called once before the first round;
- ``propose(k) -> Drafts``: at most ``k`` tokens that may continue the context (fewer,
  or none, when the source has no good guess);
- ``advance(tokens, accepted)``: the round's outcome: the context grew by ``tokens`` (the
  accepted drafts, then the target's own token), ``accepted`` of them drafts;
- ``finish(n)``: the generation ended holding the context's first ``n`` tokens in the
  cache; a source with layers of its own makes them hold exactly those.

:class:`PromptLookup` matches the context's last ``ngram`` tokens (then shorter n-grams,
down to ``min_ngram``) against the context itself and proposes what followed the latest
earlier occurrence; its index (n-gram -> where it last ended) grows with the context, one
dictionary entry per position and n-gram size. Given a store's
:class:`~mlx_chatcache.store.draft_index.DraftIndex` (the tokens the store holds for the
model), an n-gram the context does not hold earlier is looked up there before a shorter one
is tried: the longest match wins, the request's own on a tie. :class:`DraftModel` runs the draft model of a
:class:`~mlx_chatcache.models.draft_pair.DraftPair` on its own layers of the prompt cache:
they hold the context's tokens the target's layers hold, except right after a round whose
drafts were all accepted (its last draft is fed with the next round's tokens) and until
``finish``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from ..config import LOOKUP_MIN_NGRAM
from ..files.prompt_cache import PromptCache
from .model_call import call_model
from .sample import Sampler


@dataclass(frozen=True)
class Drafts:
    """Drafted tokens: ``tokens`` (host ids) or ``array`` ``(k,)`` (still being computed),
    and ``logprobs`` ``(k, V)``, the distribution each was drawn from (None: chosen, not drawn)."""

    tokens: list[int] | None = None
    array: mx.array | None = None
    logprobs: mx.array | None = None

    def __len__(self) -> int:
        return len(self.tokens) if self.tokens is not None else (0 if self.array is None else self.array.shape[0])


NO_DRAFTS = Drafts([])


class PromptLookup:
    """Drafts from n-gram matches in the generation's own tokens and, with ``index`` (a
    :class:`~mlx_chatcache.store.draft_index.DraftIndex`), in the tokens the store holds (see
    the module docstring)."""

    def __init__(self, ngram: int, min_ngram: int = LOOKUP_MIN_NGRAM, index=None):
        self.sizes = list(range(max(ngram, 1), max(min(min_ngram, ngram), 1) - 1, -1))  # longest first
        self.index = index
        self.seq: list[int] = []
        self._ends: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # positions j < _indexed are indexed (the n-grams ending before j)

    def start(self, context: Sequence[int]) -> None:
        self.seq = [int(t) for t in context]

    def _index(self) -> None:
        """Index every n-gram that ends before position j, for j up to the last token
        (each followed by the token at j)."""
        seq, stop = self.seq, len(self.seq)
        for n, ends in self._ends.items():
            for j in range(max(self._indexed, n), stop):
                ends[tuple(seq[j - n : j])] = j
        self._indexed = stop

    def propose(self, k: int) -> Drafts:
        """What followed the context's last n-gram, the longest size first: its latest earlier
        occurrence in the context, else in the index."""
        self._index()
        seq, end = self.seq, len(self.seq)
        for n in self.sizes:
            if end < n:
                continue
            j = self._ends[n].get(tuple(seq[end - n :]))
            if j is not None and j < end:
                return Drafts(seq[j : j + k])
            found = self.index.lookup(seq[end - n :], k, n) if self.index is not None else []
            if found:
                return Drafts(found)
        return NO_DRAFTS

    def advance(self, tokens: Sequence[int], accepted: int) -> None:
        self.seq.extend(int(t) for t in tokens)

    def finish(self, n: int) -> None:
        del self.seq[n:]


class DraftModel:
    """The draft model of a :class:`~mlx_chatcache.models.draft_pair.DraftPair` (see the
    module docstring). Its drafts are drawn from ``distribution`` of its log-probabilities
    (the target's sampling distribution: the speculative-sampling rule then applies), else
    chosen by ``sampler`` (greedy, or a sampler whose distribution is unknown)."""

    def __init__(self, pair, state: PromptCache, sampler: Sampler,
                 distribution: Callable[[mx.array], mx.array] | None):  # fmt: skip
        self.pair, self.state = pair, state
        self.sampler, self.distribution = sampler, distribution
        self.context: list[int] = []
        self.held = len(state.tokens)  # context tokens its layers hold
        self._drafted = 0  # drafts fed to its layers in the current round

    def _layers(self) -> list:
        return self.state.cache[self.pair.split :]  # read each time: KV quantization replaces layers

    def behind(self) -> int:
        """Context tokens its layers will be fed before its next draft."""
        return len(self.context) - self.held

    def start(self, context: Sequence[int]) -> None:
        self.context = [int(t) for t in context]

    def propose(self, k: int) -> Drafts:
        layers, draft = self._layers(), self.pair.draft
        tokens, dists = [], []
        x: Sequence[int] | mx.array = self.context[self.held :]  # at least the token the target sampled last
        for i in range(k):
            logits = call_model(draft, x, layers, sampled=i > 0)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if self.distribution is not None:
                q = self.distribution(logprobs)
                y = mx.random.categorical(q, axis=-1)
                dists.append(q)
            else:
                y = self.sampler(logprobs)
            mx.async_eval(y)
            tokens.append(y)
            x = y[None]
        self.held = len(self.context)
        self._drafted = max(k - 1, 0)
        if not tokens:
            return Drafts([])
        return Drafts(None, mx.concatenate(tokens).astype(mx.uint32), mx.concatenate(dists) if dists else None)

    def advance(self, tokens: Sequence[int], accepted: int) -> None:
        keep = min(accepted, self._drafted)  # the accepted drafts its layers were fed
        self._trim(self._layers(), self._drafted - keep)
        self.held += keep
        self._drafted = 0
        self.context.extend(int(t) for t in tokens)

    def finish(self, n: int) -> None:
        layers = self._layers()
        if self.held > n:
            self._trim(layers, self.held - n)
        elif self.held < n:
            call_model(self.pair.draft, self.context[self.held : n], layers)
            mx.eval([c.eval_arrays() for c in layers])
        self.held = n
        del self.context[n:]

    @staticmethod
    def _trim(layers, n: int) -> None:
        if n > 0:
            for c in layers:
                c.trim(n)


__all__ = ["Drafts", "NO_DRAFTS", "PromptLookup", "DraftModel"]
