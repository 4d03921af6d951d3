"""``mlxcc serve``: an OpenAI-compatible server (see :mod:`mlx_chatcache.server`).

Thin: parses flags, gathers the API keys, sets up logging, loads the model,
builds the prompt-cache store (memory tier, disk tier in ``--cache-dir``, Redis
tier at ``--cache-redis``) and runs the server until a signal drains and stops
it; the store is closed (its writers flushed) before the process exits.
"""

from __future__ import annotations

import argparse
import re

from ..config import SERVER_DEFAULTS as S
from ..config import DEFAULTS, default_cache_dir
from ..errors import UsageError
from .common import (add_cache_args, add_model_arg, add_sampling_args, add_speculative_args, check_cache_dir,
                     config_from_args, human_bytes, check_window_flags, load_model, positive_int)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}  # fmt: skip


def byte_size(text: str) -> int:
    """``2GB``, ``512MiB``, ``1500000``, ``0`` -> bytes (an argparse type)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use bytes or a unit, e.g. 512MB, 2GiB, 0")
    return int(float(m.group(1)) * _UNITS[unit])


def port_number(text: str) -> int:
    """A TCP port, 1 to 65535 (an argparse type)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}; use a number from 1 to 65535")
    return port


def server_setting(name: str):
    """The argparse type of the flag of server setting ``name``: a number in its range
    (``config.SERVER_RANGES``)."""
    from ..config import SettingError, check_setting, range_of

    integer = range_of(name).integer

    def parse(text: str):
        try:
            return check_setting(name, int(text) if integer else float(text))
        except ValueError as e:  # SettingError included
            message = str(e) if isinstance(e, SettingError) else f"invalid {'integer' if integer else 'number'}: {text!r}"
            raise argparse.ArgumentTypeError(message) from None

    return parse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server whose prompt caches survive requests and restarts",
        description="Serve the model over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health) and a chat page at / (this machine only unless --ui). Prompt caches are kept "
        "in memory and in --cache-dir, so a conversation's next turn, and the same conversation after a restart, only computes its new tokens. Up to "
        "--max-batch requests are decoded together (one model call per token for all of them); models whose cache "
        "is not plain full attention generate one request at a time. Sampling flags set the defaults of requests that do not "
        "give them; so do the speculative decoding flags (a request's num_draft_tokens: 0 turns drafting off).",
    )
    add_model_arg(p)
    p.add_argument("--host", default=S.host, help=f"address to listen on (default {S.host}: this machine only)")
    p.add_argument("--port", type=port_number, default=S.port, help=f"port to listen on, 1 to 65535 (default {S.port})")
    p.add_argument("--cache-dir", help="folder of the disk cache tier, the store's own (marked with a .mlxcc-store "
                   "file; a folder holding other files is refused; only the store's entries are ever deleted; "
                   "default MLXCC_HOME/server-cache)")  # fmt: skip
    p.add_argument("--cache-bytes", type=byte_size, default=S.memory_cache_bytes,
                   help=f"memory tier budget, e.g. 2GB; 0 turns it off (default {human_bytes(S.memory_cache_bytes)})")
    p.add_argument("--disk-cache-bytes", type=byte_size, default=S.disk_cache_bytes,
                   help=f"disk tier budget; 0 turns it off (default {human_bytes(S.disk_cache_bytes)})")
    p.add_argument("--cache-redis", metavar="URL",
                   help="a Redis tier shared by replicas, e.g. redis://127.0.0.1:6379/0, or any node of a "
                   "Redis Cluster (needs the redis package; Redis's maxmemory and eviction policy bound it; "
                   f"values expire {S.redis_ttl_seconds} s after their last use)")
    p.add_argument("--context-length", type=positive_int,
                   help="tokens a request may use, prompt plus reply (default: the model's own)")
    p.add_argument("--max-queue", type=positive_int, default=S.max_queue,
                   help=f"requests that may wait for the generator; more get HTTP 503 (default {S.max_queue})")
    p.add_argument("--max-batch", type=server_setting("max_batch"), default=S.max_batch, metavar="N",
                   help="requests decoded together, 1 to 64; 1: one at a time (default "
                   f"{S.max_batch}: decoding reads the weights once per step for every row)")
    p.add_argument("--served-model-name", metavar="NAME", action="append", default=[],
                   help="another name clients may give as 'model' (repeatable; also listed by /v1/models). "
                   "The model's path and folder name, 'default_model' and an omitted 'model' always work")
    p.add_argument("--api-key", metavar="KEY", action="append", default=[],
                   help="a key clients must send, as 'Authorization: Bearer KEY' or 'x-api-key: KEY' (repeatable; "
                   "also MLXCC_API_KEY and --api-key-file). With keys, every request but GET /health, HEAD / and "
                   "the chat page's files needs one, and each key's requests use store entries of their own "
                   "(see --shared-store). A key is 1 to 1024 printable ASCII characters without spaces")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="a file of keys, one per line (blank lines and lines starting with # are skipped)")
    p.add_argument("--shared-store", action="store_true",
                   help="let requests of different keys share store entries (default: each key has its own, so "
                   "no request is served, or timed, by another key's cached prompts)")
    p.add_argument("--drain-seconds", type=server_setting("drain_seconds"), default=S.drain_seconds, metavar="S",
                   help="on SIGTERM or SIGINT, how long running requests may still finish, 0 to 3600; new ones get "
                   "503 meanwhile; a second signal exits at once (default %(default)g)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level (default info)")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="log lines as text or one JSON object each, for log collectors; every line about a "
                   "request carries its id (the X-Request-Id the client sent, or one made; default text)")
    page = p.add_mutually_exclusive_group()
    page.add_argument("--ui", action="store_true", help="serve the chat page at / even when --host is not "
                      "loopback (anyone who reaches the server can use it, unless API keys are set: then the "
                      "page asks for one)")
    page.add_argument("--no-ui", action="store_true", help="no chat page at / (the API is unchanged)")
    add_sampling_args(p)
    add_speculative_args(p)
    add_cache_args(p, f"the first {DEFAULTS.keep} tokens of each request (a request with a window is generated "
                      "alone, not batched)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "prometheus_client")):
        raise UsageError("mlxcc serve needs starlette, uvicorn and prometheus_client: "
                         "pip install 'mlx-chatcache[serve]'")  # fmt: skip
    from ..models.loading import resolve_model_ref
    from ..server.app import listen_socket, serve
    from ..server.auth import ApiKeys, gather_keys
    from ..server.logs import configure_logging
    from ..server.service import Service
    from ..server.ui import ui_mode
    from ..store.store import build_store

    config = check_window_flags(config_from_args(args))  # before the model loads
    if any(not name.strip() for name in args.served_model_name):
        raise UsageError("--served-model-name needs a non-empty NAME")
    keys = gather_keys(args.api_key, args.api_key_file)
    configure_logging(args.log_level, args.log_format)
    cache_dir = args.cache_dir or default_cache_dir()
    if args.disk_cache_bytes > 0:
        check_cache_dir(str(cache_dir))  # a folder it cannot use is one line, before the model loads
    sock = listen_socket(args.host, args.port)  # a taken port is one line, before the model loads
    try:
        ref = resolve_model_ref(args.model)
        model, tokenizer = load_model(args)  # --adapter-path and --trust-remote-code too
        drafts = S.draft_index_tokens if config.prompt_lookup == "store" else 0
        store = build_store(args.cache_bytes, args.disk_cache_bytes, cache_dir,
                            redis_url=args.cache_redis, draft_tokens=drafts)  # fmt: skip
        try:
            service = Service(model, tokenizer, ref, store, config, args.max_queue, args.context_length,
                              served_names=tuple(args.served_model_name), max_batch=args.max_batch)  # fmt: skip
            serve(service, sock, args.log_level, ui_mode(args.host, args.ui, args.no_ui),
                  ApiKeys(keys, args.shared_store) if keys else None, args.drain_seconds)  # fmt: skip
        finally:
            store.close()
    finally:
        sock.close()
    return 0
