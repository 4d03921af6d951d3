"""The agents' replies as blocks and events, from streamed text: reasoning (a template's think markers),
text and tool calls, split wherever the pieces fall; the Messages API's block indices and the Responses
API's output items and sequence numbers. No model: a tokenizer stand-in declares the markers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mlx_chatcache.server.messages_api import MessageReply
from mlx_chatcache.server.messages_protocol import MessagesCall
from mlx_chatcache.server.protocol import Request
from mlx_chatcache.server.reply_parts import ThinkSplit
from mlx_chatcache.server.responses_api import ResponseReply
from mlx_chatcache.server.responses_protocol import ResponsesCall
from mlx_chatcache.server.service import Prepared


REPLY = '<think>I should add.</think>Let me call it.<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def service(prompt_text: str = "<|im_start|>assistant\n"):
    tok = SimpleNamespace(has_thinking=True, think_start="<think>", think_end="</think>", tool_call_start="<tool_call>",
                          tool_call_end="</tool_call>", tool_parser=lambda body, tools: json.loads(body),
                          decode=lambda ids: prompt_text)  # fmt: skip
    return SimpleNamespace(tokenizer=tok, model_id="m", uses_tools=lambda req: bool(req.tools))


def started():
    return SimpleNamespace(prepared=Prepared([1, 2, 3]), job=None, events=None)


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(REPLY)])
def test_message_blocks_and_indices(size):
    reply = MessageReply(service(), Request("chat", None, tools=TOOLS), MessagesCall(), started())
    events = []
    for piece in pieces(REPLY, size):
        events += reply.take(reply.parts.feed(piece))
    events += reply.finish()
    data = [json.loads(e.split("\ndata: ")[1]) for e in events]
    assert [b["type"] for b in reply.blocks] == ["thinking", "text", "tool_use"]
    assert reply.blocks[0]["thinking"] == "I should add." and reply.blocks[1]["text"] == "Let me call it."
    assert reply.blocks[2]["name"] == "add" and reply.blocks[2]["input"] == {"a": 2}
    starts = [(d["index"], d["content_block"]["type"]) for d in data if d["type"] == "content_block_start"]
    stops = [d["index"] for d in data if d["type"] == "content_block_stop"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")] and stops == [0, 1, 2]
    deltas = {d["index"]: d["delta"]["type"] for d in data if d["type"] == "content_block_delta"}
    assert deltas == {0: "thinking_delta", 1: "text_delta", 2: "input_json_delta"}
    for i in range(3):  # every delta of a block sits between its start and its stop
        where = [k for k, d in enumerate(data) if d.get("index") == i]
        assert data[where[0]]["type"] == "content_block_start" and data[where[-1]]["type"] == "content_block_stop"
    assert reply.stop_reason({"finish_reason": "stop", "choices": [{}]}) == ("tool_use", None)


def test_a_prompt_that_opens_the_reasoning_starts_inside_it():
    reply = MessageReply(service("...<|im_start|>assistant\n<think>\n"), Request("chat", None), MessagesCall(), started())
    for piece in pieces("plan</think>answer", 3):
        reply.take(reply.parts.feed(piece))
    reply.finish()
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in reply.blocks] == [("thinking", "plan"),
                                                                                    ("text", "answer")]  # fmt: skip


@pytest.mark.parametrize("size", [1, 4, len(REPLY)])
def test_response_items_and_sequence(size):
    call = ResponsesCall()
    reply = ResponseReply(service(), Request("chat", None, tools=TOOLS), call, started(), [])
    events = []
    for piece in pieces(REPLY, size):
        events += reply.take(reply.parts.feed(piece))
    events += reply.finish()
    data = [json.loads(e.split("\ndata: ")[1]) for e in events]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [i["type"] for i in reply.items] == ["reasoning", "message", "function_call"]
    assert reply.items[1]["content"][0]["text"] == "Let me call it." and reply.items[1]["status"] == "completed"
    assert reply.items[2]["id"].startswith("fc_") and json.loads(reply.items[2]["arguments"]) == {"a": 2}
    added = [(d["output_index"], d["item"]["type"]) for d in data if d["type"] == "response.output_item.added"]
    done = [d["output_index"] for d in data if d["type"] == "response.output_item.done"]
    assert added == [(0, "reasoning"), (1, "message"), (2, "function_call")] and done == [0, 1, 2]
    kinds = [d["type"] for d in data]
    assert kinds.index("response.content_part.added") < kinds.index("response.output_text.delta") < \
        kinds.index("response.output_text.done") < kinds.index("response.content_part.done")  # fmt: skip
    done_obj = reply.response({"finish_reason": "length", "prompt_tokens": 10, "completion_tokens": 5,
                               "cached_tokens": 4})  # fmt: skip
    assert done_obj["status"] == "completed"  # a call ends the turn, whatever stopped the tokens
    assert done_obj["usage"]["input_tokens_details"]["cached_tokens"] == 4


def test_think_split_holds_back_a_partial_marker():
    split = ThinkSplit("<think>", "</think>")
    assert split.feed("a<th") == [(False, "a")]
    assert split.feed("ink>b</thi") == [(True, "b")]
    assert split.feed("nk>c") == [(False, "c")]
    assert split.feed("<thin") == [] and split.finish() == [(False, "<thin")]


def test_tool_results_as_blocks_errors_and_their_breakpoints_are_read():
    """A ``tool_result`` whose content is text blocks is one tool message (``is_error``
    said in it), and ``cache_control`` on one of those blocks is the request's breakpoint:
    the messages up to that turn are the ones kept."""
    from mlx_chatcache.server.messages_protocol import parse_messages

    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": [
        {"type": "text", "text": "no such "}, {"type": "text", "text": "dir", "cache_control": {"type": "ephemeral"}}]}]}
    body = {"model": "m", "max_tokens": 4, "system": "sys",
            "messages": [{"role": "user", "content": "list"}, call, result, {"role": "user", "content": "and now?"}]}
    req, parsed = parse_messages(body)
    tool = req.messages[3]
    assert tool == {"role": "tool", "tool_call_id": "t1", "content": "Error: no such dir"}
    assert parsed.breakpoint == 4 and req.mark_messages == req.messages[:4]  # system, user, call, result
    del result["content"][0]["content"][1]["cache_control"]
    assert parse_messages(body)[1].breakpoint is None
