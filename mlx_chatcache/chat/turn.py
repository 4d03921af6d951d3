"""The model work of one chat turn: feeding its prompt and streaming its reply,
both stopping on request, and what the turn cost.

Contract
--------
:func:`feed_prompt` feeds ``ids[len(state.tokens):upto]`` into a
:class:`~mlx_chatcache.files.prompt_cache.PromptCache` in
``prefill_step_size`` chunks, recording each chunk in ``state.tokens``. It
polls ``should_stop`` before every chunk and raises :class:`TurnCancelled`
when it says so; the state then holds the chunks fed so far (the caller rolls
the turn back). When ``upto == len(ids) - 1`` (the prompt up to the token the
reply starts from), the tokens :func:`~mlx_chatcache.generation.feed.final_call_size`
gives (the prompt's last chunk, or only its last token for a quantized model)
are left to :func:`stream_reply`: the generate loop feeds them in the model
call that samples the first reply token, one call instead of two.
``should_stop`` is polled before that chunk too when it is more than one token. With ``should_stop`` the
chunks are paced (:mod:`mlx_chatcache.generation.pacing`): each model call, the one left
to the reply included, is sized to take about ``INTERRUPTIBLE_CALL_SECONDS``
at most, so a stop request is honoured within a second. A chunk that raises
leaves the layers holding ``state.tokens`` (trimmed back) or an empty state.

:func:`stream_reply` generates the reply to a prompt the state holds a prefix
of, passing each text piece to ``on_text``. It polls ``should_stop`` after
every token that does not end the reply and ends the reply there
("interrupted"), then passes on the text the detokenizer held back. Stop
strings end it too (finish "stop"; the text is cut before the stop string). The state
is left as :mod:`mlx_chatcache.generation.loop` documents for a reply that ends:
every reply token but the last has been fed (after an interruption, the token
the generate loop fed ahead is trimmed back off).

:class:`TurnStats` is what a turn cost; :func:`turn_stats` fills one in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..config import INTERRUPTIBLE_CALL_SECONDS, GenerationConfig
from ..generation.feed import (
    PrefillStopped,
    Progress,
    consistent_on_error,
    final_call_size,
    make_kv_quantizer,
    prefill,
)
from ..generation.pacing import CallPacer
from ..files.prompt_cache import PromptCache
from ..generation.prompt import trim_state
from ..generation.stops import StopMatcher
from ..generation.text import GenerationResponse, stream_generate

TextCallback = Callable[[str], None]
StopCheck = Callable[[], bool]


class TurnCancelled(Exception):
    """A stop request arrived before the first reply token."""


@dataclass
class TurnStats:
    """What one turn cost. ``new_tokens`` of the prompt were fed to the model,
    ``reused_tokens`` came from the cache (or the store); ``recomputed_tokens``
    of the new ones the model had read before in this conversation and fed again
    (kept by the session, :mod:`mlx_chatcache.chat.held`): after a new system
    prompt or template arguments, a rollback the cache could not follow, a
    cancelled edit, a repaired session, or a cache that held them but could not
    keep them. An /undo or /retry goes back to the start of a turn, whose
    tokens count as they did then."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    new_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    ttft: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    peak_memory: float = 0.0
    finish_reason: str = ""  # "stop", "length" or "interrupted"
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"prompt: {self.new_tokens} new + {self.reused_tokens} reused tokens "
            f"({self.recomputed_tokens} recomputed), first token {self.ttft:.3f} s, "
            f"{self.prompt_tps:.1f} tok/s | reply: {self.generated_tokens} tokens, "
            f"{self.generation_tps:.1f} tok/s ({self.finish_reason}) | peak {self.peak_memory:.3f} GB"
        )

    def add(self, s: "TurnStats") -> None:
        """Count turn ``s`` into these totals (token counts and time add up, peak memory is the max)."""
        for name in ("prompt_tokens", "reused_tokens", "new_tokens", "recomputed_tokens",
                     "generated_tokens", "seconds"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(s, name))
        self.peak_memory = max(self.peak_memory, s.peak_memory)


@dataclass
class TurnResult:
    text: str
    stats: TurnStats
    warning: str | None = None  # a line to show (the conversation nears the end of the context)


@dataclass
class Reply:
    """What :func:`stream_reply` generated."""

    text: str
    tokens: list[int]
    last: GenerationResponse  # the final step: finish reason, speed, memory
    ttft: float  # seconds from the turn's start to the first reply token
    interrupted: bool
    cut: bool = False  # ended at a stop string: ``text`` ends before the text of ``tokens`` does

    @property
    def finish_reason(self) -> str:
        if self.cut:
            return "stop"
        return "interrupted" if self.interrupted else (self.last.finish_reason or "length")


