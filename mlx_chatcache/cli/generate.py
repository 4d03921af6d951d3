"""``mlxcc generate``: one completion, optionally from and into a prompt cache file.

stdout carries only the generated text; progress and statistics go to stderr.
With ``--prompt-cache-file F --save-prompt-cache F`` the file is a rolling cache:
each call reuses what F holds, adds its prompt and reply, and saves it back.
A chat cache keeps its messages, so the next call renders the whole
conversation with the chat template and reuses the cached prefix. A cache file
without token ids (mlx-lm's) is used as :mod:`mlx_chatcache.generation.untokenized`
says (its tokens are only assumed, so its cache goes to ``--save-prompt-cache``
only, never into ``--cache-dir``). A store entry (token ids without messages or
text: a ``--cache-dir`` file) is refused, in one line. The files it reads and
writes are locked like a chat session's.

The named files are read and written as
:class:`~mlx_chatcache.files.prompt_cache.PromptCache` values, strictly
(another model's file, other cache settings or a damaged file are one-line
errors: :mod:`mlx_chatcache.files.named_file`), and ``--cache-dir DIR`` adds
the disk tier a server with the same ``--cache-dir`` uses, through the
prompt-cache store (:mod:`mlx_chatcache.store`), the interface ``mlxcc serve``
uses. The longer cached prefix of the prompt, of ``--prompt-cache-file`` and
of DIR, is used (the file on a tie:
:func:`~mlx_chatcache.generation.checkout.checkout_prompt`), and prompt and
reply are written to ``--save-prompt-cache`` and put into DIR
(:func:`~mlx_chatcache.generation.checkout.put_prompt`). A file's window and
KV settings shape the run unless flags give them (other values are refused);
an older file that does not record its KV settings is taken to have those of
its quantized layers.

The save path is claimed before the model is loaded
(:func:`~mlx_chatcache.files.cache_file.claim`: writable, not open in a chat;
an existing file must be a prompt cache and not a chat session unless
``--force``). Ctrl-C is acted upon within
about a second, also while the prompt is processed: the printed line is ended
and nothing is saved (a previous file stays as it was).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING

from ..config import DEFAULTS, INTERRUPTIBLE_CALL_SECONDS, CacheShape, GenerationConfig
from ..errors import UsageError
from ..files.mlxcc_format import read_cache_info
from ..files.registry import CacheFileInfo
from ..files.cache_file import Claim, claim, hold
from ..models.context import check_prompt_fits
from .common import (
    add_cache_args,
    add_cache_dir_arg,
    cache_dir_lines,
    add_force_arg,
    add_model_arg,
    add_json_schema_arg,
    add_sampling_args,
    add_speculative_args,
    add_verbose_arg,
    add_weights_arg,
    check_cache_dir,
    check_window_flags,
    check_store_drafts,
    config_from_args,
    config_overrides,
    load_model,
    read_json_arg,
    read_json_schema,
    read_prompt,
    runtime_lines,
)
from .progress import ProgressBar

if TYPE_CHECKING:
    from ..files.prompt_cache import PromptCache
    from ..store.store import PromptStore
    from ..store.store import Scope

def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion, reusing and saving prompt caches",
        description="Generate text. With --prompt-cache-file the longest common token prefix "
        "with the cached tokens is reused; --save-prompt-cache writes prompt and reply back.",
    )
    add_model_arg(p)
    add_weights_arg(p)
    p.add_argument("--prompt", "-p", help="the prompt text ('-' reads stdin)")
    p.add_argument("--prompt-file", "-f", help="read the prompt from this file")
    p.add_argument("--system-prompt", help="system message (replaces a cached chat's system message)")
    add_sampling_args(p)
    add_json_schema_arg(p)
    add_speculative_args(p)
    add_cache_args(p, f"the first {DEFAULTS.keep} tokens, or as many as a --prompt-cache-file recorded")
    p.add_argument("--ignore-chat-template", action="store_true", help="use the prompt as raw text")
    p.add_argument("--chat-template-config", help="JSON object (or file) of extra chat template arguments")
    p.add_argument("--extra-eos-token", nargs="+", default=[], metavar="TOKEN", help="more tokens that end generation")
    p.add_argument("--prompt-cache-file", help="start from this cache file (made by mlxcc, or by mlx-lm: then it "
                   "is taken to hold the first tokens of this prompt, checked and said on stderr)")  # fmt: skip
    p.add_argument("--save-prompt-cache", metavar="FILE", help="after the completion save the cache (prompt and reply) here; may equal --prompt-cache-file")
    add_cache_dir_arg(p)
    add_force_arg(p)
    add_verbose_arg(p, "report prompt tokens, reused tokens, TTFT, speeds and peak memory on stderr")
    p.set_defaults(run=run)


def file_config(args, info: CacheFileInfo | None) -> GenerationConfig:
    """The flags' config, shaped like the cache file ``info`` describes: its window
    and KV settings are used unless a flag gives them (a different --max-kv-size is refused)."""
    config = config_from_args(args)
    if info is None or info.tokens is None:  # mlx-lm's files: shaped by their layers (untokenized)
        return config
    from ..files.named_file import recorded_shape

    # an older file's KV quantization is read off its layers
    made = CacheShape.recorded(recorded_shape(info), args.prompt_cache_file)
    return config.shaped(adopt(args, made))


def adopt(args, made: CacheShape) -> CacheShape:
    """The shape a file was ``made`` with, with the KV settings flags give; UsageError
    when --max-kv-size asks for another window."""
    shape = made.adopted(config_overrides(args))
    if shape is None:
        raise UsageError(
            f"{args.prompt_cache_file} was made with max_kv_size={made.max_kv_size}; "
            "drop --max-kv-size or use the same value"
        )
    return shape


def layer_shape(stored) -> CacheShape:
    """The shape of an mlx-lm file's cache: its window and the KV quantization of its
    quantized layers (the defaults for a float cache)."""
    from ..cache import QuantizedKVCache, QuantizedRotatingKVCache

    q = next((c for c in stored.cache if isinstance(c, (QuantizedKVCache, QuantizedRotatingKVCache))), None)
    kv = {} if q is None else {"kv_bits": q.bits, "kv_group_size": q.group_size}
    return dataclasses.replace(stored.shape, **kv)


def build_prompt(args, tokenizer, messages: list[dict] | None, text: str | None, prompt: str):
    """``(token ids, messages, text)`` of the full prompt: the cached chat (``messages``)
    or raw ``text`` followed by ``prompt``."""
    from ..generation.templates import render_chat
    from ..generation.text import encode_prompt

    if args.ignore_chat_template:
        if messages:
            raise UsageError(f"{args.prompt_cache_file} holds a chat; drop --ignore-chat-template")
        text = (text or "") + prompt
        return encode_prompt(tokenizer, text), None, text
    if messages is None and text is not None:
        raise UsageError(f"{args.prompt_cache_file} holds raw text (made with --ignore-chat-template); pass --ignore-chat-template")
    messages = list(messages or [])
    if args.system_prompt is not None:
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": args.system_prompt})
    messages.append({"role": "user", "content": prompt})
    template = read_json_arg(args.chat_template_config, "--chat-template-config")
    return render_chat(tokenizer, messages, template_kwargs=template), messages, None


def run(args: argparse.Namespace) -> int:
    """Claims the file it writes (checked and locked, before the model loads) and holds
    the lock of the file it reads (a chat may have one open) until it ends."""
    check_cache_dir(args.cache_dir)  # before the lock files (they would make a new DIR non-empty)
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give --prompt or --prompt-file, not both")
    prompt = read_prompt(args.prompt, args.prompt_file)
    if not prompt:
        raise UsageError("the prompt is empty; pass --prompt TEXT ('-' reads stdin) or --prompt-file FILE")
    with ExitStack() as held:
        save = None
        if args.save_prompt_cache:
            save = held.enter_context(claim(args.save_prompt_cache, force=args.force))
        if args.prompt_cache_file and not (save and save.covers(args.prompt_cache_file)):
            held.enter_context(hold(args.prompt_cache_file))  # one lock per file: flock is per open file
        return _run(args, prompt, save)


def _run(args: argparse.Namespace, prompt: str, save: Claim | None) -> int:
    info = read_cache_info(args.prompt_cache_file) if args.prompt_cache_file else None
    config = check_window_flags(file_config(args, info))  # before the model loads
    check_store_drafts(args)
    args.json_schema = read_json_schema(args.json_schema)
    model, tokenizer = load_model(args)
    if info is not None and info.tokens is None:
        job = _start_untokenized(args, model, tokenizer, config, prompt, save)
    else:
        job = _start(args, model, tokenizer, config, info, prompt, save)
    warning = check_prompt_fits(model, len(job.tokens), job.state.shape.max_kv_size, "the prompt",
                                "shorten the prompt, or pass --max-kv-size N to keep only the latest N tokens")  # fmt: skip
    if warning:
        sys.stderr.write(f"mlxcc: warning: {warning}\n")
    return _generate(args, model, tokenizer, job)


@dataclasses.dataclass
class _Job:
    """What a run generates from and where its result goes."""

    tokens: list[int]  # the full prompt
    state: PromptCache  # what it starts from (a stored prefix, or empty), with the prompt's messages or text
    config: GenerationConfig
    store: PromptStore  # --cache-dir's tier (none without it)
    scope: Scope  # the store scope of this model and cache shape
    tier: str | None  # where the prefix came from ("file": --prompt-cache-file; None: nowhere)
    save: Claim | None  # --save-prompt-cache
    shared: bool = True  # put the result into --cache-dir too (False: its tokens were only assumed)


def _start(args, model, tokenizer, config, info, prompt, save: Claim | None) -> _Job:
    """The longer cached prefix of the named file (strict) and --cache-dir."""
    from ..generation.checkout import checkout_prompt, prompt_scope, shared_tiers, store_draft_tokens
    from ..store.store import PromptStore

    if info is None:
        messages, text = (None, "") if args.ignore_chat_template else ([], None)
    elif info.messages is None and info.text is None:  # a store entry (mlxcc serve / --cache-dir)
        raise UsageError(
            f"{args.prompt_cache_file} is a prompt-cache store entry (token ids only, no messages or text "
            "to continue); pass its folder as --cache-dir instead, or a file made by --save-prompt-cache"
        )
    else:
        messages, text = info.messages, info.text
    tokens, messages, text = build_prompt(args, tokenizer, messages, text, prompt)
    store = PromptStore(shared_tiers(args.cache_dir), draft_tokens=store_draft_tokens(config))
    scope = prompt_scope(model, config)
    state, tier = checkout_prompt(store, scope, model, tokens, config.shape, args.prompt_cache_file, info)
    state.messages, state.text = messages, text
    state.settings = {**(info.settings if info else {}), **state.settings}  # what the file recorded, written back
    return _Job(tokens, state, config, store, scope, tier, save)


def _start_untokenized(args, model, tokenizer, config, prompt, save: Claim | None) -> _Job:
    """An mlx-lm file (no token ids): taken to hold the prompt's first tokens (untokenized)."""
    from ..generation.untokenized import adopt_prompt_prefix, load_untokenized
    from ..generation.checkout import prompt_scope, shared_tiers
    from ..store.store import PromptStore

    stored = load_untokenized(args.prompt_cache_file, model, args.ignore_chat_template)
    config = config.shaped(adopt(args, layer_shape(stored)))
    tokens, stored.messages, stored.text = build_prompt(args, tokenizer, stored.messages, stored.text, prompt)
    sys.stderr.write(adopt_prompt_prefix(stored, tokens, model, args.prompt_cache_file) + "\n")
    store = PromptStore(shared_tiers(args.cache_dir))
    scope = prompt_scope(model, config)
    return _Job(tokens, stored, config, store, scope, "file", save, shared=False)


