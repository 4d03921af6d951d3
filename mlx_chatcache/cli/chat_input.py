"""What a chat user types: lines from a terminal or a stream, multi-line
messages, commands told from messages, and the values of ``/set``.

Contract
--------
A reader has ``read(prompt) -> str | None`` (None at end of input) and
``close()``: :class:`TerminalReader` (prompt_toolkit line editing with a
persistent history and bracketed paste; Ctrl-C at the prompt gives an empty
line) or :class:`StreamReader` (lines of a text stream, so a chat can be
scripted). :func:`read_input` reads one :class:`UserInput`: a line, a pasted
block, or a block fenced by three double quotes (the last two always a
message). :func:`parse_command` tells a ``/command`` from a message (``//text``
is the message ``/text``, see :func:`message_text`);
:func:`parse_setting` turns ``/set NAME VALUE`` into a setting name and a
checked value, or a one-line :class:`~mlx_chatcache.errors.UsageError`. Nothing
here touches a session.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, TextIO

from .common import setting_value
from ..config import RANGES, SettingError
from ..errors import UsageError, clipped

PROMPT, CONTINUATION = ">>> ", "... "
FENCE = '"""'


# ------------------------------------------------------------------ input
class StreamReader:
    """Lines from a text stream (stdin when it is not a terminal); None at EOF."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def read(self, prompt: str, default: str = "") -> str | None:
        """The next line of the stream (``default`` is for terminals: a stream has no editor)."""
        line = self.stream.readline()
        if not line:
            return None
        return line[:-1] if line.endswith("\n") else line

    def close(self) -> None:
        """Nothing to undo for a stream."""

    def keys_unechoed(self) -> contextlib.AbstractContextManager:
        """Nothing to hide: a stream has no keyboard."""
        return contextlib.nullcontext()


class TerminalReader:
    """prompt_toolkit line editing with a persistent history; None at Ctrl-D.

    Ctrl-C at the prompt gives an empty line (the line is cleared). The terminal's
    bracketed paste mode stays on between prompts (a paste made while a reply
    streams reaches the next prompt as one paste, not as typed lines) until
    :meth:`close`, which the chat calls when it ends."""

    def __init__(self, history_file: Path | None = None):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        history = InMemoryHistory()
        if history_file is not None:
            try:
                history_file.parent.mkdir(parents=True, exist_ok=True)
                history = FileHistory(str(history_file))
            except OSError:
                pass
        self.session = PromptSession(history=history)

    def read(self, prompt: str, default: str = "") -> str | None:
        """The line typed after ``prompt`` (which starts as ``default``, editable)."""
        try:
            return self.session.prompt(prompt, default=default)
        except KeyboardInterrupt:
            return ""
        except EOFError:
            return None
        finally:  # prompt_toolkit turns bracketed paste off when the prompt returns
            self._paste_mode(True)

    def close(self) -> None:
        """Turn the terminal's bracketed paste mode off (the shell after the chat expects it off)."""
        self._paste_mode(False)

    @contextlib.contextmanager
    def keys_unechoed(self) -> Iterator[None]:
        """While active (a reply streams), keys typed are not echoed into the output: the
        terminal keeps them for the next prompt, which shows them. Ctrl-C still signals."""
        try:
            import termios

            fd = sys.stdin.fileno()
            saved = termios.tcgetattr(fd)
        except (ImportError, OSError, ValueError):  # not a terminal after all
            yield
            return
        quiet = list(saved)
        quiet[3] &= ~termios.ECHO  # lflag
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
        try:
            yield
        finally:
            termios.tcsetattr(fd, termios.TCSANOW, saved)

    def _paste_mode(self, on: bool) -> None:
        out = self.session.output
        if on:
            out.enable_bracketed_paste()
        else:
            out.disable_bracketed_paste()
        out.flush()


@dataclass
class UserInput:
    text: str
    multiline: bool = False  # a fenced block: always a message, never a command


