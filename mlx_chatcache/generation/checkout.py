"""Prompt caches through the store (:class:`~mlx_chatcache.store.store.PromptStore`),
the one interface ``mlxcc serve``'s worker, ``mlxcc generate`` and chat
sessions use to find and keep caches, and beside it the cache file a user
named (read and written as a :class:`~mlx_chatcache.files.prompt_cache.PromptCache`).

Contract
--------
- ``config.shape`` (:class:`~mlx_chatcache.config.CacheShape`) is what shapes a cache (the window, KV
  quantization); every named file mlxcc writes records them
  (:meth:`~mlx_chatcache.config.CacheShape.recording`), so loading one
  (:meth:`PromptCache.load <mlx_chatcache.files.prompt_cache.PromptCache.load>`)
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
- :func:`checkout_prompt` hands out the longest cached prefix of a prompt as a
  :class:`~mlx_chatcache.files.prompt_cache.PromptCache`, from the store's
  tiers (:meth:`PromptStore.checkout <mlx_chatcache.store.store.PromptStore.checkout>`)
  or a named file (read strictly: its errors are raised, whether or not it
  serves), not yet trimmed to the prompt:
  :func:`~mlx_chatcache.generation.prompt.reuse_prefix` (which
  ``stream_generate`` calls) does that, and says how many tokens were reused.
- :func:`put_prompt` writes a prompt cache to the named file, when there is one
  (:meth:`PromptCache.save <mlx_chatcache.files.prompt_cache.PromptCache.save>`,
  through the door: also an empty cache; its errors are raised: the file is what
  the user asked for), then puts it into the store's tiers; a tier that fails is
  reported, in one line, to ``warn``. The store's tiers are skipped for an empty
  cache, a model without a fingerprint, when ``shared=False`` (a cache whose
  tokens were only assumed, mlx-lm's files) and, with one line to ``warn``, when
  the cache's layers are not what the scope's KV quantization makes (a quantized
  cache under an unquantized scope would change other runs' answers).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

from ..cache import can_trim_prompt_cache, kv_quantization_mismatch
from ..config import SERVER_DEFAULTS, CacheShape, GenerationConfig
from ..files.cache_file import Claim
from ..files.mlxcc_format import read_cache_info
from ..files.named_file import check_named_file
from ..files.prompt_cache import PromptCache
from ..files.registry import CacheFileInfo
from ..files.tokens import common_prefix_len
from ..models.fingerprint import ModelFingerprint
from ..store.store import PromptStore
from ..store.disk import DiskTier
from ..store.store import Scope, make_scope
from ..store.tiers import Tier


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


def store_draft_tokens(config: GenerationConfig) -> int:
    """The draft index capacity a command's store gets: ``SERVER_DEFAULTS.draft_index_tokens``
    when ``config`` asks for store drafts, else 0 (no index)."""
    return SERVER_DEFAULTS.draft_index_tokens if config.prompt_lookup == "store" else 0


def shared_tiers(cache_dir: str | os.PathLike | None) -> list[Tier]:
    """The disk tier in ``cache_dir`` (made if missing), or [] without one; no
    budget: a command only adds entries, it never evicts a server's (module doc)."""
    if cache_dir is None:
        return []
    return [DiskTier(os.path.expanduser(cache_dir), None)]


def checkout_prompt(store: PromptStore, scope: Scope, model, prompt: Sequence[int], shape: CacheShape,
                    named: str | os.PathLike | None = None,
                    header: CacheFileInfo | None = None) -> tuple[PromptCache, str | None]:  # fmt: skip
    """``(state, tier)`` as :meth:`PromptStore.checkout` returns them, with the cache
    file ``named`` (``header``: its header as the caller read it) as one more source,
    tier ``"file"``: the longer usable prefix of ``prompt[:-1]`` wins, the named file a
    tie. The named file's header is checked whether or not it serves; its tokens serve
    as far as they are a prefix of the prompt, all of them, or fewer when its cache can
    be trimmed back. Each source is read only when it may win."""
    query = list(prompt[:-1])
    n, full = 0, False  # what the named file can serve; whether it serves all it holds
    if named is not None:
        header = read_cache_info(named) if header is None else header
        check_named_file(header, named, fingerprint=scope.fingerprint, shape=shape)
        n = common_prefix_len(header.tokens, query)
        full = n == len(header.tokens)
    shared: tuple[PromptCache, str | None] | None = None
    if not (full and n == len(query)):  # else nothing serves more than the named file
        shared = store.checkout(scope, model, prompt, shape)
        if common_prefix_len(shared[0].tokens, query) > n:
            return shared
    if n:
        state = PromptCache.load(named, model, shape, header=header)
        if full or can_trim_prompt_cache(state.cache):  # trimmed back to n by reuse_prefix
            return state, "file"
    return shared or (PromptCache.new(model, shape), None)


def put_prompt(store: PromptStore | None, scope: Scope, state: PromptCache, warn: Callable[[str], None],
               named: Claim | str | os.PathLike | None = None, shared: bool = True,
               ends: Sequence[int] = ()) -> None:  # fmt: skip
    """Write ``state`` to the named file ``named`` (its claim, or a path claimed for the
    write; None: none), then put it into the tiers of ``store`` (None: none; ``ends``:
    shorter prefixes served exactly too, see :meth:`PromptStore.put`; see the module doc)."""
    if named is not None:
        state.save(named)
    shared = shared and store is not None and bool(store.tiers) and bool(state.tokens) \
        and scope.fingerprint is not None  # fmt: skip
    if not shared:
        return
    s = scope.settings
    why = kv_quantization_mismatch(state.cache, s.get("kv_bits"), s.get("kv_group_size"),
                                   s.get("quantized_kv_start") or 0)  # fmt: skip
    if why is not None:
        warn(f"the prompt cache was not stored in the {', '.join(t.name for t in store.tiers)} tier: {why}")
        return

    def failed(tier: Tier, e: Exception) -> None:
        warn(f"the prompt cache was not stored in the {tier.name} tier: {e}")

    store.put(scope, state.tokens, state.cache, on_error=failed, ends=ends)


__all__ = ["prompt_scope", "scope_of", "store_draft_tokens", "shared_tiers", "checkout_prompt", "put_prompt"]
