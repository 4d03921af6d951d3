"""Tool calls (server/tools.py): forced calls from a random-weight model are always one
valid call in the model's own format, parsed by mlx-lm's parser; the streaming splitter
gives the same result however the text is cut."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_chatcache.config import GenerationConfig
from mlx_chatcache.generation.constrain import Constraint
from mlx_chatcache.generation.templates import render_chat
from mlx_chatcache.generation.text import stream_generate
from mlx_chatcache.models.loading import load
from mlx_chatcache.server.tools import (
    FORCED_FAMILIES,
    ToolCallStream,
    ToolError,
    forced_choice,
    forced_call_grammar,
    split_tool_calls,
    tool_family,
)
from tiny_models import TOOL_FORMATS, build_tiny_model

import jsonschema

ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"]}}}  # fmt: skip
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_models")
    return {f: load(str(build_tiny_model("llama", root / f, tool_format=f))) for f in TOOL_FORMATS}


def forced_reply(model, tokenizer, tools, choice, seed=0, temp=1.0, max_tokens=300):
    prompt = render_chat(tokenizer, QUESTION, template_kwargs={"tools": tools})
    constraint = Constraint(tokenizer, forced_call_grammar(tokenizer, tools, choice))
    steps = list(stream_generate(model, tokenizer, prompt, config=GenerationConfig(max_tokens=max_tokens, temp=temp, seed=seed),
                                 logits_processors=[constraint]))  # fmt: skip
    return "".join(s.text for s in steps), steps[-1].finish_reason


def test_the_tiny_models_declare_their_format(tool_models):
    for family, (_, tokenizer) in tool_models.items():
        assert tool_family(tokenizer) == family


@pytest.mark.parametrize("family", FORCED_FAMILIES)
def test_a_named_function_is_called_even_by_random_weights(tool_models, family):
    model, tokenizer = tool_models[family]
    for seed in range(3):
        text, finish = forced_reply(model, tokenizer, [ADD], "add", seed=seed)
        assert finish == "stop", text
        content, calls = split_tool_calls(tokenizer, [ADD], text)
        assert content is None and len(calls) == 1, text
        call = calls[0]
        assert call["type"] == "function" and call["function"]["name"] == "add"
        # a format that numbers its calls (kimi_k2) keeps its own id, so the template writes it back
        assert call["id"] == "functions.add:0" if family == "kimi_k2" else call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), ADD["function"]["parameters"])


@pytest.mark.blas  # two greedy runs compared
def test_greedy_forced_calls_are_deterministic(tool_models):
    model, tokenizer = tool_models["json_tools"]
    assert forced_reply(model, tokenizer, [ADD], "add", temp=0.0) == forced_reply(model, tokenizer, [ADD], "add", temp=0.0)


_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=6)
_params = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda hi: {"type": "integer", "minimum": 0, "maximum": hi}, st.integers(0, 500)),
    st.just({"type": "boolean"}),
    st.builds(lambda vals: {"type": "string", "enum": vals}, st.lists(_names, min_size=1, max_size=3, unique=True)),
)


@st.composite
def tool_sets(draw):
    names = draw(st.lists(_names, min_size=1, max_size=3, unique=True))
    tools = []
    for name in names:
        props = draw(st.dictionaries(_names, _params, min_size=0, max_size=3))
        tools.append({"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": props, "required": sorted(props)}}})  # fmt: skip
    return tools


@settings(max_examples=36, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tools=tool_sets(), family=st.sampled_from(FORCED_FAMILIES), seed=st.integers(0, 2**16),
       named=st.booleans())  # fmt: skip
def test_required_gives_exactly_one_valid_call(tool_models, tools, family, seed, named):
    model, tokenizer = tool_models[family]
    names = [t["function"]["name"] for t in tools]
    choice = names[seed % len(names)] if named else "required"
    text, finish = forced_reply(model, tokenizer, tools, choice, seed=seed)
    assert finish == "stop", text
    content, calls = split_tool_calls(tokenizer, tools, text)
    assert content is None and len(calls) == 1, text
    fn = calls[0]["function"]
    assert fn["name"] in names and (not named or fn["name"] == choice)
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == fn["name"])
    jsonschema.validate(json.loads(fn["arguments"]), schema)


def test_formats_without_a_grammar_refuse_forced_calls_by_name():
    def parse_tool_call(text, tools=None):  # a format mlx-lm may add later
        raise ValueError(text)

    parse_tool_call.__module__ = "mlx_lm.tool_parsers.later_format"
    tokenizer = SimpleNamespace(tool_parser=parse_tool_call, tool_call_start="<call>", tool_call_end="</call>")
    assert tool_family(tokenizer) == "later_format" and "later_format" not in FORCED_FAMILIES
    with pytest.raises(ToolError) as e:
        forced_call_grammar(tokenizer, [ADD], "required")
    assert e.value.param == "tool_choice" and "later_format" in str(e.value) and "auto" in str(e.value)


@pytest.mark.parametrize(("family", "tool", "what"), [
    ("function_gemma", {"name": "add-one", "parameters": {"type": "object", "properties": {}}}, "add-one"),
    ("gemma4", {"name": "f", "parameters": {"type": "object", "properties": {"xs": {"type": "array"}},
                                            "required": ["xs"]}}, "xs"),
    ("kimi_k2", {"name": "a:1", "parameters": {"type": "object", "properties": {}}}, "a:1"),
    ("minimax_m2", {"name": "f", "parameters": {"type": "object", "properties": {"s": {"type": "string",
                    "enum": ["null", "NULL"]}}, "required": ["s"]}}, "null"),
])  # fmt: skip
def test_what_a_format_cannot_write_is_refused_by_name(tool_models, family, tool, what):
    _, tokenizer = tool_models[family]
    with pytest.raises(ToolError) as e:
        forced_call_grammar(tokenizer, [{"type": "function", "function": tool}], "required")
    assert e.value.param == "tool_choice" and what in str(e.value) and "auto" in str(e.value)


def test_a_tokenizer_without_a_format_refuses_tools(llama_model):
    _, tokenizer = llama_model
    with pytest.raises(ToolError) as e:
        forced_call_grammar(tokenizer, [ADD], "add")
    assert e.value.param == "tools"


def test_forced_choice():
    assert forced_choice(None) is None and forced_choice("auto") is None and forced_choice("none") is None
    assert forced_choice("required") == "required"
    assert forced_choice({"type": "function", "function": {"name": "add"}}) == "add"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, 200), max_size=12), family=st.sampled_from(FORCED_FAMILIES),
       before=st.sampled_from(["", "Let me add. ", "<tool"]), after=st.sampled_from(["", " done"]))  # fmt: skip
def test_streamed_splitting_equals_whole(tool_models, cuts, family, before, after):
    _, tokenizer = tool_models[family]
    call = {"json_tools": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
            "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]',
            "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n"
                           "</parameter>\n</function>\n</tool_call>",
            "pythonic": "<|tool_call_start|>[add(a=2, b=3)]<|tool_call_end|>",
            "glm47": "<tool_call>add<arg_key>a</arg_key><arg_value>2</arg_value><arg_key>b</arg_key>"
                     "<arg_value>3</arg_value></tool_call>",
            "minimax_m2": '<minimax:tool_call><invoke name="add"><parameter name="a">2</parameter>'
                          '<parameter name="b">3</parameter></invoke></minimax:tool_call>',
            "function_gemma": "<start_function_call>call:add{a:2,b:3}<end_function_call>",
            "gemma4": "<|tool_call>call:add{a:2,b:3}<tool_call|>",
            "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
                       '{"a": 2, "b": 3}<|tool_call_end|><|tool_calls_section_end|>',
            "longcat": "<longcat_tool_call>add<longcat_arg_key>a</longcat_arg_key><longcat_arg_value>2"
                       "</longcat_arg_value><longcat_arg_key>b</longcat_arg_key><longcat_arg_value>3"
                       "</longcat_arg_value></longcat_tool_call>",
            "minicpm5": '<function name="add"><param name="a">2</param><param name="b">3</param></function>',
            "muse_spark": '<atem:function_calls><atem:invoke name="add"><atem:parameter name="a">2</atem:parameter>'
                          '<atem:parameter name="b">3</atem:parameter></atem:invoke></atem:function_calls>',
            "kimi_k3": '<|open|>tools<|sep|><|open|>call tool="add"<|sep|><|open|>json type="object"<|sep|>'
                       '{"a": 2, "b": 3}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>',
            }[family]  # fmt: skip
    text = before + call + ("" if family == "mistral" else after)
    stream, content, calls = ToolCallStream(tokenizer, [ADD]), "", []
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in zip(points, points[1:]):
        c, k = stream.feed(text[a:b])
        content, calls = content + c, calls + k
        assert tokenizer.tool_call_start not in content
    c, k = stream.finish()
    content, calls = content + c, calls + k
    assert content == before + ("" if family == "mistral" else after)
    assert len(calls) == 1 and calls[0]["index"] == 0
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}


def test_an_unreadable_or_unclosed_call_stays_in_the_content(tool_models):
    _, tokenizer = tool_models["json_tools"]
    for text in ["a <tool_call>{not json</tool_call> b", "a <tool_call>{\"name\": \"add\""]:
        content, calls = split_tool_calls(tokenizer, [ADD], text)
        assert content == text and calls == []
