"""How many tokens a model attends to, and whether a prompt fits in that.

:func:`model_context_length` reads the model's context length (its
``max_position_embeddings``; None when the model does not say).
:func:`check_prompt_fits` is the check made before any prompt token is
processed: a prompt of at least that many tokens is a one-line
:class:`~mlx_chatcache.errors.UsageError`, unless a rotating window
(``max_kv_size``) bounds what the model attends to, when it returns a warning
line naming the window instead. :func:`context_warning` is the line a chat
shows before that happens: once a turn may fill
:data:`~mlx_chatcache.config.CONTEXT_WARNING_FRACTION` of the window or context.
"""

from __future__ import annotations

from ..config import CONTEXT_WARNING_FRACTION
from ..errors import UsageError


def model_context_length(model) -> int | None:
    """The model's context length in tokens, or None when its config does not give one."""
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return n if type(n) is int and n > 0 else None


def check_prompt_fits(model, n_prompt: int, max_kv_size: int | None, what: str, fix: str) -> str | None:
    """None when ``n_prompt`` tokens leave room for a reply in the model's context; a
    warning line when they do not but the rotating window ``max_kv_size`` holds the
    latest tokens; else UsageError: "``what`` has N tokens but the model's context
    holds C; ``fix``"."""
    context = model_context_length(model)
    if context is None or n_prompt < context:
        return None
    if max_kv_size is not None:
        return (f"{what} has {n_prompt} tokens, more than the model's context of {context}; the rotating "
                f"window keeps the latest {max_kv_size} (the model may answer poorly past its context)")  # fmt: skip
    raise UsageError(f"{what} has {n_prompt} tokens but the model's context holds {context}; {fix}")


def context_warning(model, reach: int, used: int, max_kv_size: int | None) -> str | None:
    """A line for a chat whose turn may reach ``reach`` tokens (prompt + reply room),
    ``used`` of them held now, when that is at least ``CONTEXT_WARNING_FRACTION`` of
    the rotating window ``max_kv_size`` or, without one, of the model's context
    (None: below that, or no known limit). It says what happens at the limit."""
    limit = max_kv_size if max_kv_size is not None else model_context_length(model)
    if limit is None or reach < CONTEXT_WARNING_FRACTION * limit:
        return None
    if max_kv_size is not None:
        return (f"[the conversation uses {used} tokens of the {limit}-token window: past it the oldest turns "
                "leave the window (the system prompt stays)]")  # fmt: skip
    return (f"[the conversation uses {used} of the model's {limit}-token context: at {limit} the next message "
            "is refused; /undo, /clear or a new session with --max-kv-size N]")  # fmt: skip