def read_input(reader, default: str = "") -> UserInput | None:
    """One message or command; a fenced block spans lines. None at end of input.
    On a terminal the line starts as ``default`` (editable)."""
    line = reader.read(PROMPT, default=default)
    if line is None:
        return None
    if "\n" in line:  # a pasted block (one line from a terminal holds no line break): a message
        return UserInput(line, multiline=True)
    stripped = line.strip()
    if not stripped.startswith(FENCE):
        return UserInput(line)
    rest = stripped[len(FENCE):]
    if rest.endswith(FENCE):  # """text""" on one line
        return UserInput(rest[: -len(FENCE)], multiline=True)
    parts = [rest] if rest else []
    while True:
        line = reader.read(CONTINUATION)
        if line is None:  # end of input inside a block: send what was typed
            break
        if line.rstrip().endswith(FENCE):
            parts.append(line.rstrip()[: -len(FENCE)])
            break
        parts.append(line)
    while parts and not parts[-1].strip():
        parts.pop()
    return UserInput("\n".join(parts), multiline=True)


def parse_command(text: str) -> tuple[str, str] | None:
    """``("name", "argument")`` for a ``/command``; None for a message."""
    s = text.strip()
    if not s.startswith("/") or s.startswith("//"):
        return None
    name, _, arg = s[1:].partition(" ")
    return name.lower(), arg.strip()


def message_text(text: str) -> str:
    """The message a non-command line sends (``//x`` sends ``/x``)."""
    s = text.strip()
    return s[1:] if s.startswith("//") else s


MAX_DIGITS = 9  # /edit N: more digits than any chat has messages


def parse_edit_arg(arg: str) -> int | None:
    """The N of ``/edit [N]`` (None: the last message)."""
    if not arg:
        return None
    if not (arg.isascii() and arg.isdigit() and len(arg) <= MAX_DIGITS):
        raise UsageError("usage: /edit [N] (N: the number of one of your messages, 1 is the first)")
    return int(arg)


def parse_save_arg(arg: str) -> tuple[str, bool]:
    """``(file, force)`` of ``/save FILE [--force]`` (``--force`` first works too)."""
    words = arg.strip()
    for flag in ("--force", "-f"):
        if words == flag:
            return "", True
        if words.endswith(" " + flag):
            return words[: -len(flag)].strip(), True
        if words.startswith(flag + " "):
            return words[len(flag):].strip(), True
    return words, False


# ------------------------------------------------------------------ settings
# what /set changes: GenerationConfig fields, checked as their flags are (common.setting_value)
SETTINGS = ("temp", "top_p", "top_k", "min_p", "max_tokens", "seed", "repetition_penalty")


def parse_setting(arg: str) -> tuple[str, object]:
    """``(name, value)`` of ``/set NAME VALUE``, the value in the range of its flag;
    else a one-line UsageError naming the range."""
    name, _, value = arg.partition(" ")
    name = name.strip().lower().replace("-", "_")
    aliases = {"temperature": "temp", "max_tokens": "max_tokens", "maxtokens": "max_tokens"}
    name = aliases.get(name, name)
    if name not in SETTINGS or not value.strip():
        raise UsageError(f"usage: /set NAME VALUE with NAME one of {', '.join(SETTINGS)}")
    text, r = value.strip(), RANGES[name]
    none = " (or none)" if r.optional else ""
    try:
        return name, setting_value(name, text)
    except SettingError:  # out of its range: said as typed
        raise UsageError(f"/set {name}: must be {r.describe()}{none}, got {clipped(text, 40)}") from None
    except ValueError as e:  # not a number: "invalid number: 'x'"
        raise UsageError(f"/set {name}: {e}; give {r.describe()}{none}") from None


__all__ = [
    "PROMPT",
    "CONTINUATION",
    "FENCE",
    "StreamReader",
    "TerminalReader",
    "UserInput",
    "read_input",
    "parse_command",
    "message_text",
    "parse_edit_arg",
    "parse_save_arg",
    "SETTINGS",
    "parse_setting",
]
