"""``mlxcc cache convert|trim|diff``: whole-file operations on cache files
(thin wrappers over :mod:`mlx_chatcache.files.convert`)."""

from __future__ import annotations

import argparse
import json

from ..files.convert import FORMATS, convert_cache_file, diff_cache_files, trim_cache_file
from ..files.cache_file import claim
from .common import add_force_arg, non_negative_int, plural


def add_actions(csub) -> None:
    conv = csub.add_parser(
        "convert",
        help="rewrite a cache file as mlx-lm's layout or ours",
        description="Rewrite a cache file in another layout. '--to mlx-lm' writes what "
        "mlx_lm.generate --prompt-cache-file loads (token ids, messages and the model "
        "fingerprint ride along in metadata mlx-lm ignores, so converting back loses nothing); "
        "'--to mlxcc' writes our layout.",
    )
    conv.add_argument("input", help="the cache file to read (ours or mlx-lm's)")
    conv.add_argument("output", help="the file to write (atomically)")
    conv.add_argument("--to", required=True, choices=FORMATS, help="the layout to write")
    add_force_arg(conv)
    conv.set_defaults(run=run_convert)
    trim = csub.add_parser(
        "trim",
        help="keep only the first N tokens of a cache file",
        description="Keep the first N tokens of a cache file (with --drop: remove the last N, as "
        "mlx-lm's trim_prompt_cache does). A chat cache keeps its token ids but not its messages, "
        "so a later generate reuses the common prefix. Refused for caches that cannot drop tokens "
        "(recurrent layers, a rotating window that has wrapped), and for a chat session in place "
        "(with --output its first tokens become a prompt cache, not a session).",
    )
    trim.add_argument("file", help="the cache file")
    trim.add_argument("n", type=non_negative_int, metavar="N", help="tokens to keep (with --drop: to remove from the end)")
    trim.add_argument("--drop", action="store_true", help="N counts the tokens removed from the end")
    trim.add_argument("--output", "-o", help="write the trimmed cache here instead of replacing FILE")
    add_force_arg(trim)
    trim.set_defaults(run=run_trim)
    diff = csub.add_parser(
        "diff",
        help="compare two cache files: model, common token prefix, layers, settings",
        description="Compare two cache files without loading their arrays: same model?, how many "
        "leading tokens they share and where they diverge, layer class and setting differences. "
        "Exits with status 1 when the files were made by different models (their caches and token "
        "ids cannot be compared), 0 otherwise.",
    )
    diff.add_argument("a", help="first cache file")
    diff.add_argument("b", help="second cache file")
    diff.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    diff.set_defaults(run=run_diff)


def run_convert(args: argparse.Namespace) -> int:
    with claim(args.output, force=args.force) as out:
        info = convert_cache_file(args.input, out, args.to)
    n = plural(info.num_tokens, "token") if info.num_tokens is not None else "token ids unknown"
    print(f"wrote {args.output} ({args.to} layout, {plural(len(info.classes), 'layer')}, {n})")
    return 0


def run_trim(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..files.cache_file import is_session
    from ..files.mlxcc_format import read_cache_info

    in_place = args.output is None
    # in place, FILE is replaced only by its own trimmed cache: it must be one, and not a session (below)
    with claim(args.output or args.file, force=args.force or in_place) as out:
        if in_place and is_session(read_cache_info(args.file)):
            raise UsageError(f"{args.file} is a chat session: trimming it in place would break its bookkeeping; "
                             f"/undo in 'mlxcc chat --session-file {args.file}' removes exchanges, or add "
                             "--output OUT to write its first tokens as a prompt cache (not a session)")  # fmt: skip
        before, after = trim_cache_file(args.file, out, args.n, args.drop)
    print(f"{args.output or args.file}: {before} -> {plural(after, 'token')}")
    return 0


def run_diff(args: argparse.Namespace) -> int:
    d = diff_cache_files(args.a, args.b)
    a, b = d.a, d.b
    out = {
        "a": a.path, "b": b.path,
        "model_a": a.model.model_id if a.model else a.metadata.get("model"),
        "model_b": b.model.model_id if b.model else b.metadata.get("model"),
        "same_model": d.same_model,
        "tokens_a": a.num_tokens, "tokens_b": b.num_tokens,
        # ids of two tokenizers are not comparable: no prefix is reported for different models
        "common_prefix": None if d.same_model is False else d.common_prefix,
        "diverge_at": None if d.same_model is False else d.diverge_at,
        "layer_differences": d.layer_differences, "setting_differences": d.setting_differences,
    }  # fmt: skip
    status = 1 if d.same_model is False else 0
    if args.json:
        print(json.dumps(out, indent=2, ensure_ascii=False))
        return status
    same = {True: "yes", False: "no", None: "unknown (a file does not say)"}[d.same_model]
    lines = [("model", f"{same} ({out['model_a'] or '?'} / {out['model_b'] or '?'})"),
             ("tokens", f"{_n(a.num_tokens)} / {_n(b.num_tokens)}")]  # fmt: skip
    if d.same_model is False:  # ids of two tokenizers: equal ids need not be the same text
        lines.append(("common prefix", "not compared (different models: their token ids are not comparable)"))
    elif d.common_prefix is None:
        lines.append(("common prefix", "unknown (a file holds no token ids)"))
    else:
        lines.append(("common prefix", plural(d.common_prefix, "token")))
        if d.diverge_at is not None:
            i = d.diverge_at
            lines.append(("diverge at", f"token {i} (id {a.tokens[i]} vs {b.tokens[i]})"))
        elif a.num_tokens != b.num_tokens:
            lines.append(("diverge at", "none: the shorter file is a prefix of the longer"))
    lines.append(("layers", "same classes and settings" if not d.layer_differences else "; ".join(d.layer_differences)))
    lines.append(("settings", "same" if not d.setting_differences else "; ".join(d.setting_differences)))
    width = max(len(label) for label, _ in lines) + 2  # every value starts in one column
    print("\n".join(f"{label + ':':<{width}}{value}" for label, value in lines))
    return status


def _n(v) -> str:
    return "unknown" if v is None else str(v)
