"""Chat session files and session names.

Files
-----
A session file is one cache file (see ``docs/cache-format.md``), a
:class:`~mlx_chatcache.files.prompt_cache.PromptCache` written with its ``save``
(atomically, through the door) and read with its ``load``: the cache, its token
ids, the messages, the model fingerprint, the layer copies of the newest
checkpoints and, in the user metadata key ``session``, a JSON object with the
settings and the bookkeeping of a
:class:`~mlx_chatcache.chat.session.ChatSession` (a :class:`SessionRecord`).
:func:`save_session` writes a record (a previous file survives any failure);
:func:`load_session` reads one back for a model and refuses, in one line each:
a missing file and a cache file that is not a session or uses a newer session
format (:class:`SessionError`), a file made with another model
(:class:`ModelMismatchError`), a header that cannot be read (:class:`CacheFileError`:
nothing to repair from) and a damaged cache or session metadata under a header
that reads whole (:class:`DamagedSessionError`: :func:`stored_session` reads the
conversation and settings it still holds, to repair it). A saved setting of the
right type but outside its range (:data:`~mlx_chatcache.config.RANGES`; an older
version may have saved it) is dropped, the default used, and said in one line of
the record's ``notes``.

Names
-----
:func:`session_path` maps a session name to
``mlxcc_home()/sessions/NAME.safetensors`` and refuses names that could leave
that folder. The lock that lets one process at a time hold a session is
:mod:`mlx_chatcache.files.lock`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..files.cache_file import SESSION_KEY, Claim, claim
from ..files.mlxcc_format import read_cache_info
from ..config import (DEFAULTS, RANGES, SESSION_CHECKPOINT_BYTES, SHAPE_KEYS, CacheShape, GenerationConfig,
                      SettingError, check_setting, check_window, mlxcc_home)
from ..errors import CacheFileError, ModelMismatchError, SessionError, UsageError, clipped
from ..models.fingerprint import ModelFingerprint

if TYPE_CHECKING:  # imported where a session is loaded: names, paths and locks need no MLX or mlx-lm
    from ..files.prompt_cache import PromptCache
    from ..store.store import PromptStore, Scope
    from .checkpoints import Checkpoint

SESSION_FORMAT = 2  # the newest understood; 2: a checkpoint may list spans of tokens to read again (a 6th
# element), written only by a session that has one (others stay 1, which older versions read)


@dataclass
class SessionRecord:
    """What a session file holds besides the model (see the module doc)."""

    state: PromptCache  # the cache, its tokens and the conversation they are (``state.messages``)
    config: GenerationConfig
    pending: list[int]  # fed first next turn (the last reply token; more after a rollback)
    text: str  # every prompt and reply so far, exactly as fed or generated
    checkpoints: list[Checkpoint]  # the newest cache copies saved too (kept_copies)
    attempt: int  # retries of the last turn
    source: dict | None = None  # how the model was loaded: {"model": ref, "adapter_path": path | None}
    notes: list[str] = dataclasses.field(default_factory=list)  # loading: saved settings dropped (not saved)
    branch_of: dict | None = None  # {"session": name or path, "turns": n}: forked from there, at n turns
    template_args: dict | None = None  # extra arguments of the chat template
    stop: tuple[str, ...] = ()  # stop strings: a reply ends before the first
    reread: list = dataclasses.field(default_factory=list)  # spans of ``pending`` read before (chat.held)


# ------------------------------------------------------------------ save
def session_metadata(record: SessionRecord, snapshot_index: Sequence[int] = ()) -> dict:
    """The JSON object stored under the ``session`` metadata key; ``snapshot_index``:
    per checkpoint, the file snapshot holding its cache copy (-1: none; default none)."""
    index = list(snapshot_index) or [-1] * len(record.checkpoints)
    return {
        "format": 2 if any(c.reread for c in record.checkpoints) else 1,
        "settings": dataclasses.asdict(record.config),
        "max_kv_size": record.state.shape.max_kv_size,
        "keep": record.state.shape.keep,
        "pending": list(record.pending),
        "text": record.text,
        "checkpoints": [[*c.to_json(), k, *([_spans_json(c.reread)] if c.reread else [])]
                        for c, k in zip(record.checkpoints, index)],
        "attempt": record.attempt,
        **({"source": record.source} if record.source else {}),
        **({"branch_of": record.branch_of} if record.branch_of else {}),
        **({"template_args": record.template_args} if record.template_args else {}),
        **({"stop": list(record.stop)} if record.stop else {}),
        **({"reread": _spans_json(record.reread)} if record.reread else {}),
    }


def _spans_json(spans) -> list[list[int]]:
    return [[a, b] for a, b in spans]


def _parse_spans(path, raw) -> list[tuple[int, int]]:
    """Spans of positions as a session file records them (``[[start, end], ...]``)."""
    if not (isinstance(raw, list) and all(isinstance(x, list) and len(x) == 2 and all(_is_int(v) for v in x)
                                          and 0 <= x[0] <= x[1] for x in raw)):  # fmt: skip
        raise CacheFileError(f"{path}: the session's recomputation spans are malformed; the file is damaged")
    return [(a, b) for a, b in raw]


def save_session(path: Claim | str | os.PathLike | None, record: SessionRecord,
                 fingerprint: ModelFingerprint | None, shared: PromptStore | None = None,
                 ends: Sequence[int] = ()) -> list[str]:  # fmt: skip
    """Write ``record`` to ``path`` atomically (None: no file): its prompt cache, with the
    conversation as its messages and the session JSON as user metadata
    (:meth:`~mlx_chatcache.files.prompt_cache.PromptCache.save`; its errors are raised).
    The ``shared`` store's tiers (``--cache-dir``) get the cache too; returns one line
    for each that could not take it.

    ``path`` is the chat's :class:`~mlx_chatcache.files.cache_file.Claim` of its
    session file, or a path claimed as the caller's own (``mine``: a session
    there is replaced; a file another process holds, or one that is not a
    cache, is refused) for the write."""
    from ..generation.checkout import put_prompt

    if path is not None and not isinstance(path, Claim):
        with claim(path, mine=True) as held:
            return save_session(held, record, fingerprint, shared, ends)
    snapshots, index = kept_copies(record.checkpoints)
    prompt = dataclasses.replace(  # the session's cache as its file holds it (sharing layers and tokens)
        record.state, fingerprint=fingerprint,
        settings=record.state.shape.recording(record.state.settings, record.config),
        metadata={SESSION_KEY: json.dumps(session_metadata(record, index), ensure_ascii=False)},
        snapshots=snapshots,
    )
    problems: list[str] = []
    put_prompt(shared, session_scope(fingerprint, record), prompt, problems.append, named=path, ends=ends)
    return problems


def kept_copies(checkpoints: Sequence[Checkpoint]) -> tuple[list, list[int]]:
    """``(snapshots, index)``: the checkpoint copies a session file keeps, those of the
    newest checkpoints while their bytes sum to at most
    :data:`~mlx_chatcache.config.SESSION_CHECKPOINT_BYTES` (a copy at an empty cache
    is not kept: an empty cache is made for free), and per checkpoint its snapshot (-1: none)."""
    from ..cache import prompt_cache_nbytes

    snapshots, index, total = [], [-1] * len(checkpoints), 0
    for k in range(len(checkpoints) - 1, -1, -1):
        c = checkpoints[k]
        if c.cache is None or c.state_len == 0:
            continue
        n = prompt_cache_nbytes([x for x in c.cache if x is not None])
        if total + n > SESSION_CHECKPOINT_BYTES:
            break
        total += n
        index[k] = len(snapshots)
        snapshots.append(c.cache)
    return snapshots, index


def session_scope(fingerprint: ModelFingerprint | None, record: SessionRecord) -> Scope:
    """The store scope of a session's cache: the model, the session's window and KV
    settings, the weight policy its model was loaded with."""
    from ..generation.checkout import scope_of

    return scope_of(fingerprint, _cache_config(record), record.state.settings.get("weights"))


def _cache_config(record: SessionRecord) -> GenerationConfig:
    """The session's settings with the window its cache has."""
    return record.config.windowed(record.state.shape)


