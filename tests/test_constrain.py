"""Constrained decoding (generation/constrain.py): a random-weight model's output always
parses and validates under the schema it was constrained to."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_chatcache.config import GenerationConfig
from mlx_chatcache.errors import ChatCacheError
from mlx_chatcache.generation.constrain import (
    Constraint,
    GrammarError,
    json_schema_grammar,
    mask_logits,
    schema_from_text,
)
from mlx_chatcache.generation.text import generate, stream_generate

import jsonschema

# bounded leaf schemas: every string, number and array has a bound, so a reply always ends
_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
_leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 10)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),  # fmt: skip
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda vals: {"enum": vals}, st.lists(_names, min_size=1, max_size=4, unique=True)),
    st.builds(lambda n: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": n},
              st.integers(0, 3)),  # fmt: skip
)


@st.composite
def bounded_schemas(draw):
    props = draw(st.dictionaries(_names, _leaf, min_size=1, max_size=4))
    required = draw(st.lists(st.sampled_from(sorted(props)), unique=True))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=bounded_schemas(), temp=st.sampled_from([0.0, 1.0, 2.0]), seed=st.integers(0, 2**16))
def test_random_model_output_always_validates(llama_model, schema, temp, seed):
    model, tokenizer = llama_model
    config = GenerationConfig(max_tokens=400, temp=temp, seed=seed)
    steps = list(stream_generate(model, tokenizer, "Reply in JSON.", config=config, json_schema=schema))
    text = "".join(s.text for s in steps)
    assert steps[-1].finish_reason == "stop", text
    value = json.loads(text)
    jsonschema.validate(value, schema)
    assert text == text.strip()


@pytest.mark.parametrize("schema, kind", [({}, object), ({"type": "object"}, dict)])
def test_unbounded_schemas_parse_whenever_the_grammar_ends(llama_model, schema, kind):
    """Unbounded strings may run to max_tokens ("length", cut); every reply that ends parses."""
    model, tokenizer = llama_model
    ended = 0
    for seed in range(8):
        config = GenerationConfig(max_tokens=200, temp=1.0, seed=seed)
        steps = list(stream_generate(model, tokenizer, "Hello", config=config, json_schema=schema))
        text = "".join(s.text for s in steps)
        if steps[-1].finish_reason == "stop":
            assert isinstance(json.loads(text), kind), text
            ended += 1
        else:
            assert len(steps) == 200
    assert ended >= 1


def test_without_a_schema_the_random_model_writes_no_json(llama_model):
    model, tokenizer = llama_model
    text = generate(model, tokenizer, "Reply in JSON.", max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize("schema", [
    {"type": "strin"},
    {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
    {"type": "integer", "minimum": 5, "maximum": 1},
])  # fmt: skip
def test_a_refused_schema_is_one_line(llama_model, schema):
    model, tokenizer = llama_model
    with pytest.raises(GrammarError) as e:
        generate(model, tokenizer, "x", max_tokens=5, json_schema=schema)
    assert "\n" not in str(e.value) and str(e.value).startswith("the JSON schema")


def test_schema_from_text_names_its_source():
    with pytest.raises(GrammarError, match="s.json is not JSON"):
        schema_from_text("{not json", "s.json")
    with pytest.raises(GrammarError, match="must be an object"):
        json_schema_grammar([1, 2])
    assert schema_from_text('{"type": "object"}', "s.json") == {"type": "object"}


def test_mask_logits_keeps_exactly_the_set_bits():
    rng = np.random.default_rng(0)
    for V in (5, 32, 33, 100):
        bits = rng.integers(0, 2, size=V + 7).astype(bool)  # more bits than ids: the extra ones are ignored
        packed = np.packbits(np.concatenate([bits, np.zeros(-len(bits) % 32, bool)]), bitorder="little").tobytes()
        logits = mx.array(rng.standard_normal((1, V)).astype(np.float32))
        out = np.array(mask_logits(logits, packed))[0]
        assert np.array_equal(np.isfinite(out), bits[:V])
        assert np.array_equal(out[bits[:V]], np.array(logits)[0][bits[:V]])
    wide = mask_logits(mx.zeros((1, 70)), np.full(1, 0xFFFFFFFF, np.uint32).tobytes())  # ids past the mask
    assert np.isfinite(np.array(wide)[0]).sum() == 32


def test_eos_only_when_complete(llama_model):
    _, tokenizer = llama_model
    c = Constraint(tokenizer, json_schema_grammar({"type": "object", "properties": {"a": {"type": "boolean"}},
                                                   "required": ["a"], "additionalProperties": False}))  # fmt: skip
    eos = sorted(tokenizer.eos_token_ids)
    prompt = [5, 6]
    out = np.array(c(mx.array(prompt), mx.zeros((1, 400))))[0]
    assert not np.isfinite(out[eos]).any()
    done = tokenizer.encode('{"a":true}', add_special_tokens=False)
    out = np.array(c(mx.array(prompt + done), mx.zeros((1, 400))))[0]
    assert np.isfinite(out[eos]).all() and np.isfinite(out).sum() == len(eos) and c.done()


def test_a_token_the_grammar_cannot_take_raises(llama_model):
    _, tokenizer = llama_model
    c = Constraint(tokenizer, json_schema_grammar({"type": "boolean"}))
    c(mx.array([5]), mx.zeros((1, 400)))
    bad = tokenizer.encode("Hello", add_special_tokens=False)
    with pytest.raises(ChatCacheError, match="not allowed by the grammar"):
        c(mx.array([5, *bad]), mx.zeros((1, 400)))


# -- mlxcc generate --json-schema ---------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip


def test_cli_json_schema_file(tiny_model_dirs, tmp_path, capsys):
    from mlx_chatcache.cli.main import main

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    for seed in (1, 2):
        code = main(["generate", "--model", str(tiny_model_dirs["llama"]), "-p", "Who?", "--temp", "1",
                     "--seed", str(seed), "-m", "200", "--json-schema", str(schema)])  # fmt: skip
        out, _ = capsys.readouterr()
        assert code == 0
        jsonschema.validate(json.loads(out), PERSON)


def test_cli_refuses_a_bad_schema_in_one_line_before_loading(tmp_path):
    from cli_helpers import mlxcc, one_error_line

    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "strin"}')
    p = mlxcc("generate", "--model", tmp_path / "no-model", "-p", "x", "--json-schema", bad)
    line = one_error_line(p)
    assert p.returncode != 0 and "--json-schema" in line and "strin" in line
    p = mlxcc("generate", "--model", tmp_path / "no-model", "-p", "x", "--json-schema", tmp_path / "missing.json")
    assert p.returncode != 0 and "--json-schema" in one_error_line(p)


@pytest.mark.real_model
def test_the_demo_model_answers_in_the_schema(demo_gguf):
    from mlx_chatcache.models.loading import load

    model, tokenizer = load(demo_gguf)
    prompt = "<|im_start|>user\nInvent a person.<|im_end|>\n<|im_start|>assistant\n"
    text = generate(model, tokenizer, prompt, max_tokens=80, json_schema=PERSON)
    jsonschema.validate(json.loads(text), PERSON)
