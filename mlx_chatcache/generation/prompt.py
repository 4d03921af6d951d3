"""A prompt cache together with the exact token ids it has been fed.

Contract: a :class:`PromptCache` pairs ``cache`` (one cache per layer)
with ``tokens``, the ids that cache has been fed, in order, so
``len(tokens)`` equals the cache offset; ``shape`` (a
:class:`~mlx_chatcache.config.CacheShape`: a rotating window pinning its first
``keep`` tokens, the KV quantization it was made with) lets an empty cache of
the same shape be rebuilt. The functions here keep that
pairing when a state is reused for a new prompt: :func:`reuse_prefix` reduces
a state to the longest part of a prompt it already holds, :func:`trim_state`
trims it back to a given length when every layer can be trimmed. Feeding and
sampling live in :mod:`mlx_chatcache.generation.loop`. All defaults come from
:data:`~mlx_chatcache.config.DEFAULTS`.

It is the one value type for "a cache and what it holds": it also carries the
``fingerprint`` of the model that made it, the chat ``messages`` or raw
``text`` the tokens are (None when unknown) and JSON-able ``settings``.
:meth:`PromptCache.save` writes all of it to one cache file, atomically,
through the door (:mod:`mlx_chatcache.files.cache_file`);
:meth:`PromptCache.load` reads one back for a model and refuses a file made
for another model, one whose layers the model does not make and one that does
not list its token ids. ``loop``/``stream_generate`` reuse and update it,
``mlxcc cache-prompt``/``loop`` save and load it, a chat session holds one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..cache import BaseCache, cache_offset, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from ..config import CacheShape, GenerationConfig, SettingError, check_setting, check_window
from ..errors import CacheFormatError, UsageError
from ..files import cache_file
from ..files.mlxcc_format import check_cache_fits_model, load_cache_file
from ..files.tokens import common_prefix_len
from ..models.fingerprint import ModelFingerprint


# ------------------------------------------------------------------ state
@dataclass
class PromptCache:
    """A prompt cache, the exact tokens it has been fed (``len == offset``) and what they are.

    ``cache`` and ``tokens`` are updated in place by the functions below.
    ``shape`` records the cache's shape so it can be rebuilt.
    ``fingerprint`` names the model that made it; ``messages`` (a chat) or
    ``text`` (raw text, no chat template) say what the tokens are, when known;
    ``settings`` are saved with the file, ``metadata`` (free user strings) and
    ``snapshots`` (layer copies of earlier points: a chat's checkpoints) too when
    the store puts it into a named file. The caller keeps ``messages``/``text``
    in step with ``tokens`` (:meth:`reset` leaves them alone).
    """

    cache: list[BaseCache]
    tokens: list[int] = field(default_factory=list)
    shape: CacheShape = CacheShape()
    fingerprint: ModelFingerprint | None = None
    messages: list[dict] | None = None  # chat mode
    text: str | None = None  # raw mode
    settings: dict = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    snapshots: list[list[BaseCache | None]] = field(default_factory=list)  # earlier points a named file keeps

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
        cache = make_prompt_cache(model, max_kv_size, keep)
        return cls(cache, [], shape, getattr(model, "fingerprint", None), settings=_policy(model))

    @property
    def mode(self) -> str:
        return "chat" if self.messages is not None else "raw"

    def reset(self, model) -> None:
        """Drop the cache and its tokens: a fresh empty cache of the same shape."""
        self.cache[:] = make_prompt_cache(model, self.shape.max_kv_size, self.shape.keep)
        del self.tokens[:]

    # ------------------------------------------------------------ files
    def save(self, path, metadata: dict[str, str] | None = None, *, force: bool = False) -> None:
        """Write everything to the cache file ``path`` atomically (``metadata``: free user
        strings) through the door (:mod:`mlx_chatcache.files.cache_file`): ``path`` is the
        :class:`~mlx_chatcache.files.cache_file.Claim` the caller holds, or a path claimed
        for the write (``force``: even over a file that is not a cache, or a chat session)."""
        settings = dict(self.settings)
        settings.update(max_kv_size=self.shape.max_kv_size, keep=self.shape.keep)
        cache_file.write(
            path, self.cache, tokens=self.tokens, model=self.fingerprint,
            messages=self.messages, text=self.text, settings=settings, metadata=metadata, force=force,
        )  # fmt: skip

    @classmethod
    def load(cls, path, model) -> "PromptCache":
        """The prompt cache saved at ``path``, for ``model``: checks fingerprint, layers and token ids."""
        cache, info = load_cache_file(path, model=model.fingerprint)
        if info.tokens is None:
            raise CacheFormatError(
                f"{path} does not say which tokens it holds (written by {info.layout}); "
                "rebuild it with 'mlxcc cache-prompt'"
            )
        settings = info.settings
        prompt = cls.fitted(model, cache, info.tokens, CacheShape.recorded(settings, path), path)
        prompt.messages, prompt.text = info.messages, info.text
        prompt.settings = {**settings, **prompt.settings}  # the weight policy: this model's from now on
        return prompt

    @classmethod
    def fitted(cls, model, cache, tokens, shape: CacheShape, path) -> "PromptCache":
        """A cache loaded from ``path`` and its ``tokens`` as a prompt cache of ``shape``;
        ModelMismatchError when its layers are not the kinds ``model`` makes."""
        check_cache_fits_model(cache, make_prompt_cache(model, shape.max_kv_size, shape.keep), path)
        return cls(cache, list(tokens), shape, getattr(model, "fingerprint", None), settings=_policy(model))


def _policy(model) -> dict:
    """``{"weights": policy}`` of a model loaded by :func:`mlx_chatcache.models.loading.load`
    (recorded in cache files, informational: caches of every policy load; see
    docs/cache-format.md), else ``{}``."""
    report = getattr(model, "weight_report", None)
    return {"weights": report.policy} if report is not None else {}



def ensure_state(model, state: PromptCache | None, config: GenerationConfig) -> PromptCache:
    """``state``, or a new one shaped by ``config``; rejects a conflicting shape."""
    if state is None:
        return PromptCache.new(model, config.shape)
    made = state.shape
    if config.max_kv_size is not None and (config.max_kv_size, config.keep) != (made.max_kv_size, made.keep):
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


__all__ = ["PromptCache", "ensure_state", "reuse_prefix", "trim_state"]
