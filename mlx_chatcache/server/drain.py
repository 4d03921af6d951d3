"""Graceful drain: how a server stops without dropping the work it accepted.

Contract
--------
A :class:`Drain` counts the requests running (the HTTP layer's
:meth:`Drain.running` context), holds their generation jobs (:meth:`Drain.hold`,
weakly) and knows whether the server is draining. :class:`DrainingServer` is uvicorn's server with other signal handling:

- the first SIGTERM or SIGINT starts the drain (one log line): the listening socket
  stays open, new requests get a 503 with ``Retry-After`` and ``GET /health`` a 503
  saying ``draining`` (the HTTP layer asks :attr:`Drain.draining`), running requests
  go on;
- once none runs, or ``seconds`` after the signal, the server shuts down as uvicorn
  does; jobs still running then are cancelled first (:meth:`Drain.cut`: the worker
  stores what they fed, their clients see the connection end); the app's shutdown
  then stops the worker, which writes every pending store entry, and the caller
  closes the store (flushing the Redis writer); the process exits 0;
- a second signal exits at once (status 128 + the signal's number), writing nothing more.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import weakref
from typing import Iterator

import uvicorn

log = logging.getLogger("mlxcc.serve")


class Drain:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started: float | None = None  # time.monotonic() of the first signal
        self._running = 0  # changed and read on the event loop's thread (and read by signal handlers)
        self._jobs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # the jobs of running requests

    @property
    def draining(self) -> bool:
        return self.started is not None

    @property
    def count(self) -> int:
        """Requests running now."""
        return self._running

    def begin(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def over(self) -> bool:
        """Whether a drain that began is over: no request runs, or its time is up."""
        if self.started is None:
            return False
        return self._running == 0 or time.monotonic() - self.started >= self.seconds

    def hold(self, job) -> None:
        """Hold ``job`` (a :class:`~.worker.Job`) of a running request, to cancel if the time runs out."""
        self._jobs[id(job)] = job

    def cut(self) -> int:
        """Cancel the jobs still running; how many there were."""
        jobs = [job for job in list(self._jobs.values()) if not job.cancelled]
        for job in jobs:
            job.cancel()
        return len(jobs)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Count a request as running while inside."""
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first signal and exiting on the second (module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self.drain.draining:
            log.warning("%s again: exiting now, %d request(s) cut off", name, self.drain.count)
            sys.stderr.flush()
            os._exit(128 + sig)
        self.drain.begin()
        log.warning("%s: draining, %d request(s) running; new requests get 503; exiting once they end "
                    "(at most %g s; %s again exits at once)", name, self.drain.count, self.drain.seconds, name)  # fmt: skip

    async def on_tick(self, counter: int) -> bool:
        if self.drain.over():
            if self.drain.count:
                log.warning("drain time is up: cancelling %d request(s) (%d generating); what they fed is stored",
                            self.drain.count, self.drain.cut())  # fmt: skip
            return True
        return await super().on_tick(counter)


__all__ = ["Drain", "DrainingServer"]
