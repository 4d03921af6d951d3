"""Progress on stderr, drawn only when stderr is a terminal (nothing on a pipe):
:class:`ProgressBar` for prompt processing (one update per model call),
:class:`Spinner` for one long call (loading a model: ``common.load_model``).
Both erase their line when closed, before a reply is printed."""

from __future__ import annotations

import sys
import threading
import time


class ProgressBar:
    def __init__(self, label: str, enabled: bool = True, width: int = 30, stream=None):
        self.label, self.enabled, self.width = label, enabled, width
        self.stream = stream or sys.stderr
        self.drawn = False
        self.last = 0.0

    def update(self, done: int, total: int) -> None:
        if not self.enabled or not _isatty(self.stream) or total <= 0:
            return
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        filled = int(self.width * done / total)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total} tokens")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r" + " " * (len(self.label) + self.width + 30) + "\r")
            self.stream.flush()
            self.drawn = False


class Spinner:
    """While active, ``label … N.N s`` redrawn on stderr every 0.1 s by a
    background thread (a terminal only), then cleared: for one long call,
    such as loading a model, that reports no progress of its own."""

    def __init__(self, label: str, stream=None, interval: float = 0.1):
        self.label, self.interval = label, interval
        self.stream = stream or sys.stderr
        self._stop = threading.Event()
        self._thread = None
        self._width = 0

    def _draw(self) -> None:
        start = time.monotonic()
        frames = "|/-\\"
        i = 0
        while not self._stop.wait(self.interval if i else 0):
            text = f"\r{self.label} {frames[i % 4]} {time.monotonic() - start:.1f} s"
            self._width = max(self._width, len(text))
            self.stream.write(text)
            self.stream.flush()
            i += 1

    def __enter__(self) -> "Spinner":
        if _isatty(self.stream):
            self._thread = threading.Thread(target=self._draw, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False