# ------------------------------------------------------------------ load
def load_session(path: str | os.PathLike, model, overrides: dict | None = None) -> SessionRecord:
    """The session saved at ``path``, for ``model``; ``overrides`` change sampling
    settings; a cache-shape setting (:data:`~mlx_chatcache.config.SHAPE_KEYS`: the
    window, the KV quantization) other than the session's is refused in one line.
    The record comes from the file's header; its cache is read with
    :meth:`~mlx_chatcache.files.prompt_cache.PromptCache.load` (strict: a file of
    another model, or layers the model does not make, are one-line errors)."""
    from ..files.prompt_cache import PromptCache

    if not os.path.isfile(path):
        raise SessionError(f"session file not found: {path}")
    try:
        info = read_cache_info(path)
    except CacheFileError as e:  # the header: the conversation cannot be read either
        raise CacheFileError(f"{path} cannot be read ({damage_detail(str(e), path)}), nor can the conversation it "
                             "held, so it cannot be repaired; start a new session") from None  # fmt: skip
    fingerprint = getattr(model, "fingerprint", None)
    try:
        if fingerprint is not None:
            fingerprint.check(info.model, what="session")
    except ModelMismatchError as e:
        raise ModelMismatchError(f"{path}: {e}") from None
    raw = info.metadata.get(SESSION_KEY)
    if raw is None or info.messages is None or info.tokens is None:
        raise SessionError(
            f"{path} is a cache file but not a chat session (no messages or session settings); "
            f"start a chat from it with 'mlxcc chat --prompt-cache-file {path}' (or use it with "
            f"'mlxcc generate --prompt-cache-file {path}')"
        )
    meta = _parse_session_json(path, raw)
    try:  # the header read above holds the conversation: what fails below can be repaired from it
        notes: list[str] = []
        config = _parse_config(path, meta.get("settings"), notes)
        config = config.windowed(_parse_window(path, meta))
        overrides = overrides or {}
        # the shape flags ask for: loading refuses a cache made otherwise (as for any cache file)
        config = config.updated(**{k: v for k, v in overrides.items() if k in SHAPE_KEYS and k != "keep"})
        try:
            state = PromptCache.load(path, model, config.shape, what="session", header=info)
        except UsageError as e:  # other cache-shape settings than the session's
            raise SessionError(str(e)) from None
        config = config.updated(**{k: v for k, v in overrides.items() if k not in SHAPE_KEYS})
        pending, text = _parse_text(path, meta)
        checkpoints = _parse_checkpoints(path, meta, state)
        attempt = meta.get("attempt", 0)
        state.messages, state.text = info.messages, None
        template_args, stop = _parse_template_and_stop(path, meta)
        reread = _parse_spans(path, meta.get("reread", []))
    except CacheFileError as e:
        raise DamagedSessionError(path, damage_detail(str(e), path), len(info.messages)) from None
    return SessionRecord(state, config, pending, text, checkpoints, attempt if _is_int(attempt) else 0,
                         notes=notes, branch_of=parse_branch_of(meta, path), template_args=template_args,
                         stop=stop, reread=reread)  # fmt: skip


