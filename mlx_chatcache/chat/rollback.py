"""How a :class:`~mlx_chatcache.chat.session.ChatSession` rolls back: the turn checkpoints it records,
what it keeps when a template rewrites history, rewinding to a checkpoint, and editing an
earlier message (a rollback to that message's turn, then the turn again with the new text).

:class:`SessionRollback` is a base class of ``ChatSession`` and works on its attributes (``model``,
``config``, ``messages``, ``state``, ``pending``, ``text``, ``checkpoints``, ``tokens``); the
checkpoint data and the cache-level restore are in :mod:`mlx_chatcache.chat.checkpoints`, the rules
in the docstring of :mod:`mlx_chatcache.chat.session` ("Undo and retry").
"""

from __future__ import annotations

import dataclasses

from ..cache import can_trim_prompt_cache
from ..errors import SessionError, UsageError
from .turn import StopCheck, TextCallback, TurnResult, feed_prompt
from .checkpoints import Checkpoint, RollbackResult, drop_old_copies, restore, rewind_cache, snapshot
from .held import Spans, clipped, merged, overlap


class SessionRollback:
    """Checkpoints and rollback of a chat session (see module doc)."""

    def _push_checkpoint(self) -> None:
        self.checkpoints.append(
            Checkpoint(len(self.messages), len(self.tokens), len(self.state.tokens), len(self.text),
                       snapshot(self.state.cache), list(self.reread))
        )  # fmt: skip
        drop_old_copies(self.checkpoints, self.max_checkpoints)

    def _history_rewritten(
        self, prompt_ids: list[int], k: int, prompt_text: str, n_text: int, should_stop: StopCheck | None
    ) -> int | None:
        """The template changed history from held token ``k`` on (e.g. it drops
        an earlier reply's reasoning); ``prompt_ids[:k]`` are the held tokens
        kept. Keep the checkpoints inside that prefix. An untrimmable cache
        restarts from the latest copy among them and is fed up to ``k`` (all
        but the last), then copied again, so this turn keeps a checkpoint too.
        Returns the tokens reused from that copy (None when the cache is left
        to ``reuse_prefix``)."""
        turn = self.checkpoints.pop()  # this turn's: its lengths no longer apply
        kept = [c for c in self.checkpoints if c.n_tokens <= k and prompt_text.startswith(self.text[: c.n_text])]
        self.checkpoints[:] = kept
        self.text = prompt_text[:n_text]
        restored = None
        if len(self.state.tokens) > k and not can_trim_prompt_cache(self.state.cache):
            for c in reversed(kept):
                if c.cache is not None and restore(self.state, c.cache, c.state_len, prompt_ids):
                    restored = c
                    break
        if restored is None:
            state_len = min(k, len(self.state.tokens))
            self.checkpoints.append(Checkpoint(turn.n_messages, k, state_len, n_text, None,
                                               clipped(turn.reread, state_len, k)))  # fmt: skip
            return None
        self.checkpoints.append(Checkpoint(turn.n_messages, k, restored.state_len, n_text, restored.cache,
                                           merged([(restored.state_len, k), *clipped(turn.reread, 0, k)])))  # fmt: skip
        feed_prompt(self.model, self.state, prompt_ids, k - 1, self.config, should_stop)
        copies = snapshot(self.state.cache)
        self.checkpoints[-1] = Checkpoint(turn.n_messages, k, len(self.state.tokens), n_text, copies,
                                          clipped(turn.reread, len(self.state.tokens), k))  # fmt: skip
        return restored.state_len

    def _checkpoint_system_head(self, prompt_ids: list[int], prompt_text: str, should_stop: StopCheck | None) -> None:
        """The first turn of a chat with a system prompt, on a session holding at most the
        rendered system prompt (the head): feed the head first and move this turn's
        checkpoint there, so rolling the first turn back keeps the system prompt. When
        the head was fed here and the cache cannot trim back, the shared tiers get it:
        an entry whose tokens are exactly a prefix of every chat with that system prompt."""
        ck = self.checkpoints[-1] if self.checkpoints else None
        if self.system_prompt is None or ck is None:
            return
        head_text = self.render(self.messages[:1], add_generation_prompt=False)
        head = self.encode(head_text)
        n, had = len(head), len(self.state.tokens)
        if not (0 < n < len(prompt_ids) - 1 and ck.n_tokens <= n and had <= n and prompt_ids[:n] == head
                and prompt_text.startswith(head_text)):  # fmt: skip
            return
        feed_prompt(self.model, self.state, prompt_ids, n, self.config, should_stop)
        self.checkpoints[-1] = Checkpoint(ck.n_messages, n, n, len(head_text), snapshot(self.state.cache))
        if had < n and self.shared.tiers and not all(c.always_trimmable() for c in self.state.cache):
            # best effort: a tier that fails is reported when the session is saved
            self.shared.put(self.scope, self.state.tokens, self.state.cache, on_error=lambda tier, e: None)

    def _rewind(self, ck: Checkpoint, tokens: list[int] | None = None) -> RollbackResult:
        """Make messages, tokens, text and cache what they were at ``ck``.
        ``tokens``: the session's tokens (default ``self.tokens``; a failed turn
        passes those it started with, since the cache may have been reset)."""
        tokens = self.tokens if tokens is None else tokens
        del self.messages[ck.n_messages:]
        self.text = self.text[: ck.n_text]
        self.pending = tokens[ck.state_len : ck.n_tokens]
        self.reread = list(ck.reread)
        how = rewind_cache(self.state, ck, tokens)
        if how is not None:
            return RollbackResult(how)
        # cannot roll back: start a fresh cache; the next turn feeds the history again, as it was
        self.state.reset(self.model)
        self.pending = tokens[: ck.n_tokens]
        self.reread = merged([(0, min(ck.state_len, len(tokens))), *ck.reread])
        self.checkpoints.clear()
        return RollbackResult("recompute", overlap(self.reread, 0, ck.n_tokens))

    def _last_exchange(self) -> int:
        """Index of the last user message (SessionError if there is none)."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i]["role"] == "user":
                return i
        raise SessionError("there is no exchange to undo or retry yet; send a message first")

    def _rollback_last(self) -> RollbackResult:
        return self._rollback_to(self._last_exchange())

    def _rollback_to(self, i: int) -> RollbackResult:
        """Drop ``messages[i:]`` (``i``: a user message) and roll the cache back to
        the start of that turn: from its checkpoint when there is one (trim or
        copies), else the next turn re-renders the conversation."""
        while self.checkpoints and self.checkpoints[-1].n_messages > i:
            self.checkpoints.pop()
        if self.checkpoints and self.checkpoints[-1].n_messages == i:
            return self._rewind(self.checkpoints.pop())
        # no checkpoint for that turn (history was rewritten since): the conversation is
        # rendered again; the cache keeps its common start
        del self.messages[i:]
        trimmable = can_trim_prompt_cache(self.state.cache)
        self.rebase(None)
        return RollbackResult("rerender" if trimmable else "recompute", overlap(self.reread, 0, len(self.tokens)))

    def user_message_index(self, n: int | None) -> int:
        """Index in ``messages`` of user message ``n`` (1-based; None: the last);
        a UsageError names the valid numbers."""
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        if not users:
            raise SessionError("there is no message to edit yet; send a message first")
        if n is None:
            return users[-1]
        if type(n) is not int or not 1 <= n <= len(users):
            raise UsageError(f"there is no user message {n}: this chat has {len(users)} "
                             f"(1 is the first, {len(users)} the last; /history numbers them)")  # fmt: skip
        return users[n - 1]

    def edit(
        self, n: int | None, content: str, on_text: TextCallback | None = None, should_stop: StopCheck | None = None
    ) -> TurnResult:
        """Replace user message ``n`` (1-based; None: the last) with ``content`` and
        generate its reply again; the messages after it are dropped. The cache rolls
        back to the start of that turn as ``undo`` does, so the turn feeds only the
        new message's tokens (unless that turn's checkpoint is gone: then as after a
        rollback that could not trim). The reply is the one a new chat with the same
        messages would give.

        A turn that is cancelled (``finish_reason == "cancelled"``) or raises leaves
        the conversation as it was before the edit; the tokens after the edit point
        are then fed again on the next turn (``pending``), which a caller with a saved
        copy of the session avoids by loading it again."""
        if not isinstance(content, str):
            raise UsageError("a chat message must be text")
        i = self.user_message_index(n)
        before = ([dict(m) for m in self.messages], self.text, self.tokens,
                  [dataclasses.replace(c) for c in self.checkpoints],
                  merged([(0, len(self.state.tokens)), *self.reread]))  # fmt: skip
        self._rollback_to(i)
        self.attempt = 0
        try:
            result = self._turn(content, on_text, should_stop)
        except BaseException:
            self._restore(*before)
            raise
        if result.stats.finish_reason == "cancelled":
            self._restore(*before)
        return result

    def _restore(self, messages: list[dict], text: str, tokens: list[int], checkpoints: list[Checkpoint],
                 read: Spans) -> None:  # fmt: skip
        """The conversation before a failed edit: the cache keeps the history up to
        the edit point and the tokens after it wait in ``pending`` (fed, exactly as
        they were, on the next turn; ``read``: the positions the model had read)."""
        if self.state.tokens != tokens[: len(self.state.tokens)]:
            self.state.reset(self.model)
        self.messages[:] = messages
        self.text, self.pending = text, tokens[len(self.state.tokens) :]
        self.reread = clipped(read, len(self.state.tokens), len(tokens))
        self.checkpoints[:] = checkpoints
