"""Per-turn checkpoints of a chat session, and rolling its cache back to one.

Contract
--------
A :class:`Checkpoint` records a chat session at the start of a turn (before
the user message is added): message count, token and text lengths and,
optionally, ``cache``: copies of the layers that may not trim back to that
point. Rolling back (:func:`rewind_cache`) makes a
:class:`~mlx_chatcache.files.prompt_cache.PromptCache` hold the checkpoint's
tokens again without feeding a history token twice:

- when every layer can be trimmed, the cache is trimmed (``"trim"``);
- otherwise the layers that may not trim back are restored from the
  checkpoint's copies and the plain K/V layers are trimmed (``"checkpoint"``).
  Rotating windows stop being trimmable once they drop a token, and SSM or
  convolution ``ArraysCache`` layers never are; plain K/V layers always are,
  so a hybrid model's checkpoint holds its small recurrent states, not its K/V;
- when neither works, ``None``: the caller starts a fresh cache and the
  history is recomputed on the next turn (a :class:`RollbackResult` of
  ``"recompute"``).

Copies are kept for the last ``max_checkpoints`` turns only
(:func:`drop_old_copies`). A checkpoint's copy stays valid after a restore, so
one checkpoint can be restored more than once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from ..cache import BaseCache, copy_prompt_cache
from ..files.prompt_cache import PromptCache
from ..generation.prompt import trim_state

LayerCopies = list[BaseCache | None]  # one entry per layer; None: a plain K/V layer (trimmed instead)


@dataclass
class Checkpoint:
    """The session at the start of a turn (before the user message was added).

    Lengths refer to the session's token sequence and text, which only grow
    from one turn to the next (checkpoints past a point where history is
    rewritten are dropped). ``cache``: copies of the layers that may not trim back to this
    point (None entries for plain K/V layers), or None when every layer can. ``reread``:
    the spans of the pending tokens the model had read before (:mod:`mlx_chatcache.chat.held`).
    """

    n_messages: int
    n_tokens: int  # len(state.tokens + pending)
    state_len: int  # len(state.tokens)
    n_text: int
    cache: LayerCopies | None = None
    reread: list[tuple[int, int]] = field(default_factory=list)

    def to_json(self) -> list[int]:
        return [self.n_messages, self.n_tokens, self.state_len, self.n_text]


@dataclass
class RollbackResult:
    """What undo/retry did to the cache: ``how`` is "trim", "checkpoint",
    "rerender" (no checkpoint: the conversation was rendered again and the
    cache keeps its common start) or "recompute" (the cache could not be rolled
    back). ``recompute_tokens``: tokens the model had read that the next turn
    feeds again."""

    how: str
    recompute_tokens: int = 0


def snapshot(cache: list[BaseCache]) -> LayerCopies | None:
    """Copies of the layers that might not trim back to this point (None
    entries for plain K/V layers, which always can); None when all are plain.
    So a hybrid model's checkpoint holds its small SSM states, not its K/V."""
    if all(c.always_trimmable() for c in cache):
        return None
    snap = [None if c.always_trimmable() else _copy_layer(c) for c in cache]
    mx.eval([c.eval_arrays() for c in snap if c is not None])
    return snap


def restore(state: PromptCache, snap: LayerCopies, state_len: int, tokens: list[int]) -> bool:
    """Layers copied from ``snap`` (which stays valid), the others trimmed
    back to ``state_len``; ``state.tokens = tokens[:state_len]``. Returns
    False, changing nothing, when the trimmed layers cannot get there."""
    cache = state.cache
    plain = [c for c, x in zip(cache, snap) if x is None]
    if len(snap) != len(cache):
        return False
    # each plain layer trims back on its own (after an interrupted model call
    # they may hold different counts); a reset cache holds too few
    if plain and not (
        len(state.tokens) >= state_len
        and state.tokens[:state_len] == tokens[:state_len]
        and all(c.is_trimmable() and c.offset >= state_len for c in plain)
    ):
        return False
    for i, x in enumerate(snap):
        if x is None:
            cache[i].trim(cache[i].offset - state_len)
        else:
            cache[i] = _copy_layer(x)
    mx.eval([c.eval_arrays() for c in cache])
    state.tokens[:] = tokens[:state_len]
    return True


def rewind_cache(state: PromptCache, ck: Checkpoint, tokens: list[int]) -> str | None:
    """Make ``state`` hold ``tokens[:ck.state_len]`` again: "trim" or
    "checkpoint" (see the module doc), or None when neither can (the caller
    must then reset the state: trimmable layers may have been trimmed)."""
    excess = len(state.tokens) - ck.state_len
    if excess >= 0 and state.tokens[: ck.state_len] == tokens[: ck.state_len]:
        if trim_state(state, ck.state_len):
            return "trim"
    if ck.cache is not None and restore(state, ck.cache, ck.state_len, tokens):
        return "checkpoint"
    return None


def drop_old_copies(checkpoints: list[Checkpoint], max_checkpoints: int) -> None:
    """Bounded memory: cache copies only for the last ``max_checkpoints`` turns."""
    for ck in checkpoints[: -max_checkpoints or None]:  # all of them when max_checkpoints is 0
        ck.cache = None


def _copy_layer(c: BaseCache) -> BaseCache:
    return copy_prompt_cache([c])[0]


__all__ = ["Checkpoint", "RollbackResult", "snapshot", "restore", "rewind_cache", "drop_old_copies"]
