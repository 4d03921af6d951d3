"""What the HTTP layer asks of the model, without doing MLX work itself.

Contract
--------
A :class:`Service` holds the loaded model's names, its context length, the
base :class:`GenerationConfig` and the :class:`GenerationWorker`, with its
:class:`~.batch.BatchScheduler` (``max_batch`` rows decoded together).

- :meth:`Service.check_model` refuses a ``model`` the server does not serve (404);
  its names are the model's reference, its folder's name and ``served_names``
  (``--served-model-name``); ``default_model`` (mlx-lm's name) and an omitted
  ``model`` mean the served model;
- :meth:`Service.admit` is every check of a parsed request before its job is
  queued, in order: the model name, the prompt, the job's settings and hooks (below);
  it returns an :class:`Admission` or raises :class:`~.protocol.RequestError`.
  :meth:`Service.admitted` runs it on one tokenizer thread, off the event loop and
  off the worker. An ``X-Session-Id`` given with no ``prompt_cache_key`` becomes it;
  :meth:`Service.count_tokens` is the length of a request's prompt;
- preparing a request renders and tokenizes it (chat template for
  chats) and gives a :class:`Prepared`: the prompt's token ids and, for chats, the
  *boundary*: how many of them end the last message (before the generation prompt),
  how many its leading system messages make (:func:`~mlx_chatcache.generation.templates.system_end`)
  and its *marks*: where the prefix ``req.mark_messages`` (the messages up to a cache
  breakpoint) ends in the prompt (its rendering's common prefix with the prompt);
  ``tools`` reach the chat template unless ``tool_choice`` is ``"none"``;
  a token id the model does not have (a completion's ids) is a 400 here,
  before the request is queued;
- :meth:`Service.job_hooks` is what a request's ``tools``/``tool_choice`` and
  ``response_format`` add to its job: fresh grammar constraints per choice
  (:mod:`~mlx_chatcache.generation.constrain`: a JSON schema, or one forced call in the
  model's tool format, :mod:`.tools`) and the tool-call parser of its reply; what
  cannot be honoured is a 400 naming the field;
- :meth:`Service.job_config` is the request's generation settings (temperature,
  top_p, top_k, min_p, the repetition, presence and frequency penalties and their
  context, logit_bias, seed, max_tokens) over the server's defaults; a ``logit_bias``
  token id the model does not have is a 400 naming it; a prompt that leaves no room in the context, or a
  ``max_tokens`` past it, is a 400 ``context_length_exceeded`` (with ``req.clamp_max_tokens``, the
  agents' dialects, ``max_tokens`` past it is lowered to the room left);
- ``requests`` counts the requests each endpoint submitted (``/health``, ``/v1/store``);
  ``responses`` are the stored responses of ``/v1/responses`` (:mod:`.stored_responses`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import SERVER_DEFAULTS, GenerationConfig, SettingError, check_setting
from ..errors import ChatCacheError, TokenIdError, one_line, shown
from ..generation.text import encode_prompt
from ..generation.templates import has_chat_template, render_chat, system_end
from ..generation.token_ids import check_token_ids
from ..models.context import model_context_length
from ..store.store import PromptStore
from .protocol import Request, RequestError
from .tools import ToolError, forced_call_grammar, forced_choice, split_tool_calls, tool_family
from .batch import BatchScheduler
from .drain import Drain
from .metrics import ServerMetrics
from .stored_responses import StoredResponses
from .worker import GenerationWorker

DEFAULT_MODEL = "default_model"  # mlx-lm's name for the served model


@dataclass(frozen=True)
class Prepared:
    """A request's prompt ids, its boundary, its system prompt's end and its marks (module doc)."""

    prompt: list[int]
    boundary: int | None = None
    system_end: int | None = None
    marks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Admission:
    """A request the service takes: its prepared prompt, the job's settings and hooks."""

    prepared: Prepared
    config: GenerationConfig
    processors: Callable[[], list] | None
    postprocess: Callable[[str], object] | None


