"""``mlxcc cache info FILE [--json]``: what a cache file holds, without a model.

It reads every array to check the file's checksums: a damaged file is one error line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import textwrap
from collections import Counter

from ..files.mlxcc_format import CacheFileInfo, read_cache_info, verify_cache_file
from .common import human_bytes

PREVIEW_CHARS = 240
LABEL_WIDTH = 13  # "cache types: " and the text after it
LONG_VALUE = 600  # characters of a metadata value shown as text


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="inspect, convert, trim and compare cache files",
                       description="Inspect, convert, trim and compare prompt cache files.")
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION", parser_class=type(p))
    info = csub.add_parser(
        "info",
        help="show a cache file's format, model, cache types, tokens, size and a preview",
        description="Show what a cache file holds: format, model, cache types, token "
        "count, bytes, chat messages and a decoded preview of the cached text; "
        "checks the file's checksums (a damaged file is an error).",
    )
    info.add_argument("file", help="the .safetensors cache file")
    info.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    info.add_argument("--model", help="tokenizer to decode the preview with (default: the model named in the file, if present)")
    info.set_defaults(run=run)
    from .cache_tools import add_actions

    add_actions(csub)
    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])


def summary(info: CacheFileInfo) -> dict:
    counts = Counter(info.classes)
    return {
        "file": info.path,
        "format_version": info.format_version,
        "layout": info.layout,
        "model": info.model.model_id if info.model else _recorded_model(info),
        "weights_hash": info.model.weights_hash if info.model else None,
        "tokenizer_hash": info.model.tokenizer_hash if info.model else None,
        "cache_types": dict(counts),
        "num_layers": len(info.classes),
        "num_tokens": info.num_tokens,
        "nbytes": info.nbytes,
        "stored_slots": info.slots,
        "weights": info.settings.get("weights"),
        "file_size": os.path.getsize(info.path),
        "messages": info.messages,
        "metadata": info.metadata,
    }


def _recorded_model(info: CacheFileInfo) -> str | None:
    """The model an mlx-lm file names in its metadata (mlx-lm's cache_prompt writes ``model``)."""
    model = info.metadata.get("model") if info.layout != "mlxcc" else None
    return model if isinstance(model, str) and model.strip() else None


def field(label: str, text: str, width: int | None = None) -> list[str]:
    """``label: text`` wrapped to the terminal width at spaces (a path or a word is never split,
    a line never ends in a space), continuation lines indented under the text (a label too long
    for the column gets a line of its own); a value longer than LONG_VALUE characters is cut
    (--json has it all)."""
    width = width or shutil.get_terminal_size((100, 24)).columns
    indent = " " * LABEL_WIDTH
    if len(text) > LONG_VALUE:
        text = text[:LONG_VALUE] + f"… ({len(text)} characters; --json shows all)"
    lines = [] if len(label) < LABEL_WIDTH - 1 else [f"{label}:"]
    for i, part in enumerate(text.split("\n")):
        lead = f"{label + ':':<{LABEL_WIDTH}}" if i == 0 and not lines else indent
        lines += textwrap.wrap(part, max(width - 1, LABEL_WIDTH + 20), initial_indent=lead, subsequent_indent=indent,
                               replace_whitespace=False, break_on_hyphens=False,
                               break_long_words=False) or [lead.rstrip()]  # fmt: skip
    return [line.rstrip() for line in lines]


def _room(s: dict) -> str:
    """How much room to grow the stored K/V arrays carry, if any."""
    n, slots = s["num_tokens"], s["stored_slots"]
    if n is None or slots <= n:
        return ""
    return f" (K/V stored in {slots} slots: room for {slots - n} more without a copy)"


def decoded_preview(info: CacheFileInfo, model_ref: str | None) -> tuple[str | None, str]:
    """``(preview, pending)``: the tail of the cached text, when a tokenizer can be found cheaply,
    and the end of the file's last reply that its tokens do not hold yet (a reply's last token
    is fed first by the next turn, e.g. one cut by ``-m``), shown after it."""
    if not info.tokens:
        return None, ""
    ref = model_ref or (info.model.model_id if info.model else None)
    if not ref or not os.path.exists(ref):
        return None, ""
    from ..models.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(ref)
    except Exception:  # preview is best effort: the rest of the report stands
        return None, ""
    text = tokenizer.decode(info.tokens)
    pending = _not_cached(text, info.messages)
    text += pending
    return (text if len(text) <= PREVIEW_CHARS else "…" + text[-PREVIEW_CHARS:]), pending


def _not_cached(text: str, messages: list[dict] | None) -> str:
    """The end of the last reply in ``messages`` that ``text`` (the decoded tokens) stops short of."""
    if not messages or messages[-1].get("role") != "assistant" or not isinstance(messages[-1].get("content"), str):
        return ""
    reply = messages[-1]["content"]
    for n in range(len(reply), max(len(reply) - PREVIEW_CHARS, 0) - 1, -1):
        if text.endswith(reply[:n]) and (n or text.endswith("\n")):
            return reply[n:] if n < len(reply) else ""
    return ""


def _checksums(state: str, info: CacheFileInfo) -> str:
    if state == "verified":
        return "verified (every tensor and the header match their CRC32)"
    if info.layout != "mlxcc":
        return f"none ({info.layout} files carry none; damage cannot be detected)"
    return f"none (format version {info.format_version} files carry none; damage cannot be detected)"


def run(args: argparse.Namespace) -> int:
    info = read_cache_info(args.file)
    s = summary(info)
    s["checksums"] = "verified" if verify_cache_file(args.file) else "none"
    s["preview"], s["preview_not_cached"] = decoded_preview(info, args.model)
    if args.json:
        print(json.dumps(s, indent=2, ensure_ascii=False))
        return 0
    types = ", ".join(f"{n} × {name}" for name, n in s["cache_types"].items())
    layout = "" if info.layout == "mlxcc" else f" (written by {info.layout})"
    lines = [
        f"file:        {s['file']}",
        f"format:      version {s['format_version']}{layout}",
        f"model:       {s['model'] or 'unknown (file does not say)'}"
        + (" (as recorded by mlx-lm)" if s["model"] and not info.model else ""),
        f"cache types: {types} ({s['num_layers']} layers)",
        f"tokens:      {s['num_tokens'] if s['num_tokens'] is not None else 'unknown'}{_room(s)}",
        f"bytes:       {human_bytes(s['nbytes'])} of arrays, {human_bytes(s['file_size'])} on disk",
    ]
    lines += field("checksums", _checksums(s["checksums"], info))
    if s["weights"]:
        lines += field("weights", f"{s['weights']} (the weight policy it was computed with; any policy can continue it)")
    if info.messages:
        lines += field("messages", f"{len(info.messages)} ({', '.join(m['role'] for m in info.messages)})")
    elif info.messages is not None:
        lines.append("messages:    none (a chat cache with no message yet, or one trimmed mid-message)")
    if info.settings:
        lines += field("settings", ", ".join(f"{k}={v}" for k, v in info.settings.items()))
    for k, v in info.metadata.items():
        lines += field("metadata", f"{k} = {v}")
    if s["preview"]:
        lines += field("preview", s["preview"])
        if s["preview_not_cached"]:
            lines += field("not cached", f"{s['preview_not_cached']!r}, the end of the last reply (its last token "
                           "is fed first by the next turn)")
    elif info.messages:
        last = info.messages[-1]
        lines += field(f"last message ({last['role']})", last["content"][:PREVIEW_CHARS])
    print("\n".join(lines))
    return 0
