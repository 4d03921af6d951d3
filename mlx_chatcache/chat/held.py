"""The tokens a chat session holds for its conversation, and which of them the model has read.

A session holds the token ids of its conversation (its cache's tokens, then ``pending``:
those the next turn feeds first) and, when known, their exact text. Which of the pending
tokens the model has read before (and so recomputes when it feeds them) is a list of
:data:`Spans`: half-open ``(start, end)`` position ranges, sorted and disjoint.

Contract
--------
- :func:`merged`, :func:`clipped`, :func:`shifted` and :func:`overlap` work on spans.
- :func:`held_prefix` is the most held tokens whose decoded text starts a text.
- :func:`moved_history` finds, when the start of a rendered conversation changed (a new
  system prompt), the held tokens that still stand for the same text at its end (the
  history), so they are kept as they were generated instead of being encoded again;
  :func:`rebased` is the new token sequence.
- :func:`carried` says which positions of a new token sequence the model has read, given
  those of the old one: positions whose ids did not change, and the moved history.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..files.tokens import common_prefix_len

Spans = list[tuple[int, int]]


def merged(spans: Sequence[tuple[int, int]]) -> Spans:
    """``spans`` sorted, empty ones dropped, touching or overlapping ones joined."""
    out: Spans = []
    for a, b in sorted(s for s in spans if s[0] < s[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def clipped(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> Spans:
    """The parts of ``spans`` inside ``[lo, hi)``."""
    return merged([(max(a, lo), min(b, hi)) for a, b in spans])


def shifted(spans: Sequence[tuple[int, int]], by: int) -> Spans:
    return [(a + by, b + by) for a, b in spans]


def overlap(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> int:
    """How many positions of ``[lo, hi)`` the spans cover."""
    return sum(b - a for a, b in clipped(spans, lo, hi))


def held_prefix(decode: Callable[[list[int]], str], held: list[int], text: str) -> tuple[int, int]:
    """``(k, n)``: the most held tokens ``k`` whose decoded text (``n`` characters)
    starts ``text`` (binary search; every candidate is checked, so a miss only keeps less)."""
    lo, hi = 0, len(held)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(decode(held[:mid])):
            lo = mid
        else:
            hi = mid - 1
    return lo, len(decode(held[:lo])) if lo else 0


def moved_history(decode: Callable[[list[int]], str], held: list[int], text: str, old: str, new: str,
                  floor: int = 0) -> tuple[int, int] | None:  # fmt: skip
    """``(k, n)`` such that ``held[k:]`` (the text ``text[n:]``) may follow ``new[:n + len(new) -
    len(old)]``: ``text`` is the exact text of ``held`` and a prefix of ``old`` (the conversation
    rendered before a change), ``new`` the same conversation rendered after it, and ``text[n:]``
    lies in their common end, from ``old[floor:]`` on (where its history starts). None when no
    held token boundary lies there."""
    if not old.startswith(text):
        return None
    same = 0
    while same < min(len(old), len(new)) and old[len(old) - 1 - same] == new[len(new) - 1 - same]:
        same += 1
    start = max(len(old) - same, floor)  # old[start:] == new[len(new) - (len(old) - start):]
    if start >= len(text):
        return None
    lo, hi = 0, len(held)  # the fewest tokens whose text reaches ``start``
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(held[:mid])) >= start:
            hi = mid
        else:
            lo = mid + 1
    n = len(decode(held[:lo]))
    if lo >= len(held) or not text.startswith(decode(held[:lo])) or n < start:
        return None
    return lo, n


def rebased(decode: Callable[[list[int]], str], encode: Callable[[str], list[int]], held: list[int], text: str,
            old: tuple[str, int] | None, new: str) -> tuple[list[int], str, tuple[int, int] | None]:  # fmt: skip
    """``(ids, text, moved)``: the tokens of a conversation rendered as ``new`` after a change
    (a new system prompt, template arguments, a cleared history), and their text, from
    ``held`` (text ``text``, "" when unknown) rendered before it as ``old``: ``(rendering, where
    its history starts)`` (None: keep no end).
    The held tokens whose text starts ``new`` are kept, then, when both renderings end
    alike (:func:`moved_history`), the held tokens of that end as they were fed after
    the new text between encoded (``moved``: ``(k_old, k_new)``, where they start);
    otherwise the rest of ``new`` is encoded (``moved`` None)."""
    moved = moved_history(decode, held, text, old[0], new, old[1]) if old and text else None
    if moved is not None:
        k, n = moved
        head = new[: n + len(new) - len(old[0])]
        ids = encode(head)
        return ids + held[k:], head + text[n:], (k, len(ids))
    k, n = held_prefix(decode, held, new)
    return held[:k] + encode(new[n:]), new, None


def carried(read: Spans, old: list[int], new: list[int], moved: tuple[int, int] | None) -> Spans:
    """The positions of ``new`` the model has read, when it had read ``read`` of ``old``:
    those before the first id that differs, and (``moved``: ``(k_old, k_new)``, ``new[k_new:]
    == old[k_old:]``) the read positions of the moved end, shifted."""
    out = clipped(read, 0, common_prefix_len(old, new))
    if moved is not None:
        k_old, k_new = moved
        out += shifted(clipped(read, k_old, len(old)), k_new - k_old)
    return merged(out)


__all__ = ["Spans", "merged", "clipped", "shifted", "overlap", "held_prefix", "moved_history", "rebased", "carried"]
