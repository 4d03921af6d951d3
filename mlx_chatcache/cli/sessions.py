"""``mlxcc sessions [list|show NAME|export NAME|repair NAME|rm NAME]``: the chat sessions kept in
MLXCC_HOME.

Reads file headers and loads no arrays (listing checks every file's checksums, without MLX),
except ``repair``, which loads the session's model and computes its cache again from the
conversation its file holds. ``rm`` and ``repair`` refuse a session a running chat holds (its lock).
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
from ..chat.session_catalog import existing_session
from .common import add_model_arg, add_weights_arg, human_bytes, plural

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
    repair = ssub.add_parser(
        "repair", help="compute a damaged session's cache again from the conversation its file holds",
        description="A session whose cache is damaged (its bytes changed after it was written, as "
        "'mlxcc sessions' lists it) keeps its conversation and settings in the file's header: repair "
        "loads the session's model, feeds the conversation once (with progress) and saves the session "
        "with its new cache, atomically; then 'mlxcc chat --session NAME' continues it. A session that "
        "is not damaged is left as it is.",
    )  # fmt: skip
    repair.add_argument("name", help="the session name (or the path of a --session-file, with a '/')")
    add_model_arg(repair, "the model the session was made with")
    add_weights_arg(repair)
    repair.set_defaults(run=run_repair)
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
                 "problem": s.problem, "repairable": s.repairable} for s in sessions]  # fmt: skip
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
        if s.repairable:
            sys.stderr.write(f"warning: session '{s.name}' is damaged ({s.reason}); its conversation is intact: "
                             f"repair it with 'mlxcc sessions repair {s.name}'\n")  # fmt: skip
        elif s.label == "damaged":  # the header: the conversation is lost with it
            sys.stderr.write(f"warning: session '{s.name}' cannot be read ({s.reason}), nor can its conversation, "
                             f"so it cannot be repaired; 'mlxcc sessions rm {s.name}' removes it\n")  # fmt: skip
        elif s.problem:
            sys.stderr.write(f"warning: session '{s.name}' cannot be read ({s.reason})\n")
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


def run_repair(args: argparse.Namespace) -> int:
    """Repair a damaged session (:func:`~mlx_chatcache.chat.repair.repair_session`) under its lock."""
    from ..chat.session_catalog import resume_source
    from ..chat.session_file import DamagedSessionError
    from ..files.cache_file import claim
    from .chat_file import check_session_file
    from .common import load_model
    from .progress import ProgressBar

    if "/" in args.name:
        path, label = Path(args.name).expanduser(), args.name
    else:
        path, label = existing_session(args.name), f"'{args.name}'"
    check_session_file(path, f"sessions repair {args.name}", "only a chat session can be repaired ('mlxcc sessions' "
                       "lists them)")
    with claim(path, mine=True, label=label, required=True) as held:
        source = resume_source(path, label) if args.model is None else None
        model, tokenizer = load_model(args, source)
        from ..chat.repair import repair_session
        from ..chat.session import ChatSession

        try:
            ChatSession.load(path, model, tokenizer)
        except DamagedSessionError as e:
            sys.stderr.write(f"session {label} is damaged ({e.detail}): computing its cache again from its "
                             f"{plural(e.messages, 'message')}\n")  # fmt: skip
        else:
            print(f"session {label} is not damaged: nothing to repair (continue it with {chat_command(path)})")
            return 0
        bar = ProgressBar("repair", stream=sys.stderr)
        try:
            session = repair_session(path, model, tokenizer, progress=bar.update)
        finally:
            bar.close()
        for line in session.load_notes:
            sys.stderr.write(line + "\n")
        session.save(held)
    print(f"repaired session {label}: {plural(session.cached_tokens, 'token')} of {plural(session.num_turns, 'turn')} "
          f"computed again; continue it with {chat_command(path)}")  # fmt: skip
    return 0


def chat_command(path: Path) -> str:
    """``'mlxcc chat --session NAME'`` (or ``--session-file PATH``) for the session at ``path``."""
    from ..chat.session_file import session_name

    name = session_name(path)
    return f"'mlxcc chat --session {name}'" if name != str(path) else f"'mlxcc chat --session-file {path}'"


def run_rm(args: argparse.Namespace) -> int:
    for name in args.name:
        path = remove_session(name)
        print(f"removed session '{name}' ({path})")
    return 0
