"""OpenAI's Responses API as the capture gateway speaks it (``POST /v1/responses``, JSON or streamed).

A request's ``instructions`` and ``input`` items become chat messages (``function_call`` items the assistant's tool
calls, ``function_call_output`` items tool messages), its flat function tools chat-style ones; the gateway then
treats it as a chat completions call, so its token ids link across calls exactly as chat calls do. The reply goes
back as a Response: a ``message`` output item with the text, a ``function_call`` item per tool call, status
``incomplete`` where the token limit cut it. ``previous_response_id`` works within an episode: the gateway keeps
each episode's responses until it ends (``store`` is otherwise ignored). As in OpenAI's API, a call's
``instructions`` apply to that call alone: a call continuing another does not inherit them. A streamed call gets
the same Response as server-sent events, each output item's text or arguments whole in one delta (the gateway
samples a call at once, then parses its tool calls).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from envkit import Message
from generators.gateway.chat import openai_error, openai_message
from generators.gateway.dialect import Call, function_tool, parse
from generators.gateway.dialect import event as named_event
from generators.gateway.types import ChatRequest, Choice, Episode, GatewayError, UnsupportedInput


class ResponsesRequest(BaseModel):
    """The part of a Responses API request the gateway reads (other fields are accepted and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    previous_response_id: str | None = None

    def chat_body(self, earlier: list[dict[str, Any]]) -> dict[str, Any]:
        """The equivalent chat completions request body: the instructions, then the chat ``earlier`` (that of
        ``previous_response_id``, else empty), then the input."""
        body: dict[str, Any] = {"messages": [*self._instructions(), *earlier, *_messages(self._items())]}
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.max_output_tokens:
            body["max_tokens"] = self.max_output_tokens
        return body

    def history(self, messages: list[dict[str, Any]], reply: dict[str, Any]) -> list[dict[str, Any]]:
        """What a later call continues by ``previous_response_id``: this call's chat ``messages`` without its
        instructions, then ``reply``."""
        return [*messages[len(self._instructions()):], reply]

    def _instructions(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.instructions}] if self.instructions else []

    def _items(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive ``function_call`` items join the assistant message before them."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": item.get("content")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments") or "{}")}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str | list) else str(output)})
        elif kind != "reasoning":  # the policy writes no separate reasoning items; an agent echoing one is harmless
            raise UnsupportedInput(f"input[{i}].type {kind!r} is not served: the gateway reads message, "
                                   "function_call and function_call_output items")
    return out


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function" or not tool.get("name"):
        raise UnsupportedInput(f"tools[{i}]: only function tools reach the policy (it runs no hosted tools), got "
                               f"type {tool.get('type')!r}")
    return function_tool(tool["name"], tool.get("description"), tool.get("parameters"))


def response_body(message: Message, *, truncated: bool, prompt_tokens: int, completion_tokens: int, model: str,
                  request: ResponsesRequest) -> dict[str, Any]:
    """The Response for one sampled reply."""
    output: list[dict[str, Any]] = []
    if message.get("content") or not message.get("tool_calls"):
        output.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": "completed",
                       "role": "assistant", "content": [{"type": "output_text", "text": message.get("content") or "",
                                                         "annotations": [], "logprobs": []}]})
    output += [{"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": c["id"],
                "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
               for c in message.get("tool_calls") or []]
    return {
        "id": f"resp_{secrets.token_hex(16)}", "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if truncated else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "error": None, "model": model, "output": output, "instructions": request.instructions,
        "tools": request.tools or [], "tool_choice": "auto", "parallel_tool_calls": True,
        "previous_response_id": request.previous_response_id, "metadata": {}, "text": {"format": {"type": "text"}},
        "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt_tokens + completion_tokens},
    }


async def stream(body: dict[str, Any]) -> AsyncIterator[str]:
    """The Response ``body`` as the events a streamed call gets: created, each output item added, filled in one
    delta and done, then completed (or incomplete, where the token limit cut it)."""
    sequence = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal sequence
        sequence += 1
        return named_event(kind, {"sequence_number": sequence - 1, **data})

    started = {**body, "status": "in_progress", "incomplete_details": None, "output": []}
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    for index, item in enumerate(body["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            for part_index, part in enumerate(item["content"]):
                yield event("response.content_part.added", **at, content_index=part_index,
                            part={**part, "text": ""})
                yield event("response.output_text.delta", **at, content_index=part_index, delta=part["text"],
                            logprobs=[])
                yield event("response.output_text.done", **at, content_index=part_index, text=part["text"],
                            logprobs=[])
                yield event("response.content_part.done", **at, content_index=part_index, part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **at, name=item["name"],
                        arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)


class Responses:
    """The Responses dialect: ``previous_response_id`` within an episode, one choice per call."""

    route = "/v1/responses"
    body = ResponsesRequest

    def read(self, body: Any, episode: Episode) -> Call:
        request = parse(ResponsesRequest, body)
        earlier = episode.responses.get(request.previous_response_id or "", [])
        if request.previous_response_id and not earlier:
            raise GatewayError(400, "previous_response_not_found", f"no response {request.previous_response_id!r} "
                                                                   "in this episode")
        return Call(parse(ChatRequest, request.chat_body(earlier)), request.stream, request)

    def answer(self, call: Call, choices: list[Choice], prompt_tokens: int, model: str,
               episode: Episode) -> dict[str, Any]:
        (choice,) = choices
        out = response_body(choice.message, truncated=choice.finish == "length", prompt_tokens=prompt_tokens,
                            completion_tokens=len(choice.ids), model=model, request=call.request)
        episode.responses[out["id"]] = call.request.history(call.chat.messages, openai_message(choice.message))
        return out

    def events(self, call: Call, body: dict[str, Any]) -> AsyncIterator[str]:
        return stream(body)

    def error(self, status: int, code: str, message: str) -> JSONResponse:
        return openai_error(status, code, message)
