"""The interactive loop behind ``mlxcc chat``: commands, streaming output, Ctrl-C.

:class:`ChatREPL` reads with a reader from :mod:`mlx_chatcache.cli.chat_input`
(a terminal, or line by line from a stream, so a chat can be scripted:
``printf 'Hi\\n/bye\\n' | mlxcc chat``) until the input ends or ``/bye``.
Replies stream to ``out``; notes, errors and statistics go to ``err``, so
``out`` holds only what the model and the ``/show`` commands say.

Any line starting with ``/`` is a command (:data:`COMMANDS`, listed by
:data:`HELP`); ``//text`` sends ``/text`` as a message. A line starting with
three double quotes starts a multi-line message, ended by a line ending with
three double quotes; on a terminal a pasted block is one message too (bracketed
paste), even one that starts with ``/``.

Ctrl-C while a reply streams stops it after the current token (the partial
reply stays in the conversation); a second Ctrl-C aborts the turn at once.
While the prompt is read, Ctrl-C cancels the message within about a second
(the prompt's model calls are paced, see :mod:`mlx_chatcache.generation.pacing`), and a
progress line on a terminal shows how far it got (erased when the reply
starts). Ctrl-C at the prompt clears the line; Ctrl-D (end of input) ends the chat
(a chat with no session file says it is not saved: on a terminal the first Ctrl-D
only says so, to leave time for ``/save``).

On a terminal, keys typed while a reply streams are not echoed into it: they
wait for the next prompt. Where the chat is saved (autosave, ``/save``,
``/load``, ``/branch``) is :mod:`mlx_chatcache.cli.chat_file`'s; what ``/show``,
``/system`` and ``/history`` print is :mod:`mlx_chatcache.cli.chat_report`'s.
A line that is not valid UTF-8 is refused in one line (nothing sent).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Callable, TextIO

from ..chat.session import ChatSession, RollbackResult, TurnResult
from ..chat.session_catalog import format_conversation
from ..config import mlxcc_home
from ..errors import ChatCacheError, UsageError
from ..files.cache_file import Claim
from .chat_file import ChatFile
from .chat_input import (FENCE, message_text, parse_command, parse_edit_arg, parse_save_arg, parse_setting,
                         read_input)
from .chat_report import SHOW, cost_text, show_text, system_text
from .common import plural, require_utf8
from .progress import ProgressBar

# /help: (what is typed, what it does); a description's later lines continue under it
HELP_TABLE = (
    ("/help, /?", "show this help"),
    ("/bye, /exit", "end the chat (also Ctrl-D)"),
    ("/clear", "forget the conversation (the system prompt stays)"),
    ("/undo", "remove the last exchange (your message and the reply)"),
    ("/retry", "generate the last reply again (with --seed: seed + number\n"
               "of retries, so each retry differs yet is reproducible)"),
    ("/edit [N]", "replace your message N (default the last) with the next\n"
                  "input and answer it again (the messages after it go)"),
    ("/branch NAME", "go on in a new session NAME (the session left keeps\n"
                     "this point); 'mlxcc sessions show' lists branches"),
    ("/system [TEXT]", 'show or set the system prompt (empty quotes "" removes it)'),
    ("/set NAME VALUE", "change a setting: temp, top_p, top_k, min_p, max_tokens,\n"
                        "seed (or 'none'), repetition_penalty (or 'none')"),
    ("/history", "the conversation so far"),
    ("/show " + "|".join(SHOW), "the model and settings, the cache, the last turn's\n"
                                "statistics, the chat template"),
    ("/save FILE [--force]", "save the session to FILE (--force: even over a file\n"
                             "that is not a prompt cache, or another chat session)"),
    ("/load FILE", "continue the session saved in FILE: the chat is saved\n"
                   "there from now on (the session it leaves stays as last\nsaved)"),
    (FENCE, "start or end a multi-line message (a paste is one message too)"),
    ("//text", "send a message that starts with '/'"),
)  # fmt: skip
HELP_WIDTH = 23  # the column where descriptions start, after two spaces of indent


def _help_text() -> str:
    """HELP built from :data:`HELP_TABLE`: every description starts in the same column
    (a name too long for it gets a line of its own)."""
    pad = " " * (2 + HELP_WIDTH)
    lines = ["Commands (anything else is sent to the model):"]
    for name, text in HELP_TABLE:
        first, *rest = text.split("\n")
        if len(name) < HELP_WIDTH:
            lines.append(f"  {name:<{HELP_WIDTH}}{first}")
        else:
            lines += [f"  {name}", pad + first]
        lines += [pad + line for line in rest]
    lines += ["Ctrl-C stops a reply; the conversation keeps what was written so far. Before",
              "the reply starts (a long message being read) it cancels the message."]  # fmt: skip
    return "\n".join(lines)


HELP = _help_text()


# ------------------------------------------------------------------ Ctrl-C
class StopFlag:
    """While active, the first Ctrl-C sets the flag; a second one raises
    KeyboardInterrupt. Only the main thread can own signal handlers; elsewhere
    the flag stays available but Ctrl-C keeps its default behaviour."""

    def __init__(self):
        self.stopped = False
        self._old = None

    def __call__(self) -> bool:
        return self.stopped

    def _handler(self, signum, frame):
        if self.stopped:
            raise KeyboardInterrupt
        self.stopped = True

    def __enter__(self) -> "StopFlag":
        self.stopped = False
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


# ------------------------------------------------------------------ the loop
class ChatREPL:
    """Runs a chat on ``session`` until the input ends or ``/bye``.

    ``held``, the claim of the session file (:mod:`mlx_chatcache.files.cache_file`:
    locked by this chat), is written atomically after every turn and every
    command that changes the session (without it the session's shared store
    tiers, ``--cache-dir``, still get its cache); the REPL releases it, or the
    one ``/load`` switched to, when the chat ends. Returns 0, or 1 when a command
    failed and the input is not interactive (so scripts notice).
    """

    def __init__(
        self,
        session: ChatSession,
        reader,
        *,
        out: TextIO = sys.stdout,
        err: TextIO = sys.stderr,
        held: Claim | None = None,
        verbose: bool = False,
        interactive: bool = False,
        model_ref: str | None = None,
        session_label: str | None = None,
    ):
        self.session = session
        self.reader = reader
        self.out, self.err = out, err
        self.file = ChatFile(held, session_label, self.note, self.error)
        self.verbose = verbose
        self.interactive = interactive
        self.model_ref = model_ref
        self.failed = False
        self._emitted = False
        self._bar: ProgressBar | None = None

    # -------------------------------------------------------------- output
    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def note(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()

    def error(self, e: Exception | str) -> None:
        self.failed = True
        self.note(f"error: {e}")

    def _emit(self, text: str) -> None:
        if self._bar is not None:  # the reply starts: the progress line goes
            self._bar.close()
        self._emitted = True
        self.out.write(text)
        self.out.flush()

    def _end_line(self) -> None:
        if self._emitted:
            self._emit("\n")

    # -------------------------------------------------------------- loop
    def run(self) -> int:
        try:
            rc = self._loop()
            s = self.session
            if self.file.path is not None and not self.file.unsaved and (len(s.pending) > 1 or s.reread):
                self.note(f"[saved to {self.file.label}: {cost_text(s)}]")  # a cache behind its conversation
            return rc
        finally:
            self.reader.close()
            self.file.release()

    def _loop(self) -> int:
        if self.interactive:
            self.note("Type a message, /help for commands, /bye or Ctrl-D to quit.")
        while True:
            item = read_input(self.reader)
            if item is None or not self._valid(item.text):
                if item is None and not self._keep_open():
                    break
                continue
            if not item.multiline:
                cmd = parse_command(item.text)
                if cmd is not None:
                    try:
                        if self.command(*cmd) == "quit" and not self._keep_open():
                            break
                    except ChatCacheError as e:
                        self.error(e)
                    continue
                text = message_text(item.text)
            else:
                text = item.text
            if not text.strip():
                continue
            self.turn(lambda stop: self.session.ask(text, self._emit, stop))
        return 1 if self.failed and not self.interactive else 0

    def _valid(self, text: str) -> bool:
        """Whether the input is valid text; else one error line (nothing is sent)."""
        try:
            require_utf8(text, "the input")
        except UsageError as e:
            self.error(f"{e}; nothing was sent")
            return False
        return True

    def _keep_open(self) -> bool:
        """At the end of the chat: whether it goes on so an unsaved conversation can be saved."""
        with StopFlag():  # a Ctrl-C must not interrupt a retried save (it is atomic anyway)
            return self.file.keep_open(self.session, self.interactive)

    def turn(self, action: Callable[[Callable[[], bool]], TurnResult]) -> TurnResult | None:
        """Run one generation with Ctrl-C handling and a progress line, then report and autosave.
        Returns the turn's result (None when it was aborted or failed)."""
        self._emitted = False
        self._bar = ProgressBar("prompt", stream=self.err)
        self.session.progress = self._bar.update
        try:
            with StopFlag() as stop, self.reader.keys_unechoed():
                result = action(stop)
        except KeyboardInterrupt:
            self._end_line()
            self.note("[reply aborted; the conversation is as before your message]")
            return
        except ChatCacheError as e:
            self._end_line()
            self.error(e)
            return
        finally:
            self._bar.close()
            self._bar = self.session.progress = None
        if result.stats.finish_reason == "cancelled":
            self.note("[cancelled before the reply started; your message was not sent]")
            return result
        self._emit("\n")
        if result.stats.finish_reason == "interrupted":
            self.note("[stopped]")
        if self.verbose:
            self.note(f"[stats] {result.stats.summary()}")
        if result.warning:
            self.note(result.warning)
        self.save()
        return result

    def save(self) -> None:
        """Autosave (:meth:`ChatFile.save`); a Ctrl-C during the write does not end the chat."""
        with StopFlag():
            self.file.save(self.session)

    # -------------------------------------------------------------- commands
    def command(self, name: str, arg: str) -> str | None:
        """Run ``/name arg``; "quit" when the chat should end."""
        if name in ("bye", "exit", "quit"):
            return "quit"
        run = COMMANDS.get(name)
        if run is None:
            raise UsageError(f"unknown command '/{name}'; /help lists the commands (send '//{name}' "
                             "to say it to the model)")  # fmt: skip
        run(self, arg)
        return None

    def _help(self, arg: str) -> None:
        self.say(HELP)

    def _clear(self, arg: str) -> None:
        self.session.clear()
        self.note("[conversation cleared]")
        self.save()

    def _undo(self, arg: str) -> None:
        s = self.session
        r = s.undo()
        self.note(f"[removed the last exchange; {plural(s.num_turns, 'turn')} left{self._how(r)}]")
        self.save()

    def _retry(self, arg: str) -> None:
        s = self.session
        self.turn(lambda stop: s.retry(self._emit, stop))

    def _system(self, arg: str) -> None:
        s = self.session
        if not arg:
            self.say(system_text(s))
            return
        text = "" if arg in ('""', "''") else arg
        if (text or None) == s.system_prompt:
            self.note("[the system prompt is unchanged]")
            return
        s.set_system_prompt(text)
        self.note("[system prompt " + ("removed" if not text else "set") + f"; {cost_text(s)}]")
        self.save()

    def _set(self, arg: str) -> None:
        key, value = parse_setting(arg)
        self.session.update_settings({key: value})
        self.note(f"[{key} = {value}]")
        self.save()

    def _save(self, arg: str) -> None:
        name, force = parse_save_arg(arg)
        if not name:
            raise UsageError("usage: /save FILE [--force]")
        with StopFlag():
            self.file.save_as(self.session, name, force)

    def _load(self, arg: str) -> None:
        """Continue the session in ``arg`` (:meth:`ChatFile.load`)."""
        if not arg:
            raise UsageError("usage: /load FILE")
        self.session = self.file.load(self.session, arg)

    def _edit(self, arg: str) -> None:
        """``/edit [N]``: the next input replaces user message N (default the last) and its
        reply is generated again; the messages after it go. Empty input cancels; a turn
        cancelled or aborted leaves the conversation as it was (loaded again from the
        session file when that holds it, so nothing is fed again)."""
        s = self.session
        n = parse_edit_arg(arg)
        old = s.messages[s.user_message_index(n)]["content"]  # refused before the new text is read
        self.note(f"[new text for {'your last message' if n is None else f'message {n}'} "
                  "(an empty line cancels the edit)]")  # fmt: skip
        item = read_input(self.reader, default=old if "\n" not in old else "")  # a terminal shows it, editable
        text = None
        if item is not None and self._valid(item.text):
            text = item.text if item.multiline else message_text(item.text)
        if text is None or not text.strip():
            self.note("[edit cancelled; nothing changed]")
            return
        result = self.turn(lambda stop: s.edit(n, text, self._emit, stop))
        if result is not None and result.stats.finish_reason != "cancelled":
            return
        loaded = self.file.reloaded(s)
        if loaded is not None:
            self.session = loaded
            self.note("[edit not made; the conversation is as before (0 tokens recomputed)]")
            return
        self.note(f"[edit not made; the conversation is as before: {cost_text(s)}]")

    def _branch(self, arg: str) -> None:
        self.file.branch(self.session, arg.strip())

    @staticmethod
    def _how(r: RollbackResult) -> str:
        if r.how == "recompute":
            return f"; the cache could not be rolled back: {plural(r.recompute_tokens, 'token')} will be recomputed"
        if r.how == "rerender" and r.recompute_tokens:
            return f"; the conversation was rendered again: {plural(r.recompute_tokens, 'token')} will be recomputed"
        return ""

    # -------------------------------------------------------------- /show
    def show(self, what: str) -> None:
        text = show_text(what, self.session, self.model_ref, self.file.label)
        if text is None:
            raise UsageError(f"usage: /show {'|'.join(SHOW)}")
        self.say(text)

    def _history(self, arg: str) -> None:
        self.say(format_conversation(self.session.messages))


# /NAME -> what runs it (/bye, /exit and /quit end the chat); HELP lists them
COMMANDS: dict[str, Callable[[ChatREPL, str], None]] = {
    "help": ChatREPL._help,
    "?": ChatREPL._help,
    "clear": ChatREPL._clear,
    "undo": ChatREPL._undo,
    "retry": ChatREPL._retry,
    "system": ChatREPL._system,
    "set": ChatREPL._set,
    "show": ChatREPL.show,
    "history": ChatREPL._history,
    "save": ChatREPL._save,
    "load": ChatREPL._load,
    "edit": ChatREPL._edit,
    "branch": ChatREPL._branch,
}


def history_file() -> Path:
    return mlxcc_home() / "chat_history"


__all__ = ["ChatREPL", "StopFlag", "HELP", "COMMANDS", "history_file"]
