"""A prompt cache: the one value for "a cache and the exact token ids it holds".

Contract: a :class:`PromptCache` pairs ``cache`` (one cache per layer) with
``tokens``, the ids that cache has been fed, in order, so ``len(tokens)``
equals the cache offset; ``shape`` (a :class:`~mlx_chatcache.config.CacheShape`:
a rotating window pinning its first ``keep`` tokens, the KV quantization it was
made with) lets an empty cache of the same shape be rebuilt. It also carries the
``fingerprint`` of the model that made it, the chat ``messages`` or raw
``text`` the tokens are (None when unknown) and JSON-able ``settings``.

It is what a cache file holds, so it lives with the files: :meth:`PromptCache.save`
writes all of it to one cache file, atomically, through the door
(:mod:`mlx_chatcache.files.cache_file`); :meth:`PromptCache.load` reads one back
for a model and refuses, in one line each, a file made for another model, one
recorded with other cache settings than the caller runs it with, one whose
layers the model does not make and one that does not list its token ids (the
header's checks: :mod:`mlx_chatcache.files.named_file`). Every file a user names
(a chat session, ``/save``, ``cache-prompt``, ``generate``'s files) is written
and read by these two; mlx-lm's files, which list no token ids, are read by
:mod:`mlx_chatcache.generation.untokenized`. The store
(:meth:`~mlx_chatcache.store.store.PromptStore.checkout`) hands one out, a chat
session holds one, generation reuses and updates it
(:mod:`mlx_chatcache.generation.prompt`: reuse, trim).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cache import BaseCache, make_prompt_cache
from ..cache.cache_kv import hold_kv_in
from ..config import CacheShape, SettingError, check_setting, check_window
from ..errors import CacheFileError, UsageError
from ..models.fingerprint import ModelFingerprint
from . import cache_file
from .mlxcc_format import check_cache_fits_model, load_cache_file, read_cache_info
from .named_file import check_named_file, recorded_shape
from .registry import CacheFileInfo


@dataclass
class PromptCache:
    """A prompt cache, the exact tokens it has been fed (``len == offset``) and what they are.

    ``cache`` and ``tokens`` are updated in place by the functions below.
    ``shape`` records the cache's shape so it can be rebuilt.
    ``fingerprint`` names the model that made it; ``messages`` (a chat) or
    ``text`` (raw text, no chat template) say what the tokens are, when known;
    ``settings``, ``metadata`` (free user strings) and ``snapshots`` (layer copies
    of earlier points: a chat's checkpoints) are saved with the file. The caller
    keeps ``messages``/``text`` in step with ``tokens`` (:meth:`reset` leaves them alone).
    """

    cache: list[BaseCache]
    tokens: list[int] = field(default_factory=list)
    shape: CacheShape = CacheShape()
    fingerprint: ModelFingerprint | None = None
    messages: list[dict] | None = None  # chat mode
    text: str | None = None  # raw mode
    settings: dict = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    snapshots: list[list[BaseCache | None]] = field(default_factory=list)  # earlier points the file keeps

    @classmethod
    def new(cls, model, shape: CacheShape | None = None) -> "PromptCache":
        """An empty prompt cache for ``model`` of ``shape`` (None: the defaults; rotating
        when ``max_kv_size`` is set: a window of more than the ``keep`` tokens it pins,
        else UsageError)."""
        shape = shape or CacheShape()
        max_kv_size, keep = shape.max_kv_size, shape.keep
        if max_kv_size is not None:
            try:
                check_setting("keep", keep)
                check_window(check_setting("max_kv_size", max_kv_size), keep)
            except SettingError as e:
                raise UsageError(e.named) from None
        cache = make_prompt_cache(model, max_kv_size, keep, shape.kv_dtype)
        return cls(cache, [], shape, getattr(model, "fingerprint", None), settings=_policy(model))

    @property
    def mode(self) -> str:
        return "chat" if self.messages is not None else "raw"

    def reset(self, model) -> None:
        """Drop the cache and its tokens: a fresh empty cache of the same shape."""
        self.cache[:] = make_prompt_cache(model, self.shape.max_kv_size, self.shape.keep, self.shape.kv_dtype)
        del self.tokens[:]

    # ------------------------------------------------------------ files
    def save(self, path, *, force: bool = False) -> None:
        """Write all of it (layers, token ids, messages or text, the settings with this
        shape, metadata, snapshots) to the cache file ``path`` atomically, through the
        door (:mod:`mlx_chatcache.files.cache_file`): ``path`` is the
        :class:`~mlx_chatcache.files.cache_file.Claim` the caller holds, or a path claimed
        for the write (``force``: even over a file that is not a cache, or a chat session)."""
        cache_file.write(
            path, self.cache, tokens=self.tokens, model=self.fingerprint, messages=self.messages, text=self.text,
            settings=self.shape.recording(self.settings), metadata=self.metadata, force=force,
            snapshots=self.snapshots,
        )  # fmt: skip

    @classmethod
    def load(cls, path, model, shape: CacheShape | None = None, *, what: str = "cache file",
             header: CacheFileInfo | None = None) -> "PromptCache":  # fmt: skip
        """The prompt cache saved at ``path``, for ``model``, strictly: the header passes
        :func:`~mlx_chatcache.files.named_file.check_named_file` (this model's, token ids
        listed, recorded with ``shape``'s settings; ``what`` names the file kind in a
        ModelMismatchError), then the layers are read and must be the kinds the model makes
        and hold the header's token ids. ``shape``: the shape the caller runs it with (None:
        the file's own, :func:`~mlx_chatcache.files.named_file.recorded_shape`);
        ``header``: the file's header as the caller just read it (not read again).
        Settings, messages or text come from the file; metadata and snapshots do not."""
        fingerprint = getattr(model, "fingerprint", None)
        info = read_cache_info(path) if header is None else header
        check_named_file(info, path, fingerprint=fingerprint, shape=shape, what=what)
        if shape is None:
            shape = CacheShape.recorded({**info.settings, **recorded_shape(info)}, path)
        cache, loaded = load_cache_file(path, model=fingerprint, what=what)
        if loaded.tokens != info.tokens:
            raise CacheFileError(f"{path} changed while it was read; run the command again")
        prompt = cls.fitted(model, cache, info.tokens, shape, path)
        prompt.messages, prompt.text = loaded.messages, loaded.text
        prompt.settings = {**loaded.settings, **prompt.settings}  # the weight policy: this model's from now on
        return prompt

    @classmethod
    def fitted(cls, model, cache, tokens, shape: CacheShape, path) -> "PromptCache":
        """A cache loaded from ``path`` and its ``tokens`` as a prompt cache of ``shape``;
        ModelMismatchError when its layers are not the kinds ``model`` makes; its K/V
        layers hold what they are fed from now on in ``shape.kv_dtype``."""
        check_cache_fits_model(cache, make_prompt_cache(model, shape.max_kv_size, shape.keep), path)
        hold_kv_in(cache, shape.kv_dtype)
        return cls(cache, list(tokens), shape, getattr(model, "fingerprint", None), settings=_policy(model))


def _policy(model) -> dict:
    """``{"weights": policy}`` of a model loaded by :func:`mlx_chatcache.models.loading.load`
    (recorded in cache files, informational: caches of every policy load; see
    docs/cache-format.md), else ``{}``."""
    report = getattr(model, "weight_report", None)
    return {"weights": report.policy} if report is not None else {}


__all__ = ["PromptCache"]
