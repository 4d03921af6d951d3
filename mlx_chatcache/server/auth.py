"""API keys: who may use the server, and which store entries each key's requests share.

Contract
--------
- :func:`gather_keys` collects the keys of ``--api-key KEY`` (repeatable), the
  ``MLXCC_API_KEY`` environment variable (ignored when empty) and ``--api-key-file``
  (one key per line; blank lines and lines starting with ``#`` are skipped). A key is
  1 to 1024 printable ASCII characters without spaces (``config.SERVER_RANGES
  ["api_key_length"]``); anything else, or a file that cannot be read or holds no key,
  is one :class:`~mlx_chatcache.errors.UsageError` line that names where the key came
  from (a file's line number), never the key.
- :class:`ApiKeys` checks a request's headers: ``Authorization: Bearer KEY`` or
  ``x-api-key: KEY``. :meth:`ApiKeys.tenant` is the request's tenant: None when the key
  is missing or wrong (then :meth:`ApiKeys.why` says which), else its id. Every key is
  compared, in constant time (``hmac.compare_digest`` of SHA-256 digests, so neither
  the content nor the length of a key is timed), whatever the headers hold.
- A tenant id is the first 16 hex digits of a SHA-256 of the key: stable across
  restarts, never the key. Unless ``shared_store``, each key's requests use store
  entries of their own (their scope's namespace includes the id, see
  :func:`~mlx_chatcache.store.store.tenant_scope`), so no request is ever served, or
  timed, by another key's entries; with ``shared_store`` every key's tenant is
  :data:`SHARED` (entries shared by all, as without keys).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Iterable, Mapping

from ..config import SERVER_RANGES
from ..errors import UsageError

ENV = "MLXCC_API_KEY"
SHARED = ""  # the tenant of every key with shared_store: one scope for all
_PREFIX = b"mlxcc-tenant\0"


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def tenant_id(key: str) -> str:
    """The tenant id of ``key`` (see the module docstring)."""
    return hashlib.sha256(_PREFIX + key.encode("ascii")).hexdigest()[:16]


def check_key(key: str, where: str) -> str:
    """``key`` when it is a usable key, else a UsageError naming ``where`` it came from (never the key)."""
    r = SERVER_RANGES["api_key_length"]
    if not (key.isascii() and key.isprintable() and " " not in key and r.low <= len(key) <= r.high):
        raise UsageError(f"{where}: an API key is {int(r.low)} to {int(r.high)} printable ASCII characters without "
                         f"spaces (this one has {len(key)} characters); use another key")  # fmt: skip
    return key


def read_key_file(path: str) -> list[str]:
    """The keys in ``path``, one per line (see the module docstring)."""
    try:
        text = Path(path).expanduser().read_bytes().decode("utf-8")
    except OSError as e:
        raise UsageError(f"cannot read --api-key-file {path}: {e.strerror or e}; check the path") from None
    except UnicodeDecodeError:
        raise UsageError(f"--api-key-file {path} is not UTF-8 text; write one key per line") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(check_key(line, f"--api-key-file {path} line {number}"))
    if not keys:
        raise UsageError(f"--api-key-file {path} holds no key; write one key per line")
    return keys


def gather_keys(flags: Iterable[str] = (), key_file: str | None = None,
                environ: Mapping[str, str] = os.environ) -> list[str]:  # fmt: skip
    """Every key the flags, the environment and the file give, each once, in that order."""
    keys = [check_key(k, "--api-key") for k in flags]
    if environ.get(ENV):
        keys.append(check_key(environ[ENV], ENV))
    if key_file is not None:
        keys += read_key_file(key_file)
    return list(dict.fromkeys(keys))


def _header(headers: Mapping[bytes, bytes] | list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    items = headers.items() if isinstance(headers, Mapping) else headers
    return [v for k, v in items if k.lower() == name]


def offered(headers) -> list[bytes]:
    """The keys a request offers: each ``Authorization: Bearer KEY`` and ``x-api-key: KEY``
    header's (raw ASGI header pairs)."""
    out = []
    for value in _header(headers, b"authorization"):
        scheme, _, rest = value.strip().partition(b" ")
        if scheme.lower() == b"bearer":
            out.append(rest.strip())
    return out + [v.strip() for v in _header(headers, b"x-api-key")]


class ApiKeys:
    def __init__(self, keys: Iterable[str], shared_store: bool = False):
        self.keys = list(dict.fromkeys(keys))
        if not self.keys:
            raise ValueError("ApiKeys needs at least one key")
        self.shared_store = shared_store
        self._digests = [(_digest(k.encode("ascii")), SHARED if shared_store else tenant_id(k)) for k in self.keys]

    def tenant(self, headers) -> str | None:
        """The tenant of the request with these raw header pairs; None: no key of ours."""
        found = None
        for given in offered(headers):
            d = _digest(given)
            for digest, tenant in self._digests:  # every one compared: no early exit
                if hmac.compare_digest(d, digest) and found is None:
                    found = tenant
        return found

    @staticmethod
    def why(headers) -> str:
        """Why a request was refused, in one line (never quoting what it sent)."""
        if not offered(headers):
            return ("this server needs an API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        return "the API key is not valid; check the key you were given"


__all__ = ["ApiKeys", "gather_keys", "check_key", "read_key_file", "tenant_id", "ENV", "SHARED"]
