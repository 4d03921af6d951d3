"""``mlxcc sessions [list|show NAME|export NAME|rm NAME]``: the chat sessions kept in MLXCC_HOME.

Reads file headers only (no arrays). ``rm`` refuses a session a running chat
holds (its lock).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..chat.session_catalog import format_conversation, list_sessions, read_session_info, remove_session, session_source
from ..chat.session_export import FORMATS, to_json, to_markdown
from ..chat.session_catalog import branches
from ..chat.session_file import sessions_dir
from ..errors import UsageError
from ..files.atomic import write_text_atomic
from .common import human_bytes, plural

COLUMNS = ("NAME", "MODEL", "TURNS", "TOKENS", "SIZE", "LAST USED")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sessions",
        help="list, show, export or remove saved chat sessions",
        description="The chat sessions saved with 'mlxcc chat --session NAME' (in MLXCC_HOME/sessions, "
        "default MLXCC_HOME: ~/.mlxcc). Without an action: list them, most recently used first.",
    )
    p.add_argument("--json", action="store_true", help="list as JSON")
    ssub = p.add_subparsers(dest="sessions_command", metavar="ACTION", parser_class=type(p))
    ls = ssub.add_parser("list", help="list the sessions: name, model, turns, tokens, size, last used",
                         description="List the sessions: name, model, turns, tokens, size on disk, last used.")
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.set_defaults(run=run_list)
    show = ssub.add_parser("show", help="print a session's conversation", description="Print a session's conversation.")
    show.add_argument("name", help="the session name")
    show.add_argument("--json", action="store_true", help="print the messages as JSON")
    show.set_defaults(run=run_show)
    export = ssub.add_parser(
        "export", help="write a session's conversation as JSON (OpenAI messages) or Markdown",
        description="Write a session's conversation: --format json is the list of {role, content} "
        "messages an OpenAI-style chat completion request takes; --format md is Markdown, one '## ROLE' "
        "section per message (content that could fake a section is fenced). Reads the file's header only.",
    )  # fmt: skip
    export.add_argument("name", help="the session name")
    export.add_argument("--format", choices=FORMATS, default="json", help="json (default) or md")
    export.add_argument("--output", "-o", metavar="FILE", help="write to FILE (atomically) instead of stdout")
    export.add_argument("--force", action="store_true", help="replace FILE when it exists (default: refuse)")
    export.set_defaults(run=run_export)
    rm = ssub.add_parser("rm", help="delete a session (not while a chat holds it)",
                         description="Delete a session file; refused while a chat has the session open.")
    rm.add_argument("name", nargs="+", help="the session name(s)")
    rm.set_defaults(run=run_rm)
    p.set_defaults(run=run_list)


def _model_label(ref: str | None, adapter: str | None) -> str:
    label = os.path.basename(ref.rstrip("/")) if ref and os.path.isabs(ref) else (ref or "?")
    return label + (f" + {os.path.basename(adapter.rstrip('/'))}" if adapter else "")


def run_list(args: argparse.Namespace) -> int:
    sessions = list_sessions()
    if args.json:
        rows = [{"name": s.name, "model": s.model, "adapter_path": s.adapter_path, "turns": s.turns,
                 "tokens": s.tokens, "size": s.size, "last_used": s.last_used, "path": str(s.path),
                 "problem": s.problem} for s in sessions]  # fmt: skip
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return 0
    if not sessions:
        print(f"no sessions in {sessions_dir()} (start one with 'mlxcc chat --session NAME')")
        return 0
    rows = [COLUMNS]
    for s in sessions:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.last_used))
        model = f"({s.label})" if s.problem else _model_label(s.model, s.adapter_path)
        rows.append((s.name, model, str(s.turns), str(s.tokens), human_bytes(s.size), used))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    sys.stdout.flush()  # the table first, then what could not be read
    for s in sessions:
        if s.problem:
            sys.stderr.write(f"warning: session '{s.name}' cannot be read ({s.reason}); "
                             f"remove it with 'mlxcc sessions rm {s.name}'\n")  # fmt: skip
    return 0


def run_show(args: argparse.Namespace) -> int:
    info = read_session_info(args.name)
    if args.json:
        print(json.dumps(info.messages, indent=2, ensure_ascii=False))
        return 0
    src = session_source(info)
    turns = sum(1 for m in info.messages if m["role"] == "assistant")
    print(f"session '{args.name}': model {src['model'] or '?'}"
          + (f" + adapter {src['adapter_path']}" if src["adapter_path"] else "")
          + f", {plural(turns, 'turn')}, {plural(info.num_tokens or 0, 'token')}")  # fmt: skip
    forks = branches(args.name)
    if forks:
        print("branches: " + ", ".join(f"{b} (at turn {n})" for b, n in forks))
    print(format_conversation(info.messages))
    return 0


def run_export(args: argparse.Namespace) -> int:
    info = read_session_info(args.name)
    if args.format == "json":
        text = to_json(info.messages)
    else:
        text = to_markdown(args.name, session_source(info)["model"], info.messages)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.output).expanduser()
    if out.exists() and not args.force:
        raise UsageError(f"{out} exists; pass --force to replace it, or choose another file")
    write_text_atomic(out, text)
    sys.stderr.write(f"wrote {out} ({plural(len(info.messages), 'message')}, {args.format})\n")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    for name in args.name:
        path = remove_session(name)
        print(f"removed session '{name}' ({path})")
    return 0
