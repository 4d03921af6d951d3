"""``mlxcc generate``: one completion, optionally from and into a prompt cache file.

stdout carries only the generated text; progress and statistics go to stderr.
With ``--prompt-cache-file F --save-prompt-cache F`` the file is a rolling cache:
each call reuses what F holds, adds its prompt and reply, and saves it back.
A chat cache keeps its messages, so the next call renders the whole
conversation with the chat template and reuses the cached prefix. A cache file
without token ids (mlx-lm's) is used as :mod:`mlx_chatcache.generation.prompt_recovery`
says. The files it reads and writes are locked like a chat session's.

The save path is checked before the model is loaded (writable; an existing
file must be a prompt cache unless ``--force``). Ctrl-C is acted upon within
about a second, also while the prompt is processed: the printed line is ended
and nothing is saved (a previous file stays as it was).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack
from pathlib import Path

from ..chat.session_store import SessionLock
from ..config import INTERRUPTIBLE_CALL_SECONDS
from ..errors import UsageError
from ..files.cache_io import read_cache_info
from ..files.save_target import check_save_target
from ..generation.generate import PromptCache
from ..generation.prompt_recovery import adopt_prompt_prefix, load_untokenized, needs_tokens
from ..generation.prompt_store import render_chat
from ..generation.text import encode_prompt, stream_generate
from .common import (
    add_cache_args,
    add_force_arg,
    add_model_arg,
    add_sampling_args,
    add_verbose_arg,
    config_from_args,
    load_model,
    read_json_arg,
    read_prompt,
)
from .progress import ProgressBar


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion, reusing and saving prompt caches",
        description="Generate text. With --prompt-cache-file the longest common token prefix "
        "with the cached tokens is reused; --save-prompt-cache writes prompt and reply back.",
    )
    add_model_arg(p)
    p.add_argument("--prompt", "-p", help="the prompt text ('-' reads stdin)")
    p.add_argument("--prompt-file", "-f", help="read the prompt from this file")
    p.add_argument("--system-prompt", help="system message (replaces a cached chat's system message)")
    add_sampling_args(p)
    add_cache_args(p)
    p.add_argument("--ignore-chat-template", action="store_true", help="use the prompt as raw text")
    p.add_argument("--chat-template-config", help="JSON object (or file) of extra chat template arguments")
    p.add_argument("--extra-eos-token", nargs="+", default=[], metavar="TOKEN", help="more tokens that end generation")
    p.add_argument("--prompt-cache-file", help="start from this cache file (made by mlxcc, or by mlx-lm: then it "
                   "is taken to hold the first tokens of this prompt, checked and said on stderr)")  # fmt: skip
    p.add_argument("--save-prompt-cache", metavar="FILE", help="after the completion save the cache (prompt and reply) here; may equal --prompt-cache-file")
    add_force_arg(p)
    add_verbose_arg(p, "report prompt tokens, reused tokens, TTFT, speeds and peak memory on stderr")
    p.set_defaults(run=run)


def load_or_new(args, model, config) -> PromptCache:
    if args.prompt_cache_file:
        if read_cache_info(args.prompt_cache_file).tokens is None:  # mlx-lm's files: see prompt_recovery
            stored = load_untokenized(args.prompt_cache_file, model, args.ignore_chat_template)
        else:
            stored = PromptCache.load(args.prompt_cache_file, model)
        if args.max_kv_size is not None and args.max_kv_size != stored.max_kv_size:
            raise UsageError(
                f"{args.prompt_cache_file} was made with max_kv_size={stored.max_kv_size}; "
                "drop --max-kv-size or use the same value"
            )
        return stored
    stored = PromptCache.new(model, config.max_kv_size, config.keep)
    stored.messages, stored.text = (None, "") if args.ignore_chat_template else ([], None)
    return stored


def build_prompt(args, tokenizer, stored: PromptCache, prompt: str) -> list[int]:
    """The full prompt's token ids; updates ``stored.messages``/``stored.text`` to include it."""
    if args.ignore_chat_template:
        if stored.mode == "chat" and stored.messages:
            raise UsageError(f"{args.prompt_cache_file} holds a chat; drop --ignore-chat-template")
        stored.messages, stored.text = None, (stored.text or "") + prompt
        return encode_prompt(tokenizer, stored.text)
    if stored.mode == "raw":
        raise UsageError(f"{args.prompt_cache_file} holds raw text (made with --ignore-chat-template); pass --ignore-chat-template")
    messages = list(stored.messages)
    if args.system_prompt is not None:
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": args.system_prompt})
    messages.append({"role": "user", "content": prompt})
    stored.messages = messages
    template = read_json_arg(args.chat_template_config, "--chat-template-config")
    return render_chat(tokenizer, messages, template_kwargs=template)


