"""The session file a chat is saved to: its claim, the autosave after every change,
``/save FILE``, ``/load FILE`` and ``/branch NAME``.

Contract
--------
A :class:`ChatFile` holds the chat's :class:`~mlx_chatcache.files.cache_file.Claim`
of its session file (None: the chat is not saved) and says what happens in one
line each through the ``note`` and ``error`` callables it is given. Nothing a
user typed is lost to a failed save: :meth:`ChatFile.save` reports the error,
remembers the session is ``unsaved`` and is retried after the next change;
:meth:`ChatFile.keep_open` asks once, on a terminal, before a chat ends unsaved.
``/save`` goes through the door (:func:`~mlx_chatcache.files.cache_file.claim`):
it refuses a file another chat holds, and a file that is not a prompt cache or
is another chat session unless ``--force``. ``/load FILE`` switches the chat to
FILE (claimed as this chat's session) and writes nothing; ``/branch NAME``
saves the chat as the new session NAME and goes on there. The session left
stays as last saved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ..chat.session import ChatSession
from ..chat.session_file import session_name, session_path
from ..errors import ChatCacheError, UsageError
from ..files.cache_file import Claim, cache_file_kind, claim, is_session
from .chat_report import cost_text
from .common import plural

Say = Callable[[str], None]


class ChatFile:
    """Where a chat is saved (see the module doc); ``label`` names it in messages."""

    def __init__(self, held: Claim | None, label: str | None, note: Say, error: Say):
        self.held, self.label = held, label
        self.note, self.error = note, error
        self.unsaved = False  # the last autosave failed: retried after the next change
        self._warned = False

    @property
    def path(self) -> Path | None:
        """The session file the chat is saved to (None: none)."""
        return self.held.path if self.held is not None else None

    def covers(self, path: str | os.PathLike) -> bool:
        return self.held is not None and self.held.covers(path)

    def release(self) -> None:
        if self.held is not None:
            self.held.release()

    def save(self, session: ChatSession) -> None:
        """Autosave: the session file (when there is one) and the shared tiers. A failure
        is one error line and the session is kept ``unsaved`` (retried at the next save)."""
        if self.held is None:  # no session file: only the shared tiers (--cache-dir), if any
            for line in session.save(None) if session.shared.tiers else []:
                self.note(f"warning: {line}")
            return
        try:
            problems = session.save(self.held)
        except ChatCacheError as e:
            self.unsaved = True
            self.error(f"could not save the session: {e} (the conversation is kept: saving is "
                       "retried after the next turn, or /save FILE elsewhere)")  # fmt: skip
            return
        for line in problems:  # a shared tier (--cache-dir): the session file itself was written
            self.note(f"warning: {line}")
        if self.unsaved:
            self.unsaved = False
            self.note(f"[session saved to {self.path} again]")

    def keep_open(self, session: ChatSession, interactive: bool) -> bool:
        """At the end of the chat: True (the chat goes on) the first time on a terminal when
        the conversation is not saved, so the user can /save it. A chat without a session
        file says so (piped: one line, and it ends); a failed autosave is retried first."""
        if self.held is None:
            if session.num_turns == 0:
                return False
            if not interactive:
                self.note("[not saved: start with --session NAME to keep a chat]")
                return False
            if self._warned:
                return False
            self._warned = True
            self.note("[this chat is not saved: /save FILE keeps it; Ctrl-D again to quit without saving]")
            return True
        if not self.unsaved:
            return False
        self.save(session)
        if not self.unsaved:
            return False
        if interactive and not self._warned:
            self._warned = True
            self.note(f"[the conversation is NOT saved in {self.path}: /save FILE to keep it "
                      "elsewhere, or quit again to leave without saving]")  # fmt: skip
            return True
        self.note(f"[the last changes were NOT saved in {self.path}]")
        return False

    def save_as(self, session: ChatSession, name: str, force: bool) -> None:
        """``/save FILE [--force]``: this chat's own file is autosaved; another is claimed and written."""
        if self.covers(name):
            self.save(session)
            if not self.unsaved:
                self.note(f"[session saved to {name}]")
            return
        with claim(name, force=force) as target:
            for line in session.save(target):
                self.note(f"warning: {line}")
        self.note(f"[session saved to {name}]")

    def load(self, session: ChatSession, name: str) -> ChatSession:
        """``/load FILE``: the session saved in FILE, which the chat is saved to from now on
        (its claim replaces this chat's); nothing is written."""
        check_session_file(name, f"/load {name}", LOAD_HINT)
        own = self.covers(name)
        # mine: this chat's session from now on; whatever FILE holds is checked by the load
        new = self.held if own else claim(name, mine=True, label=name, required=True)
        try:
            loaded = ChatSession.load(new.path, session.model, session.tokenizer, shared=session.shared.tiers)
        except BaseException:
            if not own:
                new.release()
            raise
        if not own:
            self.release()
            self.held, self.label = new, name
        self.unsaved = False  # the file holds what was loaded
        for line in loaded.load_notes:
            self.note(line)
        self.note(f"[loaded {name}: {plural(loaded.num_turns, 'turn')}, {cost_text(loaded)}; "
                  "saved there from now on]")  # fmt: skip
        return loaded

    def reloaded(self, session: ChatSession) -> ChatSession | None:
        """The session as its file holds it, when that is ``session``'s conversation (a turn
        that changed nothing then feeds nothing again); None otherwise."""
        if self.held is None or self.unsaved:
            return None
        try:
            loaded = ChatSession.load(self.held.path, session.model, session.tokenizer,
                                      max_checkpoints=session.max_checkpoints, shared=session.shared.tiers)  # fmt: skip
        except ChatCacheError:
            return None
        if loaded.messages != session.messages:
            return None
        loaded.totals, loaded.turns_run, loaded.last_stats = session.totals, session.turns_run, session.last_stats
        return loaded

    def branch(self, session: ChatSession, name: str) -> None:
        """``/branch NAME``: save the chat as it is into the new session NAME (which records
        the session it came from and at how many turns) and go on there. Refused, writing
        nothing, when NAME exists or another chat holds it."""
        if not name:
            raise UsageError("usage: /branch NAME (a new session name)")
        path = session_path(name)
        label = f"'{name}'"
        if self.covers(path):
            raise UsageError(f"this chat is session {label} already; /branch takes a new session name")
        if path.exists():
            raise UsageError(f"session {label} exists; /branch takes a new session name (continue {label} "
                             f"with 'mlxcc chat --session {name}')")  # fmt: skip
        if self.unsaved:  # bring the session left behind up to date first, if its file can take it
            self.save(session)
        left = self.path
        parent = None if left is None else session_name(left)
        new = claim(path, mine=True, label=label, required=True)
        before = session.branch_of
        if parent is not None:
            session.branch_of = {"session": parent, "turns": session.num_turns}
        try:
            problems = session.save(new)
        except BaseException:
            session.branch_of = before
            new.release()
            raise
        for line in problems:
            self.note(f"warning: {line}")
        self.release()
        self.held, self.label, self.unsaved = new, label, False
        if parent is None:
            self.note(f"[saved as session {label}: this chat continues there]")
            return
        again = f"--session {parent}" if parent != str(left) else f"--session-file {parent}"
        self.note(f"[branched: this chat continues in {label}; '{parent}' stays at turn {session.num_turns} "
                  f"(resume it with 'mlxcc chat {again}')]")  # fmt: skip


LOAD_HINT = "/load takes a session file that 'mlxcc chat' or /save wrote ('mlxcc sessions' lists the named ones)"


def check_session_file(name: str | os.PathLike, command: str, hint: str) -> None:
    """A one-line UsageError (``command: why; hint``) for a file that cannot be a chat session:
    missing, a folder, not a cache file, or a cache file that is not a session. A damaged one
    passes: loading it says what is wrong, and how to repair it."""
    from ..files.mlxcc_format import read_cache_info

    path = Path(name).expanduser()
    if not path.is_file():
        raise UsageError(f"{command}: {'it is a folder' if path.is_dir() else 'no such file'}; {hint}")
    if cache_file_kind(path) is None:
        raise UsageError(f"{command}: it is not a prompt cache file; {hint}")
    try:
        info = read_cache_info(path)
    except ChatCacheError:
        return  # damaged: the load says so
    if not is_session(info):
        raise UsageError(f"{command}: it is a prompt cache, not a chat session; {hint} (start a chat from it "
                         f"with 'mlxcc chat --prompt-cache-file {name}')")  # fmt: skip


__all__ = ["ChatFile", "LOAD_HINT", "check_session_file"]
