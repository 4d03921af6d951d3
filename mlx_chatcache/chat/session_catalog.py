"""The saved chat sessions of ``mlxcc_home()/sessions``: list, show, remove.

Everything here reads file headers (:func:`read_cache_info`: the token ids,
messages and session JSON) and loads no arrays; listing checks each file's
bytes against its checksums (without MLX), so a damaged session is listed as
damaged, and as repairable when its header (the conversation) reads whole.
:func:`remove_session` deletes a session only when no
process holds it (:class:`SessionLock`); :func:`list_sessions` also removes
lock files left by killed chats. :func:`session_source` says which model (and
adapter) a session was made with, so ``mlxcc chat --session NAME`` can resume
without ``--model``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ChatCacheError, SessionError
from ..files.mlxcc_format import CacheFileInfo, read_cache_info, verify_cache_file
from ..files.atomic import remove_stale_temp_files
from ..files.cache_file import SESSION_KEY
from ..files.lock import SessionLock, remove_stale_lock
from .session_file import SESSION_SUFFIX, DamagedSessionError, damage_detail, session_path, sessions_dir


@dataclass
class SessionSummary:
    name: str
    path: Path
    size: int  # bytes on disk
    last_used: float  # modification time (saved after every turn)
    model: str | None = None
    adapter_path: str | None = None
    turns: int = 0
    tokens: int = 0
    problem: str | None = None  # why the file could not be read as a session (the full error text)
    label: str | None = None  # that reason in a word or two: "damaged", "not a chat session", "newer format"
    reason: str | None = None  # that reason in a short phrase, without the file's path or a remedy
    repairable: bool = False  # damaged arrays under a whole header: 'mlxcc sessions repair' rebuilds it


def session_source(info: CacheFileInfo) -> dict:
    """``{"model": ref | None, "adapter_path": path | None, "draft_model": ref | None}`` a
    session file was made with."""
    source = {}
    try:
        meta = json.loads(info.metadata.get(SESSION_KEY, "{}"))
        source = meta.get("source") if isinstance(meta, dict) else None
    except (json.JSONDecodeError, RecursionError):
        source = None
    source = source if isinstance(source, dict) else {}
    model = source.get("model")
    if not isinstance(model, str):  # files from before sessions recorded their source
        model = info.model.model_id if info.model else None
    adapter, draft = source.get("adapter_path"), source.get("draft_model")
    return {"model": model, "adapter_path": adapter if isinstance(adapter, str) else None,
            "draft_model": draft if isinstance(draft, str) else None}  # fmt: skip


def summarize(name: str, path: Path) -> SessionSummary:
    st = path.stat()
    s = SessionSummary(name, path, st.st_size, st.st_mtime)
    try:
        info = read_cache_info(path)
    except ChatCacheError as e:
        s.problem = str(e)
        s.label, s.reason = _problem_words(s.problem, path)
        return s
    if SESSION_KEY not in info.metadata or info.messages is None:
        s.problem = s.reason = "a cache file, not a chat session"
        s.label = "not a chat session"
    else:
        try:
            verify_cache_file(path)  # every array's bytes against its checksum
        except ChatCacheError as e:
            damaged = DamagedSessionError(path, damage_detail(str(e), path), len(info.messages))
            s.problem, s.label, s.reason, s.repairable = str(damaged), "damaged", damaged.detail, True
    src = session_source(info)
    s.model, s.adapter_path = src["model"], src["adapter_path"]
    s.turns = sum(1 for m in info.messages or [] if m["role"] == "assistant")
    s.tokens = info.num_tokens or 0
    return s


def _problem_words(text: str, path: Path) -> tuple[str, str]:
    """``(label, reason)`` of the error a session file's header could not be read with."""
    if "newer than this" in text:
        return "newer format", "written by a newer mlx_chatcache: upgrade it to read this session"
    return "damaged", damage_detail(text, path)


