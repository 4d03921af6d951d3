"""``mlxcc generate``: one completion, optionally from and into a prompt cache file.

stdout carries only the generated text; progress and statistics go to stderr.
With ``--prompt-cache-file F --save-prompt-cache F`` the file is a rolling cache:
each call reuses what F holds, adds its prompt and reply, and saves it back.
A chat cache keeps its messages, so the next call renders the whole
conversation with the chat template and reuses the cached prefix.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import UsageError
from ..generation.generate import PromptCache
from ..generation.prompt_store import render_chat
from ..generation.text import encode_prompt, stream_generate
from .common import (
    add_cache_args,
    add_model_arg,
    add_sampling_args,
    config_from_args,
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
    p.add_argument("--prompt", "-p", required=True, help="the prompt text ('-' reads stdin)")
    p.add_argument("--system-prompt", help="system message (replaces a cached chat's system message)")
    add_sampling_args(p)
    add_cache_args(p)
    p.add_argument("--ignore-chat-template", action="store_true", help="use the prompt as raw text")
    p.add_argument("--chat-template-config", help="JSON object (or file) of extra chat template arguments")
    p.add_argument("--extra-eos-token", nargs="+", default=[], metavar="TOKEN", help="more tokens that end generation")
    p.add_argument("--prompt-cache-file", help="start from this cache file (made by mlxcc)")
    p.add_argument("--save-prompt-cache", metavar="FILE", help="after the completion save the cache (prompt and reply) here; may equal --prompt-cache-file")
    p.add_argument("--verbose", action="store_true", help="report prompt tokens, reused tokens, TTFT, speeds and peak memory on stderr")
    p.set_defaults(run=run)


def load_or_new(args, model, config) -> PromptCache:
    if args.prompt_cache_file:
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
    from ..models.loading import load

    prompt = read_prompt(args.prompt)
    if not prompt:
        raise UsageError("the prompt is empty; pass --prompt TEXT (or '-' to read stdin)")
    model, tokenizer = load(args.model)
    config = config_from_args(args)
    stored = load_or_new(args, model, config)
    tokens = build_prompt(args, tokenizer, stored, prompt)
    bar = ProgressBar("prompt", enabled=args.verbose)
    reply, last = [], None
    for last in stream_generate(
        model, tokenizer, tokens, state=stored, config=config,
        extra_eos_tokens=args.extra_eos_token, progress=bar.update,
    ):  # fmt: skip
        reply.append(last.text)
        sys.stdout.write(last.text)
        sys.stdout.flush()
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
