"""A multi-turn chat whose history is never fed to the model twice.

:class:`ChatSession` holds the conversation (``messages``), a prompt cache with
the exact token ids it has been fed (a :class:`~mlx_chatcache.files.prompt_cache.PromptCache`),
the settings (a :class:`GenerationConfig`) and per-turn checkpoints. This
module decides what each turn feeds and keeps; the model work of a turn
(feeding and streaming that stop on request, statistics) is in
:mod:`mlx_chatcache.chat.turn`.

How a turn is built
-------------------
Every turn renders the WHOLE conversation with the tokenizer's chat template. When
the text the session holds (``self.text``: every earlier prompt and reply, exactly
as fed or generated) is a prefix of that rendering, the prompt is the held token
ids followed by the encoding of the rest, so reply tokens stay in the cache exactly
as generated. Otherwise (a template that rewrites history, e.g. drops an earlier
reply's reasoning) the prompt keeps the longest run of held tokens whose decoded
text starts the rendering, :func:`~mlx_chatcache.generation.prompt.reuse_prefix`
trims the cache to it, and a cache that cannot be trimmed restarts from the latest
checkpoint inside it. The generate loop never feeds the last token it yields: after
a reply ``r1..rn`` the cache holds all but ``rn``, which waits in ``pending``. The
session's full token sequence is ``state.tokens + pending``.

Undo, retry and changes under the cache
---------------------------------------
At the start of each turn the session records a
:class:`~mlx_chatcache.chat.checkpoints.Checkpoint` (lengths, and copies of the layers
that may not trim back); undo, retry and a failed or cancelled turn roll back to it
without feeding a history token again (:mod:`mlx_chatcache.chat.checkpoints`). Copies
are kept for the last ``max_checkpoints`` turns, and a session file keeps the newest up
to :data:`~mlx_chatcache.config.SESSION_CHECKPOINT_BYTES`. A change before the end of
the conversation (a new system prompt or template arguments, ``/clear``, a rollback
past the kept copies) keeps the held tokens that still stand for the same text, the
history's as they were generated (:mod:`mlx_chatcache.chat.held`), and the cache keeps
its common start with them; the rest waits in ``pending``, and the tokens of it the
model had read count as recomputed when the next turn feeds them.

Bounded memory
--------------
With ``config.max_kv_size`` the full-attention layers use a rotating window of
that many tokens that pins the first ``keep`` tokens: ``keep`` is the token
count of the rendered system prompt, so the model always sees it.

Files and the store
-------------------
:meth:`ChatSession.save` writes the session to one cache file, atomically
(:mod:`mlx_chatcache.chat.session_file`: layout, names, lock);
:meth:`ChatSession.load` reads it back and refuses a session made with another
model; :meth:`ChatSession.from_prompt_cache` starts a new chat from a prebuilt chat
cache (``mlxcc cache-prompt``), reusing every held token that matches. ``shared``
tiers (``--cache-dir``: the store's disk tier, :mod:`mlx_chatcache.store`) get the
cache on every save, and a turn that starts with an empty cache starts from their
longest prefix of its prompt. A new conversation's first turn feeds its rendered
system prompt first and keeps its checkpoint there; the shared tiers get that cache
too when it cannot trim back, so every new chat with that system prompt starts from it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from typing import Mapping, Sequence

from ..cache import CacheList, can_trim_prompt_cache, prompt_cache_nbytes
from .turn import (
    Reply,
    StopCheck,
    TextCallback,
    TurnCancelled,
    TurnResult,
    TurnStats,
    feed_prompt,
    stream_reply,
    turn_stats,
)
from .checkpoints import Checkpoint, RollbackResult
from ..config import (DEFAULT_MAX_CHECKPOINTS, DEFAULTS, SEED_LIMIT, GenerationConfig, SettingError, check_config,
                      check_setting)
from ..errors import SessionError, UsageError
from ..files.tokens import common_prefix_len
from ..files.prompt_cache import PromptCache
from ..generation.prompt import reuse_prefix, trim_state
from ..generation.templates import chat_text, encode_text, has_chat_template, history_start, pinned_head, system_end
from ..generation.checkout import scope_of, store_draft_tokens
from ..generation.text import as_tokenizer_wrapper
from ..models.context import check_prompt_fits, context_warning
from .held import Spans, carried, clipped, held_prefix, merged, overlap, rebased
from .rollback import SessionRollback
from .session_file import SessionRecord, kept_copies, load_session, save_session
from ..store.store import PromptStore
from ..store.store import Scope
from ..store.tiers import Tier

MIN_WINDOW = 8  # tokens a rotating window must hold beyond the pinned system prompt


class ChatSession(SessionRollback):
    """A chat with a model whose cache follows the conversation (see module doc)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        system_prompt: str | None = None,
        config: GenerationConfig = DEFAULTS,
        max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS,
        shared: Sequence[Tier] = (),
        template_args: dict | None = None,
        stop: Sequence[str] = (),
    ):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.template_args, self.stop = template_args or None, tuple(stop)
        self._setup(model, tokenizer, config, max_checkpoints, messages, shared)
        self.state = self._new_state()
        self.pending: list[int] = []
        self.text = ""
        self.checkpoints: list[Checkpoint] = []
        self.reread: Spans = []  # the pending tokens the model had read before (chat.held)
        self.attempt = 0  # retries of the last turn (offsets the seed)
        self.load_notes: list[str] = []  # what loading the session's file dropped (see load)

    def _setup(self, model, tokenizer, config: GenerationConfig, max_checkpoints: int, messages: list[dict],
               shared: Sequence[Tier]) -> None:  # fmt: skip
        """What a new and a loaded session set up alike (the rest comes from a file or starts empty)."""
        self.model = model
        # shared store tiers (--cache-dir): only for models with a fingerprint (caches name their model)
        self.shared = PromptStore(list(shared) if getattr(model, "fingerprint", None) is not None else [],
                                  draft_tokens=store_draft_tokens(config))  # fmt: skip
        self.tokenizer = as_tokenizer_wrapper(tokenizer)
        try:
            self.config = check_config(config)
        except SettingError as e:
            raise UsageError(e.named) from None
        self.max_checkpoints = max_checkpoints
        self.messages = messages
        self._check_template()
        self.last_stats: TurnStats | None = None
        self.totals = TurnStats()
        self.turns_run = 0  # turns generated by this object (not loaded ones)
        self.progress = None  # called with (fed, to feed) while a turn's prompt is fed (a progress bar)
        self._near_limit = False  # the last turn was past the context warning's line (warned once)
        self.branch_of: dict | None = None  # the session this one was branched from (saved with it)

    # ------------------------------------------------------------ properties
    @property
    def system_prompt(self) -> str | None:
        if self.messages and self.messages[0]["role"] == "system":
            return self.messages[0]["content"]
        return None

    @property
    def tokens(self) -> list[int]:
        """Every token of the conversation so far (cached ones + ``pending``)."""
        return self.state.tokens + self.pending

    @property
    def num_turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "assistant")

    @property
    def cached_tokens(self) -> int:
        return len(self.state.tokens)

    @property
    def fingerprint(self):
        return getattr(self.model, "fingerprint", None)

    # ------------------------------------------------------------ template
    def _check_template(self) -> None:
        if not has_chat_template(self.tokenizer):
            raise SessionError(
                "this model's tokenizer has no chat template, so it cannot chat; "
                "use an instruction-tuned model (or 'mlxcc generate' for plain text)"
            )

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        try:
            return chat_text(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                             template_kwargs=self.template_args)  # fmt: skip
        except Exception as e:  # jinja errors: a template that rejects this conversation
            raise SessionError(f"the chat template failed on this conversation: {type(e).__name__}: {e}") from e

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def pinned_tokens(self) -> int:
        """Tokens a rotating window pins: the rendered system prompt (see module doc)."""
        try:
            return pinned_head(self.tokenizer, self.messages[:1] if self.system_prompt is not None else [],
                               self.template_args)  # fmt: skip
        except Exception as e:  # jinja errors: a template that rejects this conversation
            raise SessionError(f"the chat template failed on this conversation: {type(e).__name__}: {e}") from e

    def _new_state(self) -> PromptCache:
        size = self.config.max_kv_size
        if size is None:
            return PromptCache.new(self.model, self.config.shape)
        keep = self.pinned_tokens()
        if keep + MIN_WINDOW > size:
            raise SessionError(
                f"the system prompt takes {keep} tokens but --max-kv-size is {size}; the window "
                f"must hold it plus at least {MIN_WINDOW} tokens: use --max-kv-size "
                f">= {keep + MIN_WINDOW} (much larger in practice) or a shorter system prompt"
            )
        return PromptCache.new(self.model, dataclasses.replace(self.config.shape, keep=keep))

    def _call_config(self) -> GenerationConfig:
        seed = self.config.seed
        return dataclasses.replace(self.config.windowed(self.state.shape),
                                   seed=None if seed is None else (seed + self.attempt) % SEED_LIMIT)  # fmt: skip

    # ------------------------------------------------------------ turns
    def prompt_tokens(self, prompt_text: str) -> list[int]:
        """The prompt for ``prompt_text``: held tokens + the encoded rest (see module doc)."""
        return self._split_prompt(prompt_text)[0]

    def _split_prompt(self, prompt_text: str) -> tuple[list[int], int, int]:
        """``(ids, k, n_text)``: ``ids`` starts with the first ``k`` held tokens,
        unchanged, standing for ``prompt_text[:n_text]``; the rest encodes the
        remaining text. ``k`` is every held token unless history was rewritten."""
        held = self.tokens
        if self.text and prompt_text.startswith(self.text) and len(prompt_text) > len(self.text):
            k, n_text = len(held), len(self.text)
        else:
            k, n_text = held_prefix(self.tokenizer.decode, held, prompt_text)
            if n_text >= len(prompt_text):  # keep at least one token to feed
                k, n_text = 0, 0
        return held[:k] + self.encode(prompt_text[n_text:]), k, n_text

    def ask(
        self, content: str, on_text: TextCallback | None = None, should_stop: StopCheck | None = None
    ) -> TurnResult:
        """Send a user message; stream the reply through ``on_text``.

        ``should_stop`` is polled between the prompt's model calls (then sized
        to take under a second, see :mod:`mlx_chatcache.generation.pacing`: a stop there
        cancels the turn, ``finish_reason == "cancelled"``) and after every
        token; when it returns True during the reply the reply ends there
        (``finish_reason == "interrupted"``) and what was generated so far
        stays in the conversation and the cache.
        """
        if not isinstance(content, str):
            raise UsageError("a chat message must be text")
        self.attempt = 0
        return self._turn(content, on_text, should_stop)

    def _turn(self, content, on_text, should_stop) -> TurnResult:
        self._push_checkpoint()
        self.messages.append({"role": "user", "content": content})
        held = self.tokens
        try:
            return self._generate(held, on_text, should_stop)
        except TurnCancelled:  # stopped while reading the prompt: as if never sent
            self._rewind(self.checkpoints.pop(), held)
            if not self.state.tokens:  # nothing held: the arrays the prompt filled go
                self.state.reset(self.model)
            return TurnResult("", TurnStats(finish_reason="cancelled"))
        except BaseException:  # back to the turn's start (the cache may have been reset)
            self._rewind(self.checkpoints.pop(), held)
            raise

    def _generate(self, held: list[int], on_text, should_stop) -> TurnResult:
        started = time.perf_counter()
        prompt_text = self.render(self.messages, add_generation_prompt=True)
        prompt_ids, k, n_text = self._split_prompt(prompt_text)
        check_prompt_fits(self.model, len(prompt_ids), self.state.shape.max_kv_size, "the conversation",
                          "nothing was sent: send a shorter message, /undo or /clear to "
                          "shorten the conversation, or start a new chat with --max-kv-size N")  # fmt: skip
        common = common_prefix_len(self.state.tokens, prompt_ids)  # what the cache could give
        read = [(0, common), *clipped(self.reread, 0, k)]  # prompt positions the model has read before
        if not self.state.tokens and self.shared.tiers:
            self._checkout_shared(prompt_ids)
        reused = None
        if k < len(held):
            reused = self._history_rewritten(prompt_ids, k, prompt_text, n_text, should_stop)
        trimmed_to = reuse_prefix(self.state, prompt_ids, self.model)
        reused = trimmed_to if reused is None else reused
        if self.num_turns == 0:  # a new conversation: its system prompt gets a checkpoint of its own
            self._checkpoint_system_head(prompt_ids, prompt_text, should_stop)
        # feed the prompt here, chunk by chunk, so that a stop request is honoured
        # between chunks; the generate loop then feeds only the last prompt token
        feed_prompt(self.model, self.state, prompt_ids, len(prompt_ids) - 1, self.config, should_stop, self.progress)
        reply = stream_reply(
            self.model, self.tokenizer, prompt_ids, self.state, self._call_config(), started, on_text, should_stop,
            self.stop, draft_index=self.shared.draft_index(self.scope),
        )
        self._keep_reply(prompt_ids, prompt_text, reply)
        stats = turn_stats(prompt_ids, reused, overlap(read, reused, len(prompt_ids)), reply, started)
        self.last_stats = stats
        self.turns_run += 1
        self.totals.add(stats)
        near = context_warning(self.model, len(prompt_ids) + self.config.max_tokens, len(self.tokens),
                               self.state.shape.max_kv_size)  # fmt: skip
        warning, self._near_limit = (None if self._near_limit else near), near is not None
        return TurnResult(reply.text, stats, warning)

    def _checkout_shared(self, prompt_ids: list[int]) -> None:
        """An empty cache (a new session, or one whose cache could not keep a common
        start) starts from the shared tiers' longest prefix of the prompt."""
        state, tier = self.shared.checkout(self.scope, self.model, prompt_ids, self.state.shape)
        if tier is not None:
            self.state = state

    @property
    def scope(self) -> Scope:
        """The store scope of this session's caches (model, window, KV settings, weight policy)."""
        return scope_of(self.fingerprint, self._call_config(), self.state.settings.get("weights"))

    def _keep_reply(self, prompt_ids: list[int], prompt_text: str, reply: Reply) -> None:
        """Add the reply to the conversation; the next turn feeds its last token first."""
        stop_text = ""
        if reply.last.finish_reason == "stop":
            stop_text = self.tokenizer.decode([reply.last.token])
        self.reread = []
        if self.state.tokens == prompt_ids + reply.tokens[:-1]:
            self.pending = [reply.tokens[-1]]
            # cut at a stop string: the tokens say more than the reply (next turn matches them by decoding)
            self.text = "" if reply.cut else prompt_text + reply.text + stop_text
        else:  # not the documented state: fall back to re-rendering next turn
            self.pending, self.text = [], ""
            self.checkpoints.clear()
        self.messages.append({"role": "assistant", "content": reply.text})

    # ------------------------------------------------------------ rollback
    def undo(self) -> RollbackResult:
        """Drop the last exchange (user message and reply) without re-prefilling."""
        result = self._rollback_last()
        self.attempt = 0
        return result

    def retry(
        self, on_text: TextCallback | None = None, should_stop: StopCheck | None = None
    ) -> TurnResult:
        """Generate the last reply again (with ``seed``: seed + number of retries)."""
        i = self._last_exchange()
        content = self.messages[i]["content"]
        attempt = self.attempt + 1
        self._rollback_last()
        self.attempt = attempt
        return self._turn(content, on_text, should_stop)

    # ------------------------------------------------------------ settings
    def set_system_prompt(self, text: str | None) -> None:
        """Replace the system prompt. History stays: its held tokens wait in ``pending``
        behind the new system prompt, and the cache keeps the common start
        (:meth:`rebase`); the next turn feeds the rest."""
        text = text or None
        if text == self.system_prompt:
            return
        old = self._rendered()
        keep = self.state.shape.keep
        if self.system_prompt is not None:
            self.messages.pop(0)
        if text is not None:
            self.messages.insert(0, {"role": "system", "content": text})
        self.rebase(old, fresh=self.config.max_kv_size is not None and self.pinned_tokens() != keep)

    def set_template_args(self, args: dict | None) -> None:
        """Replace the chat template's extra arguments; the conversation is rendered again
        and the cache keeps the common start (:meth:`rebase`)."""
        if (args or None) != self.template_args:
            old = self._rendered()
            self.template_args = args or None
            self.rebase(old, fresh=self.config.max_kv_size is not None)

    def clear(self) -> None:
        """Forget the conversation; the system prompt stays, and so does the cache's part of it."""
        self.messages = self.messages[:1] if self.system_prompt is not None else []
        self.rebase(None)
        self.attempt = 0

    def _rendered(self) -> tuple[str, int]:
        """The conversation as a prompt ends it (no generation prompt; "" when empty), and
        where the messages after its system prompt start in it."""
        text = self.render(self.messages, add_generation_prompt=False) if self.messages else ""
        return text, history_start(self.tokenizer, self.messages, text, self.template_args)

    def rebase(self, old: tuple[str, int] | None, fresh: bool = False) -> None:
        """Hold the tokens of the conversation rendered now (:func:`~mlx_chatcache.chat.held.rebased`;
        ``old``: its rendering before the change). The cache keeps its common start with them
        (``fresh``: a new cache, for a window that pins another count); ``pending`` the rest,
        ``reread`` the positions among those the model had read. Checkpoints go."""
        held = self.tokens
        ids, text, moved = rebased(self.tokenizer.decode, self.encode, held, self.text, old, self._rendered()[0])
        read = carried(merged([(0, len(self.state.tokens)), *self.reread]), held, ids, moved)
        keep = 0 if fresh else common_prefix_len(self.state.tokens, ids)
        if fresh or not trim_state(self.state, keep):
            self.state = self._new_state()
            keep = 0
        self.pending, self.text, self.reread = ids[keep:], text, clipped(read, keep, len(ids))
        self.checkpoints.clear()

    def update_settings(self, changes: Mapping[str, object]) -> None:
        """Change sampling settings (``{"temp": 0.5, ...}``; not the cache shape); a
        value outside its range (:data:`~mlx_chatcache.config.RANGES`) is a UsageError."""
        if "max_kv_size" in changes or "keep" in changes:
            raise UsageError("the cache window cannot change during a chat; start a new session")
        try:
            checked = {k: check_setting(k, v) for k, v in changes.items()}
        except SettingError as e:
            raise UsageError(e.named) from None
        self.config = dataclasses.replace(self.config, **checked)

    # ------------------------------------------------------------ info
    def cache_info(self) -> dict:
        def names(c):
            return f"CacheList({', '.join(map(names, c.caches))})" if isinstance(c, CacheList) else type(c).__name__

        return {
            "cached_tokens": len(self.state.tokens),
            "pending_tokens": len(self.pending),
            "reread_tokens": overlap(self.reread, 0, len(self.tokens)),
            "nbytes": prompt_cache_nbytes(self.state.cache),
            "layers": dict(Counter(map(names, self.state.cache))),
            "trimmable": can_trim_prompt_cache(self.state.cache),
            "max_kv_size": self.state.shape.max_kv_size,
            "keep": self.state.shape.keep if self.state.shape.max_kv_size else None,
            "checkpoints": len(self.checkpoints),
            "checkpoint_copies": sum(1 for c in self.checkpoints if c.cache is not None),
            "saved_copies": [prompt_cache_nbytes([x for x in c if x is not None])
                             for c in kept_copies(self.checkpoints)[0]],  # fmt: skip
        }

    # ------------------------------------------------------------ files
    def record(self) -> SessionRecord:
        """What a session file holds of this session (shares its lists and cache)."""
        state = dataclasses.replace(self.state, messages=self.messages, text=None)  # the cache as a chat's
        return SessionRecord(state, self.config, self.pending, self.text, self.checkpoints, self.attempt,
                             getattr(self.model, "source", None), branch_of=self.branch_of,
                             template_args=self.template_args, stop=self.stop, reread=self.reread)  # fmt: skip

    def save(self, path: str | os.PathLike | None) -> list[str]:
        """Write the session to ``path`` atomically (a previous file survives any failure;
        None: no file), and put its cache into the shared tiers. Returns one line for each
        shared tier that could not take the cache (the file was written)."""
        start = system_end(self.tokenizer, self.messages, self.state.tokens, self.template_args)
        return save_session(path, self.record(), self.fingerprint, self.shared, ends=(start,) if start else ())

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        model,
        tokenizer,
        *,
        overrides: dict | None = None,
        max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS,
        shared: Sequence[Tier] = (),
    ) -> "ChatSession":
        """The session saved at ``path``; ``overrides`` change sampling settings;
        ``shared``: store tiers as for a new session. A saved setting out of its range
        is dropped (the default is used): ``load_notes`` has one line for each."""
        record = load_session(path, model, overrides)
        self = cls.__new__(cls)
        self.template_args, self.stop = record.template_args, record.stop
        self._setup(model, tokenizer, record.config, max_checkpoints, record.state.messages, shared)
        self.state, self.pending, self.text = record.state, record.pending, record.text
        self.checkpoints, self.attempt = record.checkpoints, record.attempt
        self.load_notes, self.branch_of = record.notes, record.branch_of
        self.reread = clipped(record.reread, len(self.state.tokens), len(self.tokens))
        return self

    @classmethod
    def from_prompt_cache(
        cls,
        model,
        tokenizer,
        prompt: PromptCache,
        *,
        config: GenerationConfig = DEFAULTS,
        max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS,
        shared: Sequence[Tier] = (),
    ) -> "ChatSession":
        """A new chat that continues the messages of ``prompt`` (a chat cache, e.g. made
        by ``mlxcc cache-prompt``) and holds it as its cache, so its first turn feeds only
        the new tokens. ``prompt`` keeps its window shape; ``config`` gives the settings."""
        if prompt.messages is None:
            raise UsageError("a chat starts only from a chat cache (messages, not raw text)")
        self = cls.__new__(cls)
        self.template_args, self.stop = None, ()
        self._setup(model, tokenizer, config, max_checkpoints, [dict(m) for m in prompt.messages], shared)
        self.state, self.pending, self.checkpoints, self.attempt, self.reread = prompt, [], [], 0, []
        text = self.render(self.messages, add_generation_prompt=False) if self.messages else ""
        # the held text is known only when the tokens are its encoding (else turns match held tokens by decoding)
        self.text = text if text and self.encode(text) == prompt.tokens else ""
        return self


__all__ = ["ChatSession", "TurnStats", "TurnResult", "Checkpoint", "RollbackResult"]