def run(args: argparse.Namespace) -> int:
    """Holds the session lock of the files it reads and writes (a chat may have one open)."""
    with ExitStack() as held:
        for f in dict.fromkeys(f for f in (args.prompt_cache_file, args.save_prompt_cache) if f):
            lock = SessionLock(Path(f).expanduser(), f)
            held.callback(lock.acquire(required=False).release)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give --prompt or --prompt-file, not both")
    prompt = read_prompt(args.prompt, args.prompt_file)
    if not prompt:
        raise UsageError("the prompt is empty; pass --prompt TEXT ('-' reads stdin) or --prompt-file FILE")
    if args.save_prompt_cache:
        check_save_target(args.save_prompt_cache, args.force)  # before any work: see save_target
    model, tokenizer = load_model(args)
    config = config_from_args(args)
    stored = load_or_new(args, model, config)
    tokens = build_prompt(args, tokenizer, stored, prompt)
    if needs_tokens(stored):
        sys.stderr.write(adopt_prompt_prefix(stored, tokens, model, args.prompt_cache_file) + "\n")
    bar = ProgressBar("prompt")
    reply, last = [], None
    try:
        for last in stream_generate(
            model, tokenizer, tokens, state=stored, config=config,
            extra_eos_tokens=args.extra_eos_token, progress=bar.update,
            max_call_seconds=INTERRUPTIBLE_CALL_SECONDS,
        ):  # fmt: skip
            bar.close()  # before the reply is printed
            reply.append(last.text)
            sys.stdout.write(last.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        bar.close()
        return interrupted(bool("".join(reply)), args.save_prompt_cache)
    sys.stdout.write("\n")
    bar.close()
    text = "".join(reply)
    if stored.mode == "chat":
        stored.messages.append({"role": "assistant", "content": text})
    else:
        stored.text += text
    if args.save_prompt_cache:
        stored.save(args.save_prompt_cache)
    if args.verbose and last is not None:
        report(last, stored)
    return 0


def interrupted(printed: bool, save_path: str | None) -> int:
    """Ctrl-C during generation: end the printed line, say what was (not) saved; exit code 130."""
    if printed:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if save_path:
        unchanged = "it is unchanged" if os.path.exists(save_path) else "no file was written"
        saved = f"; nothing saved to {save_path} ({unchanged}): run the command again to save a complete reply"
    else:
        saved = ""
    what = "the reply was cut short" if printed else "before the reply started"
    sys.stderr.write(f"mlxcc: interrupted {what}{saved}\n")
    sys.stderr.flush()
    return 130


def report(r, state) -> None:
    new = r.prompt_tokens - r.reused_tokens
    lines = [
        f"Prompt: {r.prompt_tokens} tokens ({r.reused_tokens} reused, {new} new), "
        f"{r.prompt_tps:.1f} tokens-per-sec",
        f"Time to first token: {r.ttft:.3f} s",
        f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.1f} tokens-per-sec "
        f"(finish: {r.finish_reason})",
        f"Cache: {len(state.tokens)} tokens held",
        f"Peak memory: {r.peak_memory:.3f} GB",
    ]
    sys.stderr.write("\n".join(lines) + "\n")