def feed_prompt(
    model,
    state: PromptCache,
    ids: list[int],
    upto: int,
    config: GenerationConfig,
    should_stop: StopCheck | None,
    progress: Progress | None = None,
) -> None:
    """Feed ``ids[len(state.tokens):upto]`` in ``config.prefill_step_size``
    chunks, less the reply's first call when ``upto == len(ids) - 1`` (see the
    module doc); TurnCancelled on a stop request. With ``should_stop`` the
    chunks (and the call left to the reply) are also sized to take at most
    about ``INTERRUPTIBLE_CALL_SECONDS`` (:mod:`mlx_chatcache.generation.pacing`), so a
    stop request is honoured within a second. ``progress`` gets ``(fed, to
    feed)`` (:func:`~mlx_chatcache.generation.feed.prefill`)."""
    step = config.prefill_step_size
    pacer = CallPacer(model, INTERRUPTIBLE_CALL_SECONDS) if should_stop is not None else None
    first = len(state.tokens)
    if upto == len(ids) - 1 and first <= upto:  # the reply comes next
        todo, leave = ids[first:], final_call_size(model, len(ids) - first, step)
    else:
        todo, leave = ids[first:upto], 0
    try:
        with consistent_on_error(state, model):
            prefill(model, state, todo, step, progress, kv_quantizer=make_kv_quantizer(config), leave=leave,
                    pacer=pacer, should_stop=should_stop)  # fmt: skip
    except PrefillStopped:
        raise TurnCancelled from None


def stream_reply(
    model,
    tokenizer,
    prompt_ids: list[int],
    state: PromptCache,
    config: GenerationConfig,
    started: float,
    on_text: TextCallback | None,
    should_stop: StopCheck | None,
    stops: Sequence[str] = (),
    draft_index=None,
) -> Reply:
    """The reply to ``prompt_ids`` (see the module doc); ``started``: the turn's
    start on ``time.perf_counter()``, from which the TTFT is measured. The text
    is cut at the first of ``stops`` (:class:`~mlx_chatcache.generation.stops.StopMatcher`):
    the reply ends there (``cut``; its tokens then say more than its text). ``draft_index``:
    the store's, for ``config.prompt_lookup`` "store" (speculative decoding)."""
    tokens: list[int] = []
    raw: list[str] = []  # the detokenizer's pieces
    pieces: list[str] = []  # what the reply says (cut at a stop string)
    matcher = StopMatcher(list(stops))
    last, ttft, interrupted, cut = None, 0.0, False, False

    def say(piece: str) -> bool:
        out, hit = matcher.feed(piece)
        if out:
            pieces.append(out)
            if on_text:
                on_text(out)
        return hit

    gen = stream_generate(model, tokenizer, prompt_ids, state=state, config=config, draft_index=draft_index)
    try:
        for r in gen:
            if last is None:
                ttft = time.perf_counter() - started
            last = r
            tokens.append(r.token)
            if r.text:
                raw.append(r.text)
                cut = say(r.text)
            if r.finish_reason is None and (cut or should_stop is not None and should_stop()):
                interrupted = not cut
                break
    finally:
        gen.close()
    if interrupted or cut:
        fed = len(prompt_ids) + len(tokens) - 1  # the reply's last token was fed ahead
        if len(state.tokens) > fed and not trim_state(state, fed):
            state.reset(model)  # not reached: a token is fed ahead only when it can be trimmed back
    if interrupted:
        cut = say(_held_back(tokenizer, "".join(raw), tokens))
    if not cut:
        say(matcher.flush())
    return Reply("".join(pieces), tokens, last, ttft, interrupted, cut)


def _held_back(tokenizer, text: str, tokens: list[int]) -> str:
    """The end of a word the detokenizer may hold back after ``text``."""
    eos = set(tokenizer.eos_token_ids)
    full = tokenizer.decode([t for t in tokens if t not in eos])
    return full[len(text):] if full.startswith(text) else ""


def turn_stats(prompt_ids: list[int], reused: int, recomputed: int, reply: Reply, started: float) -> TurnStats:
    """A turn's statistics: ``reused`` prompt tokens came from the cache, the rest
    were fed, ``recomputed`` of them read before."""
    new = len(prompt_ids) - reused
    return TurnStats(
        prompt_tokens=len(prompt_ids),
        reused_tokens=reused,
        new_tokens=new,
        recomputed_tokens=recomputed,
        generated_tokens=len(reply.tokens),
        ttft=reply.ttft,
        prompt_tps=new / max(reply.ttft, 1e-9),
        generation_tps=reply.last.generation_tps,
        peak_memory=reply.last.peak_memory,
        finish_reason=reply.finish_reason,
        seconds=time.perf_counter() - started,
    )


__all__ = [
    "TurnStats",
    "TurnResult",
    "TurnCancelled",
    "Reply",
    "feed_prompt",
    "stream_reply",
    "turn_stats",
]