class Service:
    def __init__(self, model, tokenizer, model_ref: str, store: PromptStore, config: GenerationConfig,
                 max_queue: int, context_length: int | None = None, served_names: tuple[str, ...] = (),
                 max_batch: int = SERVER_DEFAULTS.max_batch):  # fmt: skip
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.model_id = Path(model_ref).name.removesuffix(".gguf") or model_ref
        self.served_names = tuple(dict.fromkeys(n for n in served_names if n != self.model_id))
        self.names = {model_ref, self.model_id, str(Path(model_ref).name), DEFAULT_MODEL, *self.served_names}
        self.context_length = context_length or model_context_length(model)
        self.worker = GenerationWorker(model, tokenizer, store, config, max_queue)
        self.batch = BatchScheduler(self.worker, max_batch)  # the worker's loop when rows can be batched
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="mlxcc-tokenize")
        self.requests: Counter[str] = Counter()  # per endpoint, the requests it submitted
        self.responses = StoredResponses.beside(store)  # /v1/responses' stored responses
        self.drain: Drain | None = None  # the app's drain and metrics (server.app.create_app)
        self.metrics: ServerMetrics | None = None

    def start(self) -> None:
        from ..generation.constrain import grammar_tokenizer

        try:  # built once per model (seconds for a large vocabulary), not during a request
            grammar_tokenizer(self.tokenizer)
        except ChatCacheError:  # no tokenizer.json: constrained requests are refused then
            pass
        self.worker.start()

    def uses_tools(self, req: Request) -> bool:
        """Whether the reply is parsed for tool calls (tools given, tool_choice not "none")."""
        return bool(req.tools) and req.tool_choice != "none"

    def job_hooks(self, req: Request):
        """``(processors, postprocess)`` for the request's :class:`~.worker.Job` (see the module docstring)."""
        from ..generation.constrain import Constraint, GrammarError, json_schema_grammar

        grammar, choice, fmt = None, None, req.response_format or {"type": "text"}
        try:
            if self.uses_tools(req) and tool_family(self.tokenizer) is None:
                raise ToolError("this model's tokenizer declares no tool-call format; drop tools", "tools")
            choice = forced_choice(req.tool_choice) if self.uses_tools(req) else None
            if choice is not None:
                if fmt["type"] != "text":
                    raise ToolError("response_format cannot be combined with a forced tool call "
                                    "(tool_choice 'required' or a function)", "response_format")  # fmt: skip
                grammar = forced_call_grammar(self.tokenizer, req.tools, choice)
            elif fmt["type"] != "text":
                spec = fmt.get("json_schema") or {}
                try:
                    grammar = json_schema_grammar(spec.get("schema", {}) if fmt["type"] == "json_schema" else None)
                except GrammarError as e:
                    raise ToolError(str(e), "response_format.json_schema.schema") from None
            if grammar is not None:
                Constraint(self.tokenizer, grammar)  # refused grammars and tokenizers fail here, not in the worker
        except ToolError as e:
            raise RequestError(400, str(e), e.param, "invalid_value") from None
        except ChatCacheError as e:
            raise RequestError(400, f"constrained decoding is not available for this model: {e}",
                               "response_format" if choice is None else "tool_choice", "invalid_value") from None  # fmt: skip
        processors = None if grammar is None else (lambda: [Constraint(self.tokenizer, grammar)])
        tools = req.tools
        postprocess = (lambda text: split_tool_calls(self.tokenizer, tools, text)) if self.uses_tools(req) else None
        return processors, postprocess

    def stop(self) -> None:
        self.worker.stop()
        self._tokenize.shutdown(wait=False, cancel_futures=True)
        self.responses.close()

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise RequestError(404, f"the model {shown(name, 80)} does not exist here; this server serves "
                               f"'{self.model_id}' (see GET /v1/models)", "model", "model_not_found")  # fmt: skip

    def admit(self, req: Request, session: str | None = None,
              key_of: Callable[[Prepared], str | None] | None = None) -> Admission:  # fmt: skip
        """Every check before the job is queued (module doc); ``session`` is the
        ``X-Session-Id`` header, ``key_of`` names the pin from the prepared prompt when
        neither the body nor the header did."""
        self.check_model(req.model)
        if req.cache_key is None and session:
            req.cache_key = session
        prepared = self._prepare(req)
        if req.cache_key is None and key_of is not None:
            req.cache_key = key_of(prepared)
        config = self.job_config(req, len(prepared.prompt))
        processors, postprocess = self.job_hooks(req)
        return Admission(prepared, config, processors, postprocess)

    async def admitted(self, req: Request, session: str | None = None,
                       key_of: Callable[[Prepared], str | None] | None = None) -> Admission:  # fmt: skip
        """:meth:`admit` on the tokenizer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize, self.admit, req, session, key_of)

    async def count_tokens(self, req: Request) -> int:
        """How many tokens ``req``'s prompt has (rendered as :meth:`admit` renders it)."""
        loop = asyncio.get_running_loop()
        return len((await loop.run_in_executor(self._tokenize, self._prepare, req)).prompt)

    def _prepare(self, req: Request) -> Prepared:
        try:
            if req.kind == "completion":
                return Prepared(self._checked(encode_prompt(self.tokenizer, req.prompt), "prompt"))
            if not has_chat_template(self.tokenizer):
                raise RequestError(400, "this model has no chat template; use /v1/completions", "messages")
            kwargs = {"tools": req.tools} if req.tools and req.tool_choice != "none" else None
            prompt = render_chat(self.tokenizer, req.messages, template_kwargs=kwargs)
            head = render_chat(self.tokenizer, req.messages, add_generation_prompt=False, template_kwargs=kwargs)
            marks = ()
            if req.mark_messages:
                part = head if req.mark_messages == req.messages else render_chat(
                    self.tokenizer, req.mark_messages, add_generation_prompt=False, template_kwargs=kwargs)  # fmt: skip
                marks = (_common_prefix(part, prompt),)
        except RequestError:
            raise
        except (ChatCacheError, ValueError, TypeError, KeyError) as e:
            param = "messages" if req.kind == "chat" else "prompt"
            raise RequestError(400, f"the prompt could not be built: {_described(e)}", param) from e
        except Exception as e:  # a chat template's own error (jinja raises its own kinds)
            raise RequestError(400, f"the chat template refused these messages: {_described(e)}", "messages") from e
        boundary = len(head) if head == prompt[: len(head)] else None
        start = system_end(self.tokenizer, req.messages, prompt, kwargs)
        return Prepared(self._checked(prompt, "messages"), boundary, start, tuple(m for m in marks if m))

    def _checked(self, ids: list[int], param: str) -> list[int]:
        try:
            check_token_ids(self.model, ids)
        except TokenIdError as e:
            raise RequestError(400, str(e), param, "invalid_value") from None
        return ids

    def job_config(self, req: Request, n_prompt: int) -> GenerationConfig:
        room = None if self.context_length is None else self.context_length - n_prompt
        chat = req.kind == "chat"
        if room is not None and room < 1:
            raise RequestError(400, f"the prompt has {n_prompt} tokens but the model's context holds "
                               f"{self.context_length}; shorten the {'conversation' if chat else 'prompt'}",
                               "messages" if chat else "prompt", "context_length_exceeded")  # fmt: skip
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = self.config.max_tokens if room is None else min(self.config.max_tokens, room)
        elif room is not None and max_tokens > room and req.clamp_max_tokens:
            max_tokens = room
        elif room is not None and max_tokens > room:
            raise RequestError(400, f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) exceed the "
                               f"model's context of {self.context_length} tokens; lower max_tokens to {room} "
                               "or shorten the prompt", "max_tokens", "context_length_exceeded")  # fmt: skip
        changes = {"max_tokens": max_tokens, "temp": req.temperature, "seed": req.seed}
        changes.update(self._sampling_changes(req))
        if req.top_p == 0.0:  # only the most likely token is left
            changes["top_k"] = 1
        elif req.top_p is not None:
            changes["top_p"] = req.top_p
        return self.config.updated(**changes)

    def _sampling_changes(self, req: Request) -> dict:
        """The request's sampling fields that are set, as GenerationConfig changes (a
        repetition_penalty of 0 is off, as in mlx-lm); a value out of its range, or a
        logit_bias id the model does not have, is a 400 naming it."""
        changes = {}
        for name in ("top_k", "min_p", "repetition_penalty", "repetition_context_size", "presence_penalty",
                     "frequency_penalty", "logit_bias", "num_draft_tokens", "prompt_lookup"):  # fmt: skip
            value = getattr(req, name, None)
            if value is None or (name == "repetition_penalty" and value == 0):  # 0: off, as in mlx-lm
                continue
            try:
                changes[name] = check_setting(name, value)
                if name == "logit_bias":
                    check_token_ids(self.model, [t for t, _ in changes[name]])
            except SettingError as e:
                raise RequestError(400, e.named, name, "invalid_value") from None
            except TokenIdError as e:
                raise RequestError(400, f"logit_bias: {e}", name, "invalid_value") from None
        return changes


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _described(e: BaseException) -> str:
    """``e``'s message on one line (its class name when it has none), at most 300 characters."""
    return one_line(str(e), 300) or type(e).__name__
