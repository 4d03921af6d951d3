"""A one-line progress bar on stderr (redrawn only on a terminal)."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, label: str, enabled: bool = True, width: int = 30, stream=None):
        self.label, self.enabled, self.width = label, enabled, width
        self.stream = stream or sys.stderr
        self.drawn = False
        self.last = 0.0

    def update(self, done: int, total: int) -> None:
        if not self.enabled or not self.stream.isatty() or total <= 0:
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
