"""Repairing a chat session whose cache is damaged, from the conversation its file still holds.

Contract
--------
:func:`repair_session` reads the session's header (messages, settings, window, template
arguments, stop strings, branch: :func:`~mlx_chatcache.chat.session_file.stored_session`;
the arrays are not read), renders the conversation and feeds it into a new cache once,
calling ``progress(fed, total)``, and returns the :class:`ChatSession`, ready to go on: its
cache holds every token of the conversation. The caller saves it (through the claim it
holds). A header that cannot be read, or is not a session's, raises as loading does; so
does a model other than the session's. A Ctrl-C while the conversation is fed leaves the
file as it was.
"""

from __future__ import annotations

import os
from typing import Sequence

from ..store.tiers import Tier
from .session import ChatSession
from .session_file import stored_session
from .turn import feed_prompt


def repair_session(path: str | os.PathLike, model, tokenizer, *, progress=None,
                   shared: Sequence[Tier] = ()) -> ChatSession:  # fmt: skip
    """The session at ``path`` with its cache computed again from its messages (module doc);
    ``load_notes`` says which stored settings could not be read (their defaults are used)."""
    record = stored_session(path, model)
    session = ChatSession(model, tokenizer, config=record.config, template_args=record.template_args,
                          stop=record.stop, shared=shared)  # fmt: skip
    session.messages[:] = record.state.messages
    session.branch_of, session.load_notes = record.branch_of, record.notes
    session.rebase(None, fresh=True)  # the conversation's tokens, all pending, in a cache of its window
    ids = session.tokens
    feed_prompt(model, session.state, ids, len(ids), session.config, None, progress)
    session.pending = []
    return session


__all__ = ["repair_session"]
