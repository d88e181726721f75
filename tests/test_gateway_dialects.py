"""The capture gateway's other dialects, OpenAI's Responses API and Anthropic's Messages API: requests read as the
chat calls they are, and replies sent back read as the reply they were (the e2e side is in test_gateway.py)."""

from __future__ import annotations

import json

import pytest

from generators.gateway import ChatRequest, UnsupportedInput
from generators.gateway.anthropic import MessagesRequest, message_body, stream
from generators.gateway.responses import ResponsesRequest, response_body
from generators.gateway.responses import stream as responses_stream
from generators.gateway.types import _same

ADD = {"type": "function", "name": "add", "description": "Add two integers.", "strict": True,
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
REPLY = {"role": "assistant", "content": "Let me add.",
         "tool_calls": [{"id": "call_1_0_0", "type": "function",
                         "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}},
                        {"id": "call_1_0_1", "type": "function",
                         "function": {"name": "add", "arguments": json.dumps({"a": 1, "b": 1})}}]}


def test_a_reply_sent_back_as_input_items_reads_as_the_reply_it_was():
    """Text and two calls go out as a message item and two function_call items; sent back (as an agent SDK does,
    with their outputs), they read as that one assistant message, then one tool message per call."""
    request = ResponsesRequest(input="What is 2 + 3?", instructions="Use the tools.", tools=[ADD])
    out = response_body(REPLY, truncated=False, prompt_tokens=10, completion_tokens=5, model="policy",
                        request=request)
    assert [item["type"] for item in out["output"]] == ["message", "function_call", "function_call"]
    assert out["status"] == "completed" and out["usage"]["total_tokens"] == 15
    items = [{"role": "user", "content": "What is 2 + 3?"}, *out["output"],
             {"type": "function_call_output", "call_id": "call_1_0_0", "output": "5"},
             {"type": "function_call_output", "call_id": "call_1_0_1", "output": "2"}]
    body = ResponsesRequest(input=items, instructions="Use the tools.", tools=[ADD], max_output_tokens=9).chat_body([])
    chat = ChatRequest.model_validate(body).chat()
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool", "tool"]
    assert _same(chat[2], REPLY)
    assert [(m["tool_call_id"], m["content"]) for m in chat[3:]] == [("call_1_0_0", "5"), ("call_1_0_1", "2")]
    assert body["max_tokens"] == 9
    assert body["tools"] == [{"type": "function", "function": {"name": "add", "parameters": ADD["parameters"],
                                                               "description": "Add two integers."}}]


def test_calls_alone_and_a_cut_reply():
    """A reply of calls only has no message item and comes back as an assistant message with no text; a reply the
    token limit cut is ``incomplete``."""
    calls_only = {**REPLY, "content": ""}
    out = response_body(calls_only, truncated=True, prompt_tokens=1, completion_tokens=1, model="policy",
                        request=ResponsesRequest(input="hi"))
    assert [item["type"] for item in out["output"]] == ["function_call", "function_call"]
    assert (out["status"], out["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    [message] = ChatRequest.model_validate(ResponsesRequest(input=out["output"]).chat_body([])).chat()
    assert _same(message, calls_only)


def test_a_chained_call_continues_the_chat_under_its_own_instructions_and_the_unservable_is_refused():
    """By previous_response_id: the earlier chat, without the earlier call's instructions (each call's apply to it
    alone, as the Agents SDK resends them), then the new input."""
    first = ResponsesRequest(input="hi", instructions="Be brief.")
    body = first.chat_body([])
    earlier = first.history(body["messages"], {"role": "assistant", "content": "hello"})
    assert earlier == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    second = ResponsesRequest(input=[{"role": "user", "content": [{"type": "input_text", "text": "more"}]}],
                              instructions="Be brief.").chat_body(earlier)
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][1:3] == earlier
    for request, words in [(ResponsesRequest(input="hi", tools=[{"type": "web_search"}]), "web_search"),
                           (ResponsesRequest(input=[{"type": "computer_call"}]), "computer_call")]:
        with pytest.raises(UnsupportedInput, match=words):
            request.chat_body([])


@pytest.mark.parametrize("truncated", [False, True])
async def test_the_openai_sdk_rebuilds_a_streamed_response_as_the_json_one(truncated):
    """The events of a streamed call, fed to the openai SDK's own stream accumulator (what ``responses.stream()``
    uses), rebuild the Response the JSON call gets: text, two calls, status."""
    from openai import omit
    from openai._models import construct_type
    from openai.lib.streaming.responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    request = ResponsesRequest(input="What is 2 + 3?", tools=[ADD], stream=True)
    out = response_body(REPLY, truncated=truncated, prompt_tokens=10, completion_tokens=5, model="policy",
                        request=request)
    state: ResponseStreamState = ResponseStreamState(input_tools=[], text_format=omit)
    events = []
    async for chunk in responses_stream(out):
        kind, data = chunk.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == ("response.incomplete" if truncated else "response.completed")
    assert events[-1]["response"] == out
    # the SDK keeps a completed stream's Response apart; an incomplete one's is its running snapshot
    built = state._completed_response or state._ResponseStreamState__current_snapshot
    assert built is not None
    # (the SDK leaves an incomplete stream's item statuses as they were added)
    assert [item.model_dump(exclude_none=True, exclude={"parsed_arguments", "status"}) for item in built.output] == [
        {k: v for k, v in item.items() if v is not None and k != "status"} for item in out["output"]]
    assert built.output_text == "Let me add."


def test_an_anthropic_reply_sent_back_reads_as_the_reply_it_was():
    """Text and two tool_use blocks; sent back with tool_result blocks (and a text block after them), they read as
    one assistant message, two tool messages, then the user's text."""
    out = message_body(REPLY, finish="stop", prompt_tokens=10, completion_tokens=5, model="policy")
    assert [b["type"] for b in out["content"]] == ["text", "tool_use", "tool_use"]
    assert out["stop_reason"] == "tool_use" and out["content"][1]["input"] == {"a": 2, "b": 3}
    request = MessagesRequest(max_tokens=9, system=[{"type": "text", "text": "Use the tools."}], tools=[
        {"name": "add", "description": "Add two integers.", "input_schema": ADD["parameters"]}], messages=[
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": out["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1_0_0", "content": "5"},
                                     {"type": "tool_result", "tool_use_id": "call_1_0_1",
                                      "content": [{"type": "text", "text": "2"}]},
                                     {"type": "text", "text": "Now answer."}]}])
    body = request.chat_body()
    chat = ChatRequest.model_validate(body).chat()
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert _same(chat[2], REPLY)
    assert [m["content"] for m in chat[3:]] == ["5", "2", "Now answer."]
    assert body["tools"][0]["function"]["parameters"] == ADD["parameters"] and body["max_tokens"] == 9


async def test_an_anthropic_stream_carries_the_same_message():
    """The events of a streamed reply rebuild the JSON reply's blocks and stop reason."""
    out = message_body(REPLY, finish="stop", prompt_tokens=10, completion_tokens=5, model="policy")
    events = [json.loads(chunk.split("data: ", 1)[1]) async for chunk in stream(out)]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    blocks: list[dict] = []
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            delta = e["delta"]
            if delta["type"] == "text_delta":
                blocks[e["index"]]["text"] += delta["text"]
            else:
                blocks[e["index"]]["input"] = json.loads(delta["partial_json"])
    assert blocks == out["content"]
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == ["tool_use"]


def test_what_the_anthropic_dialect_cannot_serve_is_refused():
    for request, words in [
        (MessagesRequest(max_tokens=5, messages=[{"role": "user", "content": [{"type": "image"}]}]), "image"),
        # a hostile client's non-objects where blocks go: refused (a 400), not a crash in the gateway (a 500)
        (MessagesRequest(max_tokens=5, messages=[{"role": "user", "content": ["hi", 3]}]), "must be a block"),
        (MessagesRequest(max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": ["5"]}]}]), "only text blocks"),
        (MessagesRequest(max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": {"oops": 1}}]}]), "string or a list"),
        (MessagesRequest(max_tokens=5, messages=[{"role": "system", "content": "hi"}]), "role"),
        (MessagesRequest(max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                         tools=[{"type": "web_search_20250305", "name": "web_search"}]), "web_search"),
    ]:
        with pytest.raises(UnsupportedInput, match=words):
            request.chat_body()
