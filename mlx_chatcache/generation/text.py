"""Text in, text out on a reusable prompt cache: :func:`stream_generate` and :func:`generate`.

The top two layers of :mod:`mlx_chatcache.generation.loop` (read its docstring for what the
state holds after a call, feeding ahead and cache settings): :func:`stream_generate` encodes the
prompt, reuses the longest prefix the state already holds, runs
:func:`~mlx_chatcache.generation.loop.generate_step` and yields a :class:`GenerationResponse`
text segment with statistics per token; :func:`generate` returns the whole text. Also the tokenizer
helpers they need (:func:`as_tokenizer_wrapper`, :func:`encode_prompt`, :func:`stop_token_ids`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Collection, Iterable, Iterator, Sequence

import mlx.core as mx

from ..cache import BaseCache
from ..config import GenerationConfig
from ..errors import UsageError
from ..models.draft_pair import DraftPair
from .arguments import call_config, call_state
from .device import generation_stream, wired_limit
from .feed import Progress
from .loop import generate_step
from .speculative import speculative_generate_step
from ..files.prompt_cache import PromptCache
from .prompt import ensure_state, reuse_prefix
from .sample import LogitsProcessor, Sampler, make_logits_processors
from .token_ids import check_token_ids

@dataclass
class GenerationResponse:
    """One step of :func:`stream_generate`.

    ``text`` is the new text segment (may be empty; stop tokens add no text).
    ``prompt_tokens`` counts the whole prompt, ``reused_tokens`` the part taken
    from the cache. ``ttft`` is the number of seconds from the call to the
    first token. ``prompt_tps`` is the non-reused prompt tokens divided by
    ``ttft``. ``generation_tokens`` counts the tokens sampled so far,
    including a final stop token. ``generation_tps`` is the tokens after the
    first, per second since the first (0 until there are two).
    ``peak_memory`` is in GB. ``finish_reason`` is "stop" (a stop token),
    "length" (``max_tokens`` reached) or None (more to come). ``from_draft``:
    the token was drafted (a draft model, prompt lookup, store drafts) and the
    model accepted it.
    """

    text: str
    token: int
    logprobs: mx.array
    prompt_tokens: int
    reused_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    ttft: float
    peak_memory: float
    finish_reason: str | None = None
    from_draft: bool = False  # whether a draft source proposed the token (speculative decoding)


def as_tokenizer_wrapper(tokenizer):
    """mlx-lm's ``TokenizerWrapper`` (gives ``detokenizer`` and ``eos_token_ids``)."""
    if hasattr(tokenizer, "detokenizer") and hasattr(tokenizer, "eos_token_ids"):
        return tokenizer
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(tokenizer)