class DamagedSessionError(CacheFileError):
    """A session whose cache cannot be loaded (its bytes changed, or its layers disagree) while
    its header, with the conversation and the settings, reads whole: it can be repaired from
    them (:func:`stored_session`, ``mlxcc sessions repair``). ``detail`` says what is wrong."""

    def __init__(self, path, detail: str, messages: int):
        self.path, self.detail, self.messages = path, detail, messages
        super().__init__(f"{path} is damaged ({detail}); its {messages} messages are intact: repair it with "
                         f"'mlxcc sessions repair {repair_ref(path)}' (the cache is computed again from them)")


def repair_ref(path) -> str:
    """How ``mlxcc sessions repair`` names the session at ``path``: its name, or its path
    (with a ``/``, which no session name has)."""
    name = session_name(Path(path))
    if name != str(path):
        return name
    return name if "/" in name else os.path.join(".", name)


def damage_detail(text: str, path) -> str:
    """What an error about the file at ``path`` says is wrong: its first parenthesised
    detail, else its text without the path and the remedy."""
    body = text.replace(str(path), "").strip(" :;")
    m = re.search(r"\(([^()]*)\)", body)
    return m.group(1) if m else clipped(body.split("; ")[0], 120)


def stored_session(path: str | os.PathLike, model) -> SessionRecord:
    """What the session at ``path`` holds besides its cache, from its header alone (a session
    whose arrays are damaged): the conversation, the settings, the window, the template
    arguments, stop strings and branch. ``state`` is a new empty cache of that window holding
    the messages; a setting that cannot be read is dropped (a line in ``notes``). Raises as
    :func:`load_session` does for a header that cannot be read or is not a session's."""
    from ..files.prompt_cache import PromptCache

    info = read_cache_info(path)
    fingerprint = getattr(model, "fingerprint", None)
    if fingerprint is not None:
        try:
            fingerprint.check(info.model, what="session")
        except ModelMismatchError as e:
            raise ModelMismatchError(f"{path}: {e}") from None
    if info.messages is None or SESSION_KEY not in info.metadata:
        raise SessionError(f"{path} is a cache file, not a chat session: there is no conversation to repair it from")
    notes: list[str] = []
    meta = _readable(path, notes, "the session's settings", lambda: _parse_session_json(path, info.metadata[SESSION_KEY]), {})
    config = _readable(path, notes, "the sampling settings", lambda: _parse_config(path, meta.get("settings"), notes),
                       DEFAULTS)  # fmt: skip
    window = _readable(path, notes, "the window", lambda: _parse_window(path, meta), CacheShape())
    template_args, stop = _readable(path, notes, "the template arguments and stop strings",
                                    lambda: _parse_template_and_stop(path, meta), (None, ()))  # fmt: skip
    config = config.windowed(window)
    state = PromptCache.new(model, config.shape)
    state.messages = [dict(m) for m in info.messages]
    return SessionRecord(state, config, [], "", [], 0, source=meta.get("source") if isinstance(meta.get("source"), dict)
                         else None, notes=notes, branch_of=parse_branch_of(meta, path), template_args=template_args,
                         stop=stop)  # fmt: skip


