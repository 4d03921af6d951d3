"""OpenAI-shaped response objects: completions, stream chunks, usage, SSE lines.

``chat.completion`` / ``chat.completion.chunk`` for ``/v1/chat/completions``,
``text_completion`` for ``/v1/completions``. ``usage`` always carries
``prompt_tokens_details.cached_tokens``: the prompt tokens taken from the
prompt-cache store instead of being computed; the prompt is counted once
whatever the number of choices. The full response and the usage chunk also
carry ``mlxcc_timing`` (seconds queued behind other requests, from leaving the
queue to the first token, in all) and ``mlxcc_cache`` (``{"tokens": cached_tokens,
"tier": "memory" | "disk" | "redis" | null}``: the tier those tokens came from,
null when none did): extra fields, which OpenAI clients keep as unknown
attributes; ``usage`` stays OpenAI's.

Choices come from the worker's events (:mod:`.worker`): the ``piece`` events'
text and :class:`~.worker.TokenLogprob` entries, the ``done`` event's per-choice
finish reason (and ``content``/``tool_calls`` when the job post-processed the
text). Log-probabilities are shown as each endpoint shows them: chat
``logprobs.content[{token, logprob, bytes, top_logprobs}]``, completions
``logprobs{tokens, token_logprobs, top_logprobs, text_offset}``; ``logprobs``
is null unless the reply was made with ``logprobs=True``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Sequence

from .worker import Piece, TokenLogprob


class Reply:
    """What one request's response objects share: id, creation time, model, kind,
    and whether its choices carry log-probabilities."""

    def __init__(self, kind: str, model: str, logprobs: bool = False):
        self.kind = kind  # "chat" | "completion"
        self.model = model
        self.logprobs = logprobs
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}  # fmt: skip

    def full(self, pieces: Sequence[Piece], done: dict) -> dict:
        """The non-streamed response from every piece of every choice."""
        ends = done.get("choices") or [{"index": 0, "finish_reason": done["finish_reason"]}]
        texts: dict[int, list[str]] = {end["index"]: [] for end in ends}
        logprobs: dict[int, list[TokenLogprob]] = {end["index"]: [] for end in ends}
        for p in pieces:
            texts.setdefault(p.index, []).append(p.text)
            logprobs.setdefault(p.index, []).extend(p.logprobs)
        choices = [self._choice(end, "".join(texts[end["index"]]), logprobs[end["index"]]) for end in ends]
        obj = self._base("chat.completion" if self.kind == "chat" else "text_completion")
        return {**obj, "choices": choices, "usage": usage(done), **extras(done)}

    def _choice(self, end: dict, text: str, logprobs: list[TokenLogprob]) -> dict:
        shown = self._logprobs(logprobs)
        if self.kind != "chat":
            return {"index": end["index"], "text": text, "logprobs": shown, "finish_reason": end["finish_reason"]}
        message = {"role": "assistant", "content": end["content"] if "content" in end else text}
        if end.get("tool_calls"):
            message["tool_calls"] = end["tool_calls"]
        return {"index": end["index"], "message": message, "logprobs": shown, "finish_reason": end["finish_reason"]}

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              with_usage_field: bool = False, index: int = 0, logprobs: Sequence[TokenLogprob] | None = None,
              tool_calls: list | None = None) -> dict:  # fmt: skip
        """One streamed chunk of choice ``index``: a text delta (with the logprobs of its
        tokens), the role (a chat's first chunk), tool calls or the finish reason."""
        shown = self._logprobs(list(logprobs or ())) if logprobs is not None else None
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": shown, "finish_reason": finish}
            obj = {**self._base("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": shown, "finish_reason": finish}
            obj = {**self._base("text_completion"), "choices": [choice]}
        if with_usage_field:
            obj["usage"] = None
        return obj

    def piece_chunk(self, piece: Piece, with_usage_field: bool = False) -> dict:
        """The streamed chunk of a worker ``piece``."""
        return self.chunk(piece.text, index=piece.index, with_usage_field=with_usage_field,
                          logprobs=piece.logprobs if self.logprobs else None)  # fmt: skip

    def finish_chunks(self, done: dict, with_usage_field: bool = False) -> list[dict]:
        """The last chunk of each choice: its finish reason."""
        ends = done.get("choices") or [{"index": 0, "finish_reason": done["finish_reason"]}]
        return [self.chunk(None, e["finish_reason"], index=e["index"], with_usage_field=with_usage_field)
                for e in ends]  # fmt: skip

    def usage_chunk(self, done: dict) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(done), **extras(done)}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        """The endpoint's logprobs object for ``entries`` (None without ``logprobs``)."""
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": [{**_token(t.token, t.logprob), "top_logprobs": [_token(x, lp) for x, _, lp in t.top]}
                                for t in entries]}  # fmt: skip
        return {"tokens": [t.token for t in entries], "token_logprobs": [t.logprob for t in entries],
                "top_logprobs": [_by_text(t.top) for t in entries],
                "text_offset": [t.offset for t in entries]}  # fmt: skip


def _by_text(top: list[tuple[str, int, float]]) -> dict[str, float]:
    """Completions' ``{text: logprob}``; tokens with the same text keep the likeliest's."""
    out: dict[str, float] = {}
    for text, _, lp in top:
        out.setdefault(text, lp)
    return out


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}


def usage(done: dict) -> dict:
    p, c = done["prompt_tokens"], done["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": done["cached_tokens"]}}  # fmt: skip


def extras(done: dict) -> dict:
    """Our fields beside ``usage``: ``mlxcc_timing`` and ``mlxcc_cache`` (module doc)."""
    return {"mlxcc_timing": done.get("timing"),
            "mlxcc_cache": {"tokens": done["cached_tokens"], "tier": done.get("cached_tier")}}  # fmt: skip


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON (or ``[DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"
