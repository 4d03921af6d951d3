"""``mlxcc chat``: a multi-turn chat whose history is computed once, saved after
every turn and resumed later with nothing recomputed.

With ``--session NAME`` the chat lives in ``mlxcc_home()/sessions/NAME.safetensors``
(``--session-file PATH`` for any other file): it is saved atomically after every
turn, and starting the same command again continues it. One process at a time
may hold a session (an exclusive lock on ``NAME.lock``).

With ``--cache-dir DIR`` (the folder of ``mlxcc serve --cache-dir``) every save
also stores the cache there, and a turn that starts from an empty cache (a
new chat) starts from the longest prefix of its prompt found there.

With ``--prompt-cache-file F`` a new chat starts from a cache ``mlxcc
cache-prompt`` made (its system prompt and messages), so its first turn feeds
only the new tokens. F is only read: the chat is saved to its own session
(``--session``/``--session-file``, which must not exist yet) or not at all.
F is checked before the model loads (a chat cache with token ids, with the
window and KV settings the flags ask for; unset flags take F's). When F ends
with a user message (``cache-prompt -p``), the first turn adds a second one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..chat.session_file import DamagedSessionError, session_path
from ..config import SHAPE_KEYS
from ..files.cache_file import claim
from ..errors import SessionError, UsageError
from ..files.atomic import remove_stale_temp_files
from .common import (
    add_cache_args,
    add_cache_dir_arg,
    add_model_arg,
    add_sampling_args,
    add_speculative_args,
    add_verbose_arg,
    add_weights_arg,
    cache_dir_lines,
    check_cache_dir,
    check_store_drafts,
    config_from_args,
    config_overrides,
    lenient_stdin,
    load_model,
    plural,
    read_json_arg,
    runtime_lines,
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a model; the conversation's cache is kept, saved and resumed",
        description="Chat with a model. Each turn feeds only its new tokens; /undo and "
        "/retry roll the cache back instead of recomputing it. With --session the chat "
        "is saved after every turn and resumed by running the same command again. "
        "Type /help in the chat for its commands.",
    )
    add_model_arg(p)
    add_weights_arg(p)
    p.add_argument("--system-prompt", help="the system prompt (pinned in the cache window with --max-kv-size)")
    add_sampling_args(p)
    add_speculative_args(p)
    add_cache_args(p, "the rendered system prompt (or the chat template's default one), or what a "
                      "--prompt-cache-file recorded")
    p.add_argument("--chat-template-config", "--chat-template-args", metavar="JSON",
                   help="JSON object (or file) of extra chat template arguments; saved with the session")
    p.add_argument("--stop", metavar="TEXT", action="append",
                   help="end a reply before this text (repeatable); saved with the session")  # fmt: skip
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--session", metavar="NAME",
        help="keep the chat in MLXCC_HOME/sessions/NAME.safetensors (default MLXCC_HOME: "
        "~/.mlxcc) and resume it when it exists (with the model it was made with unless --model is given)",
    )  # fmt: skip
    where.add_argument("--session-file", metavar="PATH", help="keep the chat in this file (resumed when it exists)")
    p.add_argument(
        "--prompt-cache-file", metavar="FILE",
        help="start a new chat from this prebuilt cache ('mlxcc cache-prompt': its system prompt and "
        "messages are not computed again); FILE is only read, the chat is saved to --session/--session-file",
    )  # fmt: skip
    add_cache_dir_arg(p)
    add_verbose_arg(p, "print each turn's statistics on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_cache_dir(args.cache_dir)  # before the session's lock file (it would make a new DIR non-empty)
    check_store_drafts(args)
    path, label = None, None
    if args.session is not None:
        path, label = session_path(args.session), f"'{args.session}'"
    elif args.session_file is not None:
        path = Path(args.session_file).expanduser()
        label = str(path)
        if not path.parent.is_dir():
            raise SessionError(f"cannot keep a session in {path}: folder {path.parent} does not exist")
    if path is None:
        return _chat(args, None, None)
    with claim(path, mine=True, label=label, required=True) as held:  # the REPL saves through it
        remove_stale_temp_files(path)  # left by a killed save of this session
        return _chat(args, path, label, held)


def _chat(args: argparse.Namespace, path: Path | None, label: str | None, held=None) -> int:
    from ..chat.session import ChatSession  # imports mlx-lm: only when the chat starts, not for --help
    from .chat_report import cost_text
    from .chat_input import StreamReader, TerminalReader
    from .repl import ChatREPL, history_file

    template = read_json_arg(args.chat_template_config, "--chat-template-config")
    if args.stop is not None and not all(args.stop):
        raise UsageError("--stop needs a non-empty text")
    prebuilt = _prebuilt_header(args, path, label) if args.prompt_cache_file is not None else None
    source = None
    if path is not None and path.exists() and args.model is None:
        from ..chat.session_catalog import resume_source

        source = resume_source(path, label)
        if args.adapter_path is not None:
            source["adapter_path"] = args.adapter_path
        _note(f"[model: {source['model']} (recorded in the session)]")
    from ..generation.checkout import shared_tiers

    model, tokenizer = load_model(args, source)
    shared = shared_tiers(args.cache_dir)
    if prebuilt is not None:
        session = _from_prebuilt(args, model, tokenizer, shared, *prebuilt)
        if path is not None:
            _note(f"new session {label} (saved after every turn to {path})")
    elif path is not None and path.exists():
        overrides = config_overrides(args)
        try:
            session = ChatSession.load(path, model, tokenizer, overrides=overrides, shared=shared)
        except DamagedSessionError as e:
            session = _offer_repair(e, label, model, tokenizer, shared, held)
            session.update_settings({k: v for k, v in overrides.items() if k not in SHAPE_KEYS})
        for line in session.load_notes:
            _note(line)
        _note(f"resumed session {label}: {plural(session.num_turns, 'turn')}, {cost_text(session)}")
        for line in recap(session.messages):
            _note(line)
        if args.system_prompt is not None and args.system_prompt != (session.system_prompt or ""):
            session.set_system_prompt(args.system_prompt)
            _note(f"[new system prompt: {cost_text(session)}]")
    else:
        session = ChatSession(model, tokenizer, system_prompt=args.system_prompt, config=config_from_args(args),
                              shared=shared, template_args=template, stop=args.stop or ())  # fmt: skip
        if path is not None:
            _note(f"new session {label} (saved after every turn to {path})")
    if template is not None and template != session.template_args:  # a resumed or prebuilt chat
        session.set_template_args(template)
        _note("[new chat template arguments: the conversation will be re-read on the next turn]")
    if args.stop is not None:
        session.stop = tuple(args.stop)
    if args.verbose:  # once the session is known to be usable (errors stay one line)
        for line in runtime_lines(model):
            _note(line)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    reader = TerminalReader(history_file()) if interactive else StreamReader(lenient_stdin())
    repl = ChatREPL(
        session,
        reader,
        out=sys.stdout,
        err=sys.stderr,
        held=held,
        verbose=args.verbose,
        interactive=interactive,
        model_ref=source["model"] if source else args.model,
        session_label=label,
    )
    try:
        return repl.run()
    finally:
        for line in cache_dir_lines(shared) if args.verbose else []:
            _note(line)


def _offer_repair(damaged, label: str, model, tokenizer, shared, held):
    """On a terminal, ask to repair the damaged session (its cache computed again from its
    messages, with progress, and saved); else, or when declined, the one-line error says how."""
    from ..chat.repair import repair_session
    from .progress import ProgressBar

    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise damaged
    sys.stderr.write(f"session {label} is damaged ({damaged.detail}); its {plural(damaged.messages, 'message')} "
                     "are intact. Compute its cache again from them now? [Y/n] ")  # fmt: skip
    sys.stderr.flush()
    if sys.stdin.readline().strip().lower() not in ("", "y", "yes"):
        raise damaged
    bar = ProgressBar("repair", stream=sys.stderr)
    try:
        session = repair_session(held.path, model, tokenizer, progress=bar.update, shared=shared)
    finally:
        bar.close()
    session.save(held)
    _note(f"[repaired: {plural(session.cached_tokens, 'token')} computed again and saved]")
    return session


def _prebuilt_header(args, path: Path | None, label: str | None):
    """``(header, config)`` of ``--prompt-cache-file``, checked before the model loads:
    the chat's session must be new, the file a chat cache with token ids, and the
    window and KV flags those of the file (the generate command's rules: unset flags
    take the file's). Raises one line for anything else."""
    from ..errors import CacheFormatError
    from ..files.mlxcc_format import read_cache_info
    from ..files.named_file import check_named_file
    from .generate import file_config

    f = args.prompt_cache_file
    if path is not None and path.exists():
        raise UsageError(f"session {label} exists: resume it without --prompt-cache-file, or pick a new name")
    info = read_cache_info(f)
    if info.tokens is None:
        raise CacheFormatError(
            f"{f} does not say which tokens it holds (written by {info.layout}); chat needs a file "
            "made by 'mlxcc cache-prompt'"
        )
    if info.messages is None:
        if info.text is not None:
            raise UsageError(
                f"{f} holds raw text (made with --ignore-chat-template); chat needs a chat cache: "
                "rebuild it without --ignore-chat-template"
            )
        raise UsageError(
            f"{f} is a prompt-cache store entry (token ids only, no messages); chat needs a file made by "
            "'mlxcc cache-prompt', or pass the store's folder as --cache-dir"
        )
    config = file_config(args, info)  # F's window and KV settings; a different --max-kv-size is refused
    check_named_file(info, f, shape=config.shape)  # other KV settings are refused; the model is checked on load
    return info, config


def _from_prebuilt(args, model, tokenizer, shared, info, config):
    """A new chat session holding the cache of ``--prompt-cache-file`` (read, never written)."""
    from ..chat.session import ChatSession
    from ..errors import ModelMismatchError
    from ..files.prompt_cache import PromptCache

    f = args.prompt_cache_file
    try:  # fingerprint, settings, layers and token ids (those of the header read before) checked
        prompt = PromptCache.load(f, model, config.shape, header=info)
    except ModelMismatchError as e:
        raise ModelMismatchError(f"{f}: {e}") from None
    session = ChatSession.from_prompt_cache(model, tokenizer, prompt, config=config, shared=shared)
    if args.system_prompt is not None and args.system_prompt != (session.system_prompt or ""):
        session.set_system_prompt(args.system_prompt)
        from .chat_report import cost_text

        _note(f"[new system prompt: the cache of {f} keeps its common start; {cost_text(session)}]")
        return session
    _note(f"[started from {f}: {plural(len(prompt.tokens), 'token')} in the cache, 0 tokens recomputed]")
    window = prompt.shape
    if window.max_kv_size is not None and window.keep < session.pinned_tokens():
        _note(f"[the window of {f} pins its first {window.keep} tokens, not the whole system prompt: it leaves "
              f"the window once the chat outgrows max_kv_size={window.max_kv_size}]")  # fmt: skip
    return session


RECAP_CHARS = {"user": 200, "assistant": 300}  # what a resume shows of the last exchange, per message


def recap(messages: list[dict]) -> list[str]:
    """The last exchange of ``messages`` (the last user message and the reply after
    it), one line each, cut to :data:`RECAP_CHARS`; [] when there is none."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last is None:
        return []
    lines = []
    for m in messages[last : last + 2]:
        if m["role"] not in RECAP_CHARS:
            continue
        text = " \u23ce ".join(m["content"].strip().splitlines())  # one line: line breaks shown as ⏎
        limit = RECAP_CHARS[m["role"]]
        text = text[:limit] + "\u2026" if len(text) > limit else text
        lines.append(f"  {'you:  ' if m['role'] == 'user' else 'model:'} {text}")
    return lines


def _note(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
