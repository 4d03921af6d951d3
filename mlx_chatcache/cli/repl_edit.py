"""The chat commands that change where a conversation goes: ``/edit [N]`` and ``/branch NAME``.

Each is a function of the :class:`~mlx_chatcache.cli.repl.ChatREPL` running the chat
and the command's argument, listed in its ``COMMANDS`` table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .chat_input import message_text, read_input
from ..errors import ChatCacheError, UsageError
from ..chat.session import ChatSession
from ..chat.session_file import session_name, session_path
from ..files.cache_file import claim

if TYPE_CHECKING:
    from .repl import ChatREPL

MAX_DIGITS = 9  # /edit N: more digits than any chat has messages


def parse_edit_arg(arg: str) -> int | None:
    """The N of ``/edit [N]`` (None: the last message)."""
    if not arg:
        return None
    if not (arg.isascii() and arg.isdigit() and len(arg) <= MAX_DIGITS):
        raise UsageError("usage: /edit [N] (N: the number of one of your messages, 1 is the first)")
    return int(arg)


def edit_command(repl: ChatREPL, arg: str) -> None:
    """``/edit [N]``: the next input replaces user message N (default the last) and its
    reply is generated again; the messages after it go. Empty input cancels; a turn
    cancelled or aborted leaves the conversation as it was."""
    s = repl.session
    n = parse_edit_arg(arg)
    old = s.messages[s.user_message_index(n)]["content"]  # refused before the new text is read
    repl.note(f"[new text for {'your last message' if n is None else f'message {n}'} "
              "(an empty line cancels the edit)]")  # fmt: skip
    item = read_input(repl.reader, default=old if "\n" not in old else "")  # a terminal shows it, editable
    text = None
    if item is not None and repl._valid(item.text):
        text = item.text if item.multiline else message_text(item.text)
    if text is None or not text.strip():
        repl.note("[edit cancelled; nothing changed]")
        return
    result = repl.turn(lambda stop: s.edit(n, text, repl._emit, stop))
    if result is None or result.stats.finish_reason == "cancelled":
        _edit_not_made(repl, s)


def _edit_not_made(repl: ChatREPL, s: ChatSession) -> None:
    """After an edit's turn was cancelled or failed (``s`` has its conversation back, the
    tokens after the edit point to feed again): load the session file again when it
    holds that conversation, so nothing is fed again."""
    if repl.held is not None and not repl.unsaved:
        try:
            loaded = ChatSession.load(repl.held.path, s.model, s.tokenizer, max_checkpoints=s.max_checkpoints,
                                      shared=s.shared.tiers)  # fmt: skip
        except ChatCacheError:
            loaded = None
        if loaded is not None and loaded.messages == s.messages:
            loaded.totals, loaded.turns_run, loaded.last_stats = s.totals, s.turns_run, s.last_stats
            repl.session = loaded
            repl.note("[edit not made; the conversation is as before (0 tokens recomputed)]")
            return
    repl.note(f"[edit not made; the conversation is as before: {len(s.pending)} tokens will be recomputed "
              "on the next turn]")  # fmt: skip


def branch_command(repl: ChatREPL, arg: str) -> None:
    """``/branch NAME``: save the chat as it is into the new session NAME (a file of
    its own, which records the session it came from and at how many turns) and go
    on there; the session it leaves stays as last saved. Refused, writing nothing,
    when NAME exists or another chat holds it."""
    name = arg.strip()
    if not name:
        raise UsageError("usage: /branch NAME (a new session name)")
    path = session_path(name)
    label = f"'{name}'"
    if repl.held is not None and repl.held.covers(path):
        raise UsageError(f"this chat is session {label} already; /branch takes a new session name")
    if path.exists():
        raise UsageError(f"session {label} exists; /branch takes a new session name (continue {label} "
                         f"with 'mlxcc chat --session {name}')")  # fmt: skip
    s = repl.session
    if repl.unsaved:  # bring the session left behind up to date first, if its file can take it
        repl.save()
    left = None if repl.held is None else repl.held.path
    parent = None if left is None else session_name(left)
    new = claim(path, mine=True, label=label, required=True)
    before = s.branch_of
    if parent is not None:
        s.branch_of = {"session": parent, "turns": s.num_turns}
    try:
        problems = s.save(new)
    except BaseException:
        s.branch_of = before
        new.release()
        raise
    for line in problems:
        repl.note(f"warning: {line}")
    if repl.held is not None:
        repl.held.release()
    repl.held, repl.session_label, repl.unsaved = new, label, False
    if parent is None:
        repl.note(f"[saved as session {label}: this chat continues there]")
        return
    again = f"--session {parent}" if parent != str(left) else f"--session-file {parent}"
    repl.note(f"[branched: this chat continues in {label}; '{parent}' stays at turn {s.num_turns} "
              f"(resume it with 'mlxcc chat {again}')]")  # fmt: skip


__all__ = ["branch_command", "edit_command", "parse_edit_arg"]