def _readable(path, notes: list[str], what: str, parse, default):
    """``parse()``, or ``default`` with a line in ``notes`` when the file holds it damaged."""
    try:
        return parse()
    except CacheFileError:
        notes.append(f"warning: {path}: {what} could not be read; the defaults are used")
        return default


def _parse_session_json(path, raw: str) -> dict:
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        meta = None
    if not isinstance(meta, dict):
        raise CacheFileError(f"{path}: session settings are not a JSON object; the file is damaged")
    version = meta.get("format")
    if not _is_int(version) or version > SESSION_FORMAT:
        raise SessionError(
            f"{path} uses session format {version!r}; this mlx_chatcache understands "
            f"{SESSION_FORMAT}: upgrade mlx_chatcache"
        )
    return meta


def _parse_config(path, raw, notes: list[str]) -> GenerationConfig:
    """The saved settings; a value of the wrong type means a damaged file, one of the
    right type but out of its range (:data:`RANGES`) is dropped with a line in ``notes``."""
    if not isinstance(raw, dict):
        raise CacheFileError(f"{path}: session settings are missing; the file is damaged")
    fields = {f.name: f for f in dataclasses.fields(GenerationConfig)}
    values = {}
    for k, v in raw.items():
        if k not in fields:
            continue  # a setting from a newer version: ignore it
        default = getattr(DEFAULTS, k)
        ok = v is None or isinstance(v, (int, float)) and not isinstance(v, bool)
        ok = ok or (k in RANGES and RANGES[k].token_map and isinstance(v, list))  # JSON's (id, number) pairs
        ok = ok or (isinstance(default, str) and isinstance(v, str))  # a name (kv_dtype)
        if not ok or (v is None and default is not None and k not in ("seed",)):
            raise CacheFileError(f"{path}: session setting {k}={v!r} is invalid; the file is damaged")
        if isinstance(default, int) and not isinstance(default, bool) and isinstance(v, float):
            raise CacheFileError(f"{path}: session setting {k}={v!r} is invalid; the file is damaged")
        if k in RANGES and k not in ("max_kv_size", "keep"):  # the window is the file's (_parse_window)
            try:
                v = check_setting(k, v)
            except SettingError as e:
                notes.append(f"warning: {path}: saved setting {e.named}; dropped, the default "
                             f"({'none' if default is None else default}) is used")  # fmt: skip
                continue
        values[k] = v
    return dataclasses.replace(DEFAULTS, **values)


def _parse_window(path, meta: dict) -> CacheShape:
    """The window (``max_kv_size``, ``keep``) the session's cache was made with."""
    max_kv = meta.get("max_kv_size")
    keep = meta.get("keep", DEFAULTS.keep)
    if not (max_kv is None or _is_int(max_kv)) or not _is_int(keep):
        raise CacheFileError(f"{path}: session window settings are malformed; the file is damaged")
    try:
        check_window(max_kv, keep)
    except SettingError as e:
        raise CacheFileError(f"{path}: the session's window is unusable: {e.named.split('; ')[0]}; "
                             "the file is damaged") from None  # fmt: skip
    return CacheShape(max_kv, keep)


