"""OpenAI-shaped response objects: completions, stream chunks, usage, SSE lines.

``chat.completion`` / ``chat.completion.chunk`` for ``/v1/chat/completions``,
``text_completion`` for ``/v1/completions``. ``usage`` always carries
``prompt_tokens_details.cached_tokens``: the prompt tokens taken from the
prompt-cache store instead of being computed. The full response and the
usage chunk also carry ``mlxcc_timing`` (seconds queued behind other requests,
from leaving the queue to the first token, in all) and ``mlxcc_cache``
(``{"tokens": cached_tokens, "tier": "memory" | "disk" | "redis" | null}``: the
tier those tokens came from, null when none did): extra fields, which OpenAI
clients keep as unknown attributes; ``usage`` stays OpenAI's.
"""

from __future__ import annotations

import json
import time
import uuid


class Reply:
    """What one request's response objects share: id, creation time, model, kind."""

    def __init__(self, kind: str, model: str):
        self.kind = kind  # "chat" | "completion"
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}  # fmt: skip

    def full(self, text: str, done: dict) -> dict:
        """The non-streamed response."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": done["finish_reason"]}  # fmt: skip
            obj = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done["finish_reason"]}
            obj = self._base("text_completion")
        return {**obj, "choices": [choice], "usage": usage(done), **extras(done)}

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              with_usage_field: bool = False) -> dict:  # fmt: skip
        """One streamed chunk: a text delta, the role (first chunk) or the finish reason."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            obj = {**self._base("chat.completion.chunk"),
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}  # fmt: skip
        else:
            obj = {**self._base("text_completion"),
                   "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}  # fmt: skip
        if with_usage_field:
            obj["usage"] = None
        return obj

    def usage_chunk(self, done: dict) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(done), **extras(done)}


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
