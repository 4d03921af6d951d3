"""``mlxcc serve`` on caches that cannot be trimmed back (convolution + attention,
pure SSM): the message-boundary checkpoint serves a retry, the whole previous
turn serves the next one, and greedy output matches a server without a store.
One short real-model conversation (SmolLM2) checks the same on a real template."""

from __future__ import annotations

import pytest

import openai

from server_process import ServerProcess  # noqa: E402

from mlx_chatcache.files.tokens import common_prefix_len  # noqa: E402
from mlx_chatcache.generation.text import stream_generate  # noqa: E402
from mlx_chatcache.models.loading import load  # noqa: E402
from mlx_chatcache.generation.templates import render_chat  # noqa: E402

MAX_TOKENS = 10
TURN1 = [{"role": "user", "content": "Explain why the sky looks blue during the day."}]


def ask(server, messages, max_tokens=MAX_TOKENS):
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)
    r = c.chat.completions.create(model=server.model_id, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def reply_ids(model, tokenizer, messages, max_tokens=MAX_TOKENS):
    return [r.token for r in stream_generate(model, tokenizer, render_chat(tokenizer, messages),
                                             config=_config(max_tokens))]  # fmt: skip


def _config(n):
    from mlx_chatcache.config import DEFAULTS

    return DEFAULTS.updated(max_tokens=n)


@pytest.mark.parametrize("kind", ["hybrid", "ssm"])
def test_untrimmable_caches_reuse_turns_and_checkpoints(tiny_model_dirs, tmp_path, kind):
    folder = tiny_model_dirs[kind]
    model, tokenizer = load(str(folder))
    p1 = render_chat(tokenizer, TURN1)
    head1 = render_chat(tokenizer, TURN1, add_generation_prompt=False)
    with ServerProcess(folder, tmp_path) as s:
        text1, u1 = ask(s, TURN1)
        _, retry = ask(s, TURN1)  # the reply's cache cannot be trimmed back: the checkpoint serves
        assert retry.prompt_tokens_details.cached_tokens == len(head1) < len(p1)
        turn2 = TURN1 + [{"role": "assistant", "content": text1}, {"role": "user", "content": "Shorter."}]
        text2, u2 = ask(s, turn2)
    held = p1 + reply_ids(model, tokenizer, TURN1)[:-1]
    p2 = render_chat(tokenizer, turn2)
    want = len(held) if common_prefix_len(held, p2[:-1]) == len(held) else len(head1)
    assert u2.prompt_tokens_details.cached_tokens == want
    with ServerProcess(folder, None, "--cache-bytes", "0", "--disk-cache-bytes", "0") as cold:
        assert ask(cold, turn2)[0] == text2


@pytest.mark.real_model
def test_smollm2_two_turns(demo_gguf, tmp_path):
    with ServerProcess(demo_gguf, tmp_path, start_timeout=180) as s:
        assert s.model_id == "SmolLM2-135M-Instruct.Q4_1"
        msgs = [{"role": "user", "content": "Name one river in France."}]
        text1, u1 = ask(s, msgs, max_tokens=16)
        assert text1.strip()
        turn2 = msgs + [{"role": "assistant", "content": text1}, {"role": "user", "content": "And in Italy?"}]
        text2, u2 = ask(s, turn2, max_tokens=16)
    # the reply is cached except its last token (never fed) when it re-encodes to the same ids;
    # never more than that
    cached = u2.prompt_tokens_details.cached_tokens
    assert u1.prompt_tokens < cached <= u1.prompt_tokens + u1.completion_tokens - 1
    model, tokenizer = load(demo_gguf)  # the same turn without any store, in this process
    cold = "".join(r.text for r in stream_generate(model, tokenizer, render_chat(tokenizer, turn2), config=_config(16)))
    assert cold == text2
