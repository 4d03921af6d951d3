"""``mlxcc cache-prompt``: prebuild a prompt cache file from a system prompt and/or a prompt.

With the chat template (default) the file holds the rendered messages
(system, then the prompt as a user message) and a later ``mlxcc generate
--prompt-cache-file`` continues the chat. With ``--ignore-chat-template`` it
holds raw text: a later ``generate --ignore-chat-template`` appends its prompt
to that text.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..config import INTERRUPTIBLE_CALL_SECONDS
from ..errors import UsageError
from ..files.cache_file import claim
from ..models.context import check_prompt_fits
from .common import (
    add_cache_args,
    add_force_arg,
    add_model_arg,
    add_verbose_arg,
    add_weights_arg,
    check_window_flags,
    config_from_args,
    human_bytes,
    load_model,
    read_json_arg,
    read_prompt,
)
from .progress import ProgressBar


def add_parser(sub) -> None:
    p = sub.add_parser(
        "cache-prompt",
        help="prebuild a prompt cache file",
        description="Encode a system prompt and/or a prompt once and save the cache, so later "
        "generate/chat calls start from it.",
    )
    add_model_arg(p)
    add_weights_arg(p)
    p.add_argument("--prompt", "-p", help="prompt text ('-' reads stdin)")
    p.add_argument("--prompt-file", "-f", help="read the prompt from this file")
    p.add_argument("--system-prompt", help="system message to cache")
    p.add_argument("--prompt-cache-file", required=True, help="the cache file to write")
    add_force_arg(p)
    add_cache_args(p)
    p.add_argument("--ignore-chat-template", action="store_true", help="cache the text as is (raw prefix)")
    p.add_argument("--chat-template-config", help="JSON object (or file) of extra chat template arguments")
    add_verbose_arg(p, "also report the peak memory on stderr")
    p.set_defaults(run=run)


def build(args, tokenizer, prompt: str | None) -> tuple[list[dict] | None, str | None, list[int]]:
    """``(messages, text, tokens)``: what the file will hold (chat messages or raw text) and its ids."""
    from ..generation.templates import render_chat  # generation/ (hence mlx-lm): only when a model runs
    from ..generation.text import encode_prompt

    if args.ignore_chat_template:
        text = (args.system_prompt or "") + (prompt or "")
        return None, text, encode_prompt(tokenizer, text)
    messages = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    if prompt:
        messages.append({"role": "user", "content": prompt})
    template = read_json_arg(args.chat_template_config, "--chat-template-config")
    tokens = render_chat(tokenizer, messages, add_generation_prompt=False, template_kwargs=template)
    return messages, None, tokens


def run(args: argparse.Namespace) -> int:
    """Claims the file to write (checked and locked) before the model loads, until it is written."""
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give --prompt or --prompt-file, not both")
    prompt = read_prompt(args.prompt, args.prompt_file)
    if not prompt and not args.system_prompt:
        given = [name for name, v in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file),
                                      ("--system-prompt", args.system_prompt)) if v is not None]  # fmt: skip
        if given:
            raise UsageError(f"nothing to cache: {' and '.join(given)} {'is' if len(given) == 1 else 'are'} empty; "
                             "give the text to cache (a non-empty --prompt, --prompt-file or --system-prompt)")
        raise UsageError("nothing to cache: pass --prompt, --prompt-file or --system-prompt")
    config = check_window_flags(config_from_args(args))  # before the model loads
    with claim(args.prompt_cache_file, force=args.force) as target:
        return _run(args, prompt, config, target)


def _run(args: argparse.Namespace, prompt: str | None, config, target) -> int:
    from ..files.prompt_cache import PromptCache
    from ..generation.templates import feed_all

    model, tokenizer = load_model(args)
    messages, text, tokens = build(args, tokenizer, prompt)
    warning = check_prompt_fits(model, len(tokens), config.max_kv_size, "the text to cache",
                                "shorten it, or pass --max-kv-size N to keep only the latest N tokens")  # fmt: skip
    if warning:
        sys.stderr.write(f"mlxcc: warning: {warning}\n")
    stored = PromptCache.new(model, config.shape)
    stored.messages, stored.text = messages, text
    start = time.perf_counter()
    bar = ProgressBar("caching")
    try:
        feed_all(model, stored, tokens, config.prefill_step_size, bar.update,
                 max_call_seconds=INTERRUPTIBLE_CALL_SECONDS)  # fmt: skip
    except KeyboardInterrupt:
        bar.close()
        sys.stderr.write(f"mlxcc: interrupted; nothing saved to {args.prompt_cache_file}\n")
        return 130
    bar.close()
    if config.kv_bits is not None:
        from ..cache import quantize_prompt_cache

        quantize_prompt_cache(stored.cache, config.kv_group_size, config.kv_bits, config.quantized_kv_start)
    elapsed = time.perf_counter() - start
    stored.settings = stored.shape.recording(stored.settings, config)  # generate adopts them, refuses others
    stored.save(target)
    size = os.path.getsize(args.prompt_cache_file)
    sys.stdout.write(
        f"Cached {len(tokens)} tokens in {elapsed:.2f} s ({len(tokens) / max(elapsed, 1e-9):.1f} tokens-per-sec) "
        f"to {args.prompt_cache_file} ({human_bytes(size)})\n"
    )
    if args.verbose:
        import mlx.core as mx

        sys.stderr.write(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB\n")
    return 0