def list_sessions(folder: Path | None = None) -> list[SessionSummary]:
    """Every session in ``folder`` (default :func:`sessions_dir`), most recently used first."""
    folder = folder or sessions_dir()
    if not folder.is_dir():
        return []
    for lock in folder.glob("*.lock"):
        remove_stale_lock(lock)
    out = []
    for p in folder.iterdir():
        if p.name.startswith(".") or not p.name.endswith(SESSION_SUFFIX) or not p.is_file():
            continue  # temp files of a save in progress are dot files
        out.append(summarize(p.name[: -len(SESSION_SUFFIX)], p))
    return sorted(out, key=lambda s: (-s.last_used, s.name))


def existing_session(name: str) -> Path:
    path = session_path(name)
    if not path.is_file():
        raise SessionError(f"no session named '{name}' in {path.parent}; 'mlxcc sessions' lists them")
    return path


def read_session_info(name: str) -> CacheFileInfo:
    """The header of session ``name`` (SessionError when it is not a chat session)."""
    path = existing_session(name)
    info = read_cache_info(path)
    if info.messages is None or SESSION_KEY not in info.metadata:
        raise SessionError(f"{path} is a cache file but not a chat session; inspect it with 'mlxcc cache info'")
    return info


def remove_session(name: str) -> Path:
    """Delete session ``name`` (and its lock and leftover temp files) unless a chat holds it."""
    path = existing_session(name)
    with SessionLock(path, f"'{name}'"):
        os.unlink(path)
        remove_stale_temp_files(path)
    return path


def resume_source(path: Path, label: str) -> dict:
    """The model (and adapter) to resume the session at ``path`` with when no
    ``--model`` is given; SessionError when it is unknown or no longer on disk."""
    src = session_source(read_cache_info(path))
    model = src["model"]
    if not model:
        raise SessionError(f"session {label} does not say which model made it; pass --model")
    for what, ref in (("model", model), ("adapter", src["adapter_path"])):
        if ref and os.path.isabs(ref) and not os.path.exists(ref):
            raise SessionError(
                f"session {label} was made with the {what} {ref}, which no longer exists; "
                "pass --model PATH (and --adapter-path) to resume it with the same model moved elsewhere"
            )
    return src


def format_conversation(messages: list[dict]) -> str:
    """One block per message: ``role:`` then its text, indented (``sessions show``, ``/history``);
    user messages are numbered (``user [N]:``), as ``/edit N`` names them."""
    if not messages:
        return "(no messages yet)"
    blocks, n = [], 0
    for m in messages:
        body = m["content"].replace("\n", "\n    ")
        n += m["role"] == "user"
        blocks.append(f"{m['role']} [{n}]:\n    {body}" if m["role"] == "user" else f"{m['role']}:\n    {body}")
    return "\n".join(blocks)


def branches(name: str, folder: Path | None = None) -> list[tuple[str, int]]:
    """``[(session, turns)]``: the sessions in ``folder`` (default :func:`sessions_dir`)
    branched from session ``name``, at ``turns`` turns, by name (headers only)."""
    from .session_file import parse_branch_of

    folder = folder or sessions_dir()
    out = []
    for p in sorted(folder.glob(f"*{SESSION_SUFFIX}")) if folder.is_dir() else []:
        if p.name.startswith("."):
            continue
        try:
            meta = json.loads(read_cache_info(p).metadata.get(SESSION_KEY, "{}"))
        except (ChatCacheError, OSError, json.JSONDecodeError, RecursionError):
            continue  # damaged or not a session: 'mlxcc sessions' says so
        parent = parse_branch_of(meta) if isinstance(meta, dict) else None
        if parent is not None and parent["session"] == name:
            out.append((p.name[: -len(SESSION_SUFFIX)], parent["turns"]))
    return out


__all__ = [
    "branches",
    "format_conversation",
    "SessionSummary",
    "list_sessions",
    "read_session_info",
    "remove_session",
    "resume_source",
    "session_source",
]