def _generate(args, model, tokenizer, job: _Job) -> int:
    from ..generation.checkout import put_prompt
    from ..generation.text import stream_generate

    bar = ProgressBar("prompt")
    reply, last, drafts = [], None, {}
    try:
        for last in stream_generate(
            model, tokenizer, job.tokens, state=job.state, config=job.config,
            extra_eos_tokens=args.extra_eos_token, progress=bar.update,
            max_call_seconds=INTERRUPTIBLE_CALL_SECONDS, json_schema=args.json_schema,
            draft_index=job.store.draft_index(job.scope), draft_stats=drafts,
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
    state = job.state
    if state.messages is not None:
        state.messages.append({"role": "assistant", "content": text})
    else:
        state.text += text
    state.settings = state.shape.recording(state.settings, job.config)
    put_prompt(job.store, job.scope, state, named=job.save, shared=job.shared, ends=_ends(args, tokenizer, job),
               warn=lambda line: sys.stderr.write(f"mlxcc: warning: {line}\n"))  # fmt: skip
    if args.verbose and last is not None:
        report(last, job.state, job.tier, [*runtime_lines(model), *cache_dir_lines(job.store.tiers)], drafts)
    return 0


def _ends(args, tokenizer, job: _Job) -> tuple[int, ...]:
    """What else of the run's cache ``--cache-dir`` serves exactly: the prompt (the next turn
    starts with it), the prompt but its last token (the same prompt asked again) and its
    system prompt (what other conversations share)."""
    from ..generation.templates import system_end

    n, messages = len(job.tokens), job.state.messages
    template = None if messages is None else read_json_arg(args.chat_template_config, "--chat-template-config")
    start = None if messages is None else system_end(tokenizer, messages[:-1], job.tokens, template)
    return tuple(e for e in (start, n - 1, n) if e)


def draft_line(drafts: dict, tokens: int) -> str:
    """What --verbose says of speculative decoding: drafts accepted and tokens per model call."""
    rate = drafts["accepted"] / drafts["drafted"] if drafts["drafted"] else 0.0
    per_call = tokens / drafts["rounds"] if drafts["rounds"] else 0.0
    return (f"Drafts: {drafts['accepted']} of {drafts['drafted']} accepted ({rate:.0%}), "
            f"{per_call:.2f} tokens per model call")  # fmt: skip


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
    sys.stderr.write(f"mlxcc: interrupted: {what}{saved}\n")
    sys.stderr.flush()
    return 130


def report(r, state, tier: str | None = None, runtime: list[str] = (), drafts: dict | None = None) -> None:
    new = r.prompt_tokens - r.reused_tokens
    lines = [
        f"Prompt: {r.prompt_tokens} tokens ({r.reused_tokens} reused, {new} new), "
        f"{r.prompt_tps:.1f} tokens-per-sec",
        f"Time to first token: {r.ttft:.3f} s",
        f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.1f} tokens-per-sec "
        f"(finish: {r.finish_reason})",
        f"Cache: {len(state.tokens)} tokens held" + (f" (prefix from the {tier} tier)" if tier and r.reused_tokens else ""),
        *([draft_line(drafts, r.generation_tokens)] if drafts else []),
        f"Peak memory: {r.peak_memory:.3f} GB",
        *runtime,
    ]
    sys.stderr.write("\n".join(lines) + "\n")
