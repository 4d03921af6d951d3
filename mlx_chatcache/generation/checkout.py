"""Prompt caches through the store (:class:`~mlx_chatcache.store.store.PromptStore`),
the one interface ``mlxcc serve``'s worker, ``mlxcc generate`` and chat
sessions use to find and keep caches.

Contract
--------
- ``config.shape`` (:class:`~mlx_chatcache.config.CacheShape`) is what shapes a cache (the window, KV
  quantization); every named file mlxcc writes records them
  (:meth:`~mlx_chatcache.config.CacheShape.recording`), so the strict file tier
  can refuse a run with other ones. :func:`prompt_scope` is the store :class:`~mlx_chatcache.store.tiers.Scope`
  of a model, those settings and the weight policy applied to the model
  (``--weights``: it changes the arithmetic, so a shared entry of another
  policy is not used; a named file of another policy is, see
  docs/cache-format.md). Entries of another scope are never used, so a
  command and a server share entries exactly when model, settings and policy agree.
- :func:`shared_tiers` is the tier ``--cache-dir DIR`` adds to a command:
  the disk tier a server run with the same ``--cache-dir`` uses (our file
  format), or nothing. DIR must be a store folder (new, empty, marked or a
  server's: see :func:`mlx_chatcache.store.disk.claim_folder`; else a one-line
  UsageError). A command has no byte budget there: it never evicts, it
  only adds its entries; the server owning DIR enforces its budget.
- :meth:`PromptStore.checkout <mlx_chatcache.store.store.PromptStore.checkout>`
  (called with a scope made here) hands out the longest cached prefix of a prompt
  as a :class:`~mlx_chatcache.files.prompt_cache.PromptCache`, not yet trimmed to
  the prompt: :func:`~mlx_chatcache.generation.prompt.reuse_prefix` (which
  ``stream_generate`` calls) does that, and says how many tokens were reused.
- :func:`put_prompt` stores a prompt cache in every tier, the named file with
  its messages or text, settings and metadata; a shared tier that fails is reported, in one line, to ``warn``
  (the named file is what the user asked for: its errors are raised). The
  shared tiers are skipped when ``shared=False`` (a cache whose tokens were
  only assumed, mlx-lm's files) and, with one line to ``warn``, when the
  cache's layers are not what the scope's KV quantization makes (a quantized
  cache under an unquantized scope would change other runs' answers).
"""

from __future__ import annotations

import os
from typing import Callable

from ..cache import kv_quantization_mismatch
from ..config import GenerationConfig
from ..models.fingerprint import ModelFingerprint
from ..store.store import PromptStore
from ..store.disk import DiskTier
from ..store.store import Scope, make_scope
from ..store.tiers import Tier
from ..files.prompt_cache import PromptCache


def prompt_scope(model, config: GenerationConfig) -> Scope:
    report = getattr(model, "weight_report", None)
    return scope_of(getattr(model, "fingerprint", None), config, report.policy if report is not None else None)


def scope_of(fingerprint: ModelFingerprint | None, config: GenerationConfig, policy: str | None = None) -> Scope:
    """The scope of caches a model with ``fingerprint`` and weight ``policy`` (the
    applied one, ``model.weight_report.policy``; None: unknown) makes with
    ``config``. Without a fingerprint (a model not loaded by
    :func:`mlx_chatcache.load`) the namespace is empty: only a named file can
    hold such caches, never a shared tier."""
    settings = config.shape.settings()
    if policy is not None:
        settings["weights"] = policy
    if fingerprint is None:
        return Scope("", None, settings)
    return make_scope(fingerprint, settings)


def shared_tiers(cache_dir: str | os.PathLike | None) -> list[Tier]:
    """The disk tier in ``cache_dir`` (made if missing), or [] without one; no
    budget: a command only adds entries, it never evicts a server's (module doc)."""
    if cache_dir is None:
        return []
    return [DiskTier(os.path.expanduser(cache_dir), None)]


def put_prompt(store: PromptStore, scope: Scope, state: PromptCache, warn: Callable[[str], None],
               shared: bool = True) -> None:  # fmt: skip
    """Store ``state`` in every tier of ``store`` (see the module doc)."""

    def failed(tier: Tier, e: Exception) -> None:
        warn(f"the prompt cache was not stored in the {tier.name} tier: {e}")

    anonymous = [t for t in store.tiers if not t.named]
    if anonymous and shared:
        s = scope.settings
        why = kv_quantization_mismatch(state.cache, s.get("kv_bits"), s.get("kv_group_size"),
                                       s.get("quantized_kv_start") or 0)  # fmt: skip
        if why is not None:
            warn(f"the prompt cache was not stored in the {', '.join(t.name for t in anonymous)} tier: {why}")
            shared = False
    if not shared:
        store = PromptStore([t for t in store.tiers if t.named])
    store.put(scope, state.tokens, state.cache, prompt=state, on_error=failed)


__all__ = ["prompt_scope", "scope_of", "shared_tiers", "put_prompt"]
