"""Anthropic's Messages API as the capture gateway speaks it (``POST /v1/messages``, JSON or streamed), for agents
and CLIs built on the Anthropic SDK.

A request's ``system`` and ``messages`` become chat messages: an assistant turn's ``tool_use`` blocks its tool calls,
a user turn's ``tool_result`` blocks tool messages (before the turn's text); ``tools`` (``input_schema``) become
function tools. The gateway then treats it as a chat completions call, so calls link by token prefix exactly as chat
calls do. The reply goes back as a Message: a ``text`` block, a ``tool_use`` block per call, ``stop_reason``
``tool_use``, ``max_tokens``, ``stop_sequence`` (with the one that matched, where the engine says which: vLLM and
SGLang do) or ``end_turn``. The key comes in ``x-api-key`` (or as a bearer token).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from envkit import Message
from generators.gateway.dialect import Call, event, function_tool, no_retry, parse
from generators.gateway.types import ChatRequest, Choice, Episode, UnsupportedInput

_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
           409: "invalid_request_error", 429: "rate_limit_error"}


class MessagesRequest(BaseModel):
    """The part of a Messages API request the gateway reads (other fields are accepted and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False

    def chat_body(self) -> dict[str, Any]:
        """The equivalent chat completions request body."""
        system = _joined(self.system, "system") if self.system else None
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        for i, message in enumerate(self.messages):
            messages += _chat(message, i)
        body: dict[str, Any] = {"messages": messages, "max_tokens": self.max_tokens}
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        return body


def _joined(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UnsupportedInput(f"{where} must be a string or a list of text blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise UnsupportedInput(f"{where}[{j}]: only text blocks reach the policy, got {kind!r}")
    return "".join(str(b.get("text", "")) for b in content)


def _chat(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """One Messages API turn as chat messages."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise UnsupportedInput(f"messages[{i}].role must be user or assistant, got {role!r}")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise UnsupportedInput(f"messages[{i}].content must be a string or a list of blocks")
    texts, calls, results = _blocks(content, role, i)
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(texts) or None, **({"tool_calls": calls} if calls else {})}]
    return [*results, *([{"role": "user", "content": "".join(texts)}] if texts or not results else [])]


def _blocks(content: list[Any], role: str, i: int) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """Turn ``i``'s content blocks, read: their texts, the tool calls of its ``tool_use`` blocks (an assistant's) and
    the tool messages of its ``tool_result`` blocks (a user's)."""
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise UnsupportedInput(f"messages[{i}].content[{j}] must be a block (an object), got {block!r:.40}")
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": str(block.get("name", "")),
                                       "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            output = block.get("content")
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _joined(output or "", f"messages[{i}].content[{j}].content")})
        elif kind not in ("thinking", "redacted_thinking"):  # the policy writes no thinking blocks; echoes are harmless
            raise UnsupportedInput(f"messages[{i}].content[{j}]: a {role} turn's {kind!r} block is not served")
    return texts, calls, results


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if not tool.get("name") or tool.get("type") not in (None, "custom"):
        raise UnsupportedInput(f"tools[{i}]: only client tools (name, input_schema) reach the policy, got "
                               f"{tool.get('type') or tool.get('name')!r}")
    return function_tool(tool["name"], tool.get("description"), tool.get("input_schema"))


def message_body(message: Message, *, finish: str, prompt_tokens: int, completion_tokens: int, model: str,
                 stop_sequence: str | None = None) -> dict[str, Any]:
    """The Message for one sampled reply."""
    content: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in message.get("tool_calls") or []]
    if message.get("tool_calls"):
        stop, stop_sequence = "tool_use", None
    elif finish == "length":
        stop, stop_sequence = "max_tokens", None
    else:
        stop = "stop_sequence" if stop_sequence else "end_turn"
    return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}}


async def stream(body: dict[str, Any]) -> AsyncIterator[str]:
    """The Message as server-sent events: each block whole in one delta (the gateway samples a call at once)."""
    usage = body["usage"]
    yield event("message_start", {"message": {**body, "content": [], "stop_reason": None,
                                              "usage": {**usage, "output_tokens": 0}}})
    for index, block in enumerate(body["content"]):
        if block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield event("content_block_start", {"index": index, "content_block": start})
        yield event("content_block_delta", {"index": index, "delta": delta})
        yield event("content_block_stop", {"index": index})
    yield event("message_delta", {"delta": {"stop_reason": body["stop_reason"],
                                            "stop_sequence": body["stop_sequence"]},
                                  "usage": {"output_tokens": usage["output_tokens"]}})
    yield event("message_stop", {})


class Messages:
    """Anthropic's Messages dialect: ``system``, content blocks, ``stop_sequences``; the key in ``x-api-key``."""

    route = "/v1/messages"
    body = MessagesRequest

    def read(self, body: Any, episode: Episode) -> Call:
        request = parse(MessagesRequest, body)
        return Call(parse(ChatRequest, request.chat_body()), request.stream, request)

    def answer(self, call: Call, choices: list[Choice], prompt_tokens: int, model: str,
               episode: Episode) -> dict[str, Any]:
        (choice,) = choices
        return message_body(choice.message, finish=choice.finish, stop_sequence=choice.stop_string,
                            prompt_tokens=prompt_tokens, completion_tokens=len(choice.ids), model=model)

    def events(self, call: Call, body: dict[str, Any]) -> AsyncIterator[str]:
        return stream(body)

    def error(self, status: int, code: str, message: str) -> JSONResponse:
        return JSONResponse({"type": "error", "error": {"type": _ERRORS.get(status, "api_error"),
                                                        "message": message}}, status_code=status,
                            headers=no_retry(status))
