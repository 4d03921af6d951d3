"""Real processes to kill, started without a new interpreter's seconds of imports.

``ForkServer(*modules)`` is a context manager: entering starts a Python process that
imports ``modules`` once (``mlx_chatcache`` first, then e.g. ``mlx.core``) and computes
nothing; :meth:`ForkServer.start` has it fork a child that runs ``code`` with ``sys.argv``
set to ``argv`` and its stdout a pipe to the server. ``start`` returns the child's pid once
the child printed its first line (e.g. "ready"), which it returns too; later output is read
and dropped by the server, so a child never blocks on it. The test kills the child
itself (``os.kill(pid, SIGKILL)``, a real process, killed wherever it is) and calls
:meth:`ForkServer.reap` to wait until it is gone. Leaving stops the server and kills any
child still running.

The server computes nothing before it forks, and runs OpenBLAS on one thread
(``MLXCC_BLAS_THREADS=1``): a worker thread of a BLAS pool would not exist in the child,
so each child starts as a fresh process would, minus the imports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

SERVER = textwrap.dedent(
    """
    import importlib, json, os, select, sys, traceback

    for name in sys.argv[1:]:
        importlib.import_module(name)
    out = sys.stdout
    out.write("up\\n")
    out.flush()
    pipes = {}  # read end -> child pid

    def command(line):
        msg = json.loads(line)
        if msg["op"] == "start":
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: runs the code, never returns to this loop
                os.close(r)
                os.dup2(w, 1)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.argv = msg["argv"]
                code = 0
                try:
                    exec(compile(msg["code"], "<child>", "exec"), {"__name__": "__main__"})
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
                except BaseException:
                    traceback.print_exc()
                    code = 1
                sys.stdout.flush()
                os._exit(code)
            os.close(w)
            first = b""
            while not first.endswith(b"\\n"):
                chunk = os.read(r, 1)
                if not chunk:
                    break
                first += chunk
            pipes[r] = pid
            out.write(json.dumps({"pid": pid, "first": first.decode(errors="replace")}) + "\\n")
        else:  # reap
            _, status = os.waitpid(msg["pid"], 0)
            for r, pid in list(pipes.items()):
                if pid == msg["pid"]:
                    os.close(r)
                    del pipes[r]
            out.write(json.dumps({"status": status}) + "\\n")
        out.flush()

    while True:
        ready, _, _ = select.select([sys.stdin, *pipes], [], [])
        for f in ready:
            if f is sys.stdin:
                line = sys.stdin.readline()
                if not line:
                    sys.exit(0)
                command(line)
            elif f in pipes and not os.read(f, 65536):  # a child's later output: dropped
                os.close(f)
                del pipes[f]
    """
)


class ForkServer:
    def __init__(self, *modules: str):
        self.modules = ("mlx_chatcache", *modules)  # first: it switches MLX's BLAS before mlx.core loads
        self.proc: subprocess.Popen | None = None
        self.children: set[int] = set()

    def __enter__(self) -> "ForkServer":
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, *self.modules], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "MLXCC_BLAS_THREADS": "1"})  # fmt: skip
        assert self.proc.stdout.readline() == "up\n", "the fork server did not start"
        return self

    def _ask(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    def start(self, code: str, *argv: str) -> tuple[int, str]:
        """Fork a child running ``code`` (``sys.argv = ["-c", *argv]``); (its pid, its first line)."""
        got = self._ask(op="start", code=code, argv=["-c", *map(str, argv)])
        self.children.add(got["pid"])
        return got["pid"], got["first"]

    def reap(self, pid: int) -> int:
        """Wait until child ``pid`` is gone; its wait status."""
        self.children.discard(pid)
        return self._ask(op="reap", pid=pid)["status"]

    def __exit__(self, *exc) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.reap(pid)
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
