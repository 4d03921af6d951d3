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

Nothing a user typed is lost to a failed save: ``/save`` and autosave errors
are one line and the chat goes on; a failed autosave is retried after the
next change and, if it still fails when the chat ends on a terminal, the user
is asked once to ``/save`` elsewhere. ``/save`` goes through the door
(:func:`~mlx_chatcache.files.cache_file.claim`): it refuses a file another chat
holds, and a file that is not a prompt cache or is another chat session unless
``--force``. ``/load FILE`` switches the chat to FILE (claimed as this chat's
session: refused when another chat holds it) and writes nothing; the session
it leaves stays as last saved. A line that is not valid UTF-8 is refused in
one line (nothing sent).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Callable, TextIO

from .chat_input import FENCE, message_text, parse_command, parse_save_arg, parse_setting, read_input
from .common import plural, require_utf8
from .progress import ProgressBar
from .repl_show import SHOW
from ..config import mlxcc_home
from ..errors import ChatCacheError, UsageError
from ..files.cache_file import Claim, claim
from ..chat.session import ChatSession, RollbackResult, TurnResult
from .repl_edit import branch_command, edit_command

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
    ("/show info|cache|stats|template", "the model and settings, the cache, the last turn's\n"
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
        self.held = held
        self.verbose = verbose
        self.interactive = interactive
        self.model_ref = model_ref
        self.session_label = session_label
        self.failed = False
        self._emitted = False
        self.unsaved = False  # the last autosave failed: retried after the next change
        self._warned_unsaved = False
        self._bar: ProgressBar | None = None

    @property
    def autosave(self) -> Path | None:
        """The session file the chat is saved to (None: none)."""
        return self.held.path if self.held is not None else None

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
            return self._loop()
        finally:
            self.reader.close()
            if self.held is not None:
                self.held.release()

    def _loop(self) -> int:
        if self.interactive:
            self.note("Type a message, /help for commands, /bye or Ctrl-D to quit.")
        while True:
            item = read_input(self.reader)
            if item is None or not self._valid(item.text):
                if item is None and not self._keep_unsaved():
                    break
                continue
            if not item.multiline:
                cmd = parse_command(item.text)
                if cmd is not None:
                    try:
                        if self.command(*cmd) == "quit" and not self._keep_unsaved():
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

    def _keep_unsaved(self) -> bool:
        """At the end of the chat (end of input, /bye): True (the chat goes on) the first
        time on a terminal when the conversation is not saved, so the user can /save it.
        A chat without a session file says so (piped: one line, and it ends); a failed
        autosave is retried first."""
        if self.autosave is None:
            if self.session.num_turns == 0:
                return False
            if not self.interactive:
                self.note("[not saved: start with --session NAME to keep a chat]")
                return False
            if self._warned_unsaved:
                return False
            self._warned_unsaved = True
            self.note("[this chat is not saved: /save FILE keeps it; Ctrl-D again to quit without saving]")
            return True
        if not self.unsaved:
            return False
        self.save()
        if not self.unsaved:
            return False
        if self.interactive and not self._warned_unsaved:
            self._warned_unsaved = True
            self.note(f"[the conversation is NOT saved in {self.autosave}: /save FILE to keep it "
                      "elsewhere, or quit again to leave without saving]")  # fmt: skip
            return True
        self.note(f"[the last changes were NOT saved in {self.autosave}]")
        return False

    def turn(self, action: Callable[[Callable[[], bool]], TurnResult]) -> TurnResult | None:
        """Run one generation with Ctrl-C handling and a progress line, then report and autosave.
        Returns the turn's result (None when it was aborted or failed)."""
        self._emitted = False
        self._bar = ProgressBar("prompt", stream=self.err)
        self.session.progress = self._bar.update
        try:
            with StopFlag() as stop:
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
        if self.autosave is None:  # no session file: only the shared tiers (--cache-dir), if any
            with StopFlag():  # as below: a Ctrl-C during the write must not end the chat
                problems = self.session.save(None) if self.session.shared.tiers else []
            for line in problems:
                self.note(f"warning: {line}")
            return
        with StopFlag():  # a Ctrl-C must not interrupt the write (it is atomic anyway)
            try:
                problems = self.session.save(self.held)
            except ChatCacheError as e:
                self.unsaved = True
                self.error(f"could not save the session: {e} (the conversation is kept: saving is "
                           "retried after the next turn, or /save FILE elsewhere)")  # fmt: skip
                return
        for line in problems:  # a shared tier (--cache-dir): the session file itself was written
            self.note(f"warning: {line}")
        if self.unsaved:
            self.unsaved = False
            self.note(f"[session saved to {self.autosave} again]")

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
            self.say(s.system_prompt if s.system_prompt is not None else "(no system prompt)")
            return
        text = "" if arg in ('""', "''") else arg
        s.set_system_prompt(text)
        self.note("[system prompt " + ("removed" if not text else "set") +
                  "; the conversation will be re-read on the next turn]")  # fmt: skip
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
        if self.held is not None and self.held.covers(name):  # this chat's own session file
            self.save()
            if not self.unsaved:
                self.note(f"[session saved to {name}]")
            return
        with claim(name, force=force) as target:
            for line in self.session.save(target):
                self.note(f"warning: {line}")
        self.note(f"[session saved to {name}]")

    def _load(self, arg: str) -> None:
        """Continue the session in ``arg``: the chat switches to it (its claim replaces
        this chat's); nothing is written (the session left stays as last saved)."""
        if not arg:
            raise UsageError("usage: /load FILE")
        s = self.session
        own = self.held is not None and self.held.covers(arg)
        # mine: this chat's session from now on; whatever FILE holds is checked by the load
        new = self.held if own else claim(arg, mine=True, label=arg, required=True)
        try:
            loaded = ChatSession.load(new.path, s.model, s.tokenizer, shared=s.shared.tiers)
        except BaseException:
            if not own:
                new.release()
            raise
        if not own:
            if self.held is not None:
                self.held.release()
            self.held, self.session_label = new, arg
        for line in loaded.load_notes:
            self.note(line)
        self.session = loaded
        self.unsaved = False  # the file holds what was loaded
        self.note(f"[loaded {arg}: {plural(loaded.num_turns, 'turn')}, {plural(loaded.cached_tokens, 'token')} in "
                  "the cache, 0 tokens recomputed; saved there from now on]")  # fmt: skip

    @staticmethod
    def _how(r: RollbackResult) -> str:
        if r.how == "recompute":
            return f"; the cache could not be rolled back: {plural(r.recompute_tokens, 'token')} will be recomputed"
        if r.how == "rerender":
            return "; the conversation will be re-read on the next turn"
        return ""

    # -------------------------------------------------------------- /show
    def show(self, what: str) -> None:
        show = SHOW.get(what.strip().lower())
        if show is None:
            raise UsageError(f"usage: /show {'|'.join(SHOW)}")
        self.say(show(self))

    def _history(self, arg: str) -> None:
        from ..chat.session_catalog import format_conversation

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
    "edit": edit_command,
    "branch": branch_command,
}


def history_file() -> Path:
    return mlxcc_home() / "chat_history"


__all__ = ["ChatREPL", "StopFlag", "HELP", "COMMANDS", "history_file"]
