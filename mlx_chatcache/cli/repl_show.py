"""What ``/show info|cache|stats|template`` prints in ``mlxcc chat``.

Each entry of :data:`SHOW` takes the running :class:`~mlx_chatcache.cli.repl.ChatREPL`
and returns the text to print; none changes the chat.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .common import human_bytes, plural

if TYPE_CHECKING:
    from .repl import ChatREPL


def show_info(repl: ChatREPL) -> str:
    s = repl.session
    c = s.config
    fp = s.fingerprint
    lines = [
        f"model:         {repl.model_ref or (fp.model_id if fp else 'unknown')}",
        f"session:       {repl.session_label or '(not saved)'}",
        f"turns:         {s.num_turns}",
        f"system prompt: {s.system_prompt if s.system_prompt is not None else '(none)'}",
        f"sampling:      temp={c.temp} top_p={c.top_p} top_k={c.top_k} min_p={c.min_p} "
        f"seed={c.seed} repetition_penalty={c.repetition_penalty}",
        f"max_tokens:    {c.max_tokens}",
        f"cache:         max_kv_size={s.state.shape.max_kv_size} kv_bits={c.kv_bits}",
    ]
    return "\n".join(lines)


def show_cache(repl: ChatREPL) -> str:
    i = repl.session.cache_info()
    layers = ", ".join(f"{n} × {k}" for k, n in i["layers"].items())
    window = (f"rotating window of {i['max_kv_size']} tokens, first {i['keep']} pinned"
              if i["max_kv_size"] else "unbounded")  # fmt: skip
    lines = [
        f"tokens:      {i['cached_tokens']} in the cache (+{i['pending_tokens']} to feed next turn)",
        f"bytes:       {human_bytes(i['nbytes'])}",
        f"layers:      {layers}",
        f"window:      {window}",
        f"trimmable:   {'yes' if i['trimmable'] else 'no'}",
        f"checkpoints: {plural(i['checkpoints'], 'turn')} ({i['checkpoint_copies']} with a cache copy, "
        f"{len(i['saved_copies'])} kept in a session file: {human_bytes(sum(i['saved_copies']))})",
    ]
    return "\n".join(lines)


def show_stats(repl: ChatREPL) -> str:
    s = repl.session
    last, t = s.last_stats, s.totals
    if last is None:
        return "no turn yet in this run"
    return (
        f"last turn: {last.summary()}\n"
        f"this run:  {plural(s.turns_run, 'turn')}, {t.new_tokens} prompt tokens fed, "
        f"{t.reused_tokens} reused, {t.recomputed_tokens} recomputed, "
        f"{t.generated_tokens} generated, {t.seconds:.2f} s"
    )


def show_template(repl: ChatREPL) -> str:
    return getattr(repl.session.tokenizer, "chat_template", None) or "(no chat template)"


# /show WHAT -> the text it prints
SHOW: dict[str, Callable[[ChatREPL], str]] = {
    "info": show_info,
    "cache": show_cache,
    "stats": show_stats,
    "template": show_template,
}

__all__ = ["SHOW"]
