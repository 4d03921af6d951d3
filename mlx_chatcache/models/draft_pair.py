"""A model and its draft model as one model for prompt caches (speculative decoding).

Contract
--------
:class:`DraftPair` ``(target, draft)`` stands for the target model wherever a prompt cache
is made, fed, saved or stored, so that cache holds both models' layers in mlx-lm's layout
for speculative decoding: the target's layers, then the draft's
(``prompt_cache[:pair.split]`` are the target's, as mlx-lm's
``prompt_cache[:len(model.layers)]``).

- ``make_cache()``: the target's caches then the draft's (each model's own
  ``make_cache()``, else one K/V cache per layer);
- ``pair(inputs, cache=layers)`` feeds both models the same tokens (each its layers) and
  returns the target's output, so prefill, chat checkpoints and the server's batch feed
  both; speculative decoding (:mod:`mlx_chatcache.generation.speculative`) calls
  ``target`` and ``draft`` on their own layers;
- ``fingerprint``: the target's with the draft's as its ``draft``
  (:class:`~mlx_chatcache.models.fingerprint.ModelFingerprint`): files, sessions and store
  scopes of a pair are never mixed with those of the target alone; None unless both have one;
- ``source``: the target's, with ``draft_model`` (the draft's ``model`` reference);
- every other attribute (``model_type``, ``args``, ``weight_report``, ``named_modules``,
  the token embedding) is the target's.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import UsageError


def _caches_of(model) -> list:
    """``model.make_cache()``, or mlx-lm's K/V cache per layer (what mlx-lm makes for it)."""
    if hasattr(model, "make_cache"):
        return list(model.make_cache())
    from mlx_lm.models.cache import KVCache

    return [KVCache() for _ in model.layers]


class DraftPair:
    def __init__(self, target, draft):
        if isinstance(target, DraftPair) or isinstance(draft, DraftPair):
            raise UsageError("a draft model cannot itself be paired with a draft model; pass one model each")
        if not callable(draft) or not (hasattr(draft, "make_cache") or hasattr(draft, "layers")):
            raise UsageError(
                f"draft_model must be a model loaded like the target (mlx_chatcache.load), got {type(draft).__name__}"
            )
        self.target, self.draft = target, draft
        self.split = len(_caches_of(target))
        fp_t, fp_d = getattr(target, "fingerprint", None), getattr(draft, "fingerprint", None)
        self.fingerprint = fp_t.with_draft(fp_d) if fp_t is not None and fp_d is not None else None
        source = getattr(target, "source", None)
        if source is not None:
            self.source = {**source, "draft_model": (getattr(draft, "source", None) or {}).get("model")}

    def make_cache(self) -> list:
        return _caches_of(self.target) + _caches_of(self.draft)

    @property
    def layers(self) -> list:
        return list(self.target.layers) + list(self.draft.layers)

    def target_layers(self, cache: Sequence) -> list:
        return list(cache[: self.split])

    def draft_layers(self, cache: Sequence) -> list:
        return list(cache[self.split :])

    def __call__(self, inputs, cache=None):
        out = self.target(inputs, cache=None if cache is None else cache[: self.split])
        self.draft(inputs, cache=None if cache is None else cache[self.split :])
        return out

    def __getattr__(self, name: str):
        if name in ("target", "draft", "split", "source"):  # not set yet (or no source): not the target's
            raise AttributeError(name)
        return getattr(self.target, name)


def unpaired(model):
    """The target of a :class:`DraftPair`, else ``model`` itself."""
    return model.target if isinstance(model, DraftPair) else model


__all__ = ["DraftPair", "unpaired"]
