"""What the chat prints about its session: ``/system`` without text, ``/show
info|cache|stats|template`` and ``/history``.

Each function takes the :class:`~mlx_chatcache.chat.session.ChatSession` (and,
for ``info``, how the chat names its model and session file) and returns the
text to print; none changes the session. What is shown is what the model gets:
the system prompt the chat template writes when the conversation has none is
shown, marked as the template's default, and so are the stop strings and the
template arguments in force.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .common import human_bytes, plural

if TYPE_CHECKING:
    from ..chat.session import ChatSession

SHOW = ("info", "cache", "stats", "template")  # what /show takes


def cost_text(s: ChatSession) -> str:
    """What the session's cache holds and what its next turn feeds before the new message
    (after a resume, a new system prompt, a rollback the cache could not follow)."""
    cached, pending = len(s.state.tokens), len(s.pending)
    again = s.cache_info()["reread_tokens"]
    if pending <= 1 and not again:
        return f"{plural(cached, 'token')} in the cache, 0 tokens recomputed"
    return (f"{plural(cached, 'token')} in the cache: the next turn feeds {plural(pending, 'token')} before "
            f"your message, {again} of them recomputed")  # fmt: skip


def _default_system(s: ChatSession) -> str | None:
    from ..generation.templates import default_system_prompt

    return default_system_prompt(s.tokenizer, s.template_args)


def system_text(s: ChatSession) -> str:
    """The system prompt the model gets (``/system`` without text)."""
    if s.system_prompt is not None:
        return s.system_prompt
    default = _default_system(s)
    if default is None:
        return "(no system prompt)"
    return f"{default}\n(the chat template's default: this conversation sets none; /system TEXT replaces it)"


def _system_line(s: ChatSession) -> str:
    if s.system_prompt is not None:
        return s.system_prompt
    default = _default_system(s)
    return "(none)" if default is None else f"{default} (the chat template's default)"


def info_text(s: ChatSession, model_ref: str | None, session_label: str | None) -> str:
    """``/show info``: the model, the session file, and every setting the next turn uses."""
    c = s.config
    fp = s.fingerprint
    window = s.state.shape
    cache = f"max_kv_size={window.max_kv_size}"
    if window.max_kv_size is not None:
        cache += f" (first {window.keep} tokens pinned)"
    lines = [
        f"model:         {model_ref or (fp.model_id if fp else 'unknown')}",
        f"session:       {session_label or '(not saved)'}",
        f"turns:         {s.num_turns}",
        f"system prompt: {_system_line(s)}",
        f"sampling:      temp={c.temp} top_p={c.top_p} top_k={c.top_k} min_p={c.min_p} "
        f"seed={c.seed} repetition_penalty={c.repetition_penalty}",
        f"max_tokens:    {c.max_tokens}",
        f"stop:          {', '.join(json.dumps(x, ensure_ascii=False) for x in s.stop) or '(none)'}",
        f"template args: {json.dumps(s.template_args, ensure_ascii=False) if s.template_args else '(none)'}",
        f"cache:         {cache} kv_bits={c.kv_bits}",
    ]
    return "\n".join(lines)


def cache_text(s: ChatSession) -> str:
    """``/show cache``: the tokens the cache holds, those the next turn feeds, its arrays."""
    i = s.cache_info()
    layers = ", ".join(f"{n} × {k}" for k, n in i["layers"].items())
    window = (f"rotating window of {i['max_kv_size']} tokens, first {i['keep']} pinned"
              if i["max_kv_size"] else "unbounded")  # fmt: skip
    feed = f"+{i['pending_tokens']} to feed next turn"
    if i["reread_tokens"]:
        feed += f", {i['reread_tokens']} of them read before: recomputed"
    lines = [
        f"tokens:      {i['cached_tokens']} in the cache ({feed})",
        f"bytes:       {human_bytes(i['nbytes'])} of arrays",
        f"layers:      {layers}",
        f"window:      {window}",
        f"trimmable:   {'yes' if i['trimmable'] else 'no'}",
        f"checkpoints: {plural(i['checkpoints'], 'turn')} ({i['checkpoint_copies']} with a cache copy, "
        f"{len(i['saved_copies'])} kept in a session file: {human_bytes(sum(i['saved_copies']))})",
    ]
    return "\n".join(lines)


def stats_text(s: ChatSession) -> str:
    """``/show stats``: the last turn's counts and this run's totals."""
    last, t = s.last_stats, s.totals
    if last is None:
        return "no turn yet in this run"
    return (
        f"last turn: {last.summary()}\n"
        f"this run:  {plural(s.turns_run, 'turn')}, {t.new_tokens} prompt tokens fed "
        f"({t.recomputed_tokens} of them recomputed), {t.reused_tokens} reused, "
        f"{t.generated_tokens} generated, {t.seconds:.2f} s"
    )


def template_text(s: ChatSession) -> str:
    """``/show template``: the chat template, and the arguments it gets."""
    template = getattr(s.tokenizer, "chat_template", None) or "(no chat template)"
    if s.template_args:
        template += f"\n(rendered with {json.dumps(s.template_args, ensure_ascii=False)})"
    return template


def show_text(what: str, s: ChatSession, model_ref: str | None, session_label: str | None) -> str | None:
    """The text of ``/show WHAT`` (None: WHAT is not one of :data:`SHOW`)."""
    what = what.strip().lower()
    if what == "info":
        return info_text(s, model_ref, session_label)
    return {"cache": cache_text, "stats": stats_text, "template": template_text}.get(what, lambda s: None)(s)


__all__ = ["SHOW", "cost_text", "system_text", "info_text", "cache_text", "stats_text", "template_text", "show_text"]
