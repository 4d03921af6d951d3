"""Token ids a model does not have never reach it: the library raises TokenIdError
(one line naming the id and the valid range) and leaves the prompt cache as it
was; ``mlxcc serve`` answers 400 before queuing and keeps serving.

The valid range is the model's embedding rows, found for float and quantized
embeddings; ids drawn by the package's own sampler are not waited for.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_chatcache.cache import cache_offset, make_prompt_cache
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.errors import ChatCacheError, TokenIdError
from mlx_chatcache.generation.loop import generate_step
from mlx_chatcache.generation.model_call import call_model
from mlx_chatcache.files.prompt_cache import PromptCache
from mlx_chatcache.generation.text import generate
from mlx_chatcache.generation.token_ids import check_token_ids, logits_fit, vocab_size
from tiny_models import VOCAB_SIZE

CONFIG = DEFAULTS.updated(max_tokens=4, temp=0.0)


@pytest.mark.parametrize("bad", [VOCAB_SIZE, VOCAB_SIZE + 1, 60000, -1])
@pytest.mark.parametrize("kind", ["llama", "hybrid"])  # a trimmable cache, and one that is not
def test_generate_refuses_an_id_the_model_does_not_have_and_keeps_the_cache(kind, bad, make_tiny_model):
    model, tokenizer = make_tiny_model(kind, seed=0)
    state = PromptCache.new(model)
    generate(model, tokenizer, "Good morning! How are you?", state=state, config=CONFIG)
    held, offset = list(state.tokens), cache_offset(state.cache)
    layers = list(state.cache)
    prompt = held[:3] + [bad]  # shares a prefix: trimming to it first would lose the cache
    with pytest.raises(TokenIdError) as e:
        generate(model, tokenizer, prompt, state=state, config=CONFIG)
    msg = str(e.value)
    assert "\n" not in msg and f"token id {bad} " in msg and f"0 to {VOCAB_SIZE - 1}" in msg
    assert state.tokens == held and cache_offset(state.cache) == offset
    assert all(a is b for a, b in zip(layers, state.cache))
    # the cache still serves: its next turn reuses all of it
    again = list(generate_step(held + [5], model, state=state, config=CONFIG))
    assert again and state.tokens[: len(held)] == held


def test_every_model_call_checks_ids(llama_model):
    model, _ = llama_model
    cache = make_prompt_cache(model)
    for tokens in ([1, VOCAB_SIZE], mx.array([[1, VOCAB_SIZE]], dtype=mx.uint32), mx.array([[-3]], dtype=mx.int32)):
        with pytest.raises(TokenIdError, match=r"ids go from 0 to 383"):
            call_model(model, tokens, cache)
        assert cache_offset(cache) == 0  # refused before the model ran
    call_model(model, [0, VOCAB_SIZE - 1], cache)
    assert cache_offset(cache) == 2


def test_sampled_ids_are_checked_until_the_logits_are_known_to_fit(make_tiny_model):
    model, _ = make_tiny_model("llama", seed=0)  # a new object: nothing recorded yet
    assert not logits_fit(model)
    with pytest.raises(TokenIdError):
        call_model(model, mx.array([[VOCAB_SIZE]], dtype=mx.uint32), make_prompt_cache(model), sampled=True)
    call_model(model, [1, 2], make_prompt_cache(model))  # its logits are VOCAB_SIZE wide
    assert logits_fit(model)


def test_generate_step_with_a_callers_sampler_checks_its_ids(llama_model):
    model, _ = llama_model
    state = PromptCache.new(model)
    def sampler(logprobs):
        return mx.array([VOCAB_SIZE + 7], dtype=mx.uint32)  # not an index of the logits

    with pytest.raises(TokenIdError, match=f"token id {VOCAB_SIZE + 7} "):
        list(generate_step([1, 2, 3], model, state=state, config=CONFIG, sampler=sampler))


def test_vocab_size_is_the_embedding_rows_float_or_quantized(make_tiny_model):
    model, _ = make_tiny_model("llama", seed=0)
    assert vocab_size(model) == VOCAB_SIZE
    quantized, _ = make_tiny_model("llama", seed=0)
    nn.quantize(quantized, group_size=64, bits=4)
    assert any(isinstance(m, nn.QuantizedEmbedding) for _, m in quantized.named_modules())
    assert vocab_size(quantized) == VOCAB_SIZE
    with pytest.raises(TokenIdError):
        check_token_ids(quantized, [VOCAB_SIZE])


def test_the_error_is_a_chatcacheerror():
    assert issubclass(TokenIdError, ChatCacheError)


# ------------------------------------------------------------------ the server
def _post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.base_url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    from server_process import ServerProcess

    import uvicorn  # noqa: F401
    with ServerProcess(tiny_model_dirs["llama"], tmp_path_factory.mktemp("cache"), "--max-tokens", "8") as s:
        yield s


@pytest.mark.parametrize("bad", [VOCAB_SIZE, 60000])
def test_server_answers_400_for_an_id_the_model_does_not_have_and_keeps_serving(server, bad):
    status, body = _post(server, "/completions", {"model": server.model_id, "prompt": [1, 2, bad]})
    assert status == 400, body
    err = body["error"]
    assert err["param"] == "prompt" and err["type"] == "invalid_request_error"
    assert f"token id {bad} " in err["message"] and f"0 to {VOCAB_SIZE - 1}" in err["message"]
    status, body = _post(server, "/completions", {"model": server.model_id, "prompt": [1, 2, 3], "max_tokens": 4})
    assert status == 200 and body["usage"]["prompt_tokens"] == 3
    assert server.proc.poll() is None


@pytest.mark.parametrize("path, body, param", [
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800 there"}]}, "messages[0].content"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages[0].content[0].text"),
    ("/completions", {"prompt": "a\ud800"}, "prompt"),
])  # fmt: skip
def test_server_refuses_a_lone_surrogate_naming_the_field(server, path, body, param):
    status, answer = _post(server, path, {"model": server.model_id, "max_tokens": 2, **body})
    assert status == 400, answer
    err = answer["error"]
    assert err["param"] == param and "not valid Unicode text (a lone surrogate at character" in err["message"]
    assert param in err["message"] and "\n" not in err["message"]
    status, _ = _post(server, "/completions", {"model": server.model_id, "prompt": "hello", "max_tokens": 2})
    assert status == 200
