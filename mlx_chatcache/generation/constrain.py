"""Constrained decoding: a grammar decides which tokens may come next.

The engine is llguidance (a compiled grammar per request, a token mask per
step; see docs/structured-output.md for why this one).

Contract
--------
- :func:`json_schema_grammar` compiles a JSON schema (None: any JSON object)
  with compact whitespace: no whitespace outside strings is allowed, so a model
  cannot pad forever. :func:`lark_grammar` takes a Lark grammar (``%json {...}``
  embeds a schema; a special token is written ``<|name|>``). Both check the
  grammar and raise :class:`GrammarError` (one line, llguidance's reason) when
  llguidance refuses it.
- :func:`grammar_tokenizer` is the tokenizer llguidance masks with, built once per
  tokenizer object (a 128k vocabulary takes seconds) and cached.
- :class:`Constraint` is a logits processor (the ``(tokens, logits)`` convention
  of :mod:`mlx_chatcache.generation.sample`) for one generation: each call
  consumes the tokens sampled since its previous call, then leaves finite only
  the logits of tokens the grammar allows. The tokenizer's EOS tokens are allowed
  exactly when the text so far is complete, and they are the only tokens allowed
  once the grammar can take nothing more. So a reply that ends by an EOS token
  parses (and validates against the schema); one cut by ``max_tokens`` may not.
  Ids past the tokenizer's vocabulary (a model with padded logits) are never allowed.
  A token the grammar cannot take (only a sampler that ignores the logits draws
  one) raises :class:`~mlx_chatcache.errors.ChatCacheError`.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..errors import ChatCacheError

ANY_OBJECT = {"type": "object"}
_COMPACT = {"whitespace_flexible": False}
_SHIFTS = None  # mx.arange(32) as uint32, made on first use


class GrammarError(ChatCacheError):
    """llguidance refused a grammar or schema; ``str()`` is one line with its reason."""


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a dependency; only a broken install lacks it
        raise ChatCacheError("constrained decoding needs llguidance: pip install 'llguidance>=1.6,<2'") from None
    return llguidance


def _check(grammar: str, what: str) -> str:
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"{what}: {' '.join(error.split())}")
    return grammar


def json_schema_grammar(schema: dict | None) -> str:
    """The grammar of JSON text valid under ``schema`` (None: any JSON object), compact."""
    llg = _llguidance()
    schema = ANY_OBJECT if schema is None else schema
    if not isinstance(schema, dict):
        raise GrammarError(f"the JSON schema must be an object, got {type(schema).__name__}")
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=_COMPACT)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the JSON schema is not usable: {' '.join(str(e).split())}") from None
    return _check(grammar, "the JSON schema is not usable")


def lark_grammar(lark: str) -> str:
    """The grammar of a Lark text (checked)."""
    return _check(_llguidance().LLMatcher.grammar_from_lark(lark), "the grammar is not usable")


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer):
    """llguidance's tokenizer for ``tokenizer`` (mlx-lm's ``TokenizerWrapper`` or a Hugging
    Face fast tokenizer), EOS tokens = ``tokenizer.eos_token_ids``; cached per object."""
    key = getattr(tokenizer, "_tokenizer", tokenizer)  # the wrapper is rebuilt by some callers; the HF one is not
    with _TOKENIZERS_LOCK:
        found = _TOKENIZERS.get(key)
        if found is not None:
            return found
        llg = _llguidance()
        try:
            text = key.backend_tokenizer.to_str()
        except AttributeError:
            raise ChatCacheError("constrained decoding needs a Hugging Face fast tokenizer (tokenizer.json)") from None
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [key.eos_token_id])
        built = llg.LLTokenizer(text, eos_token=eos)
        _TOKENIZERS[key] = built
        return built


class Constraint:
    """The logits processor of one generation under ``grammar`` (see the module docstring).
    It keeps state (the tokens it consumed), so it sees each context once, in order:
    ``keeps_state`` tells speculative decoding not to draft under it."""

    keeps_state = True

    def __init__(self, tokenizer, grammar: str):
        llg = _llguidance()
        self.tokenizer = grammar_tokenizer(tokenizer)
        self.matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar is not usable: {' '.join(self.matcher.get_error().split())}")
        self.seen: int | None = None  # context length at the previous call

    def __call__(self, tokens: mx.array | Sequence[int], logits: mx.array) -> mx.array:
        n = len(tokens)
        if self.seen is not None:
            new = tokens[self.seen :]
            new = new.tolist() if isinstance(new, mx.array) else [int(t) for t in new]
            if new and not self.matcher.consume_tokens(new):
                raise ChatCacheError(f"the sampled token is not allowed by the grammar: {self.matcher.get_error()}")
        self.seen = n
        return mask_logits(logits, self.matcher.compute_bitmask())

    def done(self) -> bool:
        """Whether the grammar can take no more tokens (only EOS is allowed now)."""
        return self.matcher.is_stopped()


def mask_logits(logits: mx.array, bitmask: bytes) -> mx.array:
    """``logits`` ``(B, V)`` with -inf where bit ``i`` of the little-endian ``bitmask`` is 0
    (ids past the mask's bits are masked too)."""
    global _SHIFTS
    if _SHIFTS is None:
        _SHIFTS = mx.arange(32, dtype=mx.uint32)
    words = mx.array(np.frombuffer(bitmask, dtype=np.uint32))  # (W,)
    allowed = ((words[:, None] >> _SHIFTS) & 1).reshape(-1)  # (32 W,)
    V = logits.shape[-1]
    if allowed.shape[0] < V:
        allowed = mx.concatenate([allowed, mx.zeros((V - allowed.shape[0],), dtype=allowed.dtype)])
    return mx.where(allowed[:V].astype(mx.bool_), logits, -mx.inf)


def schema_from_text(text: str, source: str) -> dict:
    """A JSON schema read from ``text`` (``source`` names it in the error), checked."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"{source} is not JSON: {e}") from None
    json_schema_grammar(schema)
    return schema


__all__ = [
    "GrammarError",
    "json_schema_grammar",
    "lark_grammar",
    "grammar_tokenizer",
    "Constraint",
    "mask_logits",
    "schema_from_text",
]
