"""What a prompt cache holds: chat messages rendered to token ids, or all of a prompt fed.

A :class:`~mlx_chatcache.files.prompt_cache.PromptCache` (cache + token ids)
holds either the chat ``messages`` or the raw ``text`` (caches made
without a chat template); saving and loading it is
:meth:`~mlx_chatcache.files.prompt_cache.PromptCache.save` /
:meth:`~mlx_chatcache.files.prompt_cache.PromptCache.load`.
``feed_all`` feeds every token of a prompt into an empty one, without
sampling (what ``mlxcc cache-prompt`` saves).
``render_chat`` turns messages into token ids with the tokenizer's chat
template (``chat_text`` then ``encode_text``, which chat sessions use too).
"""

from __future__ import annotations

from ..cache import cache_offset
from ..errors import UsageError
from ..files.tokens import common_prefix_len
from .feed import consistent_on_error, prefill
from .pacing import CallPacer
from ..files.prompt_cache import PromptCache


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                template_kwargs: dict | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    if not has_chat_template(tokenizer):
        raise UsageError("this model's tokenizer has no chat template; pass --ignore-chat-template")
    text = chat_text(tokenizer, messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs)
    return encode_text(tokenizer, text)


def system_end(tokenizer, messages: list[dict], prompt: list[int], template_kwargs: dict | None = None) -> int | None:
    """How many tokens of ``prompt`` (``messages`` rendered) its leading system messages make,
    when other messages follow and the template renders them alone as a prefix of ``prompt``
    (else None): where conversations sharing a system prompt meet, token for token."""
    k = next((i for i, m in enumerate(messages) if not isinstance(m, dict) or m.get("role") != "system"), 0)
    if not 0 < k < len(messages):
        return None
    try:
        head = render_chat(tokenizer, messages[:k], add_generation_prompt=False, template_kwargs=template_kwargs)
    except Exception:  # a template that cannot render a system message alone
        return None
    return len(head) if 0 < len(head) < len(prompt) and prompt[: len(head)] == head else None


def default_system_prompt(tokenizer, template_kwargs: dict | None = None) -> str | None:
    """The system prompt the chat template writes into a conversation that has none
    (SmolLM2's "You are a helpful AI assistant ..."), or None: it writes none, or it
    does not render a system message where that text goes."""
    user = [{"role": "user", "content": "A"}]
    mark = "\u2063mlxcc-system\u2063"  # text no template writes itself
    try:
        bare = chat_text(tokenizer, user, template_kwargs=template_kwargs)
        given = chat_text(tokenizer, [{"role": "system", "content": mark}, *user], template_kwargs=template_kwargs)
    except Exception:  # a template that rejects a probe conversation shows no default
        return None
    before, found, after = given.partition(mark)
    if not found or len(bare) <= len(before) + len(after):
        return None
    if not (bare.startswith(before) and bare.endswith(after)):
        return None
    return bare[len(before) : len(bare) - len(after)] or None


def history_start(tokenizer, messages: list[dict], rendered: str, template_kwargs: dict | None = None) -> int:
    """Where the messages after the leading system messages start in ``rendered`` (``messages``
    rendered without a generation prompt): the length of the system messages rendered alone,
    or of the template's default system prompt when there are none; 0 when that rendering
    does not start ``rendered``."""
    k = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    head = messages[:k]
    if not head:
        default = default_system_prompt(tokenizer, template_kwargs)
        head = [{"role": "system", "content": default}] if default is not None else []
    try:
        text = chat_text(tokenizer, head, add_generation_prompt=False, template_kwargs=template_kwargs) if head else ""
    except Exception:  # a template that cannot render a system message alone
        return 0
    return len(text) if rendered.startswith(text) else 0


def pinned_head(tokenizer, system: list[dict], template_kwargs: dict | None = None) -> int:
    """How many tokens every conversation starting with the ``system`` messages starts with:
    those messages rendered alone, when the template renders them as a prefix of a
    conversation; else (none, or a template that cannot) the tokens two probe conversations
    share (a template's default system prompt, BOS, a header). Template errors propagate."""
    def render(messages, gen=True):
        return chat_text(tokenizer, messages, add_generation_prompt=gen, template_kwargs=template_kwargs)

    if system:
        try:
            head = render(system, gen=False)
        except Exception:  # a template that cannot render a system message alone
            head = None
        if head and render([*system, {"role": "user", "content": "Hi"}]).startswith(head):
            return len(encode_text(tokenizer, head))
    a = encode_text(tokenizer, render([*system, {"role": "user", "content": "A"}]))
    b = encode_text(tokenizer, render([*system, {"role": "user", "content": "Z"}]))
    return common_prefix_len(a, b)


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


def feed_all(model, state: PromptCache, tokens: list[int], prefill_step_size: int,
             progress=None, max_call_seconds: float | None = None) -> None:
    """Feed every one of ``tokens`` into an empty ``state`` (no sampling); a model call
    that raises leaves it holding the chunks fed before. ``max_call_seconds``: see
    :func:`~mlx_chatcache.generation.feed.prefill`."""
    if state.tokens or cache_offset(state.cache):
        raise UsageError("feed_all needs an empty prompt cache")
    pacer = CallPacer(model, max_call_seconds) if max_call_seconds else None
    with consistent_on_error(state, model):
        rest = prefill(model, state, tokens, prefill_step_size, progress, pacer=pacer)
        prefill(model, state, rest, max(len(rest), 1), leave=0)  # in one call: the pacer made it fit
    if progress:
        progress(len(tokens), len(tokens))
