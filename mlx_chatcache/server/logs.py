"""Request ids and the server's log lines.

Contract
--------
- Every HTTP request has an id: the client's ``X-Request-Id`` when it is 1 to
  :data:`MAX_ID_CHARS` characters of ``A-Z a-z 0-9 . _ : / + = -`` (anything else is
  replaced, never echoed), else ``req_`` and 24 random hex digits (:func:`request_id`).
  While a request is handled its id is :func:`current_request_id` (a context variable
  the HTTP layer sets, :func:`bound`); work done for it on another thread passes it
  as ``extra={"request_id": ...}``.
- :func:`configure_logging` sets up the server's loggers (``mlxcc``, ``uvicorn``):
  one line per record on stderr, ``text`` (``time LEVEL request_id message``, ``-``
  outside a request) or ``json`` (one object per line: ``time`` (UTC, ISO 8601),
  ``level``, ``logger``, ``message``, ``request_id`` when there is one, the access
  fields ``method``, ``path``, ``status``, ``duration_s``, ``client`` when the record
  has them, and ``exception`` (its traceback) when it carries one).
- Nothing here logs a header: API keys never reach a log line.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import logging.config
import re
import secrets
import time
from typing import Iterator

MAX_ID_CHARS = 128
_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,%d}" % MAX_ID_CHARS)
_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("mlxcc_request_id", default=None)
ACCESS_FIELDS = ("method", "path", "status", "duration_s", "client")
FORMATS = ("text", "json")


def request_id(given: bytes | None = None) -> str:
    """The id of a request whose ``X-Request-Id`` header is ``given`` (raw bytes, None: absent)."""
    if given is not None:
        text = given.decode("latin-1")
        if _ID.fullmatch(text):
            return text
    return "req_" + secrets.token_hex(12)


def current_request_id() -> str | None:
    """The id of the request being handled here (None: none is)."""
    return _CURRENT.get()


@contextlib.contextmanager
def bound(rid: str) -> Iterator[None]:
    """Make ``rid`` the current request id for the code run inside."""
    token = _CURRENT.set(rid)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class RequestIdFilter(logging.Filter):
    """Gives every record a ``request_id``: its own (``extra``), the current one, or ``-``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _CURRENT.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}  # fmt: skip
        rid = getattr(record, "request_id", "-")
        if rid != "-":
            out["request_id"] = rid
        out.update({k: getattr(record, k) for k in ACCESS_FIELDS if hasattr(record, k)})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Send the ``mlxcc`` and ``uvicorn`` loggers' records at ``level`` and above to stderr
    in format ``fmt`` (:data:`FORMATS`), each with its request id."""
    formatter = ({"()": JsonFormatter} if fmt == "json" else
                 {"format": "%(asctime)s %(levelname)s %(request_id)s %(message)s"})  # fmt: skip
    handler = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "line",
               "filters": ["request_id"]}  # fmt: skip
    own = {"handlers": ["stderr"], "level": level.upper(), "propagate": False}
    logging.config.dictConfig({
        "version": 1, "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {"line": formatter},
        "handlers": {"stderr": handler},
        "loggers": {"mlxcc": own, "uvicorn": own, "uvicorn.error": {"level": level.upper()},
                    "uvicorn.access": {"handlers": [], "propagate": False}},
    })  # fmt: skip


__all__ = ["request_id", "current_request_id", "bound", "configure_logging", "JsonFormatter", "FORMATS"]