def encode_prompt(tokenizer, prompt: str | Sequence[int] | mx.array) -> list[int]:
    """Token ids of ``prompt``. Special tokens are added to text unless it already starts with BOS."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        ids = list(tokenizer.encode(prompt, add_special_tokens=add_special))
    elif isinstance(prompt, mx.array):
        ids = prompt.reshape(-1).tolist()
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise UsageError("the prompt is empty; give at least one token")
    return ids


def stop_token_ids(tokenizer, extra_eos_tokens: Iterable[str | int] = ()) -> set[int]:
    """The tokenizer's EOS ids plus ``extra_eos_tokens``.

    Each extra token is an id or a string: the string must encode to a single
    token or be one vocabulary entry, otherwise :class:`UsageError`.
    """
    stops = set(tokenizer.eos_token_ids)
    for tok in extra_eos_tokens:
        if isinstance(tok, int):
            stops.add(tok)
            continue
        ids = tokenizer.encode(tok, add_special_tokens=False)
        if len(ids) != 1:  # maybe a vocabulary entry spelled as stored ("Ġthe")
            vocab_id = tokenizer.get_vocab().get(tok)
            ids = [] if vocab_id is None else [vocab_id]
        if len(ids) != 1:
            raise UsageError(f"extra EOS token {tok!r} is not a single token of this tokenizer")
        stops.add(int(ids[0]))
    return stops


def next_segment(detokenizer, token: int, stops: Collection[int], finish: str | None) -> str:
    """The text ``token`` adds to a streaming ``detokenizer`` (a stop token adds none);
    the text held back is flushed when ``finish`` says the reply ends here."""
    if token not in stops:
        detokenizer.add_token(token)
    if finish:
        detokenizer.finalize()
    return detokenizer.last_segment


def constrained(tokenizer, json_schema: dict, config: GenerationConfig,
                processors: Sequence[LogitsProcessor] | None) -> list[LogitsProcessor]:
    """``processors`` (None: those ``config`` describes) then a fresh
    :class:`~mlx_chatcache.generation.constrain.Constraint` to ``json_schema``."""
    from .constrain import Constraint, json_schema_grammar

    if processors is None:
        processors = make_logits_processors(config)
    return [*processors, Constraint(tokenizer, json_schema_grammar(json_schema))]


def stream_generate(
    model,
    tokenizer,
    prompt: str | Sequence[int] | mx.array,
    max_tokens: int | None = None,
    draft_model=None,
    stream=generation_stream,
    *,
    num_draft_tokens: int | None = None,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    max_kv_size: int | None = None,
    prompt_cache: list[BaseCache] | PromptCache | None = None,
    prefill_step_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
    prompt_progress_callback: Progress | None = None,
    input_embeddings: mx.array | None = None,
    state: PromptCache | None = None,
    config: GenerationConfig | None = None,
    extra_eos_tokens: Iterable[str | int] = (),
    progress: Progress | None = None,
    max_call_seconds: float | None = None,
    json_schema: dict | None = None,
    draft_index=None,
    draft_stats: dict | None = None,
) -> Iterator[GenerationResponse]:
    """Yield a :class:`GenerationResponse` per sampled token; the last has a ``finish_reason``.

    ``prompt`` is text (encoded with the tokenizer) or token ids. ``state``
    is reused and updated in place (see the module docstring); None uses a
    throw-away cache. Generation stops at the tokenizer's EOS tokens, at
    ``extra_eos_tokens`` and at ``config.max_tokens``. ``max_call_seconds``:
    see :func:`~mlx_chatcache.generation.feed.prefill`. mlx-lm's arguments
    (``max_tokens``, ``stream``, ``prompt_cache``, ``input_embeddings``, ...) mean what they mean for
    :func:`~mlx_chatcache.generation.loop.generate_step`. Speculative decoding
    (:func:`~mlx_chatcache.generation.speculative.speculative_generate_step`) runs with
    ``draft_model`` (or a model that is a :class:`~mlx_chatcache.models.draft_pair.DraftPair`)
    or ``config.prompt_lookup`` ("store" drafts from ``draft_index`` too), unless
    ``num_draft_tokens`` (else ``config.num_draft_tokens``) is 0 or a logits processor keeps
    state (``json_schema``'s); ``draft_stats``: see there. ``json_schema``: the reply is JSON valid under
    this schema whenever it ends by an EOS token (``finish_reason`` "stop"; see
    :mod:`mlx_chatcache.generation.constrain`); a schema llguidance refuses raises
    :class:`~mlx_chatcache.generation.constrain.GrammarError` before anything is computed.
    The loop holds :func:`~mlx_chatcache.generation.device.wired_limit` while it runs.
    """
    start = time.perf_counter()
    config = call_config(
        config, max_tokens=max_tokens, max_kv_size=max_kv_size, prefill_step_size=prefill_step_size,
        kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
    )  # fmt: skip
    tokenizer = as_tokenizer_wrapper(tokenizer)
    prompt_ids = [] if input_embeddings is not None and _empty(prompt) else encode_prompt(tokenizer, prompt)
    check_token_ids(model, prompt_ids)  # before the state is trimmed to the prompt
    stops = stop_token_ids(tokenizer, extra_eos_tokens)
    if json_schema is not None:
        logits_processors = constrained(tokenizer, json_schema, config, logits_processors)
    drafting = _drafting(model, draft_model, config, num_draft_tokens, logits_processors)
    if drafting and input_embeddings is not None:
        raise UsageError("speculative decoding does not take input_embeddings; generate without a draft source")
    state, borrowed = call_state(prompt_cache, state)
    reused = 0
    if not borrowed and state is not None:
        state = ensure_state(model, state, config)
        reused = reuse_prefix(state, prompt_ids, model)
    args = dict(prompt_cache=state.cache if borrowed else None, state=None if borrowed else state, config=config,
                sampler=sampler, logits_processors=logits_processors, stop_tokens=stops, progress=progress,
                max_call_seconds=max_call_seconds)  # fmt: skip
    if drafting:
        if prompt_progress_callback is not None:
            args["progress"] = progress or prompt_progress_callback
        steps = speculative_generate_step(prompt_ids, model, draft_model, stream, num_draft_tokens=num_draft_tokens,
                                          draft_index=draft_index, draft_stats=draft_stats, **args)  # fmt: skip
    else:
        plain = generate_step(prompt_ids, model, stream, prompt_progress_callback=prompt_progress_callback,
                              input_embeddings=input_embeddings, **args)  # fmt: skip
        steps = ((token, logprobs, False) for token, logprobs in plain)
    n_prompt = len(prompt_ids) if input_embeddings is None else input_embeddings.shape[0]
    detokenizer = tokenizer.detokenizer
    with wired_limit(model):
        for n, (token, logprobs, from_draft) in enumerate(steps, 1):
            now = time.perf_counter()
            if n == 1:
                ttft, first = now - start, now
            finish = "stop" if token in stops else "length" if n == config.max_tokens else None
            yield GenerationResponse(
                text=next_segment(detokenizer, token, stops, finish),
                token=token,
                logprobs=logprobs,
                prompt_tokens=n_prompt,
                reused_tokens=reused,
                prompt_tps=(n_prompt - reused) / max(ttft, 1e-9),
                generation_tokens=n,
                generation_tps=(n - 1) / (now - first) if n > 1 else 0.0,
                ttft=ttft,
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                from_draft=from_draft,
            )


def _empty(prompt) -> bool:
    return (isinstance(prompt, mx.array) and prompt.size == 0) or (not isinstance(prompt, mx.array) and len(prompt) == 0)


def _drafting(model, draft_model, config: GenerationConfig, num_draft_tokens: int | None,
              processors: Sequence[LogitsProcessor] | None) -> bool:  # fmt: skip
    """Whether a call with these arguments decodes speculatively (see :func:`stream_generate`)."""
    source = draft_model is not None or isinstance(model, DraftPair) or config.prompt_lookup != "off"
    k = config.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    stateful = any(getattr(p, "keeps_state", False) for p in processors or ())
    return source and k != 0 and not stateful


def generate(
    model,
    tokenizer,
    prompt: str | Sequence[int] | mx.array,
    verbose: bool = False,
    *,
    max_tokens: int | None = None,
    draft_model=None,
    num_draft_tokens: int | None = None,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    max_kv_size: int | None = None,
    prompt_cache: list[BaseCache] | PromptCache | None = None,
    prefill_step_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
    prompt_progress_callback: Progress | None = None,
    input_embeddings=None,
    state: PromptCache | None = None,
    config: GenerationConfig | None = None,
    extra_eos_tokens: Iterable[str | int] = (),
    json_schema: dict | None = None,
    draft_index=None,
) -> str:
    """The whole generated text (see :func:`stream_generate`, which takes the same
    keywords); ``verbose`` prints it and stats."""
    text, last = "", None
    for last in stream_generate(
        model, tokenizer, prompt, max_tokens, draft_model, num_draft_tokens=num_draft_tokens, sampler=sampler,
        logits_processors=logits_processors,
        max_kv_size=max_kv_size, prompt_cache=prompt_cache, prefill_step_size=prefill_step_size, kv_bits=kv_bits,
        kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
        prompt_progress_callback=prompt_progress_callback, input_embeddings=input_embeddings, state=state,
        config=config, extra_eos_tokens=extra_eos_tokens, json_schema=json_schema, draft_index=draft_index,
    ):  # fmt: skip
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print()
        print(
            f"Prompt: {last.prompt_tokens} tokens ({last.reused_tokens} reused), "
            f"{last.prompt_tps:.1f} tokens/s, first token after {last.ttft:.3f} s"
        )
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s")
        print(f"Peak memory: {last.peak_memory:.3f} GB")
    return text

__all__ = [
    "GenerationResponse",
    "as_tokenizer_wrapper",
    "encode_prompt",
    "stop_token_ids",
    "next_segment",
    "stream_generate",
    "generate",
]