def _parse_text(path, meta: dict) -> tuple[list[int], str]:
    pending, text = meta.get("pending", []), meta.get("text", "")
    if not (isinstance(pending, list) and all(_is_int(t) for t in pending) and isinstance(text, str)):
        raise CacheFileError(f"{path}: session token bookkeeping is malformed; the file is damaged")
    return pending, text


def _parse_checkpoints(path, meta: dict, state: PromptCache) -> list[Checkpoint]:
    """The checkpoints, with the cache copies the file keeps (checked against ``state``'s layers)."""
    from ..files.mlxcc_format import load_snapshots
    from .checkpoints import Checkpoint

    checkpoints, index = [], []
    for ck in meta.get("checkpoints", []):
        if not (isinstance(ck, list) and len(ck) in (4, 5, 6) and all(_is_int(v) for v in ck[:4])
                and (len(ck) == 4 or type(ck[4]) is int and ck[4] >= -1)):  # fmt: skip
            raise CacheFileError(f"{path}: session checkpoints are malformed; the file is damaged")
        checkpoints.append(Checkpoint(*ck[:4], reread=_parse_spans(path, ck[5]) if len(ck) == 6 else []))
        index.append(ck[4] if len(ck) >= 5 else -1)
    if any(k >= 0 for k in index):
        snapshots = load_snapshots(path)
        for ck, k in zip(checkpoints, index):
            if k < 0:
                continue
            snap = snapshots[k] if k < len(snapshots) else None
            if snap is None or len(snap) != len(state.cache) or any(
                    x is not None and type(x) is not type(c) for x, c in zip(snap, state.cache)):  # fmt: skip
                raise CacheFileError(f"{path}: a checkpoint's cache copy does not fit the session's cache; "
                                     "the file is damaged")  # fmt: skip
            ck.cache = snap
    return checkpoints


def _parse_template_and_stop(path, meta: dict) -> tuple[dict | None, tuple[str, ...]]:
    args, stop = meta.get("template_args"), meta.get("stop", [])
    if not (args is None or isinstance(args, dict)) or not (
            isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)):  # fmt: skip
        raise CacheFileError(f"{path}: the session's template arguments or stop strings are malformed; "
                             "the file is damaged")  # fmt: skip
    return args or None, tuple(stop)


def parse_branch_of(meta: dict, path=None) -> dict | None:
    """The session a session was branched from, ``{"session": str, "turns": int}``
    (None: none); malformed: CacheFileError when ``path`` names the file, else None."""
    raw = meta.get("branch_of")
    if raw is None:
        return None
    if isinstance(raw, dict) and isinstance(raw.get("session"), str) and _is_int(raw.get("turns")):
        return {"session": raw["session"], "turns": raw["turns"]}
    if path is None:
        return None
    raise CacheFileError(f"{path}: the session's branch_of record is malformed; the file is damaged")


def session_name(path: str | os.PathLike) -> str:
    """The name of the session at ``path`` (its path when it is not in :func:`sessions_dir`)."""
    path = Path(path)
    if Path(os.path.realpath(path.parent)) == Path(os.path.realpath(sessions_dir())) and \
            path.name.endswith(SESSION_SUFFIX):  # fmt: skip
        return path.name[: -len(SESSION_SUFFIX)]
    return str(path)


def _is_int(v) -> bool:
    return type(v) is int and v >= 0


# ------------------------------------------------------------------ names and locks
MAX_NAME = 100
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
SESSION_SUFFIX = ".safetensors"


def sessions_dir() -> Path:
    return mlxcc_home() / "sessions"


def session_path(name: str) -> Path:
    """``mlxcc_home()/sessions/NAME.safetensors``; SessionError for a name that
    could leave that folder or is not a plain file name."""
    shown = repr(clipped(name, 43) if isinstance(name, str) else name)
    ok = (
        isinstance(name, str)
        and 0 < len(name) <= MAX_NAME
        and set(name) <= _NAME_CHARS
        and name[0] not in ".-"
        and ".." not in name
    )
    if not ok:
        raise SessionError(
            f"invalid session name {shown}: use 1-{MAX_NAME} letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (or --session-file PATH for a file elsewhere)"
        )
    return sessions_dir() / f"{name}{SESSION_SUFFIX}"


__all__ = [
    "SessionRecord",
    "session_metadata",
    "kept_copies",
    "save_session",
    "load_session",
    "stored_session",
    "DamagedSessionError",
    "damage_detail",
    "repair_ref",
    "session_name",
    "session_path",
    "sessions_dir",
    "parse_branch_of",
]
