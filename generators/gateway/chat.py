"""OpenAI's chat completions API (``POST /v1/chat/completions``, JSON or streamed): the gateway's own request form,
which every other dialect is read into (:class:`~generators.gateway.types.ChatRequest`), and the dialect that speaks
it."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from envkit import Message
from generators.gateway.dialect import Call, no_retry, parse
from generators.gateway.types import MAX_STOPS as MAX_STOPS  # these two had their home here: still importable
from generators.gateway.types import ROLES as ROLES
from generators.gateway.types import ChatRequest, Choice, Episode


def openai_message(message: Message) -> dict[str, Any]:
    """A sampled reply as an OpenAI assistant message."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
        out["content"] = out["content"] or None
    return out


def _finish(choice: Choice) -> str:
    if choice.message.get("tool_calls"):
        return "tool_calls"
    return "length" if choice.finish == "length" else "stop"


class ChatCompletions:
    """The chat completions dialect: ``n`` choices, ``stop``, ``stream_options.include_usage``."""

    route = "/v1/chat/completions"
    body = ChatRequest

    def read(self, body: Any, episode: Episode) -> Call:
        chat = parse(ChatRequest, body)
        return Call(chat, chat.stream)

    def answer(self, call: Call, choices: list[Choice], prompt_tokens: int, model: str,
               episode: Episode) -> dict[str, Any]:
        completion_tokens = sum(len(c.ids) for c in choices)
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": i, "message": openai_message(c.message), "logprobs": None,
                         "finish_reason": _finish(c)} for i, c in enumerate(choices)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    async def events(self, call: Call, body: dict[str, Any]) -> AsyncIterator[str]:
        """Each choice's whole message in one delta (the gateway samples a call at once), then its finish reason,
        then the usage when asked for."""
        head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
                "model": body["model"]}
        for choice in body["choices"]:
            delta: dict[str, Any] = {"role": "assistant", "content": choice["message"]["content"]}
            if "tool_calls" in choice["message"]:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]
            yield f"data: {json.dumps({**head, 'choices': [{'index': choice['index'], 'delta': delta}]})}\n\n"
            done = {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}
            yield f"data: {json.dumps({**head, 'choices': [done]})}\n\n"
        if (call.chat.stream_options or {}).get("include_usage"):
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': body['usage']})}\n\n"
        yield "data: [DONE]\n\n"

    def error(self, status: int, code: str, message: str) -> JSONResponse:
        return openai_error(status, code, message)


def openai_error(status: int, code: str, message: str) -> JSONResponse:
    """A refusal in OpenAI's error shape (chat completions and Responses share it)."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                   else "server_error", "code": code}}, status_code=status, headers=no_retry(status))
