"""Which token ids a model can take, and the check that ids are among them.

Contract:

- :func:`vocab_size` is the number of rows of the model's token embedding
  (the ids it can look up are ``0 .. rows - 1``), found once per model object:
  the embedding module named like a token embedding (``embed_tokens``,
  ``wte``, ``word_embeddings``, ...; the first such name in that order, the
  one nearest the model's root among equals), float or quantized (rows are
  ``weight.shape[0]`` in both); else ``args.vocab_size``; else None (unknown:
  ids are not checked). The tokenizer's vocabulary is not used: it may be
  smaller or larger than the embedding.
- :func:`logits_fit` says whether ids drawn from the model's logits are
  known to be in range: its outputs (as :func:`note_logits_width` recorded
  them) are no wider than its embedding.
- :func:`check_token_ids` raises :class:`~mlx_chatcache.errors.TokenIdError`
  naming the first bad id, its position and the valid range; host-side, no
  MLX work, one pass over the ids.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Sequence

from ..errors import TokenIdError

# names of token embeddings in mlx-lm's architectures, most common first
_EMBEDDING_NAMES = ("embed_tokens", "wte", "word_embeddings", "tok_embeddings", "token_embeddings",
                    "embed_in", "embeddings", "embedding", "embed")  # fmt: skip



@dataclass
class _Facts:
    rows: int | None  # of the token embedding
    width: int | None = None  # of the logits, once seen


_FACTS: dict[int, tuple[weakref.ref, _Facts]] = {}  # id(model) -> (model, its facts)


def _facts(model) -> _Facts:
    key = id(model)
    known = _FACTS.get(key)
    if known is not None and known[0]() is model:
        return known[1]
    facts = _Facts(_embedding_rows(model))
    with contextlib.suppress(TypeError):  # not weak-referenceable: looked up again next time
        _FACTS[key] = (weakref.ref(model, lambda _: _FACTS.pop(key, None)), facts)
    return facts


def vocab_size(model) -> int | None:
    """Rows of ``model``'s token embedding (None: not found); found once per model object."""
    return _facts(model).rows


def note_logits_width(model, width: int) -> None:
    """Record the last dimension of ``model``'s output (its logits)."""
    _facts(model).width = width


def logits_fit(model) -> bool:
    """Whether an index into ``model``'s logits is always an id it can take."""
    f = _facts(model)
    return f.rows is None or (f.width is not None and f.width <= f.rows)


def _embedding_rows(model) -> int | None:
    found = []  # (name rank, depth, rows)
    modules = model.named_modules() if hasattr(model, "named_modules") else []
    for name, module in modules:
        leaf = name.rsplit(".", 1)[-1]
        shape = getattr(getattr(module, "weight", None), "shape", None)
        if leaf in _EMBEDDING_NAMES and shape is not None and len(shape) == 2:
            found.append((_EMBEDDING_NAMES.index(leaf), name.count("."), int(shape[0])))
    if found:
        return min(found)[2]
    n = getattr(getattr(model, "args", None), "vocab_size", None)
    return n if isinstance(n, int) and n > 0 else None


def check_token_ids(model, ids: Sequence[int]) -> None:
    """Raise :class:`TokenIdError` unless every id is in ``0 .. vocab_size(model) - 1``."""
    rows = vocab_size(model)
    if rows is None or not ids:
        return
    if min(ids) >= 0 and max(ids) < rows:
        return
    i, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < rows)
    raise TokenIdError(
        f"token id {bad} (position {i} of {len(ids)}) is not one of this model's: ids go from 0 to "
        f"{rows - 1} (its vocabulary has {rows} tokens); send token ids of this model's tokenizer"
    )


__all__ = ["vocab_size", "check_token_ids", "logits_fit", "note_logits_width"]
