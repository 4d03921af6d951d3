"""A prompt cache together with what it holds, as stored in a cache file.

A :class:`StoredPrompt` pairs a :class:`PromptCacheState` (cache + token ids)
with either the chat ``messages`` it holds or the raw ``text`` (caches made
without a chat template). ``load_stored_prompt`` refuses files made for another
model and files that cannot tell which tokens they hold (``state_for_model``,
also used for chat session files, refuses a cache whose layers the model does
not make); ``save_stored_prompt`` writes everything atomically.
``render_chat`` turns messages into token ids with the tokenizer's chat
template (``chat_text`` then ``encode_text``, which chat sessions use too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .cache import cache_offset, make_prompt_cache
from .cache_io import check_cache_fits_model, load_prompt_cache, save_prompt_cache
from .config import DEFAULTS
from .errors import CacheFormatError, UsageError
from .generate import prefill
from .prompt_state import PromptCacheState


@dataclass
class StoredPrompt:
    state: PromptCacheState
    messages: list[dict] | None = None  # chat mode
    text: str | None = None  # raw mode
    settings: dict = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return "chat" if self.messages is not None else "raw"


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                template_kwargs: dict | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    if not has_chat_template(tokenizer):
        raise UsageError("this model's tokenizer has no chat template; pass --ignore-chat-template")
    text = chat_text(tokenizer, messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs)
    return encode_text(tokenizer, text)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_text(tokenizer, messages, *, add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
    """``messages`` rendered with the tokenizer's chat template, as text (template errors propagate)."""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
    )


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of rendered text: the template writes any special tokens itself."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def load_stored_prompt(path, model) -> StoredPrompt:
    """Load a cache file for ``model``: checks fingerprint, layers and token ids."""
    cache, info = load_prompt_cache(path, return_metadata=True, model=model.fingerprint)
    if info.tokens is None:
        raise CacheFormatError(
            f"{path} does not say which tokens it holds (written by {info.layout}); "
            "rebuild it with 'mlxcc cache-prompt'"
        )
    settings = info.settings
    max_kv_size, keep = settings.get("max_kv_size"), settings.get("keep", DEFAULTS.keep)
    if max_kv_size is not None and (type(max_kv_size) is not int or type(keep) is not int):
        raise CacheFormatError(f"{path}: settings max_kv_size/keep are not integers; the file is damaged")
    state = state_for_model(model, cache, info.tokens, max_kv_size, keep, path)
    return StoredPrompt(state, info.messages, info.text, settings)


def state_for_model(model, cache, tokens, max_kv_size: int | None, keep: int, path) -> PromptCacheState:
    """A cache loaded from ``path`` and its ``tokens`` as a state of the given
    shape; ModelMismatchError when its layers are not the kinds ``model`` makes."""
    check_cache_fits_model(cache, make_prompt_cache(model, max_kv_size, keep), path)
    return PromptCacheState(cache, list(tokens), max_kv_size, keep)


def save_stored_prompt(path, model, stored: StoredPrompt, metadata: dict | None = None) -> None:
    settings = dict(stored.settings)
    settings.update(max_kv_size=stored.state.max_kv_size, keep=stored.state.keep)
    if getattr(model, "weight_report", None) is not None:  # informational: caches of all policies load
        settings["weights"] = model.weight_report.policy
    save_prompt_cache(
        path, stored.state.cache, tokens=stored.state.tokens, model=model.fingerprint,
        messages=stored.messages, text=stored.text, settings=settings, metadata=metadata,
    )  # fmt: skip


def feed_all(model, state: PromptCacheState, tokens: list[int], prefill_step_size: int,
             progress=None) -> None:
    """Feed every one of ``tokens`` into an empty ``state`` (no sampling)."""
    if state.tokens or cache_offset(state.cache):
        raise UsageError("feed_all needs an empty prompt cache")
    rest = prefill(model, state.cache, tokens, prefill_step_size, progress)
    model(mx.array(rest, dtype=mx.uint32)[None], cache=state.cache)  # (1, 1) in
    mx.eval([c.eval_arrays() for c in state.cache])
    state.tokens.extend(tokens)
    if progress:
        progress(len(tokens), len(tokens))
